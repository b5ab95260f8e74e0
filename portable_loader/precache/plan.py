"""The logical tasks of a precache run: which contiguous input rows each worker turns into which shard.

The tasks follow from the row count and the worker count alone (never from timing), so the shards
a run will write are fixed before any process starts, and the records, in order, are the same for
any worker count.

Example:
    >>> [(t.lo, t.hi, t.file("arrow")) for t in plan_shards(10, 3)]
    [(0, 3, 'data-00000-of-00003.arrow'), (3, 6, 'data-00001-of-00003.arrow'), (6, 10, 'data-00002-of-00003.arrow')]
"""

from __future__ import annotations

import os
from typing import NamedTuple

from portable_loader.cache.writer import shard_name


class ShardTask(NamedTuple):
    """Rows ``[lo, hi)`` of the input, tokenized into shard ``index`` of ``count``.

    Example:
        >>> ShardTask(1, 4, 25, 50).file("array_record")
        'data-00001-of-00004.array_record'
    """

    index: int
    count: int
    lo: int
    hi: int

    def file(self, backend: str) -> str:
        return shard_name(backend, self.index, self.count)


def plan_shards(rows: int, num_workers: int | None) -> list[ShardTask]:
    """One task per worker: ``rows`` split into near-equal contiguous ranges, at least one row each.

    ``num_workers`` None means all cores; 0 means this process, as for ``DataLoader``, so one task.

    Example:
        >>> [(t.lo, t.hi) for t in plan_shards(5, 0)]
        [(0, 5)]
    """
    workers = max(1, min(cpu_count() if num_workers is None else int(num_workers), rows))
    bounds = [rows * i // workers for i in range(workers + 1)]
    return [ShardTask(i, workers, bounds[i], bounds[i + 1]) for i in range(workers)]


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
