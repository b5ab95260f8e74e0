"""DataLoader invariants against oracles: pure-function batches, exact resume, worker and host
independence, every record (or token) once per epoch, O(1) state, refusal of foreign states, no leaks."""

import json
import signal
import threading

import numpy as np
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portable_loader as pl
from portable_loader.orders.sampler import LCGSampler
from portable_loader import collate as C
from portable_loader.engine import WorkerError
from conftest import loader_processes
from test_exit import held_shm, made_by, shm

TOKEN_BASE = 10_000  # record r's tokens are r*TOKEN_BASE + 0, 1, 2, ...: every token is unique


def make_source(n, seed=0, max_len=40):
    rng = np.random.default_rng(seed)
    out = []
    for r in range(n):
        size = int(rng.integers(1, max_len))
        mask = (rng.random(size) < 0.7).astype(np.uint8)
        out.append({"input_ids": (r * TOKEN_BASE + np.arange(size)).astype(np.int32), "loss_mask": mask})
    return out


def take(it, k):
    return [next(it) for _ in range(k)]


def same(a, b):
    return len(a) == len(b) and all(all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def concat(batches):
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


# --- the padding-mode oracle ------------------------------------------------------------------


def reference_padded_batch(src, step, batch, seq_len, seed, num_epochs=None):
    n = len(src)
    sampler = LCGSampler(n, seed=seed)
    ids = np.zeros((batch, seq_len), np.int32)
    mask = np.zeros((batch, seq_len), np.uint8)
    seg = np.zeros((batch, seq_len), np.int32)
    pos = np.zeros((batch, seq_len), np.int32)
    for row in range(batch):
        p = step * batch + row
        if num_epochs is not None and p >= num_epochs * n:
            continue
        rec = src[int(sampler.record_indices([p % n], epoch=p // n)[0])]
        size = min(seq_len, rec["input_ids"].size)
        ids[row, :size] = rec["input_ids"][:size]
        mask[row, :size] = rec["loss_mask"][:size]
        seg[row, :size] = 1
        pos[row, :size] = np.arange(size)
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": seg.astype(np.uint8), "segment_ids": seg,
            "positions": pos}


def test_padded_batches_equal_the_oracle_across_epochs():
    src = make_source(37)
    loader = pl.DataLoader(src, global_batch_size=8, seq_len=24, seed=3, prefetch=0)
    got = take(iter(loader), 12)  # 96 positions: two epoch boundaries inside batches
    want = [reference_padded_batch(src, s, 8, 24, seed=3) for s in range(12)]
    assert same(got, want)
    assert all(set(b) == {"input_ids", "loss_mask", "attention_mask"} for b in got)  # padded default


@pytest.mark.parametrize("fields", [
    ["input_ids", "attention_mask"],
    ["input_ids", "loss_mask", "segment_ids", "positions"],
    ["positions", "segment_ids", "attention_mask", "loss_mask", "input_ids"],
])
@pytest.mark.parametrize("packing", [False, True])
def test_fields_asked_for_are_the_fields_of_all_fields(fields, packing):
    # Any subset is the same arrays as the full set, with the others left out.
    src = make_source(41)
    kw = dict(global_batch_size=4, seq_len=32, seed=5, packing=packing, prefetch=0)
    full = take(iter(pl.DataLoader(src, fields=C.FIELDS, **kw)), 6)
    some = take(iter(pl.DataLoader(src, fields=fields, **kw)), 6)
    assert all(set(b) == set(fields) for b in some)
    assert same(some, full)
    if not packing:
        assert same(full, [reference_padded_batch(src, s, 4, 32, seed=5) for s in range(6)])


@pytest.mark.parametrize("fields", ["input_ids", ["loss_mask", "attention_mask"], ["input_ids", "positions"],
                                    ["input_ids", "attention_mask", "labels"]])
def test_bad_fields_are_refused_by_name(fields):
    with pytest.raises(ValueError, match="fields"):
        pl.DataLoader(make_source(5), global_batch_size=2, seq_len=8, fields=fields)


def test_finite_stream_ends_with_a_padded_partial_batch_and_every_record_once():
    src = make_source(37)
    loader = pl.DataLoader(src, global_batch_size=8, seq_len=64, seed=1, num_epochs=2)
    with iter(loader) as it:
        batches = list(it)
    assert len(batches) == 10  # ceil(74 / 8)
    last = batches[-1]
    assert (last["attention_mask"][2:] == 0).all() and (last["loss_mask"][2:] == 0).all()
    assert all(b["input_ids"].shape == (8, 64) for b in batches)  # static shape: no recompiles
    firsts = concat(batches)["input_ids"][:, 0][concat(batches)["attention_mask"][:, 0] > 0] // TOKEN_BASE
    assert sorted(firsts[:37].tolist()) == list(range(37)) and sorted(firsts[37:].tolist()) == list(range(37))
    assert firsts[:37].tolist() != firsts[37:].tolist()  # a fresh order each epoch
    assert same(batches, [reference_padded_batch(src, s, 8, 64, 1, num_epochs=2) for s in range(10)])


def test_evaluation_pass_is_in_order():
    src = make_source(10)
    loader = pl.DataLoader(src, global_batch_size=4, seq_len=64, shuffle=False, num_epochs=1)
    rows = concat(list(iter(loader)))
    assert (rows["input_ids"][:10, 0] // TOKEN_BASE).tolist() == list(range(10))


# --- packing ----------------------------------------------------------------------------------


def check_packed_rows(batch, src):
    """Each segment is a contiguous slice of one record, with positions 0..n-1 and its own mask."""
    for r in range(batch["input_ids"].shape[0]):
        seg = batch["segment_ids"][r]
        for s in np.unique(seg[seg > 0]):
            where = np.flatnonzero(seg == s)
            assert (np.diff(where) == 1).all()
            toks = batch["input_ids"][r, where]
            rec = src[int(toks[0] // TOKEN_BASE)]
            start = int(toks[0] % TOKEN_BASE)
            assert toks.tolist() == rec["input_ids"][start : start + where.size].tolist()
            assert batch["loss_mask"][r, where].tolist() == rec["loss_mask"][start : start + where.size].tolist()
            assert batch["positions"][r, where].tolist() == list(range(where.size))
        pad = seg == 0
        assert (batch["loss_mask"][r, pad] == 0).all() and (batch["positions"][r, pad] == 0).all()


@pytest.mark.parametrize("window", [7, 64, 1024])
def test_packing_covers_every_token_once_per_epoch(window):
    src = make_source(150, max_len=60)
    # A list source gets overlong="truncate" by default (it could be SFT data); this test is about
    # splitting, which keeps every token.
    loader = pl.DataLoader(src, global_batch_size=4, seq_len=32, seed=5, packing=True, num_epochs=2,
                           packing_window=window, overlong="split")
    batches = list(iter(loader))
    for b in batches:
        check_packed_rows(b, src)
    tokens = concat(batches)["input_ids"][concat(batches)["segment_ids"] > 0]
    expected = np.concatenate([r["input_ids"] for r in src])
    assert sorted(tokens.tolist()) == sorted(np.concatenate([expected, expected]).tolist())


@pytest.mark.slow
def test_packing_efficiency_on_real_alpaca_beats_grain(tmp_path):
    from conftest import DATA, PHI3, need

    path = pl.precache(need(DATA / "alpaca" / "llamafactory_alpaca_en_demo.json"), tokenizer=need(PHI3),
                       format="alpaca", out=tmp_path, max_length=2048)
    src = pl.open_cache(path)
    # Three epochs of the endless stream: the padding rows that keep a finite stream's last batch at
    # its static shape are not packing's doing.
    loader = pl.DataLoader(src, global_batch_size=8, seq_len=2048, seed=0, packing=True)
    with iter(loader) as it:
        seg = concat(take(it, 3 * 232_000 // (8 * 2048)))["segment_ids"]
        assert it.stats["packing_efficiency"] == pytest.approx((seg > 0).mean())
    ours = (seg > 0).mean()
    assert ours >= 0.95
    import grain.python as grain
    from grain.experimental import FirstFitPackIterDataset

    ds = grain.MapDataset.source(src).shuffle(seed=0).map(lambda r: {"input_ids": r["input_ids"]}).to_iter_dataset()
    packed = FirstFitPackIterDataset(ds, length_struct={"input_ids": 2048}, num_packing_bins=8)
    theirs = np.mean([(p["input_ids_segment_ids"] > 0).mean() for p in packed])
    assert ours >= theirs, (ours, theirs)


# --- exact resume -----------------------------------------------------------------------------


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(packing=st.booleans(), n=st.integers(5, 80), batch=st.sampled_from([1, 2, 4, 8]), k=st.integers(0, 30),
       epochs=st.sampled_from([None, 3]), workers=st.sampled_from([0, 2]))
def test_resume_after_any_step_matches_uninterrupted(packing, n, batch, k, epochs, workers):
    src = make_source(n, seed=n)
    kw = dict(global_batch_size=batch, seq_len=24, seed=7, packing=packing, num_epochs=epochs, packing_window=16)
    full = list(_limited(iter(pl.DataLoader(src, prefetch=0, **kw)), k + 6))
    with iter(pl.DataLoader(src, num_workers=workers, **kw)) as it:
        head = list(_limited(it, k))
        state = json.loads(json.dumps(it.get_state()))  # through JSON, as a checkpoint would
    assert len(json.dumps(state)) < 1024
    with iter(pl.DataLoader(src, num_workers=workers, **kw)) as it2:
        it2.set_state(state)
        assert same(head + list(_limited(it2, 6)), full)


def _limited(it, k):
    for _ in range(k):
        try:
            yield next(it)
        except StopIteration:
            return


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True])
def test_resume_with_workers_at_epoch_boundaries(packing):
    src = make_source(24)
    kw = dict(global_batch_size=4, seq_len=24, seed=2, packing=packing, packing_window=8)
    with iter(pl.DataLoader(src, **kw)) as it:
        full = take(it, 20)
    for k in (5, 6, 7, 12, 13):  # 24 / 4 = 6 steps per epoch in padding mode
        with iter(pl.DataLoader(src, num_workers=2, **kw)) as it:
            take(it, k)
            state = it.state_dict()
        with iter(pl.DataLoader(src, num_workers=2, **kw)) as it2:
            it2.load_state_dict(state)
            assert same(take(it2, 20 - k), full[k:])


def test_set_state_of_a_finished_stream_stops():
    src = make_source(9)
    loader = pl.DataLoader(src, global_batch_size=4, seq_len=8, num_epochs=1)
    it = iter(loader)
    list(it)
    it2 = iter(loader)
    it2.set_state(it.get_state())
    with pytest.raises(StopIteration):
        next(it2)


def test_set_state_is_o1_far_into_the_stream():
    from portable_loader.plan import Cursor
    from portable_loader.state import make_state

    src = make_source(50)
    loader = pl.DataLoader(src, global_batch_size=4, seq_len=16, seed=1, prefetch=0)
    it = iter(loader)
    # Editing "step" by hand is refused (the digest): a state far ahead is made the way get_state makes one.
    state = make_state(loader, Cursor(10**9, 0, 0))
    it.set_state(state)
    got = next(it)
    assert same([got], [reference_padded_batch(src, 10**9, 4, 16, seed=1)])


def test_foreign_states_are_refused():
    src = make_source(20)
    it = iter(pl.DataLoader(src, global_batch_size=4, seq_len=16, seed=0))
    next(it)
    state = it.get_state()
    for kw, word in [(dict(seed=1), "seed"), (dict(seq_len=32), "seq_len"), (dict(packing=True), "packing")]:
        cfg = {**dict(global_batch_size=4, seq_len=16, seed=0), **kw}
        with pytest.raises(ValueError, match=f"another source or config.*{word}"):
            iter(pl.DataLoader(src, **cfg)).set_state(state)
    with pytest.raises(ValueError, match="source differs"):
        iter(pl.DataLoader(make_source(21), global_batch_size=4, seq_len=16, seed=0)).set_state(state)
    with pytest.raises(ValueError, match="version"):
        iter(pl.DataLoader(src, global_batch_size=4, seq_len=16, seed=0)).set_state(dict(state, version=99))
    it.close()


@pytest.mark.slow
def test_cache_source_fingerprint_tracks_the_cache(tmp_path):
    from conftest import DATA, GPT2, need

    a = pl.open_cache(pl.precache(need(DATA / "text" / "llamafactory_c4_demo.jsonl"), tokenizer=need(GPT2),
                                  format="text", out=tmp_path, max_length=64))
    b = pl.open_cache(pl.precache(need(DATA / "text" / "llamafactory_c4_demo.jsonl"), tokenizer=need(GPT2),
                                  format="text", out=tmp_path, max_length=128))
    state = iter(pl.DataLoader(a, global_batch_size=2, seq_len=64)).get_state()
    with pytest.raises(ValueError, match="source differs"):
        iter(pl.DataLoader(b, global_batch_size=2, seq_len=64)).set_state(state)


# --- independence of workers, prefetch and hosts ----------------------------------------------


@pytest.mark.parametrize("packing", [False, True])
def test_stream_is_identical_for_any_workers_and_prefetch(packing):
    src = make_source(60)
    kw = dict(global_batch_size=4, seq_len=32, seed=4, packing=packing, packing_window=16, num_epochs=2)
    base = list(iter(pl.DataLoader(src, prefetch=0, **kw)))
    for workers, prefetch in [(0, 3), (1, 1), (2, 2), (4, 1)]:
        with iter(pl.DataLoader(src, num_workers=workers, prefetch=prefetch, **kw)) as it:
            assert same(list(it), base), (workers, prefetch)


@pytest.mark.parametrize("packing", [False, True])
def test_host_slices_concatenate_to_the_global_batch_and_resume_elastically(packing):
    src = make_source(45)
    kw = dict(global_batch_size=8, seq_len=24, seed=9, packing=packing, packing_window=20)
    glob = take(iter(pl.DataLoader(src, **kw)), 14)
    for hosts in (1, 2, 4):
        parts = [take(iter(pl.DataLoader(src, shard_index=k, shard_count=hosts, **kw)), 14) for k in range(hosts)]
        for s in range(14):
            assert same([{k: np.concatenate([p[s][k] for p in parts]) for k in glob[s]}], [glob[s]])
    # A state saved by host 0 of 2 mid-epoch continues the same global stream on 4 hosts and on 1.
    it = iter(pl.DataLoader(src, shard_index=0, shard_count=2, **kw))
    take(it, 5)
    state = it.get_state()
    for hosts in (4, 1):
        parts = []
        for k in range(hosts):
            resumed = iter(pl.DataLoader(src, shard_index=k, shard_count=hosts, **kw))
            resumed.set_state(state)
            parts.append(take(resumed, 9))
        for s in range(9):
            assert same([{k: np.concatenate([p[s][k] for p in parts]) for k in glob[0]}], [glob[5 + s]])


def test_indivisible_global_batch_is_refused():
    with pytest.raises(ValueError, match="not divisible by shard_count 3"):
        pl.DataLoader(make_source(5), global_batch_size=8, seq_len=8, shard_index=0, shard_count=3)


def test_grain_map_dataset_source():
    import grain.python as grain

    src = make_source(30)
    mapped = grain.MapDataset.source(src).map(lambda r: {**r, "input_ids": r["input_ids"] + 1})
    a = take(iter(pl.DataLoader(mapped, global_batch_size=4, seq_len=16, seed=0)), 3)
    b = take(iter(pl.DataLoader(src, global_batch_size=4, seq_len=16, seed=0)), 3)
    for x, y in zip(a, b):
        live = x["attention_mask"] > 0
        assert np.array_equal(x["input_ids"][live], y["input_ids"][live] + 1)


# --- errors and leaks -------------------------------------------------------------------------


class Exploding:
    def __init__(self, n, bad):
        self.data, self.bad = make_source(n), bad

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if i == self.bad:
            raise KeyError(f"record {i} is poisoned")
        return self.data[i]


def resources():
    """Worker processes, threads, and the /dev/shm entries this process and its workers made or hold
    (the machine is shared: other programs' entries come and go and are not counted)."""
    children = loader_processes()
    procs = [psutil.Process(), *children]
    held, pids = held_shm(procs), {str(p.pid) for p in procs}
    return len(children), threading.active_count(), {e for e in shm() if made_by(e, pids, held, tag="none")}


def assert_no_leaks(before):
    import time

    for _ in range(50):  # give exiting threads a moment
        now = resources()
        if now[0] == before[0] and now[1] <= before[1] and now[2] <= before[2]:
            return
        time.sleep(0.1)
    assert now[0] == before[0], "child process left behind"
    assert now[1] <= before[1], "thread left behind"
    assert now[2] <= before[2], f"/dev/shm entries left: {now[2] - before[2]}"


@pytest.mark.parametrize("workers,prefetch", [(0, 0), (0, 2), (2, 2)])
def test_worker_exception_reaches_the_caller_with_its_traceback(workers, prefetch):
    before = resources()
    src = Exploding(20, bad=int(LCGSampler(20, seed=0).record_indices([9])[0]))
    it = iter(pl.DataLoader(src, global_batch_size=4, seq_len=8, num_workers=workers, prefetch=prefetch))
    with pytest.raises((KeyError, WorkerError)) as e:
        take(it, 5)
    assert "poisoned" in str(e.value)
    if workers:
        assert "in __getitem__" in str(e.value) and "raise KeyError" in str(e.value)
    it.close()
    assert_no_leaks(before)


@pytest.mark.parametrize("workers", [0, 2])
def test_no_leaks_after_close_exception_and_keyboard_interrupt(workers):
    src = make_source(40)
    before = resources()
    loader = pl.DataLoader(src, global_batch_size=4, seq_len=16, num_workers=workers, prefetch=2)
    with iter(loader) as it:
        take(it, 3)
    assert_no_leaks(before)
    with pytest.raises(RuntimeError):
        with iter(loader) as it:
            take(it, 2)
            raise RuntimeError("training step failed")
    assert_no_leaks(before)
    with pytest.raises(KeyboardInterrupt):
        with iter(loader) as it:
            take(it, 2)
            signal.raise_signal(signal.SIGINT)
    assert_no_leaks(before)


def test_killed_worker_is_reported_not_waited_for():
    src = make_source(40)
    before = resources()
    others = {p.pid for p in loader_processes()}  # what earlier tests left running is not ours to kill
    it = iter(pl.DataLoader(src, global_batch_size=4, seq_len=16, num_workers=2, prefetch=1))
    take(it, 2)
    victim = next(p for p in loader_processes() if p.pid not in others)
    victim.kill()  # like the OOM killer: the zombie is left for the loader to find
    with pytest.raises(WorkerError, match="was terminated unexpectedly with exit code -9"):
        take(it, 10)
    it.close()
    assert_no_leaks(before)
