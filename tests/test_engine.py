"""The engine package: no import cycle with the loader, and the Producer's ordering under stealing."""

from __future__ import annotations

import ast
import pathlib
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_loader.engine import Producer, threads


def test_engine_never_imports_the_loader():
    # The loader imports the engine; an import back would be a cycle.
    import portable_loader.engine as engine

    for path in pathlib.Path(engine.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in names if m in ("portable_loader.loader", "portable_loader.workers")], path


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 40), depth=st.integers(1, 3), delays=st.lists(st.sampled_from([0.0, 0.0, 0.0005, 0.002]), min_size=1, max_size=8))
def test_results_come_in_produce_order_whoever_builds_them(n, depth, delays):
    # The consumer sleeps (GIL released, like a training step) at random, so both threads build.
    source = iter(range(n))
    builders = []

    def produce():
        builders.append(threading.current_thread().name)
        return next(source)

    p = Producer(produce, depth=depth)
    try:
        got = []
        for i in range(n):
            got.append(p.next())
            time.sleep(delays[i % len(delays)])
        assert got == list(range(n))
        for _ in range(2):  # the end stays the end
            with pytest.raises(StopIteration):
                p.next()
    finally:
        p.close()


def test_both_threads_build_and_hide_a_gil_releasing_step():
    # With a step to hide under, the thread builds ahead; with none, the caller builds itself.
    def produce():
        time.sleep(0.001)  # a build that releases the GIL, so its timing is not the machine's load
        return threading.current_thread().name

    p = Producer(produce, depth=2)
    try:
        tight = [p.next() for _ in range(40)]
        stepped = []
        for _ in range(40):
            stepped.append(p.next())
            time.sleep(0.004)  # the "training step", longer than a build
    finally:
        p.close()
    assert threading.current_thread().name in tight
    assert stepped[5:].count("portable_loader-producer") >= 30  # generous: the machine is shared


class _CountingEvent(threading.Event):
    """Counts how often a thread came back from waiting on it (each time it took the GIL)."""

    waits = 0

    def wait(self, timeout=None):
        try:
            return super().wait(timeout)
        finally:
            self.waits += 1


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_loop_with_no_step_leaves_the_thread_asleep(depth, monkeypatch):
    # Each wake-up of the thread costs the caller GIL transfers; a caller that comes straight back
    # must neither wake it nor let it build, and builds every result itself.
    monkeypatch.setattr(threads.threading, "Event", _CountingEvent)

    def produce():
        time.sleep(0.0002)
        return threading.current_thread().name

    p = Producer(produce, depth=depth)
    try:
        p.next()  # the first call comes after the set-up, so it counts as a step
        deadline = time.monotonic() + 10
        while len(p._ready) < depth and time.monotonic() < deadline:  # the thread fills up (slowly on a loaded machine)
            time.sleep(0.005)
        time.sleep(0.01)  # and sleeps
        before = p._space.waits
        tight = [p.next() for _ in range(400)]  # 80 ms or more
        woke = p._space.waits - before
        stepped = []
        for _ in range(20):
            stepped.append(p.next())
            time.sleep(0.002)
    finally:
        p.close()
    assert woke <= 3, woke  # the first call after the sleep wakes it; a 5 ms poll would be >= 16
    assert tight[depth + 1:] == [threading.current_thread().name] * (399 - depth)
    assert stepped[3:].count("portable_loader-producer") >= 12  # a step wakes it again


def test_an_error_reaches_the_caller_and_stays():
    calls = iter([1, 2])

    def produce():
        v = next(calls, None)
        if v is None:
            raise ValueError("boom")
        return v

    p = Producer(produce, depth=1)
    try:
        assert [p.next(), p.next()] == [1, 2]
        for _ in range(2):
            with pytest.raises(ValueError, match="boom"):
                p.next()
    finally:
        p.close()


def test_close_stops_the_thread_and_drops_results():
    p = Producer(lambda: np.zeros(4), depth=3)
    p.next()
    p.close()
    assert not p._thread.is_alive()
    assert not p._ready
