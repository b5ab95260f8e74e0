"""Grain's ``LimitIterDataset``: the first ``count`` elements of the parent, a step of our pipelines.

The state is the parent's position plus ``<n>.limit.count``, the elements taken so far (Grain
saves ``{"parent": ..., "count_elements_read": ...}``, the same two things). A count past the limit
is refused. ``get_next_index`` is the count, as in Grain.

Example:
    >>> from portable_loader import grain
    >>> list(LimitIterDataset(grain.MapDataset.range(5).to_iter_dataset(), 2))
    [0, 1]
    >>> it = iter(LimitIterDataset(grain.MapDataset.range(10).to_iter_dataset().filter(lambda x: x % 2), 3).batch(2))
    >>> next(it).tolist(), {k[2:]: int(v) for k, v in it.get_state()["cursor"].items()}
    ([1, 3], {'source.position': 4, 'limit.count': 2})
"""

from __future__ import annotations

import numpy as np

from portable_loader.dataset.iter.dataset import IterDataset
from portable_loader.dataset.iter.runtime import set_next_index

__all__ = ["LimitIterDataset"]


class LimitIterDataset(IterDataset):
    """Grain's ``LimitIterDataset(parent, count)``: at most ``count`` (> 0) elements of ``parent``.

    Example:
        >>> from portable_loader import grain
        >>> LimitIterDataset(grain.MapDataset.range(5).to_iter_dataset(), 0)
        Traceback (most recent call last):
        ...
        ValueError: Count must be a non-negative integer. Got 0
    """

    def __init__(self, parent, count: int):
        from portable_loader.dataset.iter.pack import as_iter_dataset

        if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
            raise TypeError(f"LimitIterDataset: count must be an integer, got {type(count).__name__}")
        if count <= 0:
            raise ValueError(f"Count must be a non-negative integer. Got {count}")  # Grain's words
        super().__init__((as_iter_dataset(parent, "LimitIterDataset"),))
        self._count = int(count)

    def _identity(self) -> tuple:
        return ("limit", self._count, self._parent._identity())

    def _make_part(self, children: list, n: int) -> "LimitIter":
        return LimitIter(f"{n}.limit.count", children[0], self._count)

    def __str__(self) -> str:
        return f"LimitIterDataset(count={self._count})"


class LimitIter:
    """The running part of :class:`LimitIterDataset`.

    Example:
        >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
        >>> from portable_loader.dataset.iter.iterator import _compile
        >>> part = LimitIter("1.limit.count", _compile(to_iter_dataset([5, 6, 7])), 2)
        >>> part.next(), part.next(), part.fields()
        (5, 6, {'0.source.position': 2, '1.limit.count': 2})
    """

    def __init__(self, field: str, child, limit: int):
        self.field, self.child, self.limit, self.count = field, child, limit, 0

    def next(self):
        if self.count >= self.limit:
            raise StopIteration
        value = self.child.next()
        self.count += 1
        return value

    def fields(self) -> dict:
        return {**self.child.fields(), self.field: self.count}

    def field_names(self) -> list[str]:
        return self.child.field_names() + [self.field]

    def restore(self, fields: dict, refuse) -> None:
        if fields[self.field] > self.limit:
            raise refuse(self.field, f"{fields[self.field]} elements taken is past the limit {self.limit}")
        self.child.restore(fields, refuse)
        self.count = fields[self.field]

    def next_index(self) -> int:
        return self.count

    def set_next_index(self, index: int) -> None:
        set_next_index(self.child, index)
        self.count = index

    def close(self) -> None:
        self.child.close()
