"""LCG index sampler: a keyed permutation of ``range(N)`` per epoch in O(1) memory.

Epoch ``e`` of a sampler with ``seed`` is :class:`~portable_loader.orders.keyed.KeyedPermutation` ``(N, seed, e)``:
a bijection ``position -> record index`` computed, never stored (:mod:`portable_loader.orders.keyed` has the
arithmetic: a mixed LCG over the next power of two, with cycle walking). Shard ``k`` of ``K`` takes
positions ``k, k + K, ...`` of each epoch's one global order, so hosts split one order between them.
The same ``(seed, epoch)`` gives the same order on every machine.

Example:
    >>> from portable_loader.orders.keyed import KeyedPermutation
    >>> s = LCGSampler(10, seed=4, shard_index=1, shard_count=2)
    >>> s.stream_indices([0, 1]).tolist() == [KeyedPermutation(10, 4, 0).one(p) for p in (1, 3)]
    True
"""

from __future__ import annotations

import sys
from typing import Iterable

import numpy as np

from portable_loader.errors import PositionOutOfRange
from portable_loader.orders.keyed import (FEW, MASK64, KeyedPermutation, as_int64, check_int, epoch_position, keep,
                                   shard_epoch_length)

__all__ = ["LCGSampler"]

_KEPT_EPOCHS = 4  # permutations a sampler keeps: a step may straddle epochs, describe may go back and forth


class LCGSampler:
    """Shuffled, sharded, repeatable record order without materializing a permutation.

    Each epoch is a fresh pseudo-random permutation of ``range(num_records)``; shard ``k`` of ``K``
    takes global positions ``k, k + K, k + 2K, ...`` of every epoch, so the shards of one epoch are
    disjoint and together cover each record exactly once. Memory is O(1) in ``num_records``.

    It implements Grain's ``Sampler`` protocol (``__getitem__`` returning ``grain.RecordMetadata``).

    Example:
        >>> s = LCGSampler(num_records=10, seed=0)
        >>> sorted(s.record_indices(range(10), epoch=0).tolist()) == list(range(10))
        True
        >>> s[3].record_key == int(s.record_indices([3], epoch=0)[0])
        True
        >>> int(LCGSampler(10**12, seed=1).record_indices([10**12 - 1])[0]) < 10**12
        True
    """

    whole_epochs = True  # each epoch is one permutation of every record (dataset.protocols.StreamOrder)
    online = ()  # no stages set while running: only a mixture's order has them

    def __init__(
        self,
        num_records: int,
        seed: int | None = None,
        *,
        shuffle: bool = True,
        num_epochs: int | None = None,
        shard_index: int = 0,
        shard_count: int = 1,
    ):
        self.num_records = check_int("num_records", num_records, minimum=1, maximum=1 << 63)
        if seed is None:
            raise ValueError("seed is required (an integer in [0, 2**64)), got None")
        self.seed = check_int("seed", seed, minimum=0, maximum=MASK64)
        self.shuffle = bool(shuffle)
        self.num_epochs = None if num_epochs is None else check_int("num_epochs", num_epochs, 1)
        self.shard_count = check_int("shard_count", shard_count, minimum=1)
        self.shard_index = check_int("shard_index", shard_index, 0, self.shard_count - 1)
        self.shard_epoch_length = shard_epoch_length(self.num_records, self.shard_index, self.shard_count)
        self._perms: dict[int, KeyedPermutation] = {}

    def _permutation(self, epoch: int) -> KeyedPermutation:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = keep(self._perms, epoch, KeyedPermutation(self.num_records, self.seed, epoch), _KEPT_EPOCHS)
        return perm

    def record_indices(self, positions: Iterable[int] | np.ndarray, epoch: int = 0) -> np.ndarray:
        """Record index at each global position of ``epoch`` (vectorized; int64 out).

        Positions are in the whole epoch's order, before sharding: ``[0, num_records)``.
        """
        epoch = check_int("epoch", epoch)
        if self.num_epochs is not None and epoch >= self.num_epochs:
            raise ValueError(f"epoch must be < num_epochs={self.num_epochs}, got {epoch}")
        pos = as_int64("positions", positions)
        if pos.size and (pos.min() < 0 or pos.max() >= self.num_records):
            bad = pos[(pos < 0) | (pos >= self.num_records)][0]
            raise ValueError(f"positions must be in [0, {self.num_records}), got {int(bad)}")
        if not self.shuffle:
            return pos.copy()
        return self._permutation(epoch)(pos.view(np.uint64))

    def stream_indices(self, indices: Iterable[int] | np.ndarray) -> np.ndarray:
        """Record index at each position of this shard's stream (epochs concatenated; int64 out)."""
        idx = as_int64("index", indices)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            bad = idx[(idx < 0) | (idx >= len(self))][0]
            raise PositionOutOfRange(
                f"index must be in [0, {len(self)}) for this sampler's stream, got {int(bad)}"
            )
        if idx.size <= FEW:  # a few positions: Python integers, no numpy calls per epoch
            return np.array(self.few(idx.reshape(-1).tolist()), dtype=np.int64).reshape(idx.shape)
        epochs, global_pos = epoch_position(idx, self.shard_epoch_length, self.shard_index, self.shard_count)
        out = np.empty_like(idx)
        for epoch in np.unique(epochs).tolist():
            sel = epochs == epoch
            out[sel] = self.record_indices(global_pos[sel], epoch=epoch)
        return out

    def few(self, positions: list[int]) -> list[int]:
        """``stream_indices`` of a few positions already checked to be in range, as Python integers."""
        per, k, count = self.shard_epoch_length, self.shard_index, self.shard_count
        out, perm, last = [], None, -1
        for i in positions:
            epoch, within = divmod(i, per)  # epoch_position, inlined: a call per position costs 6% here
            g = within * count + k
            if not self.shuffle:
                out.append(g)
                continue
            if epoch != last:  # a few positions seldom straddle epochs
                perm, last = self._permutation(epoch), epoch
            out.append(perm.one(g))
        return out

    def __len__(self) -> int:
        if self.num_epochs is None:
            return sys.maxsize
        return self.num_epochs * self.shard_epoch_length

    @property
    def _shard_options(self):
        # grain.DataLoader reads this to decide how to shard; this sampler's stream is already one
        # shard's, so Grain must not shard it again.
        from grain.python import NoSharding

        return NoSharding()

    def __getitem__(self, index: int):
        from grain.python import RecordMetadata

        index = check_int("index", index, minimum=-sys.maxsize)
        record_key = int(self.stream_indices([index])[0])
        return RecordMetadata(index=index, record_key=record_key)

    def __repr__(self) -> str:
        return (
            f"LCGSampler(num_records={self.num_records}, seed={self.seed}, shuffle={self.shuffle}, "
            f"num_epochs={self.num_epochs}, shard_index={self.shard_index}, "
            f"shard_count={self.shard_count})"
        )

