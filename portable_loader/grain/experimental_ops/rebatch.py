"""Grain's ``RebatchIterDataset``: the parent's batches cut and joined into batches of ``batch_size`` rows.

Each element of the parent is a pytree of arrays sharing their first axis (a batch); the rows
flow on in order and come out ``batch_size`` at a time (leaves sliced, and concatenated where a
new batch spans parent batches). The last batch is short unless ``drop_remainder``, which ends the
stream there, as Grain's does. A parent batch of no rows is Grain's ``ValueError``.

A step of our pipelines: the state is the parent's position before the parent batch being cut plus
``<n>.rebatch.index``, the rows of it already used (Grain saves ``{"parent": ..., "batch_idx": ...}``,
the same two things).

Example:
    >>> from portable_loader import grain
    >>> ds = grain.MapDataset.range(7).to_iter_dataset().batch(3)
    >>> [b.tolist() for b in RebatchIterDataset(ds, batch_size=2)]
    [[0, 1], [2, 3], [4, 5], [6]]
"""

from __future__ import annotations

import numpy as np

from portable_loader.dataset.batch import _tree_map
from portable_loader.dataset.iter.dataset import IterDataset

__all__ = ["RebatchIterDataset"]


class RebatchIterDataset(IterDataset):
    """Grain's ``RebatchIterDataset(parent, batch_size, drop_remainder=False)``.

    Example:
        >>> from portable_loader import grain
        >>> ds = grain.MapDataset.range(5).map(lambda i: {"x": i, "y": -i}).to_iter_dataset().batch(2)
        >>> [b["y"].tolist() for b in RebatchIterDataset(ds, 3, drop_remainder=True)]
        [[0, -1, -2]]
    """

    def __init__(self, parent, batch_size: int, drop_remainder: bool = False):
        from portable_loader.dataset.iter.pack import as_iter_dataset

        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
            raise ValueError("batch_size must be positive.")
        super().__init__((as_iter_dataset(parent, "RebatchIterDataset"),))
        self._batch_size, self._drop_remainder = int(batch_size), bool(drop_remainder)

    def _identity(self) -> tuple:
        # The batch size is part of it: the state counts rows of the parent's batch, not a stream position.
        return ("rebatch", self._batch_size, self._drop_remainder, self._parent._identity())

    def _make_part(self, children: list, n: int) -> "RebatchIter":
        return RebatchIter(f"{n}.rebatch.index", children[0], self._batch_size, self._drop_remainder)

    def __str__(self) -> str:
        return f"RebatchIterDataset(batch_size={self._batch_size}, drop_remainder={self._drop_remainder})"


def _rows(batch) -> int:
    leaves = []
    _tree_map(leaves.append, batch)
    if not leaves:
        raise ValueError("RebatchIterDataset: an element with no array to rebatch")
    return len(leaves[0])


class RebatchIter:
    """The running part of :class:`RebatchIterDataset`.

    Example:
        >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
        >>> from portable_loader.dataset.iter.iterator import _compile
        >>> part = RebatchIter("2.rebatch.index", _compile(to_iter_dataset(range(5)).batch(3)), 2, False)
        >>> part.next().tolist(), part.next().tolist(), part.fields()
        ([0, 1], [2, 3], {'0.source.position': 3, '2.rebatch.index': 1})
    """

    def __init__(self, field: str, child, batch_size: int, drop_remainder: bool):
        self.field, self.child = field, child
        self.batch_size, self.drop_remainder = batch_size, drop_remainder
        self.batch, self.rows, self.index = None, 0, 0
        self.before = child.fields()  # the parent's position before the batch being cut

    def next(self):
        needed, pieces = self.batch_size, []
        while needed > 0:
            if self.batch is None or self.index >= self.rows:
                first = self.batch is None
                self.before = self.child.fields()
                try:
                    self.batch = self.child.next()
                except StopIteration:
                    if self.drop_remainder:
                        raise
                    break
                self.rows = _rows(self.batch)
                if not first:
                    self.index = 0
                if self.rows <= 0:
                    raise ValueError("Rebatching with starting batch size of 0 is not supported.")
            take = min(needed, self.rows - self.index)
            a = self.index
            if take > 0:  # a state taken at a batch's end restores to an empty rest: never an empty piece
                pieces.append(_tree_map(lambda x: x[a:a + take], self.batch))
            self.index += take
            needed -= take
        if not pieces:
            raise StopIteration
        if len(pieces) == 1:
            return pieces[0]
        return _tree_map(lambda *xs: np.concatenate(xs, axis=0), *pieces)

    def fields(self) -> dict:
        return {**self.before, self.field: self.index}

    def field_names(self) -> list[str]:
        return self.child.field_names() + [self.field]

    def restore(self, fields: dict, refuse) -> None:
        self.child.restore(fields, refuse)
        self.before = self.child.fields()
        self.batch, self.rows, self.index = None, 0, fields[self.field]

    def close(self) -> None:
        self.child.close()
