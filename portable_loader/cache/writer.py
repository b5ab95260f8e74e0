"""The shard writer: records (``input_ids`` int32, ``loss_mask`` uint8) into one Arrow or ArrayRecord file.

Shards are named ``data-XXXXX-of-YYYYY.{arrow,array_record}``; ``close()`` fsyncs the file and returns
its manifest entry. ``record_digest`` gives the per-record terms of the cache's content checksum.

Example:
    >>> import numpy as np
    >>> w = ShardWriter(shard_name("arrow", 0, 1), "arrow")
    >>> w.write(np.array([5, 6], np.int32), np.array([0, 1], np.uint8))
    >>> w.close()["file"], w.rows
    ('data-00000-of-00001.arrow', 1)
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from portable_loader.cache.manifest import BACKENDS
from portable_loader.cache.publish import fsync_path
from portable_loader.io import file_digest

_EXT = {"arrow": "arrow", "array_record": "array_record"}
# Arrow record batches: few and large, so that opening reads few message headers (each one faults in
# a readahead window of the memory map), yet bounded in a writer's memory by a token budget.
_BATCH_ROWS = 65536
_BATCH_TOKENS = 8 << 20


# group_size:1 puts each record in its own chunk, so a random read decodes one record. Uncompressed:
# reads are about 2x faster, and a compressed shard's reader crashes (SIGSEGV) in a worker forked
# after the parent has read from it (the decompressor's background thread does not survive fork).
ARRAY_RECORD_OPTIONS = "group_size:1,uncompressed"


def _arrow(pa, values: np.ndarray):
    """An Arrow array over ``values``' own buffer. (``pa.array`` first asks whether they are a pandas
    object, which imports pandas: half a second of CPU in every process that writes a shard.)"""
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def shard_name(backend: str, index: int, count: int) -> str:
    """The file name of shard ``index`` of ``count``.

    Example:
        >>> shard_name("array_record", 2, 16)
        'data-00002-of-00016.array_record'
    """
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
        >>> w = ShardWriter("x.array_record", "array_record")
        >>> w.write(np.array([1, 2], np.int32), np.array([0, 1], np.uint8))
        >>> w.write(np.array([3], np.int32), np.array([1], np.uint8))
        >>> w.close()     # the shard's manifest entry
        {'file': 'x.array_record', 'rows': 2, 'bytes': ..., 'sha256': '...'}
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

            self._writer = ArrayRecordWriter(path, ARRAY_RECORD_OPTIONS)
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
        offsets = _arrow(pa, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        ids = pa.ListArray.from_arrays(offsets, _arrow(pa, np.concatenate(self._ids).astype(np.int32, copy=False)))
        mask = pa.ListArray.from_arrays(offsets, _arrow(pa, np.concatenate(self._mask).astype(np.uint8, copy=False)))
        self._writer.write_batch(pa.record_batch([ids, mask], schema=self._schema))
        self._ids, self._mask, self._tokens = [], [], 0

    def close(self) -> dict:
        if self.backend == "arrow":
            self._flush()
            self._writer.close()
            self._sink.close()
        else:
            self._writer.close()
        fsync_path(self.path)
        return {
            "file": os.path.basename(self.path),
            "rows": self.rows,
            "bytes": os.path.getsize(self.path),
            "sha256": file_digest(self.path),
        }
