"""Grain's ``TFRecordIterDataset``: the records of one TFRecord file in file order, each checksum checked.

A TFRecord file is a sequence of records, each ``length`` (uint64, little-endian), the masked
CRC-32C of those 8 bytes (uint32), ``length`` bytes of data and the masked CRC-32C of the data.
Grain 0.2.18 reads both checksums and checks neither; here both are checked, so a damaged file
is an :class:`~portable_loader.errors.InputError` (a ``ValueError``, as Grain's truncation errors)
naming the file and the record's byte offset, never wrong bytes handed on. A record cut short is
the same error. The elements are the records' bytes, as in Grain.

The state of ``iter(ds)`` is Grain's: ``{"reader_offset": n}``, the byte offset of the next record.
Inside one of our pipelines (``ds.map(f).batch(b)``) the offset is the field
``<n>.tfrecord.reader_offset`` of the pipeline's position state. An offset past the end of the file is
refused with a :class:`~portable_loader.errors.StateError`; one that is not at a record's start
fails the next read's length checksum, which names the offset.

Subclassing works as in Grain (MaxText subclasses it at import and overrides ``__iter__``, reading
``self._path``); inside a pipeline such a subclass's iterator runs as written, as a user's step does
(:mod:`portable_loader.dataset.iter.opaque`): its state, whatever it holds, nests under ``steps``.

Example:
    >>> import os, struct, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "a.tfrecord")
    >>> write_tfrecord(path, [b"one", b"two", b"three"])
    >>> it = iter(TFRecordIterDataset(path))
    >>> next(it), it.get_state()
    (b'one', {'reader_offset': 19})
    >>> list(it)
    [b'two', b'three']
    >>> [len(b) for b in TFRecordIterDataset(path).map(len).batch(2)]
    [2, 1]
"""

from __future__ import annotations

import os
import struct
from typing import Sequence

from portable_loader.dataset.iter.dataset import IterDataset
from portable_loader.errors import InputError, StateError
from portable_loader.grain.experimental_ops.crc32c import masked_crc32c
from portable_loader.grain.experimental_ops.parts import GrainStyleIterator, iterator_part

__all__ = ["TFRecordIterDataset", "write_tfrecord"]

_HEADER = struct.Struct("<QI")  # length, masked CRC of the length
_FOOTER = struct.Struct("<I")  # masked CRC of the data


class _TFRecordReader:
    """Reads records from an open TFRecord file, checking both checksums (Grain's reader has the same shape)."""

    def __init__(self, path: str):
        self._path = os.fspath(path)
        self._reader = open(self._path, "rb")

    def _damaged(self, offset: int, what: str) -> InputError:
        return InputError(f"{self._path}: the TFRecord record at byte offset {offset} is damaged: {what}")

    def __next__(self) -> bytes:
        offset = self._reader.tell()
        head = self._reader.read(_HEADER.size)
        if not head:
            raise StopIteration
        if len(head) != _HEADER.size:
            raise self._damaged(offset, f"the file ends {len(head)} bytes into the 12-byte header")
        length, length_crc = _HEADER.unpack(head)
        if masked_crc32c(head[:8]) != length_crc:
            raise self._damaged(offset, "the length's checksum does not match (a damaged file, or an offset "
                                        "that is not a record's start)")
        body = self._reader.read(length + _FOOTER.size)
        if len(body) != length + _FOOTER.size:
            raise self._damaged(offset, f"the file ends {len(body)} bytes into a record of {length} bytes")
        data = body[:length]
        if masked_crc32c(data) != _FOOTER.unpack(body[length:])[0]:
            raise self._damaged(offset, "the data's checksum does not match")
        return data

    def seek(self, offset: int) -> None:
        self._reader.seek(offset)

    def tell(self) -> int:
        return self._reader.tell()

    def close(self) -> None:
        self._reader.close()


class _TFRecordDatasetIterator(GrainStyleIterator):
    """The iterator of :class:`TFRecordIterDataset`: the next record, and Grain's state ``{"reader_offset": n}``."""

    def __init__(self, path: str):
        super().__init__()
        self._reader = _TFRecordReader(path)

    def __next__(self) -> bytes:
        if self._closed:
            raise ValueError("this DatasetIterator is closed")
        return next(self._reader)

    def get_state(self) -> dict:
        return {"reader_offset": self._reader.tell()}

    def set_state(self, state) -> None:
        offset = state.get("reader_offset") if isinstance(state, dict) else None
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise StateError("reader_offset", f"expected {{'reader_offset': <int>}}, got {state!r}")
        size = os.fstat(self._reader._reader.fileno()).st_size
        if not 0 <= offset <= size:
            raise StateError("reader_offset", f"{offset} is not in [0, {size}], the size of {self._reader._path}")
        self._reader.seek(offset)

    def close(self) -> None:
        if not getattr(self, "_closed", True):
            self._reader.close()
        super().close()


class TFRecordIterDataset(IterDataset):
    """Grain's ``TFRecordIterDataset(path)``: the records (bytes) of the TFRecord file ``path``, checksums checked.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "b.tfrecord")
        >>> write_tfrecord(path, [b"x" * 3])
        >>> with open(path, "r+b") as f:
        ...     _ = f.seek(13); _ = f.write(b"y")
        >>> list(TFRecordIterDataset(path))
        Traceback (most recent call last):
        ...
        portable_loader.errors.InputError: ...b.tfrecord: the TFRecord record at byte offset 0 is damaged: the data's checksum does not match
    """

    def __init__(self, path: str):
        super().__init__()
        self._path = path

    def __iter__(self) -> GrainStyleIterator:
        return _TFRecordDatasetIterator(self._path)

    def _identity(self) -> tuple:
        path = os.fspath(self._path)
        return ("tfrecord", type(self).__qualname__, path, os.path.getsize(path) if os.path.exists(path) else None)

    def _make_part(self, children: list, n: int):
        return iterator_part(f"{n}.tfrecord", self.__iter__())  # a subclass's own iterator, where it has one

    def __str__(self) -> str:
        return f"TFRecordIterDataset(path={self._path!r})"


def write_tfrecord(path: str, records: Sequence[bytes]) -> None:
    """Write ``records`` as a TFRecord file at ``path`` (what TensorFlow's ``TFRecordWriter`` writes).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "c.tfrecord")
        >>> write_tfrecord(path, [b"", b"ab"])
        >>> os.path.getsize(path), list(TFRecordIterDataset(path))
        (34, [b'', b'ab'])
    """
    with open(path, "wb") as f:
        for data in records:
            length = struct.pack("<Q", len(data))
            f.write(length + _FOOTER.pack(masked_crc32c(length)) + bytes(data) + _FOOTER.pack(masked_crc32c(data)))
