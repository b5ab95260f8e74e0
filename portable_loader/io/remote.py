"""URLs (``s3://``, ``gs://``, ``az://``, ...) through fsspec, with its standard configuration.

fsspec reads its environment config (``FSSPEC_S3_ENDPOINT_URL``, ``FSSPEC_CONFIG_DIR``, ...) and the
provider's own (``AWS_*`` for s3fs); ``storage_options`` passes anything else, as in ``datasets``.
A missing backend package is named in the error, with the extra that installs it.

An object's identity is its ETag (or checksum/mtime where the store has none), size and URL, read
from the store's metadata: the object's bytes are never read to decide a cache key.

Example:
    >>> is_url("s3://bucket/train.jsonl"), is_url("data/train.jsonl")
    (True, False)
    >>> fs, path = filesystem("memory://bucket/train.jsonl")   # s3://, gs://, az:// alike, with their package
    >>> type(fs).__name__, path
    ('MemoryFileSystem', '/bucket/train.jsonl')
"""

from __future__ import annotations

import os

from portable_loader.errors import InputError

__all__ = ["is_url", "filesystem", "object_identity", "open_binary", "join"]

# The package each protocol needs, and the portable_loader extra that installs it.
_BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs"}
_EXTRAS = {"s3fs": "s3", "gcsfs": "gcs", "adlfs": "azure"}


def is_url(path) -> bool:
    """Whether ``path`` is a remote URL (``proto://...``); ``file://`` and plain paths are local."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def filesystem(url: str, storage_options: dict | None = None):
    """``(fs, path)`` for a URL; a clear error naming the package (and extra) a protocol needs."""
    protocol = url.split("://", 1)[0].lower()
    try:
        import fsspec.core
    except ImportError:
        raise InputError(f"{url}: URLs need fsspec: pip install 'portable-loader[s3]' (or gcs, azure)") from None
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as e:
        package = _BACKENDS.get(protocol)
        if package is None:
            raise InputError(f"{url}: the {protocol}:// protocol needs a package fsspec could not import: {e}") from None
        raise InputError(
            f"{url}: {protocol}:// URLs need {package}: pip install {package} "
            f"(or pip install 'portable-loader[{_EXTRAS[package]}]')"
        ) from None
    except ValueError as e:  # an unknown protocol
        raise InputError(f"{url}: {e}") from None


def join(url: str, *parts: str) -> str:
    """``url`` with ``parts`` appended, ``/``-separated (``os.path.join`` for a local path)."""
    if not is_url(url):
        return os.path.join(url, *parts)
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


def object_identity(url: str, storage_options: dict | None = None) -> dict:
    """``{"url", "etag", "size"}`` of one object, from its metadata (its bytes are not read).

    Stores without an ETag give their checksum or modification time instead, so an overwritten
    object still gets a new identity.

    Example:
        >>> with open("train.jsonl", "w") as f:
        ...     _ = f.write('{"text": "hi"}\\n')
        >>> object_identity("local://" + os.path.abspath("train.jsonl"))   # no ETag: the mtime stands in
        {'url': 'local:///.../train.jsonl', 'etag': '...', 'size': 15}
        >>> object_identity("s3://bucket/train.jsonl")   # needs an S3 bucket  # doctest: +SKIP
        {'url': 's3://bucket/train.jsonl', 'etag': '"9b2cf5..."', 'size': 81234}
    """
    fs, path = filesystem(url, storage_options)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise InputError(f"{url}: no such object") from None
    tag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("crc32c")
    if tag is None:
        tag = str(info.get("LastModified") or info.get("mtime") or info.get("last_modified") or "")
        if not tag:
            raise InputError(f"{url}: the store reports no ETag, checksum or mtime to identify the object by")
    return {"url": url, "etag": str(tag), "size": int(info["size"])}


def open_binary(url: str, storage_options: dict | None = None):
    """A seekable binary file object reading the object at ``url``."""
    fs, path = filesystem(url, storage_options)
    try:
        return fs.open(path, "rb")
    except FileNotFoundError:
        raise InputError(f"{url}: no such object") from None
