"""Workers hand batches over in shared memory: no copy in the trainer's process, a held batch never
overwritten, bounded memory, a dead worker reported on every path, safe start methods."""

import gc
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import portable_loader as pl
from portable_loader.engine import WorkerError
from portable_loader.engine import channel as channel_module
from portable_loader.engine import inline as inline_engine
from portable_loader.engine.workers import fork_hazard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def corpus(path, tokens=400_000, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 50_000, tokens).astype(np.uint16)
    ids[rng.choice(tokens, tokens // 700, replace=False)] = 0  # documents of ~700 tokens
    ids.tofile(path)
    return pl.pretokenized(str(path), eos_token_id=0)


def inline_batches(loader, n):
    ref = pl.DataLoader(loader.documents, **{**loader.options.kwargs(), "num_workers": 0, "prefetch": 0})
    with iter(ref) as it:
        return [next(it) for _ in range(n)]


def same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def batch_maps():
    """Mappings of batch blocks in this process (anonymous shared memory: nothing in /dev/shm)."""
    with open("/proc/self/maps") as f:
        return sum("portable_loader-batch" in line for line in f)


@pytest.mark.parametrize("packing", ["concat", True, False])
def test_batches_are_views_of_shared_memory_equal_to_inline(tmp_path, packing):
    docs = corpus(tmp_path / "c.bin")
    loader = pl.DataLoader(docs, global_batch_size=8, seq_len=512, packing=packing, num_workers=2, seed=3)
    ref = inline_batches(loader, 12)
    with iter(loader) as it:
        got = [next(it) for _ in range(12)]   # every batch held: none may be overwritten
        for b in got:
            assert all(not v.flags.owndata and v.base is not None for v in b.values())
    assert all(same(a, b) for a, b in zip(ref, got))


def kept(batch, how):
    """What a caller keeps of ``batch``: all of it, one field, a view of two rows, a memoryview."""
    if how == "batch":
        return batch
    if how == "field":
        return {"loss_mask": batch["loss_mask"]}
    if how == "rows":
        return {"input_ids": batch["input_ids"][1:3]}
    return {"segment_ids": memoryview(batch["segment_ids"])}


def same_kept(part, batch, how):
    return all(np.array_equal(np.asarray(v), kept(batch, how)[k]) for k, v in part.items())


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(keep=st.lists(st.sampled_from([None, "batch", "field", "rows", "memoryview"]), min_size=30, max_size=30),
       workers=st.integers(0, 3), prefetch=st.integers(0, 3))
def test_a_held_batch_is_never_overwritten(tmp_path_factory, keep, workers, prefetch):
    # (0 workers: the batches are collated in this process, into its own reused blocks: small ones too, here.
    # With workers a block hands out the same array objects again once nothing else refers to them:
    # a view or a memoryview of one field must hold the block as the whole batch does.)
    path = tmp_path_factory.mktemp("held") / "c.bin"
    docs = corpus(path, tokens=60_000)
    loader = pl.DataLoader(docs, global_batch_size=4, seq_len=256, packing="concat", num_workers=workers,
                           prefetch=prefetch, seed=1)
    ref = inline_batches(loader, len(keep))
    held = {}
    gc.collect()
    before = batch_maps()   # what earlier tests' garbage may still map
    with pytest.MonkeyPatch.context() as patch, iter(loader) as it:
        patch.setattr(inline_engine, "_POOLED_MIN", 0)
        for step, k in enumerate(keep):
            b = next(it)
            assert same(b, ref[step])
            if k:
                held[step] = kept(b, k)
            del b
        maps = batch_maps() - before
    for step, part in held.items():  # read after the others were served (and the engine closed)
        assert same_kept(part, ref[step], keep[step]), step
    # Blocks the caller dropped are reused: the pool stays at prefetch + 2 a worker, plus what is held.
    assert maps <= workers * (max(1, prefetch) + 2) + len(held)


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [0, 2])
def test_without_workers_a_batchs_memory_is_reused(tmp_path_factory, prefetch):
    # A corpus larger than the batches read from it: reading it leaves the allocator fresh memory to
    # hand out (with a small one, glibc happened to hand the same freed chunks back).
    docs = corpus(tmp_path_factory.getbasetemp() / "big.bin", tokens=20_000_000)
    loader = pl.DataLoader(docs, global_batch_size=64, seq_len=4096, packing="concat", prefetch=prefetch)
    pages = 64 * 4096 * 14 // 4096  # the batch's 14 bytes a token (five fields): 3.7 MB
    with iter(loader) as it:
        for _ in range(10):
            next(it)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(50):
            next(it)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50
    # A fresh allocation a batch faults in each of its pages when it is written; a reused one, none.
    assert faults < pages / 10, (faults, pages)


def test_a_block_served_in_another_layout_stays_held_by_the_old_arrays():
    from portable_loader.engine.blocks import Layout, Pool
    fields = ("input_ids", "loss_mask")
    pool = Pool(keep=2)
    big, small = Layout.of(4, 8, fields), Layout.of(2, 8, fields)
    block, _ = pool.take(big.size)
    pool.done(block)
    old = pool.arrays(block, big)["loss_mask"]
    old[:] = 7
    assert block.held()
    assert pool.arrays(block, small)["loss_mask"].shape == (2, 8)   # the batch size changed (a schedule)
    assert block.held()   # ``old`` is not among the arrays the block keeps now, and still views it
    assert pool.take(big.size)[0] is not block
    del old
    assert not block.held()
    # What a caller does to its arrays in place stays with them: the next batch has its own shape and flags.
    first = pool.arrays(block, big)
    first["input_ids"].shape = (-1,)
    first["loss_mask"].flags.writeable = False
    del first
    again = pool.arrays(block, big)
    assert again["input_ids"].shape == (4, 8) and again["loss_mask"].flags.writeable
    del again
    pool.close()


@pytest.mark.slow
def test_memory_is_bounded_and_freed(tmp_path):
    docs = corpus(tmp_path / "c.bin")
    loader = pl.DataLoader(docs, global_batch_size=8, seq_len=512, packing="concat", num_workers=2, prefetch=2)
    gc.collect()
    before = batch_maps()
    with iter(loader) as it:
        for _ in range(200):
            next(it)
        during = batch_maps() - before
    assert 1 <= during <= 2 * (2 + 2)
    assert batch_maps() == before   # freed at close, nothing held


def test_no_batch_bytes_travel_through_the_channel(tmp_path, monkeypatch):
    received = []
    recv_bytes = channel_module.Channel.recv_bytes

    def counting(self):
        payload, fds = recv_bytes(self)
        received.append(len(payload))
        return payload, fds

    monkeypatch.setattr(channel_module.Channel, "recv_bytes", counting)
    docs = corpus(tmp_path / "c.bin", tokens=2_000_000)
    loader = pl.DataLoader(docs, global_batch_size=32, seq_len=4096, packing="concat", num_workers=2)
    with iter(loader) as it:
        batches = [next(it) for _ in range(10)]
    size = sum(v.nbytes for v in batches[0].values())
    assert size > 1_500_000
    assert len(received) >= 10 and max(received) < 1000, received   # a one-line answer a batch


# --- a dead worker, on every path -------------------------------------------------------------------

KILL_JOB = """
import os, signal, sys, time
import numpy as np
import portable_loader as pl
from portable_loader.engine import WorkerError
kind = sys.argv[1]
rng = np.random.default_rng(0)
ids = rng.integers(1, 50_000, 3_000_000).astype(np.uint16); ids[::900] = 0; ids.tofile("c.bin")
if kind == "tokenized":
    from portable_loader.precache import sample_args
    src, opts = pl.tokenized(**sample_args()), dict(global_batch_size=8, seq_len=256, packing=True, packing_window=64)
elif kind == "mp_prefetch":
    src = None
else:
    src = pl.pretokenized("c.bin", eos_token_id=0)
    packing = {"concat": "concat", "packed": True, "padded": False}[kind]
    opts = dict(global_batch_size=64, seq_len=4096, packing=packing)
if src is None:
    from portable_loader import grain
    ds = grain.MapDataset.range(100_000).map(lambda x: np.full(100_000, x)).to_iter_dataset()
    it = iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))
else:
    it = iter(pl.DataLoader(src, num_workers=2, **opts))
for _ in range(3):
    next(it)
import psutil
kids = [p for p in psutil.Process().children(recursive=True) if "forkserver" not in " ".join(p.cmdline())]
os.kill(kids[0].pid, signal.SIGKILL)
t = time.monotonic()
try:
    for _ in range(10_000):
        next(it)
except WorkerError as e:
    print("raised after", round(time.monotonic() - t, 2), "s:", e)
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["concat", "packed", "padded", "tokenized", "mp_prefetch"])
def test_a_killed_worker_is_reported_on_every_path(tmp_path, kind):
    job = tmp_path / "job.py"
    job.write_text(KILL_JOB)
    r = subprocess.run([sys.executable, str(job), kind], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "raised after" in r.stdout and "was terminated unexpectedly with exit code -9 (signal SIGKILL)" in r.stdout, r.stdout + r.stderr
    assert float(r.stdout.split("raised after")[1].split()[0]) < 5


# --- start methods --------------------------------------------------------------------------------

def test_a_threaded_parent_does_not_fork(tmp_path):
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="trainer-thread")
    t.start()
    try:
        assert "trainer-thread" in fork_hazard()
        docs = corpus(tmp_path / "c.bin", tokens=50_000)
        loader = pl.DataLoader(docs, global_batch_size=4, seq_len=128, packing="concat", num_workers=2)
        with iter(loader) as it:
            got = [next(it) for _ in range(5)]
            assert it._engine.start_method in ("forkserver", "spawn")
    finally:
        stop.set()
        t.join()
    assert all(same(a, b) for a, b in zip(inline_batches(loader, 5), got))


JAX_JOB = """
import warnings, threading
warnings.simplefilter("error")               # a fork warning would fail the job
import jax, jax.numpy as jnp, numpy as np
import portable_loader as pl
x = jnp.arange(1000.0).sum()                 # the backend and its threads are running
rng = np.random.default_rng(0)
rng.integers(1, 1000, 50_000).astype(np.uint16).tofile("c.bin")
docs = pl.pretokenized("c.bin", eos_token_id=0)
kw = dict(global_batch_size=4, seq_len=128, packing="concat", seed=2)
with iter(pl.DataLoader(docs, num_workers=2, **kw)) as it:
    got = [next(it) for _ in range(6)]
    method = it._engine.start_method
with iter(pl.DataLoader(docs, **kw)) as it:
    ref = [next(it) for _ in range(6)]
assert all(np.array_equal(a[k], b[k]) for a, b in zip(got, ref) for k in a)
print("ok", method)
"""


@pytest.mark.slow
def test_jax_with_workers_no_fork_warning(tmp_path):
    pytest.importorskip("jax")
    job = tmp_path / "job.py"
    job.write_text(JAX_JOB)   # no `if __name__ == "__main__"`: workers must not run the script again
    r = subprocess.run([sys.executable, str(job)], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ok", "forkserver"], r.stdout
    assert r.stderr == ""


def test_a_dataset_that_cannot_travel_is_named(monkeypatch):
    monkeypatch.setenv("PORTABLE_LOADER_START_METHOD", "forkserver")

    class Locked:
        def __init__(self):
            self.lock = threading.Lock()

        def __call__(self, r):
            return r

    src = pl.source([{"input_ids": np.arange(5)}] * 20).map(Locked(), name="locked")
    with pytest.raises(TypeError, match=r"cannot be sent to the loader's worker processes.*lock"):
        next(iter(pl.DataLoader(src, global_batch_size=4, seq_len=8, num_workers=2)))


def test_shared_memory_too_small_is_a_clear_error(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent("""
        import resource, signal
        import numpy as np
        import portable_loader as pl
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))   # a shared-memory block may not pass 1 MiB
        src = [{"input_ids": np.arange(50)}] * 100
        try:
            next(iter(pl.DataLoader(src, global_batch_size=64, seq_len=4096, num_workers=2)))
        except OSError as e:
            print("error:", e)
    """))
    r = subprocess.run([sys.executable, str(job)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "shared-memory block" in r.stdout and "num_workers" in r.stdout, r.stdout + r.stderr


@settings(max_examples=15, deadline=None)
@given(packing=st.sampled_from(["concat", True, False]), batch=st.integers(1, 9), seed=st.integers(0, 1000),
       epochs=st.sampled_from([1, None]))
def test_a_reused_blocks_old_bytes_never_show_through(tmp_path_factory, packing, batch, seed, epochs):
    from portable_loader.collate import FIELD_DTYPES, collating_into
    from portable_loader.engine import build_batch
    from portable_loader.plan import Cursor
    from portable_loader.step_plans import StepPlans

    path = tmp_path_factory.getbasetemp() / "garbage.bin"  # 31 windows: a finite stream's last step pads
    docs = corpus(path, tokens=3_000) if not path.exists() else pl.pretokenized(str(path), eos_token_id=0)
    loader = pl.DataLoader(docs, global_batch_size=batch, seq_len=96, packing=packing, seed=seed, num_epochs=epochs)
    spec = loader.spec
    plans = StepPlans(spec, loader.planner(), Cursor(0, 0, 0))

    def dirty(name, size):  # memory as a block left by an earlier batch: anything
        dtype = FIELD_DTYPES[name]
        return np.full(size, 0x5A5A5A5A if dtype.itemsize == 4 else 0x5A, dtype)

    for _ in range(40):
        planned = plans.next()
        if planned is None:
            break
        rows = planned[0]
        want = build_batch(loader.source, rows, spec.seq_len, spec.pad_id, spec.fields)
        with collating_into(dirty):
            got = build_batch(loader.source, rows, spec.seq_len, spec.pad_id, spec.fields)
        assert same(want, got)
