"""``drop_remainder``: a finite stream's last batch, when short, is left out; nothing else changes.

The oracle is the same loader without it: its batches, cut after the last one that is full. A
batch's rows are counted from the batches themselves (padded records and packed rows are never
empty; only the padding of a short last batch is), and the number of full batches is found by
walking the batch sizes, not through the loader's own arithmetic. Every mode (padded, packed,
``"concat"``), schedules, hosts, workers, skips, filters and states are held to it.
"""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_loader as pl


def documents(n: int, seed: int) -> list:
    """``n`` records of 1-12 tokens, each token naming its record (so batches say what they hold)."""
    lens = np.random.default_rng(seed).integers(1, 13, n)
    return [{"input_ids": (np.arange(k, dtype=np.int32) % 7) + 10 * r + 1} for r, k in enumerate(lens)]


def served(loader, state=None, skip=0) -> list:
    with iter(loader) as it:
        if state is not None:
            it.set_state(state)
        if skip:
            it.skip(skip)
        return list(it)


def real_rows(batches) -> int:
    return sum(int(b["attention_mask"].any(axis=1).sum()) for b in batches)


def full_batches(rows: int, sizes) -> int:
    """How many consecutive batches of ``sizes(step)`` rows ``rows`` rows fill completely."""
    k = 0
    while rows >= sizes(k):
        rows -= sizes(k)
        k += 1
    return k


def same(a, b) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(np.array_equal(x[f], y[f]) for f in x)
                                    for x, y in zip(a, b))


SIZES = st.one_of(st.integers(1, 9), st.lists(st.integers(1, 6), min_size=2, max_size=3).map(
    lambda bs: [(3 * i, b) for i, b in enumerate(bs)]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(5, 60), size=SIZES, epochs=st.integers(1, 2), packing=st.sampled_from([False, True, "concat"]),
       seed=st.integers(0, 2**16), window=st.sampled_from([3, 16]))
def test_the_batches_are_the_full_ones_of_the_run_without_it(n, size, epochs, packing, seed, window):
    kw = dict(global_batch_size=size, seq_len=5, seed=seed, packing=packing, num_epochs=epochs, prefetch=0,
              **({"packing_window": window} if packing is True else {}))
    src = documents(n, seed)
    keep, drop = pl.DataLoader(src, **kw), pl.DataLoader(src, drop_remainder=True, **kw)
    everything = served(keep)
    k = full_batches(real_rows(everything), drop.batch_size_at)
    assert len(everything) - k in (0, 1)  # at most the last batch was short
    got = served(drop)
    assert same(got, everything[:k])
    assert drop.num_steps() == k == pl.DataLoader(src, drop_remainder=True, **{**kw, "num_epochs": None}).num_steps(epochs)
    if epochs == 1:
        assert drop.steps_per_epoch() == k
    assert keep.num_steps() == len(everything)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(5, 50), size=st.sampled_from([2, 4, 6]), packing=st.sampled_from([False, True, "concat"]),
       data=st.data())
def test_states_cross_both_ways_and_the_end_is_the_end(n, size, packing, data):
    kw = dict(global_batch_size=size, seq_len=5, seed=3, packing=packing, num_epochs=1, prefetch=0)
    src = documents(n, n)
    keep, drop = pl.DataLoader(src, **kw), pl.DataLoader(src, drop_remainder=True, **kw)
    everything, full = served(keep), served(drop)
    k = len(full)
    j = data.draw(st.integers(0, len(everything)), label="state after batch")
    with iter(keep) as a, iter(drop) as b:
        for _ in range(j):
            next(a)
        if j <= k:
            for _ in range(j):
                next(b)
            # The same position in both streams: one state, whichever loader saved it.
            assert json.dumps(a.get_state(), sort_keys=True) == json.dumps(b.get_state(), sort_keys=True)
        state = a.get_state()
    assert same(served(drop, state), full[j:])  # past the last full batch: nothing more, not an error
    assert same(served(keep, state), everything[j:])
    # A state saved at half the batch size, between the last full batch and the end of the stream.
    half = pl.DataLoader(src, drop_remainder=True, **{**kw, "global_batch_size": size // 2})
    with iter(half) as h:
        for _ in range(len(served(half))):
            next(h)
        assert served(drop, h.get_state()) == []


@pytest.mark.parametrize("packing", [False, True, "concat"])
def test_hosts_and_workers_split_the_same_full_batches(packing):
    kw = dict(global_batch_size=4, seq_len=5, seed=2, packing=packing, num_epochs=2, packing_window=8,
              drop_remainder=True)
    src = documents(37, 5)
    one = pl.DataLoader(src, **kw)
    full = served(one)
    assert len(full) == one.num_steps() and real_rows(full) == 4 * len(full)
    hosts = [served(pl.DataLoader(src, shard_index=h, shard_count=2, **kw)) for h in range(2)]
    assert same([{f: np.concatenate([a[f], b[f]]) for f in a} for a, b in zip(*hosts)], full)
    assert same(served(pl.DataLoader(src, num_workers=2, **kw)), full)


@pytest.mark.parametrize("packing", [False, True])
def test_skips_leave_out_batches_of_the_full_stream(packing):
    kw = dict(global_batch_size=3, seq_len=5, seed=4, packing=packing, num_epochs=1, drop_remainder=True)
    src = documents(40, 6)
    full = served(pl.DataLoader(src, **kw))
    k = len(full)
    skips = [(1, 3), (k - 1, k + 5)]  # the second reaches past the end
    skipping = pl.DataLoader(src, skip_batches=skips, **kw)
    kept = [full[i] for i in range(k) if not any(a <= i < b for a, b in skips)]
    assert same(served(skipping), kept) and skipping.num_steps() == len(kept)
    loader = pl.DataLoader(src, **kw)
    assert same(served(loader, skip=2), full[2:])
    assert served(loader, skip=k) == [] and served(loader, skip=k + 3) == []


def test_a_filter_ends_at_the_last_full_batch_of_its_survivors():
    src = pl.source(documents(50, 7)).filter(lambda r: r["input_ids"][0] % 3 != 0, name="not3")
    kw = dict(global_batch_size=4, seq_len=5, seed=0, num_epochs=1)
    everything = served(pl.DataLoader(src, **kw))
    drop = pl.DataLoader(src, drop_remainder=True, **kw)
    k = real_rows(everything) // 4
    assert same(served(drop), everything[:k]) and drop.num_steps() == k


def test_a_stream_shorter_than_one_batch_serves_nothing():
    drop = pl.DataLoader(documents(3, 0), global_batch_size=4, seq_len=5, num_epochs=1, drop_remainder=True)
    assert served(drop) == [] and drop.num_steps() == 0


def test_an_endless_stream_has_no_remainder():
    kw = dict(global_batch_size=4, seq_len=5, seed=1)
    src = documents(7, 1)
    with iter(pl.DataLoader(src, **kw)) as a, iter(pl.DataLoader(src, drop_remainder=True, **kw)) as b:
        assert same([next(a) for _ in range(9)], [next(b) for _ in range(9)])


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_drop_remainder_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="drop_remainder must be True or False"):
        pl.DataLoader(documents(3, 0), global_batch_size=2, seq_len=4, drop_remainder=bad)


def test_with_shard_keeps_it():
    loader = pl.DataLoader(documents(9, 0), global_batch_size=4, seq_len=5, num_epochs=1, drop_remainder=True)
    assert loader.with_shard(1, 2).drop_remainder and loader.with_shard(1, 2).num_steps() == 2
