"""grain.experimental.LimitIterDataset against real Grain 0.2.18: the same elements and next
indices over random pipelines, a position state that resumes at every step, and composition with
the built-in steps on both sides."""

import grain
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_loader import grain as pg
from portable_loader.errors import StateError


def _plain(x):
    return x.tolist() if isinstance(x, np.ndarray) else x


def _pipeline(g, n, count, mod, batch):
    ds = g.MapDataset.range(n).to_iter_dataset().filter(lambda x: x % mod != 1)
    return g.experimental.LimitIterDataset(ds.map(lambda x: x * 3), count).batch(batch)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 30), count=st.integers(1, 40), mod=st.integers(2, 5), batch=st.integers(1, 4))
def test_elements_equal_grains_and_every_state_resumes(n, count, mod, batch):
    want = [_plain(b) for b in _pipeline(grain, n, count, mod, batch)]
    it = iter(_pipeline(pg, n, count, mod, batch))
    states, got = [it.get_state()], []
    for b in it:
        got.append(_plain(b))
        states.append(it.get_state())
    assert got == want
    for k, state in enumerate(states):
        again = iter(_pipeline(pg, n, count, mod, batch))
        again.set_state(state)
        assert [_plain(b) for b in again] == want[k:]


def test_next_index_is_grains_and_bad_counts_and_states_are_refused():
    def indices(g):
        it = iter(g.experimental.LimitIterDataset(g.MapDataset.range(10).to_iter_dataset(), 4))
        out = [g.experimental.get_next_index(it)]
        for _ in it:
            out.append(g.experimental.get_next_index(it))
        g.experimental.set_next_index(it, 1)
        return out, list(it)

    assert indices(pg) == indices(grain)
    for bad in (0, -3):
        for g in (grain, pg):
            with pytest.raises(ValueError, match="Count must be"):
                g.experimental.LimitIterDataset(g.MapDataset.range(3).to_iter_dataset(), bad)
    ds = pg.experimental.LimitIterDataset(pg.MapDataset.range(10).to_iter_dataset(), 4)
    state = iter(pg.experimental.LimitIterDataset(pg.MapDataset.range(10).to_iter_dataset(), 9)).get_state()
    with pytest.raises(StateError, match="pipeline"):
        iter(ds).set_state(state)


def test_limit_over_packing_under_mp_prefetch_equals_grain():
    def pipeline(g, workers):
        ds = g.MapDataset.range(1, 30).map(lambda n: {"ids": np.arange(n % 7 + 1)}).to_iter_dataset()
        if workers:
            ds = ds.mp_prefetch(g.MultiprocessingOptions(num_workers=workers))
        packed = g.experimental.FirstFitPackIterDataset(ds, length_struct={"ids": 8}, num_packing_bins=2)
        return g.experimental.LimitIterDataset(packed, 5)

    want = [r["ids"].tolist() for r in pipeline(grain, 0)]
    with iter(pipeline(pg, 2)) as it:
        assert [r["ids"].tolist() for r in it] == want
