"""The prefetch thread: one daemon thread runs a producer up to ``depth`` results ahead.

The caller builds a result itself whenever none is ready and the thread is idle, so prefetching
never costs more than inline building (see ``Producer`` and docs/performance.md). ``Producer`` is
also what the torch and JAX adapters use for their own background collation; its docstring
has the example.
"""

from __future__ import annotations

import collections
import threading
from time import perf_counter

from portable_loader.engine.inline import InlineEngine
# Raised here, and imported from here by engine/__init__.py and the process engines.
from portable_loader.errors import WorkerError
from portable_loader.lifecycle import hook_last, join_thread
from portable_loader.step_plans import StepPlans

__all__ = ["Producer", "WorkerError", "thread_engine"]

_POLL_S = 0.2
# The caller woke the thread only after an absence this long (its training step): shorter gaps are a
# loop with nothing to hide under, where a wake-up (a futex call, then the GIL taken from the caller
# within the 5 ms switch interval) costs more than the overlap could win.
_AWAY_S = 50e-6
_JOIN_S = 5.0  # a producer thread finishing the batch in hand


class Producer:
    """Keeps up to ``depth`` results of ``produce()`` ready, built by a daemon thread or by the caller.

    ``next()`` returns them in order, raises ``StopIteration`` once ``produce`` does (and keeps
    raising it), and re-raises ``produce``'s exception with its traceback. ``close()`` stops and
    joins the thread and drops results not taken.

    Why the caller may build a result itself: a hand-off between threads costs a wake-up and a GIL
    transfer (tens to hundreds of µs on a loaded machine), which is pure loss when the caller has
    nothing else to do. So ``next()`` takes a ready result if there is one; if there is none and the
    thread is not building one, the caller calls ``produce()`` itself (no hand-off at all); only
    when the thread is midway through the very result the caller needs does the caller wait for it.
    A trainer whose step releases the GIL (a CUDA launch, an XLA call, numpy) finds results ready;
    a loop with no step runs at the inline speed. One lock serializes ``produce()``, so results come
    in ``produce`` order whichever thread built them.

    The thread builds only for a caller that was away for longer than ``_AWAY_S`` since its last
    ``next()`` (a step to hide under); a caller back sooner (a loop with no step) stops it after
    the result in hand, so it sleeps and costs nothing, where a wake-up per result cost 10-25% of a
    50 µs batch in GIL transfers (docs/performance.md).

    Example:
        >>> it = iter(range(3))
        >>> p = Producer(lambda: next(it), depth=2)
        >>> [p.next() for _ in range(3)]
        [0, 1, 2]
        >>> p.close()
    """

    def __init__(self, produce, depth: int, name: str = "portable_loader-producer"):
        hook_last()
        self._produce = produce
        self._depth = max(1, depth)
        self._ready: collections.deque = collections.deque()  # (kind, value); append/popleft are atomic
        self._building = threading.Lock()  # held while produce() runs, by either thread
        self._space = threading.Event()  # wakes the thread: a caller back from a step, or close()
        self._stop = threading.Event()
        self._left = perf_counter()  # when the caller last returned from next()
        self._wanted = True  # the thread may build: set by a caller with a step, cleared by one without
        self._ended: tuple | None = None  # ("end", None) or ("error", e) once produce stopped
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _build(self) -> tuple:
        """Run ``produce()`` once; the caller holds ``_building`` and no result is pending."""
        try:
            return ("ok", self._produce())
        except StopIteration:
            self._ended = ("end", None)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer as is
            self._ended = ("error", e)
        return self._ended

    def _run(self) -> None:
        while not self._stop.is_set() and self._ended is None:
            # Cleared before looking, so a wake-up between the look and the wait is not lost.
            self._space.clear()
            # Never queue up behind the caller: if it is building, it is not busy elsewhere, and
            # waiting on the lock would only hand the next result across threads.
            if self._wanted and len(self._ready) < self._depth and self._building.acquire(blocking=False):
                try:
                    if self._ended is None and not self._stop.is_set() and len(self._ready) < self._depth:
                        self._ready.append(self._build())
                finally:
                    self._building.release()
                continue
            self._space.wait()

    def next(self):
        away = perf_counter() - self._left > _AWAY_S
        if not away:
            self._wanted = False
        while True:
            if self._ready:
                kind, value = self._ready.popleft()
                break
            if self._ended is not None:
                kind, value = self._ended
                break
            if self._building.acquire(blocking=False):
                try:
                    if self._ready or self._ended is not None:
                        continue  # the thread finished one between our check and the lock
                    kind, value = self._build()
                finally:
                    self._building.release()
                break
            # The thread is building the result we need: wait for it, not for a poll interval.
            if not self._building.acquire(timeout=_POLL_S):
                if not self._thread.is_alive():
                    raise WorkerError("the background thread stopped without a result") from None
                continue
            self._building.release()
        if away:  # the caller has a step: build the next results during it
            self._wanted = True
            self._space.set()
        self._left = perf_counter()
        if kind == "end":
            raise StopIteration
        if kind == "error":
            raise value
        return value

    def close(self) -> None:
        self._stop.set()
        self._space.set()
        join_thread(self._thread, _JOIN_S)  # (from garbage collection: at exit)
        self._ready.clear()


def thread_engine(spec, source, plans: StepPlans) -> Producer:
    """One background thread runs the inline engine up to ``spec.prefetch`` steps ahead."""
    # Batches alive besides the caller's: those queued, the one being built, and the one the
    # thread waits to queue.
    engine = InlineEngine(spec, source, plans, keep=spec.prefetch + 2)
    return Producer(engine.next, spec.prefetch, "portable_loader-prefetch")
