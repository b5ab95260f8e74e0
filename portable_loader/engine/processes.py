"""Worker processes that fetch and collate planned rows.

The caller's thread takes every step's finished plan (``StepPlans``); workers receive row plans
that are already fixed, so they cannot change the order. Step ``s`` goes to worker ``s % W`` and comes back on
that worker's own queue, so results are consumed in step order. Over a source whose lengths cost a
tokenization the workers also tokenize ahead the records the planner will size (``engine/ahead.py``);
their answers share the queues, and a reply that comes before the one awaited is kept until asked for.
A worker's exception reaches the caller with the worker's traceback; a worker that dies is reported
instead of waited for; ``close()`` ends every thread and process (SIGKILL if need be), and a worker
whose parent died without closing it ends by itself (see ``_worker_main``).

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

import ctypes
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback

from portable_loader.engine.ahead import AHEAD_BLOCKS, Ahead, wanted
from portable_loader.engine.inline import build_batch
from portable_loader.engine.threads import WorkerError
from portable_loader.errors import CacheError
from portable_loader.lifecycle import hook_last, pid_alive
from portable_loader.step_plans import StepPlans

__all__ = ["ProcessEngine"]

_POLL_S = 0.2
_WORKER_JOIN_S = 2.0  # per stage of a worker's end: after the stop message, then after SIGTERM
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# Signals a scheduler or a parent sends to end a process. A forked worker inherits the parent's
# handlers for them, Python's and C's alike: jax.distributed installs a C++ SIGTERM handler (its
# preemption notice) that swallows the signal, so multiprocessing's exit-time terminate() would
# not end the worker and its join (no timeout) would hang the parent forever.
_RESET_SIGNALS = [getattr(signal, n) for n in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
                  if hasattr(signal, n)]


def _die_with_forking_thread() -> bool:
    """Linux: have the kernel SIGKILL this process when the thread that forked it ends."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def worker_setup(forked_from_main: bool) -> None:
    """A forked worker's signals: Ctrl-C is the parent's, the rest default, and die with the parent.

    A parent killed by SIGKILL, or one that exits through os._exit, runs no hook and never sends
    the stop message: the worker must notice by itself, or it blocks on its inbox forever (an
    orphan of PID 1 holding the parent's pipes open). PDEATHSIG is immediate, but it fires when
    the *thread* that forked us ends, not the process: it is only safe when that thread is the
    main thread (a prefetch thread that forks the workers may end long before the loader does).
    Otherwise, and off Linux, :func:`worker_tasks` checks every ``_POLL_S`` that the parent lives.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it closes the workers
    for sig in _RESET_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    if forked_from_main:
        _die_with_forking_thread()


def worker_tasks(inbox, parent: int):
    """The tasks on a worker's inbox, until the stop message (None) or until ``parent`` is gone."""
    while True:
        try:
            task = inbox.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:  # re-parented: ours is gone
                return
            continue
        if task is None:
            return
        yield task


def _worker_main(index: int, spec, source, inbox, outbox, parent: int, forked_from_main: bool) -> None:
    worker_setup(forked_from_main)
    try:
        if os.getppid() != parent:  # it died before we got here
            return
        source = source.reopen()  # file handles and reader threads do not survive fork: open our own
        for key, payload in worker_tasks(inbox, parent):
            try:
                if isinstance(key, tuple):  # ("ahead", block, part): tokenize records, answer their lengths
                    value = source.tokenize_ahead(*payload)
                else:
                    value = build_batch(source, payload, spec.seq_len, spec.pad_id, spec.fields)
                outbox.put((key, "ok", value))
            except BaseException as e:  # noqa: BLE001
                text = "".join(traceback.format_exception(e))
                outbox.put((key, "error", f"{type(e).__name__} in loader worker {index} (pid {os.getpid()}):\n{text}"))
    finally:
        outbox.cancel_join_thread()  # nobody may read what is still buffered: do not wait on it


def _join_all(procs, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))


def end_workers(procs: list, inboxes: list, outboxes: list) -> None:
    """Ask each worker to stop (None on its inbox), end the processes, and close their queues."""
    for box in inboxes:
        try:
            box.put(None)
        except (ValueError, OSError):  # a queue already closed
            pass
    _end_processes(procs)
    for box in inboxes:
        box.close()
        box.cancel_join_thread()  # unsent tasks of a stopped stream are not needed
    for box in outboxes:
        box.close()
        box.join_thread()


def _end_processes(procs) -> None:
    """Join ``procs`` (already sent their stop message); SIGTERM those still running, then SIGKILL.

    SIGTERM can still fail (a worker stuck in C code, or one whose handler a library replaced
    between fork and our reset), so SIGKILL ends it: a close never waits forever.
    """
    _join_all(procs, _WORKER_JOIN_S)
    for stop in ("terminate", "kill"):
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            getattr(p, stop)()
        _join_all(alive, _WORKER_JOIN_S)


class ProcessEngine:
    """``spec.num_workers`` processes fetch and collate; the caller's thread takes the plans and
    reads the batches in order. Each worker receives the spec and the dataset, nothing else."""

    def __init__(self, spec, source, plans: StepPlans):
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        hazard = source.fork_hazard
        if hazard and ctx.get_start_method() == "fork":
            raise CacheError(hazard)
        self._plans = plans
        self._sent: list = []  # cursor after each step handed out and not yet consumed
        self._early: dict = {}  # (worker, key) -> (kind, value): replies that came before the one awaited
        self._ahead = None
        self._ended = False
        n = spec.num_workers
        hook_last()
        from_main = threading.current_thread() is threading.main_thread()
        self._inboxes = [ctx.Queue() for _ in range(n)]
        self._outboxes = [ctx.Queue() for _ in range(n)]
        self._procs = [
            ctx.Process(target=_worker_main,
                        args=(i, spec, source, self._inboxes[i], self._outboxes[i], os.getpid(), from_main),
                        name=f"portable_loader-worker-{i}", daemon=True)
            for i in range(n)
        ]
        for p in self._procs:
            p.start()
        self._depth = n * max(1, spec.prefetch)
        if wanted(source, spec):
            self._ahead = Ahead(plans, source, workers=n, send=lambda j, task: self._inboxes[j].put(task),
                                receive=self._receive)
        try:
            self._fill()
        except BaseException:  # the caller never gets this engine to close (a bad row met by the planner)
            self.close()
            raise

    def _fill(self) -> None:
        ahead, plans = self._ahead, self._plans
        while not self._ended and len(self._sent) < self._depth:
            if ahead is not None:  # the lengths this step plans from, computed by the workers
                ahead.ready()
            planned = plans.next()
            if planned is None:
                self._ended = True
                return
            rows, cursor = planned
            step = cursor.step - 1
            self._inboxes[step % len(self._procs)].put((step, rows))
            self._sent.append(cursor)
            if ahead is not None:  # queued after the step, so that the step's batch is not held up
                ahead.dispatch(ahead.block_of(cursor) + AHEAD_BLOCKS)

    def _receive(self, worker: int, key):
        """Worker ``worker``'s reply ``(kind, value)`` for ``key``; replies it sent before are kept."""
        if (worker, key) in self._early:
            return self._early.pop((worker, key))
        while True:
            try:
                got, kind, value = self._outboxes[worker].get(timeout=_POLL_S)
            except queue.Empty:
                proc = self._procs[worker]
                # is_alive() stays True for a child someone else already reaped; its pid is gone then.
                if not proc.is_alive() or not pid_alive(proc.pid):
                    self.close()
                    raise WorkerError(
                        f"loader worker {worker} (pid {proc.pid}) exited unexpectedly with code {proc.exitcode}"
                    ) from None
                continue
            if got == key:
                return kind, value
            self._early[(worker, got)] = (kind, value)

    def next(self):
        if not self._sent:
            raise StopIteration
        cursor = self._sent.pop(0)
        step = cursor.step - 1
        kind, value = self._receive(step % len(self._procs), step)
        if kind == "error":
            self.close()
            raise WorkerError(value)
        if self._ahead is not None:
            self._ahead.served(cursor)
        self._fill()
        return value, cursor

    def close(self) -> None:
        procs, self._procs = self._procs, []
        end_workers(procs, self._inboxes, self._outboxes)
        self._inboxes, self._outboxes, self._sent, self._early = [], [], [], {}
        self._ended = True
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            ahead.close()
