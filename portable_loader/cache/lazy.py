"""A cache in object storage read shard by shard: fetched on first touch, evicted LRU, reserved ahead.

``open_cache(url, cache_dir=..., cache_limit=...)`` returns a :class:`RemoteCacheSource`. It reads
like a local cache (same records, same ``len``, same fingerprint, so the same batches and loader
states) but holds only the shards it has touched, in a :class:`~portable_loader.cache.shardstore.ShardStore`
bounded by ``cache_limit``: a cache larger than the limit can be read. Each process (the loader's,
each worker) keeps up to ``max_open`` shards open; a read holds a shared lock on each shard it reads
from, so no process evicts it meanwhile. ``reserve``/``release`` are what the loader's fetch-ahead
thread (:mod:`portable_loader.engine.ahead`) uses to fetch the next steps' shards and keep them.

Example:
    >>> src = open_cache("s3://b/caches/chat-0123", cache_dir="/scratch/pl", cache_limit="3GB")  # doctest: +SKIP
    >>> src[0]["input_ids"][:4]            # fetches the shard holding record 0   # doctest: +SKIP
    array([  1, 882, 198,  40], dtype=int32)
    >>> src.remote["bytes_downloaded"]      # doctest: +SKIP
    1048912
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np

from portable_loader.cache.readers import ArrayRecordCacheSource, ArrowCacheSource, _CacheSource
from portable_loader.cache.shardstore import ShardStore

__all__ = ["RemoteCacheSource"]


class RemoteCacheSource(_CacheSource):
    """Records of the remote cache ``store.url``, read from shards fetched into ``store.local``.

    ``remote`` reports ``{"url", "local", "bytes_downloaded", "fetches"}`` (this process's downloads).

    Example:
        >>> src = open_cache(url, cache_dir=tmp, cache_limit=3 * shard_bytes)   # doctest: +SKIP
        >>> src.shard_of([0, len(src) - 1]).tolist()                            # doctest: +SKIP
        [0, 11]
    """

    # Lengths need the shard's offsets, i.e. the shard itself: a padded loader should not fetch a
    # chunk of 4096 records' shards to count over-long records (collation cuts them anyway).
    cheap_lengths = False

    def __init__(self, store: ShardStore, max_open: int = 8):
        super().__init__(store.local, store.manifest)
        self.store, self.max_open = store, int(max_open)
        self._starts = self._shard_starts.tolist()
        self._open: OrderedDict[int, _CacheSource] = OrderedDict()
        self._lock = threading.Lock()
        arrow = store.manifest["backend"] == "arrow"
        self._reader_cls = ArrowCacheSource if arrow else ArrayRecordCacheSource
        compressed = not arrow and "uncompressed" not in store.manifest.get("array_record_options", "group_size:1")
        self.fork_hazard = (f"{store.url}: this ArrayRecord cache was written compressed (by an older portable_loader); "
                            "its reader crashes in forked worker processes: rebuild it or use num_workers=0") if compressed else None

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

    def _reader(self, s: int, fd: int) -> _CacheSource:
        """Shard ``s``'s reader (opened on the pinned file ``fd``'s path); LRU over ``max_open``."""
        with self._lock:
            entry = self._open.get(s)
            if entry is not None and entry[1] == os.fstat(fd).st_ino:
                self._open.move_to_end(s)
                return entry[0]
        one = {**self.manifest, "shards": [self.manifest["shards"][s]]}
        reader = self._reader_cls(self.store.local, one)
        os.utime(fd)  # recently opened: evicted last
        with self._lock:
            # Readers dropped here are closed when the last thread reading them lets go.
            self._open[s] = (reader, os.fstat(fd).st_ino)
            self._open.move_to_end(s)
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)
        return reader

    def _per_shard(self, indices, read) -> list:
        """``read(reader, local indices)`` per shard of ``indices``, results back in request order."""
        idx = self._indices(indices)
        shard = np.searchsorted(self._shard_starts, idx, side="right") - 1
        out = [None] * idx.size
        for s in dict.fromkeys(shard.tolist()):
            where = np.flatnonzero(shard == s)
            fd = self.store.pin(s)
            try:
                got = read(self._reader(s, fd), idx[where] - self._starts[s])
            finally:
                self.store.unpin(fd)
            for w, r in zip(where.tolist(), got):
                out[w] = r
        return out

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        return self._per_shard(indices, lambda r, local: r.__getitems__(local))

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
        fd = self.store.pin(s)
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

    def close(self) -> None:
        """Drop the open shard readers (their files stay in the local cache)."""
        with self._lock:
            self._open = OrderedDict()
