"""Where each record of an uncompressed, one-record-per-chunk ArrayRecord shard lies in the file.

An ArrayRecord file is a riegeli file: 64 KiB blocks, each opening with a 24-byte block header,
and chunks laid over them (a chunk's bytes skip the block headers they meet). A chunk is a 40-byte
header (header hash, data size, data hash, chunk type byte + 7-byte record count, decoded size),
then its data. The shards portable_loader writes (``group_size:1,uncompressed``) hold one record
per simple chunk (type ``r``) with compression type 0, whose data is ``0``, the varint size of the
sizes, the record's varint size, then the record's bytes: so a record's bytes are the last
``decoded size`` bytes of its chunk, and can be served straight from a memory map of the file.

:func:`index_shard` hops the chunk headers once (one ``struct`` read per record) and returns each
record's payload position; anything it does not expect (another chunk type, a compressed chunk,
chunks of more records, a file that ends early) is a :class:`CacheError` naming the file.

Example:
    >>> ix = index_shard("cache/data-00000-of-00001.array_record", rows=999)  # doctest: +SKIP
    >>> bytes(ix.view[ix.pos[0]:ix.pos[0] + ix.size[0]]) == reader.read(0, 1)[0]  # doctest: +SKIP
    True
"""

from __future__ import annotations

import mmap
import struct
from typing import NamedTuple

import numpy as np

from portable_loader.errors import CacheError

BLOCK = 1 << 16
BLOCK_HEADER = 24
USABLE = BLOCK - BLOCK_HEADER
CHUNK_HEADER = 40
_SKIPPED = {ord("s"), ord("m"), ord("p")}  # file signature, file metadata, padding: no records
_SIMPLE = ord("r")
_ONE_SIMPLE = _SIMPLE | 1 << 8  # a simple chunk of one record
_HEADER = struct.Struct("<8xQ8xQQ")  # data size, chunk type | records << 8, decoded size


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
        >>> read_record(ix.view, ix.pos[7], ix.size[7]) == reader.read(7, 8)[0]  # doctest: +SKIP
        True
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


def index_shard(path: str, rows: int) -> ShardIndex:
    """Memory-map an uncompressed ``group_size:1`` ArrayRecord shard and locate its ``rows`` records.

    Example:
        >>> index_shard(shard_path, rows=999).size[:3].tolist()   # doctest: +SKIP
        [1060, 435, 10240]
    """
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mm)
    end = _usable(len(mm))
    begins, data_sizes, sizes = [], [], []  # chunk data offsets (block headers not counted)
    unpack, u = _HEADER.unpack_from, 0

    def bad(what: str, at: int):
        return CacheError(f"{path}: not an uncompressed one-record-per-chunk ArrayRecord shard: "
                          f"{what} (chunk at byte {_physical(at)})")

    while len(begins) < rows:
        if u + CHUNK_HEADER > end:
            raise bad(f"the file ends after {len(begins)} of {rows} records", u)
        block, at = divmod(u, USABLE)
        if at + CHUNK_HEADER <= USABLE:
            data_size, type_records, decoded = unpack(view, block * BLOCK + BLOCK_HEADER + at)
        else:  # the header meets a block header
            data_size, type_records, decoded = unpack(read_record(view, _physical(u), CHUNK_HEADER))
        if type_records == _ONE_SIMPLE:
            begins.append(u)
            data_sizes.append(data_size)
            sizes.append(decoded)
        elif type_records & 0xFF == _SIMPLE:
            raise bad(f"a chunk of {type_records >> 8} records, after {len(begins)} of {rows} records", u)
        elif type_records & 0xFF not in _SKIPPED:
            raise bad(f"chunk type {chr(type_records & 0xFF)!r}", u)
        # riegeli's ChunkEnd: the header and data, plus the block headers they cross (a chunk of
        # one record always ends past the next possible chunk boundary, so its max() is moot).
        u += CHUNK_HEADER + data_size
        if u > end:
            raise bad("a chunk runs past the end of the file", u - CHUNK_HEADER - data_size)
    u_begin, data_sizes, sizes = (np.asarray(x, dtype=np.int64) for x in (begins, data_sizes, sizes))
    arr = np.frombuffer(mm, dtype=np.uint8)
    compression = arr[_physical(u_begin + CHUNK_HEADER)] if rows else np.zeros(0, np.uint8)
    if compression.any():
        raise bad("a compressed chunk", int(u_begin[int(np.flatnonzero(compression)[0])]))
    # Each data: compression type 0, varint(len(sizes)), sizes = varint(record size), the record.
    sizes_len = _varint_len(sizes)
    if not np.array_equal(data_sizes, 1 + _varint_len(sizes_len) + sizes_len + sizes):
        k = int(np.flatnonzero(data_sizes != 1 + _varint_len(sizes_len) + sizes_len + sizes)[0])
        raise bad("a chunk's data size does not match one uncompressed record", int(u_begin[k]))
    u_payload = u_begin + CHUNK_HEADER + data_sizes - sizes
    cross = u_payload % USABLE + sizes > USABLE
    return ShardIndex(view, _physical(u_payload), sizes, cross)
