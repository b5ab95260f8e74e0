"""Grain's ways of combining datasets: ``Dataset.mix``, ``concatenate`` and ``select_from_datasets``.

All three are one view, :class:`Select`: element ``i`` is ``datasets[d][k]`` for
``(d, k) = selection_map[i]``. ``mix`` uses Grain's proportional map, ``concatenate`` Grain's
concatenation map, with Grain's arithmetic to the element:

- ``mix(datasets, weights)``: weights are scaled so the smallest is 100 and truncated to integers
  (``[1, 1.5]`` is ``[100, 150]``; no weights is ``[1] * n``); element ``k`` comes from the dataset
  whose running count first grows between ``k`` and ``k + 1`` under exact integer division. The
  length is ``int(min(len(d) / (w / sum(w))))`` in floating point: the longest prefix in which no
  dataset is read past its end (an index past it reads a dataset's next epoch).
- ``concatenate(datasets)``: the datasets one after another; epoch ``e`` of the result is epoch
  ``e`` of each part. Endless datasets are refused.

(The loader's own ``pl.mix({name: ds}, weights)`` is a different mixture: exact per-block counts
and its own stream order.)

Example:
    >>> from portable_loader.dataset import Dataset
    >>> m = Dataset.mix([Dataset.range(10), Dataset.range(100, 110)], weights=[1, 2])
    >>> len(m), list(m)[:6]
    (15, [0, 100, 101, 1, 102, 103])
"""

from __future__ import annotations

import bisect
import sys
from collections import defaultdict
from typing import Sequence

import numpy as np

from portable_loader.dataset.base import Dataset, _plain, _qualified, as_indices, attributes_of, digest, within
from portable_loader.dataset.remap import over_reopened_children

__all__ = ["ConcatMap", "ProportionalMap", "Select", "concatenate", "mix_datasets", "select_from_datasets"]

_SAMPLE = 64  # selection-map entries a fingerprint hashes when the map is long


def mix_datasets(datasets: Sequence, weights: Sequence[float] | None = None) -> "Select":
    """Grain's ``MapDataset.mix``: ``datasets`` interleaved in proportion to ``weights`` (module docstring).

    Example:
        >>> from portable_loader.dataset import Dataset
        >>> list(mix_datasets([Dataset.range(5), Dataset.range(7, 10)]))
        [0, 7, 1, 8, 2, 9]
    """
    parents = _sources(datasets)
    return Select(parents, ProportionalMap([len(p) for p in parents], weights))


def concatenate(datasets: Sequence) -> "Select":
    """Grain's ``MapDataset.concatenate``: the elements of ``datasets`` one dataset after another.

    Example:
        >>> from portable_loader.dataset import Dataset
        >>> list(concatenate([Dataset.range(2), Dataset.source(["a"])]))
        [0, 1, 'a']
    """
    parents = _sources(datasets)
    return Select(parents, ConcatMap([len(p) for p in parents]))


def select_from_datasets(datasets: Sequence, selection_map) -> "Select":
    """Grain's ``MapDataset.select_from_datasets``: element ``i`` is ``datasets[d][k]`` for ``(d, k) = selection_map[i]``.

    ``selection_map`` is a Grain ``DatasetSelectionMap`` or any object with ``__len__`` and
    ``__getitem__`` returning ``(dataset_index, index)``; it must be deterministic.

    Example:
        >>> from portable_loader.dataset import Dataset
        >>> list(select_from_datasets([Dataset.range(3), Dataset.source(list("xyz"))], [(1, 2), (0, 0), (1, 0)]))
        ['z', 0, 'x']
    """
    return Select(_sources(datasets), selection_map)


def _sources(datasets) -> tuple:
    from portable_loader.dataset.sources import source

    return tuple(source(d) for d in datasets)


class ProportionalMap:
    """Grain's ``SelectionWithProportionsMap`` over datasets of ``lengths``: ``(dataset, index)`` per position.

    Example:
        >>> p = ProportionalMap([4, 10], [1, 2])
        >>> len(p), [p[k] for k in range(4)], p.proportions
        (12, [(0, 0), (1, 0), (1, 1), (0, 1)], (100, 200))
    """

    def __init__(self, lengths: Sequence[int], weights: Sequence[float] | None = None):
        if weights is None:
            proportions = [1] * len(lengths)
        elif 0 in weights:
            raise ValueError("Must specify all non-zero proportions for mixing.")
        else:
            scale = 100 / min(weights)  # Grain's _float_to_int_proportions, truncation included
            proportions = [int(w * scale) for w in weights]
        if len(proportions) != len(lengths):
            raise ValueError(f"mix() got {len(lengths)} datasets but {len(proportions)} weights")
        self.proportions = tuple(proportions)
        total = sum(proportions)
        shares = [n / (w / total) for n, w in zip(lengths, proportions)]
        empty = [f"index {i}" for i, s in enumerate(shares) if s == 0]
        if empty:
            raise ValueError(
                f"All datasets must have positive length for mixing, but dataset(s) at {', '.join(empty)} have length 0."
            )
        self._length = min(sys.maxsize, int(min(shares)))

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, k: int) -> tuple[int, int]:
        # Grain's _dataset_and_key_of_next_element: which dataset's count grows from k to k + 1.
        remaining = sum(self.proportions)
        cur, nxt = k, k + 1
        for i, p in enumerate(self.proportions):
            next_cur = (cur * (remaining - p)) // remaining
            next_nxt = (nxt * (remaining - p)) // remaining
            count = nxt - next_nxt
            if cur - next_cur != count:
                return i, count - 1
            remaining -= p
            cur, nxt = next_cur, next_nxt
        raise AssertionError(f"no dataset found for mixture index {k}")  # unreachable for k >= 0

    def identity(self) -> tuple:
        return ("proportions", self.proportions, self._length)


class ConcatMap:
    """Grain's concatenation map over datasets of ``lengths``; index ``i`` of epoch ``e`` reads epoch ``e`` of its part.

    Example:
        >>> c = ConcatMap([2, 3])
        >>> len(c), [c[i] for i in (0, 2, 4, 5)]
        (5, [(0, 0), (1, 0), (1, 2), (0, 2)])
    """

    def __init__(self, lengths: Sequence[int]):
        for i, n in enumerate(lengths):
            if n >= sys.maxsize:
                raise ValueError(f"Cannot concatenate infinite datasets. Dataset {i} is infinite.")
        self.lengths = tuple(int(n) for n in lengths)
        self._starts = [0]
        for n in self.lengths:
            self._starts.append(self._starts[-1] + n)

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> tuple[int, int]:
        epoch, at = divmod(index, len(self))
        d = bisect.bisect_right(self._starts, at) - 1
        return d, at - self._starts[d] + epoch * self.lengths[d]

    def identity(self) -> tuple:
        return ("concatenate", self.lengths)


class Select(Dataset):
    """Element ``i`` is ``datasets[d][k]`` for ``(d, k) = selection_map[i]``; the view behind :func:`mix_datasets`,
    :func:`concatenate` and :func:`select_from_datasets`.

    Reads, ``lengths`` and ``accepts`` are grouped by dataset (one batched read each). The
    fingerprint covers every dataset's and the map's: a proportional or concatenation map by its
    parameters, any other by its type, plain attributes and its entries (all up to 1,024, else 64
    at fixed positions). The loader serves it in the LCG order of its own length.

    Example:
        >>> from portable_loader.dataset import Dataset, source
        >>> s = Select([source([{"input_ids": [1, 2]}]), source([{"input_ids": [3]}])], [(1, 0), (0, 0)])
        >>> s.lengths([0, 1]).tolist(), len(s)
        ([1, 2], 2)
    """

    reads_epochs = True

    def __init__(self, datasets: Sequence[Dataset], selection_map):
        if not (hasattr(selection_map, "__len__") and hasattr(selection_map, "__getitem__")):
            raise TypeError(f"selection_map must have __len__ and __getitem__, got {type(selection_map).__name__}")
        self.children, self.selection_map = tuple(datasets), selection_map
        self._length = len(selection_map)
        self.cheap_lengths = all(c.cheap_lengths for c in self.children)
        self.fork_hazard = next((c.fork_hazard for c in self.children if c.fork_hazard), None)
        self.filters = tuple(f"dataset {d}: {f}" for d, c in enumerate(self.children) for f in c.filters)
        self._map_id = self._map_identity()  # fixed now: a map is stateless, but the fingerprint must be

    @property
    def format(self) -> str | None:
        formats = {c.format for c in self.children}
        return formats.pop() if len(formats) == 1 else None

    def __len__(self) -> int:
        return self._length

    def _grouped(self, indices, read, empty):
        """``read(dataset, keys)`` once per dataset, reassembled in the order of ``indices``."""
        groups: dict[int, tuple[list, list]] = defaultdict(lambda: ([], []))
        for at, i in enumerate(as_indices(indices).tolist()):
            d, k = self.selection_map[i]
            slot = groups[int(d)]
            slot[0].append(at)
            slot[1].append(int(k))
        out = empty(sum(len(g[0]) for g in groups.values()))
        for d, (places, keys) in groups.items():
            child = self.children[d]
            for at, value in zip(places, read(child, within(child, keys))):
                out[at] = value
        return out

    def __getitems__(self, indices) -> list:
        return self._grouped(indices, lambda c, k: c.__getitems__(k), lambda n: [None] * n)

    def lengths(self, indices) -> np.ndarray:
        return self._grouped(indices, lambda c, k: c.lengths(k), lambda n: np.zeros(n, dtype=np.int64))

    def accepts(self, indices) -> np.ndarray:
        if not self.filters:
            return np.ones(as_indices(indices).size, dtype=bool)
        read = lambda c, k: c.accepts(k) if c.filters else np.ones(len(k), dtype=bool)  # noqa: E731
        return self._grouped(indices, read, lambda n: np.ones(n, dtype=bool))

    def _map_identity(self) -> tuple:
        own = getattr(self.selection_map, "identity", None)
        if isinstance(self.selection_map, (ProportionalMap, ConcatMap)):
            return own()
        n = self._length
        positions = range(n) if n <= 1024 else [(n - 1) * j // (_SAMPLE - 1) for j in range(_SAMPLE)]
        entries = [tuple(int(x) for x in self.selection_map[p]) for p in positions]
        return ("map", _qualified(type(self.selection_map)), _plain(attributes_of(self.selection_map)), n, digest(entries))

    def _identity(self) -> tuple:
        return (tuple(c.fingerprint() for c in self.children), self._map_id)

    def reopen(self) -> "Select":
        return over_reopened_children(self)
