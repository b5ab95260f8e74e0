"""``grain.experimental.RepeatIterDataset`` (portable_loader/dataset/iter/repeat.py) against real Grain.

Oracle: Grain 0.2.18's ``RepeatIterDataset`` over the same pipeline (deterministic: no shuffle, no
workers), so the elements must be equal, pass after pass. On top, what Grain's state lacks: a
small JSON position that resumes exactly after every element, across pass boundaries and after a
batch that straddles one, at another ``mp_prefetch`` worker count, and is refused when it points
past ``num_epochs``.
"""

from __future__ import annotations

import json

import grain
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from portable_loader import grain as pg
from portable_loader.errors import StateError
from conftest import take

SETTINGS = dict(derandomize=True, deadline=None, max_examples=60)


def build(g, n: int, num_epochs, keep_mod: int, batch: int):
    ds = g.MapDataset.range(n).to_iter_dataset().map(lambda x: x * 3)
    if keep_mod > 1:
        ds = ds.filter(lambda x: x % keep_mod != 0)
    ds = g.experimental.RepeatIterDataset(ds, num_epochs=num_epochs)
    ds = ds.map_with_index(lambda i, x: (i, x))
    return ds.batch(batch, batch_fn=list) if batch > 1 else ds


@settings(**SETTINGS)
@given(n=st.integers(0, 9), num_epochs=st.one_of(st.none(), st.integers(1, 4)), keep_mod=st.integers(1, 3),
       batch=st.integers(1, 4))
def test_elements_equal_grain(n, num_epochs, keep_mod, batch):
    k = 60  # enough for every finite case here; the infinite ones are compared on a prefix
    ours = take(build(pg, n, num_epochs, keep_mod, batch), k)
    one_pass = [x for x in range(n) if keep_mod == 1 or (3 * x) % keep_mod]
    if one_pass or num_epochs is not None:
        assert ours == take(build(grain, n, num_epochs, keep_mod, batch), k)
    else:  # Grain's iterator over an empty pass repeated forever never returns from next(): ours ends (documented)
        assert ours == []
    if one_pass and num_epochs is None:
        assert len(ours) == k


@pytest.mark.parametrize("bad", [0, -1])
def test_num_epochs_refused_as_grain(bad):
    with pytest.raises(ValueError) as real:
        grain.experimental.RepeatIterDataset(grain.MapDataset.range(3).to_iter_dataset(), num_epochs=bad)
    with pytest.raises(ValueError) as ours:
        pg.experimental.RepeatIterDataset(pg.MapDataset.range(3).to_iter_dataset(), num_epochs=bad)
    assert str(ours.value) == str(real.value)


def test_empty_repeated_forever_ends():
    assert list(pg.experimental.RepeatIterDataset(pg.MapDataset.range(0).to_iter_dataset(), None)) == []
    everything_dropped = pg.MapDataset.range(5).to_iter_dataset().filter(lambda x: x > 10)
    assert list(pg.experimental.RepeatIterDataset(everything_dropped, None)) == []


@pytest.mark.slow
@settings(**SETTINGS)
@given(n=st.integers(1, 7), num_epochs=st.one_of(st.none(), st.integers(1, 3)), keep_mod=st.integers(1, 3),
       batch=st.integers(1, 3), cut=st.integers(0, 25), workers=st.sampled_from([0, 2]))
def test_resume_anywhere_is_the_continuation(n, num_epochs, keep_mod, batch, cut, workers):
    ds = build(pg, n, num_epochs, keep_mod, batch)
    full = take(ds, 40)
    it = iter(ds)
    got = [x for _, x in zip(range(cut), it)]
    state = json.loads(json.dumps(it.get_state()))
    assert len(json.dumps(state)) < 400
    it.close()
    resumed = ds.mp_prefetch(pg.MultiprocessingOptions(num_workers=workers)) if workers else ds
    with iter(resumed) as it2:
        it2.set_state(state)
        rest = take(it2, 40 - len(got))
    assert got + rest == full



def test_state_is_epoch_and_position():
    ds = pg.experimental.RepeatIterDataset(pg.MapDataset.range(4).to_iter_dataset(), num_epochs=3)
    it = iter(ds)
    [next(it) for _ in range(6)]
    cursor = {k.split(".", 1)[1]: int(v) for k, v in it.get_state()["cursor"].items()}
    assert cursor == {"source.position": 2, "repeat.epoch": 1}


def test_state_past_num_epochs_refused():
    ds = pg.experimental.RepeatIterDataset(pg.MapDataset.range(4).to_iter_dataset(), num_epochs=2)
    other = pg.experimental.RepeatIterDataset(pg.MapDataset.range(4).to_iter_dataset(), num_epochs=5)
    it = iter(other)
    for _ in range(13):
        next(it)
    with pytest.raises(StateError, match="pipeline"):  # another num_epochs is another pipeline
        iter(ds).set_state(it.get_state())


def test_after_mp_prefetch_workers_are_kept():
    import os

    ds = pg.MapDataset.range(20).to_iter_dataset().map(lambda x: os.getpid())
    ds = ds.mp_prefetch(pg.MultiprocessingOptions(num_workers=2))
    with iter(pg.experimental.RepeatIterDataset(ds, num_epochs=3)) as it:
        pids = list(it)
    assert len(pids) == 60 and len(set(pids)) == 2 and os.getpid() not in pids


def test_repeat_of_batches_equals_grain():
    def make(g):
        ds = g.MapDataset.range(5).to_iter_dataset().batch(2)
        return g.experimental.RepeatIterDataset(ds, num_epochs=2)

    assert [np.asarray(b).tolist() for b in make(pg)] == [np.asarray(b).tolist() for b in make(grain)]
