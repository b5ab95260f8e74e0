"""grain.experimental.RebatchIterDataset against real Grain 0.2.18: the same batches over random
parent batch sizes, target sizes and pytrees, drop_remainder included, and a position state that
resumes at every step (also where Grain would yield an empty batch after a resume)."""

import grain
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_loader import grain as pg


def _plain(b):
    return {k: v.tolist() for k, v in b.items()}


def _pipeline(g, n, parent, size, drop, filt):
    ds = g.MapDataset.range(n).map(lambda i: {"x": i, "y": np.full(2, -i)}).to_iter_dataset()
    ds = ds.filter(lambda e: e["x"] % filt != 1).batch(parent)
    return g.experimental.RebatchIterDataset(ds, size, drop_remainder=drop)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 30), parent=st.integers(1, 6), size=st.integers(1, 7), drop=st.booleans(),
       filt=st.integers(2, 5))
def test_batches_equal_grains_and_every_state_resumes(n, parent, size, drop, filt):
    want = [_plain(b) for b in _pipeline(grain, n, parent, size, drop, filt)]
    it = iter(_pipeline(pg, n, parent, size, drop, filt))
    states, got = [it.get_state()], []
    for b in it:
        got.append(_plain(b))
        states.append(it.get_state())
    assert got == want
    for k, state in enumerate(states):
        again = iter(_pipeline(pg, n, parent, size, drop, filt))
        again.set_state(state)
        assert [_plain(b) for b in again] == want[k:]


def test_errors_are_grains_and_it_composes_with_built_in_steps():
    for g in (grain, pg):
        with pytest.raises(ValueError, match="batch_size must be positive"):
            g.experimental.RebatchIterDataset(g.MapDataset.range(3).to_iter_dataset().batch(2), 0)

    def pipeline(g):
        ds = g.MapDataset.range(20).to_iter_dataset().batch(3)
        return g.experimental.RebatchIterDataset(ds, 4).map(lambda b: b * 2).batch(2)

    assert [b.tolist() for b in pipeline(pg)] == [b.tolist() for b in pipeline(grain)]
