"""Worker processes for ``IterDataset.mp_prefetch``: the element stream is the same for any worker count.

Grain's ``mp_prefetch`` gives each worker a slice of the source and runs the whole pipeline there,
so its stream (and what a checkpoint means) changes with the number of workers. Here workers only
run the per-element operations that follow ``to_iter_dataset`` (a :class:`Segment`), whose result is
a pure function of each element and its ordinal. The main process cuts the source into chunks of
positions, hands chunk ``c`` of stream ``s`` to worker ``(c + s) % N``, puts the results back in
position order, and runs everything stateful (batch, mix, operations after them) itself. Its state
is its own stream position, so a state saved with ``N`` workers restores exactly with ``M``.

Ordinals after a filter depend on how many elements earlier chunks kept, so a chunk goes through
its stages one message at a time: a worker runs stage ``k`` and answers how many elements survived,
keeping them; once every earlier chunk has entered stage ``k + 1`` the main process knows the
chunk's first ordinal there and sends it on. A chunk that fails is run again by its worker one
position at a time, so the elements before the failing one are still served and the error comes up
where it would without workers.

Workers start as the loader's do (``engine/workers.py``: forked only where that is safe), talk over
their own channel (a dead worker is noticed at once), reopen the datasets' files, end with the
iterator (``close``, ``with``, garbage collection, interpreter exit) and by themselves if the parent dies.

Example:
    >>> import grain
    >>> from portable_loader.dataset import source
    >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
    >>> ds = to_iter_dataset(source(list(range(100)))).filter(lambda x: x % 3).map_with_index(lambda i, x: (i, x))
    >>> with iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2))) as it:
    ...     got = [next(it) for _ in range(50)]
    >>> got == list(ds)[:50]                 # what the same pipeline gives without workers
    True
"""

from __future__ import annotations

import collections
import os
import pickle
import traceback

from portable_loader.dataset.iter.ops import Segment, read_chunk, run_slowly
from portable_loader.dataset.iter.runtime import Chunk
from portable_loader.engine.threads import WorkerError
from portable_loader.engine.workers import context, end, launch, load, pickled, receive, worker_setup, worker_tasks
from portable_loader.lifecycle import hook_last

__all__ = ["WorkerPool", "PoolExec"]

POOL_CHUNK = 64  # positions per task: a message costs about as much as a light map over 64 elements


def _dumps(value) -> bytes:
    # Pickled here, not by the queue's feeder thread, which would print the error and drop the message.
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _error_info(e: BaseException) -> tuple:
    text = "".join(traceback.format_exception(e))
    try:
        blob = _dumps(e)
        pickle.loads(blob)  # an exception whose __init__ takes other arguments would fail in the parent
    except Exception:  # noqa: BLE001
        blob = None
    return blob, type(e).__name__, text


def _worker_main(chan, parent, from_main, index, count, work) -> None:
    worker_setup(from_main)
    try:
        try:
            streams, init_fn = load(work)
            datasets = [ds.reopen() if hasattr(ds, "reopen") else ds for ds, _ in streams]
            if init_fn is not None:
                init_fn(index, count)
        except BaseException as e:  # noqa: BLE001
            chan.send((None, "fatal", f"mp_prefetch worker {index} (pid {os.getpid()}) failed to start:\n"
                       + "".join(traceback.format_exception(e))))
            return
        pending: dict = {}  # (stream, chunk) -> (positions, elements, ordinals, stage input counts)
        for task, _ in worker_tasks(chan, parent):
            kind, key = task[0], task[1]
            if kind == "drop":
                pending.pop(key, None)
                continue
            s = key[0]
            ds, seg = datasets[s], streams[s][1]
            try:
                if kind == "retry":
                    a, b, start = task[2:]
                    pos, elems, ords, running, error = run_slowly(ds, seg, a, b, start)
                    try:
                        blob = _dumps((pos, elems, ords, running, None if error is None else _error_info(error)))
                    except Exception as e:  # noqa: BLE001 - elements that cannot travel: the error is that
                        blob = _dumps(([], [], [], start, _error_info(e)))
                    reply = ("slow", blob)
                else:
                    if kind == "run":
                        a, b, stage, base = task[2:]
                        pos, elems = read_chunk(ds, seg.allow_nones, a, b)
                        ords, counts = [[] for _ in elems], []
                    else:  # "cont": the next stage of a chunk we keep
                        stage, base = task[2:]
                        pos, elems, ords, counts = pending.pop(key[:2])
                    if seg.ordinal[stage]:
                        counts.append(len(elems))
                    pos, elems, ords = seg.run_stage(stage, pos, elems, ords, base)
                    if stage + 1 < len(seg.stages):
                        pending[key[:2]] = (pos, elems, ords, counts)
                        reply = ("count", len(elems))
                    else:
                        reply = ("done", _dumps((pos, elems, ords, counts)))
            except Exception:  # noqa: BLE001 - the parent has the chunk run again, one position at a time
                pending.pop(key[:2], None)
                reply = ("error", None)
            chan.send((key, *reply))
    except OSError:  # the parent is gone
        return


class WorkerPool:
    """``num_workers`` processes serving the segments of ``streams`` (``(dataset, Segment)`` pairs).

    Started on first use; ``close()`` stops every process (SIGTERM, then SIGKILL if need be).

    Example:
        >>> from portable_loader.dataset import source
        >>> pool = WorkerPool(2)
        >>> ex = PoolExec(pool)
        >>> seg = Segment(allow_nones=False); seg.seal()
        >>> ex.bind(source(list(range(100))), seg); ex.restart(0, [])
        >>> ex.next_chunk().elems[:3], pool.worker_of(0, 1)
        ([0, 1, 2], 1)
        >>> pool.close()
    """

    def __init__(self, num_workers: int, buffer: int = 1, init_fn=None):
        self.num_workers, self.buffer, self.init_fn = int(num_workers), max(1, int(buffer)), init_fn
        self.streams: list = []
        self._procs: list = []
        self._chans: list = []
        self._early: dict = {}
        self._stale: set = set()  # (stream, chunk) whose one outstanding reply is to be dropped
        self.started = self.closed = False

    def add_stream(self, ds, seg: Segment) -> int:
        assert not self.started
        self.streams.append((ds, seg))
        return len(self.streams) - 1

    def start(self) -> None:
        if self.started:
            return
        if self.closed:
            raise ValueError("the iterator is closed")
        ctx, method = context([ds for ds, _ in self.streams])
        work = (self.streams, self.init_fn)
        if method != "fork":
            work = pickled(f"the mp_prefetch pipeline {[ds for ds, _ in self.streams]!r:.200}", work)
        self.started = True
        hook_last()
        n = self.num_workers
        try:
            for i in range(n):
                proc, chan = launch(ctx, method, _worker_main, (i, n, work), f"portable_loader-mp_prefetch-{i}")
                self._procs.append(proc)
                self._chans.append(chan)
        except BaseException:
            self.close()
            raise

    def worker_of(self, stream: int, chunk: int) -> int:
        return (chunk + stream) % self.num_workers

    def send(self, worker: int, task) -> None:
        try:
            self._chans[worker].send(task)
        except OSError:  # its end is closed: it died, and its replies left are of no use now
            while True:
                self._receive(worker)  # raises the worker's exit

    def _store(self, got) -> None:
        key, kind, value = got
        if kind == "fatal":
            self.close()
            raise WorkerError(value)
        if key[:2] in self._stale:
            self._stale.discard(key[:2])
        else:
            self._early[key] = (kind, value)

    def drain(self, worker: int) -> None:
        """Take in every reply ``worker`` has sent so far; never waits."""
        chan = self._chans[worker]
        while chan.poll(0):
            self._store(self._receive(worker))

    def _receive(self, worker: int):
        try:
            return receive(self._chans[worker], self._procs[worker], f"mp_prefetch worker {worker}")
        except WorkerError:
            self.close()
            raise

    def take(self, key):
        """The reply for ``key`` if it has been taken in, else None."""
        return self._early.pop(key, None)

    def wait(self, worker: int, key):
        """The reply for ``key``: waits for it, and reports a worker that died instead of waiting forever."""
        if not self._procs:
            raise WorkerError("the mp_prefetch workers were closed")
        while key not in self._early:
            self._store(self._receive(worker))
        return self._early.pop(key)

    def forget(self, stream: int, chunk: int, key, outstanding: bool) -> None:
        """Drop a chunk in flight: its reply is discarded, and its worker frees what it keeps of it."""
        if outstanding:
            self._stale.add((stream, chunk))
        else:
            self._early.pop(key, None)
        if self._procs:
            self.send(self.worker_of(stream, chunk), ("drop", (stream, chunk)))

    def close(self) -> None:
        self.closed = True
        procs, chans, self._procs, self._chans = self._procs, self._chans, [], []
        end(procs, chans)
        self._early, self._stale = {}, set()


class _InFlight:
    __slots__ = ("cid", "a", "b", "stage", "count", "result", "failed", "outstanding")

    def __init__(self, cid: int, a: int, b: int):
        self.cid, self.a, self.b = cid, a, b
        self.stage, self.count, self.result, self.failed, self.outstanding = 0, None, None, False, True


class PoolExec:
    """A source's executor backed by a :class:`WorkerPool`: chunks go out round-robin and come back in order.

    Example:
        >>> from portable_loader.dataset import source
        >>> from portable_loader.dataset.iter.ops import ElementOp
        >>> seg = Segment(allow_nones=False)
        >>> seg.add("1.filter.count", ElementOp("filter", lambda x: x % 2 == 0))
        >>> seg.add("2.map_with_index.count", ElementOp("map_with_index", lambda i, x: (i, x)))
        >>> seg.seal()
        >>> ex = PoolExec(WorkerPool(3), chunk=4)
        >>> ex.bind(source(list(range(20))), seg); ex.restart(0, [0])
        >>> [ex.next_chunk().elems for _ in range(3)]      # ordinals continue across chunks and workers
        [[(0, 0), (1, 2)], [(2, 4), (3, 6)], [(4, 8), (5, 10)]]
        >>> ex.close()
    """

    def __init__(self, pool: WorkerPool, chunk: int | None = None):
        self.pool, self.chunk = pool, max(1, int(POOL_CHUNK if chunk is None else chunk))
        self._inflight: collections.deque = collections.deque()
        self._next_cid = 0  # chunk ids never repeat, so a reply for a forgotten chunk is recognized

    def bind(self, ds, seg: Segment) -> None:
        self.ds, self.seg, self.n = ds, seg, len(ds)
        self.stream = self.pool.add_stream(ds, seg)
        self.depth = self.pool.num_workers * (self.pool.buffer + 1)

    def restart(self, pos: int, running: list) -> None:
        for ch in self._inflight:
            self.pool.forget(self.stream, ch.cid, (self.stream, ch.cid, ch.stage), ch.outstanding)
        self._inflight.clear()
        self.next_pos = pos
        self._entered = list(running)  # ordinal counts handed to the chunks that entered each stage
        self.running = list(running)  # the counts at the start of the first chunk in flight

    def _key(self, ch: _InFlight):
        return (self.stream, ch.cid, ch.stage)

    def _dispatch(self) -> None:
        while len(self._inflight) < self.depth and self.next_pos < self.n:
            a = self.next_pos
            b = min(a + self.chunk, self.n)
            ch = _InFlight(self._next_cid, a, b)
            self._next_cid += 1
            base = 0
            if self.seg.ordinal[0]:  # no hole is skipped: the stage sees every position
                base = self._entered[0]
                self._entered[0] += b - a
            self.pool.send(self.pool.worker_of(self.stream, ch.cid), ("run", self._key(ch), a, b, 0, base))
            self._inflight.append(ch)
            self.next_pos = b

    def _absorb(self, ch: _InFlight, reply) -> None:
        ch.outstanding = False
        kind, value = reply
        if kind == "count":
            ch.count = value
        elif kind == "done":
            ch.result = pickle.loads(value)
        else:
            ch.failed = True

    def _pump(self) -> None:
        """Take in replies and send each chunk on to its next stage as soon as its first ordinal is known."""
        for w in {self.pool.worker_of(self.stream, ch.cid) for ch in self._inflight if ch.outstanding}:
            self.pool.drain(w)  # one look per worker: a look at an empty pipe costs a system call
        last = len(self.seg.stages)
        bound = last  # a chunk may enter stage k once the chunk before it has
        for ch in self._inflight:
            if ch.outstanding:
                reply = self.pool.take(self._key(ch))
                if reply is not None:
                    self._absorb(ch, reply)
            if ch.count is not None and not ch.failed and ch.stage + 1 <= bound:
                ch.stage += 1
                r = self.seg.rank[ch.stage]
                base = self._entered[r]
                self._entered[r] += ch.count
                ch.count, ch.outstanding = None, True
                self.pool.send(self.pool.worker_of(self.stream, ch.cid), ("cont", self._key(ch), ch.stage, base))
            bound = last if ch.result is not None else ch.stage

    def next_chunk(self) -> Chunk | None:
        self.pool.start()
        while True:
            self._dispatch()
            self._pump()
            if not self._inflight:
                return None
            head = self._inflight[0]
            worker = self.pool.worker_of(self.stream, head.cid)
            if head.result is not None:
                self._inflight.popleft()
                pos, elems, ords, counts = head.result
                start = self.running
                self.running = [x + c for x, c in zip(start, counts)]
                return Chunk(pos, elems, ords, head.b, self.running)
            if head.failed:
                return self._retry(head, worker)
            self._absorb(head, self.pool.wait(worker, self._key(head)))

    def _retry(self, head: _InFlight, worker: int) -> Chunk:
        key = (self.stream, head.cid, "retry")
        self.pool.send(worker, ("retry", key, head.a, head.b, self.running))
        pos, elems, ords, running, error = pickle.loads(self.pool.wait(worker, key)[1])
        if error is not None:  # the source raises it after `elems`, then restarts at the failing element
            return Chunk(pos, elems, ords, head.b, running, _rebuild(error))
        # It passed this time (a flaky read); later chunks may wait on counts it never reported: start over after it.
        self._inflight.popleft()
        self.restart(head.b, running)
        return Chunk(pos, elems, ords, head.b, running)

    def close(self) -> None:
        self._inflight.clear()
        self.pool.close()


def _rebuild(info) -> BaseException:
    """The worker's exception, with the worker's traceback as a note; a ``WorkerError`` if it cannot travel."""
    blob, name, text = info
    if blob is not None:
        try:
            e = pickle.loads(blob)
            e.add_note(f"raised in an mp_prefetch worker:\n{text}")
            return e
        except Exception:  # noqa: BLE001
            pass
    return WorkerError(f"{name} in an mp_prefetch worker:\n{text}")
