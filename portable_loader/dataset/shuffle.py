"""``ds.shuffle(seed=None)``: the records in Grain 0.2.18's shuffled order, a fresh one per epoch.

``Dataset.shuffle`` is ``grain.MapDataset.shuffle``, so it reads what Grain's reads: index ``i`` is
position ``i % n`` of epoch ``e = i // n``, permuted by Grain's ``index_shuffle`` keyed by
``(seed + e) % 2**32`` (:mod:`portable_loader.orders.index_shuffle`), so a run that switches from
Grain sees the same records in the same order. The order is computed, never stored: a shuffle of a
billion records costs a few integers, and any index is read in O(1). Over an endless ``repeat()``
the one epoch is the whole ``sys.maxsize`` stream, as in Grain. The seed is an integer in
``[0, 2**32)``, given here or derived from a ``ds.seed(...)`` above; with neither, as in Grain, it
is a ``ValueError``. (Where Grain's own shuffle reads a record twice in an epoch, at
``2**16 + 1``, ``2**18 + 1``, ... records, this one keeps every record once: the module above says how.)

The loader's own sampler (``pl.DataLoader`` over a source) is the LCG order of
:mod:`portable_loader.orders.sampler`, not this one.

Example:
    >>> from portable_loader.dataset import Dataset
    >>> ds = Dataset.range(6).shuffle(seed=42).repeat(2)
    >>> sorted(ds[:6]) == sorted(ds[6:]) == list(range(6)), list(ds[:6]) != list(ds[6:])
    (True, True)
"""

from __future__ import annotations

import numbers

import numpy as np

from portable_loader.orders.index_shuffle import ORDER, EpochShuffle
from portable_loader.dataset.base import narrow
from portable_loader.dataset.remap import Remap
from portable_loader.dataset.seeds import default_seed

__all__ = ["Shuffle"]


class Shuffle(Remap):
    """``parent``'s records in Grain's order keyed by ``(seed + epoch) % 2**32``; built by :meth:`Dataset.shuffle`.

    Example:
        >>> from portable_loader.dataset import Dataset
        >>> s = Shuffle(Dataset.range(5), seed=1)
        >>> sorted(s), list(s) == list(Shuffle(Dataset.range(5), seed=1))
        ([0, 1, 2, 3, 4], True)
        >>> Shuffle(Dataset.range(5), seed=2**32)
        Traceback (most recent call last):
        ...
        ValueError: Seed must be an integer between 0 and 2**32-1 (got seed=4294967296).
    """

    def __init__(self, parent, *, seed: int | None = None):
        super().__init__(parent)
        seed = default_seed(parent) if seed is None else seed
        if seed is None:
            raise ValueError("`shuffle` requires a seed. Please provide it with `ds.seed(seed)`")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**32:
            raise ValueError(f"Seed must be an integer between 0 and 2**32-1 (got {seed=}).")
        self._seed = int(seed)
        self._order = None

    def _remap(self, idx: np.ndarray) -> np.ndarray:
        if self._order is None:  # built on first read: an empty parent has no permutation
            self._order = EpochShuffle(len(self.parent), self._seed)
        return narrow(self._order(idx))

    def _params(self) -> tuple:
        # ORDER names the permutation: a state saved when shuffles had another order is refused.
        return ("shuffle", ORDER, self._seed)

    def __getstate__(self):  # a worker builds its own permutations
        return dict(self.__dict__, _order=None)
