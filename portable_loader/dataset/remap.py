"""A base for views that read one parent at computed indices: slice, shuffle, repeat, seed.

A remap holds no records: ``view[i]`` is ``parent[remap(i)]``, and ``lengths`` and ``accepts`` map
through the same arithmetic, so a cache's lengths stay free and a filter below is still asked about
the right records. Indices follow Grain's epoch rule (``reads_epochs``): an index past ``len`` reads
a later epoch, which a shuffle reshuffles. The loader serves a remap in the LCG order of its own
length, like any source (a remap does not keep a mixture's order, since it moves indices).

A subclass defines ``_remap`` (int64 array in, int64 array out) and ``_params`` (what its
fingerprint adds to the parent's), and ``__len__`` when the length changes.

Example:
    >>> import numpy as np
    >>> from portable_loader.dataset import Dataset
    >>> class Reverse(Remap):
    ...     def _remap(self, idx): return len(self) - 1 - idx
    >>> list(Reverse(Dataset.range(4)))
    [3, 2, 1, 0]
"""

from __future__ import annotations

import copy

import numpy as np

from portable_loader.dataset.base import Dataset, as_indices, within

__all__ = ["Remap", "over_reopened_parent"]


class Remap(Dataset):
    """A dataset over ``parent`` whose index ``i`` reads the parent's index ``_remap(i)``.

    Example:
        >>> from portable_loader.dataset import source
        >>> class Every2(Remap):
        ...     def __len__(self): return len(self.parent) // 2
        ...     def _remap(self, idx): return 2 * idx
        >>> ds = Every2(source([{"input_ids": [0] * n} for n in range(6)]))
        >>> ds.lengths([0, 1, 2]).tolist(), ds.fingerprint() == Every2(ds.parent).fingerprint()
        ([0, 2, 4], True)
    """

    reads_epochs = True

    def __init__(self, parent: Dataset):
        self.parent = parent
        self.cheap_lengths = parent.cheap_lengths
        self.fork_hazard = parent.fork_hazard
        self.filters = parent.filters

    @property
    def format(self) -> str | None:
        return self.parent.format

    def __len__(self) -> int:
        return len(self.parent)

    def _remap(self, idx: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _params(self) -> tuple:
        return ()

    def _parent_indices(self, indices):
        return within(self.parent, self._remap(as_indices(indices)))

    def __getitems__(self, indices) -> list:
        if not len(indices):
            return []
        return list(self.parent.__getitems__(self._parent_indices(indices)))

    def lengths(self, indices) -> np.ndarray:
        if not len(indices):
            return np.zeros(0, dtype=np.int64)
        return np.asarray(self.parent.lengths(self._parent_indices(indices)), dtype=np.int64)

    def accepts(self, indices) -> np.ndarray:
        idx = as_indices(indices)
        if not self.filters or not idx.size:
            return np.ones(idx.size, dtype=bool)
        return np.asarray(self.parent.accepts(self._parent_indices(idx)), dtype=bool)

    def _identity(self) -> tuple:
        return (self.parent.fingerprint(), *self._params())

    def reopen(self) -> "Remap":
        return over_reopened_parent(self)


def over_reopened_parent(view):
    """``view`` itself, or where its ``parent`` opens files of its own in a worker, a copy of it (the
    same parameters and fingerprint) over the reopened parent: a one-parent view's ``reopen``.

    Example:
        >>> from portable_loader.dataset import Dataset
        >>> ds = Dataset.range(5)[1:3]
        >>> over_reopened_parent(ds) is ds   # nothing below holds files
        True
    """
    parent = view.parent.reopen()
    if parent is view.parent:
        return view
    clone = copy.copy(view)
    clone.parent = parent
    return clone


def over_reopened_children(view):
    """:func:`over_reopened_parent` for a view of several ``children`` (a mix, a zip): itself where
    none opens files of its own in a worker, else a copy over the reopened children.

    Example:
        >>> from portable_loader.dataset import Dataset
        >>> ds = Dataset.concatenate([Dataset.range(2), Dataset.range(3)])
        >>> over_reopened_children(ds) is ds
        True
    """
    children = tuple(c.reopen() for c in view.children)
    if all(a is b for a, b in zip(children, view.children)):
        return view
    clone = copy.copy(view)
    clone.children = children
    return clone
