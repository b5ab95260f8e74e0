"""Thread read-ahead (grain.experimental.ThreadPrefetchIterDataset, ThreadPrefetchDatasetIterator,
multithread_prefetch, device_put) against real Grain 0.2.18 and against the same pipeline without
the thread: the same elements, the state of the elements taken (not of those read ahead), reading
done in the thread, errors at their element, and no thread left after close."""

import gc
import threading
import time

import grain
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_loader import grain as pg

PREFIX = "portable-loader-prefetch"


def _threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith(PREFIX)]


def _plain(x):
    return x.tolist() if isinstance(x, np.ndarray) else x


def _base(g, n, mod):
    return g.MapDataset.range(n).to_iter_dataset().map(lambda x: x * 7).filter(lambda x: x % mod != 0)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(0, 25), mod=st.integers(2, 4), size=st.integers(0, 6), batch=st.integers(1, 3))
def test_elements_are_grains_and_the_state_is_that_of_the_elements_taken(n, mod, size, batch):
    want = [_plain(b) for b in grain.experimental.ThreadPrefetchIterDataset(_base(grain, n, mod), prefetch_buffer_size=size)
            .batch(batch)]
    plain_it = iter(_base(pg, n, mod).batch(batch))
    with iter(pg.experimental.ThreadPrefetchIterDataset(_base(pg, n, mod), prefetch_buffer_size=size).batch(batch)) as it:
        states, got = [it.get_state()], []
        assert states[0]["cursor"] == plain_it.get_state()["cursor"]
        for b in it:
            got.append(_plain(b))
            next(plain_it)
            states.append(it.get_state())
            if len(got[-1]) == batch:  # a short batch met the end, which the thread reached past its element
                assert states[-1]["cursor"] == plain_it.get_state()["cursor"]
    assert got == want
    for k, state in enumerate(states):
        with iter(pg.experimental.ThreadPrefetchIterDataset(_base(pg, n, mod), prefetch_buffer_size=size)
                  .batch(batch)) as again:
            again.set_state(state)
            assert [_plain(b) for b in again] == want[k:]
    assert not _threads()


def test_the_thread_reads_ahead_and_an_error_arrives_at_its_element():
    seen = []

    def record(x):
        seen.append(threading.current_thread().name)
        if x == 6:
            raise KeyError("element 6")
        return x

    ds = pg.experimental.ThreadPrefetchIterDataset(pg.MapDataset.range(10).to_iter_dataset().map(record),
                                                   prefetch_buffer_size=4)
    with iter(ds) as it:
        assert next(it) == 0
        deadline = time.monotonic() + 5
        while len(seen) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(seen) >= 5 and set(seen) == {PREFIX}      # 1 taken + 4 read ahead (at least), in the thread
        assert it.get_state()["cursor"] == {"0.source.position": "%020d" % 1}
        assert [next(it) for _ in range(5)] == [1, 2, 3, 4, 5]
        with pytest.raises(Exception, match="element 6"):
            next(it)
    assert not _threads()


@pytest.mark.slow
def test_closing_the_outer_iterator_joins_every_thread_nested_or_collected():
    ds = pg.MapDataset.range(1000).to_iter_dataset()
    for _ in range(3):
        ds = pg.experimental.ThreadPrefetchIterDataset(ds.map(lambda x: x + 1), prefetch_buffer_size=2)
    it = iter(ds.batch(4))
    assert next(it).tolist() == [3, 4, 5, 6]
    assert len(_threads()) == 3
    it.close()
    assert not _threads()
    it = iter(ds)
    next(it)
    del it
    gc.collect()
    assert not _threads()


def test_thread_prefetch_dataset_iterator_over_a_grain_iterator_has_grains_elements_and_states():
    def walk(cls, g):
        it = cls(iter(g.MapDataset.range(12).to_iter_dataset().filter(lambda x: x % 3)), 3)
        out = [(None, it.get_state())] + [(x, it.get_state()) for x in it]
        it.set_state(out[2][1])
        out.append(list(it))
        it.close()
        return out

    want = walk(grain.experimental.ThreadPrefetchDatasetIterator, grain)
    assert walk(pg.experimental.ThreadPrefetchDatasetIterator, grain) == want       # real Grain's states, equal
    ours = walk(pg.experimental.ThreadPrefetchDatasetIterator, pg)                  # over ours: our positions
    assert [x for x, _ in ours[:-1]] == [x for x, _ in want[:-1]] and ours[-1] == want[-1]
    assert not _threads()


def test_multithread_prefetch_keeps_the_order_at_any_thread_count():
    def run(g, threads):
        return [_plain(b) for b in g.experimental.multithread_prefetch(_base(g, 40, 3), num_threads=threads,
                                                                        buffer_size=4)]

    want = run(grain, 1)
    assert run(pg, 0) == run(pg, 1) == run(pg, 3) == want == [_plain(x) for x in _base(pg, 40, 3)]
    assert sorted(run(grain, 3)) == sorted(want)                      # Grain's order changes with the count
    assert pg.experimental.multithread_prefetch(_base(pg, 4, 3), num_threads=0, buffer_size=1) is not None
    assert not _threads()


def test_thread_prefetch_over_workers_equals_grain_without_them():
    def pipeline(g, workers):
        ds = g.MapDataset.range(60).to_iter_dataset().map(lambda x: x * x)
        if workers:
            ds = ds.mp_prefetch(g.MultiprocessingOptions(num_workers=workers))
        return g.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=3).batch(7)

    with iter(pipeline(pg, 2)) as it:
        assert [b.tolist() for b in it] == [b.tolist() for b in pipeline(grain, 0)]
    assert not _threads()


def test_device_put_puts_grains_elements_on_the_device_and_leaves_no_thread():
    jax = pytest.importorskip("jax")

    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)

    def run(g, where):
        ds = g.MapDataset.range(20).map(lambda x: {"x": np.full(3, x)}).to_iter_dataset().batch(4)
        it = iter(g.experimental.device_put(ds, where, cpu_buffer_size=3, device_buffer_size=2))
        out = [next(it) for _ in range(3)]
        it.close()
        return out

    for where in (device, sharding):
        ours, real = run(pg, where), run(grain, where)
        assert all(isinstance(b["x"], jax.Array) and b["x"].devices() == {device} for b in ours)
        assert [b["x"].tolist() for b in ours] == [b["x"].tolist() for b in real]
        assert not _threads()
