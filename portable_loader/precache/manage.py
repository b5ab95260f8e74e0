"""Look into and tidy a folder of caches: :func:`cache_info`, :func:`list_caches`, :func:`remove_cache`.

These back the ``info``, ``ls`` and ``rm`` subcommands of ``python -m portable_loader.precache``.
Each takes a local path or a URL (``s3://bucket/caches``): remote caches are read through their
manifests and the store's metadata, never by downloading a shard.

Example:
    >>> import portable_loader as pl
    >>> from portable_loader.precache import sample_args
    >>> path = pl.precache(**sample_args(), out="cache")
    >>> [c["name"] for c in pl.list_caches("cache")]
    ['chat-...']
    >>> pl.cache_info(path)["rows"]
    2000
"""

from __future__ import annotations

import os
import re
import shutil
import uuid

import numpy as np

from portable_loader.cache.manifest import MANIFEST, cache_names, check_shards, read_manifest
from portable_loader.cache.publish import _HOST
from portable_loader.cache.opening import open_cache
from portable_loader.cache.remote import check_remote_shards, remote_manifest
from portable_loader.errors import CacheError
from portable_loader.io.remote import filesystem, is_url, join
from portable_loader.precache.lock import locked

__all__ = ["cache_info", "list_caches", "remove_cache", "format_info"]

_QUANTILES = (0.5, 0.9, 0.99)
# What precache writes into a cache directory; remove_cache deletes nothing else.
_CACHE_FILE = re.compile(r"(manifest\.json|state\.json|dataset_info\.json|data-\d{5}-of-\d{5}\.(arrow|array_record))")


def cache_info(path: str) -> dict:
    """A cache's size and shape: rows, tokens, drops, bytes, record-length statistics, build options.

    ``lengths`` holds min/mean/max, the 50/90/99th percentiles and a histogram over power-of-two
    bins (``[lo, hi)`` token counts and the number of records in each); None for a URL (the lengths
    are in the shards, which info does not download). ``options`` is the configuration the cache was
    built with (input, tokenizer, format, max_length, ...).

    Example:
        >>> from portable_loader.precache import precache, sample_args
        >>> info = cache_info(precache(**sample_args(), out="cache"))
        >>> info["rows"], info["tokens"], info["lengths"]["p50"], info["options"]["format"]
        (2000, 73528, 34.0, 'chat')
    """
    if is_url(path):
        m, lengths = _published(path), None
        path, name, rows, tokens = path, path.rstrip("/").rsplit("/", 1)[-1], m["counts"]["rows_out"], m["counts"].get("tokens")
    else:
        src = open_cache(path)
        m = src.manifest
        lengths = src.lengths(np.arange(len(src)))
        path, name, rows, tokens = os.path.abspath(path), os.path.basename(os.path.abspath(path)), len(src), int(lengths.sum())
    counts = m["counts"]
    return {
        "path": path,
        "name": name,
        "key": m.get("key"),
        "backend": m["backend"],
        "format_version": m["format_version"],
        "created_unix": m.get("created_unix"),
        "rows": rows,
        "rows_in": counts.get("rows_in"),
        "dropped": counts.get("dropped", {}),
        "truncated": counts.get("truncated"),
        "tokens": tokens,
        "trainable_tokens": counts.get("trainable_tokens"),
        "bytes": sum(s["bytes"] for s in m["shards"]),
        "shards": len(m["shards"]),
        "lengths": None if lengths is None else _length_stats(lengths),
        "options": m.get("config", {}),
    }


def _published(url: str) -> dict:
    m = remote_manifest(url)
    if m is None:
        raise CacheError(f"{join(url, MANIFEST)}: missing: not a portable_loader cache, or an unfinished upload")
    return m


def _length_stats(lengths: np.ndarray) -> dict:
    top = max(int(lengths.max()), 1)
    edges = [0, 1] + [1 << k for k in range(1, top.bit_length() + 1)]
    hist, _ = np.histogram(lengths, bins=edges)
    return {
        "min": int(lengths.min()),
        "mean": round(float(lengths.mean()), 2),
        "max": int(lengths.max()),
        **{f"p{round(q * 100)}": float(np.quantile(lengths, q)) for q in _QUANTILES},
        "histogram": [[lo, hi, int(n)] for lo, hi, n in zip(edges[:-1], edges[1:], hist) if hi > lengths.min()],
    }


def format_info(info: dict) -> str:
    """``cache_info``'s dict as the text ``precache info`` prints (a bar per histogram bin).

    Example:
        >>> from portable_loader.precache import precache, sample_args
        >>> path = precache(**sample_args(), out="cache")
        >>> print(format_info(cache_info(path)))
        cache:    .../cache/chat-...
        backend:  arrow (2 shards, ... bytes)
        rows:     2,000 (of 2,000 input rows; dropped: none; truncated: 0)
        tokens:   73,528 (23,340 trained)
        length:   min 17  mean 36.76  p50 34  p90 59.1  p99 80.01  max 100
               16-31      ################################         819
               32-63      ######################################## 1,032
               64-127     ######                                   149
        options:
          backend: arrow
        ...
          format: chat
        ...
    """
    s = info["lengths"]
    n = lambda v: "?" if v is None else f"{v:,}"  # noqa: E731  (counts a hand-made manifest may lack)
    if s is None:
        s = {"histogram": []}
    lines = [
        f"cache:    {info['path']}",
        f"backend:  {info['backend']} ({info['shards']} shards, {info['bytes']:,} bytes)",
        f"rows:     {info['rows']:,} (of {n(info['rows_in'])} input rows; dropped: "
        f"{', '.join(f'{k} {v}' for k, v in info['dropped'].items()) or 'none'}; truncated: {info['truncated']})",
        f"tokens:   {n(info['tokens'])} ({n(info['trainable_tokens'])} trained)",
        f"length:   min {s['min']}  mean {s['mean']}  p50 {s['p50']:g}  p90 {s['p90']:g}  p99 {s['p99']:g}  max {s['max']}"
        if s["histogram"] else "length:   not computed for a URL (the lengths are in the shards)",
    ]
    widest = max((n for _, _, n in s["histogram"]), default=1)
    for lo, hi, n in s["histogram"]:
        lines.append(f"  {lo:>7}-{hi - 1:<7} {'#' * round(40 * n / widest):<40} {n:,}")
    lines.append("options:")
    lines += [f"  {k}: {v}" for k, v in sorted(info["options"].items())]
    return "\n".join(lines)


def list_caches(out: str) -> list[dict]:
    """The caches directly under ``out``, by name: their size, or the error that makes one unusable.

    Each entry has ``name``, ``path``, ``format``, ``rows``, ``tokens``, ``bytes``, ``created_unix`` and
    ``error`` (``None`` for a sound cache). Folders without ``manifest.json`` are not caches and are
    left out; so are the hidden temporary folders of runs in progress.

    Example:
        >>> [(c["name"], c["rows"], c["error"]) for c in list_caches("cache")]
        [('chat-...', 2000, None)]
    """
    out = os.fspath(out)
    remote = is_url(out)
    if remote:
        fs, base = filesystem(out)
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(base, detail=False)]
        names = [n for n in names if not n.startswith(".") and fs.exists(join(base, n, MANIFEST))]
    elif not os.path.isdir(out):
        raise CacheError(f"{out}: no such folder")
    else:
        names = cache_names(out)
    found = []
    for name in sorted(names):
        path = join(out, name)
        entry = {"name": name, "path": path, "format": name.split("-", 1)[0], "rows": None, "tokens": None,
                 "bytes": None, "created_unix": None, "error": None}
        try:
            if remote:
                m = _published(path)
                check_remote_shards(path, m)
            else:
                m = read_manifest(path)
                check_shards(path, m)
        except CacheError as e:
            entry["error"] = str(e)
        else:
            entry.update(rows=m["counts"]["rows_out"], tokens=m["counts"]["tokens"],
                         bytes=sum(s["bytes"] for s in m["shards"]), created_unix=m.get("created_unix"),
                         format=m.get("config", {}).get("format", entry["format"]))
        found.append(entry)
    return found


def remove_cache(path: str) -> None:
    """Delete one cache directory, refusing any folder that holds anything but a cache's own files.

    The cache is renamed out of sight first (readers never see half of it), under the same lock that
    precache takes for it, so a concurrent rebuild of that cache cannot interleave.

    Example:
        >>> import shutil
        >>> (name,) = [c["name"] for c in list_caches("cache")]
        >>> copy = shutil.copytree(os.path.join("cache", name), os.path.join("old", name))
        >>> remove_cache(copy)
        >>> os.listdir("old")
        []
        >>> os.makedirs("notes")
        >>> remove_cache("notes")
        Traceback (most recent call last):
        ...
        portable_loader.errors.CacheError: .../notes: not a portable_loader cache (no manifest.json); nothing removed
    """
    if is_url(path):
        return _remove_published(path)
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise CacheError(f"{path}: no such cache directory")
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        raise CacheError(f"{path}: not a portable_loader cache (no {MANIFEST}); nothing removed")
    out, name = os.path.split(path)
    with locked(os.path.join(out, f".{name}.lock"), name):
        others = sorted(e for e in os.listdir(path) if not _CACHE_FILE.fullmatch(e))
        if others:
            shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
            raise CacheError(f"{path}: holds files that precache did not write ({shown}); nothing removed")
        trash = os.path.join(out, f".trash-{name}-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.rename(path, trash)
        shutil.rmtree(trash)


def _remove_published(url: str) -> None:
    """Delete a cache in a bucket: its manifest first (then nothing can open it), then its shards."""
    fs, path = filesystem(url)
    if not fs.exists(join(path, MANIFEST)):
        raise CacheError(f"{url}: not a portable_loader cache (no {MANIFEST}); nothing removed")
    names = sorted(p[len(path.rstrip("/")) + 1:] for p in fs.find(path))
    others = [n for n in names if not _CACHE_FILE.fullmatch(n)]
    if others:
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        raise CacheError(f"{url}: holds objects that precache did not write ({shown}); nothing removed")
    fs.rm(join(path, MANIFEST))
    fs.rm([join(path, n) for n in names if n != MANIFEST])
