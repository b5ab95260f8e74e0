"""Grain's ``WindowShuffleMapDataset``: each window of ``window_size`` consecutive records in a keyed order.

Record ``i`` stays within its window ``[w * window_size, (w + 1) * window_size)`` (the last window
may be shorter); inside it the order is the LCG permutation (:mod:`portable_loader.orders.sampler`) keyed
by ``(seed, epoch, w)``, so every epoch (an index past ``len`` reads a later one, as everywhere in
Grain) and every window has an order of its own. Grain uses another permutation (its
``index_shuffle`` over the whole window size, keyed by ``seed + w``), so the order differs; where
``window_size`` divides the length the records of each window are the same, and Grain's last,
short window reads past the end (records of the next epoch in place of some of its own), which
this one does not: every epoch reads each record once. Computed, never stored.

Example:
    >>> from portable_loader.dataset import Dataset
    >>> ds = WindowShuffle(Dataset.range(10), window_size=4, seed=0)
    >>> [sorted(ds[4 * w:4 * w + 4]) for w in range(3)]
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
"""

from __future__ import annotations

import functools
import numbers

import numpy as np

from portable_loader.dataset.base import exact, narrow
from portable_loader.dataset.remap import Remap
from portable_loader.orders.keyed import splitmix64

__all__ = ["WindowShuffle"]


@functools.lru_cache(maxsize=64)
def _permutation(n: int, key: int):
    from portable_loader.orders.sampler import LCGSampler

    return LCGSampler(n, seed=key)


class WindowShuffle(Remap):
    """``parent`` with each window of ``window_size`` records shuffled (the module says how); Grain's name and arguments.

    Example:
        >>> from portable_loader import grain
        >>> ds = grain.experimental.WindowShuffleMapDataset(grain.MapDataset.range(6), window_size=3, seed=1)
        >>> len(ds), sorted(ds[:3]), sorted(ds[3:])
        (6, [0, 1, 2], [3, 4, 5])
    """

    def __init__(self, parent, *, window_size: int, seed: int):
        super().__init__(parent)
        if isinstance(window_size, bool) or not isinstance(window_size, numbers.Integral) or window_size <= 0:
            raise ValueError(f"window_size must be a positive integer, got {window_size!r}")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**32:
            raise ValueError(f"Seed must be an integer between 0 and 2**32-1 (got {seed=}).")
        self._window, self._seed = int(window_size), int(seed)

    def _remap(self, idx: np.ndarray) -> np.ndarray:
        n, size = len(self.parent), self._window
        idx = exact(idx, (int(idx.max()) // n + 1) * n if idx.size else 0)
        epochs, pos = idx // n, (idx % n).astype(np.int64)
        windows = pos // size
        out = np.empty_like(idx)
        for epoch, w in sorted(set(zip(epochs.tolist(), windows.tolist()))):
            sel = (epochs == epoch) & (windows == w)
            start = w * size
            key = splitmix64(self._seed ^ splitmix64((epoch << 32) ^ w)) & (2**32 - 1)
            perm = _permutation(min(size, n - start), key)
            out[sel] = perm.record_indices(pos[sel] - start).astype(idx.dtype) + (epoch * n + start)
        return narrow(out)

    def _params(self) -> tuple:
        return ("window_shuffle", self._window, self._seed)
