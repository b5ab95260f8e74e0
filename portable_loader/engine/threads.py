"""The prefetch thread: one daemon thread runs a producer up to ``depth`` results ahead.

``Producer`` is also what the torch and JAX adapters use for their own background collation.

Example:
    >>> it = iter(range(3))
    >>> p = Producer(lambda: next(it), depth=2)
    >>> [p.next() for _ in range(3)]
    [0, 1, 2]
    >>> p.close()
"""

from __future__ import annotations

import queue
import threading

from portable_loader.engine.inline import InlineEngine
from portable_loader.lifecycle import hook_last
from portable_loader.plan import Cursor, Planner

__all__ = ["Producer", "WorkerError", "thread_engine"]

_POLL_S = 0.2
_JOIN_S = 5.0  # a producer thread finishing the batch in hand


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
        hook_last()
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
