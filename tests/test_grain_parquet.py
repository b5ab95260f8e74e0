"""grain.experimental.ParquetIterDataset and InterleaveIterDataset against real Grain 0.2.18: the
same rows and the same states at every step (one file, several files through Grain's interleave
of 16), every state resumes, bad states are refused, a single file runs inside our pipelines, and
the interleave's order over datasets and MapDatasets of datasets is Grain's."""

import json

import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_loader import grain as pg
from portable_loader.errors import StateError


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x.item() if isinstance(x, np.generic) else x


def _walk(it):
    steps = [(None, _plain(it.get_state()))]
    steps += [(_plain(x), _plain(it.get_state())) for x in it]
    return steps


def _write(folder, sizes, group):
    paths, start = [], 0
    for k, n in enumerate(sizes):
        path = str(folder / f"f{k}.parquet")
        pq.write_table(pa.table({"x": list(range(start, start + n)), "s": [f"r{i}" for i in range(start, start + n)]}),
                       path, row_group_size=group)
        paths.append(path)
        start += 1000
    return paths


@settings(max_examples=7, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=4), group=st.integers(1, 4), single=st.booleans())
def test_rows_and_states_equal_grains_at_every_step_and_every_state_resumes(tmp_path_factory, sizes, group, single):
    paths = _write(tmp_path_factory.mktemp("pq"), sizes, group)
    arg = paths[0] if single else paths
    want = _walk(iter(grain.experimental.ParquetIterDataset(arg)))
    assert _walk(iter(pg.experimental.ParquetIterDataset(arg))) == want
    for k, (_, state) in enumerate(want):
        it = iter(pg.experimental.ParquetIterDataset(arg))
        it.set_state(state)
        assert [_plain(x) for x in it] == [x for x, _ in want[k + 1:]]


def test_bad_states_are_refused_and_one_file_runs_inside_a_pipeline(tmp_path):
    (path,) = _write(tmp_path, [7], 3)
    for bad in ({"row_group": 5, "index_within_row_group": 0}, {"row_group": 0, "index_within_row_group": 4},
                {"row_group": "0", "index_within_row_group": 0}, {}):
        with pytest.raises(StateError):
            iter(pg.experimental.ParquetIterDataset(path)).set_state(bad)

    def pipeline(g):
        return g.experimental.ParquetIterDataset(path).map(lambda r: int(r["x"]) * 2).filter(lambda v: v % 3).batch(2)

    want = [b.tolist() for b in pipeline(grain)]
    it = iter(pipeline(pg))
    states = [it.get_state()] + [it.get_state() for _ in it]
    for k, state in enumerate(states):
        again = iter(pipeline(pg))
        again.set_state(state)
        assert [b.tolist() for b in again] == want[k:]
    assert sorted(states[1]["cursor"]) == ["0.parquet.index_within_row_group", "0.parquet.row_group"]


def _sources(g, sizes):
    return [g.MapDataset.range(100 * k, 100 * k + n) for k, n in enumerate(sizes)]


@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=6), cycle=st.integers(1, 7), as_iter=st.booleans())
def test_interleave_order_equals_grains_and_every_state_resumes(sizes, cycle, as_iter):
    def build(g):
        parts = _sources(g, sizes)
        return g.experimental.InterleaveIterDataset([p.to_iter_dataset() for p in parts] if as_iter else parts,
                                                    cycle_length=cycle)

    want = [x for x in build(grain)]
    it = iter(build(pg))
    states = [it.get_state()] + [it.get_state() for _ in it]
    assert [x for x in build(pg)] == want
    for k, state in enumerate(states):
        again = iter(build(pg))
        again.set_state(state)
        assert list(again) == want[k:]


def test_interleave_of_a_map_dataset_of_datasets_is_grains():
    def build(g):
        files = g.MapDataset.source([3, 0, 5, 2]).map(lambda n: g.MapDataset.range(n).map(lambda i: n * 10 + i))
        return g.experimental.InterleaveIterDataset(files.shuffle(seed=4), cycle_length=2)

    assert list(build(pg)) == list(build(grain))
    with pytest.raises(ValueError, match="cycle_length"):
        pg.experimental.InterleaveIterDataset([], cycle_length=0)


def test_interleave_composes_with_built_in_steps():
    # Over MapDatasets the inner states are pipeline positions, not integers: the interleave runs as an
    # opaque step, its Grain state nested under "steps", and every state taken mid-stream resumes.
    def build(g):
        ds = g.experimental.InterleaveIterDataset(_sources(g, [3, 4, 2]), cycle_length=2)
        return ds.map(lambda x: x + 1).batch(2)

    want = [b.tolist() for b in build(grain)]
    assert [b.tolist() for b in build(pg)] == want
    it = iter(build(pg))
    states = [it.get_state()] + [it.get_state() for _ in it]
    assert list(states[1]["steps"]) == ["0.interleave"]
    assert states[1]["steps"]["0.interleave"]["next_index_in_datasets"] == 2
    for k, state in enumerate(states):
        again = iter(build(pg))
        again.set_state(json.loads(json.dumps(state)))  # as a checkpoint holds it
        assert [b.tolist() for b in again] == want[k:]
    # Under mp_prefetch the step runs here, once: the same stream, and its state resumes at 0 workers.
    two = iter(build(pg).mp_prefetch(pg.MultiprocessingOptions(num_workers=2)))
    assert next(two).tolist() == want[0]
    again = iter(build(pg))
    again.set_state(two.get_state())
    two.close()
    assert [b.tolist() for b in again] == want[1:]


@pytest.mark.parametrize("through", ["paths", "interleave"])
def test_several_parquet_files_compose_with_built_in_steps_and_resume(tmp_path, through):
    paths = _write(tmp_path, [3, 5, 2], 2)

    def build(g):
        if through == "paths":
            files = g.experimental.ParquetIterDataset(paths)
        else:  # as Grain's parquet_dataset_test: a MapDataset of files, interleaved
            files = g.experimental.InterleaveIterDataset(
                g.MapDataset.source(paths).map(g.experimental.ParquetIterDataset), cycle_length=2)
        ds = files.map(lambda r: int(r["x"]))
        return g.experimental.WindowShuffleIterDataset(ds, window_size=3, seed=42).batch(2)

    want = [b.tolist() for b in build(grain)]
    it = iter(build(pg))
    states = [it.get_state()] + [it.get_state() for _ in it]
    assert [b.tolist() for b in build(pg)] == want
    for k, state in enumerate(states):
        again = iter(build(pg))
        again.set_state(state)
        assert [b.tolist() for b in again] == want[k:]
