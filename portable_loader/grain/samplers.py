"""Grain's samplers: ``IndexSampler`` and ``SequentialSampler``, computed, never stored.

A sampler names the record at each position of one global stream: ``sampler[i].record_key``.
Unshuffled, the order is Grain's exactly (``i % num_records`` epoch after epoch). Shuffled, it is
Grain's too: epoch ``e`` is Grain's ``index_shuffle`` permutation keyed by ``(seed + e) % 2**32``
(:mod:`portable_loader.orders.index_shuffle`; Grain's ``IndexSampler`` shuffles a ``range`` with
``MapDataset.shuffle``), in O(1) memory, so an unsharded run reads Grain's records in Grain's
order. Sharding is not the
sampler's business here: ``DataLoader`` hands shard ``k`` of ``K`` the positions ``k, k + K, ...``
of the global stream (:mod:`portable_loader.grain.sharding`); the shard options given to a sampler
are passed on to the ``DataLoader`` that has none of its own.

``RecordMetadata.rng`` is Grain's: ``Generator(Philox(key=seed + index))`` when a seed is given.

Example:
    >>> from portable_loader.grain import samplers
    >>> [samplers.IndexSampler(4, num_epochs=2)[i].record_key for i in range(8)]
    [0, 1, 2, 3, 0, 1, 2, 3]
    >>> s = samplers.IndexSampler(1000, shuffle=True, num_epochs=1, seed=7)
    >>> sorted(s[i].record_key for i in range(1000)) == list(range(1000))
    True
"""

from __future__ import annotations

import sys
from typing import Optional, Protocol

import numpy as np

from portable_loader.orders.index_shuffle import ORDER, EpochShuffle
from portable_loader.errors import PositionOutOfRange
from portable_loader.grain import sharding
from portable_loader.grain.records import RecordMetadata
from portable_loader.orders.sampler import LCGSampler

__all__ = ["IndexSampler", "Sampler", "SequentialSampler", "stream_order"]


class Sampler(Protocol):
    """What a ``DataLoader`` reads a sampler through: ``sampler[index]`` is a ``RecordMetadata`` (``IndexError`` past the end).

    ``__len__`` is optional; ``__repr__`` names the sampler in a state's fingerprint.

    Example:
        >>> class Reversed:
        ...     def __len__(self):
        ...         return 3
        ...     def __getitem__(self, i):
        ...         return RecordMetadata(index=i, record_key=2 - i)
        ...     def __repr__(self):
        ...         return "Reversed(3)"
        >>> from portable_loader.grain import DataLoader, sharding
        >>> list(DataLoader(data_source=["a", "b", "c"], sampler=Reversed(), shard_options=sharding.NoSharding()))
        ['c', 'b', 'a']
    """

    def __getitem__(self, index: int) -> RecordMetadata:
        """The metadata of position ``index``."""


def _grain_rng(seed: Optional[int], index: int) -> Optional[np.random.Generator]:
    return None if seed is None else np.random.Generator(np.random.Philox(key=seed + index))


def _check_num_records(num_records) -> int:
    if num_records <= 0:
        raise ValueError(f"Invalid number of records in Sampler. Got {num_records} records, but number of records "
                         "must be greater than 0.")
    return int(num_records)


class IndexSampler:
    """Grain's ``IndexSampler``: ``num_epochs`` epochs (None: endless) of ``num_records`` records, shuffled or not.

    Without ``shuffle`` position ``i`` reads record ``i % num_records``, as in Grain. With it, epoch
    ``e`` is Grain's permutation keyed by ``(seed + e) % 2**32``: the record keys of Grain's unsharded
    ``IndexSampler``, position for position. ``seed`` (a 32-bit integer, as Grain checks) keys the
    shuffle and each record's ``rng``. ``shard_options`` only tells a ``DataLoader`` without shard
    options how to shard.

    Example:
        >>> s = IndexSampler(10, shuffle=True, num_epochs=2, seed=3)
        >>> len(s), s[12].index, sorted(s[i].record_key for i in range(10, 20)) == list(range(10))
        (20, 12, True)
        >>> import grain   # real Grain 0.2.18 gives the same keys
        >>> g = grain.samplers.IndexSampler(10, shuffle=True, num_epochs=2, seed=3)
        >>> [g[i].record_key for i in range(20)] == s.record_keys(range(20)).tolist()
        True
        >>> IndexSampler(10, shuffle=True)
        Traceback (most recent call last):
        ...
        ValueError: Shuffling requires specifying a seed.
    """

    def __init__(self, num_records: int, shard_options: sharding.ShardOptions | None = sharding.NoSharding(),
                 shuffle: bool = False, num_epochs: Optional[int] = None, seed: Optional[int] = None):
        num_records = _check_num_records(num_records)
        if num_epochs is not None and num_epochs <= 0:
            raise ValueError(f"Invalid number of epochs in Index Sampler.Got {num_epochs} epochs, but number of "
                             "epochs must be greater than 0.")
        if shuffle and seed is None:
            raise ValueError("Shuffling requires specifying a seed.")
        if shuffle and not isinstance(seed, int):
            raise TypeError(f"Expected seed of int type. Got seed with type {type(seed)}")
        if seed is not None and (seed < 0 or int(seed).bit_length() > 32):
            raise ValueError("Seed should be positive 32-bit integer.")
        self._num_records, self._shuffle, self._num_epochs, self._seed = num_records, bool(shuffle), num_epochs, seed
        self._shard_options = sharding.NoSharding() if shard_options is None else shard_options
        self._order = EpochShuffle(num_records, int(seed)) if self._shuffle else None

    def __len__(self) -> int:
        if self._num_epochs is None:
            return sys.maxsize
        total = self._num_epochs * self._num_records
        _, count, drop = sharding.shard_of(self._shard_options)
        return total - total % count if drop else total

    def record_keys(self, positions) -> np.ndarray:
        """The record read at each position (vectorized; int64).

        Example:
            >>> IndexSampler(3, num_epochs=None).record_keys([0, 4, 8]).tolist()
            [0, 1, 2]
        """
        idx = np.asarray(positions, dtype=np.int64)
        end = sys.maxsize if self._num_epochs is None else self._num_epochs * self._num_records
        if idx.size and (idx.min() < 0 or idx.max() >= end):
            bad = idx[(idx < 0) | (idx >= end)][0]
            raise PositionOutOfRange(f"index must be in [0, {end}) for this sampler's stream, got {int(bad)}")
        if self._order is None:
            return idx % self._num_records
        return self._order(idx) % self._num_records

    def __getitem__(self, index: int) -> RecordMetadata:
        if index < 0 or index >= len(self):
            raise IndexError(f"RecordMetadata object index is out of bounds; Got index {index}, allowed indices "
                             f"should be in [0, {len(self)}]")
        return RecordMetadata(index=index, record_key=int(self.record_keys([index])[0]),
                              rng=_grain_rng(self._seed, index))

    def __repr__(self) -> str:
        return (f"IndexSampler(num_records={self._num_records}, shard_options={self._shard_options!r}, "
                f"shuffle={self._shuffle}, num_epochs={self._num_epochs}, seed={self._seed})")


class SequentialSampler:
    """Grain's ``SequentialSampler``: records ``0 .. num_records - 1`` once, in order.

    Example:
        >>> s = SequentialSampler(3, seed=1)
        >>> [s[i].record_key for i in range(3)], s[0].rng is not None
        ([0, 1, 2], True)
    """

    def __init__(self, num_records: int, shard_options: sharding.ShardOptions | None = sharding.NoSharding(),
                 seed: Optional[int] = None):
        self._num_records = _check_num_records(num_records)
        self._shard_options = sharding.NoSharding() if shard_options is None else shard_options
        self._seed = seed

    def __len__(self) -> int:
        _, count, drop = sharding.shard_of(self._shard_options)
        return self._num_records - self._num_records % count if drop else self._num_records

    def __getitem__(self, index: int) -> RecordMetadata:
        if index < 0 or index >= len(self):
            raise IndexError(f"RecordMetadata object index is out of bounds; Got index {index}, allowed indices "
                             f"should be in [0, {len(self)}]")
        return RecordMetadata(index=index, record_key=index, rng=_grain_rng(self._seed, index))

    def __repr__(self) -> str:
        return f"SequentialSampler(num_records={self._num_records}, shard_options={self._shard_options!r})"


class _Order:
    """A sampler as the ``DataLoader`` reads it: record keys of positions, its length, its rng seed, its identity."""

    def __init__(self, total: int, identity: tuple, seed: Optional[int], keys, metadata=None, shard_options=None):
        self.total, self.identity, self.seed, self.keys = total, identity, seed, keys
        # position -> RecordMetadata, for a sampler known only through __getitem__ (then keys is None)
        self.metadata = metadata
        self.shard_options = shard_options


def _length_of(sampler) -> int:
    if hasattr(sampler, "__len__"):
        return len(sampler)
    lo, hi = 0, sys.maxsize  # Grain's rule for a sampler without a length: the first index that raises
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            sampler[mid]
            lo = mid + 1
        except IndexError:
            hi = mid
    return lo


def stream_order(sampler) -> _Order:
    """How a ``DataLoader`` reads ``sampler``: this module's samplers, real Grain's (rebuilt here from
    their settings, so that they shard by position too), a :class:`portable_loader.LCGSampler`, or any
    object whose ``[index]`` is a ``RecordMetadata``.

    Example:
        >>> o = stream_order(IndexSampler(5, num_epochs=1))
        >>> o.total, o.keys(np.arange(5)).tolist()
        (5, [0, 1, 2, 3, 4])
    """
    cls = type(sampler)
    if cls.__module__.startswith("grain.") and cls.__name__ in ("IndexSampler", "SequentialSampler"):
        if cls.__name__ == "IndexSampler":
            sampler = IndexSampler(sampler._num_records, sampler._shard_options, sampler._shuffle,
                                   sampler._num_epochs, sampler._seed)
        else:
            sampler = SequentialSampler(sampler._num_records, sampler._shard_options, sampler._seed)
    if isinstance(sampler, IndexSampler):
        s = sampler
        identity = ("IndexSampler", s._num_records, s._shuffle, s._num_epochs, s._seed)
        if s._shuffle:  # ORDER names the shuffled order: a state saved when it was another one is refused
            identity += (ORDER,)
        return _Order(len(s), identity, s._seed, s.record_keys, shard_options=s._shard_options)
    if isinstance(sampler, SequentialSampler):
        s = sampler
        return _Order(len(s), ("SequentialSampler", s._num_records, s._seed), s._seed,
                      lambda pos: np.asarray(pos, dtype=np.int64), shard_options=s._shard_options)
    if isinstance(sampler, LCGSampler):
        if sampler.shard_count != 1:
            raise ValueError("an LCGSampler given to DataLoader must be unsharded (shard_count=1): the DataLoader "
                             "shards by position itself (pass shard_options)")
        identity = ("LCGSampler", sampler.num_records, sampler.seed, sampler.shuffle, sampler.num_epochs)
        return _Order(len(sampler), identity, None, sampler.stream_indices, shard_options=sharding.NoSharding())
    if not callable(getattr(sampler, "__getitem__", None)):
        raise TypeError(f"sampler must have __getitem__(index) returning a RecordMetadata, got {cls.__name__}")
    own = getattr(sampler, "_shard_options", None)

    return _Order(_length_of(sampler), ("sampler", f"{cls.__module__}.{cls.__qualname__}", repr(sampler)), None,
                  None, metadata=sampler.__getitem__, shard_options=own if hasattr(own, "shard_count") else None)
