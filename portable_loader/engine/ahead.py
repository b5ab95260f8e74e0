"""Lengths computed ahead by the loader's worker processes, for a source whose lengths cost a tokenization.

A packed loader plans a window from its records' lengths before it reads a record; over
:func:`portable_loader.tokenized` a length is a tokenization. So the main process does not ask
the source: the stream is cut into blocks of ``planner.window`` positions (a block is a packing
window; a padded loader with ``overlong="drop"`` reads lengths too), and each block whose lengths
are not known yet is split into one part per worker, sent ahead on the workers' inboxes. A worker
tokenizes its part, hands the records over (``source.tokenize_ahead``: a file the other workers
read) and answers with the lengths; the planner's ``lengths`` waits for the parts covering what
it asks for and takes their answers. The plan is still made in one place, from the same lengths,
so the batches cannot depend on the number of workers; tokenization runs on all of them.

A part that fails (a bad row with ``on_bad_row="error"``) answers nothing: the source then
tokenizes those records in the main process, which raises the row's own error. The files of a
block are removed once every step that reads it has been returned, and all of them at close.

Example:
    >>> import portable_loader as pl
    >>> from portable_loader.precache import sample_args
    >>> ds = pl.tokenized(**sample_args())   # a length costs a tokenization
    >>> planner = pl.DataLoader(ds, global_batch_size=8, seq_len=256, packing=True, packing_window=64).planner()
    >>> wanted(ds, planner)
    True
    >>> inboxes = {0: [], 1: []}             # two workers' inboxes; here "the workers" answer in-process
    >>> def receive(j, key):
    ...     (part, name), = [payload for k, payload in inboxes[j] if k == key]
    ...     return "ok", ds.tokenize_ahead(part, name)
    >>> ahead = Ahead(planner, ds, workers=2, send=lambda j, task: inboxes[j].append(task), receive=receive)
    >>> first = ahead.block_of(Cursor(0, 0, 0))
    >>> ahead.dispatch(first); ahead.dispatch(first + AHEAD_BLOCKS)   # the block planned next, and 2 more
    >>> [key for key, _ in inboxes[0]]       # ("ahead", block, part): a part of each block per worker
    [('ahead', 0, 0), ('ahead', 1, 0), ('ahead', 2, 0)]
    >>> rows, cursor = planner.step(Cursor(0, 0, 0))   # takes block 0's answers: the window's 64 lengths
    >>> ds.encoded, len(ds.unknown(np.arange(len(ds))))
    (64, 1936)
    >>> ahead.close()                                  # the planner asks the source itself again
"""

from __future__ import annotations

import uuid
from collections import deque

import numpy as np

from portable_loader.plan import Cursor, Planner

__all__ = ["AHEAD_BLOCKS", "Ahead", "wanted"]

AHEAD_BLOCKS = 2  # blocks in flight beyond the one being planned: every worker has its next part queued


def wanted(source, planner: Planner) -> bool:
    """Whether ``planner`` reads lengths from ``source`` that its workers should compute ahead."""
    return source.tokenizes_ahead and (planner.packing or planner.overlong == "drop")


class Ahead:
    """Sends blocks to workers and answers the planner's ``lengths`` from their replies.

    ``send(worker, task)`` puts a task on a worker's inbox; ``receive(worker, key)`` returns that
    worker's reply ``(kind, value)`` for ``key`` (raising if the worker died). While it exists, the
    planner's lengths come through :meth:`lengths`; :meth:`close` gives the planner its own back.
    """

    def __init__(self, planner: Planner, source, *, workers: int, send, receive):
        self.planner, self.source, self.workers = planner, source, workers
        self._send, self._receive = send, receive
        self._tag = uuid.uuid4().hex[:8]  # file names of this loader's blocks, apart from earlier ones
        self._next: int | None = None  # the first block not yet sent
        self._pending: dict[int, list[tuple[int, np.ndarray, str]]] = {}  # block -> its parts in flight
        self._answered: deque = deque()  # (block, file names) whose lengths were taken
        # The planner belongs to this loader's iterator, and only this engine plans with it while
        # the engine lives (set_state closes the engine first).
        self._inner = planner.use_lengths(self.lengths)

    def block_of(self, cursor: Cursor) -> int:
        """The block holding the next position ``cursor`` plans from."""
        if self.planner.packing:
            return cursor.window
        return self.planner.resolve(cursor).samples // self.planner.window

    def dispatch(self, last: int) -> None:
        """Send every block up to ``last`` not sent yet (from the first one asked for)."""
        if self._next is None:
            self._next = last
        total, w = self.planner.total, self.planner.window
        while self._next <= last and (total is None or self._next * w < total):
            b = self._next
            lo = b * w
            hi = lo + w if total is None else min(lo + w, total)
            todo = self.source.unknown(self.planner.records(lo, hi))
            parts = []
            for j, part in enumerate(np.array_split(todo, self.workers)):
                if part.size:
                    name = f"{self._tag}-{b}-{j}"
                    self._send(j, (("ahead", b, j), (part, name)))
                    parts.append((j, part, name))
            if parts:  # none from the second epoch on: every length is known
                self._pending[b] = parts
            self._next += 1

    def lengths(self, recs: np.ndarray) -> np.ndarray:
        """The planner's lengths: wait for the blocks in flight that hold unknown ones, then ask the source."""
        unknown = self.source.unknown(recs)
        extra = AHEAD_BLOCKS + 1  # a step longer than the blocks sent (tiny windows): send a few more
        while unknown.size:
            covering = [b for b in sorted(self._pending)
                        if any(np.isin(part, unknown).any() for _, part, _ in self._pending[b])]
            if not covering:
                if extra == 0 or self._next is None:
                    break
                extra -= 1
                self.dispatch(self._next)
                continue
            if not self._take(covering[0]):
                break  # a part failed: the source meets its error again, here
            unknown = self.source.unknown(unknown)
        return self._inner(recs)  # what no worker answered, the source tokenizes here

    def _take(self, b: int) -> bool:
        """Take block ``b``'s answers; False if a part failed."""
        parts, names = self._pending.pop(b), []
        for j, part, name in parts:
            kind, value = self._receive(j, ("ahead", b, j))
            if kind == "ok":
                self.source.learn(part, value)
                names.append(name)
        self._answered.append((b, names))
        return len(names) == len(parts)

    def served(self, cursor: Cursor) -> None:
        """Every step before ``cursor`` was returned: remove the files of the blocks they read."""
        first = self.block_of(cursor)
        while self._answered and self._answered[0][0] < first:
            for name in self._answered.popleft()[1]:
                self.source.drop_handover(name)

    def close(self) -> None:
        """Give the planner its lengths back and remove every file of this loader."""
        self.planner.use_lengths(self._inner)
        self._pending.clear()
        self._answered.clear()
        self.source.drop_handover()
