"""precache with engine="ray" on a real multi-node Ray cluster on this machine (all on 127.0.0.1).

One module-scoped ``ray.cluster_utils.Cluster``, hosted by a process of its own (``ray_cluster.py``,
so this one never forks): a head and two worker nodes of one CPU each. The oracle for every Ray build is the local engine's build of the same input: the shard files must be
byte-identical (sha256 computed here), and the cache names equal.
"""

import os

# Every Ray process on loopback: without this Ray binds to this machine's outside address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import hashlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")

import portable_loader as pl  # noqa: E402
from conftest import NO_FORK  # noqa: E402
from portable_loader.errors import BadRowError, PortableLoaderError  # noqa: E402
from portable_loader.precache import build_cache, sample_args  # noqa: E402
from ray_cluster import HostedCluster  # noqa: E402

pytestmark = NO_FORK

LOOPBACK = "127.0.0.1"
NODE = dict(num_cpus=1, node_ip_address=LOOPBACK, include_dashboard=False, object_store_memory=80 * 1024 * 1024)
ROWS_PER_TASK = 40


@pytest.fixture(scope="session")
def inputs(tmp_path_factory):
    """The bundled chat sample, repeated and cut into three files of unequal length."""
    folder = tmp_path_factory.mktemp("ray-in")
    lines = [line for line in open(sample_args()["input"]) if line.strip()]
    rows = (lines * (1 + 900 // len(lines)))[:900]
    for k, (lo, hi) in enumerate([(0, 130), (130, 500), (500, 900)]):
        (folder / f"part-{k}.jsonl").write_text("".join(rows[lo:hi]))
    return folder


def options(**extra):
    return {"tokenizer": sample_args()["tokenizer"], "format": "chat", "rows_per_task": ROWS_PER_TASK, **extra}


def shard_digests(path) -> dict:
    return {f: hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(path)) if f.startswith("data-")}


@pytest.fixture(scope="session")
def local(inputs, tmp_path_factory):
    """The local engine's caches (1 and 2 workers), built before any Ray process exists."""
    base = tmp_path_factory.mktemp("local")
    one, _ = build_cache(str(inputs), out=base / "w1", num_workers=1, **options())
    two, summary = build_cache(str(inputs), out=base / "w2", num_workers=2, **options())
    assert summary["num_workers"] == 2 and summary["tasks"] == 4 + 10 + 10  # 130, 370, 400 rows by 40
    assert os.path.basename(one) == os.path.basename(two) and shard_digests(one) == shard_digests(two)
    return one


@pytest.fixture(scope="module")
def cluster(local):
    cluster = HostedCluster(NODE, workers=2)  # (its own process: no fork of this one)
    ray.init(address=cluster.address, _node_ip_address=LOOPBACK, log_to_driver=False)
    yield cluster, cluster.workers
    ray.shutdown()
    cluster.shutdown()


def no_temp_left(out) -> bool:
    return not [n for n in os.listdir(out) if n.startswith(".tmp-")]


@pytest.mark.slow
def test_ray_build_is_byte_identical_to_local_and_a_hit_for_local(inputs, local, cluster, tmp_path, capsys):
    path, summary = build_cache(str(inputs), out=tmp_path, engine="ray", ray_address=cluster[0].address,
                                show_progress=True, **options())
    assert "900/900" in capsys.readouterr().err  # the driver's progress bar counted every row
    assert summary["engine"] == "ray" and not summary["hit"] and summary["num_workers"] == 3
    nodes = summary["nodes"]  # every task started once and finished where it started; none was rerun
    assert summary["retried"] == 0 and all(n["started"] == n["finished"] for n in nodes.values())
    assert sum(n["finished"] for n in nodes.values()) == 24 and set(nodes) <= {n["NodeID"] for n in ray.nodes()}
    assert os.path.basename(path) == os.path.basename(local)  # the engine is not in the key
    assert shard_digests(path) == shard_digests(local) and len(shard_digests(path)) == 24
    assert pl.open_cache(path).manifest["content_checksum"] == pl.open_cache(local).manifest["content_checksum"]
    again, s = build_cache(str(inputs), out=tmp_path, num_workers=2, **options())
    assert s["hit"] and again == path


@pytest.mark.slow
def test_a_hit_is_answered_without_connecting_to_ray(inputs, local, tmp_path):
    """Run where no Ray exists: a fresh process, an address where nothing listens, and a cache there."""
    out = os.path.dirname(local)
    code = (
        "import sys, portable_loader as pl; from portable_loader.precache import build_cache; "
        f"p, s = build_cache({str(inputs)!r}, out={out!r}, engine='ray', ray_address='{LOOPBACK}:{free_port()}', "
        f"**{options()!r}); print(s['hit'], p, 'ray' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", local, "False"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_an_address_that_does_not_answer_is_a_clear_error_within_seconds(inputs, tmp_path):
    t = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "portable_loader.precache", "--input", str(inputs), "--format", "chat",
         "--tokenizer", sample_args()["tokenizer"], "--out", str(tmp_path), "--engine", "ray",
         "--ray-address", f"{LOOPBACK}:{free_port()}"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 2 and "cannot reach the Ray cluster at '127.0.0.1:" in r.stderr, r.stderr
    assert time.monotonic() - t < 60  # the connect timeout is 5 s; the rest is start-up on a loaded machine
    assert no_temp_left(tmp_path) and not [n for n in os.listdir(tmp_path) if n.startswith("chat-")]


@pytest.mark.slow
def test_ray_not_installed_is_a_clear_error(inputs, tmp_path):
    # sys.modules[name] = None is Python's own way of making an import fail, as if not installed.
    code = (
        "import sys; sys.modules['ray'] = None; from portable_loader.precache import build_cache\n"
        "try:\n"
        f"    build_cache({str(inputs)!r}, out={str(tmp_path)!r}, engine='ray', **{options()!r})\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.startswith("PortableLoaderError engine='ray' needs Ray: pip install 'portable-loader[ray]'"), r
    assert no_temp_left(tmp_path)


def ask_ledger(ask, going):
    """``ask(actor)``'s answer from the running build's ledger actor, asked again while ``going()``
    (the ledger not up yet, ended between the listing and the call, or a loaded machine answering
    late); None once ``going()`` is false."""
    while going():
        names = [n for n in ray.util.list_named_actors() if n.startswith("portable_loader-precache-")]
        try:
            if names:
                return ray.get(ask(ray.get_actor(names[0])), timeout=10)
        except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.05)
    return None


def ledger_starts(timeout=120) -> list:
    """The running build's task starts ``(task, node id)``, read from its ledger actor."""
    deadline = time.monotonic() + timeout
    return ask_ledger(lambda actor: actor.read.remote(0), lambda: time.monotonic() < deadline) or []


def ledger_node(build: threading.Thread) -> str | None:
    """The node id of the running build's ledger actor, once it is up; None if the build ended first."""

    def where(actor):
        return ray.get_runtime_context().get_node_id()

    return ask_ledger(lambda actor: actor.__ray_call__.remote(where), build.is_alive)


@pytest.mark.slow
def test_node_lost_mid_run_reruns_its_tasks_and_the_cache_is_identical(inputs, local, cluster, tmp_path):
    c, workers = cluster
    got = {}

    def build(out):
        try:
            got["result"] = build_cache(str(inputs), out=out, engine="ray", ray_address=c.address,
                                        **options(rows_per_task=10))
        except BaseException as e:  # reported by the assertion below
            got["error"] = e

    # Not the node this driver is attached to (the build's ledger is there): any other may be lost.
    victim = next(w for w in workers[::-1] if w != ray.get_runtime_context().get_node_id())
    workers.remove(victim)
    # The build lasts seconds, and a loaded machine can start the victim's first task (a Ray worker
    # process starting there) near its end: a build that ends before it is seen is run again.
    for attempt in range(3):
        got.clear()
        thread = threading.Thread(target=build, args=(tmp_path / f"c{attempt}",))
        thread.start()
        # The ledger lives on the driver's node (with soft affinity Ray put it on another one about
        # every other run, and a lost node then lost the counts).
        node = ledger_node(thread)
        assert node in (None, ray.get_runtime_context().get_node_id())
        # Wait until a task has started on the node to remove (the build's ledger says so), then kill it.
        deadline = time.monotonic() + 120
        while thread.is_alive() and time.monotonic() < deadline and victim not in {n for _, n in ledger_starts(5)}:
            time.sleep(0.01)
        if node is not None and thread.is_alive():
            break
        thread.join(300)
        assert "error" not in got, got.get("error")
    else:
        pytest.fail(f"3 builds ended before a node could be removed: {got}")
    c.remove_node(victim)
    thread.join(300)
    workers.append(c.add_node())  # for the tests after this one
    assert "error" not in got, got.get("error")
    path, summary = got["result"]
    # rows_per_task=10 is another plan (another key): its oracle is a local build with the same plan.
    want, _ = build_cache(str(inputs), out=tmp_path / "local", num_workers=0, **options(rows_per_task=10))
    assert os.path.basename(path) == os.path.basename(want) and summary["tasks"] == 90
    assert shard_digests(path) == shard_digests(want)
    assert sorted(os.listdir(path)) == sorted(os.listdir(want))  # no partial shard of a killed task left
    # Tasks ran on the removed node; every one that started there and did not finish there was rerun.
    nodes = summary["nodes"]
    assert nodes[victim]["started"] >= 1, nodes
    killed = nodes[victim]["started"] - nodes[victim]["finished"]
    assert summary["retried"] >= killed and sum(n["finished"] for n in nodes.values()) == 90, summary
    print(f"removed node: {nodes[victim]}; tasks retried: {summary['retried']}")


@pytest.mark.slow
def test_bad_row_stops_the_run_names_file_and_line_publishes_nothing_and_the_cluster_stays_usable(
        inputs, local, cluster, tmp_path):
    bad = tmp_path / "in"
    bad.mkdir()
    for k in range(3):
        text = (inputs / f"part-{k}.jsonl").read_text()
        if k == 2:
            lines = text.splitlines(keepends=True)
            lines[250] = '{"messages": [{"role": "user", "content": "unterminated\n'
            text = "".join(lines)
        (bad / f"part-{k}.jsonl").write_text(text)
    out = tmp_path / "c"
    with pytest.raises(BadRowError) as e:
        build_cache(str(bad), out=out, engine="ray", ray_address=cluster[0].address, **options())
    assert str(bad / "part-2.jsonl") in str(e.value) and "line 251" in str(e.value)
    assert no_temp_left(out) and not [n for n in os.listdir(out) if n.startswith("chat-")]
    # Still usable: the same cluster builds the good input, identical to the local build.
    path, summary = build_cache(str(inputs), out=out, engine="ray", ray_address=cluster[0].address, **options())
    assert not summary["hit"] and shard_digests(path) == shard_digests(local)


DRIVER_PEAKS = """
import json, sys, ray
from portable_loader.precache import build_cache

def kib(field):  # VmHWM: the peak RSS since the last reset; VmRSS: now
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))

address, out, options, warm, inputs = json.loads(sys.argv[1])
ray.init(address=address, _node_ip_address="127.0.0.1", log_to_driver=False)
build_cache(warm, out=out, engine="ray", ray_address=address, **options)  # the fixed costs: tokenizer, Ray
for path in inputs:
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the RSS now
    base = kib("VmRSS")
    cache, _ = build_cache(path, out=out, engine="ray", ray_address=address, **{**options, "rows_per_task": 1000})
    print(json.dumps({"path": path, "growth": (kib("VmHWM") - base) * 1024, "peak": kib("VmHWM") * 1024,
                      "cache": cache}))
"""


def padded_input(path, megabytes):
    """Chat rows with a 10 KB extra column (as raw crawls carry): bytes to list, few rows to tokenize."""
    rows = [json.loads(line) for line in open(sample_args()["input"]) if line.strip()]
    with open(path, "w") as f:
        written = i = 0
        while written < megabytes * 10**6:
            written += f.write(json.dumps({**rows[i % len(rows)], "meta": f"{i:010d}" * 1000}) + "\n")
            i += 1
    return os.path.getsize(path)


@pytest.mark.slow
def test_the_drivers_peak_rss_does_not_grow_with_the_input(inputs, cluster, tmp_path):
    """A fresh driver process, warmed by one small build, builds a 50 MB and a 200 MB input: what its
    peak RSS grows by during each build is independent of the input and well under 30% of its size."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    sizes = {str(tmp_path / f"in-{mb}.jsonl"): padded_input(tmp_path / f"in-{mb}.jsonl", mb) for mb in (50, 200)}
    argv = json.dumps([cluster[0].address, str(tmp_path / "c"), options(), str(inputs), list(sizes)])
    r = subprocess.run([sys.executable, "-c", DRIVER_PEAKS, argv], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    small, big = [run["growth"] for run in runs]
    assert [run["path"] for run in runs] == list(sizes)
    for run in runs:  # what is left is the listing's read buffer (8 MiB) and small change
        assert run["growth"] < 0.3 * sizes[run["path"]], runs
    assert big - small < 0.02 * (max(sizes.values()) - min(sizes.values())), runs  # no slope with the input
    # The 200 MB input's tasks open it at seek offsets past its first 4,096 lines: the same shards.
    want, summary = build_cache(list(sizes)[1], out=tmp_path / "local", num_workers=1, **options(rows_per_task=1000))
    assert summary["tasks"] == 20 and shard_digests(runs[1]["cache"]) == shard_digests(want)
    for run in runs:
        print(f"{sizes[run['path']] / 1e6:.0f} MB input: driver peak RSS {run['peak'] / 1e6:.1f} MB, "
              f"+{run['growth'] / 1e6:.1f} MB during the build")


@pytest.mark.slow
def test_an_in_memory_dataset_is_refused_with_the_way_out(cluster, tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([json.loads(line) for line in open(sample_args()["input"]) if line.strip()])
    with pytest.raises(PortableLoaderError, match="save_to_disk"):
        build_cache(ds, out=tmp_path, engine="ray", ray_address=cluster[0].address, **options())
    assert no_temp_left(tmp_path)


@pytest.fixture(scope="module")
def bucket(inputs):
    """A moto S3 server on 127.0.0.1 holding the inputs, and the storage_options that reach it.
    (moto keeps one store per process: the bucket is named apart from test_s3.py's.)

    No environment variable points at it: the Ray workers (started without one) can reach the bucket
    only through the storage_options each task carries."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address=LOOPBACK, port=0)
    server.start()
    host, port = server.get_host_and_port()
    so = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing"}
    import s3fs

    fs = s3fs.S3FileSystem(**so)
    fs.mkdir("ray-bkt")
    for k in range(3):
        fs.pipe_file(f"ray-bkt/in/part-{k}.jsonl", (inputs / f"part-{k}.jsonl").read_bytes())
    yield fs, so
    server.stop()


@pytest.mark.slow
def test_ray_from_a_bucket_to_a_bucket_tasks_upload_their_shards_driver_the_manifest_last(
        local, cluster, bucket, monkeypatch):
    import s3fs

    fs, so = bucket
    driver_puts = []  # what this process (the driver) uploads: never a shard
    real_put = s3fs.S3FileSystem._put_file

    async def spy(self, lpath, rpath, *args, **kwargs):
        driver_puts.append(os.path.basename(rpath))
        return await real_put(self, lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_put_file", spy)
    s3fs.S3FileSystem.clear_instance_cache()  # an instance binds its sync methods when made
    try:
        url, summary = build_cache("s3://ray-bkt/in/", out="s3://ray-bkt/caches", engine="ray",
                                   ray_address=cluster[0].address, storage_options=so, **options())
    finally:
        monkeypatch.undo()
        s3fs.S3FileSystem.clear_instance_cache()
    assert url.startswith("s3://ray-bkt/caches/chat-") and summary["engine"] == "ray" and summary["tasks"] == 24
    assert driver_puts == ["dataset_info.json", "state.json", "manifest.json"]
    path = url.removeprefix("s3://")
    shards = {os.path.basename(p): hashlib.sha256(fs.cat_file(p)).hexdigest() for p in fs.find(path)
              if os.path.basename(p).startswith("data-")}
    assert shards == shard_digests(local)  # byte-identical to the local engine's build of the same files
    fs.invalidate_cache()
    manifest_time = fs.info(f"{path}/manifest.json")["LastModified"]
    assert all(fs.info(f"{path}/{name}")["LastModified"] <= manifest_time for name in shards)
    assert pl.open_cache(url, cache_dir=local + "-fetched", storage_options=so).manifest["content_checksum"] == \
        pl.open_cache(local).manifest["content_checksum"]
    again, s = build_cache("s3://ray-bkt/in/", out="s3://ray-bkt/caches", engine="ray", storage_options=so, **options())
    assert s["hit"] and again == url


@pytest.mark.slow
def test_ray_bucket_build_that_fails_leaves_nothing_in_the_bucket(inputs, cluster, bucket):
    fs, so = bucket
    for k in range(3):
        data = (inputs / f"part-{k}.jsonl").read_bytes()
        fs.pipe_file(f"ray-bkt/bad/part-{k}.jsonl", data + b'{"messages": [\n' if k == 2 else data)
    with pytest.raises(BadRowError) as e:
        build_cache("s3://ray-bkt/bad/", out="s3://ray-bkt/failed", engine="ray", ray_address=cluster[0].address,
                    storage_options=so, **options())
    assert "s3://ray-bkt/bad/part-2.jsonl" in str(e.value) and "line 401" in str(e.value)
    fs.invalidate_cache()
    assert not fs.exists("ray-bkt/failed") or fs.find("ray-bkt/failed") == []  # the shards tasks uploaded: removed


def idle_cpus():
    return ray.available_resources().get("CPU", 0)


@pytest.mark.slow
def test_ctrl_c_on_the_driver_cancels_the_tasks_and_publishes_nothing(inputs, local, cluster, tmp_path):
    out = tmp_path / "c"
    driver = subprocess.Popen(
        [sys.executable, "-m", "portable_loader.precache", "--input", str(inputs), "--format", "chat",
         "--tokenizer", sample_args()["tokenizer"], "--out", str(out), "--engine", "ray",
         "--ray-address", cluster[0].address, "--rows-per-task", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 120
    while driver.poll() is None and time.monotonic() < deadline and not any(
        n.startswith("data-") for d in (out.glob(".tmp-*") if out.exists() else []) if d.is_dir() for n in os.listdir(d)
    ):
        time.sleep(0.01)
    assert driver.poll() is None, "the build ended before Ctrl-C"
    driver.send_signal(signal.SIGINT)
    _, err = driver.communicate(timeout=120)
    assert driver.returncode == 130 and "interrupted: no cache was published" in err, err
    assert no_temp_left(out) and not [n for n in os.listdir(out) if n.startswith("chat-")]
    # The cancelled tasks are gone: the cluster's CPUs are all free again, and it still builds.
    deadline = time.monotonic() + 60
    while idle_cpus() != ray.cluster_resources().get("CPU") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert idle_cpus() == ray.cluster_resources().get("CPU") >= 3
    path, summary = build_cache(str(inputs), out=out, engine="ray", ray_address=cluster[0].address, **options())
    assert shard_digests(path) == shard_digests(local)


@pytest.mark.slow
def test_local_engine_in_a_process_connected_to_ray_does_not_hang(inputs, local, cluster, tmp_path):
    """Forked workers of a process holding Ray's gRPC threads hang; the pool must not fork then."""
    assert ray.is_initialized()
    path, summary = build_cache(str(inputs), out=tmp_path, num_workers=2, **options())
    assert summary["num_workers"] == 2 and shard_digests(path) == shard_digests(local)
