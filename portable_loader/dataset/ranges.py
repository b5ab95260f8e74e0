"""``Dataset.range(start, stop=None, step=1)``: the integers of a Python ``range`` as a dataset.

Example:
    >>> from portable_loader.dataset import Dataset
    >>> ds = Dataset.range(3, 12, 4)
    >>> len(ds), list(ds), ds[-1]
    (3, [3, 7, 11], 11)
"""

from __future__ import annotations

from portable_loader.dataset.base import Dataset, as_indices

__all__ = ["Range"]


class Range(Dataset):
    """The integers ``range(start, stop, step)`` (``range(n)`` when ``stop`` is None), as Grain's
    ``MapDataset.range``: element ``i`` is ``start + (i % len) * step``, a Python ``int``.

    Example:
        >>> Range(5)[4], Range(5, 0, -2)[1], len(Range(0))
        (4, 3, 0)
    """

    reads_epochs = True  # index i is i % len: every epoch is alike

    def __init__(self, start: int, stop: int | None = None, step: int = 1):
        self.start, self.stop = (0, start) if stop is None else (start, stop)
        self.step = step
        self._length = len(range(self.start, self.stop, self.step))

    def __len__(self) -> int:
        return self._length

    def __getitems__(self, indices) -> list:
        n, start, step = self._length, self.start, self.step
        return [start + (i % n) * step for i in as_indices(indices).tolist()]

    def _identity(self) -> tuple:
        return (self.start, self.stop, self.step)
