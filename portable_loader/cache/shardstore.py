"""A local folder of verified shards fetched from object storage, bounded by ``cache_limit``.

One store serves one remote cache (``cache_dir/<name>-<hash of the URL>/``) but the limit counts
every shard file under ``cache_dir``, so caches sharing a folder share its budget. Processes
cooperate through the file system only, so worker processes, a fetch-ahead thread and other jobs
on the machine may all fetch and evict:

* **Fetch**: under an exclusive ``flock`` on ``<shard>.lock``, a shard already present (someone
  else fetched it) is kept; otherwise it is downloaded under a unique temporary name, checked
  against the manifest's size and sha256, and renamed into place. A file under its final name is
  therefore always complete and verified.
* **In use**: whoever reads a shard, or reserves it for the steps ahead, holds a shared ``flock``
  on it. Eviction takes an exclusive non-blocking ``flock`` first, so it never removes a shard in
  use; it removes the least recently opened shards (mtime) until the new one fits.
* A shard that is in use everywhere is never waited for: a fetch that lacks room first has its own
  process close the shards its current read does not need, then touches ``cache_dir/.release``,
  which every reader checks (one ``stat``) before each read and answers by closing its idle shards;
  until then the limit is exceeded by the shards in use.

Example:
    >>> import portable_loader as pl
    >>> from portable_loader.precache import sample_args
    >>> from portable_loader.cache.manifest import read_manifest
    >>> from portable_loader.cache.remote import upload_cache
    >>> path = pl.precache(**sample_args(), out="cache")
    >>> upload_cache(path, "memory://bucket/caches/chat")    # memory:// stands in for s3://, gs://, ...
    >>> store = ShardStore("memory://bucket/caches/chat", read_manifest(path), "shards", limit=250_000)
    >>> store.prepare()
    >>> fd = store.pin(0)            # fetched if absent; not evictable until unpinned
    >>> store.unpin(fd)
    >>> store.unpin(store.pin(1))    # room for one ~190 KB shard: shard 0, no longer in use, is evicted
    >>> os.path.exists(store.path(0)), os.path.exists(store.path(1))
    (False, True)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import time
import uuid

from portable_loader.cache.manifest import MANIFEST
from portable_loader.errors import CacheError
from portable_loader.io import file_digest
from portable_loader.io.remote import filesystem, join

__all__ = ["ShardStore", "local_name"]

_LOCK, _TMP = ".lock", ".tmp-"
_ASK_EVERY_S = 0.005


def local_name(url: str) -> str:
    """The folder name of the local copy of ``url``: its last part and a hash of the whole URL.

    Example:
        >>> local_name("s3://bucket/caches/chat-0123")
        'chat-0123-4ceec0df2c00'
    """
    return f"{url.rstrip('/').rsplit('/', 1)[-1]}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def _flock(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how)
        return True
    except BlockingIOError:
        return False


class ShardStore:
    """The verified local shards of the remote cache ``url`` (see the module docstring).

    Example:
        >>> import portable_loader as pl
        >>> from portable_loader.precache import sample_args
        >>> from portable_loader.cache.remote import open_store, upload_cache
        >>> upload_cache(pl.precache(**sample_args(), out="cache"), "memory://bucket/caches/chat")
        >>> store = open_store("memory://bucket/caches/chat", "shards-3gb", "3GB")
        >>> store.fetch(0) == store.shards[0]["bytes"], store.fetch(0)   # bytes downloaded: the second finds it present
        (True, 0)
    """

    def __init__(self, url: str, manifest: dict, cache_dir: str, limit: int | None, storage_options: dict | None = None):
        self.url, self.manifest, self.cache_dir, self.limit = url, manifest, cache_dir, limit
        self.storage_options = storage_options
        self.local = os.path.join(cache_dir, local_name(url))
        self.shards = manifest["shards"]
        self.bytes_downloaded = 0  # by this process, since this store was made
        self.fetches = 0
        self._count = threading.Lock()
        self._release_seen = None
        self._asked_at = float("-inf")

    # --- opening ------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create the local folder and write the manifest; drop shards of a republished cache."""
        os.makedirs(self.local, exist_ok=True)
        lmanifest = os.path.join(self.local, MANIFEST)
        try:
            with open(lmanifest, encoding="utf-8") as f:
                old = json.load(f).get("checksum")
        except (OSError, ValueError):
            old = None
        if old == self.manifest["checksum"]:
            return
        if old is not None:  # republished (--force): same file names, other bytes
            with self._evict_lock():
                for name in os.listdir(self.local):
                    if not name.endswith(_LOCK):
                        os.remove(os.path.join(self.local, name))
        tmp = f"{lmanifest}{_TMP}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.manifest, f, indent=2, sort_keys=True)
        os.replace(tmp, lmanifest)

    def path(self, s: int) -> str:
        return os.path.join(self.local, self.shards[s]["file"])

    # --- pins ---------------------------------------------------------------------------------

    def pin(self, s: int, release=None) -> int:
        """A file descriptor of shard ``s`` holding a shared lock: present, verified, not evictable.

        Fetches the shard when it is absent (or was evicted between the fetch and the lock);
        ``release`` is called when that fetch lacks room (see :meth:`fetch`).
        """
        path = self.path(s)
        while True:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                self.fetch(s, release)
                continue
            fcntl.flock(fd, fcntl.LOCK_SH)
            if os.fstat(fd).st_nlink:  # still the file under that name, not one evicted meanwhile
                return fd
            self.unpin(fd)

    @staticmethod
    def unpin(fd: int) -> None:
        # Unlock before closing: a worker forked while the lock was held shares the lock otherwise.
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    # --- fetching and eviction ------------------------------------------------------------------

    def fetch(self, s: int, release=None) -> int:
        """Download shard ``s`` unless present; bytes downloaded. Refuses a truncated or altered object.

        When the shards not in use leave too little room, ``release()`` (this process unpinning
        what it can) is called and eviction tried again; if room is still short, the other
        processes are asked to release theirs (:meth:`release_asked`) and the limit is exceeded
        until they do.
        """
        shard = self.shards[s]
        target = self.path(s)
        obj = join(self.url, shard["file"])
        fd = os.open(target + _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one download of a shard at a time, on this machine
            if os.path.isfile(target):
                return 0  # fetched by another process or thread while we waited
            if self._make_room(shard["bytes"]):
                if release is not None:
                    release()
                self._make_room(shard["bytes"], ask=True)
            tmp = f"{target}{_TMP}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            fs, path = filesystem(self.url, self.storage_options)
            try:
                fs.get_file(join(path, shard["file"]), tmp)
            except FileNotFoundError:
                raise CacheError(f"{obj}: shard missing") from None
            try:
                size = os.path.getsize(tmp)
                with self._count:
                    self.bytes_downloaded += size
                    self.fetches += 1
                if size != shard["bytes"]:
                    raise CacheError(f"{obj}: {size} bytes, the manifest says {shard['bytes']}: the shard is truncated or altered; refused")
                if file_digest(tmp) != shard["sha256"]:
                    raise CacheError(f"{obj}: sha256 differs from the manifest's: the shard is truncated or altered; refused")
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
            return size
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _evict_lock(self):
        return _FileLock(os.path.join(self.cache_dir, ".evict" + _LOCK))

    def _make_room(self, need: int, ask: bool = False) -> int:
        """Evict the least recently opened shards not in use until ``need`` more bytes fit the limit.

        Returns the bytes still missing; with ``ask``, a shortfall asks other processes to release.
        """
        if self.limit is None:
            return 0
        with self._evict_lock():
            files = []
            for copy in os.listdir(self.cache_dir):
                folder = os.path.join(self.cache_dir, copy)
                if copy.startswith(".") or not os.path.isdir(folder):
                    continue
                for name in os.listdir(folder):
                    if not name.startswith("data-") or name.endswith(_LOCK) or _TMP in name:
                        continue
                    try:
                        st = os.stat(os.path.join(folder, name))
                    except FileNotFoundError:
                        continue
                    files.append((st.st_mtime_ns, st.st_size, os.path.join(folder, name)))
            used = sum(f[1] for f in files)
            for _, size, path in sorted(files):
                if used + need <= self.limit:
                    break
                if self._evict(path):
                    used -= size
            short = max(0, used + need - self.limit)
            if short and ask:
                with open(self._release_marker(), "a"):
                    pass
                os.utime(self._release_marker(), ns=(time.time_ns(), time.time_ns()))
            return short

    def _release_marker(self) -> str:
        return os.path.join(self.cache_dir, ".release")

    def release_asked(self) -> bool:
        """Whether a process lacked room since this store last asked: then close idle shards.

        One ``stat``, at most every ``_ASK_EVERY_S`` (readers call this before every read).
        """
        if self.limit is None:
            return False
        now = time.monotonic()
        if now - self._asked_at < _ASK_EVERY_S:
            return False
        self._asked_at = now
        try:
            stamp = os.stat(self._release_marker()).st_mtime_ns
        except FileNotFoundError:
            return False
        asked, self._release_seen = stamp != self._release_seen, stamp
        return asked

    @staticmethod
    def _evict(path: str) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            if not _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB):
                return False  # in use: read now, or reserved for the steps ahead
            os.remove(path)
            return True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def local_bytes(self) -> int:
        """Bytes of this cache's shards present locally now."""
        total = 0
        for shard in self.shards:
            try:
                total += os.path.getsize(os.path.join(self.local, shard["file"]))
            except FileNotFoundError:
                pass
        return total


class _FileLock:
    """An exclusive ``flock`` on ``path`` for a ``with`` block (between processes and threads)."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
