"""The running parts of an ``IterDataset`` iterator, one per node of the pipeline.

Every part offers ``next()``, ``fields()`` (its share of the state: named integers) and
``restore(fields)``. The state is taken *between* elements, where nothing is half done: a source
reports the position after the last element it handed on (plus the ordinal counts of its
operations), a batch holds nothing between batches, a main-process operation its ordinal count, a
mixture its index. So the state is a stream position of fixed size, and restoring it recomputes what
follows instead of replaying what came before.

Example:
    >>> from portable_loader.dataset import source
    >>> from portable_loader.dataset.iter.ops import ElementOp, Segment
    >>> seg = Segment(allow_nones=False)
    >>> seg.add("1.filter.count", ElementOp("filter", lambda x: x % 2 == 1))
    >>> src = SourceIter("0.source.position", source(list(range(10))), seg, InlineExec(chunk=3))
    >>> src.seal()
    >>> it = BatchIter(src, 2, drop_remainder=False, batch_fn=list)
    >>> it.next(), it.fields()
    ([1, 3], {'0.source.position': 4})
    >>> it.restore({'0.source.position': 8}, ValueError); it.next()
    [9]
"""

from __future__ import annotations

import bisect
import collections
import logging
import math
import time
from concurrent import futures
from typing import Callable, Sequence

from portable_loader.dataset.batch import stack
from portable_loader.dataset.iter.ops import ElementOp, Segment, apply_one, read_chunk, run_chunk, run_slowly
from portable_loader.errors import FilterError
from portable_loader.lifecycle import in_finalizer

__all__ = ["BatchIter", "FilterRatioCheck", "InlineExec", "MixIter", "OpIter", "SourceIter", "filter_name",
           "int_proportions", "mix_choice", "next_index", "set_next_index"]

# Elements filtered out in a row before an iterator gives up: an endless stream whose filter
# rejects everything would otherwise never yield (Grain's does not), as pl.DataLoader's planner.
MAX_REJECTED = 1_000_000


def _rejected_all(where: str, run: int) -> FilterError:
    return FilterError(f"{where} rejected {run:,} elements in a row: it rejects everything, or so nearly "
                       "everything that the stream cannot go on")

INLINE_CHUNK = 64  # positions per batched read in this process
# Grain's filter check: over each window of this many elements a filter sees, warn (at most once a
# minute) or raise when it dropped at least the ratios of DatasetOptions (iter_options.py): a filter
# that drops nearly everything is usually a bug that would otherwise only show as a slow stream.
FILTER_WINDOW, FILTER_WARN_EVERY_S = 1000, 60.0
_log = logging.getLogger(__name__)


class FilterRatioCheck:
    """Grain's filter threshold check for one filtering step, over exact windows of ``FILTER_WINDOW`` inputs.

    ``warn`` / ``raise_``: the ``DatasetOptions`` ratios (None or 0: off, as in Grain). ``check(kept)``
    counts one input and raises at the last input of a window over the raise ratio;
    ``check_range(a, b, kept)`` counts the source positions ``[a, b)``, of which the sorted ``kept``
    survived, and returns the position where the raise ratio was crossed (the error is ``error``),
    so that the elements before it are still served, as in Grain, whatever the chunking.

    Example:
        >>> c = FilterRatioCheck("f", warn=None, raise_=0.5)
        >>> c.check_range(0, 1500, list(range(0, 1500, 4)))    # 75 % of the first 1000 dropped
        999
        >>> str(c.error)[:64]
        'Transformation f skipped 75.00 % of the last seen 1000 elements.'
    """

    def __init__(self, name: str, warn: float | None, raise_: float | None):
        self.name = name
        self.warn, self.raise_ = warn or math.inf, raise_ or math.inf
        self.seen = self.kept = 0
        self.warned_at = -math.inf
        self.error: FilterError | None = None

    def check(self, kept: bool) -> None:
        self.seen += 1
        self.kept += bool(kept)
        if self.seen == FILTER_WINDOW and self._judge():
            raise self.error

    def check_range(self, a: int, b: int, kept: list) -> int | None:
        while a < b:
            take = min(b - a, FILTER_WINDOW - self.seen)
            self.kept += bisect.bisect_left(kept, a + take) - bisect.bisect_left(kept, a)
            self.seen += take
            a += take
            if self.seen == FILTER_WINDOW and self._judge():
                return a - 1
        return None

    def _judge(self) -> bool:
        """Ends a window: logs the warning, or keeps the error and returns True."""
        ratio, seen = 1 - self.kept / self.seen, self.seen
        self.seen = self.kept = 0
        if ratio >= self.raise_:
            self.error = FilterError(
                f"Transformation {self.name} skipped {ratio * 100:.2f} % of the last seen {seen} elements. Please "
                "check the filtering logic. If this is intended, consider pre-filtering the input dataset before "
                "training. To disable this check, set `grain.experimental.DatasetOptions.filter_raise_threshold_ratio` "
                "used in `WithOptionsIterDataset` to `None`.")
            return True
        if ratio >= self.warn and time.monotonic() - self.warned_at >= FILTER_WARN_EVERY_S:
            self.warned_at = time.monotonic()
            _log.warning(
                "Transformation %s skipped %.2f %% of the last seen %d elements. Please check the filtering logic. "
                "If this is intended, consider pre-filtering the input dataset before training. To disable this "
                "check, set `grain.experimental.DatasetOptions.filter_warn_threshold_ratio` used in "
                "`WithOptionsIterDataset` to `None`.", self.name, ratio * 100, seen)
        return False


def filter_name(transform) -> str:
    """How a filter is named in the check's messages: Grain's ``FilterDatasetIterator(transform=...)``.

    Example:
        >>> filter_name(len)
        'FilterDatasetIterator(transform=len)'
    """
    fn = getattr(transform, "__name__", None) or type(transform).__name__
    return f"FilterDatasetIterator(transform={fn})"


class Chunk:
    """What an executor hands a source: surviving elements of ``[a, end)`` and the counts at ``end``.

    ``error``: an exception to raise after the elements (which are those before the failing one).

    Example:
        >>> Chunk([0, 2], ["a", "c"], [[], []], 3, []).end
        3
    """

    __slots__ = ("pos", "elems", "ords", "end", "running", "error")

    def __init__(self, pos, elems, ords, end, running, error=None):
        self.pos, self.elems, self.ords, self.end, self.running, self.error = pos, elems, ords, end, running, error


class InlineExec:
    """Runs a source's segment in this process, a chunk at a time.

    With ``threads > 0`` and ``buffer > 0`` (``grain.ReadOptions``), a thread pool reads the next
    chunks (``ds.__getitems__``: the ``MapDataset`` part) while this thread runs the operations; the
    reads are pure, so what they return does not depend on the threads. The pool is created on first
    use and shut down by ``close``.

    Example:
        >>> from portable_loader.dataset import source
        >>> seg = Segment(allow_nones=False); seg.seal()
        >>> ex = InlineExec(chunk=2, threads=2, buffer=4)
        >>> ex.bind(source([1, None, 3]), seg); ex.restart(0, [])
        >>> ex.next_chunk().elems, ex.next_chunk().elems, ex.next_chunk()
        ([1], [3], None)
        >>> ex.close()
    """

    def __init__(self, chunk: int = INLINE_CHUNK, threads: int = 0, buffer: int = 0):
        self.chunk = max(1, int(chunk))
        self.depth = -(-int(buffer) // self.chunk) if threads > 0 and buffer > 0 else 0
        self.threads = min(int(threads), self.depth)
        self._pool: futures.ThreadPoolExecutor | None = None
        self._ahead: collections.deque = collections.deque()
        # The chunks after a (re)start grow 1, 2, 4, ... up to ``chunk``: an iterator read for a few
        # elements computes about as many (Grain computes one at a time), a long read reaches the
        # batched size after a few chunks; with read-ahead, the first element waits on one read and
        # the threads share the next ones, and a close right after the start leaves little in flight.
        self._ramp = 1

    def bind(self, ds, seg: Segment) -> None:
        self.ds, self.seg, self.n = ds, seg, len(ds)

    def restart(self, pos: int, running: list) -> None:
        self._cancel()
        self.next_pos, self.running = pos, list(running)
        self._ramp = 1

    def _cancel(self) -> None:
        while self._ahead:
            self._ahead.popleft()[2].cancel()

    def _next_end(self, a: int) -> int:
        b = min(a + min(self.chunk, self._ramp), self.n)
        self._ramp = min(self.chunk, 2 * self._ramp)
        return b

    def _read_ahead(self, a: int):
        """The chunk at ``a``: its end and its read (a future from the pool, after queueing the next ones)."""
        if not self.depth:
            return self._next_end(a), None
        if self._pool is None:
            self._pool = futures.ThreadPoolExecutor(self.threads, thread_name_prefix="portable_loader-read")
        if self._ahead and self._ahead[0][0] != a:
            self._cancel()
            self._ramp = 1
        nxt = self._ahead[-1][1] if self._ahead else a
        while len(self._ahead) < self.depth and nxt < self.n:
            b = self._next_end(nxt)
            self._ahead.append((nxt, b, self._pool.submit(read_chunk, self.ds, self.seg.allow_nones, nxt, b)))
            nxt = b
        _, b, pending = self._ahead.popleft()
        return b, pending

    def next_chunk(self) -> Chunk | None:
        a = self.next_pos
        if a >= self.n:
            return None
        b, pending = self._read_ahead(a)
        try:
            read = pending.result() if pending is not None else None
            pos, elems, ords, running = run_chunk(self.ds, self.seg, a, b, self.running, read)
        except Exception:  # noqa: BLE001 - run it again element by element to raise at the right one
            self._cancel()
            pos, elems, ords, running, error = run_slowly(self.ds, self.seg, a, b, self.running)
            if error is not None:
                return Chunk(pos, elems, ords, b, running, error)
        self.next_pos, self.running = b, running
        return Chunk(pos, elems, ords, b, running)

    def close(self) -> None:
        self._cancel()
        if self._pool is not None:
            # A collection must not wait on threads (lifecycle.in_finalizer): the pool's end on their own.
            self._pool.shutdown(wait=not in_finalizer(), cancel_futures=True)
            self._pool = None


class SourceIter:
    """``to_iter_dataset`` plus the per-element operations that follow it (its :class:`Segment`).

    ``executor`` computes chunks: :class:`InlineExec` here, or a worker pool's stream
    (:mod:`portable_loader.dataset.iter.mp_prefetch`). The state is the position after the last element
    handed on and the ordinal counts there; elements computed ahead of it are simply recomputed
    after a restore. ``ratios``: the filter check's warn and raise ratios (``DatasetOptions``), for
    the segment's filters and, where the source has holes that are skipped, for those
    (``holes_name`` names them in the messages).

    Example:
        >>> from portable_loader.dataset import source
        >>> src = SourceIter("0.source.position", source(list(range(5))), Segment(allow_nones=False), InlineExec())
        >>> src.add("1.map_with_index.count", ElementOp("map_with_index", lambda i, x: (i, x)))
        >>> src.seal()
        >>> src.next(), src.next(), src.fields()
        ((0, 0), (1, 1), {'0.source.position': 2, '1.map_with_index.count': 2})
    """

    def __init__(self, field: str, ds, seg: Segment, executor, ratios: tuple = (0.9, None),
                 holes_name: str = "to_iter_dataset"):
        self.field, self.ds, self.seg, self.executor = field, ds, seg, executor
        self.ratios, self.holes_name = ratios, holes_name
        self.n = len(ds)
        self._buf: collections.deque = collections.deque()
        self._error: BaseException | None = None
        self._started = False
        self.pos, self.running = 0, []
        self._dropped = 0  # positions filtered out in a row
        self._filters: FilterRatioCheck | None = None
        self._counted = 0  # positions up to which the filter check has counted

    @property
    def open(self) -> bool:
        """Whether element operations can still join the segment."""
        return not self.seg.sealed

    def add(self, field: str, op: ElementOp) -> None:
        self.seg.add(field, op)

    def seal(self) -> None:
        if not self.seg.sealed:
            self.seg.seal()
            # One check for the segment: its filters run fused, per chunk, so the share is of source positions.
            names = [filter_name(op.transform) for _, op in self.seg.ops if op.drops]
            if not names and not self.seg.allow_nones and self.ds.filters:
                names = [self.holes_name]
            self._filters = FilterRatioCheck(", ".join(names), *self.ratios) if names else None
            self.running = [0] * self.seg.num_counts
            self.executor.bind(self.ds, self.seg)

    def _start(self) -> None:
        self._started = True
        self._counted = self.pos
        self.executor.restart(self.pos, self.running)

    def next(self):
        if not self._started:
            self._start()
        while not self._buf:
            if self._error is not None:
                error, self._error = self._error, None
                self.executor.restart(self.pos, self.running)  # the next call tries the failed element again
                raise error
            chunk = self.executor.next_chunk()
            if chunk is None:
                self.pos = max(self.pos, self.n)
                self.running = list(self.executor.running)
                raise StopIteration
            elements, error = list(zip(chunk.pos, chunk.elems, chunk.ords)), chunk.error
            if self._filters is not None and error is None:
                start, self._counted = max(self.pos, self._counted), max(self._counted, chunk.end)
                stop = self._filters.check_range(start, chunk.end, chunk.pos)
                if stop is not None:  # Grain raises at the window's last element, after those before it
                    elements, error = [e for e in elements if e[0] < stop], self._filters.error
            self._buf.extend(elements)
            self._error = error
            if not elements and error is None:  # all dropped: nothing to recompute before `end`
                self._dropped += chunk.end - self.pos
                self.pos, self.running = chunk.end, list(chunk.running)
                if self._dropped >= MAX_REJECTED:
                    raise _rejected_all("the filter after to_iter_dataset", self._dropped)
        self._dropped = 0
        p, element, ords = self._buf.popleft()
        self.pos, self.running = p + 1, [o + 1 for o in ords]
        return element

    def fields(self) -> dict:
        out = {self.field: self.pos}
        for field, r in self.seg.field_rank.items():
            out[field] = self.running[r]
        return out

    def field_names(self) -> list[str]:
        return [self.field, *self.seg.field_rank]

    def restore(self, fields: dict, refuse: Callable[[str, str], Exception]) -> None:
        pos = fields[self.field]
        if pos > self.n:
            raise refuse(self.field, f"position {pos} is past the end of the dataset ({self.n} records)")
        running: list = [None] * self.seg.num_counts
        for field, r in self.seg.field_rank.items():
            value = fields[field]
            if value > pos:
                raise refuse(field, f"count {value} exceeds the source position {pos}")
            if running[r] is not None and running[r] != value:
                raise refuse(field, f"count {value} differs from {running[r]}, which the same elements reach")
            running[r] = value
        self._buf.clear()
        self._error = None
        self.pos, self.running = pos, running
        self._started = True
        self._counted = pos
        self.executor.restart(pos, running)

    def next_index(self) -> int:
        """Grain's ``get_next_index``: the source position of the next element, where it is one.

        A filter, or holes that are skipped, make the element's index a count that only reading
        finds: a ``ValueError`` (as Grain's filter iterators), the state is the position to use.
        """
        if any(op.drops for _, op in self.seg.ops) or (not self.seg.allow_nones and self.ds.filters):
            raise ValueError("get_next_index/set_next_index: a filter makes the index of the next element unknown "
                             "without reading; use get_state()/set_state(), which hold a position")
        return self.pos

    def set_next_index(self, index: int) -> None:
        self.next_index()  # the same refusal
        if not 0 <= index <= self.n:
            raise IndexError(f"set_next_index: {index} is not in [0, {self.n}], the dataset's positions")
        self.restore({self.field: index, **{field: index for field in self.seg.field_rank}}, ValueError)

    def close(self) -> None:
        self.executor.close()


class OpIter:
    """A per-element operation run in this process (after a batch, a mixture or ``mp_prefetch``).

    Example:
        >>> from portable_loader.dataset import source
        >>> src = SourceIter("0.source.position", source([1, 2, 3]), Segment(allow_nones=False), InlineExec())
        >>> src.seal()
        >>> it = OpIter("1.map_with_index.count", src, ElementOp("map_with_index", lambda i, x: i * 10 + x))
        >>> it.next(), it.next(), it.fields()
        (1, 12, {'0.source.position': 2, '1.map_with_index.count': 2})
    """

    def __init__(self, field: str, child, op: ElementOp, ratios: tuple = (0.9, None)):
        self.field, self.child, self.op = field, child, op
        self.count = 0
        self.check = FilterRatioCheck(filter_name(op.transform), *ratios) if op.drops else None

    def next(self):
        for _ in range(MAX_REJECTED):
            element = self.child.next()
            ordinal = self.count
            self.count += 1
            keep, element = apply_one(self.op, element, ordinal if self.op.ordinal else None)
            if self.check is not None:
                self.check.check(keep)
            if keep:
                return element
        raise _rejected_all(f"{self.op.kind} {self.field}", MAX_REJECTED)

    def next_index(self) -> int:
        if self.op.drops:
            raise ValueError("get_next_index/set_next_index: a filter makes the index of the next element unknown "
                             "without reading; use get_state()/set_state(), which hold a position")
        return next_index(self.child)

    def set_next_index(self, index: int) -> None:
        self.next_index()  # the same refusal
        set_next_index(self.child, index)
        if self.op.ordinal:
            self.count = index

    def fields(self) -> dict:
        out = self.child.fields()
        if self.op.ordinal:
            out[self.field] = self.count
        return out

    def field_names(self) -> list[str]:
        return self.child.field_names() + ([self.field] if self.op.ordinal else [])

    def restore(self, fields: dict, refuse) -> None:
        self.child.restore(fields, refuse)
        self.count = fields[self.field] if self.op.ordinal else 0

    def close(self) -> None:
        self.child.close()


class OverChild:
    """A running part that holds no state of its own: its state, restore and close are its child's.

    Example:
        >>> from portable_loader.dataset import source
        >>> src = SourceIter("0.source.position", source([1, 2]), Segment(allow_nones=False), InlineExec())
        >>> src.seal()
        >>> part = BatchIter(src, 2, drop_remainder=False, batch_fn=None)   # a batch holds nothing between batches
        >>> isinstance(part, OverChild), part.field_names() == src.field_names()
        (True, True)
    """

    child: object

    def fields(self) -> dict:
        return self.child.fields()

    def field_names(self) -> list[str]:
        return self.child.field_names()

    def restore(self, fields: dict, refuse) -> None:
        self.child.restore(fields, refuse)

    def close(self) -> None:
        self.child.close()


class BatchIter(OverChild):
    """Grain's ``IterDataset.batch``: ``batch_size`` elements per batch, stacked by
    :func:`portable_loader.dataset.batch.stack` (Grain's ``make_batch``) unless ``batch_fn`` is given;
    nothing is held between batches, so the state is the source's position.

    Example:
        >>> from portable_loader.dataset import source
        >>> src = SourceIter("0.source.position", source([1, 2, 3]), Segment(allow_nones=False), InlineExec())
        >>> src.seal()
        >>> it = BatchIter(src, 2, drop_remainder=True, batch_fn=None)
        >>> it.next().tolist(), it.fields()
        ([1, 2], {'0.source.position': 2})
    """

    def __init__(self, child, batch_size: int, drop_remainder: bool, batch_fn):
        self.child, self.batch_size, self.drop_remainder = child, batch_size, drop_remainder
        self.batch_fn = batch_fn

    def next(self):
        values = []
        for _ in range(self.batch_size):
            try:
                values.append(self.child.next())
            except StopIteration:
                if self.drop_remainder:
                    raise
                break
        if not values:
            raise StopIteration
        return stack(values, self.batch_fn)

    def next_index(self) -> int:
        return -(-next_index(self.child) // self.batch_size)  # a partly read batch counts, as in Grain

    def set_next_index(self, index: int) -> None:
        set_next_index(self.child, index * self.batch_size)


def next_index(part) -> int:
    """Grain's ``get_next_index`` of a running part: the index of the element it yields next.

    Parts whose index is arithmetic (a source without filters, maps, batches) define it; the rest
    (filters, mixtures, packing, ...) refuse with a ``ValueError``, as Grain documents for them.

    Example:
        >>> from portable_loader.dataset import source
        >>> src = SourceIter("0.source.position", source(list(range(5))), Segment(allow_nones=False), InlineExec())
        >>> src.seal()
        >>> it = BatchIter(src, 2, drop_remainder=False, batch_fn=None)
        >>> set_next_index(it, 2); next_index(it), it.next().tolist()
        (2, [4])
    """
    method = getattr(part, "next_index", None)
    if method is None:
        raise ValueError(f"get_next_index/set_next_index: not defined through a {type(part).__name__} step (its "
                         "next element has no index without reading); use get_state()/set_state()")
    return method()


def set_next_index(part, index: int) -> None:
    """Grain's ``set_next_index`` of a running part: continue at the element of that index (see :func:`next_index`)."""
    next_index(part)  # the same refusal where it has no index
    part.set_next_index(index)



def int_proportions(weights: Sequence[float], scale_min_to: int = 100) -> list[int]:
    """Grain's integer proportions for ``IterDataset.mix``: scaled so the smallest is 100, truncated.

    Example:
        >>> int_proportions([0.7, 0.3])
        [233, 100]
    """
    scale = scale_min_to / min(weights)
    return [int(p * scale) for p in weights]


def mix_choice(k: int, proportions: Sequence[int]) -> int:
    """Which dataset gives element ``k`` of Grain's ``IterDataset.mix`` (its exact integer rule).

    Example:
        >>> [mix_choice(k, (1, 1)) for k in range(6)]
        [0, 1, 0, 1, 0, 1]
    """
    remaining = sum(proportions)
    cur, cur1 = k, k + 1
    for i, p in enumerate(proportions):
        nxt = (cur * (remaining - p)) // remaining
        nxt1 = (cur1 * (remaining - p)) // remaining
        if cur - nxt != cur1 - nxt1:
            return i
        remaining -= p
        cur, cur1 = nxt, nxt1
    raise AssertionError("mix_choice: no dataset chosen")  # unreachable for positive proportions


class MixIter:
    """Grain's ``IterDataset.mix``: a fixed interleaving by integer proportions; ends when any input ends.

    Example:
        >>> from portable_loader.dataset import source
        >>> parts = [SourceIter(f"{i}.source.position", source(d), Segment(allow_nones=False), InlineExec())
        ...          for i, d in enumerate([[1, 2, 3], [10, 20]])]
        >>> for p in parts: p.seal()
        >>> it = MixIter("2.mix", parts, [100, 100])
        >>> [it.next() for _ in range(4)], it.fields()["2.mix.index"]
        ([1, 10, 2, 20], 4)
    """

    def __init__(self, field: str, children: list, proportions: Sequence[int]):
        self.field, self.children, self.proportions = field, children, tuple(proportions)
        self.index, self.stop = 0, False

    def next(self):
        if self.stop:
            raise StopIteration
        i = mix_choice(self.index, self.proportions)
        self.index += 1
        try:
            return self.children[i].next()
        except Exception:
            self.stop = True  # as Grain: once any input ends (or fails), the mixture has ended
            raise

    def fields(self) -> dict:
        out = {f"{self.field}.index": self.index, f"{self.field}.stop": int(self.stop)}
        for c in self.children:
            out.update(c.fields())
        return out

    def field_names(self) -> list[str]:
        names = [f"{self.field}.index", f"{self.field}.stop"]
        for c in self.children:
            names += c.field_names()
        return names

    def restore(self, fields: dict, refuse) -> None:
        stop = fields[f"{self.field}.stop"]
        if stop not in (0, 1):
            raise refuse(f"{self.field}.stop", f"must be 0 or 1, got {stop}")
        for c in self.children:
            c.restore(fields, refuse)
        self.index, self.stop = fields[f"{self.field}.index"], bool(stop)

    def close(self) -> None:
        for c in self.children:
            c.close()

