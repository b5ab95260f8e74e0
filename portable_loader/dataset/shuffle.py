"""``ds.shuffle(seed=None)``: the records in a keyed pseudo-random order, a fresh one per epoch.

The order is the LCG sampler's (:mod:`portable_loader.sampler`): computed, never stored, so a
shuffle of a billion records costs a few integers. Index ``i`` reads position ``i % n`` of epoch
``i // n`` (Grain's epoch rule), permuted by the key ``(seed, epoch)``; over an endless
``repeat()`` the one epoch is the whole ``sys.maxsize`` stream, as in Grain. The orders differ
from Grain's (it uses another keyed permutation) but are as deterministic: the same seed gives
the same order on every machine. The seed is an integer in ``[0, 2**32)``, given here or
derived from a ``ds.seed(...)`` above; with neither, as in Grain, it is a ``ValueError``.

Example:
    >>> from portable_loader.dataset import Dataset
    >>> ds = Dataset.range(6).shuffle(seed=42).repeat(2)
    >>> sorted(ds[:6]) == sorted(ds[6:]) == list(range(6)), list(ds[:6]) != list(ds[6:])
    (True, True)
"""

from __future__ import annotations

import numbers

import numpy as np

from portable_loader.dataset.remap import Remap
from portable_loader.dataset.seeds import default_seed

__all__ = ["Shuffle"]


class Shuffle(Remap):
    """``parent``'s records in the LCG order keyed by ``(seed, epoch)``; built by :meth:`Dataset.shuffle`.

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
        self._sampler = None

    def _remap(self, idx: np.ndarray) -> np.ndarray:
        n = len(self.parent)
        if self._sampler is None:  # built on first read: an empty parent has no permutation
            from portable_loader.sampler import LCGSampler

            self._sampler = LCGSampler(n, seed=self._seed)
        epochs, pos = np.divmod(idx, n)
        first = int(epochs[0])
        if (epochs == first).all():  # the usual case: one epoch per read
            return self._sampler.record_indices(pos, epoch=first) + first * n
        out = np.empty_like(idx)
        for epoch in np.unique(epochs).tolist():
            sel = epochs == epoch
            out[sel] = self._sampler.record_indices(pos[sel], epoch=epoch) + epoch * n
        return out

    def _params(self) -> tuple:
        return ("shuffle", self._seed)

    def __getstate__(self):  # a worker builds its own sampler
        return dict(self.__dict__, _sampler=None)
