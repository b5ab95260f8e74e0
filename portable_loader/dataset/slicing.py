"""``ds.slice(sl)`` and ``ds[a:b:c]``: the records at the indices of a Python slice, as a dataset.

Grain's arithmetic: the slice is resolved against the parent's length once (``sl.indices``), and
an index past the view's end reads the same positions of the parent's next epoch. A common use is
sharding: ``ds[shard_index::shard_count]``.

Example:
    >>> from portable_loader.dataset import Dataset
    >>> ds = Dataset.range(10)
    >>> list(ds[::-4]), list(ds.slice(slice(2, 6))), list(ds[1::3][1:])
    ([9, 5, 1], [2, 3, 4, 5], [4, 7])
"""

from __future__ import annotations

import numpy as np

from portable_loader.dataset.base import exact, narrow
from portable_loader.dataset.remap import Remap

__all__ = ["Slice"]


class Slice(Remap):
    """The parent's records at ``range(*sl.indices(len(parent)))``; built by :meth:`Dataset.slice`.

    Example:
        >>> from portable_loader.dataset import Dataset
        >>> s = Slice(Dataset.range(7), slice(-2, None, -2))
        >>> list(s), (s.start, s.stop, s.step)
        ([5, 3, 1], (5, -1, -2))
        >>> Slice(Dataset.range(7), 3)
        Traceback (most recent call last):
        ...
        ValueError: sl is not a slice: <class 'int'>
    """

    def __init__(self, parent, sl: slice):
        if not isinstance(sl, slice):
            raise ValueError(f"sl is not a slice: {type(sl)}")
        super().__init__(parent)
        self._parent_length = len(parent)
        self.start, self.stop, self.step = sl.indices(self._parent_length)
        self._length = len(range(self.start, self.stop, self.step))

    def __len__(self) -> int:
        return self._length

    def _remap(self, idx: np.ndarray) -> np.ndarray:
        # Epoch e of the view reads epoch e of the parent: past an endless parent, past int64.
        epochs = int(idx.max()) // self._length + 1 if idx.size else 0
        idx = exact(idx, epochs * self._parent_length + abs(self.start))
        epoch, offset = idx // self._length, idx % self._length
        return narrow(self.start + offset * self.step + epoch * self._parent_length)

    def _params(self) -> tuple:
        return ("slice", self.start, self.stop, self.step, self._parent_length)
