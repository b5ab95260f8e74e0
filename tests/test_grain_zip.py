"""grain.experimental.ZipMapDataset and ZipIterDataset against real Grain 0.2.18: the same tuples
(past the end too, through slices, shuffles and batches), Grain's errors, and for ZipIterDataset a
position state that resumes at every step and composes with the built-in steps."""

import grain
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_loader import grain as pg
from portable_loader.errors import StateError


def _plain(x):
    if isinstance(x, tuple):
        return tuple(_plain(v) for v in x)
    return x.tolist() if isinstance(x, np.ndarray) else x


def _map_parents(g, n, seed):
    return [g.MapDataset.range(n), g.MapDataset.range(100, 100 + n).shuffle(seed=seed),
            g.MapDataset.source([f"s{i}" for i in range(n)]).map(lambda s: s + "!")]


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 12), seed=st.integers(0, 2**32 - 1), k=st.integers(1, 3), batch=st.integers(1, 4))
def test_zip_map_dataset_equals_grains_in_range_past_the_end_and_through_views(n, seed, k, batch):
    ours = pg.experimental.ZipMapDataset(_map_parents(pg, n, seed)[:k])
    real = grain.experimental.ZipMapDataset(_map_parents(grain, n, seed)[:k])
    assert len(ours) == len(real) == n
    assert [ours[i] for i in range(3 * n)] == [real[i] for i in range(3 * n)]
    assert list(ours[1::2]) == list(real[1::2])
    assert list(ours.shuffle(seed=seed % 7)) == list(real.shuffle(seed=seed % 7))
    assert [_plain(b) for b in ours.batch(batch)] == [_plain(b) for b in real.batch(batch)]
    assert ours.fingerprint() == pg.experimental.ZipMapDataset(_map_parents(pg, n, seed)[:k]).fingerprint()
    if k > 1:
        assert ours.fingerprint() != pg.experimental.ZipMapDataset(_map_parents(pg, n, seed + 1)[:k]).fingerprint()


def test_zip_map_dataset_refuses_as_grain_and_runs_in_the_loader_machinery():
    for g in (grain, pg):
        with pytest.raises(ValueError, match="same length"):
            g.experimental.ZipMapDataset([g.MapDataset.range(2), g.MapDataset.range(3)])
        with pytest.raises(ValueError, match="At least one parent"):
            g.experimental.ZipMapDataset([])
    ours = pg.experimental.ZipMapDataset([pg.MapDataset.range(40), pg.MapDataset.range(40).map(lambda x: -x)])
    with iter(ours.to_iter_dataset().mp_prefetch(pg.MultiprocessingOptions(num_workers=2)).batch(8)) as it:
        got = [_plain(b) for b in it]
    assert got == [_plain(b) for b in grain.experimental.ZipMapDataset(
        [grain.MapDataset.range(40), grain.MapDataset.range(40).map(lambda x: -x)]).to_iter_dataset().batch(8)]


def _iter_parents(g, sizes):
    return [g.MapDataset.range(10 * i, 10 * i + n).to_iter_dataset().map(lambda x: x * 2) for i, n in enumerate(sizes)]


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(0, 8), min_size=1, max_size=3), strict=st.booleans())
def test_zip_iter_dataset_equals_grains_elements_and_errors(sizes, strict):
    def run(g):
        out = []
        try:
            for x in g.experimental.ZipIterDataset(_iter_parents(g, sizes), strict=strict):
                out.append(x)
        except ValueError as e:
            out.append(str(e))
        return out

    assert run(pg) == run(grain)


def test_zip_iter_dataset_state_resumes_at_every_step_and_composes():
    def pipeline(g):
        zipped = g.experimental.ZipIterDataset(_iter_parents(g, [7, 7]))
        return zipped.map(lambda t: t[0] + t[1]).filter(lambda v: v % 3 != 0).batch(2)

    want = [_plain(b) for b in pipeline(grain)]
    assert [_plain(b) for b in pipeline(pg)] == want
    it = iter(pipeline(pg))
    states = [it.get_state()] + [it.get_state() for _ in it]
    for k, state in enumerate(states):
        again = iter(pipeline(pg))
        again.set_state(state)
        assert [_plain(b) for b in again] == want[k:]
    with pytest.raises(StateError):
        iter(pg.experimental.ZipIterDataset(_iter_parents(pg, [7, 6]))).set_state(states[1])
