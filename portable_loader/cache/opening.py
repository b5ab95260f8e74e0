"""``open_cache``: a published cache as a dataset, local (memory-mapped) or remote (shard by shard).

The one place that knows both kinds of source, so the local readers (``readers``) and the remote
one built on them (``lazy``) never import each other.

Example:
    >>> from portable_loader.cache import open_cache
    >>> open_cache("/no/such/cache")
    Traceback (most recent call last):
    ...
    portable_loader.errors.CacheError: /no/such/cache: no such cache directory
"""

from __future__ import annotations

import os

from portable_loader.cache.lazy import RemoteCacheSource
from portable_loader.cache.manifest import check_shards, read_manifest
from portable_loader.cache.readers import ArrayRecordCacheSource, ArrowCacheSource
from portable_loader.cache.remote import open_store
from portable_loader.errors import CacheError
from portable_loader.io.remote import is_url

__all__ = ["open_cache"]


def open_cache(path: str, verify: bool = False, *, cache_dir: str | None = None, cache_limit=None,
               storage_options: dict | None = None):
    """Open a published cache; refuse one that is incomplete, corrupted or of another format version.

    Opening is O(shards), never O(rows): no per-record Python objects are built. ``verify=True`` also
    checks every shard's sha256 and names a corrupted one.

    A URL (``s3://bucket/caches/text-0123...``, any fsspec protocol) is read shard by shard
    (:class:`~portable_loader.cache.lazy.RemoteCacheSource`): each shard is downloaded whole when
    first read (or fetched ahead by the loader), checked against the manifest's size and sha256, into
    ``cache_dir`` (default ``$PORTABLE_LOADER_CACHE_DIR`` or ``~/.cache/portable_loader/remote``),
    which ``cache_limit`` (bytes, or ``"10GB"``) bounds by evicting the least recently opened shards
    not in use. Downloads are always verified, so ``verify`` applies to local paths only.
    The source's ``remote`` attribute says ``{"url", "local", "bytes_downloaded", "fetches"}``.

    Example:
        >>> import portable_loader as pl
        >>> from portable_loader.precache import sample_args
        >>> src = open_cache(pl.precache(**sample_args(), out="cache"))
        >>> src[0]["loss_mask"].dtype
        dtype('uint8')
        >>> from portable_loader.cache.remote import upload_cache
        >>> upload_cache(src.path, "memory://bucket/caches/chat")   # memory:// stands in for s3://, gs://, ...
        >>> remote = open_cache("memory://bucket/caches/chat", cache_dir="remote", cache_limit="10GB")
        >>> remote[0]["input_ids"].tolist() == src[0]["input_ids"].tolist(), remote.remote["fetches"]
        (True, 1)
    """
    if is_url(path):
        return RemoteCacheSource(open_store(path, cache_dir, cache_limit, storage_options))
    path = os.fspath(path)
    manifest = read_manifest(path)
    check_shards(path, manifest, verify=verify)
    cls = ArrowCacheSource if manifest["backend"] == "arrow" else ArrayRecordCacheSource
    try:
        return cls(path, manifest)
    except CacheError:
        raise
    except Exception as e:  # pyarrow / array_record errors on a damaged shard
        raise CacheError(f"{path}: cannot read shards: {type(e).__name__}: {e}") from None
