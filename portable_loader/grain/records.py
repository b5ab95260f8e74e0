"""``Record`` and ``RecordMetadata``: what a Grain sampler returns and a Grain ``DataLoader`` carries.

A sampler's ``__getitem__(index)`` returns a ``RecordMetadata`` naming the record to read
(``record_key``) and, where the sampler has a seed, the generator a ``RandomMap`` draws from.

Example:
    >>> from portable_loader.grain import samplers
    >>> samplers.SequentialSampler(5)[3]
    RecordMetadata(index=3, record_key=3, rng=None)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, Optional, TypeVar

import numpy as np

__all__ = ["Record", "RecordMetadata"]

T = TypeVar("T")


@dataclasses.dataclass(slots=True)
class RecordMetadata:
    """Position ``index`` in a sampler's stream, the ``record_key`` it reads there, and a generator ``rng``.

    Example:
        >>> m = RecordMetadata(index=4, record_key=9)
        >>> m.remove_record_key()
        RecordMetadata(index=4, record_key=None, rng=None)
    """

    index: int
    record_key: Optional[int] = None
    rng: Optional[np.random.Generator] = None

    def remove_record_key(self) -> "RecordMetadata":
        """This metadata without its ``record_key`` (what a batch of records keeps, as in Grain).

        Example:
            >>> RecordMetadata(0).remove_record_key()
            RecordMetadata(index=0, record_key=None, rng=None)
        """
        return self if self.record_key is None else dataclasses.replace(self, record_key=None)


@dataclasses.dataclass(slots=True)
class Record(Generic[T]):
    """A record's ``data`` with its ``metadata``.

    Example:
        >>> Record(RecordMetadata(0, 0), data="x").data
        'x'
    """

    metadata: RecordMetadata
    data: Any
