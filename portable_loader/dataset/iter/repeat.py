"""Grain's ``RepeatIterDataset``: an ``IterDataset`` read ``num_epochs`` times over (None: forever); a position state.

``RepeatIterDataset(parent, num_epochs)`` yields the elements of ``parent`` and, when it ends,
starts ``parent`` again from the position its iterator started at, until ``num_epochs`` passes
are done. As in Grain, every pass is the same: ``IterDataset`` has no epochs of its own, so
nothing upstream is reseeded (``MapDataset.repeat`` before ``to_iter_dataset`` is the way to get
a fresh shuffle per epoch).

The state is the parent's position fields plus ``<n>.repeat.epoch``, the passes completed: Grain
saves ``{"parent": ..., "epoch": ...}``, the same two things. Restoring sets both, in O(1);
starting a new pass restores the parent's initial position, which with ``mp_prefetch`` keeps the
worker processes (they are told new positions, not restarted).

One difference, on purpose: a pass that yields no element ends the stream, where Grain's
iterator with ``num_epochs=None`` over an empty dataset loops forever in ``next()``.

Example:
    >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
    >>> ds = RepeatIterDataset(to_iter_dataset(range(3)), num_epochs=2)
    >>> it = iter(ds)
    >>> [next(it) for _ in range(4)]
    [0, 1, 2, 0]
    >>> {k[2:]: int(v) for k, v in it.get_state()["cursor"].items()}
    {'source.position': 1, 'repeat.epoch': 1}
    >>> state = it.get_state()
    >>> it2 = iter(ds); it2.set_state(state); list(it2)
    [1, 2]
"""

from __future__ import annotations

import numpy as np

from portable_loader.dataset.iter.dataset import IterDataset
from portable_loader.dataset.iter.pack import as_iter_dataset
from portable_loader.errors import StateError

__all__ = ["RepeatIterDataset"]


class RepeatIterDataset(IterDataset):
    """Grain's ``RepeatIterDataset(parent, num_epochs=None)``: ``parent``'s elements ``num_epochs`` times.

    ``num_epochs`` must be a positive integer or None (``ValueError`` otherwise, as in Grain).
    ``parent`` is an ``IterDataset`` or a random-access dataset, read in order. Each pass gives the
    same elements (Grain's behaviour: no reseeding).

    Example:
        >>> from portable_loader.grain import MapDataset
        >>> list(RepeatIterDataset(MapDataset.range(3).to_iter_dataset(), num_epochs=2))
        [0, 1, 2, 0, 1, 2]
        >>> [b.tolist() for b in RepeatIterDataset(MapDataset.range(3).to_iter_dataset(), num_epochs=3).batch(4)]
        [[0, 1, 2, 0], [1, 2, 0, 1], [2]]
        >>> RepeatIterDataset(MapDataset.range(3).to_iter_dataset(), num_epochs=0)
        Traceback (most recent call last):
        ...
        ValueError: num_epochs must be positive, but got 0.
    """

    def __init__(self, parent, num_epochs: int | None = None):
        super().__init__((as_iter_dataset(parent, "RepeatIterDataset"),))
        if num_epochs is not None:
            if isinstance(num_epochs, bool) or not isinstance(num_epochs, (int, np.integer)):
                raise TypeError(f"num_epochs must be a positive integer or None, got {type(num_epochs).__name__}")
            if num_epochs <= 0:
                raise ValueError(f"num_epochs must be positive, but got {num_epochs}.")
            num_epochs = int(num_epochs)
        self.num_epochs = num_epochs

    def _identity(self) -> tuple:
        return ("repeat", self.num_epochs, self._parent._identity())

    def _make_part(self, children: list, n: int) -> "RepeatIter":
        return RepeatIter(f"{n}.repeat.epoch", children[0], self.num_epochs)

    def __str__(self) -> str:
        return f"RepeatIterDataset(num_epochs={self.num_epochs})"


class RepeatIter:
    """The running part of a repeat (iter_runtime's protocol: ``next``, ``fields``, ``restore``).

    Example:
        >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
        >>> from portable_loader.dataset.iter.iterator import _compile
        >>> part = RepeatIter("1.repeat.epoch", _compile(to_iter_dataset([7, 8])), num_epochs=None)
        >>> [part.next() for _ in range(5)], part.fields()
        ([7, 8, 7, 8, 7], {'0.source.position': 1, '1.repeat.epoch': 2})
    """

    def __init__(self, field: str, child, num_epochs: int | None):
        self.field, self.child, self.num_epochs = field, child, num_epochs
        self.start = dict(child.fields())  # where every pass begins: the parent iterator's first position
        self.epoch = 0
        self.seen = False  # whether the current pass has yielded an element

    def next(self):
        while self.num_epochs is None or self.epoch < self.num_epochs:
            try:
                element = self.child.next()
            except StopIteration:
                if not self.seen:
                    raise  # a pass without elements: every later one would be empty too
                self.epoch += 1
                if self.num_epochs is not None and self.epoch >= self.num_epochs:
                    raise
                self.child.restore(self.start, StateError)
                self.seen = False
                continue
            self.seen = True
            return element
        raise StopIteration

    def fields(self) -> dict:
        return {**self.child.fields(), self.field: self.epoch}

    def field_names(self) -> list[str]:
        return self.child.field_names() + [self.field]

    def restore(self, fields: dict, refuse) -> None:
        epoch = fields[self.field]
        if self.num_epochs is not None and epoch > self.num_epochs:
            raise refuse(self.field, f"epoch {epoch} is past num_epochs={self.num_epochs}")
        self.child.restore(fields, refuse)
        self.epoch = epoch
        self.seen = {k: fields[k] for k in self.start} != self.start

    def close(self) -> None:
        self.child.close()
