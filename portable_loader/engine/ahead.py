"""Fetch-ahead for remote caches: a thread plans the steps after the consumer's and reserves their shards.

The batch of every step is known in advance (the ``Planner``), so the shards the next steps read
are known too. For a loader over a :class:`~portable_loader.cache.lazy.RemoteCacheSource`,
:class:`FetchAhead` wraps the engine: a daemon thread plans steps on a planner of its own, and
reserves (fetches, and keeps from eviction) each step's shards in the order the steps need them,
while the shards reserved and not yet consumed fit in ``cache_limit`` less one shard (room for a
read the thread has not reached). A shard is released once the consumer has taken the last step
that reads it; it then stays in the local cache until space is needed (least recently opened first).
Worker processes read shards the thread has reserved; one it has not reached yet they fetch
themselves. A fetch that fails stops the thread quietly: the read of that shard fails again, with
the error naming the object, where the consumer sees it.

Example:
    >>> loader = DataLoader(open_cache(url, cache_limit="3GB"), global_batch_size=8, seq_len=512,
    ...                     shuffle="shards", shuffle_shards=2)   # doctest: +SKIP
    >>> with iter(loader) as it: batch = next(it)                 # the thread starts with the iterator  # doctest: +SKIP
"""

from __future__ import annotations

import threading

import numpy as np

from portable_loader.plan import Cursor

__all__ = ["FetchAhead", "remote_of"]

_WAIT_S = 0.2
_JOIN_S = 10.0


def remote_of(dataset):
    """The remote cache a dataset reads (directly or through maps), or None.

    Example:
        >>> from portable_loader.dataset import source
        >>> remote_of(source([{"input_ids": [1]}])) is None
        True
    """
    node = dataset
    while node is not None:
        inner = getattr(node, "cache", None)
        if inner is not None and callable(getattr(inner, "reserve", None)):
            return inner
        node = getattr(node, "parent", None)
    return None


class FetchAhead:
    """An engine that reserves, in a background thread, the shards of the steps after the consumer's.

    ``max_steps``: how far ahead of the consumer it may run (the only bound when the cache has no
    ``cache_limit``).
    """

    def __init__(self, engine, loader, remote, cursor: Cursor, max_steps: int = 256):
        self.engine, self.loader, self.remote, self.max_steps = engine, loader, remote, max_steps
        self._planner = loader.planner()  # its own: the engine's planner is not thread-safe
        limit = remote.store.limit
        largest = max((s["bytes"] for s in remote.manifest["shards"]), default=0)
        self.budget = None if limit is None else max(largest, limit - largest)
        self._consumed = cursor.step
        self._cond = threading.Condition()
        self._stop = False
        self.error: BaseException | None = None  # why the thread stopped early, for inspection
        self._thread = threading.Thread(target=self._run, args=(cursor,), name="portable_loader-fetch-ahead", daemon=True)
        self._thread.start()

    def next(self):
        batch, cursor = self.engine.next()
        with self._cond:
            self._consumed = cursor.step
            self._cond.notify_all()
        return batch, cursor

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=_JOIN_S)
        self.engine.close()

    def _run(self, cursor: Cursor) -> None:
        held: dict[int, list] = {}  # shard -> [token, last step reading it]
        try:
            cur = cursor
            while not self._stop:
                planned = self._planner.step(cur)
                if planned is None:
                    break
                rows, nxt = planned
                recs = [piece[0] for row in self.loader.local_rows(rows) for piece in row]
                shards = dict.fromkeys(self.remote.shard_of(np.asarray(recs, dtype=np.int64)).tolist()) if recs else {}
                for s in shards:
                    if s in held:
                        held[s][1] = cur.step
                    elif self._wait_for_room(held, s, cur.step):
                        held[s] = [self.remote.reserve(s), cur.step]
                    else:
                        return
                cur = nxt
            with self._cond:  # the stream's end: keep the reservations until they are consumed or closed
                while not self._stop and held:
                    self._release_consumed(held)
                    self._cond.wait(_WAIT_S)
        except BaseException as e:  # noqa: BLE001 - the consumer's own read reports it (see module doc)
            self.error = e
        finally:
            for token, _ in held.values():
                self.remote.release(token)

    def _release_consumed(self, held: dict) -> None:
        for s in [s for s, (_, last) in held.items() if last < self._consumed]:
            self.remote.release(held.pop(s)[0])

    def _wait_for_room(self, held: dict, s: int, step: int) -> bool:
        """Wait until shard ``s`` (first read at ``step``) fits the budget; False when stopped."""
        need = self.remote.shard_bytes(s)
        with self._cond:
            while not self._stop:
                self._release_consumed(held)
                used = sum(self.remote.shard_bytes(h) for h in held)
                fits = self.budget is None or not held or used + need <= self.budget
                if fits and step - self._consumed <= self.max_steps:
                    return True
                self._cond.wait(_WAIT_S)
        return False
