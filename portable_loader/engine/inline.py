"""The inline engine: plan, fetch and collate a step in the calling thread.

``build_batch`` is the one function every engine (inline, prefetch thread, worker process) runs
to turn a row plan into a batch, so the engine never changes what a batch holds.

Example:
    >>> from portable_loader.dataset import source
    >>> src = source([{"input_ids": np.arange(3, dtype=np.int32)}])
    >>> build_batch(src, [[(0, 0, 4)]], seq_len=4, pad_id=0)["input_ids"].tolist()
    [[0, 1, 2, 0]]
"""

from __future__ import annotations

import numpy as np

from portable_loader.collate import FIELDS, collate
from portable_loader.plan import Cursor, Planner

__all__ = ["InlineEngine", "build_batch"]


def build_batch(source, rows, seq_len: int, pad_id: int, fields=FIELDS) -> dict[str, np.ndarray]:
    """Fetch the records a row plan names (one batched read) and collate ``fields`` of them."""
    wanted = sorted({piece[0] for row in rows for piece in row})
    records = dict(zip(wanted, source.__getitems__(np.asarray(wanted, dtype=np.int64))))
    if any(r is None for r in records.values()):  # a filter's hole: the plan only names records it accepted
        i = next(k for k, r in records.items() if r is None)
        raise ValueError(f"record {i} was planned as accepted but a filter rejects it now: a filter's predicate must be "
                         "a pure function of the record (same answer in every process and every call)")
    return collate(rows, records, seq_len, pad_id, fields)


class InlineEngine:
    """No prefetch: plan, fetch and collate in the caller's thread.

    ``loader`` is a ``DataLoader`` (anything with ``source``, ``seq_len``, ``pad_id``, ``fields``
    and ``local_rows``); ``next()`` returns ``(batch, cursor after it)``.

    Example:
        >>> engine = InlineEngine(loader, loader.planner(), Cursor(0, 0, 0))   # doctest: +SKIP
        >>> batch, cursor = engine.next()                                      # doctest: +SKIP
    """

    def __init__(self, loader, planner: Planner, cursor: Cursor):
        self.loader, self.planner, self.cursor = loader, planner, cursor

    def next(self) -> tuple[dict, Cursor]:
        planned = self.planner.step(self.cursor)
        if planned is None:
            raise StopIteration
        rows, self.cursor = planned
        loader = self.loader
        batch = build_batch(loader.source, loader.local_rows(rows), loader.seq_len, loader.pad_id, loader.fields)
        return batch, self.cursor

    def close(self) -> None:
        pass
