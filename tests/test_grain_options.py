"""``grain.experimental.DatasetOptions`` / ``WithOptionsIterDataset`` and ``get_next_index`` / ``set_next_index``
(portable_loader/dataset/iter/options.py, iter_runtime.py) against real Grain 0.2.18.

Oracle: the same options and pipelines built with real Grain, without worker processes: the merged
option values, which elements a pipeline yields before a filter's raise threshold stops it (and
that it stops), and the next index before and after ``set_next_index``. On top: the same outcome
at 2 ``mp_prefetch`` workers, and the options leave the state (a position) unchanged.
"""

from __future__ import annotations

import functools
import logging

import grain
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import canon
from portable_loader import grain as pg

FIELDS = ("filter_warn_threshold_ratio", "filter_raise_threshold_ratio", "min_shm_size")
RATIO = st.one_of(st.none(), st.sampled_from([0.1, 0.25, 0.5, 0.75, 0.9, 0.999, 1.0]))
OPTION_KW = st.fixed_dictionaries({}, optional={"filter_warn_threshold_ratio": RATIO,
                                                "filter_raise_threshold_ratio": RATIO,
                                                "min_shm_size": st.integers(0, 4096)})


def values(opts) -> tuple:
    return tuple(getattr(opts, f) for f in FIELDS) + (opts.execution_tracking_mode.name,)


@given(st.lists(OPTION_KW, min_size=1, max_size=4))
@settings(max_examples=200, deadline=None)
def test_options_defaults_and_merges_equal_grains(kws):
    mine = [pg.experimental.DatasetOptions(**kw) for kw in kws]
    theirs = [grain.experimental.DatasetOptions(**kw) for kw in kws]
    assert [values(o) for o in mine] == [values(o) for o in theirs]
    m, t = mine[0], theirs[0]
    for a, b in zip(mine[1:], theirs[1:]):
        m, t = m.merge(a), t.merge(b)
        assert values(m) == values(t)
    assert values(pg.experimental.DatasetOptions().merge(None)) == values(grain.experimental.DatasetOptions())


def test_bad_option_values_are_refused():
    for kw in ({"filter_raise_threshold_ratio": 1.5}, {"filter_warn_threshold_ratio": "0.5"},
               {"min_shm_size": -1}, {"execution_tracking_mode": "STAGE_TIMING"}):
        with pytest.raises(ValueError, match="DatasetOptions"):
            pg.experimental.DatasetOptions(**kw)


def keep_below(k, x):
    return x % 100 < k


def batch_keep_below(k, b):
    return keep_below(k, int(b[0]) // 3)


def outcome(it, limit=20_000) -> tuple[list, str | None]:
    """Elements up to the end or the first error (its type), at most ``limit``."""
    out = []
    try:
        for x in it:
            out.append(canon(x))
            if len(out) >= limit:
                break
    except ValueError as e:  # Grain's raise threshold error (ours is a FilterError, a ValueError)
        return out, "ValueError" if "skipped" in str(e) else repr(e)
    finally:
        getattr(it, "close", lambda: None)()
    return out, None


def build(g, n, keep, where, opts_at, kws, workers=None):
    """One pipeline on Grain ``g`` (real or ours): a filter at ``where``, options at ``opts_at``."""
    ds = g.MapDataset.range(n)
    if where == "map_dataset":
        ds = ds.filter(functools.partial(keep_below, keep))
    ds = ds.to_iter_dataset()
    if opts_at[0]:
        ds = g.experimental.WithOptionsIterDataset(ds, g.experimental.DatasetOptions(**kws[0]))
    if where == "iter":
        ds = ds.filter(functools.partial(keep_below, keep))
    if workers is not None:
        ds = ds.mp_prefetch(g.MultiprocessingOptions(num_workers=workers))
    ds = ds.map(times3)
    if where == "after_batch":
        ds = ds.batch(1).filter(functools.partial(batch_keep_below, keep))
    if opts_at[1]:
        ds = g.experimental.WithOptionsIterDataset(ds, g.experimental.DatasetOptions(**kws[1]))
    return ds


@pytest.mark.slow
@given(n=st.integers(0, 4500), keep=st.integers(0, 100), where=st.sampled_from(["map_dataset", "iter", "after_batch"]),
       opts_at=st.tuples(st.booleans(), st.booleans()), kws=st.tuples(OPTION_KW, OPTION_KW))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_filters_raise_threshold_stops_the_stream_where_grains_does(n, keep, where, opts_at, kws):
    expected = outcome(iter(build(grain, n, keep, where, opts_at, kws)))
    assert outcome(iter(build(pg, n, keep, where, opts_at, kws))) == expected


@pytest.mark.slow
@pytest.mark.parametrize("where", ["map_dataset", "iter", "after_batch"])
def test_the_stop_does_not_depend_on_the_worker_count(where):
    kws = ({"filter_raise_threshold_ratio": 0.5}, {})
    expected = outcome(iter(build(grain, 5000, 40, where, (True, False), kws)))
    assert expected[1] == "ValueError" and len(expected[0]) == 400  # the first window is 60 % dropped
    for workers in (0, 2):
        assert outcome(iter(build(pg, 5000, 40, where, (True, False), kws, workers))) == expected


def test_the_warning_and_silencing_it(caplog):
    ds = pg.MapDataset.range(2000).to_iter_dataset().filter(lambda x: x % 20 == 0)   # 95 % dropped
    with caplog.at_level(logging.WARNING):
        assert len(list(ds)) == 100
    assert "skipped 95.00 % of the last seen 1000 elements" in caplog.text
    caplog.clear()
    quiet = pg.experimental.WithOptionsIterDataset(ds, pg.experimental.DatasetOptions(filter_warn_threshold_ratio=None))
    with caplog.at_level(logging.WARNING):
        assert len(list(quiet)) == 100
    assert "skipped" not in caplog.text


def test_options_are_in_the_iterator_context_and_leave_the_state_unchanged():
    ds = pg.MapDataset.range(50).to_iter_dataset().filter(lambda x: x % 3)
    inner = pg.experimental.DatasetOptions(filter_warn_threshold_ratio=0.1, filter_raise_threshold_ratio=0.2)
    outer = pg.experimental.DatasetOptions(filter_raise_threshold_ratio=0.4)
    with_opts = pg.experimental.WithOptionsIterDataset(
        pg.experimental.WithOptionsIterDataset(ds, inner).map(lambda x: x), outer)
    plain = ds.map(lambda x: x)
    it = iter(with_opts)
    assert it._ctx.dataset_options == pg.experimental.DatasetOptions(filter_warn_threshold_ratio=0.1,
                                                                      filter_raise_threshold_ratio=0.4)
    next(it), next(it)
    other = iter(plain)
    other.set_state(it.get_state())  # options are not part of the pipeline's fingerprint
    assert list(other) == list(it)


# --- get_next_index / set_next_index ---------------------------------------------------------------


def plus_index(i, x):
    return x + 1000 * i


def jitter(x, rng):
    return x + int(rng.integers(0, 1000))


def double(x):
    return x * 2


def times3(x):
    return x * 3


STEPS = st.lists(st.sampled_from(["map", "random_map", "map_with_index", "batch2", "batch3"]), max_size=4)


def indexed(g, n, steps, workers=None):
    ds = g.MapDataset.range(n).to_iter_dataset()
    if workers is not None:
        ds = ds.mp_prefetch(g.MultiprocessingOptions(num_workers=workers))
    for s in steps:
        if s == "map":
            ds = ds.map(double)
        elif s == "random_map":
            ds = ds.random_map(jitter, seed=7)
        elif s == "map_with_index":
            ds = ds.map_with_index(plus_index)
        else:
            ds = ds.batch(int(s[-1]), drop_remainder=True)  # a ragged batch of batches fails in Grain too
    return ds


@given(n=st.integers(1, 40), steps=STEPS, data=st.data())
@settings(max_examples=80, deadline=None)
def test_next_index_equals_grains_when_reading_and_after_setting_it(n, steps, data):
    theirs, ours = iter(indexed(grain, n, steps)), iter(indexed(pg, n, steps))
    while True:
        assert pg.experimental.get_next_index(ours) == grain.experimental.get_next_index(theirs)
        a, b = next(theirs, None), next(ours, None)
        assert canon(b) == canon(a)
        if a is None:
            break
    total = grain.experimental.get_next_index(theirs)
    for i in data.draw(st.lists(st.integers(0, max(total - 1, 0)), max_size=5)):
        grain.experimental.set_next_index(theirs, i)
        pg.experimental.set_next_index(ours, i)
        assert pg.experimental.get_next_index(ours) == i
        assert canon(next(ours, None)) == canon(next(theirs, None))


def test_next_index_with_workers_equals_without():
    for workers in (0, 2):
        it = iter(indexed(pg, 30, ["map", "batch2"], workers))
        pg.experimental.set_next_index(it, 9)
        assert pg.experimental.get_next_index(it) == 9
        assert next(it).tolist() == [36, 38] and pg.experimental.get_next_index(it) == 10
        it.close()


def test_next_index_is_refused_where_it_is_not_arithmetic():
    with_filter = pg.MapDataset.range(10).to_iter_dataset().filter(lambda x: x % 2)
    holes = pg.MapDataset.range(10).filter(lambda x: x % 2).to_iter_dataset().map(lambda x: x)
    mixed = pg.IterDataset.mix([pg.MapDataset.range(5).to_iter_dataset(), pg.MapDataset.range(5).to_iter_dataset()])
    packed = pg.experimental.FirstFitPackIterDataset(
        pg.MapDataset.source([{"a": [1, 2]}] * 4).to_iter_dataset(), length_struct={"a": 4}, num_packing_bins=2)
    for ds in (with_filter, holes, mixed, packed, with_filter.batch(2)):
        it = iter(ds)
        with pytest.raises(ValueError, match="get_state"):
            pg.experimental.get_next_index(it)
        with pytest.raises(ValueError, match="get_state"):
            pg.experimental.set_next_index(it, 1)
    it = iter(pg.MapDataset.range(10).to_iter_dataset())
    with pytest.raises(IndexError):
        pg.experimental.set_next_index(it, 11)
