"""``grain.experimental.WindowShuffleIterDataset`` (portable_loader/dataset/iter/window_shuffle.py) against real Grain.

Oracle: Grain 0.2.18's ``WindowShuffleIterDataset`` over the same input: the same elements in the
same order (each window in Grain's shuffled order); on top, ours differs between windows and
seeds, and resumes exactly from every element, at another ``mp_prefetch`` worker count.
"""

from __future__ import annotations

import json
import grain
import pytest
from hypothesis import given, settings, strategies as st

from portable_loader import grain as pg
from portable_loader.errors import StateError

SETTINGS = dict(derandomize=True, deadline=None, max_examples=60)


def build(g, n: int, window: int, seed: int, keep_mod: int):
    ds = g.MapDataset.range(n).to_iter_dataset()
    if keep_mod > 1:
        ds = ds.filter(lambda x: x % keep_mod != 0)
    return g.experimental.WindowShuffleIterDataset(ds, window_size=window, seed=seed)


@pytest.mark.slow
@settings(**SETTINGS)
@given(n=st.integers(0, 40), window=st.integers(1, 12), seed=st.integers(0, 2**31), keep_mod=st.integers(1, 3))
def test_elements_are_grains_in_grains_order(n, window, seed, keep_mod):
    assert list(build(pg, n, window, seed, keep_mod)) == list(build(grain, n, window, seed, keep_mod))


def test_windows_and_seeds_differ():
    ds = pg.experimental.WindowShuffleIterDataset(pg.MapDataset.range(8).repeat(3).to_iter_dataset(), window_size=8,
                                                  seed=42)
    out = list(ds)
    first, second, third = out[:8], out[8:16], out[16:]
    assert first != second != third != first and sorted(first) == sorted(second) == sorted(third) == list(range(8))
    other = pg.experimental.WindowShuffleIterDataset(pg.MapDataset.range(8).to_iter_dataset(), window_size=8, seed=43)
    assert list(other) != first


@pytest.mark.slow
@settings(**SETTINGS)
@given(n=st.integers(1, 30), window=st.integers(1, 9), cut=st.integers(0, 30), workers=st.sampled_from([0, 2]))
def test_resume_from_any_element(n, window, cut, workers):
    ds = build(pg, n, window, 5, 2)
    full = list(ds)
    it = iter(ds)
    head = [x for _, x in zip(range(cut), it)]
    state = json.loads(json.dumps(it.get_state()))
    again = ds.mp_prefetch(pg.MultiprocessingOptions(num_workers=workers)) if workers else ds
    with iter(again) as it2:
        it2.set_state(state)
        assert it2.get_state() == state
        assert head + list(it2) == full


@pytest.mark.parametrize("bad", [0, -3])
def test_window_size_must_be_positive(bad):
    with pytest.raises(ValueError, match="window_size"):
        pg.experimental.WindowShuffleIterDataset(pg.MapDataset.range(3).to_iter_dataset(), window_size=bad, seed=0)


def test_the_state_has_grains_window_index_where_grain_has_it():
    # Grain's shuffle_test::test_checkpoint_restore_on_fresh_iterator reads state["window_index"].
    def make(g):
        return g.experimental.WindowShuffleIterDataset(g.MapDataset.range(100).to_iter_dataset(), window_size=10, seed=42)

    theirs, ours = iter(make(grain)), iter(make(pg))
    for k in range(60):
        assert ours.get_state()["window_index"] == theirs.get_state()["window_index"], k
        next(theirs), next(ours)
    state = ours.get_state()
    restored = iter(make(pg))
    restored.set_state(state)
    assert restored.get_state() == state
    with pytest.raises(StateError, match="window_index"):
        restored.set_state({**state, "window_index": state["window_index"] + 1})
    assert "window_index" not in iter(make(pg).map(abs)).get_state()  # only at the top, as in Grain
