"""precache's task plan (row ranges per worker and shard) and the new modules' docstring examples."""

import doctest
import importlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_loader.precache.plan import cpu_count, plan_shards


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10_000), st.none() | st.integers(0, 64))
def test_tasks_cover_the_rows_once_in_order_in_near_equal_ranges(rows, num_workers):
    tasks = plan_shards(rows, num_workers)
    wanted = cpu_count() if num_workers is None else num_workers
    assert len(tasks) == max(1, min(wanted, rows))
    # Contiguous and in order: concatenating the shards gives the input's rows, each exactly once.
    covered = [r for t in tasks for r in range(t.lo, t.hi)]
    assert covered == list(range(rows))
    sizes = [t.hi - t.lo for t in tasks]
    assert max(sizes) - min(sizes) <= 1
    assert rows == 0 or min(sizes) >= 1
    assert [(t.index, t.count) for t in tasks] == [(i, len(tasks)) for i in range(len(tasks))]
    assert len({t.file("arrow") for t in tasks}) == len(tasks)


@pytest.mark.parametrize("name", [
    "portable_loader.digests", "portable_loader.precache.plan", "portable_loader.cache",
    "portable_loader.cache.manifest", "portable_loader.cache.writer", "portable_loader.cache.publish",
])
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0 and result.attempted > 0
