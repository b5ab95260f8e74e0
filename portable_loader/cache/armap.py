"""Where each record of an uncompressed, one-record-per-chunk ArrayRecord shard lies in the file.

An ArrayRecord file is a riegeli file: 64 KiB blocks, each opening with a 24-byte block header,
and chunks laid over them (a chunk's bytes skip the block headers they meet). A chunk is a 40-byte
header (header hash, data size, data hash, chunk type byte + 7-byte record count, decoded size),
then its data. The shards portable_loader writes (``group_size:1,uncompressed``) hold one record
per simple chunk (type ``r``) with compression type 0, whose data is ``0``, the varint size of the
sizes, the record's varint size, then the record's bytes: so a record's bytes are the last
``decoded size`` bytes of its chunk, and can be served straight from a memory map of the file.

:func:`index_shard` finds the chunks from ArrayRecord's footer (a simple chunk of one
``ArrayRecordFooter`` proto per chunk: offset, decoded size, records; located by the postscript
in the file's last block), reads and checks every chunk header at once (numpy gathers, no
per-record Python) and returns each record's payload position. Anything it does not expect
(another chunk type, a compressed chunk, chunks of more records, a footer of another count) is a
:class:`CacheError` naming the file.

Example:
    >>> from portable_loader.cache.writer import ShardWriter
    >>> w = ShardWriter("data-00000-of-00001.array_record", "array_record")   # as precache writes shards
    >>> for n in (3, 5):
    ...     w.write(np.arange(n, dtype=np.int32), np.ones(n, np.uint8))
    >>> _ = w.close()
    >>> ix = index_shard("data-00000-of-00001.array_record", rows=2)
    >>> ix.size.tolist()    # bytes: a record is its int32 ids, then its uint8 mask
    [15, 25]
    >>> from array_record.python.array_record_module import ArrayRecordReader
    >>> reader = ArrayRecordReader("data-00000-of-00001.array_record")
    >>> bytes(ix.view[ix.pos[0]:ix.pos[0] + ix.size[0]]) == reader.read(0, 1)[0]
    True
"""

from __future__ import annotations

import mmap
from typing import NamedTuple

import numpy as np

from portable_loader.errors import CacheError

BLOCK = 1 << 16
BLOCK_HEADER = 24
USABLE = BLOCK - BLOCK_HEADER
CHUNK_HEADER = 40
_SIMPLE = ord("r")
_ONE_SIMPLE = _SIMPLE | 1 << 8  # a simple chunk of one record
_MAGIC = 0x71930E704FDAE05E  # ArrayRecord's postscript


class ShardIndex(NamedTuple):
    """A shard's memory map and, per record, its payload's file position and byte size.

    ``cross[k]`` is true where record ``k``'s bytes are interrupted by a block header: those are
    read with :func:`read_record` (a copy), the others are ``view[pos[k] : pos[k] + size[k]]``.
    """

    view: memoryview
    pos: np.ndarray
    size: np.ndarray
    cross: np.ndarray


def _usable(p: int) -> int:
    """Bytes of chunk data before file position ``p`` (block headers not counted)."""
    return (p // BLOCK) * USABLE + max(p % BLOCK - BLOCK_HEADER, 0)


def _physical(u):
    """File position of usable byte ``u`` (scalar or array): never inside a block header."""
    return (u // USABLE) * BLOCK + BLOCK_HEADER + u % USABLE


def read_record(view: memoryview, pos: int, size: int) -> bytes:
    """``size`` bytes of chunk data from file position ``pos``, skipping the block headers met.

    Example:
        >>> from portable_loader.cache.writer import ShardWriter
        >>> w = ShardWriter("long.array_record", "array_record")
        >>> w.write(np.arange(20000, dtype=np.int32), np.ones(20000, np.uint8))   # 100,000 bytes
        >>> _ = w.close()
        >>> ix = index_shard("long.array_record", rows=1)
        >>> bool(ix.cross[0])    # a block header interrupts the record: no zero-copy view of it
        True
        >>> raw = read_record(ix.view, ix.pos[0], ix.size[0])
        >>> len(raw), np.frombuffer(raw, np.int32, count=20000)[-2:].tolist()
        (100000, [19998, 19999])
    """
    parts, u = [], _usable(pos)
    while size:
        at = _physical(u)
        n = min(size, BLOCK - at % BLOCK)
        parts.append(view[at:at + n])
        u, size = u + n, size - n
    return b"".join(parts)


def _varint_len(n: np.ndarray) -> np.ndarray:
    """Bytes of the LEB128 varint of each (non-negative) ``n``."""
    out = np.ones(n.shape, dtype=np.int64)
    for bits in range(7, 64, 7):
        out += n >= (1 << bits)
    return out


def _varints(data: np.ndarray) -> np.ndarray:
    """Every LEB128 varint in ``data`` (uint8), decoded at once; ValueError if the last one is cut."""
    if not data.size:
        return np.zeros(0, np.uint64)
    ends = np.flatnonzero(data < 0x80)
    if not ends.size or ends[-1] != data.size - 1:
        raise ValueError("a varint runs past its section")
    starts = np.concatenate([[0], ends[:-1] + 1])
    shift = np.arange(data.size) - np.repeat(starts, ends - starts + 1)
    if shift.max() > 9:
        raise ValueError("a varint of more than 10 bytes")
    return np.add.reduceat((data & 0x7F).astype(np.uint64) << (7 * shift).astype(np.uint64), starts)


def _chunk(arr: np.ndarray, begin: int, path: str) -> tuple[int, int, np.ndarray]:
    """(records, record count, data) of the simple uncompressed chunk at file position ``begin``."""
    u = _usable(begin)
    header = arr[_physical(u + np.arange(CHUNK_HEADER))].view("<u8")
    data_size, type_records = int(header[1]), int(header[3])
    if type_records & 0xFF != _SIMPLE or u + CHUNK_HEADER + data_size > _usable(arr.size):
        raise CacheError(f"{path}: no ArrayRecord footer chunk at byte {begin}")
    data = arr[_physical(u + CHUNK_HEADER + np.arange(data_size))]
    if data[0] != 0:
        raise CacheError(f"{path}: its ArrayRecord footer is compressed (chunk at byte {begin})")
    return type_records >> 8, data


def _sections(path: str, begin: int, records: int, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A simple chunk's records' sizes and their bytes, from its (uncompressed) data."""
    head = data[1:11]
    n = int(np.flatnonzero(head < 0x80)[0]) + 1
    sizes_len = int(_varints(head[:n])[0])
    sizes = _varints(data[1 + n : 1 + n + sizes_len]).astype(np.int64)
    values = data[1 + n + sizes_len :]
    if sizes.size != records or sizes.sum() != values.size:
        raise CacheError(f"{path}: the chunk at byte {begin} does not hold the records it says")
    return sizes, values


def _chunk_offsets(arr: np.ndarray, path: str, rows: int) -> np.ndarray:
    """The file positions of the record chunks, from ArrayRecord's footer (found by its postscript,
    the file's last block): one per chunk, decoded all at once."""
    try:
        if arr.size < BLOCK or arr.size % BLOCK:
            raise CacheError(f"{path}: {arr.size} bytes is not a whole number of 64 KiB blocks")
        begin = arr.size - BLOCK
        records, data = _chunk(arr, begin, path)
        sizes, values = _sections(path, begin, records, data)
        post = _varints(values[: sizes[0]])  # RiegeliPostscript: 1: footer_offset, 2: magic
        if post.size != 4 or post[0] != 8 or post[2] != 16 or post[3] != _MAGIC:
            raise CacheError(f"{path}: no ArrayRecord postscript in its last block")
        begin = int(post[1])
        records, data = _chunk(arr, begin, path)
        sizes, values = _sections(path, begin, records, data)
        # Record 0 is the footer's metadata; then one ArrayRecordFooter per chunk: fields 1, 2, 3
        # (offset, decoded size, records), all set, so six varints each.
        fields = _varints(values[sizes[0] :]).reshape(-1, 6)
    except ValueError as e:
        raise CacheError(f"{path}: a malformed ArrayRecord footer: {e}") from None
    if len(fields) != records - 1 or (fields[:, ::2] != np.array([8, 16, 24], np.uint64)).any():
        raise CacheError(f"{path}: a malformed ArrayRecord footer (chunk at byte {begin})")
    if len(fields) != rows or (fields[:, 5] != 1).any():
        raise CacheError(f"{path}: not an uncompressed one-record-per-chunk ArrayRecord shard of {rows} "
                         f"records: its footer lists {len(fields)} chunks of {int(fields[:, 5].sum())} records")
    return fields[:, 1].astype(np.int64)


def index_shard(path: str, rows: int) -> ShardIndex:
    """Memory-map an uncompressed ``group_size:1`` ArrayRecord shard and locate its ``rows`` records.

    The chunks' positions come from the file's footer; their headers are then read all at once and
    checked (a simple chunk of one record, uncompressed, of the size the footer gives).

    Example:
        >>> from portable_loader.cache.writer import ShardWriter
        >>> w = ShardWriter("shard.array_record", "array_record")
        >>> for n in (212, 87, 2048):
        ...     w.write(np.zeros(n, np.int32), np.zeros(n, np.uint8))
        >>> _ = w.close()
        >>> index_shard("shard.array_record", rows=3).size.tolist()   # 5 bytes a token
        [1060, 435, 10240]
        >>> index_shard("shard.array_record", rows=4)
        Traceback (most recent call last):
        portable_loader.errors.CacheError: shard.array_record: not an uncompressed one-record-per-chunk ArrayRecord shard of 4 records: its footer lists 3 chunks of 3 records
    """
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    arr = np.frombuffer(mm, dtype=np.uint8)
    begins = _chunk_offsets(arr, path, rows)
    u_begin = (begins // BLOCK) * USABLE + np.maximum(begins % BLOCK - BLOCK_HEADER, 0)
    # Header bytes 8-40 (data size, data hash, type and records, decoded size) of every chunk.
    header = arr[_physical(u_begin[:, None] + np.arange(8, CHUNK_HEADER))].view("<u8")
    data_sizes, type_records, sizes = (header[:, k].astype(np.int64) for k in (0, 2, 3))

    def bad(what: str, k: int):
        return CacheError(f"{path}: not an uncompressed one-record-per-chunk ArrayRecord shard: "
                          f"{what} (chunk at byte {int(begins[k])})")

    if (type_records != _ONE_SIMPLE).any():
        k = int(np.flatnonzero(type_records != _ONE_SIMPLE)[0])
        kind, records = int(type_records[k]) & 0xFF, int(type_records[k]) >> 8
        raise bad(f"chunk type {chr(kind)!r}" if kind != _SIMPLE else f"a chunk of {records} records", k)
    compression = arr[_physical(u_begin + CHUNK_HEADER)] if rows else np.zeros(0, np.uint8)
    if compression.any():
        raise bad("a compressed chunk", int(np.flatnonzero(compression)[0]))
    # Each data: compression type 0, varint(len(sizes)), sizes = varint(record size), the record.
    sizes_len = _varint_len(sizes)
    if not np.array_equal(data_sizes, 1 + _varint_len(sizes_len) + sizes_len + sizes):
        k = int(np.flatnonzero(data_sizes != 1 + _varint_len(sizes_len) + sizes_len + sizes)[0])
        raise bad("a chunk's data size does not match one uncompressed record", k)
    u_payload = u_begin + CHUNK_HEADER + data_sizes - sizes
    cross = u_payload % USABLE + sizes > USABLE
    return ShardIndex(memoryview(mm), _physical(u_payload), sizes, cross)
