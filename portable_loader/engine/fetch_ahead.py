"""Fetch-ahead for remote caches: a thread reserves the shards of the records the next steps read.

The record at every stream position is known in advance (the loader's order), so the shards the
next steps read are known too. For a loader over a :class:`~portable_loader.cache.lazy.RemoteCacheSource`,
:class:`FetchAhead` wraps the engine: a daemon thread looks up the records of the positions after
the consumer's, a chunk at a time (one vectorized call), and reserves (fetches, and keeps from
eviction) their shards in the order the stream first needs them, while the shards reserved and not
yet consumed fit in ``cache_limit`` less one shard (room for a read the thread has not reached). A
shard is released once the consumer has passed the last position that reads it (packing: the last
window), and then stays in the local cache until space is needed, least recently opened first.
When the whole cache fits the limit (or there is none), the thread ends once every shard is local.

A padded loader with a fixed batch size reserves only this host's rows' records; otherwise every
position's (a packed window's rows go to all hosts). Worker processes read the shards the thread
has reserved, and fetch a shard it has not reached yet themselves. A fetch that fails stops the
thread quietly: the read of that shard fails again, with the error naming the object, where the
consumer sees it.

Example:
    >>> import fsspec
    >>> import portable_loader as pl
    >>> from portable_loader.precache import sample_args
    >>> path = pl.precache(**sample_args(), out="cache")
    >>> url = "memory://fetch-ahead/" + path.rsplit("/", 1)[-1]   # an in-memory bucket stands in for s3://
    >>> fsspec.filesystem("memory").put(path, url, recursive=True)
    >>> src = pl.open_cache(url, cache_dir="shards", cache_limit="3MB")
    >>> loader = pl.DataLoader(src, global_batch_size=8, seq_len=512, shuffle="shards", shuffle_shards=2)
    >>> with iter(loader) as it:          # the thread starts with the iterator
    ...     batch = next(it)
    >>> src.remote["fetches"]             # both shards, fetched once
    2
    >>> src.close(); fsspec.filesystem("memory").rm("memory://fetch-ahead", recursive=True)
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from portable_loader.lifecycle import join_thread
from portable_loader.step_plans import Cursor, StepPlans

__all__ = ["FetchAhead", "remotes_of"]

_WAIT_S = 0.2
_JOIN_S = 10.0
_CHUNK = 1024  # positions looked up per call


def remotes_of(dataset) -> list[tuple[int, int, object]]:
    """Every remote cache a dataset reads, as ``(lo, hi, cache)``: the cache's records are the
    dataset's indices ``[lo, hi)`` (through maps and filters: all of them; in a mixture: its slice).

    Example:
        >>> from portable_loader.dataset import mix, source
        >>> remotes_of(source([{"input_ids": [1]}]))
        []
        >>> remotes_of(mix({"a": [{"input_ids": [1]}], "b": [{"input_ids": [2]}]}, {"a": 1, "b": 1}))
        []
    """
    node = dataset
    while node is not None:  # maps and filters keep their parent's indices
        inner = getattr(node, "cache", None)
        if inner is not None and callable(getattr(inner, "reserve", None)):
            return [(0, len(dataset), inner)]
        children, offsets = getattr(node, "children", None), getattr(node, "offsets", None)
        if children is not None and offsets is not None:  # a mixture: each child's slice
            return [(int(off) + lo, int(off) + hi, r)
                    for child, off in zip(children, offsets) for lo, hi, r in remotes_of(child)]
        node = getattr(node, "parent", None)
    return []


class FetchAhead:
    """An engine that reserves, in a background thread, the shards of the records after the consumer's.

    ``max_records``: how many stream positions ahead of the consumer it may look (the only bound
    when the cache has no ``cache_limit``). ``part``: the loader's indices ``[lo, hi)`` that are
    ``remote``'s records (a mixture's slice; default: all of them). A mixture of remote caches gets
    one ``FetchAhead`` per cache, each within that cache's own ``cache_limit``.

    Example:
        >>> import fsspec
        >>> import portable_loader as pl
        >>> from portable_loader.engine import InlineEngine
        >>> from portable_loader.precache import sample_args
        >>> from portable_loader.step_plans import StepPlans
        >>> path = pl.precache(**sample_args(), out="cache")
        >>> url = "memory://fetch-ahead/" + path.rsplit("/", 1)[-1]   # an in-memory bucket stands in for s3://
        >>> fsspec.filesystem("memory").put(path, url, recursive=True)
        >>> loader = pl.DataLoader(pl.open_cache(url, cache_dir="fetched"), global_batch_size=8, seq_len=512)
        >>> (lo, hi, remote), = remotes_of(loader.source)
        >>> lo, hi, remote is loader.source.cache
        (0, 2000, True)
        >>> plans = StepPlans(loader.spec, loader.planner(), Cursor(0, 0, 0))
        >>> engine = FetchAhead(InlineEngine(loader.spec, loader.source, plans), loader.spec, plans,
        ...                     remote, Cursor(0, 0, 0), part=(lo, hi))
        >>> batch, cursor = engine.next(); engine.close()
        >>> cursor.step, engine.error, remote.remote["fetches"]
        (1, None, 2)
        >>> remote.close(); fsspec.filesystem("memory").rm("memory://fetch-ahead", recursive=True)
    """

    def __init__(self, engine, spec, plans: StepPlans, remote, cursor: Cursor, max_records: int = 1 << 13,
                 part: tuple | None = None):
        self.engine, self.spec, self.remote, self.max_records = engine, spec, remote, max_records
        self.part = part
        # The plans' order (the mixture's online stages included) and length; never their planner,
        # which belongs to the engine's thread.
        self._order, self._total = plans.order, plans.total
        self.window = spec.packing_window if spec.packing else 1
        limit = remote.store.limit
        largest = max((s["bytes"] for s in remote.manifest["shards"]), default=0)
        self.budget = None if limit is None else max(largest, limit - largest)
        self._consumed = self._start = self._position(cursor)
        self._wake_at = self._consumed  # the consumer position the thread waits for
        self._cond = threading.Condition()
        self._stop = False
        self.error: BaseException | None = None  # why the thread stopped early, for inspection
        self._thread = threading.Thread(target=self._run, name="portable_loader-fetch-ahead", daemon=True)
        self._thread.start()

    def _position(self, cursor: Cursor) -> int:
        """The first stream position the consumer may still read at ``cursor``."""
        if self.spec.packing:
            return cursor.window * self.window  # a window's records are read until its last row is served
        return self.spec.resolve(cursor).samples

    @property
    def row_tokens(self):
        """The real tokens per row of the batch just returned, where the engine knows them (workers)."""
        return getattr(self.engine, "row_tokens", None)

    @property
    def tokens(self) -> int:
        """Their sum."""
        return self.engine.tokens

    def next(self):
        batch, cursor = self.engine.next()
        self._consumed = self._position(cursor)
        if self._consumed >= self._wake_at:  # only when the thread waits for it: a wake-up costs
            with self._cond:
                self._cond.notify_all()
        return batch, cursor

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        join_thread(self._thread, _JOIN_S)  # (from garbage collection: at exit)
        self.engine.close()

    def _mine(self, lo: int, hi: int) -> np.ndarray:
        """The positions in ``[lo, hi)`` whose records this host reads."""
        pos = np.arange(lo, hi, dtype=np.int64)
        spec = self.spec
        if spec.packing or spec.shard_count == 1 or not spec.schedule.fixed:
            return pos
        size = spec.schedule.stages[0][1]
        b = size // spec.shard_count
        row = (pos - self._start) % size  # steps of B from where this run started
        return pos[(row >= spec.shard_index * b) & (row < (spec.shard_index + 1) * b)]

    def _run(self) -> None:
        held: dict[int, list] = {}  # shard -> [token, last position reading it]
        total = self._total if self._total is not None else sys.maxsize
        shards_bytes = [s["bytes"] for s in self.remote.manifest["shards"]]
        # When every shard fits, nothing is ever evicted: once each one is local, the work is done.
        fits_all = self.remote.store.limit is None or self.remote.store.limit >= sum(shards_bytes)
        fetched: set[int] = set()
        lo = self._consumed
        try:
            while lo < total and not (fits_all and len(fetched) == len(shards_bytes)):
                hi = min(lo + _CHUNK, total)
                if not self._wait(held, lambda: hi - self._consumed <= self.max_records, lambda: hi - self.max_records // 2):
                    return
                pos = self._mine(lo, hi)
                idx = self._order.stream_indices(pos) if pos.size else pos
                if self.part is not None and pos.size:  # a mixture: only this cache's records
                    inside = (idx >= self.part[0]) & (idx < self.part[1])
                    pos, idx = pos[inside], idx[inside] - self.part[0]
                shards = self.remote.shard_of(idx) if pos.size else pos
                # Each shard's first and last position in this chunk (packing: the end of its window).
                order, first = np.unique(shards, return_index=True)
                last = pos.size - 1 - np.unique(shards[::-1], return_index=True)[1]
                ends = (pos[last] // self.window + 1) * self.window - 1
                for i in np.argsort(first, kind="stable").tolist():
                    s, end = int(order[i]), int(ends[i])
                    if s in held:
                        held[s][1] = max(held[s][1], end)
                    elif self._wait(held, lambda: self._fits(held, s), lambda: 1 + min(e for _, e in held.values())):
                        held[s] = [self.remote.reserve(s), end]
                        fetched.add(s)
                    else:
                        return
                lo = hi
            if not fits_all:
                self._wait(held, lambda: not held, lambda: 1 + min(e for _, e in held.values()))
        except BaseException as e:  # noqa: BLE001 - the consumer's own read reports it (see module doc)
            self.error = e
        finally:
            for token, _ in held.values():
                self.remote.release(token)

    def _release_consumed(self, held: dict) -> None:
        for s in [s for s, (_, end) in held.items() if end < self._consumed]:
            self.remote.release(held.pop(s)[0])

    def _fits(self, held: dict, s: int) -> bool:
        used = sum(self.remote.shard_bytes(h) for h in held)
        return self.budget is None or not held or used + self.remote.shard_bytes(s) <= self.budget

    def _wait(self, held: dict, ready, wake_at) -> bool:
        """Release consumed shards until ``ready()``, sleeping until the consumer reaches ``wake_at()``;
        False once the engine is closing."""
        with self._cond:
            while not self._stop:
                self._release_consumed(held)
                if ready():
                    return True
                self._wake_at = wake_at()
                self._cond.wait(_WAIT_S)
        return False
