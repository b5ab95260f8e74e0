"""Caches in object storage: publishing a locally built cache to a prefix, and fetching one to read.

Publishing uploads every shard (and the ``datasets`` metadata) under ``<out>/<format>-<key>/``, then
``manifest.json`` last. Readers trust only what a manifest lists, so a killed upload leaves nothing
openable and the rerun publishes; two machines building one key upload the same shard files (the
records are the same for one key) and each manifest describes its own shards.

Reading (:func:`open_store`) checks the manifest and hands the shards to a
:class:`~portable_loader.cache.shardstore.ShardStore`, which fetches each one whole when it is
first read, verified, into ``cache_dir/<name>-<hash of the URL>/``, within ``cache_limit``.

Example:
    >>> import portable_loader as pl
    >>> from portable_loader.precache import sample_args
    >>> path = pl.precache(**sample_args(), out="cache")     # built locally
    >>> upload_cache(path, "memory://bucket/caches/chat")    # memory:// stands in for s3://, gs://, ...
    >>> store = open_store("memory://bucket/caches/chat", "remote", "10GB")
    >>> store.limit, len(store.shards), os.listdir(store.local)    # no shard fetched yet
    (10000000000, 2, ['manifest.json'])
"""

from __future__ import annotations

import json
import os
import re

from portable_loader.cache.manifest import MANIFEST, check_manifest
from portable_loader.errors import CacheError
from portable_loader.cache.shardstore import ShardStore
from portable_loader.io.remote import filesystem, join

__all__ = ["upload_cache", "unpublish", "discard_unpublished", "remote_manifest", "open_store", "parse_bytes", "default_cache_dir"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(size) -> int | None:
    """Bytes from an int or a string such as ``'10GB'`` or ``'512 MiB'``; None stays None (no limit).

    Example:
        >>> parse_bytes("10GB"), parse_bytes("1.5 KiB"), parse_bytes(2048)
        (10000000000, 1536, 2048)
    """
    if size is None:
        return None
    if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
        return size
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(size)) if isinstance(size, str) else None
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cache_limit must be a number of bytes or a string such as '10GB', got {size!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def default_cache_dir() -> str:
    """``$PORTABLE_LOADER_CACHE_DIR``, else ``~/.cache/portable_loader/remote``."""
    return os.environ.get("PORTABLE_LOADER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "portable_loader", "remote")


def upload_cache(local: str, url: str, storage_options: dict | None = None, replace: bool = False) -> None:
    """Upload the cache built at ``local`` to ``url``: every other file first, ``manifest.json`` last."""
    fs, path = filesystem(url, storage_options)
    if replace:
        unpublish(url, storage_options)  # never a manifest over shards being replaced
    names = sorted(n for n in os.listdir(local) if n != MANIFEST)
    for name in names + [MANIFEST]:
        fs.put_file(os.path.join(local, name), join(path, name))


def unpublish(url: str, storage_options: dict | None = None) -> None:
    """Remove the manifest at ``url`` (if any): the cache there can no longer be opened.

    Example:
        >>> import portable_loader as pl
        >>> from portable_loader.precache import sample_args
        >>> upload_cache(pl.precache(**sample_args(), out="cache"), "memory://bucket/caches/old")
        >>> unpublish("memory://bucket/caches/old")
        >>> remote_manifest("memory://bucket/caches/old") is None   # the shards are there, but no cache
        True
    """
    fs, path = filesystem(url, storage_options)
    if fs.exists(join(path, MANIFEST)):
        fs.rm(join(path, MANIFEST))


def discard_unpublished(url: str, storage_options: dict | None = None) -> None:
    """Remove every object under ``url`` unless a manifest is there: what a failed build uploaded.

    Objects without a manifest are no cache (readers open only what a manifest lists); a build that
    fails after its tasks uploaded shards leaves them to this. Best effort: the caller is reporting
    the build's own error.

    Example:
        >>> import portable_loader as pl
        >>> from portable_loader.precache import sample_args
        >>> from portable_loader.io.remote import filesystem
        >>> upload_cache(pl.precache(**sample_args(), out="cache"), "memory://bucket/caches/half")
        >>> unpublish("memory://bucket/caches/half")          # as a failed build leaves it: shards, no manifest
        >>> fs, prefix = filesystem("memory://bucket/caches/half")
        >>> len(fs.find(prefix))
        4
        >>> discard_unpublished("memory://bucket/caches/half")
        >>> fs.find(prefix)
        []
    """
    try:
        fs, path = filesystem(url, storage_options)
        if not fs.exists(join(path, MANIFEST)):
            found = fs.find(path)
            if found:
                fs.rm(found)
    except Exception:  # noqa: BLE001 (the build's own error is the one to report)
        pass


def remote_manifest(url: str, storage_options: dict | None = None) -> dict | None:
    """The checked manifest published at ``url``, or None when there is none (nothing to open)."""
    fs, path = filesystem(url, storage_options)
    murl = join(url, MANIFEST)
    try:
        raw = fs.cat_file(join(path, MANIFEST))
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise CacheError(f"{murl}: unreadable: {e}") from None
    return check_manifest(manifest, murl)


def check_remote_shards(url: str, manifest: dict, storage_options: dict | None = None) -> None:
    """Every shard the manifest lists is in the store at its recorded size (a metadata call each)."""
    fs, path = filesystem(url, storage_options)
    for shard in manifest["shards"]:
        try:
            size = int(fs.info(join(path, shard["file"]))["size"])
        except FileNotFoundError:
            raise CacheError(f"{join(url, shard['file'])}: shard missing") from None
        if size != shard["bytes"]:
            raise CacheError(
                f"{join(url, shard['file'])}: shard is {size} bytes, the manifest says {shard['bytes']}: truncated or replaced"
            )


def open_store(url: str, cache_dir: str | None = None, cache_limit=None, storage_options: dict | None = None) -> ShardStore:
    """The local shard store of the cache published at ``url`` (its manifest read and checked).

    Nothing but the manifest is downloaded here: shards are fetched when first read.

    Example:
        >>> import portable_loader as pl
        >>> from portable_loader.precache import sample_args
        >>> upload_cache(pl.precache(**sample_args(), out="cache"), "memory://bucket/caches/chat")
        >>> open_store("memory://bucket/caches/chat", "remote", "10GB").local
        'remote/chat-0a81438fdcd4'
    """
    limit = parse_bytes(cache_limit)
    manifest = remote_manifest(url, storage_options)
    if manifest is None:
        raise CacheError(f"{join(url, MANIFEST)}: missing: not a portable_loader cache, or an unfinished upload")
    largest = max((s["bytes"] for s in manifest["shards"]), default=0)
    if limit is not None and largest > limit:
        raise CacheError(f"{url}: its largest shard holds {largest} bytes, more than cache_limit={cache_limit!r} ({limit} bytes)")
    cache_dir = os.fspath(cache_dir) if cache_dir is not None else default_cache_dir()
    os.makedirs(cache_dir, exist_ok=True)
    store = ShardStore(url, manifest, cache_dir, limit, storage_options)
    store.prepare()
    return store
