"""JaxLoader: device shards hold exactly the numpy global batch's rows, torch/JAX bit-identity,
Orbax and Grain checkpoint round trips, and a real two-process JAX job resumed in one process."""

import json
import os
import threading
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import portable_loader as pl  # noqa: E402
from portable_loader.adapters.jax import JaxLoader, LoaderRestore, LoaderSave  # noqa: E402
from test_loader import make_source  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def loader(src=None, **kw):
    cfg = dict(global_batch_size=8, seq_len=32, seed=5, packing=True, packing_window=16)
    cfg.update(kw)
    return pl.DataLoader(src if src is not None else make_source(40), **cfg)


def as_numpy(batches):
    return [{k: np.asarray(v) for k, v in b.items()} for b in batches]


def same(a, b):
    return len(a) == len(b) and all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def take(it, k):
    return [next(it) for _ in range(k)]


def test_eight_virtual_devices():
    assert len(jax.devices()) == 8, "tests/conftest.py sets XLA_FLAGS before jax is imported"


@pytest.mark.parametrize("shape,axes,spec", [((8,), ("data",), P("data")), ((4, 2), ("data", "model"), P("data")),
                                             ((2, 4), ("data", "model"), P("data", "model"))])
def test_every_device_shard_holds_the_expected_rows(shape, axes, spec):
    mesh = Mesh(np.array(jax.devices()).reshape(shape), axes)
    sharding = NamedSharding(mesh, spec)
    want = take(iter(loader()), 5)
    with JaxLoader(loader(), sharding=sharding) as jl:
        got = take(jl, 5)
    for g, w in zip(got, want):
        for k, arr in g.items():
            assert arr.shape == w[k].shape and arr.sharding == sharding
            for shard in arr.addressable_shards:
                assert np.array_equal(np.asarray(shard.data), w[k][shard.index]), (k, shard.device)


def test_default_sharding_splits_the_batch_over_all_devices():
    with JaxLoader(loader()) as jl:
        arr = next(jl)["input_ids"]
    assert {s.data.shape for s in arr.addressable_shards} == {(1, 32)}


def test_jax_and_torch_deliver_bit_identical_batches():
    torch_adapter = pytest.importorskip("portable_loader.adapters.torch")
    with JaxLoader(loader(num_epochs=2)) as jl:
        a = as_numpy(list(jl))
    with torch_adapter.TorchLoader(loader(num_epochs=2)) as tl:
        b = [{k: v.numpy() for k, v in x.items()} for x in tl]
    assert len(a) > 5 and same(a, b)


@pytest.mark.parametrize("n", [3, 5, 6])  # 40 records / 8 = 5 padded steps per epoch
def test_orbax_checkpoint_manager_round_trip(tmp_path, n):
    kw = dict(packing=False)
    full = as_numpy(take(JaxLoader(loader(**kw), prefetch=0), 12))
    params = {"w": np.arange(4.0)}
    jl = JaxLoader(loader(**kw), prefetch=2)
    take(jl, n)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(n, args=ocp.args.Composite(params=ocp.args.StandardSave(params), data=LoaderSave(jl)))
        mngr.wait_until_finished()
    jl.close()
    fresh = JaxLoader(loader(**kw), prefetch=2)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        restored = mngr.restore(n, args=ocp.args.Composite(params=ocp.args.StandardRestore(params),
                                                           data=LoaderRestore(fresh)))
    assert np.array_equal(restored["params"]["w"], params["w"])
    assert same(as_numpy(take(fresh, 12 - n)), full[n:])
    fresh.close()
    other = JaxLoader(loader(seed=9, **kw))
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr, pytest.raises(ValueError, match="seed"):
        mngr.restore(n, args=ocp.args.Composite(data=LoaderRestore(other)))


def test_grain_checkpoint_handler_works_on_jaxloader(tmp_path):
    import grain.checkpoint as gc

    full = as_numpy(take(JaxLoader(loader(), prefetch=0), 9))
    jl = JaxLoader(loader())
    take(jl, 4)
    with ocp.CheckpointManager(tmp_path / "g") as mngr:
        mngr.save(4, args=ocp.args.Composite(data=gc.CheckpointSave(jl)))
        mngr.wait_until_finished()
        fresh = JaxLoader(loader())
        mngr.restore(4, args=ocp.args.Composite(data=gc.CheckpointRestore(fresh)))
    assert same(as_numpy(take(fresh, 5)), full[4:])
    jl.close()
    fresh.close()



@pytest.mark.parametrize("prefetch", [0, 2])
def test_state_is_computed_only_when_asked_for(monkeypatch, prefetch):
    """Each batch's state is the plain iterator's after as many batches, and no state (a digest,
    ~10 µs) is computed for batches whose state nobody asks for (issue 23)."""
    import portable_loader.loader as loader_module

    want = []
    plain = iter(loader())
    for _ in range(6):
        next(plain)
        want.append(plain.get_state())
    real, made = loader_module.make_state, []
    monkeypatch.setattr(loader_module, "make_state", lambda *a: made.append(1) or real(*a))
    with JaxLoader(loader(), prefetch=prefetch) as jl:
        take(jl, 3)
        assert made == []
        assert jl.state_dict() == want[2] and json.loads(jl.get_state()) == want[2]
        take(jl, 3)
        assert jl.state_dict() == want[5]
        assert len(made) == 3  # (closing a prefetching loader computes one more: it rewinds to it)
@pytest.mark.parametrize("prefetch", [0, 2])
def test_one_background_thread_builds_and_places(prefetch):
    # JaxLoader's prefetch thread runs the loader inline (no prefetch thread under it); with
    # prefetch=0 the loader's own prefetch thread is the one.
    with JaxLoader(loader(prefetch=2), prefetch=prefetch) as jl:
        got = as_numpy(take(iter(jl), 6))
        names = sorted(t.name for t in threading.enumerate() if t.name.startswith("portable_loader-") and t.is_alive())
    assert names == (["portable_loader-jax-prefetch"] if prefetch else ["portable_loader-prefetch"])
    assert same(got, take(iter(loader(prefetch=0)), 6))


def test_misaligned_shard_is_refused():
    with pytest.raises(ValueError, match="given shard 1/2"):
        JaxLoader(loader(shard_index=1, shard_count=2))


# --- a real two-process job -------------------------------------------------------------------


def run_job(cache, out, nproc, steps, *extra):
    from conftest import run_ranks

    os.makedirs(out, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # each process sets its own 4 devices
    run_ranks(os.path.join(HERE, "jax_dist_job.py"), nproc,
              lambda i, port: [cache, out, i, nproc, port, steps, *extra], env=env)
    batches = [dict() for _ in range(steps)]
    seen = [np.zeros(8, int) for _ in range(steps)]
    for i in range(nproc):
        z = np.load(os.path.join(out, f"process{i}.npz"))
        for name in z.files:
            if name.endswith("_rows"):
                continue
            field, step, _ = name.rsplit("_", 2)
            lo, hi = z[name + "_rows"]
            whole = batches[int(step)].setdefault(field, np.zeros((8, 64), dtype=z[name].dtype))
            whole[lo:hi] = z[name]
            if field == "input_ids":
                seen[int(step)][lo:hi] += 1
    assert all((s == 1).all() for s in seen), "every row held by exactly one device"
    return batches


@pytest.mark.slow
def test_two_process_job_matches_one_process_and_orbax_resumes_in_one(tmp_path):
    from conftest import SAMPLE

    cache = pl.precache(str(SAMPLE / "sample_chat.jsonl"), tokenizer=str(SAMPLE / "tokenizer"), format="chat",
                        out=str(tmp_path / "cache"))
    glob = take(iter(pl.DataLoader(pl.open_cache(cache), global_batch_size=8, seq_len=64, seed=3, packing=True)), 9)
    ckpt = str(tmp_path / "orbax")
    two = run_job(cache, str(tmp_path / "p2"), 2, 4, "save", ckpt)
    assert same(two, glob[:4])
    one = run_job(cache, str(tmp_path / "p1"), 1, 5, "load", ckpt)
    assert same(one, glob[4:9])


@pytest.mark.slow
def test_train_jax_resume_reproduces_the_loss_curve(tmp_path):
    script = os.path.join(os.path.dirname(HERE), "scripts", "train_jax.py")
    common = ["--cache-dir", str(tmp_path / "cache"), "--seq-len", "64", "--ckpt-every", "4"]

    def run(*extra):
        r = subprocess.run([sys.executable, script, *common, *extra], capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return [line for line in r.stdout.splitlines() if line.startswith("{")]

    full = run("--steps", "10")
    head = run("--steps", "5", "--ckpt", str(tmp_path / "ck"))
    tail = run("--steps", "10", "--ckpt", str(tmp_path / "ck"), "--resume")
    assert head + tail == full and len(full) == 10
