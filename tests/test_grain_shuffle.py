"""Grain's shuffled order: ``MapDataset.shuffle``, ``IndexSampler(shuffle=True)`` and ``index_shuffle``.

Oracle: real Grain 0.2.18, element for element, over random sizes, seeds (up to ``2**32 - 1``, where
the per-epoch seed wraps), rounds and epochs. The one place where ours differs on purpose: at
sizes where Grain's cipher block is a bit short (``max_index`` an even power of two from ``2**16``,
or a few above a power of two past ``2**48``, where the float's ``log2`` rounds down)
Grain's epoch reads a record twice and another never; ours equals Grain's at every other position
and keeps each record once. A state saved when shuffles had the LCG order is refused.
"""

from __future__ import annotations

import math
import grain
import numpy as np
import pytest
from grain._src.python.experimental.index_shuffle.python import index_shuffle_module as real_index_shuffle
from hypothesis import given, settings
from hypothesis import strategies as st

import portable_loader as pl
from portable_loader import grain as pg
from portable_loader.orders.index_shuffle import ORDER
from portable_loader.errors import StateError

seeds = st.one_of(st.integers(0, 2**32 - 1), st.integers(2**32 - 4, 2**32 - 1), st.integers(0, 3))


def short_block(max_index: int) -> bool:
    """Grain's block is a bit short here: its ``ceil(log2)`` of the float rounds down (a power of two,
    or within a few of one above ``2**48``), and it reads a record twice."""
    bits = math.ceil(math.log2(float(max_index))) if max_index > 1 else 0
    return max_index >= 2**16 and max_index >= 2 ** (bits + bits % 2)


# Every size class: the 16-bit block's tabulated range (below 2**14), cycle walking in a block up to
# 4x the range, and huge ranges (doubles are exact below 2**53, so Grain's block size is exact there).
max_indices = st.one_of(st.integers(0, 300), st.integers(0, 70_000), st.integers(2**14 - 3, 2**14 + 3),
                        st.integers(0, 2**40), st.integers(2**52, 2**53 - 1)).filter(lambda m: not short_block(m))


@pytest.mark.slow
@settings(max_examples=120, deadline=None)
@given(max_index=max_indices, seed=seeds, rounds=st.sampled_from([4, 4, 6, 8, 20, 1024]), data=st.data())
def test_index_shuffle_equals_grains(max_index, seed, rounds, data):
    # Grain's own cycle walk takes 2**16 / (max_index + 1) steps for small ranges: a few indices there.
    count = 3 if max_index < 1000 else 40
    idx = data.draw(st.lists(st.integers(0, max_index), min_size=1, max_size=count)) + [0, max_index]
    want = [real_index_shuffle.index_shuffle(i, max_index, seed, rounds) for i in idx]
    assert [pg.experimental.index_shuffle(i, max_index, seed, rounds) for i in idx] == want


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(n=st.one_of(st.integers(1, 40), st.integers(40, 3000)), seed=seeds, epochs=st.integers(1, 3))
def test_map_dataset_shuffle_equals_grains_element_for_element(n, seed, epochs):
    g = grain.MapDataset.range(n).shuffle(seed=seed).repeat(epochs)
    d = pg.MapDataset.range(n).shuffle(seed=seed).repeat(epochs)
    want = list(g)
    assert list(d) == want  # read in chunks, as an iterator reads
    assert [d[i] for i in range(0, len(d), 7)] == want[::7]  # one element at a time
    # Past the end of the shuffle itself: later epochs, each with its own seed (seed + epoch) % 2**32.
    s, gs = pg.MapDataset.range(n).shuffle(seed=seed), grain.MapDataset.range(n).shuffle(seed=seed)
    assert [s[i] for i in range(epochs * n)] == [gs[i] for i in range(epochs * n)]


@settings(max_examples=25, deadline=None)
@given(n=st.one_of(st.integers(2**14, 2**20), st.integers(2**20, 10**12)).filter(lambda n: not short_block(n - 1)),
       seed=seeds, data=st.data())
def test_large_shuffles_equal_grains_at_any_index(n, seed, data):
    idx = data.draw(st.lists(st.integers(0, 4 * n - 1), min_size=1, max_size=64))  # up to 4 epochs
    d, g = pg.MapDataset.range(n).shuffle(seed=seed), grain.MapDataset.range(n).shuffle(seed=seed)
    want = [g[i] for i in idx]
    assert [d[i] for i in idx] == want
    assert d.repeat(4)[idx] == want  # a batched read: the vectorized path


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 2000), seed=seeds, epochs=st.one_of(st.none(), st.integers(1, 3)), data=st.data())
def test_index_sampler_equals_grains(n, seed, epochs, data):
    real = grain.samplers.IndexSampler(n, shard_options=grain.sharding.NoSharding(), shuffle=True,
                                       num_epochs=epochs, seed=seed)
    ours = pg.samplers.IndexSampler(n, shuffle=True, num_epochs=epochs, seed=seed)
    span = 3 * n if epochs is None else len(real)
    pos = sorted(set(data.draw(st.lists(st.integers(0, span - 1), max_size=50)) + [0, span - 1]))
    assert [ours[i].record_key for i in pos] == [real[i].record_key for i in pos]
    assert ours.record_keys(pos).tolist() == [real[i].record_key for i in pos]
    assert all(ours[i].rng.integers(2**32) == real[i].rng.integers(2**32) for i in pos[:5])


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 200), seed=seeds, batch=st.integers(1, 9), workers=st.sampled_from([0, 2]))
def test_shuffled_data_loader_yields_grains_batches(n, seed, batch, workers):
    def batches(g, **kw):
        loader = g.DataLoader(data_source=list(range(n)), operations=[g.transforms.Batch(batch)], **kw,
                              sampler=g.samplers.IndexSampler(n, shard_options=g.sharding.NoSharding(), shuffle=True,
                                                              num_epochs=2, seed=seed))
        return [b.tolist() for b in loader]

    assert batches(pg, worker_count=workers) == batches(grain, worker_count=0)


@pytest.mark.slow
@pytest.mark.parametrize("n", [2**16 + 1, 2**18 + 1])
def test_where_grains_epoch_repeats_a_record_ours_keeps_every_record(n):
    want = [real_index_shuffle.index_shuffle(i, n - 1, 3, 4) for i in range(n)]
    got = pg.MapDataset.range(n).shuffle(seed=3)[list(range(n))]
    assert len(set(want)) == n - 1  # Grain: one record twice, one never
    assert got[:-1] == want[:-1] and got[-1] == n - 1 and sorted(got) == list(range(n))
    assert pg.experimental.index_shuffle(n - 1, n - 1, 3, 4) == n - 1



@pytest.mark.parametrize("extra", [1, 11])
def test_above_2_48_where_the_float_log2_rounds_down_ours_keeps_the_indices_past_grains_block(extra):
    max_index = 2**52 + extra   # log2 of the double is exactly 52.0: Grain's block has 2**52 indices
    inside = np.random.default_rng(extra).integers(0, 2**52, 30).tolist() + [0, 2**52 - 1]
    assert [pg.experimental.index_shuffle(i, max_index, 7, 4) for i in inside] == \
        [real_index_shuffle.index_shuffle(i, max_index, 7, 4) for i in inside]
    past = list(range(2**52, max_index + 1))
    assert [pg.experimental.index_shuffle(i, max_index, 7, 4) for i in past] == past


# --- states saved when shuffles had the LCG order ------------------------------------------------


def lcg_era_shuffle_identity(monkeypatch):
    """Make shuffles fingerprint as they did before they took Grain's order (no order name)."""
    from portable_loader.dataset.shuffle import Shuffle
    from portable_loader.grain import data_loader, samplers

    def order_without_name(sampler):
        order = samplers.stream_order(sampler)
        order.identity = tuple(x for x in order.identity if x != ORDER)
        return order

    monkeypatch.setattr(Shuffle, "_params", lambda self: ("shuffle", self._seed))
    monkeypatch.setattr(data_loader, "stream_order", order_without_name)


def test_states_of_the_lcg_order_are_refused(monkeypatch):
    def grain_loader():
        return pg.DataLoader(data_source=list(range(20)), operations=[pg.transforms.Batch(2)],
                             sampler=pg.samplers.IndexSampler(20, shuffle=True, num_epochs=1, seed=4))

    def dataset():
        return pg.MapDataset.range(20).shuffle(seed=4).to_iter_dataset()

    def pl_loader():  # the loader's own sampler over a shuffled source
        source = pl.source([{"input_ids": np.full(3, i, np.int32)} for i in range(20)]).shuffle(4)
        return pl.DataLoader(source, global_batch_size=2, seq_len=4)

    makers = (grain_loader, dataset, pl_loader)
    with monkeypatch.context() as m:
        lcg_era_shuffle_identity(m)
        old = []
        for make in makers:
            with iter(make()) as it:
                next(it)
                old.append(it.get_state())
    for make, state in zip(makers, old):
        with iter(make()) as it:
            next(it)
            fresh = it.get_state()
            with pytest.raises(StateError, match="Grain's order"):
                it.set_state(state)
            it.set_state(fresh)  # today's states resume
    unshuffled = pg.samplers.IndexSampler(20, num_epochs=1)
    assert ORDER not in pg.samplers.stream_order(unshuffled).identity  # its states are unchanged
