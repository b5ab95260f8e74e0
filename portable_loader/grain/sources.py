"""``grain.sources``: ``RangeDataSource`` and the ``RandomAccessDataSource`` protocol here; Grain's file sources from Grain.

``ArrayRecordDataSource`` and ``SharedMemoryDataSource`` are real Grain's classes, imported on
first use (Grain imports JAX, which ``import portable_loader.grain`` must not): they are data
sources like any other, and both pickle into worker processes.

Example:
    >>> from portable_loader.grain import DataLoader, samplers, sources
    >>> src = sources.RangeDataSource(start=0, stop=10, step=3)
    >>> list(DataLoader(data_source=src, sampler=samplers.IndexSampler(len(src), num_epochs=1)))
    [0, 3, 6, 9]
"""

from __future__ import annotations

import math
from typing import Protocol, SupportsIndex, TypeVar

from portable_loader.grain._unsupported import forward

__all__ = ["ArrayRecordDataSource", "RandomAccessDataSource", "RangeDataSource", "SharedMemoryDataSource"]

T = TypeVar("T")
_FROM_GRAIN = ("ArrayRecordDataSource", "SharedMemoryDataSource")


def __getattr__(name: str):
    if name in _FROM_GRAIN:
        return forward("grain.sources", name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class RandomAccessDataSource(Protocol[T]):
    """What a data source offers: ``__len__`` and ``__getitem__(record_key)``; ``__repr__`` and picklability help.

    Any such object works; subclassing is not needed.

    Example:
        >>> class Squares:
        ...     def __len__(self):
        ...         return 4
        ...     def __getitem__(self, i):
        ...         return i * i
        >>> from portable_loader.grain import MapDataset
        >>> list(MapDataset.source(Squares()))
        [0, 1, 4, 9]
    """

    def __len__(self) -> int:
        """The number of records."""

    def __getitem__(self, record_key: SupportsIndex) -> T:
        """The record at ``record_key``."""


class RangeDataSource:
    """Grain's ``RangeDataSource``: record ``i`` is ``start + i * step``, as Python's ``range``.

    Example:
        >>> s = RangeDataSource(2, 11, 4)
        >>> len(s), s[2], s
        (3, 10, RangeDataSource(start=2, stop=11, step=4))
    """

    def __init__(self, start: int, stop: int, step: int):
        if step == 0:
            raise ValueError("step can't be zero.")
        self._start, self._stop, self._step = start, stop, step
        self._len = int(math.ceil((stop - start) / step))
        if self._len < 0:
            raise ValueError("length can't be negative.")

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, record_key: SupportsIndex) -> int:
        record_key = record_key.__index__()
        if record_key < 0 or record_key >= self._len:
            raise IndexError(f"Index {record_key} out of range for {self._len}")
        return self._start + record_key * self._step

    def __repr__(self) -> str:
        return f"RangeDataSource(start={self._start}, stop={self._stop}, step={self._step})"
