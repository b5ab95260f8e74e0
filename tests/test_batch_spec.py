"""The engines' interface: a frozen BatchSpec (all a worker receives), finished step plans, and the
planner's lengths through the dataset contract only (what StepPlans.lengths_ahead announces is all
the planner reads; a cache located once by lengths() serves the same spans)."""

import dataclasses
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portable_loader as pl
from conftest import NO_FORK
from portable_loader.batch_spec import BatchSpec
from portable_loader.step_plans import Cursor, StepPlans

pytestmark = NO_FORK


def records(lengths):
    return [{"input_ids": np.arange(1, n + 1, dtype=np.int32) + 1000 * i} for i, n in enumerate(lengths)]


def test_the_spec_is_frozen_small_and_built_once_from_the_options():
    sizes = pl.BatchSchedule([(0, 4), (12, 8)], unit="samples")
    loader = pl.DataLoader(records([3, 5, 9] * 20), global_batch_size=sizes, seq_len=16, packing=True,
                           skip_batches=[(2, 3)], shard_index=1, shard_count=2, num_workers=1)
    spec = loader.spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seq_len = 32
    assert (spec.seq_len, spec.packing, spec.shard_index, spec.shard_count, spec.num_workers) == (16, True, 1, 2, 1)
    assert spec.skips == ((8, 12),)  # batch 2 of the schedule: rows 8..11 of the stream
    assert spec.fields == tuple(loader.fields) and spec.overlong == loader.overlong == "truncate"
    assert pickle.loads(pickle.dumps(spec)) == spec and len(pickle.dumps(spec)) < 2048
    assert loader.with_shard(0, 2).spec == dataclasses.replace(spec, shard_index=0)


def test_worker_processes_receive_the_spec_and_the_dataset_never_the_loader(monkeypatch):
    from portable_loader.engine import processes, workers

    real, sent = processes.launch, []

    def recording(ctx, method, target, args, name):  # what each worker is handed, however it starts
        sent.append(" ".join(type(a).__name__ for a in workers.load(args[1])))
        return real(ctx, method, target, args, name)

    # (Whatever start method the loader picks: a forced fork would copy this process's threads.)
    monkeypatch.setattr(processes, "launch", recording)
    loader = pl.DataLoader(records(range(1, 41)), global_batch_size=4, seq_len=8, num_workers=2)
    with iter(loader) as it, iter(pl.DataLoader(records(range(1, 41)), global_batch_size=4, seq_len=8)) as ref:
        batch = next(it)
        assert all(np.array_equal(batch[k], v) for k, v in next(ref).items())
    assert sent == [f"BatchSpec {type(loader.source).__name__}"] * 2


class Recorded:
    """A dataset whose lengths() calls are recorded (the planner's only way to lengths)."""

    def __init__(self, ds):
        self.asked: list[int] = []
        inner = ds.lengths

        def lengths(idx):
            self.asked.extend(np.asarray(idx).tolist())
            return inner(idx)

        object.__setattr__(ds, "lengths", lengths)
        self.ds = ds


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 40), min_size=12, max_size=120), seq_len=st.integers(4, 32),
       batch=st.integers(1, 6), window=st.integers(1, 10), packing=st.booleans(), filtered=st.booleans(),
       skip=st.booleans(), epochs=st.sampled_from([1, 2, None]), steps=st.integers(3, 25))
def test_lengths_ahead_announces_every_length_the_next_step_reads(lengths, seq_len, batch, window, packing, filtered,
                                                                  skip, epochs, steps):
    ds = pl.source(records(lengths))
    if filtered:
        ds = ds.filter(lambda r: int(r["input_ids"][0]) % 3 != 1)
    rec = Recorded(ds)
    try:
        loader = pl.DataLoader(ds, global_batch_size=batch, seq_len=seq_len, packing=packing, packing_window=window,
                               overlong="split" if packing else "drop", num_epochs=epochs,
                               skip_batches=[(1, 3)] if skip and not (filtered and not packing) else ())
    except ValueError:
        return
    planner = loader.planner()
    plans = StepPlans(loader.spec, planner, Cursor(0, 0, 0))
    for _ in range(steps):
        rec.asked.clear()
        announced = set()
        try:
            for lo, hi in plans.lengths_ahead():
                announced.update(plans.records(lo, hi).tolist())
            planned = plans.next()
        except pl.FilterError:
            return  # the filter rejects too much: the planner says so, whatever was announced
        # (A padded step through a filter takes positions until it holds its rows: past its own
        # size they are not announced, and the dataset computes their lengths itself, documented.)
        if packing or not filtered:
            assert set(rec.asked) <= announced, (sorted(set(rec.asked) - announced), plans.cursor)
        if planned is None:
            break


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    from portable_loader.precache import sample_args

    return pl.open_cache(pl.precache(**sample_args(), out=str(tmp_path_factory.mktemp("spec") / "cache")))


@pytest.mark.slow
@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data())
def test_a_cache_answers_lengths_and_then_the_same_spans_for_any_records(cache, data):
    n = len(cache)
    idx = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=300)), dtype=np.int64)
    want = [len(cache[int(i)]["input_ids"]) for i in idx]
    assert cache.lengths(idx).tolist() == want
    sp = cache.spans(idx)
    assert sp.length == want
    for k in data.draw(st.lists(st.integers(0, idx.size - 1), max_size=5)):
        got = np.frombuffer(sp.ids[sp.buf[k]][sp.ids_at[k]:][: 4 * sp.length[k]], np.int32)
        assert np.array_equal(got, cache[int(idx[k])]["input_ids"])
    changed = idx.copy()
    changed[0] = (idx[0] + 1) % n  # other records: never the kept spans
    assert cache.spans(changed).length[0] == len(cache[int(changed[0])]["input_ids"])
    idx[0] = (idx[0] + 1) % n  # the caller's array changed in place after lengths(): not served stale
    assert cache.spans(idx).length[0] == len(cache[int(idx[0])]["input_ids"])


def test_a_spec_built_by_hand_plans_the_loaders_stream():
    ds = pl.source(records([3, 7, 2, 9, 4, 4, 8, 1] * 5))
    loader = pl.DataLoader(ds, global_batch_size=4, seq_len=8, packing=True, packing_window=8, seed=3)
    spec = BatchSpec(pl.BatchSchedule([(0, 4)]), seq_len=8, packing=True, packing_window=8, overlong="truncate",
                     fields=tuple(loader.fields), seed=3)
    assert spec == loader.spec
    mine = StepPlans(spec, spec.planner(ds, spec.order(ds)), Cursor(0, 0, 0))
    theirs = StepPlans(loader.spec, loader.planner(), Cursor(0, 0, 0))
    for _ in range(12):
        assert mine.next() == theirs.next()


@pytest.mark.slow
def test_only_a_window_sized_lengths_call_keeps_its_spans(cache, monkeypatch):
    from portable_loader.cache import readers

    src = pl.open_cache(cache.path)
    monkeypatch.setattr(readers, "KEEP_SPANS_MAX", 100)
    want = [len(src[i]["input_ids"]) for i in range(500)]
    assert src.lengths(np.arange(500)).tolist() == want and src._sized is None  # a whole-cache call keeps nothing
    assert src.lengths(np.arange(80)).tolist() == want[:80] and src._sized is not None
    assert src.spans(np.arange(80)) is src._sized[1]


@pytest.mark.slow
def test_a_packed_loader_over_a_local_cache_locates_each_window_once(cache):
    from portable_loader.cache.readers import kept_spans

    src = pl.open_cache(cache.path)
    located = []  # each spans() call that located records (not served from the spans a lengths() call kept)
    inner = src.spans

    def spans(indices):
        if kept_spans(src._sized, indices) is None:
            located.append(np.asarray(indices).copy())
        return inner(indices)

    src.spans = spans
    kw = dict(global_batch_size=8, seq_len=128, packing=True, packing_window=64, seed=1)
    loader = pl.DataLoader(src, **kw)
    assert loader.source.read_ahead is None  # a local cache: nothing to narrow
    with iter(loader) as it, iter(pl.DataLoader([src[i] for i in range(len(src))], **kw)) as ref:
        for _ in range(40):
            a, b = next(it), next(ref)
            assert all(np.array_equal(a[k], b[k]) for k in b)
    # Each window located once, by the planner's lengths(); a step that crosses into a window takes
    # its records from the two read-aheads, not from a spans call of its own.
    assert len(located) > 3 and all(x.size == 64 for x in located)
    assert len({x.tobytes() for x in located}) == len(located)


@pytest.mark.parametrize("skips", [[(3, 5)], [(7, 30)], [(0, 2), (9, 10)]])
def test_a_packed_loader_over_a_local_cache_serves_its_records_batches_across_skips(cache, skips):
    kw = dict(global_batch_size=8, seq_len=128, packing=True, packing_window=64, seed=2, skip_batches=skips)
    with iter(pl.DataLoader(pl.open_cache(cache.path), **kw)) as it, \
            iter(pl.DataLoader([cache[i] for i in range(len(cache))], **kw)) as ref:
        for _ in range(40):
            a, b = next(it), next(ref)
            assert all(np.array_equal(a[k], b[k]) for k in b)
