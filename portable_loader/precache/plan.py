"""The logical tasks of a precache run: which input rows become which shard.

The plan is a function of the input (its files and their row counts) and ``rows_per_task`` alone:
never of the worker count, the engine or timing. Every file's rows are cut into near-equal
contiguous tasks of at most ``rows_per_task`` rows (a task never spans two files), numbered in input
order, and task ``k`` writes shard ``k``. So the shard files of a cache are byte-identical whether
one process, a pool or a Ray cluster ran the tasks, and whichever node ran which task.

Example:
    >>> split_rows(0, 10, 4)
    [(0, 3), (3, 6), (6, 10)]
    >>> ShardTask(1, 4, 25, 50, "a.jsonl", 25).shard("arrow")
    'data-00001-of-00004.arrow'
"""

from __future__ import annotations

import os
from typing import NamedTuple

from portable_loader.cache.writer import shard_name

# Big enough that a task's start-up (opening the file, loading the tokenizer) is noise, small enough
# that a lost node's rerun, and the progress bar's steps, are a few seconds of work.
DEFAULT_ROWS_PER_TASK = 50_000
# A smaller input is still cut into up to this many tasks (of at least 1,000 rows), so that a
# 30,000-row SFT set keeps every core busy; the cut depends on the row count alone, never on the
# worker count or the engine, so the shard files stay identical.
_MIN_TASKS, _MIN_ROWS_PER_TASK = 64, 1_000


def default_rows_per_task(total_rows: int) -> int:
    """The ``rows_per_task`` used when none is given: a function of the input's row count alone.

    Example:
        >>> default_rows_per_task(7_473), default_rows_per_task(1_000_000), default_rows_per_task(10**9)
        (1000, 15625, 50000)
    """
    return min(DEFAULT_ROWS_PER_TASK, max(_MIN_ROWS_PER_TASK, -(-int(total_rows) // _MIN_TASKS)))


class ShardTask(NamedTuple):
    """Window rows ``[lo, hi)`` of the input, tokenized into shard ``index`` of ``count``.

    The rows all lie in one file: ``file`` (None for an in-memory dataset), where ``lo`` is row
    ``file_lo`` of that file read alone (no split), so a remote worker can read them from storage.
    ``seek`` (JSONL and text files): where the listing found line ``file_lo`` or one a little before it
    (see :meth:`~portable_loader.io.tables.InputTable.seek_point`), so the worker opens the file there
    instead of scanning it from the start.

    Example:
        >>> ShardTask(0, 1, 0, 10, "x.jsonl", 0).shard("array_record")
        'data-00000-of-00001.array_record'
    """

    index: int
    count: int
    lo: int
    hi: int
    file: str | None
    file_lo: int
    seek: tuple[int, int, int] | None = None

    def shard(self, backend: str) -> str:
        return shard_name(backend, self.index, self.count)


def split_rows(lo: int, hi: int, rows_per_task: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into the fewest near-equal contiguous ranges of at most ``rows_per_task`` rows.

    Example:
        >>> split_rows(5, 8, 100)
        [(5, 8)]
    """
    n = hi - lo
    k = -(-n // rows_per_task)
    return [(lo + n * i // k, lo + n * (i + 1) // k) for i in range(k)]


def plan_tasks(table, rows_per_task: int = DEFAULT_ROWS_PER_TASK) -> list[ShardTask]:
    """The tasks for an open input table (see :func:`portable_loader.io.open_inputs`).

    Example:
        >>> from portable_loader.precache import sample_args
        >>> from portable_loader.io import open_inputs
        >>> [(t.lo, t.hi) for t in plan_tasks(open_inputs(sample_args()["input"]), 20)][:2]
        [(0, 20), (20, 40)]
    """
    if isinstance(rows_per_task, bool) or not isinstance(rows_per_task, int) or rows_per_task < 1:
        raise ValueError(f"rows_per_task must be an integer >= 1, got {rows_per_task!r}")
    pieces = []
    for t, path, lo, hi, file_lo in _file_spans(table):
        for a, b in split_rows(lo, hi, rows_per_task):
            f = file_lo + a - lo
            pieces.append((a, b, path, f, t.seek_point(f)))
    return [ShardTask(i, len(pieces), *piece) for i, piece in enumerate(pieces)]


def _file_spans(table) -> list[tuple]:
    """``(file's table, file, window_lo, window_hi, file_lo)`` for each file with rows in the window."""
    parts = getattr(table, "tables", None)
    if parts is None:
        path = table.path if table.kind != "hf_dataset" else None
        return [(table, path, 0, len(table), table.start)]
    spans = []
    for k, t in enumerate(parts):
        a, b = max(table.start, int(table.bounds[k])), min(table.stop, int(table.bounds[k + 1]))
        if a < b:
            spans.append((t, t.path, a - table.start, b - table.start, t.start + a - int(table.bounds[k])))
    return spans


def cpu_count() -> int:
    """The cores this process may run on (its affinity mask where the OS has one).

    Example:
        >>> cpu_count() >= 1
        True
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
