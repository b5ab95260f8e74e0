"""A cache's key and ``manifest.json``: writing it with its own checksum, reading and checking it.

The manifest records the format version, the cache key (the sha256 of the key parts: input identity,
record options, storage), counts, and each shard's size and sha256. Arrow caches also get the
``state.json`` and ``dataset_info.json`` that make them loadable by ``datasets.load_from_disk``.

Example:
    >>> import portable_loader as pl
    >>> from portable_loader.precache import sample_args
    >>> path = pl.precache(**sample_args(), out="cache")
    >>> manifest = read_manifest(path)
    >>> check_shards(path, manifest, verify=True)   # every shard present, at its size and sha256
    >>> manifest["counts"]["rows_out"], [(s["file"], s["rows"]) for s in manifest["shards"]]
    (2000, [('data-00000-of-00002.arrow', 1000), ('data-00001-of-00002.arrow', 1000)])
    >>> path.endswith(manifest["key"][:20]), manifest["format_version"] == FORMAT_VERSION
    (True, True)
"""

from __future__ import annotations

import json
import os

from portable_loader.digests import json_sha256
from portable_loader.errors import CacheError
from portable_loader.io import file_digest

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
BACKENDS = ("arrow", "array_record")


def cache_key(key_parts: dict) -> str:
    """The cache key: the sha256 of the key parts' canonical JSON.

    Example:
        >>> cache_key({"format_version": 1, "format": "text"})[:8]
        '5073c623'
    """
    return json_sha256(key_parts)


def cache_key_parts(input: dict, records: dict, **storage) -> dict:
    """What a cache key hashes: the format version, the input's identity, the record options' part
    (:meth:`~portable_loader.record_options.RecordOptions.key_parts`) and, for a cache on disk, how
    it is stored (``backend``, ``plan``; a dataset tokenized on read has none).

    Example:
        >>> parts = cache_key_parts({"kind": "jsonl", "sha256": "9f...", "split": None, "rows": 3},
        ...                         {"format": "text"}, backend="arrow")
        >>> sorted(parts)
        ['backend', 'format', 'format_version', 'input']
    """
    return {"format_version": FORMAT_VERSION, "input": input, **records, **storage}


def _manifest_checksum(body: dict) -> str:
    return json_sha256({k: v for k, v in body.items() if k != "checksum"})


def write_manifest(directory: str, manifest: dict) -> None:
    """Write ``manifest.json`` (with its own checksum) and, for Arrow, the ``datasets`` metadata."""
    manifest = dict(manifest, checksum=_manifest_checksum(manifest))
    if manifest["backend"] == "arrow":
        _write_json(os.path.join(directory, "dataset_info.json"), _DATASET_INFO)
        _write_json(
            os.path.join(directory, "state.json"),
            {
                "_data_files": [{"filename": s["file"]} for s in manifest["shards"]],
                "_fingerprint": manifest["key"][:16],
                "_format_columns": None,
                "_format_kwargs": {},
                "_format_type": None,
                "_output_all_columns": False,
                "_split": None,
            },
        )
    _write_json(os.path.join(directory, MANIFEST), manifest)


_LIST = lambda dtype: {"feature": {"dtype": dtype, "_type": "Value"}, "_type": "List"}  # noqa: E731
_DATASET_INFO = {
    "citation": "",
    "description": "portable_loader tokenized cache",
    "features": {"input_ids": _LIST("int32"), "loss_mask": _LIST("uint8")},
    "homepage": "",
    "license": "",
}


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(path: str) -> dict:
    """The checked manifest of the cache at ``path``; ``CacheError`` naming the file otherwise."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CacheError(f"{path}: no such cache directory")
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        inside = sorted(cache_names(path))
        if inside:
            shown = ", ".join(inside[:10]) + (f", ... ({len(inside)} in all)" if len(inside) > 10 else "")
            raise CacheError(
                f"{mpath}: missing: {path} is a folder of caches, not a cache; open one of: {shown}"
            ) from None
        raise CacheError(f"{mpath}: missing: not a portable_loader cache, or an incomplete one") from None
    except (OSError, ValueError) as e:
        raise CacheError(f"{mpath}: unreadable: {e}") from None
    return check_manifest(manifest, mpath)


def check_manifest(manifest, mpath: str) -> dict:
    """``manifest`` (parsed JSON) if its checksum and format version are right; ``CacheError`` naming ``mpath``."""
    if not isinstance(manifest, dict) or manifest.get("checksum") != _manifest_checksum(manifest):
        raise CacheError(f"{mpath}: checksum mismatch: the manifest was edited or corrupted")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CacheError(
            f"{mpath}: cache format version {version}, this portable_loader reads version {FORMAT_VERSION}: "
            "rebuild it with precache --force"
        )
    return manifest


def cache_names(out: str) -> list[str]:
    """Names of the folders directly under ``out`` that hold a manifest (hidden temp folders excluded)."""
    try:
        entries = os.listdir(out)
    except OSError:
        return []
    return [e for e in entries if not e.startswith(".") and os.path.isfile(os.path.join(out, e, MANIFEST))]


def check_shards(path: str, manifest: dict, verify: bool = False) -> None:
    """Every shard present at its recorded size (always), and with its sha256 (``verify``)."""
    for shard in manifest["shards"]:
        spath = os.path.join(path, shard["file"])
        try:
            size = os.path.getsize(spath)
        except OSError:
            raise CacheError(f"{spath}: shard missing") from None
        if size != shard["bytes"]:
            raise CacheError(f"{spath}: shard is {size} bytes, the manifest says {shard['bytes']}: truncated or replaced")
        if verify and file_digest(spath) != shard["sha256"]:
            raise CacheError(f"{spath}: checksum mismatch: the shard is corrupted")
