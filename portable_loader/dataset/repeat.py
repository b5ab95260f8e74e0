"""``ds.repeat(num_epochs=None)``: the records over and over; ``None`` repeats endlessly.

As in Grain only the length changes (``num_epochs * len``, or ``sys.maxsize`` for an endless
repeat): an index past the parent's length already reads the parent's next epoch, in which a
shuffle below reshuffles and a random map redraws. ``reseed_each_epoch=False`` reads the first
epoch again instead.

Example:
    >>> from portable_loader.dataset import Dataset
    >>> ds = Dataset.range(3).shuffle(seed=0).repeat(2)
    >>> len(ds), sorted(ds[:3]) == sorted(ds[3:]) == [0, 1, 2]
    (6, True)
    >>> import sys; len(Dataset.range(3).repeat()) == sys.maxsize
    True
"""

from __future__ import annotations

import sys

import numpy as np

from portable_loader.dataset.remap import Remap

__all__ = ["Repeat"]


class Repeat(Remap):
    """``parent`` repeated ``num_epochs`` times (endlessly when None); built by :meth:`Dataset.repeat`.

    Example:
        >>> from portable_loader.dataset import Dataset
        >>> list(Repeat(Dataset.range(2), 3)), len(Repeat(Dataset.range(0)))
        ([0, 1, 0, 1, 0, 1], 0)
        >>> Repeat(Dataset.range(2).repeat(), 2)
        Traceback (most recent call last):
        ...
        ValueError: Repeating an already infinite dataset does nothing.
    """

    def __init__(self, parent, num_epochs: int | None = None, *, reseed_each_epoch: bool = True):
        if num_epochs is not None and num_epochs <= 0:
            raise ValueError(f"num_epochs must be positive, but got {num_epochs}.")
        if len(parent) >= sys.maxsize:
            raise ValueError("Repeating an already infinite dataset does nothing.")
        super().__init__(parent)
        self.num_epochs, self.reseed_each_epoch = num_epochs, bool(reseed_each_epoch)
        n = len(parent)
        self._length = (sys.maxsize if n else 0) if num_epochs is None else num_epochs * n

    def __len__(self) -> int:
        return self._length

    def _remap(self, idx: np.ndarray) -> np.ndarray:
        return idx if self.reseed_each_epoch else idx % len(self.parent)

    def _params(self) -> tuple:
        return ("repeat", self.num_epochs, self.reseed_each_epoch)
