"""Tokenized caches: shard writers, the manifest, atomic publishing and ``open_cache``.

A cache is a directory ``<out>/<format>-<key>`` holding ``data-XXXXX-of-YYYYY.{arrow,array_record}``
shards and ``manifest.json`` (format version, key, counts, per-shard sizes and sha256, and a checksum
of the manifest itself). Arrow caches also carry the ``state.json`` and ``dataset_info.json`` that make
them loadable by ``datasets.load_from_disk``. Each record is ``input_ids`` (int32) and ``loss_mask``
(uint8) of one length.

Shards are written into a uniquely named temporary directory beside the target and published with one
``rename``: readers see either no cache or a complete one, also after ``kill -9``.

Example:
    >>> src = open_cache("cache/alpaca-0123abcd")       # doctest: +SKIP
    >>> len(src), src[0]["input_ids"].dtype             # doctest: +SKIP
    (999, dtype('int32'))
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
import socket
import uuid
from typing import Sequence

import numpy as np

from portable_loader.errors import CacheError
from portable_loader.indexing import parse_index

__all__ = ["FORMAT_VERSION", "ShardWriter", "open_cache", "ArrowCacheSource", "ArrayRecordCacheSource"]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
BACKENDS = ("arrow", "array_record")
_EXT = {"arrow": "arrow", "array_record": "array_record"}
# Arrow record batches: few and large, so that opening reads few message headers (each one faults in
# a readahead window of the memory map), yet bounded in a writer's memory by a token budget.
_BATCH_ROWS = 65536
_BATCH_TOKENS = 8 << 20


def shard_name(backend: str, index: int, count: int) -> str:
    return f"data-{index:05d}-of-{count:05d}.{_EXT[backend]}"


def record_digest(row: int, ids: np.ndarray, mask: np.ndarray) -> int:
    """128-bit digest of one output record and the input row it came from.

    The cache's content checksum is the sum of these mod 2**128: it does not depend on how rows were
    split among workers, yet it changes with any token, mask bit, or order.
    """
    h = hashlib.blake2b(row.to_bytes(8, "little"), digest_size=16)
    h.update(ids.tobytes())
    h.update(mask.tobytes())
    return int.from_bytes(h.digest(), "little")


class ShardWriter:
    """Writes one shard of records; ``close()`` returns its name, record count, size and sha256.

    Example:
        >>> w = ShardWriter("/tmp/x.arrow", "arrow")                    # doctest: +SKIP
        >>> w.write(np.array([1, 2], np.int32), np.array([0, 1], np.uint8))  # doctest: +SKIP
        >>> w.close()["rows"]                                           # doctest: +SKIP
        1
    """

    def __init__(self, path: str, backend: str):
        self.path, self.backend, self.rows = path, backend, 0
        self._ids: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        self._tokens = 0
        if backend == "arrow":
            import pyarrow as pa

            self._pa = pa
            self._schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8()))])
            self._sink = pa.OSFile(path, "wb")
            self._writer = pa.ipc.new_stream(self._sink, self._schema)
        elif backend == "array_record":
            from array_record.python.array_record_module import ArrayRecordWriter

            # group_size:1 puts each record in its own chunk: a random read decodes one record.
            self._writer = ArrayRecordWriter(path, "group_size:1")
        else:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    def write(self, ids: np.ndarray, mask: np.ndarray) -> None:
        self.rows += 1
        if self.backend == "array_record":
            self._writer.write(ids.astype(np.int32, copy=False).tobytes() + mask.astype(np.uint8, copy=False).tobytes())
            return
        self._ids.append(ids)
        self._mask.append(mask)
        self._tokens += ids.size
        if len(self._ids) >= _BATCH_ROWS or self._tokens >= _BATCH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if not self._ids:
            return
        pa = self._pa
        lengths = np.fromiter((a.size for a in self._ids), dtype=np.int64, count=len(self._ids))
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        ids = pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(self._ids).astype(np.int32, copy=False)))
        mask = pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(self._mask).astype(np.uint8, copy=False)))
        self._writer.write_batch(pa.record_batch([ids, mask], schema=self._schema))
        self._ids, self._mask, self._tokens = [], [], 0

    def close(self) -> dict:
        if self.backend == "arrow":
            self._flush()
            self._writer.close()
            self._sink.close()
        else:
            self._writer.close()
        _fsync(self.path)
        return {
            "file": os.path.basename(self.path),
            "rows": self.rows,
            "bytes": os.path.getsize(self.path),
            "sha256": _sha256(self.path),
        }


def _sha256(path: str) -> str:
    from portable_loader.inputs import file_digest

    return file_digest(path)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- manifest ---------------------------------------------------------------------------------


def _manifest_checksum(body: dict) -> str:
    body = {k: v for k, v in body.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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
        if verify and _sha256(spath) != shard["sha256"]:
            raise CacheError(f"{spath}: checksum mismatch: the shard is corrupted")


# --- reading ----------------------------------------------------------------------------------


class _CacheSource:
    """Random access to records; Grain's ``RandomAccessDataSource`` protocol plus batched reads."""

    def __init__(self, path: str, manifest: dict):
        self.path, self.manifest = path, manifest
        counts = [s["rows"] for s in manifest["shards"]]
        self._shard_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._len = int(self._shard_starts[-1])

    def __len__(self) -> int:
        return self._len

    def _indices(self, indices) -> np.ndarray:
        """Indices as int64, negative ones counted from the end; IndexError for any out of range.

        The rule of :func:`parse_index` (so ``[1.0]`` or ``["3"]`` is a ``TypeError``), plus a
        ``range`` or a single integer, which batched readers pass.
        """
        if type(indices) is np.ndarray and indices.dtype == np.int64 and indices.ndim == 1:
            # The loader's own reads (already int64): two reductions instead of a per-element check.
            if not indices.size or (indices.min() >= 0 and indices.max() < self._len):
                return indices
        if isinstance(indices, range):
            indices = np.arange(indices.start, indices.stop, indices.step, dtype=np.int64)
        elif not isinstance(indices, (list, tuple, np.ndarray, slice)):
            indices = [indices]
        try:
            return parse_index(indices, self._len)
        except IndexError as e:
            raise IndexError(f"{e} ({self.path})") from None

    def __getitem__(self, key):
        """One record for an integer; a list of records, in order, for a list, 1-D integer array or slice.

        Example:
            >>> src[3]["input_ids"].size, len(src[[5, 6, 7]]), len(src[:10:2])  # doctest: +SKIP
            (212, 3, 5)
        """
        try:
            idx = parse_index(key, self._len)
        except IndexError as e:
            raise IndexError(f"{e} ({self.path})") from None
        if isinstance(idx, int):
            return self.__getitems__([idx])[0]
        return self.__getitems__(idx)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, records={self._len})"


_FEW = 64  # up to this many indices, plain Python loops beat vectorized numpy


def _view(array, dtype) -> np.ndarray:
    """A zero-copy numpy view of a primitive Arrow array (``to_numpy`` would import pandas)."""
    dtype = np.dtype(dtype)
    data = array.buffers()[1]
    return np.frombuffer(data, dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)


class ArrowCacheSource(_CacheSource):
    """Memory-mapped Arrow shards; records are zero-copy, read-only numpy views.

    Example:
        >>> src = open_cache(path)                       # doctest: +SKIP
        >>> [r["input_ids"].size for r in src.__getitems__([0, 5])]  # doctest: +SKIP
        [212, 87]
    """

    def __init__(self, path: str, manifest: dict):
        import pyarrow as pa

        super().__init__(path, manifest)
        starts, self._offsets, self._ids, self._mask = [], [], [], []
        row = 0
        for shard in manifest["shards"]:
            table = pa.ipc.open_stream(pa.memory_map(os.path.join(path, shard["file"]))).read_all()
            ids_col, mask_col = table.column("input_ids"), table.column("loss_mask")
            for ids_chunk, mask_chunk in zip(ids_col.chunks, mask_col.chunks):
                starts.append(row)
                self._offsets.append(_view(ids_chunk.offsets, np.int32))
                self._ids.append(_view(ids_chunk.values, np.int32))
                self._mask.append(_view(mask_chunk.values, np.uint8))
                row += len(ids_chunk)
        if row != self._len:
            raise CacheError(f"{path}: shards hold {row} records, the manifest says {self._len}")
        # One entry per written batch (up to 65,536 records), never one per record.
        self._seg_starts = np.asarray(starts + [row], dtype=np.int64)
        # The same, as Python ints: a loader step reads a few records, and for a few, bisect and
        # memoryview reads (plain ints) cost less than the numpy calls' fixed price.
        self._seg_list = starts + [row]
        self._offsets_mv = [memoryview(o) for o in self._offsets]

    def _locate(self, indices) -> tuple[list[int], list[int]]:
        """(shard batch, row within it) of each index, as Python lists."""
        if type(indices) is np.ndarray and indices.dtype == np.int64 and indices.ndim == 1 and indices.size <= _FEW:
            idx = indices.tolist()  # the loader's own reads: checked in Python (numpy's min/max cost µs each)
            if idx and (min(idx) < 0 or max(idx) >= self._len):
                idx = self._indices(indices).tolist()  # negatives counted from the end; IndexError
        else:
            idx = self._indices(indices)
            if idx.size > _FEW:
                segs = np.searchsorted(self._seg_starts, idx, side="right") - 1
                return segs.tolist(), (idx - self._seg_starts[segs]).tolist()
            idx = idx.tolist()
        starts, segs, local = self._seg_list, [], []
        for i in idx:
            s = bisect.bisect_right(starts, i) - 1
            segs.append(s)
            local.append(i - starts[s])
        return segs, local

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        out = []
        all_offsets, all_ids, all_mask = self._offsets_mv, self._ids, self._mask
        for seg, j in zip(*self._locate(indices)):
            offsets = all_offsets[seg]
            a, b = offsets[j], offsets[j + 1]
            out.append({"input_ids": all_ids[seg][a:b], "loss_mask": all_mask[seg][a:b]})
        return out

    def lengths(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Token counts of records, vectorized (what a packer needs before it reads anything)."""
        if isinstance(indices, (list, tuple, np.ndarray)) and len(indices) <= _FEW:  # a padded step's few
            # records: a loop beats np.unique's setup
            offsets = self._offsets_mv
            segs, local = self._locate(indices)
            return np.array([offsets[s][j + 1] - offsets[s][j] for s, j in zip(segs, local)], dtype=np.int64)
        idx = self._indices(indices)
        seg = np.searchsorted(self._seg_starts, idx, side="right") - 1
        out = np.empty(idx.shape, dtype=np.int64)
        for s in np.unique(seg).tolist():
            sel = seg == s
            j = idx[sel] - self._seg_starts[s]
            out[sel] = self._offsets[s][j + 1] - self._offsets[s][j]
        return out


class ArrayRecordCacheSource(_CacheSource):
    """ArrayRecord shards (one record per chunk); batched reads go to each shard in one call."""

    def __init__(self, path: str, manifest: dict):
        from array_record.python.array_record_module import ArrayRecordReader

        super().__init__(path, manifest)
        self._readers = [
            ArrayRecordReader(os.path.join(path, s["file"]), "readahead_buffer_size:0")
            for s in manifest["shards"]
        ]

    @staticmethod
    def _decode(raw: bytes) -> dict:
        n = len(raw) // 5
        return {
            "input_ids": np.frombuffer(raw, dtype=np.int32, count=n),
            "loss_mask": np.frombuffer(raw, dtype=np.uint8, offset=4 * n),
        }

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        idx = self._indices(indices)
        shard = np.searchsorted(self._shard_starts, idx, side="right") - 1
        out: list = [None] * idx.size
        for s in np.unique(shard).tolist():
            where = np.flatnonzero(shard == s)
            raws = self._readers[s].read((idx[where] - self._shard_starts[s]).tolist())
            for w, raw in zip(where.tolist(), raws):
                out[w] = self._decode(raw)
        return out

    def lengths(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        return np.asarray([r["input_ids"].size for r in self.__getitems__(list(indices))], dtype=np.int64)

    def reopen(self) -> "ArrayRecordCacheSource":
        """A fresh instance with its own readers (what a forked worker needs)."""
        return ArrayRecordCacheSource(self.path, self.manifest)

    def close(self) -> None:
        for r in self._readers:
            r.close()


def open_cache(path: str, verify: bool = False):
    """Open a published cache; refuse one that is incomplete, corrupted or of another format version.

    Opening is O(shards), never O(rows): no per-record Python objects are built. ``verify=True`` also
    checks every shard's sha256 and names a corrupted one.

    Example:
        >>> src = open_cache(pl.precache("train.jsonl", tokenizer="tok/", format="text", out="cache/"))  # doctest: +SKIP
        >>> src[0]["loss_mask"].dtype                                                                  # doctest: +SKIP
        dtype('uint8')
    """
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


# --- atomic publishing ------------------------------------------------------------------------

_HOST = socket.gethostname().replace("-", "_")


def temp_dir(out: str, name: str) -> str:
    """A fresh, uniquely named directory beside the target: ``.tmp-<name>-<host>-<pid>-<uuid>``."""
    path = os.path.join(out, f".tmp-{name}-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(path)
    return path


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (zombies included); used for stale temp dirs and workers."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(out: str, name: str) -> list[str]:
    """Remove temp and trash directories that runs killed on this host left behind."""
    removed = []
    for entry in os.listdir(out):
        for prefix in (f".tmp-{name}-{_HOST}-", f".trash-{name}-{_HOST}-"):
            if entry.startswith(prefix):
                pid = entry[len(prefix) :].split("-", 1)[0]
                if pid.isdigit() and not pid_alive(int(pid)):
                    shutil.rmtree(os.path.join(out, entry), ignore_errors=True)
                    removed.append(entry)
    return removed


def publish(tmp: str, final: str, replace: bool = False) -> bool:
    """Rename ``tmp`` to ``final`` atomically. False (and ``tmp`` removed) if another run won."""
    _fsync(tmp)
    if replace and os.path.exists(final):
        out, name = os.path.split(final)
        trash = os.path.join(out, f".trash-{name}-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.rename(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:
        if not os.path.isdir(final):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    _fsync(os.path.dirname(final) or ".")
    return True
