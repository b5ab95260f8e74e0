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

_CHUNK = 4096


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
        self._chunk: tuple[int, np.ndarray] | None = None

    def records(self, lo: int, hi: int) -> np.ndarray:
        """Record indices at global stream positions ``[lo, hi)``.

        Looked up a chunk of ``_CHUNK`` positions at a time: one vectorized sampler call costs about
        as much for 4096 positions as for 8, and consecutive steps read consecutive positions.
        """
        parts = []
        while lo < hi:
            chunk = lo // _CHUNK
            if self._chunk is None or self._chunk[0] != chunk:
                first = chunk * _CHUNK
                last = first + _CHUNK if self.total is None else min(first + _CHUNK, self.total)
                self._chunk = (chunk, self.sampler.stream_indices(np.arange(first, last, dtype=np.int64)))
            end = min(hi, (chunk + 1) * _CHUNK)
            parts.append(self._chunk[1][lo - chunk * _CHUNK : end - chunk * _CHUNK])
            lo = end
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

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
