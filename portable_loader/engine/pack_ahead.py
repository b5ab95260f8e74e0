"""Best-fit packing windows packed by the loader's worker processes, ahead of the steps that serve them.

Best-fit packing (``packing=True``) costs per record: a sort and a search per piece, most of what
a batch cost the trainer's process once workers collate (0.9 of its 1.1 ms a batch, 64 x 4096).
So with workers the engine's planner packs no window itself: window ``w`` goes to worker
``w % W`` a few windows before a step needs it, and the planner takes the answer
(``Planner.packer``). The main process still works out what a window is packed from (its records,
their lengths, the filters' verdicts: vectorized calls, the same as without workers), and the rows
are ``plan.packed_rows`` of that, a pure function: the batches cannot depend on the worker count.

A source whose lengths cost a tokenization (``engine/ahead.py``) is packed in the main process:
its lengths are known only once the workers' tokenization of the window is back, and that
packing is small beside the tokenizing (1/180 of the workers' CPU).

Example:
    >>> import numpy as np
    >>> from portable_loader.dataset import source
    >>> from portable_loader.batch_spec import BatchSpec, as_schedule
    >>> from portable_loader.plan import Cursor, packed_rows
    >>> ds = source([{"input_ids": np.arange(n % 7 + 1)} for n in range(100)])
    >>> spec = BatchSpec(as_schedule(4), seq_len=8, packing=True, packing_window=16, num_epochs=1)
    >>> planner = spec.planner(ds, spec.order(ds))
    >>> inboxes = {0: {}, 1: {}}             # two workers; here "the workers" answer in-process
    >>> def receive(j, key):
    ...     return "ok", packed_rows(*inboxes[j].pop(key))
    >>> ahead = PackAhead(planner, workers=2, send=lambda j, task: inboxes[j].update([task]), receive=receive)
    >>> rows, cursor = planner.step(Cursor(0, 0, 0))   # window 0 packed by "worker" 0
    >>> ahead.dispatch_for(cursor, rows=4)           # the windows of the next steps, sent ahead
    >>> sorted(inboxes[1]), sorted(inboxes[0])
    ([('pack', 1)], [('pack', 2)])
    >>> ahead.close()                               # the planner packs by itself again
    >>> planner.packer is None
    True
"""

from __future__ import annotations

import math

from portable_loader.engine.threads import WorkerError
from portable_loader.plan import Cursor, Planner

__all__ = ["PackAhead"]

_STEPS_AHEAD = 2  # steps' worth of windows sent beyond the one being planned
_MAX_AHEAD = 64  # windows in flight at most (a window of a few records makes a row or two)


class PackAhead:
    """Has ``planner``'s windows packed by the workers while it is attached (until ``close``).

    ``send(worker, (key, args))`` queues a task; ``receive(worker, key)`` returns that worker's reply
    ``(kind, value)`` (raising if the worker died).
    """

    def __init__(self, planner: Planner, *, workers: int, send, receive):
        self.planner, self.workers = planner, workers
        self._send, self._receive = send, receive
        self._next: int | None = None  # the first window not sent yet
        self._pending: dict[int, tuple[int, int, int]] = {}  # window -> (worker, over-long, rejected)
        self._rows = self._windows = 0  # rows the answers held, and how many answers: the rows a window makes
        planner.packer = self.packed

    def _dispatch(self, last: int) -> None:
        """Send every window up to ``last`` not sent yet (from the first one asked for)."""
        p = self.planner
        if self._next is None:
            self._next = last
        end = p.num_windows
        while self._next <= last and (end is None or self._next < end):
            w = self._next
            recs, lengths, over, rejected = p.window_input(w)
            j = w % self.workers
            self._send(j, (("pack", w), (recs, lengths, p.seq_len, p.overlong, p.row_key(w))))
            self._pending[w] = (j, over, rejected)
            self._next += 1

    def dispatch_for(self, cursor: Cursor, rows: int) -> None:
        """Send the windows the steps after ``cursor`` (of ``rows`` rows each) will likely read."""
        per_window = self._rows / self._windows if self._windows else 1.0
        ahead = min(_MAX_AHEAD, 1 + math.ceil(_STEPS_AHEAD * rows / max(per_window, 1.0)))
        self._dispatch(cursor.window + ahead)

    def packed(self, w: int):
        """Window ``w`` as ``Planner._pack_window`` gives it, packed by a worker."""
        if w not in self._pending:
            if self._next is not None and w < self._next:  # behind the windows sent (never met in order)
                return self.planner._pack_window(w)
            self._dispatch(w)
        for v in [v for v in self._pending if v < w]:  # windows passed over (a skipped range): not served
            self._take(v)
        rows = self._take(w)
        self._rows, self._windows = self._rows + len(rows[0]), self._windows + 1
        return rows

    def _take(self, w: int):
        j, over, rejected = self._pending.pop(w)
        kind, value = self._receive(j, ("pack", w))
        if kind != "ok":
            raise WorkerError(value)
        return value, over, rejected

    def close(self) -> None:
        """Detach from the planner (it packs its windows itself again) and forget the windows in flight."""
        if self.planner.packer == self.packed:
            self.planner.packer = None
        self._pending.clear()
