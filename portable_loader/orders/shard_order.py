"""``shuffle="shards"``: a record order that reads a sharded source a few shards at a time.

A global shuffle reads every shard in every stretch of the stream, so a bounded local cache of a
remote source downloads each shard many times per epoch. This order keeps locality instead, with
the same guarantees as the global one (O(1) state: the stream position; exact resume; independent
of workers and hosts). Epoch ``e``:

1. the shards are permuted (a keyed bijection of ``[0, S)`` from ``(seed, e)``);
2. the permuted list is cut into groups of ``K = shuffle_shards`` consecutive shards;
3. the stream serves group after group; within a group, its records (those of its ``K`` shards)
   come in a keyed permutation from ``(seed, e, group)``.

Position ``p`` -> epoch ``p // N`` -> group (a search over the epoch's group starts) -> a permuted
position in the group -> shard and row. The epoch's layout (O(S) integers) is computed once per
epoch and nothing per record is ever stored. Each epoch visits every record exactly once, and a
stretch of the stream inside one group reads only ``K`` shards, so a cache of about ``K + 1`` shards
downloads each shard about once per epoch.

Example:
    >>> order = ShardShuffle([3, 3, 3, 3], group=2, seed=0, num_epochs=1)
    >>> epoch = order.stream_indices(range(12)).tolist()
    >>> sorted(epoch) == list(range(12))
    True
    >>> [len({i // 3 for i in epoch[g * 6:(g + 1) * 6]}) for g in range(2)]   # 2 shards per group
    [2, 2]
"""

from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

from portable_loader.errors import PositionOutOfRange
from portable_loader.orders.keyed import MASK64, KeyedPermutation, as_int64, check_int, epoch_position, subkey

__all__ = ["ShardShuffle"]

_SHARD_SALT = 0x5_4A2D_0F_5EED
_GROUP_SALT = 0x6_1200_9F_5EED


class ShardShuffle:
    """Stream position -> record index, shuffling ``group`` shards' records together (module docstring).

    ``shard_rows``: records per shard, in the source's order (a cache's manifest order). It is a
    :class:`portable_loader.dataset.protocols.StreamOrder`.

    Example:
        >>> ShardShuffle([2, 2], group=1, seed=3).stream_indices([0, 1, 2, 3]).tolist()
        [3, 2, 0, 1]
    """

    shuffle = True
    whole_epochs = True  # each epoch is one permutation of every record (dataset.protocols.StreamOrder)
    online = ()  # no stages set while running: only a mixture's order has them

    def __init__(self, shard_rows: Sequence[int], group: int, seed: int, *, num_epochs: int | None = None):
        rows = np.asarray(shard_rows, dtype=np.int64)
        if rows.ndim != 1 or not rows.size or (rows < 0).any() or not rows.sum():
            raise ValueError(f"shard_rows must be a non-empty list of record counts with records in it, got {list(shard_rows)[:8]}")
        self.group = check_int("shuffle_shards", group, minimum=1)
        self.seed = check_int("seed", seed, minimum=0, maximum=MASK64)
        self.num_epochs = None if num_epochs is None else check_int("num_epochs", num_epochs, 1)
        self.rows = rows
        self.offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self.num_records = int(self.offsets[-1])
        self._layout_cache: tuple | None = None

    def __len__(self) -> int:
        return sys.maxsize if self.num_epochs is None else self.num_epochs * self.num_records

    def layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """``(shards in epoch order, start of each group in the epoch's stream + the end)``."""
        cached = self._layout_cache
        if cached is None or cached[0] != epoch:
            n = self.rows.size
            order = KeyedPermutation(n, self.seed ^ _SHARD_SALT, epoch)(np.arange(n, dtype=np.uint64))
            starts = np.concatenate([[0], np.cumsum(self.rows[order])]).astype(np.int64)
            bounds = np.concatenate([np.arange(0, n, self.group), [n]])
            cached = self._layout_cache = (epoch, order, starts[bounds])
        return cached[1], cached[2]

    def group_shards(self, epoch: int, g: int) -> np.ndarray:
        """The shards of group ``g`` of ``epoch``, in the order their records are concatenated."""
        order, _ = self.layout(epoch)
        return order[g * self.group : (g + 1) * self.group]

    def stream_indices(self, indices) -> np.ndarray:
        """Record index at each stream position (epochs concatenated; int64 out)."""
        idx = as_int64("index", indices)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            bad = idx[(idx < 0) | (idx >= len(self))][0]
            raise PositionOutOfRange(f"index must be in [0, {len(self)}) for this order's stream, got {int(bad)}")
        epochs, within = epoch_position(idx, self.num_records)
        out = np.empty_like(idx)
        for epoch in np.unique(epochs).tolist():
            at = np.flatnonzero(epochs == epoch)
            pos = within[at]
            _, starts = self.layout(epoch)
            groups = np.searchsorted(starts, pos, side="right") - 1
            for g in np.unique(groups).tolist():
                sel = np.flatnonzero(groups == g)
                size = int(starts[g + 1] - starts[g])
                perm = KeyedPermutation(size, subkey(self.seed, g, _GROUP_SALT), epoch)
                j = perm((pos[sel] - starts[g]).astype(np.uint64))
                shards = self.group_shards(epoch, g)
                ends = np.cumsum(self.rows[shards])
                k = np.searchsorted(ends, j, side="right")
                out[at[sel]] = self.offsets[shards[k]] + j - (ends[k] - self.rows[shards[k]])
        return out

    def few(self, positions: list[int]) -> list[int]:
        """``stream_indices`` of a few positions already checked to be in range, as Python integers."""
        return self.stream_indices(np.array(positions, dtype=np.int64)).tolist()

    def __repr__(self) -> str:
        return (f"ShardShuffle(shards={self.rows.size}, records={self.num_records}, group={self.group}, "
                f"seed={self.seed}, num_epochs={self.num_epochs})")
