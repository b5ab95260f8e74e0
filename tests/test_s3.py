"""Object storage against a real S3 server (moto's, on 127.0.0.1): inputs read by URL, caches published
to a bucket (manifest last, a killed run leaves nothing openable), opened through a bounded local
cache with batches equal to a local build's, damaged objects refused by name, keys from ETag + size."""

import os
import signal
import subprocess
import sys
import textwrap
import urllib.request


import numpy as np
import pytest

s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

import portable_loader as pl  # noqa: E402
from conftest import SAMPLE  # noqa: E402
from portable_loader.errors import CacheError, InputError  # noqa: E402
from portable_loader.precache import build_cache  # noqa: E402

TOK = str(SAMPLE / "tokenizer")
ROWS = 300  # of the bundled chat sample: enough for several shards and steps, fast to tokenize


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1, the env that points fsspec at it (subprocesses inherit), a bucket."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    # moto's backends are global to the process: start empty when another module's server ran before.
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")).close()
    env = {
        "FSSPEC_S3_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec.config

    fsspec.config.set_conf_env(fsspec.config.conf)  # the env var is read at import: read it again
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    fs.mkdir("bkt")
    with open(SAMPLE / "sample_chat.jsonl", "rb") as f:
        data = b"".join(line for line, _ in zip(f, range(ROWS)))
    fs.pipe_file("bkt/in/chat.jsonl", data)
    yield fs, data
    server.stop()
    for k, v in saved.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    fsspec.config.conf.pop("s3", None)
    s3fs.S3FileSystem.clear_instance_cache()


def build(input, out, **kw):
    return build_cache(input, tokenizer=TOK, format="chat", out=out, max_length=128, num_workers=2, **kw)


def batches(src, steps=6, state=None, **kw):
    it = iter(pl.DataLoader(src, global_batch_size=4, seq_len=64, seed=5, prefetch=0, **kw))
    if state is not None:
        it.set_state(state)
    return [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(steps)], it


def records(src):
    return [(r["input_ids"].tolist(), r["loss_mask"].tolist()) for r in src.__getitems__(range(len(src)))]


@pytest.fixture(scope="module")
def published(s3, tmp_path_factory):
    """The sample cached from the bucket into the bucket, and the same rows cached locally."""
    fs, data = s3
    local_in = tmp_path_factory.mktemp("in") / "chat.jsonl"
    local_in.write_bytes(data)
    url, summary = build("s3://bkt/in/chat.jsonl", "s3://bkt/caches")
    local, _ = build(local_in, tmp_path_factory.mktemp("local"))
    return url, summary, local


@pytest.mark.slow
def test_remote_cache_reads_like_a_local_one(published, tmp_path):
    url, summary, local = published
    assert url.startswith("s3://bkt/caches/chat-") and not summary["hit"]
    src = pl.open_cache(url, cache_dir=tmp_path, cache_limit="1GB")
    ref = pl.open_cache(local)
    assert records(src) == records(ref) and len(src) == summary["rows_out"]
    got, _ = batches(src)
    want, _ = batches(ref)
    for a, b in zip(got, want):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    with_workers, it = batches(src, num_workers=2)  # worker processes read the local copy too
    it.close()
    for a, b in zip(with_workers, want):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    # Exact resume: a state taken after 3 steps, on a fresh remote open, gives steps 4-6.
    _, it = batches(src, steps=3)
    resumed, _ = batches(pl.open_cache(url, cache_dir=tmp_path), steps=3, state=it.get_state())
    for a, b in zip(resumed, got[3:]):
        assert all(np.array_equal(a[k], b[k]) for k in a)


def test_bytes_downloaded_per_open(published, tmp_path, s3):
    fs, _ = s3
    url = published[0]
    shard_bytes = sum(fs.info(p)["size"] for p in fs.ls(url) if p.endswith(".arrow"))
    first = pl.open_cache(url, cache_dir=tmp_path)
    assert first.remote["bytes_downloaded"] == 0  # the manifest only: shards come when read
    records(first)
    assert first.remote["bytes_downloaded"] == shard_bytes > 0
    again = pl.open_cache(url, cache_dir=tmp_path)
    records(again)
    assert again.remote["bytes_downloaded"] == 0


def test_rerun_is_a_hit_without_reading_the_input(published, s3):
    fs, _ = s3
    url = published[0]
    before = {p: fs.info(p)["LastModified"] for p in fs.find(url)}
    import portable_loader.io.tables as tables

    real, calls = tables._open_bytes, []
    tables._open_bytes = lambda *a: calls.append(a) or real(*a)
    try:
        again, summary = build("s3://bkt/in/chat.jsonl", "s3://bkt/caches")
    finally:
        tables._open_bytes = real
    assert summary["hit"] and again == url and calls == []
    fs.invalidate_cache()
    assert {p: fs.info(p)["LastModified"] for p in fs.find(url)} == before


def test_overwritten_input_gets_a_new_key(s3, published):
    fs, data = s3
    fs.pipe_file("bkt/in/changed.jsonl", data)
    first, _ = build("s3://bkt/in/changed.jsonl", "s3://bkt/caches2")
    lines = data.splitlines(keepends=True)
    fs.pipe_file("bkt/in/changed.jsonl", b"".join(lines[:-1]))  # same name, other bytes
    fs.invalidate_cache()
    second, summary = build("s3://bkt/in/changed.jsonl", "s3://bkt/caches2")
    assert second != first and not summary["hit"] and summary["rows_in"] == ROWS - 1


def test_damaged_remote_cache_is_refused_by_name(s3, published, tmp_path):
    fs, _ = s3
    url = published[0]
    copy = "s3://bkt/damaged/" + url.rsplit("/", 1)[-1]
    fs.copy(url, copy, recursive=True)
    shard = sorted(p for p in fs.ls(copy) if p.endswith(".arrow"))[0]
    raw = bytearray(fs.cat_file(shard))
    raw[len(raw) // 2] ^= 0xFF
    fs.pipe_file(shard, bytes(raw))
    with pytest.raises(CacheError, match=f"s3://{shard}: sha256 differs"):
        records(pl.open_cache(copy, cache_dir=tmp_path))
    fs.pipe_file(shard, bytes(raw[:-10]))
    with pytest.raises(CacheError, match=f"s3://{shard}: .*bytes, the manifest says"):
        records(pl.open_cache(copy, cache_dir=tmp_path))
    assert not [n for n in os.listdir(tmp_path / os.listdir(tmp_path)[0]) if n.endswith(".arrow")]
    fs.rm(copy + "/manifest.json")
    with pytest.raises(CacheError, match="manifest.json: missing"):
        pl.open_cache(copy, cache_dir=tmp_path)


def test_cache_limit_smaller_than_a_shard_is_refused(s3, published, tmp_path):
    fs, _ = s3
    url = published[0]
    largest = max(fs.info(p)["size"] for p in fs.ls(url) if p.endswith(".arrow"))
    with pytest.raises(CacheError, match=f"largest shard holds {largest} bytes, more than cache_limit"):
        pl.open_cache(url, cache_dir=tmp_path, cache_limit=largest - 1)


def test_missing_input_and_backend_are_named(s3):
    with pytest.raises(InputError, match="s3://bkt/in/nothing.jsonl: no such object"):
        build("s3://bkt/in/nothing.jsonl", "s3://bkt/caches")
    with pytest.raises(InputError, match="nope://"):
        pl.open_cache("nope://x/y")


KILLED = textwrap.dedent("""
    import sys, portable_loader.cache.remote as r
    real = r.filesystem
    def slow(url, so=None):
        fs, path = real(url, so)
        put = fs.put_file
        def put_then_wait(lpath, rpath, **kw):
            put(lpath, rpath, **kw)
            print("PUT", rpath, flush=True)
            if rpath.endswith(".arrow"):
                import time; time.sleep(60)
        fs.put_file = put_then_wait
        return fs, path
    r.filesystem = slow
    from portable_loader.precache import build_cache
    build_cache(sys.argv[1], tokenizer=sys.argv[2], format="chat", out=sys.argv[3], max_length=128, num_workers=1)
""")


@pytest.mark.slow
def test_killed_upload_leaves_nothing_openable_and_the_rerun_publishes(s3, tmp_path):
    fs, _ = s3
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED, "s3://bkt/in/chat.jsonl", TOK, "s3://bkt/killed"],
        stdout=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()  # the first shard is up; the manifest is not
    assert line.startswith("PUT") and line.strip().endswith(".arrow"), line
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    fs.invalidate_cache()
    (cache,) = fs.ls("bkt/killed")
    assert not fs.exists(cache + "/manifest.json")
    with pytest.raises(CacheError, match="manifest.json: missing"):
        pl.open_cache("s3://" + cache, cache_dir=tmp_path)
    url, summary = build("s3://bkt/in/chat.jsonl", "s3://bkt/killed")
    assert url == "s3://" + cache and not summary["hit"]
    assert len(pl.open_cache(url, cache_dir=tmp_path)) == summary["rows_out"]


def test_storage_options_reach_the_store(s3, published, tmp_path):
    """With fsspec's env config set aside, ``storage_options`` alone point inputs, out and reads at the server."""
    import fsspec.config

    url = published[0]
    saved = fsspec.config.conf.pop("s3")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        so = {"endpoint_url": saved["endpoint_url"]}
        again, summary = build("s3://bkt/in/chat.jsonl", "s3://bkt/caches", storage_options=so)
        assert summary["hit"] and again == url
        src = pl.open_cache(url, cache_dir=tmp_path, storage_options=so)
        assert len(records(src)) == summary["rows_out"] and src.remote["bytes_downloaded"] > 0
    finally:
        fsspec.config.conf["s3"] = saved
        s3fs.S3FileSystem.clear_instance_cache()


def test_prefix_glob_parquet_and_gzip_inputs_read_like_local_files(s3, tmp_path):
    """Objects listed by prefix and glob, in path order, read as the same rows as local copies."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from portable_loader.io import open_inputs

    fs, data = s3
    lines = data.splitlines(keepends=True)
    pq.write_table(pa.Table.from_pylist([{"text": f"row {i}"} for i in range(50)]), tmp_path / "b.parquet", row_group_size=16)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(b"".join(lines[:20])))
    (tmp_path / "c.jsonl").write_bytes(b"".join(lines[20:30]))
    for name in ("a.jsonl.gz", "b.parquet", "c.jsonl"):
        fs.put_file(str(tmp_path / name), f"bkt/mixed/{name}")
    fs.pipe_file("bkt/mixed/_SUCCESS", b"")
    local = [str(tmp_path / n) for n in ("a.jsonl.gz", "b.parquet", "c.jsonl")]
    # Different columns across formats are refused the same way locally and remotely: compare per file.
    for spec, ref in (("s3://bkt/mixed/a.jsonl.gz", local[0]), ("s3://bkt/mixed/*.parquet", local[1])):
        got, want = open_inputs(spec), open_inputs(ref)
        assert len(got) == len(want) and list(got.read(0, len(got))) == list(want.read(0, len(want)))
        assert got.get([3, 1]) == want.get([3, 1])
    assert [f.rsplit("/", 1)[-1] for f in pl.io.list_files("s3://bkt/mixed/")] == ["a.jsonl.gz", "b.parquet", "c.jsonl"]
    with pytest.raises(InputError, match="columns differ"):
        len(open_inputs("s3://bkt/mixed/"))


def test_two_concurrent_opens_of_one_cache_agree(published, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    url, _, local = published
    with ThreadPoolExecutor(2) as pool:
        srcs = list(pool.map(lambda _: pl.open_cache(url, cache_dir=tmp_path), range(2)))
    assert records(srcs[0]) == records(srcs[1]) == records(pl.open_cache(local))
    assert not [n for n in os.listdir(srcs[0].remote["local"]) if ".tmp-" in n]


@pytest.mark.slow
def test_array_record_cache_in_a_bucket(published, tmp_path):
    url, summary = build("s3://bkt/in/chat.jsonl", "s3://bkt/caches", backend="array_record")
    assert url != published[0] and not summary["hit"]
    src = pl.open_cache(url, cache_dir=tmp_path)
    assert records(src) == records(pl.open_cache(published[2]))


@pytest.mark.slow
def test_cli_takes_urls(published):
    run = subprocess.run(
        [sys.executable, "-m", "portable_loader.precache", "--input", "s3://bkt/in/chat.jsonl", "--tokenizer", TOK,
         "--format", "chat", "--out", "s3://bkt/caches", "--max-length", "128"],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "cache hit" in run.stdout and run.stdout.strip().endswith(published[0])


def test_tokenized_reads_a_url(published):
    tok = pl.tokenized("s3://bkt/in/chat.jsonl", tokenizer=TOK, format="chat", max_length=128)
    got, _ = batches(tok)
    want, _ = batches(pl.open_cache(published[2]))
    for a, b in zip(got, want):
        assert all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_pretokenized_files_by_url_serve_the_local_files_batches(s3, tmp_path):
    from test_pretokenized import write_megatron

    fs, _ = s3
    rng = np.random.default_rng(3)
    docs = [rng.integers(1, 3000, rng.integers(1, 90)).tolist() for _ in range(60)]
    prefix = write_megatron(tmp_path / "m", docs, np.uint16)
    flat = np.array([t for d in docs for t in d + [0]], dtype=np.uint32)
    np.save(tmp_path / "f.npy", flat)
    for name in ("m.bin", "m.idx", "f.npy"):
        fs.put_file(str(tmp_path / name), f"bkt/pt/{name}")
    for local, url, kw in ((prefix, "s3://bkt/pt/m", {}), (str(tmp_path / "f.npy"), "s3://bkt/pt/f.npy", {"eos_token_id": 0})):
        a, b = pl.pretokenized(local, **kw), pl.pretokenized(url, **kw)
        assert len(a) == len(b) and [r["input_ids"].tolist() for r in a] == [r["input_ids"].tolist() for r in b]
        got = [list(pl.DataLoader(ds, global_batch_size=4, seq_len=32, seed=1, packing="concat", num_epochs=1,
                                  num_workers=w)) for ds, w in ((a, 0), (b, 2))]
        assert len(got[0]) == len(got[1]) > 0
        for x, y in zip(*got):
            assert all(np.array_equal(x[k], y[k]) for k in x)
    fs.pipe_file("bkt/pt/short.bin", fs.cat_file("bkt/pt/m.bin")[:-2])
    fs.put_file(str(tmp_path / "m.idx"), "bkt/pt/short.idx")
    with pytest.raises(ValueError, match="short.bin.*does not match"):
        pl.pretokenized("s3://bkt/pt/short")


LATE_CREDENTIALS = """
import multiprocessing.forkserver, os, sys
multiprocessing.forkserver.ensure_running()   # started before the credentials exist, as in a long-lived process
os.environ.update({k[len("LATE_"):]: v for k, v in os.environ.items() if k.startswith("LATE_")})
from portable_loader.precache import build_cache
url, summary = build_cache(sys.argv[1], tokenizer=sys.argv[2], format="chat", out=sys.argv[3], max_length=128,
                           num_workers=2, rows_per_task=100)
print(summary["rows_out"])
"""


@pytest.mark.slow
def test_forkserver_precache_workers_see_the_callers_environment_as_it_is_now(s3, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_"))}
    env.update({"LATE_" + k: v for k, v in os.environ.items() if k.startswith(("AWS_", "FSSPEC_"))})
    env["PORTABLE_LOADER_START_METHOD"] = "forkserver"
    r = subprocess.run([sys.executable, "-c", LATE_CREDENTIALS, "s3://bkt/in/chat.jsonl", TOK, str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split()[-1]) > 0
