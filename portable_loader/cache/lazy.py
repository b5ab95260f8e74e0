"""A cache in object storage read shard by shard: fetched on first touch, evicted LRU, reserved ahead.

``open_cache(url, cache_dir=..., cache_limit=...)`` returns a :class:`RemoteCacheSource`. It reads
like a local cache (same records, same ``len``, same fingerprint, so the same batches and loader
states) but holds only the shards it has touched, in a :class:`~portable_loader.cache.shardstore.ShardStore`
bounded by ``cache_limit``: a cache larger than the limit can be read. Each process (the loader's,
each worker) keeps up to ``max_open`` shards open (default: as many as ``cache_limit`` holds), each pinned (in use: no process evicts it); when
a fetch lacks room, the process closes the open shards its current read does not need, and asks
the other processes to do the same (they do at their next read). ``reserve``/``release`` are what the loader's fetch-ahead
thread (:mod:`portable_loader.engine.fetch_ahead`) uses to fetch the next steps' shards and keep them.

Example:
    >>> import portable_loader as pl
    >>> from portable_loader.precache import sample_args
    >>> from portable_loader.cache.remote import upload_cache
    >>> path = pl.precache(**sample_args(), out="cache")
    >>> upload_cache(path, "memory://bucket/caches/chat")   # memory:// stands in for s3://, gs://, ...
    >>> src = pl.open_cache("memory://bucket/caches/chat", cache_dir="remote", cache_limit="3GB")
    >>> src[0]["input_ids"][:4]            # fetches the shard holding record 0
    array([  2, 203, 297, 295], dtype=int32)
    >>> src.remote["fetches"], src.remote["bytes_downloaded"] == src.shard_bytes(0)
    (1, True)
"""

from __future__ import annotations

import bisect
import os
import threading
import weakref
from collections import OrderedDict
from typing import Sequence

import numpy as np

from portable_loader.cache.readers import ArrayRecordCacheSource, ArrowCacheSource, Spans, _CacheSource
from portable_loader.cache.shardstore import ShardStore

__all__ = ["RemoteCacheSource"]

_MAX_OPEN = 1024  # file descriptors a process may spend on open shards
_FEW = 64  # up to this many records, a read loops in Python (as the local Arrow reader does)


class RemoteCacheSource(_CacheSource):
    """Records of the remote cache ``store.url``, read from shards fetched into ``store.local``.

    ``remote`` reports ``{"url", "local", "bytes_downloaded", "fetches"}`` (this process's downloads).

    Example:
        >>> import portable_loader as pl
        >>> from portable_loader.precache import sample_args
        >>> from portable_loader.cache.remote import upload_cache
        >>> upload_cache(pl.precache(**sample_args(), out="cache"), "memory://bucket/caches/chat")
        >>> src = pl.open_cache("memory://bucket/caches/chat", cache_dir="remote", cache_limit="3GB")
        >>> src.shard_of([0, len(src) - 1]).tolist()
        [0, 1]
    """

    # Lengths need the shard's offsets, i.e. the shard itself: a padded loader should not fetch a
    # chunk of 4096 records' shards to count over-long records (collation cuts them anyway).
    cheap_lengths = False

    def __init__(self, store: ShardStore, max_open: int | None = None):
        super().__init__(store.local, store.manifest)
        self.store = store
        if max_open is None:  # as many as the limit holds: open shards are pinned, so they must fit
            shards = store.manifest["shards"]
            mean = max(1, sum(s["bytes"] for s in shards) // max(1, len(shards)))
            max_open = len(shards) if store.limit is None else store.limit // mean
        self.max_open = max(2, min(int(max_open), _MAX_OPEN))
        self._starts = self._shard_starts.tolist()
        self._bytes = np.asarray([s["bytes"] for s in store.manifest["shards"]], dtype=np.int64)
        self._open: OrderedDict[int, tuple] = OrderedDict()  # shard -> (reader, pinned fd)
        # Unpinned when the source is collected, or its files stay unevictable until the process ends.
        weakref.finalize(self, _unpin_all, self._open, os.getpid())
        self._lock = threading.Lock()  # the open shards, shared by a reading thread and the fetch-ahead thread
        self._arrow = arrow = store.manifest["backend"] == "arrow"
        self._reader_cls = ArrowCacheSource if arrow else ArrayRecordCacheSource
        compressed = not arrow and "uncompressed" not in store.manifest.get("array_record_options", "group_size:1")
        self.fork_hazard = (f"{store.url}: this ArrayRecord cache was written compressed (by an older portable_loader); "
                            "its reader crashes in forked worker processes, so workers start by forkserver for it: "
                            "rebuild it to have them forked") if compressed else None

    @property
    def remote(self) -> dict:
        return {"url": self.store.url, "local": self.store.local,
                "bytes_downloaded": self.store.bytes_downloaded, "fetches": self.store.fetches}

    def shard_of(self, indices) -> np.ndarray:
        """The shard holding each record index."""
        return np.searchsorted(self._shard_starts, self._indices(indices), side="right") - 1

    def shard_bytes(self, s: int) -> int:
        return self.manifest["shards"][s]["bytes"]

    # --- reading ------------------------------------------------------------------------------

    def _reader(self, s: int, needed) -> _CacheSource:
        """Shard ``s``'s reader, opened (and pinned) if it is not; LRU over ``max_open``.

        ``needed``: the shards of the request in hand, which a release must keep. The lock is not
        held while fetching: another thread's fetch may need it to release shards.
        """
        with self._lock:
            entry = self._open.get(s)
            if entry is not None:
                self._open.move_to_end(s)
                return entry[0]
        fd = self.store.pin(s, release=lambda: self._close_idle(needed))
        try:
            os.utime(fd)  # recently opened: evicted last
            reader = self._reader_cls(self.store.local, {**self.manifest, "shards": [self.manifest["shards"][s]]})
        except BaseException:
            self.store.unpin(fd)
            raise
        with self._lock:
            entry = self._open.get(s)
            if entry is not None:  # another thread opened it meanwhile
                self.store.unpin(fd)
                return entry[0]
            self._open[s] = (reader, fd)
            while len(self._open) > self.max_open:
                self.store.unpin(self._open.popitem(last=False)[1][1])
            return reader

    def _close_idle(self, needed) -> None:
        """Close the open shards the request in hand does not read: other processes may evict them."""
        with self._lock:
            for s in [s for s in self._open if s not in needed]:
                self.store.unpin(self._open.pop(s)[1])

    def _shards_of(self, indices) -> tuple:
        """(indices as int64, each one's shard, the shards in first-use order); idle shards closed if asked."""
        idx = self._indices(indices)
        shard = np.searchsorted(self._shard_starts, idx, side="right") - 1
        needed = dict.fromkeys(shard.tolist())
        if self.store.release_asked():
            self._close_idle(needed)
        return idx, shard, needed

    def _per_shard(self, indices, read) -> list:
        """``read(reader, local indices)`` per shard of ``indices``, results back in request order."""
        idx, shard, needed = self._shards_of(indices)
        if len(needed) == 1:
            (s,) = needed
            return list(read(self._reader(s, needed), idx - self._starts[s]))
        out = [None] * idx.size
        for s in needed:
            where = np.flatnonzero(shard == s)
            got = read(self._reader(s, needed), idx[where] - self._starts[s])
            for w, r in zip(where.tolist(), got):
                out[w] = r
        return out

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        if self._arrow and len(indices) <= _FEW:
            got = self._few(indices)
            if got is not None:
                return got
        return self._per_shard(indices, lambda r, local: r.__getitems__(local))

    def _few(self, indices) -> list[dict] | None:
        """A loader step's few records when their shards are open here (None otherwise): one
        Python loop, as the local Arrow reader does, instead of a call per shard."""
        return self._each_open(indices, lambda reader, j: reader.record_at(j))

    def _few_spans(self, indices) -> Spans | None:
        """``spans`` of a worker's step (a few records, often as many shards) when their shards
        are open here (None otherwise): one loop, one buffer per record (8 records in 8 shards:
        7-12 µs measured, against 85-95 µs joining a ``Spans`` per shard)."""
        got = self._each_open(indices, lambda reader, j: reader.span_at(j))
        if got is None:
            return None
        ids, masks, ids_at, mask_at, length = map(list, zip(*got)) if got else ([],) * 5
        return Spans(ids, masks, list(range(len(got))), ids_at, mask_at, length)

    def _each_open(self, indices, read) -> list | None:
        """``read(reader, local index)`` per record, when every record's shard is open here."""
        if isinstance(indices, np.ndarray) and indices.ndim == 1 and indices.dtype.kind in "iu":
            idx = indices.tolist()
        elif isinstance(indices, (list, tuple)) and all(type(i) is int for i in indices):
            idx = indices
        else:
            return None
        if self.store.release_asked():
            self._close_idle(set())
        starts, n, out = self._starts, self._len, []
        with self._lock:
            opened = self._open
            for i in idx:
                if not 0 <= i < n:
                    return None  # negative or out of range: the general path checks and raises
                s = bisect.bisect_right(starts, i) - 1
                entry = opened.get(s)
                if entry is None:
                    return None
                opened.move_to_end(s)
                out.append(read(entry[0], i - starts[s]))
        return out

    def spans(self, indices) -> Spans:
        """Where the records' tokens lie (see :class:`~portable_loader.cache.readers.Spans`), from each
        shard's own reader (fetching the shards not local), joined into one ``Spans``.

        The shards' buffer lists are concatenated and each record's ``buf`` shifted by the buffers
        before its shard's. The buffers are memory maps (Arrow) or bytes read (ArrayRecord): they stay
        valid after the shard is unpinned, even evicted, because a shard file is only ever removed or
        replaced whole (``os.remove``, ``os.replace``), never written in place.

        Example:
            >>> import portable_loader as pl
            >>> from portable_loader.precache import sample_args
            >>> from portable_loader.cache.remote import upload_cache
            >>> upload_cache(pl.precache(**sample_args(), out="cache"), "memory://bucket/caches/chat")
            >>> src = pl.open_cache("memory://bucket/caches/chat", cache_dir="remote", cache_limit="3GB")
            >>> sp = src.spans([0, len(src) - 1])     # two shards, one Spans
            >>> sp.length == [len(src[0]["input_ids"]), len(src[-1]["input_ids"])]
            True
        """
        if self._arrow and isinstance(indices, (list, tuple, np.ndarray)) and len(indices) <= _FEW:
            got = self._few_spans(indices)
            if got is not None:
                return got
        idx, shard, needed = self._shards_of(indices)
        if len(needed) == 1:
            (s,) = needed
            return self._reader(s, needed).spans(idx - self._starts[s])
        ids, masks = [], []
        buf, ids_at, mask_at, length = (np.empty(idx.size, dtype=np.int64) for _ in range(4))
        for s in needed:
            where = np.flatnonzero(shard == s)
            part = self._reader(s, needed).spans(idx[where] - self._starts[s])
            buf[where] = np.asarray(part.buf, dtype=np.int64) + len(ids)  # ids and masks are parallel lists
            ids_at[where], mask_at[where], length[where] = part.ids_at, part.mask_at, part.length
            ids += part.ids
            masks += part.masks
        return Spans(ids, masks, buf.tolist(), ids_at.tolist(), mask_at.tolist(), length.tolist())

    def read_ahead(self, now: np.ndarray, ahead: np.ndarray) -> np.ndarray:
        """The records of ``ahead`` worth reading together with ``now``'s: those in ``now``'s shards
        or in shards already local (the fetch-ahead thread's), taking the shards in the order first
        met while they fit ``cache_limit`` less one shard and ``max_open``. A loader reads ahead over
        a local cache a chunk at a time; here that would fetch every shard of the chunk at once, on
        top of what the fetch-ahead thread holds.

        Example:
            >>> import portable_loader as pl
            >>> from portable_loader.precache import sample_args
            >>> from portable_loader.cache.remote import upload_cache
            >>> upload_cache(pl.precache(**sample_args(), out="cache"), "memory://bucket/caches/chat")
            >>> src = pl.open_cache("memory://bucket/caches/chat", cache_dir="remote-400k", cache_limit="400KB")
            >>> ahead = src.read_ahead(np.array([0]), np.arange(len(src)))
            >>> np.unique(src.shard_of(ahead)).tolist()   # 400 KB less one ~190 KB shard: room for record 0's only
            [0]
        """
        if self.store.limit is None or not ahead.size:
            return ahead
        shard = self.shard_of(np.concatenate([now, ahead]))
        uniq, first = np.unique(shard, return_index=True)
        mine = set(shard[: now.size].tolist())
        met = [s for s in uniq[np.argsort(first)].tolist() if s in mine or os.path.exists(self.store.path(s))]
        met = np.asarray(met, dtype=np.int64)
        budget = self.store.limit - int(self._bytes.max())
        fits = met[(np.cumsum(self._bytes[met]) <= budget) & (np.arange(met.size) < self.max_open)]
        return ahead[np.isin(shard[now.size :], fits)]

    def lengths(self, indices) -> np.ndarray:
        """Token counts; fetches the shards that hold ``indices`` (see ``cheap_lengths``)."""
        return np.asarray(self._per_shard(indices, lambda r, local: r.lengths(local).tolist()), dtype=np.int64)

    def prefetch(self, indices) -> None:
        """Fetch the shards holding ``indices`` now (in the caller's thread), without keeping them."""
        for s in np.unique(self.shard_of(indices)).tolist():
            self.store.unpin(self.store.pin(s))

    # --- reservations (fetch-ahead) -----------------------------------------------------------

    def reserve(self, s: int) -> int:
        """Fetch shard ``s`` if absent and keep it from eviction until ``release(token)``."""
        # Short of room, this process's open shards are closed (a read reopens what it needs):
        # what the steps ahead need is reserved, and the rest is what the limit should evict.
        fd = self.store.pin(s, release=lambda: self._close_idle(()))
        os.utime(fd)
        return fd

    def release(self, token: int) -> None:
        self.store.unpin(token)

    # --- processes ----------------------------------------------------------------------------

    def reopen(self) -> "RemoteCacheSource":
        """A fresh instance for a worker process: its own readers and downloads, the same store."""
        store = ShardStore(self.store.url, self.manifest, self.store.cache_dir, self.store.limit,
                           self.store.storage_options)
        return RemoteCacheSource(store, self.max_open)

    def __reduce__(self):
        return _reopened, (self.store.url, self.manifest, self.store.cache_dir, self.store.limit,
                           self.store.storage_options, self.max_open)

    def close(self) -> None:
        """Drop the open shard readers (their files stay in the local cache)."""
        with self._lock:
            _unpin_all(self._open, os.getpid())


def _unpin_all(opened: OrderedDict, pid: int) -> None:
    # Only in the process that pinned them: a forked child shares the locks, and must not drop them.
    if os.getpid() == pid:
        while opened:
            ShardStore.unpin(opened.popitem()[1][1])


def _reopened(url, manifest, cache_dir, limit, storage_options, max_open) -> RemoteCacheSource:
    """What an unpickled remote cache is: its own store over the same folder and bucket."""
    return RemoteCacheSource(ShardStore(url, manifest, cache_dir, limit, storage_options), max_open)
