"""TorchLoader: async collation byte-identical to serial, consumed-batch state, HF fields against a
per-token oracle, failures and shutdown, torch.save and DCP round trips, a real gloo job."""

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import portable_loader as pl
from portable_loader.adapters.torch import TorchLoader, hf_fields
from test_loader import Exploding, make_source

HERE = os.path.dirname(os.path.abspath(__file__))
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def loader(src=None, **kw):
    cfg = dict(global_batch_size=4, seq_len=32, seed=5, packing=True, packing_window=16)
    cfg.update(kw)
    return pl.DataLoader(src if src is not None else make_source(30), **cfg)


def as_numpy(batches):
    return [{k: v.cpu().numpy() for k, v in b.items()} for b in batches]


def same(a, b):
    return len(a) == len(b) and all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packing", [False, True])
def test_async_and_serial_batches_are_byte_identical_over_epochs(device, packing):
    kw = dict(packing=packing, num_epochs=3)
    with TorchLoader(loader(**kw), device=device, async_collation=False) as serial:
        a = as_numpy(list(serial))
    with TorchLoader(loader(**kw), device=device, async_collation=True) as async_:
        b = as_numpy(list(async_))
    numpy_batches = list(iter(loader(**kw)))
    assert len(a) == len(numpy_batches) > 12
    assert same(a, b) and same(a, numpy_batches)
    assert a[0]["input_ids"].dtype == np.int32 and a[0]["loss_mask"].dtype == np.uint8


@pytest.mark.parametrize("async_collation", [False, True])
def test_one_background_thread_builds_and_converts(async_collation):
    # The collator thread runs the loader inline: a prefetch thread under it would hand every
    # batch across twice. Without async collation, the loader's own prefetch thread is the one.
    def building_threads():
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("portable_loader-") and t.is_alive())

    with TorchLoader(loader(prefetch=2), device="cpu", async_collation=async_collation) as tl:
        got = as_numpy(_take(iter(tl), 6))
        names = building_threads()
    assert names == (["portable_loader-torch-collator"] if async_collation else ["portable_loader-prefetch"])
    assert same(got, _take(iter(loader(prefetch=0)), 6))


@pytest.mark.parametrize("async_collation", [False, True])
def test_state_is_that_of_consumed_batches_across_epoch_boundaries(async_collation, tmp_path):
    src = make_source(24)
    kw = dict(packing=False, global_batch_size=4)  # 6 steps per epoch
    full = as_numpy(list(_take(TorchLoader(loader(src, **kw), async_collation=False), 20)))
    for n in (5, 6, 7, 12):
        tl = TorchLoader(loader(src, **kw), async_collation=async_collation)
        head = as_numpy(_take(tl, n))
        # The collator has already prepared step n+1; the state must still say "after step n".
        torch.save({"data": tl.state_dict()}, tmp_path / "ckpt.pt")
        tl.close()
        fresh = TorchLoader(loader(src, **kw), async_collation=async_collation)
        fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt")["data"])
        assert same(head + as_numpy(_take(fresh, 20 - n)), full)
        fresh.close()


def test_close_rewinds_to_the_last_batch_returned():
    tl = TorchLoader(loader(), async_collation=True)
    first = as_numpy(_take(tl, 3))
    tl.close()  # drops the prepared batch 4
    rest = as_numpy(_take(tl, 3))
    tl.close()
    assert same(first + rest, as_numpy(_take(TorchLoader(loader(), async_collation=False), 6)))


def _take(it, k):
    return [next(it) for _ in range(k)]


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("async_collation", [False, True])
def test_batches_held_are_their_own_and_equal_the_numpy_loaders_bit_for_bit(tmp_path, packing, async_collation):
    # Over a cache (the spans path: the packed default's five-field loop) and over records.
    from conftest import SAMPLE

    cache = pl.open_cache(pl.precache(str(SAMPLE / "sample_chat.jsonl"), tokenizer=str(SAMPLE / "tokenizer"),
                                      format="chat", out=str(tmp_path / "cache")))
    for src in (cache, make_source(30)):
        kw = dict(packing=packing, num_epochs=2, seq_len=64)
        want = list(iter(loader(src, **kw)))
        with TorchLoader(loader(src, **kw), device="cpu", async_collation=async_collation) as tl:
            held = [(b, {k: v.clone() for k, v in b.items()}) for b in tl]  # a copy as each is received
        assert len(held) == len(want) > 4
        for (batch, at_receipt), w in zip(held, want):
            assert list(batch) == list(w)
            for k, t in batch.items():
                # Unchanged by the batches taken after it: no buffer is reused under a batch held.
                assert torch.equal(t, at_receipt[k]) and t.is_contiguous()
                assert t.numpy().dtype == w[k].dtype and np.array_equal(t.numpy(), w[k])
        tensors = [t for batch, _ in held for t in batch.values()]
        assert len({t.data_ptr() for t in tensors}) == len(tensors)  # every field of every batch its own memory


def test_hf_fields_against_a_per_token_oracle():
    b = next(iter(loader(make_source(40), packing=True, seq_len=48)))
    got = hf_fields(b)
    rows, cols = b["input_ids"].shape
    for r in range(rows):
        for c in range(cols):
            real = b["segment_ids"][r, c] > 0
            starts_doc = real and b["positions"][r, c] == 0
            want = int(b["input_ids"][r, c]) if real and b["loss_mask"][r, c] and not starts_doc else -100
            assert got["labels"][r, c] == want
            assert got["attention_mask"][r, c] == int(real)
            assert got["position_ids"][r, c] == b["positions"][r, c]
    assert all(v.dtype == np.int64 for v in got.values())
    with TorchLoader(loader(make_source(40), packing=True, seq_len=48), hf_labels=True) as tl:
        t = next(tl)
    assert set(t) == {"input_ids", "labels", "attention_mask", "position_ids"}
    assert np.array_equal(t["labels"].numpy(), got["labels"])


def test_background_failure_surfaces_with_traceback_and_shutdown_joins():
    before = threading.active_count()
    src = Exploding(20, bad=int(pl.LCGSampler(20, seed=5).record_indices([6])[0]))
    tl = TorchLoader(loader(src, packing=False, prefetch=0), async_collation=True)
    with pytest.raises(KeyError, match="poisoned") as e:
        _take(tl, 10)
    assert any("__getitem__" in str(frame.name) for frame in e.traceback)
    tl.close()
    with pytest.raises(RuntimeError, match="step failed"):
        with TorchLoader(loader(), async_collation=True) as tl2:
            next(tl2)
            raise RuntimeError("training step failed")
    assert threading.active_count() <= before


def test_bad_device_and_foreign_state_are_refused():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            TorchLoader(loader(), device="cuda")
    tl = TorchLoader(loader())
    next(tl)
    state = tl.state_dict()
    tl.close()
    with pytest.raises(ValueError, match="another source or config.*seed"):
        TorchLoader(loader(seed=6)).load_state_dict(state)
    with pytest.raises(ValueError, match="not a TorchLoader state"):
        TorchLoader(loader()).load_state_dict({"step": 3})


def test_dcp_round_trip_single_process(tmp_path):
    import torch.distributed.checkpoint as dcp

    tl = TorchLoader(loader(), async_collation=True)
    _take(tl, 7)
    dcp.save({"data": tl}, checkpoint_id=str(tmp_path / "ckpt"))
    want = as_numpy(_take(tl, 5))
    tl.close()
    fresh = TorchLoader(loader(), async_collation=True)
    dcp.load({"data": fresh}, checkpoint_id=str(tmp_path / "ckpt"))
    assert same(as_numpy(_take(fresh, 5)), want)
    fresh.close()


# --- a real multi-process job ---------------------------------------------------------------------


def run_job(cache, out, world, steps, *extra):
    from conftest import run_ranks

    os.makedirs(out, exist_ok=True)
    run_ranks(os.path.join(HERE, "torch_dist_job.py"), world, lambda r, port: [cache, out, r, world, port, steps, *extra])
    ranks = [np.load(os.path.join(out, f"rank{r}.npz")) for r in range(world)]
    keys = sorted({k.rsplit("_", 1)[0] for k in ranks[0].files})
    return [{k: np.concatenate([z[f"{k}_{i}"] for z in ranks]) for k in keys} for i in range(steps)]


@pytest.mark.slow
def test_gloo_world_2_matches_world_1_and_dcp_resumes_at_1_and_4(tmp_path):
    from conftest import SAMPLE

    cache = pl.precache(str(SAMPLE / "sample_chat.jsonl"), tokenizer=str(SAMPLE / "tokenizer"), format="chat",
                        out=str(tmp_path / "cache"))
    glob = as_numpy(_take(TorchLoader(pl.DataLoader(pl.open_cache(cache), global_batch_size=8, seq_len=64, seed=3,
                                                    packing=True), async_collation=False), 10))
    ckpt = str(tmp_path / "dcp")
    two = run_job(cache, str(tmp_path / "w2"), 2, 4, "save", ckpt)
    assert same(two, glob[:4])  # the union of the ranks' rows is the world-1 global batch
    for world in (1, 4):
        resumed = run_job(cache, str(tmp_path / f"r{world}"), world, 6, "load", ckpt)
        assert same(resumed, glob[4:10]), world


@pytest.mark.slow
def test_train_torch_resume_reproduces_the_loss_curve(tmp_path):
    script = os.path.join(os.path.dirname(HERE), "scripts", "train_torch.py")
    common = ["--cache-dir", str(tmp_path / "cache"), "--seq-len", "64", "--ckpt-every", "4"]

    def run(*extra):
        r = subprocess.run([sys.executable, script, *common, *extra], capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert r.returncode == 0, r.stderr
        return [line for line in r.stdout.splitlines() if line.startswith("{")]

    full = run("--steps", "12")
    head = run("--steps", "6", "--ckpt", str(tmp_path / "ck.pt"))  # checkpoints at 4 and at the end, 6
    tail = run("--steps", "12", "--ckpt", str(tmp_path / "ck.pt"), "--resume")
    assert head + tail == full  # bit-identical losses: nothing skipped, nothing repeated
    first, last = json.loads(full[0]), json.loads(full[-1])
    assert len(full) == 12 and last["loss"] < first["loss"]
