"""The global plan: which record pieces fill which rows of global step ``s``, by arithmetic.

The global record stream is position ``p -> (epoch p // N, sampler(epoch, p % N))``.

* Padding: step ``s`` takes positions ``[sB, (s+1)B)``, one record per row (cut to ``seq_len``).
* Packing: the stream is cut into windows of ``W`` positions; each window is packed on its own (a
  pure function of its records' lengths) and the row stream is the windows' rows in order. Step
  ``s`` takes the next ``B`` rows.

A ``Cursor`` (step, window, row) is where the next step starts; restoring one re-plans at most one
window, O(W), never O(steps). Hosts cut the same global rows at different offsets, so their number
never changes the stream.

Example:
    >>> from portable_loader.sampler import LCGSampler
    >>> p = Planner(LCGSampler(10, seed=0, num_epochs=1), 10, global_batch_size=4, seq_len=8)
    >>> rows, nxt = p.step(Cursor(0, 0, 0))
    >>> len(rows), nxt
    (4, Cursor(step=1, window=0, row=0))
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from portable_loader.collate import Piece, pack
from portable_loader.sampler import LCGSampler

__all__ = ["Cursor", "Planner"]


class Cursor(NamedTuple):
    """Where the next global step starts (``window``/``row`` are used in packing mode only)."""

    step: int
    window: int
    row: int


class Planner:
    """Plans global steps; ``step(cursor)`` -> (rows of pieces, next cursor), or None at the end."""

    def __init__(
        self,
        sampler: LCGSampler,
        num_records: int,
        *,
        global_batch_size: int,
        seq_len: int,
        packing: bool = False,
        window: int = 1024,
        lengths: Callable[[np.ndarray], np.ndarray] | None = None,
    ):
        self.sampler, self.n = sampler, num_records
        self.batch, self.seq_len, self.packing, self.window = global_batch_size, seq_len, packing, window
        self.total = None if sampler.num_epochs is None else sampler.num_epochs * num_records
        self._lengths = lengths
        self._windows: dict[int, list[list[Piece]] | None] = {}

    def records(self, lo: int, hi: int) -> np.ndarray:
        """Record indices at global stream positions ``[lo, hi)``."""
        return self.sampler.stream_indices(np.arange(lo, hi, dtype=np.int64))

    def window_rows(self, w: int) -> list[list[Piece]] | None:
        if w not in self._windows:
            lo = w * self.window
            if self.total is not None and lo >= self.total:
                rows = None
            else:
                hi = lo + self.window if self.total is None else min(lo + self.window, self.total)
                recs = self.records(lo, hi)
                rows = pack(recs, self._lengths(recs), self.seq_len)
            if len(self._windows) >= 2:
                self._windows.pop(min(self._windows))
            self._windows[w] = rows
        return self._windows[w]

    def step(self, cur: Cursor) -> tuple[list[list[Piece]], Cursor] | None:
        if not self.packing:
            lo = cur.step * self.batch
            if self.total is not None and lo >= self.total:
                return None
            hi = lo + self.batch if self.total is None else min(lo + self.batch, self.total)
            # End = seq_len: collate cuts each record to its own length.
            rows = [[(idx, 0, self.seq_len)] for idx in self.records(lo, hi).tolist()]
            return rows + [[] for _ in range(self.batch - len(rows))], Cursor(cur.step + 1, 0, 0)
        rows: list[list[Piece]] = []
        w, r = cur.window, cur.row
        while len(rows) < self.batch:
            window = self.window_rows(w)
            if window is None:
                break
            take = window[r : r + self.batch - len(rows)]
            rows += take
            r += len(take)
            if r >= len(window):
                w, r = w + 1, 0
        if not rows:
            return None
        return rows + [[] for _ in range(self.batch - len(rows))], Cursor(cur.step + 1, w, r)
