"""Grain's ``FlatMapMapDataset``: each record split into up to ``max_fan_out`` elements, at fixed indices.

A random-access dataset cannot know how many pieces a record splits into before reading it, so
Grain gives every record ``max_fan_out`` slots: index ``i`` is piece ``i % max_fan_out`` of record
``i // max_fan_out``, and a slot past the record's last piece is a hole (None), as a filter
leaves one. The length is ``len(parent) * max_fan_out`` (``sys.maxsize`` for an endless parent).
A record that splits into more than ``max_fan_out`` pieces is a ``ValueError``, as in Grain.

Here the holes are declared as a filter's are (``filters``, ``accepts``): iteration, the
``IterDataset`` and ``pl.DataLoader`` skip them, and ``batch`` refuses to follow, as Grain's does.
A batched read splits each record once for all its slots that are asked for (Grain splits it once
per slot), which gives the same elements for a ``flat_map`` that is a function of the record.

Example:
    >>> from portable_loader.dataset import Dataset
    >>> class Repeat(object):
    ...     max_fan_out = 3
    ...     def flat_map(self, x):
    ...         return [x] * x
    >>> ds = FlatMapMapDataset(Dataset.range(1, 4), Repeat())
    >>> len(ds)
    9
    >>> [ds[i] for i in range(6)]
    [1, None, None, 2, 2, None]
    >>> list(ds)
    [1, 2, 2, 3, 3, 3]
"""

from __future__ import annotations

import sys

import numpy as np

from portable_loader.dataset.base import Dataset, as_indices, function_identity, within
from portable_loader.dataset.remap import over_reopened_parent

__all__ = ["FlatMapMapDataset", "flat_map_function", "pieces_of"]

_TOO_MANY = ("The user-provided FlatMapTransform has a split that exceeds specified max fan-out size. To address "
             "this, you can raise the max fan-out size, but for a max fan-out size >100, performance may suffer. "
             "Please consider preprocessing your data to keep the max fan-out size reasonable.")


def flat_map_function(transform):
    """The ``flat_map`` method of a ``FlatMap`` transform (ours, real Grain's, or any object that has one).

    Example:
        >>> flat_map_function(len)
        Traceback (most recent call last):
        ...
        TypeError: a FlatMap transform (an object with a flat_map method) is needed, got builtin_function_or_method
    """
    fn = getattr(transform, "flat_map", None)
    if not callable(fn):
        raise TypeError(f"a FlatMap transform (an object with a flat_map method) is needed, got "
                        f"{type(transform).__name__}")
    return fn


def pieces_of(fn, element) -> list:
    """``fn(element)`` as a list: Grain's flat maps may return any iterable (a generator too).

    Example:
        >>> pieces_of(lambda x: (c for c in x), "ab")
        ['a', 'b']
    """
    pieces = fn(element)
    return pieces if isinstance(pieces, list) else list(pieces)


class FlatMapMapDataset(Dataset):
    """Grain's ``FlatMapMapDataset(parent, transform)``: ``transform.max_fan_out`` slots per record (module docstring).

    ``transform`` is a ``grain.transforms.FlatMap`` (ours or real Grain's): ``flat_map(record)``
    returns the record's pieces, at most ``max_fan_out`` (a positive integer) of them.

    Example:
        >>> from portable_loader.grain import MapDataset, transforms
        >>> class Words(transforms.FlatMap):
        ...     max_fan_out = 4
        ...     def flat_map(self, text):
        ...         return text.split()
        >>> ds = FlatMapMapDataset(MapDataset.source(["a b", "c d e"]), Words())
        >>> list(ds), ds.accepts(range(8)).tolist()
        (['a', 'b', 'c', 'd', 'e'], [True, True, False, False, True, True, True, False])
        >>> FlatMapMapDataset(MapDataset.source(["a b c d e"]), Words())[0]
        Traceback (most recent call last):
        ...
        ValueError: The user-provided FlatMapTransform has a split that exceeds specified max fan-out size. ...
    """

    reads_epochs = True  # slot i reads record i // fan_out, which the parent takes by its own rule

    def __init__(self, parent, transform):
        from portable_loader.dataset.sources import source

        self.parent = source(parent)
        self.transform, self.fn = transform, flat_map_function(transform)
        self._fn_id = function_identity(self.fn)  # taken as the step is built, never from what fn did since
        fan_out = getattr(transform, "max_fan_out", None)
        if isinstance(fan_out, bool) or not isinstance(fan_out, (int, np.integer)) or fan_out <= 0:
            raise ValueError(f"FlatMapMapDataset: {type(transform).__name__}.max_fan_out must be a positive integer, "
                             f"got {fan_out!r}")
        self.fan_out = int(fan_out)
        self.fork_hazard = self.parent.fork_hazard
        # The unused slots are holes: declared as a filter's, so that everything that skips those skips these.
        self.filters = self.parent.filters + (f"flat_map {type(transform).__qualname__}",)

    def __len__(self) -> int:
        n = len(self.parent)
        return sys.maxsize if n >= sys.maxsize / self.fan_out else n * self.fan_out  # Grain's cap for endless parents

    def _split(self, indices) -> tuple[np.ndarray, dict]:
        """The slots' pieces: ``(piece index per slot, {record index: its pieces, or None for a hole below})``."""
        idx = as_indices(indices)
        records, piece = idx // self.fan_out, idx % self.fan_out  # np.divmod has no Python-integer form
        keys = np.unique(records)
        read = self.parent.__getitems__(within(self.parent, keys))
        split = {}
        for key, record in zip(keys.tolist(), read):
            pieces = None if record is None else pieces_of(self.fn, record)
            if pieces is not None and len(pieces) > self.fan_out:
                raise ValueError(_TOO_MANY)
            split[key] = pieces
        return np.stack([records, piece]), split

    def __getitems__(self, indices) -> list:
        if not len(indices):
            return []
        (records, piece), split = self._split(indices)
        out = []
        for r, p in zip(records.tolist(), piece.tolist()):
            pieces = split[r]
            out.append(pieces[p] if pieces is not None and p < len(pieces) else None)
        return out

    def accepts(self, indices) -> np.ndarray:
        if not len(indices):
            return np.zeros(0, dtype=bool)
        (records, piece), split = self._split(indices)
        return np.asarray([split[r] is not None and p < len(split[r]) for r, p in zip(records.tolist(), piece.tolist())],
                          dtype=bool)

    def lengths(self, indices) -> np.ndarray:
        # A hole counts as empty: the loader asks ``accepts`` first and never serves it.
        records = self.__getitems__(indices)
        return np.asarray([0 if r is None else len(r["input_ids"]) for r in records], dtype=np.int64)

    def _identity(self) -> tuple:
        return (self.parent.fingerprint(), self.fan_out, self._fn_id)

    def reopen(self) -> "FlatMapMapDataset":
        return over_reopened_parent(self)

    def __str__(self) -> str:
        return f"FlatMapMapDataset(transform={type(self.transform).__name__})"

