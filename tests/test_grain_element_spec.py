"""``grain.experimental.get_element_spec`` / ``ShapeDtypeStruct`` (portable_loader/grain/experimental.py) against real Grain.

Oracle: Grain 0.2.18's ``get_element_spec`` wherever it infers a spec (sources of ranges and the
steps that keep the element: shuffle, repeat, window shuffle, ``to_iter_dataset``): the same shape
and dtype. Ours reads the first element, so it also describes what Grain cannot infer (a plain map,
a list source), and gives the first batch's size where Grain gives ``None`` (documented).
"""

from __future__ import annotations

import grain
import numpy as np
import pytest

from portable_loader import grain as pg

CASES = {
    "range": lambda g: g.MapDataset.range(10),
    "to_iter_dataset": lambda g: g.MapDataset.range(10).to_iter_dataset(),
    "shuffle": lambda g: g.MapDataset.range(10).shuffle(seed=1),
    "repeat_iter": lambda g: g.experimental.RepeatIterDataset(g.MapDataset.range(3).to_iter_dataset(), 2),
    "window_shuffle_iter": lambda g: g.experimental.WindowShuffleIterDataset(
        g.MapDataset.range(30).to_iter_dataset(), window_size=10, seed=42),
    "window_shuffle_map": lambda g: g.experimental.WindowShuffleMapDataset(g.MapDataset.range(20), window_size=5,
                                                                           seed=42),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_spec_equals_grains(case):
    real = grain.experimental.get_element_spec(CASES[case](grain))
    ours = pg.experimental.get_element_spec(CASES[case](pg))
    assert isinstance(ours, pg.experimental.ShapeDtypeStruct)
    assert (tuple(ours.shape), np.dtype(ours.dtype)) == (tuple(real.shape), np.dtype(real.dtype))


def test_a_tree_of_leaves_read_off_the_first_element():
    ds = pg.MapDataset.range(5).map(lambda x: {"ids": np.arange(4, dtype=np.int32), "w": (1.5, [x])})
    spec = pg.experimental.get_element_spec(ds.to_iter_dataset().batch(2))
    S = pg.experimental.ShapeDtypeStruct
    assert spec == {"ids": S((2, 4), np.dtype(np.int32)), "w": (S((2,), np.dtype(np.float64)), [S((2,), np.dtype(np.int64))])}


def test_empty_dataset_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        pg.experimental.get_element_spec(pg.MapDataset.range(0))
