"""precache end to end: worker-count independence, both backends, cache keys, atomic publishing with
real concurrent processes and a real SIGKILL, refusing damaged caches, and the CLI's errors."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import portable_loader as pl
from conftest import DATA, GPT2, PHI3, SAMPLE, need
from portable_loader.cache import record_digest
from portable_loader.errors import BadRowError, CacheError, InputError, PortableLoaderError, TokenizerError
from portable_loader.precache import build_cache
from portable_loader.tokenize import Formatter, load_tokenizer

GSM = DATA / "alpaca" / "gsm8k_train.jsonl"
GSM_FIELDS = {"instruction": "question", "output": "answer"}


def records(src):
    return [(r["input_ids"].tolist(), r["loss_mask"].tolist()) for r in src.__getitems__(range(len(src)))]


def run_cli(*args, cwd=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "portable_loader.precache", *map(str, args)],
        capture_output=True, text=True, cwd=cwd, timeout=timeout,
    )


@pytest.fixture(scope="module")
def gsm_caches(tmp_path_factory):
    """GSM8K's first 600 rows (4 tasks of 150) cached with 1, 2 and 3 workers and with both backends."""
    need(GSM)
    base = tmp_path_factory.mktemp("gsm")
    out = {}
    for workers in (1, 2, 3):
        out[workers] = build_cache(
            GSM, tokenizer=need(GPT2), format="alpaca", out=base / f"w{workers}", fields=GSM_FIELDS,
            split="train[:600]", max_length=256, num_workers=workers, rows_per_task=150,
        )
    out["array_record"] = build_cache(
        GSM, tokenizer=need(GPT2), format="alpaca", out=base / "ar", fields=GSM_FIELDS,
        split="train[:600]", max_length=256, num_workers=2, backend="array_record",
    )
    return out


@pytest.mark.slow
def test_records_equal_the_formatter_oracle(gsm_caches):
    path, summary = gsm_caches[1]
    tok = load_tokenizer(str(GPT2))
    rows = [json.loads(line) for line, _ in zip(open(GSM), range(600))]
    expected = [r for r in Formatter("alpaca", tok, fields=GSM_FIELDS, max_length=256).encode(rows) if not isinstance(r, str)]
    got = records(pl.open_cache(path))
    assert got == [(ids.tolist(), mask.tolist()) for ids, mask in expected]
    assert summary["rows_in"] == 600 and summary["rows_out"] == len(expected)
    assert summary["rows_out"] + sum(summary["dropped"].values()) == 600


@pytest.mark.slow
def test_output_is_identical_for_any_worker_count(gsm_caches):
    base = records(pl.open_cache(gsm_caches[1][0]))
    manifests = [pl.open_cache(gsm_caches[w][0]).manifest for w in (1, 2, 3)]
    assert [gsm_caches[w][1]["num_workers"] for w in (1, 2, 3)] == [1, 2, 3]
    assert [m["counts"]["tasks"] for m in manifests] == [4, 4, 4]
    assert len({m["content_checksum"] for m in manifests}) == 1
    assert len({os.path.basename(gsm_caches[w][0]) for w in (1, 2, 3)}) == 1  # num_workers is not in the key
    # The shard files themselves, hashed here (not the manifest's word for it), are byte-identical.
    shards = [shard_digests(gsm_caches[w][0]) for w in (1, 2, 3)]
    assert len(shards[0]) == 4 and shards[0] == shards[1] == shards[2]
    for w in (2, 3):
        assert records(pl.open_cache(gsm_caches[w][0])) == base


def shard_digests(path) -> dict:
    return {f: hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(path)) if f.startswith("data-")}


@pytest.mark.slow
def test_content_checksum_is_recomputable(gsm_caches):
    src = pl.open_cache(gsm_caches[2][0])
    rows = [json.loads(line) for line, _ in zip(open(GSM), range(600))]
    # The oracle: re-derive which input row each record came from, then sum the digests.
    tok = load_tokenizer(str(GPT2))
    kept = [i for i, r in enumerate(Formatter("alpaca", tok, fields=GSM_FIELDS, max_length=256).encode(rows)) if not isinstance(r, str)]
    total = sum(record_digest(i, src[j]["input_ids"], src[j]["loss_mask"]) for j, i in enumerate(kept)) % (1 << 128)
    assert f"{total:032x}" == src.manifest["content_checksum"]


def test_array_record_backend_holds_the_same_records(gsm_caches):
    ar = pl.open_cache(gsm_caches["array_record"][0])
    assert type(ar).__name__ == "ArrayRecordCacheSource"
    assert records(ar) == records(pl.open_cache(gsm_caches[1][0]))
    assert ar.manifest["content_checksum"] == pl.open_cache(gsm_caches[1][0]).manifest["content_checksum"]
    idx = [5, 0, 17, 5]
    assert [r["input_ids"].tolist() for r in ar.__getitems__(idx)] == [ar[i]["input_ids"].tolist() for i in idx]
    assert ar.lengths(idx).tolist() == [ar[i]["input_ids"].size for i in idx]


def test_arrow_cache_loads_with_datasets_and_grain(gsm_caches):
    import datasets
    import grain.python as grain

    path = gsm_caches[2][0]
    src = pl.open_cache(path)
    ds = datasets.load_from_disk(path)
    assert len(ds) == len(src)
    for i in (0, 7, len(src) - 1):
        assert ds[i]["input_ids"] == src[i]["input_ids"].tolist()
        assert ds[i]["loss_mask"] == src[i]["loss_mask"].tolist()
    mapped = grain.MapDataset.source(src).map(lambda r: int(r["input_ids"].size))
    assert [mapped[i] for i in range(5)] == src.lengths(range(5)).tolist()
    assert isinstance(src[0]["input_ids"], np.ndarray) and src[0]["input_ids"].dtype == np.int32


@pytest.mark.slow
def test_second_run_is_a_hit_and_each_key_part_changes_the_key(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}", "question": "x", "answer": "y"}) + "\n" for i in range(40)))
    tok = tmp_path / "tok"
    shutil.copytree(need(PHI3), tok)
    base = dict(tokenizer=str(tok), format="alpaca", out=str(tmp_path / "c"), max_length=64, num_workers=1)
    first, s1 = build_cache(data, **base)
    again, s2 = build_cache(data, **base)
    assert (again, s1["hit"], s2["hit"]) == (first, False, True)

    variants = [
        dict(base, max_length=65),
        dict(base, overlong="truncate"),
        dict(base, fields={"instruction": "question", "output": "answer"}),
        dict(base, format="text", fields={"text": "instruction"}),
        dict(base, backend="array_record"),
        dict(base, split="train[:20]"),
    ]
    paths = {first}
    for v in variants:
        paths.add(build_cache(data, **v)[0])
    assert len(paths) == 1 + len(variants)
    # The input's content, not its path, and the tokenizer's files, not its name.
    data.write_text(data.read_text().replace("q39", "q39!"))
    paths.add(build_cache(data, **base)[0])
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg["chat_template"].replace("<|end|>", "<|end|> ")
    (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    paths.add(build_cache(data, **base)[0])
    assert len(paths) == 3 + len(variants)


def test_chat_template_override_changes_the_key(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}) + "\n")
    t1, t2 = tmp_path / "t1.jinja", tmp_path / "t2.jinja"
    t1.write_text("{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    t2.write_text("{% for m in messages %}[{{ m['content'] }}]{{ eos_token }}{% endfor %}")
    common = dict(tokenizer=need(GPT2), format="chat", out=str(tmp_path / "c"))
    assert pl.precache(data, chat_template=str(t1), **common) != pl.precache(data, chat_template=str(t2), **common)


def test_all_rows_dropped_is_an_error_and_publishes_nothing(tmp_path):
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"text": "word " * 100}) + "\n")
    with pytest.raises(PortableLoaderError, match="all 1 rows were dropped .overlong: 1."):
        pl.precache(data, tokenizer=need(GPT2), format="text", out=tmp_path / "c", max_length=8)
    assert os.listdir(tmp_path / "c") == []


# --- refusing damaged caches ------------------------------------------------------------------


@pytest.fixture()
def small_cache(tmp_path):
    path = pl.precache(
        need(DATA / "text" / "llamafactory_c4_demo.jsonl"), tokenizer=need(GPT2), format="text",
        out=tmp_path, num_workers=2, rows_per_task=150,
    )
    return path


def shard_files(path):
    return sorted(f for f in os.listdir(path) if f.startswith("data-"))


@pytest.mark.slow
def test_truncated_shard_is_refused_on_open(small_cache):
    victim = os.path.join(small_cache, shard_files(small_cache)[1])
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 10)
    with pytest.raises(CacheError, match=f"{victim}: shard is .* truncated"):
        pl.open_cache(small_cache)


@pytest.mark.slow
def test_flipped_byte_is_refused_by_verify(small_cache):
    victim = os.path.join(small_cache, shard_files(small_cache)[0])
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    pl.open_cache(small_cache)  # same size: only the checksum can tell
    with pytest.raises(CacheError, match=f"{victim}: checksum mismatch"):
        pl.open_cache(small_cache, verify=True)
    r = run_cli("--input", DATA / "text" / "llamafactory_c4_demo.jsonl", "--tokenizer", GPT2, "--format", "text",
                "--out", os.path.dirname(small_cache), "--num-workers", "2", "--rows-per-task", "150", "--verify")
    assert r.returncode == 2 and "checksum mismatch" in r.stderr and victim in r.stderr


@pytest.mark.slow
def test_missing_shard_and_manifest_are_refused(small_cache):
    os.remove(os.path.join(small_cache, shard_files(small_cache)[0]))
    with pytest.raises(CacheError, match="shard missing"):
        pl.open_cache(small_cache)
    os.remove(os.path.join(small_cache, "manifest.json"))
    with pytest.raises(CacheError, match="manifest.json: missing"):
        pl.open_cache(small_cache)


@pytest.mark.slow
def test_edited_manifest_and_other_format_version_are_refused(small_cache):
    mpath = os.path.join(small_cache, "manifest.json")
    manifest = json.load(open(mpath))
    manifest["counts"]["rows_out"] += 1
    json.dump(manifest, open(mpath, "w"))
    with pytest.raises(CacheError, match="manifest.json: checksum mismatch"):
        pl.open_cache(small_cache)
    from portable_loader.cache.manifest import _manifest_checksum

    manifest["counts"]["rows_out"] -= 1
    manifest["format_version"] = 999
    manifest["checksum"] = _manifest_checksum(manifest)
    json.dump(manifest, open(mpath, "w"))
    with pytest.raises(CacheError, match="cache format version 999"):
        pl.open_cache(small_cache)


# --- atomic publishing: real processes --------------------------------------------------------


@pytest.mark.slow
def test_concurrent_runs_for_one_key_end_with_one_cache(tmp_path):
    args = ["--input", need(GSM), "--tokenizer", need(GPT2), "--format", "alpaca", "--field", "instruction=question",
            "--field", "output=answer", "--split", "train[:300]", "--num-workers", "1", "--out", tmp_path]
    procs = [subprocess.Popen([sys.executable, "-m", "portable_loader.precache", *map(str, args)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [o[1] for o in outs]
    printed = {o[0].strip().splitlines()[-1] for o in outs}
    assert len(printed) == 1
    entries = os.listdir(tmp_path)  # no .lock, .tmp- or .trash- entry either
    assert len(entries) == 1 and not entries[0].startswith(".")
    pl.open_cache(printed.pop(), verify=True)


@pytest.mark.slow
def test_sigkill_leaves_no_partial_cache_and_next_run_completes(tmp_path):
    need(GSM)
    args = ["--input", GSM, "--tokenizer", PHI3, "--format", "alpaca", "--field", "instruction=question",
            "--field", "output=answer", "--num-workers", "2", "--out", tmp_path]
    reference = run_cli(*args, "--out", tmp_path / "ref").stdout.strip().splitlines()[-1]
    ref_sum = pl.open_cache(reference).manifest["content_checksum"]
    rng = np.random.default_rng(0)
    for delay in rng.uniform(0.3, 3.0, size=3):
        p = subprocess.Popen([sys.executable, "-m", "portable_loader.precache", *map(str, args)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        time.sleep(delay)
        os.killpg(p.pid, signal.SIGKILL)  # the parent and its workers, like an OOM kill of the job
        p.wait()
        for entry in os.listdir(tmp_path):
            if entry.startswith("alpaca-"):  # visible means complete
                pl.open_cache(tmp_path / entry, verify=True)
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    path = done.stdout.strip().splitlines()[-1]
    assert pl.open_cache(path, verify=True).manifest["content_checksum"] == ref_sum
    leftovers = [e for e in os.listdir(tmp_path) if e.startswith((".tmp-", ".trash-"))]
    assert leftovers == []


# --- the command line -------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_summary_and_last_line_is_the_cache(tmp_path):
    r = run_cli("--input", need(DATA / "chat" / "fastchat_dummy_conversation.json"), "--tokenizer", need(PHI3),
                "--format", "chat", "--out", tmp_path, "--backend", "array_record", "--verify")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert "rows in: 500" in r.stdout and "rows/s" in r.stdout and "tokens:" in r.stdout
    src = pl.open_cache(lines[-1])
    assert len(src) == 500 and os.path.dirname(lines[-1]) == str(tmp_path)


@pytest.mark.slow
def test_cli_without_arguments_caches_the_bundled_sample(tmp_path):
    r = run_cli(cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    path = os.path.join(tmp_path, r.stdout.strip().splitlines()[-1])
    src = pl.open_cache(path, verify=True)
    rows = [json.loads(line) for line in open(SAMPLE / "sample_chat.jsonl")]
    assert len(src) == len(rows)
    tok = load_tokenizer(str(SAMPLE / "tokenizer"))
    ids, mask = src[3]["input_ids"], src[3]["loss_mask"]
    answers = [m["content"] + "<|end|>" for m in rows[3]["messages"] if m["role"] == "assistant"]
    assert tok.decode(ids[mask == 1]) == "".join(answers)


def bad_jsonl(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "fine"}\n{"text": "broken\n{"text": 5}\n{"text": "fine too"}\n')
    return p


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,message",
    [
        (["--format", "text"], r"bad.jsonl: line 2: malformed JSON"),
        (["--format", "alpaca"], r"bad.jsonl: line 1: field instruction: missing"),
        (["--format", "chat"], r"no chat template"),
    ],
)
def test_cli_bad_input_is_one_line_error_and_no_cache(tmp_path, args, message):
    r = run_cli("--input", bad_jsonl(tmp_path), "--tokenizer", need(GPT2), "--out", tmp_path / "c", *args)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: ")
    import re

    assert re.search(message, r.stderr), r.stderr
    assert not os.path.exists(tmp_path / "c") or os.listdir(tmp_path / "c") == []


def test_on_bad_row_skip_counts_the_rows(tmp_path):
    path, s = build_cache(bad_jsonl(tmp_path), tokenizer=need(GPT2), format="text", out=tmp_path / "c", on_bad_row="skip")
    assert s["rows_out"] == 2 and s["dropped"] == {"bad_row": 2}
    assert [r["input_ids"][-1] for r in pl.open_cache(path).__getitems__([0, 1])] == [50256, 50256]


def test_tokenizer_errors(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "x"}) + "\n")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="junk: cannot load tokenizer"):
        pl.precache(data, tokenizer=tmp_path / "junk", format="text", out=tmp_path / "c")
    with pytest.raises(TokenizerError, match="no such tokenizer folder"):
        pl.precache(data, tokenizer=tmp_path / "nope", format="text", out=tmp_path / "c")
    # A tokenizer with no special token at all has no EOS to append.
    from tokenizers import Tokenizer, models, pre_tokenizers

    bare = Tokenizer(models.WordLevel({"x": 0, "[UNK]": 1}, unk_token="[UNK]"))
    bare.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "bare").mkdir()
    bare.save(str(tmp_path / "bare" / "tokenizer.json"))
    with pytest.raises(TokenizerError, match="has no EOS token"):
        pl.precache(data, tokenizer=tmp_path / "bare", format="text", out=tmp_path / "c")


def test_empty_dataset_is_refused(tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    with pytest.raises(InputError, match="empty.jsonl: no rows"):
        pl.precache(data, tokenizer=need(GPT2), format="text", out=tmp_path / "c")


def test_open_is_cheap_and_lazy(gsm_caches):
    # O(shards) structures, never O(rows): the segment index has one entry per written batch.
    from portable_loader.cache.writer import _BATCH_ROWS

    src = pl.open_cache(gsm_caches[3][0])
    assert len(src._seg_starts) <= len(src.manifest["shards"]) * (1 + len(src) // _BATCH_ROWS) + 1
    assert not src[0]["input_ids"].flags.writeable  # a view on the memory map, not a copy


def test_bad_row_error_survives_worker_processes(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(50)) + '{"text": 1}\n')
    with pytest.raises(BadRowError, match=r"d.jsonl: line 51: field text: expected a string, got int"):
        pl.precache(p, tokenizer=need(GPT2), format="text", out=tmp_path / "c", num_workers=2)
    assert not any(e.startswith(".tmp-") for e in os.listdir(tmp_path / "c"))


def test_shards_of_many_record_batches_read_back_exactly(tmp_path, monkeypatch):
    import datasets

    from portable_loader import cache

    monkeypatch.setattr(cache.writer, "_BATCH_ROWS", 7)  # many small Arrow record batches per shard
    rng = np.random.default_rng(0)
    written = []
    shards = []
    for s in range(3):
        w = cache.ShardWriter(str(tmp_path / cache.shard_name("arrow", s, 3)), "arrow")
        for _ in range(int(rng.integers(1, 40))):
            n = int(rng.integers(1, 30))
            ids, mask = rng.integers(0, 999, n).astype(np.int32), rng.integers(0, 2, n).astype(np.uint8)
            w.write(ids, mask)
            written.append((ids.tolist(), mask.tolist()))
        shards.append(w.close())
    counts = {"rows_in": len(written), "rows_out": len(written)}
    cache.write_manifest(str(tmp_path), {"format_version": cache.FORMAT_VERSION, "backend": "arrow", "key": "k" * 64,
                                         "counts": counts, "content_checksum": "", "shards": shards})
    src = pl.open_cache(str(tmp_path), verify=True)
    assert len(src._seg_starts) > 6
    assert records(src) == written
    order = rng.permutation(len(written)).tolist() + [-1]
    assert [r["input_ids"].tolist() for r in src.__getitems__(order)] == [written[i][0] for i in order]
    assert src.lengths(order[:-1]).tolist() == [len(written[i][0]) for i in order[:-1]]
    assert datasets.load_from_disk(str(tmp_path))["input_ids"] == [w[0] for w in written]
    with pytest.raises(IndexError):
        src.__getitems__([len(written)])


@pytest.mark.slow
def test_the_first_bad_row_in_input_order_is_reported_whatever_worker_fails_first(tmp_path):
    # Worker 1's range starts with a bad row and fails at once; worker 0's bad row is the last of
    # its 8,000 rows. The error must name worker 0's row (the first in the file), not the quicker one.
    p = tmp_path / "bad.jsonl"
    rows = [json.dumps({"text": f"row {i} " + "word " * 40}) for i in range(7999)]
    p.write_text("\n".join(rows + ['{"text": 1}', '{"text": 2}'] + rows) + "\n")
    with pytest.raises(BadRowError, match=r"bad.jsonl: line 8000: "):
        build_cache(str(p), tokenizer=need(GPT2), format="text", out=str(tmp_path / "c"), num_workers=2)


JAX_PRECACHE = """
import json, multiprocessing, warnings
warnings.simplefilter("error")               # a fork warning would fail the job
import jax.numpy as jnp
import psutil
import portable_loader as pl
from portable_loader.precache import sample_args
jnp.arange(10.0).sum()                       # JAX's backend and its threads are running
methods = []
context = multiprocessing.get_context
multiprocessing.get_context = lambda method=None: methods.append(method) or context(method)
path = pl.precache(**sample_args(), out="cache", num_workers=2, rows_per_task=500)
servers = [p.cmdline()[-1] for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline())]
print(json.dumps([path, methods, servers]))
"""


@pytest.mark.slow
def test_precache_in_a_jax_process_does_not_fork(tmp_path):
    pytest.importorskip("jax")
    job = tmp_path / "job.py"
    job.write_text(JAX_PRECACHE)  # no main guard: the workers must not run the script again
    r = subprocess.run([sys.executable, str(job)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    path, methods, servers = json.loads(r.stdout.splitlines()[-1])
    assert methods == ["forkserver"]
    assert "fork" not in r.stderr.replace("forkserver", "")
    # The server (one a process, whichever pool starts it) imports the package once for every worker it
    # forks, the loader's later ones included, and the tokenizer's class that each worker loads;
    # multiprocessing's default would preload nothing here.
    from portable_loader.engine.workers import PRELOAD
    from portable_loader.precache import sample_args
    from portable_loader.tokenize import load_tokenizer

    module = type(load_tokenizer(sample_args()["tokenizer"])).__module__
    assert len(servers) == 1 and str([*PRELOAD, module]) in servers[0], servers

    here = pl.precache(**sample_args(), out=str(tmp_path / "here"), num_workers=2, rows_per_task=500)
    assert os.path.basename(here) == os.path.basename(path)
    assert shard_digests(here) == shard_digests(str(tmp_path / path))
