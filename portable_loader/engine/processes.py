"""Worker processes that fetch and collate planned rows.

The caller's thread takes every step's finished plan (``StepPlans``); workers receive row plans
that are already fixed, so they cannot change the order. Step ``s`` goes to worker ``s % W`` and is
answered on that worker's own channel, so results are consumed in step order. A worker collates the
batch straight into a shared-memory block the parent chose for it (``engine/blocks.py``) and answers
one line; the caller gets numpy arrays over that memory: no batch byte is pickled or copied in the
trainer's process. How workers start (fork only where it is safe) and how a dead one is noticed:
``engine/workers.py``. Over a source whose lengths cost a
tokenization the workers also tokenize ahead the records the planner will size (``engine/ahead.py``);
their answers share the queues, and a reply that comes before the one awaited is kept until asked for.
A worker's exception reaches the caller with the worker's traceback; a worker that dies is reported
instead of waited for, on every path (batches and lengths alike); ``close()`` ends every process
(SIGKILL if need be), and a worker whose parent died without closing it ends by itself.

Example:
    >>> import numpy as np
    >>> import portable_loader as pl
    >>> from portable_loader.precache import sample_args
    >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache"))
    >>> loader = pl.DataLoader(src, global_batch_size=8, seq_len=128, num_workers=2)
    >>> with iter(loader) as it:            # two worker processes, ended when the block exits
    ...     batch = next(it)
    >>> with iter(pl.DataLoader(src, global_batch_size=8, seq_len=128)) as inline:
    ...     all(np.array_equal(batch[k], v) for k, v in next(inline).items())   # what workers change: speed
    True
"""

from __future__ import annotations

import os
import traceback

import numpy as np

from portable_loader.engine.ahead import AHEAD_BLOCKS, Ahead, wanted
from portable_loader.engine.blocks import Layout, Pool, WorkerBlocks
from portable_loader.engine.pack_ahead import PackAhead
from portable_loader.engine.inline import build_batch
from portable_loader.engine.threads import WorkerError
from portable_loader.engine.workers import context, end, launch, load, pickled, receive, worker_setup, worker_tasks
from portable_loader.collate import collating_into
from portable_loader.lifecycle import hook_last
from portable_loader.plan import packed_rows
from portable_loader.step_plans import StepPlans

__all__ = ["ProcessEngine"]

_SPARE_BLOCKS = 2  # blocks a worker keeps beyond its tasks in flight: the batch the caller holds, and one more


def _worker_main(chan, parent: int, forked_from_main: bool, index: int, work) -> None:
    worker_setup(forked_from_main)
    spec, source = load(work)
    source = source.reopen()  # file handles and reader threads do not survive a fork: open our own
    blocks = WorkerBlocks()
    for task, fds in worker_tasks(chan, parent):
        kind, key = task[0], task[1]
        try:
            if kind == "ahead":  # tokenize records, answer their lengths
                value = source.tokenize_ahead(*task[2])
            elif kind == "pack":  # pack a window of the plan, answer its rows
                value = packed_rows(*task[2])
            else:
                rows, block, size, rows_n, retired = task[2:]
                blocks.forget(retired)
                blocks.learn(block, fds[0] if fds else None, size)
                layout = Layout.of(rows_n, spec.seq_len, spec.fields)
                with collating_into(blocks.allocator(block, layout)):
                    batch = build_batch(source, rows, spec.seq_len, spec.pad_id, spec.fields)
                if not blocks.placed(block, layout, batch):
                    raise ValueError(f"a batch of {sorted(batch)} does not have the layout of {spec.fields} x "
                                     f"[{rows_n}, {spec.seq_len}]")
                real = batch["attention_mask"] if "attention_mask" in batch else batch["segment_ids"]
                # the loader's stats, counted here; raw bytes unpickle in ~1 µs, an array in ~10
                per_row = np.array(list(map(np.count_nonzero, real)), dtype=np.int32)  # (axis=1 is 2x slower)
                value = (per_row.tobytes(), int(per_row.sum()))
                del batch, real
            reply = (key, "ok", value)
        except BaseException as e:  # noqa: BLE001
            text = "".join(traceback.format_exception(e))
            reply = (key, "error", f"{type(e).__name__} in loader worker {index} (pid {os.getpid()}):\n{text}")
        try:
            chan.send(reply)
        except OSError:  # the parent is gone
            return


class ProcessEngine:
    """``spec.num_workers`` processes fetch and collate; the caller's thread takes the plans and
    reads the batches in order. Each worker receives the spec and the dataset, nothing else.

    ``start_method`` says how the workers started (``engine/workers.py``: fork where it is safe).
    """

    def __init__(self, spec, source, plans: StepPlans):
        ctx, self.start_method = context([source])
        work = (spec, source) if self.start_method == "fork" else pickled(f"the dataset {source!r:.200}", (spec, source))
        self._plans, self._spec = plans, spec
        self._sent: list = []  # (cursor after the step, its block, its layout), per step handed out, not yet consumed
        self._early: dict = {}  # (worker, key) -> (kind, value): replies that came before the one awaited
        self._ahead = self._pack = None
        self._ended = False
        self.row_tokens = None  # real tokens per row of the batch last returned, counted by its worker
        self.tokens = 0  # their sum
        n = spec.num_workers
        hook_last()
        self._procs, self._chans = [], []
        self._pools = [Pool(max(1, spec.prefetch) + _SPARE_BLOCKS) for _ in range(n)]
        try:
            for i in range(n):
                proc, chan = launch(ctx, self.start_method, _worker_main, (i, work), f"portable_loader-worker-{i}")
                self._procs.append(proc)
                self._chans.append(chan)
            self._depth = n * max(1, spec.prefetch)
            if wanted(source, spec):
                self._ahead = Ahead(plans, source, workers=n, send=lambda j, task: self._send(j, ("ahead", *task)),
                                    receive=self._receive)
            elif plans.planner.packing:  # best fit: the workers pack the windows too
                self._pack = PackAhead(plans.planner, workers=n, send=lambda j, task: self._send(j, ("pack", *task)),
                                       receive=self._receive)
            self._fill()
        except BaseException:  # the caller never gets this engine to close (a bad row met by the planner)
            self.close()
            raise

    def _send(self, worker: int, task, fds=()) -> None:
        try:
            self._chans[worker].send(task, fds)
        except OSError:  # its end is closed: it died
            self._dead(worker)

    def _dead(self, worker: int):
        """Raise worker ``worker``'s end (its channel refused a task): its replies left are of no use now."""
        try:
            while True:
                receive(self._chans[worker], self._procs[worker], f"loader worker {worker}")
        finally:
            self.close()

    def _fill(self) -> None:
        ahead, plans, spec = self._ahead, self._plans, self._spec
        while not self._ended and len(self._sent) < self._depth:
            if ahead is not None:  # the lengths this step plans from, computed by the workers
                ahead.ready()
            planned = plans.next()
            if planned is None:
                self._ended = True
                return
            rows, cursor = planned
            step = cursor.step - 1
            w = step % len(self._procs)
            pool, layout = self._pools[w], Layout.of(len(rows), spec.seq_len, spec.fields)
            block, new = pool.take(layout.size)
            retired, pool.retired = pool.retired, []
            self._sent.append((cursor, block, layout))
            self._send(w, ("batch", step, rows, block.id, block.size, layout.rows, retired), (block.fd,) if new else ())
            if ahead is not None:  # queued after the step, so that the step's batch is not held up
                ahead.dispatch(ahead.block_of(cursor) + AHEAD_BLOCKS)
            elif self._pack is not None:
                self._pack.dispatch_for(cursor, plans.planner.sizes.size(cursor.step, cursor.samples))

    def _receive(self, worker: int, key):
        """Worker ``worker``'s reply ``(kind, value)`` for ``key``; replies it sent before are kept."""
        if self._early and (worker, key) in self._early:
            return self._early.pop((worker, key))
        if not self._procs:
            raise WorkerError("the loader's workers were closed")
        while True:
            try:
                got, kind, value = receive(self._chans[worker], self._procs[worker], f"loader worker {worker}")
            except WorkerError:
                self.close()
                raise
            if got == key:
                return kind, value
            self._early[(worker, got)] = (kind, value)

    def next(self):
        if not self._sent:
            raise StopIteration
        cursor, block, layout = self._sent.pop(0)
        step = cursor.step - 1
        w = step % len(self._procs)
        kind, value = self._receive(w, step)
        self._pools[w].done(block)
        if kind == "error":
            self.close()
            raise WorkerError(value)
        batch = self._pools[w].arrays(block, layout)
        self.row_tokens, self.tokens = np.frombuffer(value[0], dtype=np.int32), value[1]
        if self._ahead is not None:
            self._ahead.served(cursor)
        self._fill()
        return batch, cursor

    def close(self) -> None:
        procs, self._procs = self._procs, []
        end(procs, self._chans)
        for pool in self._pools:
            pool.close()
        self._chans, self._sent, self._early = [], [], {}
        self._ended = True
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            ahead.close()
        if self._pack is not None:
            pack, self._pack = self._pack, None
            pack.close()
