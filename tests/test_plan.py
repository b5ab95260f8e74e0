"""precache's task plan (row ranges per worker and shard) and the new modules' docstring examples."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_loader.io import open_inputs
from portable_loader.io.tables import open_input
from portable_loader.precache.plan import plan_tasks, split_rows


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 10_000), st.integers(1, 3_000))
def test_split_rows_covers_the_range_once_in_order_in_near_equal_ranges(lo, n, per_task):
    pieces = split_rows(lo, lo + n, per_task)
    assert len(pieces) == -(-n // per_task)  # the fewest ranges of at most per_task rows
    assert [r for a, b in pieces for r in range(a, b)] == list(range(lo, lo + n))
    sizes = [b - a for a, b in pieces]
    assert all(1 <= s <= per_task for s in sizes) and (not sizes or max(sizes) - min(sizes) <= 1)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.integers(1, 50), st.data())
def test_tasks_never_span_files_and_read_alone_give_the_tables_rows(tmp_path_factory, sizes, per_task, data):
    folder = tmp_path_factory.mktemp("in")
    for k, n in enumerate(sizes):
        (folder / f"part-{k}.jsonl").write_text("".join(json.dumps({"text": f"{k}-{i}"}) + "\n" for i in range(n)))
    total = sum(sizes)
    lo = data.draw(st.integers(0, total - 1))
    hi = data.draw(st.integers(lo + 1, total))
    table = open_inputs(str(folder), f"train[{lo}:{hi}]")
    tasks = plan_tasks(table, per_task)
    assert [(t.index, t.count) for t in tasks] == [(i, len(tasks)) for i in range(len(tasks))]
    assert [r for t in tasks for r in range(t.lo, t.hi)] == list(range(hi - lo))
    assert all(1 <= t.hi - t.lo <= per_task for t in tasks) and len({t.shard("arrow") for t in tasks}) == len(tasks)
    # The oracle: each task's file, opened alone, gives the rows the whole table gives for that range.
    for t in tasks:
        alone = [row for _, row in open_input(t.file).read(t.file_lo, t.file_lo + t.hi - t.lo)]
        assert alone == [row for _, row in table.read(t.lo, t.hi)]
    # A function of the input and rows_per_task alone.
    assert plan_tasks(open_inputs(str(folder), f"train[{lo}:{hi}]"), per_task) == tasks


@pytest.mark.parametrize("gz", [False, True])
def test_a_task_opened_at_its_seek_point_reads_its_rows_without_reading_the_file_before_it(tmp_path, gz):
    """Checkpoints every 7 lines, so tasks start past line 0; then every byte before each task's seek
    offset is overwritten (same length, no newline): a reader that scanned or read from the start
    would number the lines wrongly or hit garbage. A gzip file has no seek: it reads from its start."""
    import gzip

    import portable_loader.io.tables as tables

    lines = [json.dumps({"text": f"row {i}"}) + "\n" for i in range(100)]
    lines[40] = "  \n"  # a blank line is a row number with nothing to read, as for the whole table
    path = tmp_path / ("a.jsonl.gz" if gz else "a.jsonl")
    data = "".join(lines).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tables, "_CHECKPOINT_EVERY", 7)
        table = open_inputs(str(path))
        tasks = plan_tasks(table, 16)
        want = {t.index: list(table.read(t.lo, t.hi)) for t in tasks}
    assert [t.seek[0] for t in tasks] == [100] * len(tasks)  # the file's row count, from the listing
    assert [t.seek[1] for t in tasks] == ([0] * len(tasks) if gz else [t.file_lo // 7 * 7 for t in tasks])
    assert all(t.seek[1] <= t.file_lo for t in tasks) and (gz or tasks[-1].seek[2] > 0)
    for t in tasks:
        if not gz:
            path.write_bytes(b"x" * t.seek[2] + data[t.seek[2]:])
        alone = open_input(str(path), seek=t.seek)
        assert len(alone) == 100 and list(alone.read(t.file_lo, t.hi)) == want[t.index]
        assert alone.where(t.file_lo) == f"line {t.file_lo + 1}"


def test_rows_per_task_must_be_a_positive_integer(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="rows_per_task must be an integer >= 1"):
            plan_tasks(open_inputs(str(tmp_path / "a.jsonl")), bad)
