"""Lengths computed ahead by the loader's worker processes, for a source whose lengths cost a tokenization.

A packed loader plans a window from its records' lengths before it reads a record; over
:func:`portable_loader.tokenized` a length is a tokenization. So the main process does not
compute them: the stream is cut into blocks of ``spec.packing_window`` positions (a block is a
packing window; a padded loader with ``overlong="drop"`` reads lengths too, and any padded loader
tokenizes by blocks: a step's few records would pay the tokenizer's fixed costs per step), and each
block whose lengths are not known yet is split into one part per worker, sent ahead on the
workers' inboxes.
A worker tokenizes its part, hands the records over (``source.tokenize_ahead``: a file the other
workers read) and answers with the lengths, which the dataset learns (``source.learn``). Before
the engine takes the next plan, :meth:`Ahead.ready` waits for the blocks that plan reads lengths
from (``StepPlans.lengths_ahead``); the planner then asks the dataset's ``lengths``, which knows
them. The plan is still made in one place, from the same lengths, so the batches cannot depend
on the number of workers; tokenization runs on all of them.

A part that fails (a bad row with ``on_bad_row="error"``) answers nothing: the dataset then
tokenizes those records in the main process when the planner asks, which raises the row's own
error. The files of a block are removed once every step that reads it has been returned, and all
of them at close.

Example:
    >>> import portable_loader as pl
    >>> from portable_loader.precache import sample_args
    >>> from portable_loader.step_plans import StepPlans
    >>> ds = pl.tokenized(**sample_args())   # a length costs a tokenization
    >>> loader = pl.DataLoader(ds, global_batch_size=8, seq_len=256, packing=True, packing_window=64)
    >>> wanted(ds, loader.spec)
    True
    >>> plans = StepPlans(loader.spec, loader.planner(), Cursor(0, 0, 0))
    >>> inboxes = {0: [], 1: []}             # two workers' inboxes; here "the workers" answer in-process
    >>> def receive(j, key):
    ...     (part, name), = [payload for k, payload in inboxes[j] if k == key]
    ...     return "ok", ds.tokenize_ahead(part, name)
    >>> ahead = Ahead(plans, ds, workers=2, send=lambda j, task: inboxes[j].append(task), receive=receive)
    >>> ahead.ready()                        # sends block 0, takes its answers: what the first step packs
    >>> ahead.dispatch(AHEAD_BLOCKS)         # the next blocks, ahead of the steps that read them
    >>> [key for key, _ in inboxes[0]]       # ("ahead", block, part): a part of each block per worker
    [('ahead', 0, 0), ('ahead', 1, 0), ('ahead', 2, 0)]
    >>> rows, cursor = plans.next()          # the planner's lengths come from the dataset, known
    >>> ds.encoded, len(ds.unknown(np.arange(len(ds))))
    (64, 1936)
    >>> ahead.close()                        # removes the workers' hand-over files
"""

from __future__ import annotations

import uuid
from collections import deque

import numpy as np

from portable_loader.step_plans import Cursor, StepPlans

__all__ = ["AHEAD_BLOCKS", "Ahead", "wanted"]

AHEAD_BLOCKS = 2  # blocks in flight beyond the one being planned: every worker has its next part queued


def wanted(source, spec) -> bool:
    """Whether the workers of a loader of ``spec`` should tokenize ``source`` ahead, in blocks.

    Always for a source that tokenizes on read. Packing (and padding with ``overlong="drop"``)
    reads lengths before it plans; padding otherwise does not, but a step pads only a few records
    (8 of ~100 tokens: less than a millisecond of tokenizing), and tokenizing them step by step paid
    the tokenizer's and the reader's fixed costs per step: tokenized by blocks ahead, a step's
    records are read from the memo and the hand-over files.
    """
    return bool(source.tokenizes_ahead)


class Ahead:
    """Sends blocks of records to the workers to tokenize, and makes the dataset learn their lengths.

    ``send(worker, task)`` puts a task on a worker's inbox; ``receive(worker, key)`` returns that
    worker's reply ``(kind, value)`` for ``key`` (raising if the worker died). ``plans`` are the
    engine's: the blocks follow their stream.
    """

    def __init__(self, plans: StepPlans, source, *, workers: int, send, receive):
        self.plans, self.source, self.workers = plans, source, workers
        self.window = plans.spec.packing_window
        self._send, self._receive = send, receive
        self._tag = uuid.uuid4().hex[:8]  # file names of this loader's blocks, apart from earlier ones
        self._next: int | None = None  # the first block not yet sent
        self._pending: dict[int, list[tuple[int, np.ndarray, str]]] = {}  # block -> its parts in flight
        self._answered: deque = deque()  # (block, file names) whose lengths were taken

    def block_of(self, cursor: Cursor) -> int:
        """The block holding the next position ``cursor`` plans from."""
        if self.plans.spec.packing:
            return cursor.window
        return self.plans.spec.resolve(cursor).samples // self.window

    def dispatch(self, last: int) -> None:
        """Send every block up to ``last`` not sent yet (from the first one asked for)."""
        if self._next is None:
            self._next = last
        total, w = self.plans.total, self.window
        while self._next <= last and (total is None or self._next * w < total):
            b = self._next
            lo = b * w
            hi = lo + w if total is None else min(lo + w, total)
            todo = self.source.unknown(self.plans.records(lo, hi))
            parts = []
            for j, part in enumerate(np.array_split(todo, self.workers)):
                if part.size:
                    name = f"{self._tag}-{b}-{j}"
                    self._send(j, (("ahead", b, j), (part, name)))
                    parts.append((j, part, name))
            if parts:  # none from the second epoch on: every length is known
                self._pending[b] = parts
            self._next += 1

    def ready(self) -> None:
        """Take the answers of every block the next plan reads lengths from, sending those not sent yet."""
        for lo, hi in self.plans.lengths_ahead():
            for b in range(lo // self.window, (hi - 1) // self.window + 1):
                if self._next is None or b >= self._next:
                    self.dispatch(b)
                if b in self._pending:
                    self._take(b)  # a failed part: the dataset meets its error again when the planner asks

    def _take(self, b: int) -> None:
        """Take block ``b``'s answers: the dataset learns the lengths of the parts that succeeded."""
        parts, names = self._pending.pop(b), []
        for j, part, name in parts:
            kind, value = self._receive(j, ("ahead", b, j))
            if kind == "ok":
                self.source.learn(part, value)
                names.append(name)
        self._answered.append((b, names))

    def served(self, cursor: Cursor) -> None:
        """Every step before ``cursor`` was returned: remove the files of the blocks they read."""
        first = self.block_of(cursor)
        while self._answered and self._answered[0][0] < first:
            for name in self._answered.popleft()[1]:
                self.source.drop_handover(name)

    def close(self) -> None:
        """Forget the blocks in flight and remove every file of this loader."""
        self._pending.clear()
        self._answered.clear()
        self.source.drop_handover()
