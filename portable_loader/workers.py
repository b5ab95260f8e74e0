"""Prefetch engines: a background thread, or worker processes that fetch and collate planned rows.

The caller's thread (or the prefetch thread) plans every step; workers receive row plans that are
already fixed, so they cannot change the order. Step ``s`` goes to worker ``s % W`` and comes back on
that worker's own queue, so results are consumed in step order without any reordering buffer.
A worker's exception reaches the caller with the worker's traceback; a worker that dies is reported
instead of waited for; ``close()`` ends every thread and process.

Example:
    >>> loader = DataLoader(src, global_batch_size=8, seq_len=128, num_workers=2)  # doctest: +SKIP
    >>> with iter(loader) as it:                                                  # doctest: +SKIP
    ...     next(it)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import traceback

from portable_loader.cache import pid_alive
from portable_loader.loader import InlineEngine, build_batch
from portable_loader.plan import Cursor, Planner

__all__ = ["Producer", "thread_engine", "ProcessEngine", "WorkerError"]

_POLL_S = 0.2
_JOIN_S = 5.0


class WorkerError(RuntimeError):
    """A loader worker failed; the message holds the worker's own traceback."""


class Producer:
    """Runs ``produce()`` in a daemon thread, keeping up to ``depth`` results ready.

    ``next()`` returns them in order, raises ``StopIteration`` once ``produce`` does (and keeps
    raising it), and re-raises ``produce``'s exception with its traceback. ``close()`` stops and
    joins the thread and drops results not taken.

    Example:
        >>> it = iter(range(3))
        >>> p = Producer(lambda: next(it), depth=2)
        >>> [p.next() for _ in range(3)]
        [0, 1, 2]
        >>> p.close()
    """

    def __init__(self, produce, depth: int, name: str = "portable_loader-producer"):
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(produce,), name=name, daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, produce) -> None:
        try:
            while not self._stop.is_set():
                try:
                    item = produce()
                except StopIteration:
                    self._put(("end", None))
                    return
                if not self._put(("ok", item)):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer as is
            self._put(("error", e))

    def next(self):
        while True:
            try:
                kind, value = self._q.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise WorkerError("the background thread stopped without a result") from None
        if kind == "end":
            self._put(("end", None))  # stay ended
            raise StopIteration
        if kind == "error":
            raise value
        return value

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=_JOIN_S)
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                break


def thread_engine(loader, planner: Planner, cursor: Cursor) -> Producer:
    """One background thread runs the inline engine up to ``prefetch`` steps ahead."""
    return Producer(InlineEngine(loader, planner, cursor).next, loader.prefetch, "portable_loader-prefetch")


def _worker_main(index: int, loader, inbox, outbox) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it closes the workers
    source = loader.source
    reopen = getattr(source, "reopen", None)
    if reopen is not None:
        source = reopen()  # file handles and reader threads do not survive fork: open our own
    while True:
        task = inbox.get()
        if task is None:
            break
        step, rows = task
        try:
            outbox.put((step, "ok", build_batch(source, rows, loader.seq_len, loader.pad_id)))
        except BaseException as e:  # noqa: BLE001
            text = "".join(traceback.format_exception(e))
            outbox.put((step, "error", f"{type(e).__name__} in loader worker {index} (pid {os.getpid()}):\n{text}"))
    outbox.cancel_join_thread()


class ProcessEngine:
    """``num_workers`` processes fetch and collate; the caller's thread plans and reads in order."""

    def __init__(self, loader, planner: Planner, cursor: Cursor):
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self._loader, self._planner = loader, planner
        self._plan_cursor = cursor  # where the next step to hand out starts
        self._sent: list = []  # cursor after each step handed out and not yet consumed
        self._ended = False
        n = loader.num_workers
        self._inboxes = [ctx.Queue() for _ in range(n)]
        self._outboxes = [ctx.Queue() for _ in range(n)]
        self._procs = [
            ctx.Process(target=_worker_main, args=(i, loader, self._inboxes[i], self._outboxes[i]),
                        name=f"portable_loader-worker-{i}", daemon=True)
            for i in range(n)
        ]
        for p in self._procs:
            p.start()
        self._depth = n * max(1, loader.prefetch)
        self._fill()

    def _fill(self) -> None:
        while not self._ended and len(self._sent) < self._depth:
            planned = self._planner.step(self._plan_cursor)
            if planned is None:
                self._ended = True
                return
            rows, self._plan_cursor = planned
            step = self._plan_cursor.step - 1
            self._inboxes[step % len(self._procs)].put((step, self._loader.local_rows(rows)))
            self._sent.append(self._plan_cursor)

    def next(self):
        if not self._sent:
            raise StopIteration
        cursor = self._sent.pop(0)
        step = cursor.step - 1
        worker = step % len(self._procs)
        while True:
            try:
                got_step, kind, value = self._outboxes[worker].get(timeout=_POLL_S)
                break
            except queue.Empty:
                proc = self._procs[worker]
                # is_alive() stays True for a child someone else already reaped; its pid is gone then.
                if not proc.is_alive() or not pid_alive(proc.pid):
                    self.close()
                    raise WorkerError(
                        f"loader worker {worker} (pid {proc.pid}) exited unexpectedly with code {proc.exitcode}"
                    ) from None
        if kind == "error":
            self.close()
            raise WorkerError(value)
        if got_step != step:  # cannot happen while each worker serves its steps in order
            self.close()
            raise WorkerError(f"loader worker {worker} returned step {got_step}, expected {step}")
        self._fill()
        return value, cursor

    def close(self) -> None:
        procs, self._procs = self._procs, []
        for box in self._inboxes:
            try:
                box.put(None)
            except (ValueError, OSError):
                pass
        for p in procs:
            p.join(timeout=_JOIN_S)
            if p.is_alive():
                p.terminate()
                p.join(timeout=_JOIN_S)
            if p.is_alive():
                p.kill()
                p.join()
        for box in self._inboxes:
            box.close()
            box.cancel_join_thread()  # unsent plans of a stopped stream are not needed
        for box in self._outboxes:
            box.close()
            box.join_thread()
        self._inboxes, self._outboxes, self._sent = [], [], []
        self._ended = True
