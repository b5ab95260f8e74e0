"""Grain's ``ZipMapDataset`` and ``ZipIterDataset``: tuples of the elements at one index, or one step, of each parent.

``ZipMapDataset`` is a random-access dataset of ours (``pl.Dataset``): ``len``, batched
``__getitems__`` (one batched read per parent), an index past the end read as each parent reads it
(Grain's epochs), a fingerprint over the parents', worker processes reopening each parent.
``ZipIterDataset`` is a step of our ``IterDataset`` pipelines: each parent runs as its own branch
and the state is every branch's position, as Grain's state is every parent's state; ``strict``
(the default) raises Grain's ``ValueError`` where one parent ends before another.

Example:
    >>> from portable_loader import grain
    >>> zipped = ZipMapDataset([grain.MapDataset.range(3), grain.MapDataset.range(10, 13)])
    >>> list(zipped), zipped[1:].__len__()
    ([(0, 10), (1, 11), (2, 12)], 2)
    >>> its = [grain.MapDataset.range(3).to_iter_dataset(), grain.MapDataset.range(5, 8).to_iter_dataset().map(str)]
    >>> list(ZipIterDataset(its).batch(2))[0]
    (array([0, 1]), array(['5', '6'], dtype='<U1'))
"""

from __future__ import annotations

from typing import Sequence

from portable_loader.dataset.base import Dataset, within
from portable_loader.dataset.remap import over_reopened_children
from portable_loader.dataset.iter.dataset import IterDataset

__all__ = ["ZipIterDataset", "ZipMapDataset"]


class ZipMapDataset(Dataset):
    """Grain's ``ZipMapDataset(parents)``: element ``i`` is ``tuple(p[i] for p in parents)``; equal lengths required.

    Example:
        >>> from portable_loader import grain
        >>> ZipMapDataset([grain.MapDataset.range(3), grain.MapDataset.range(4)])
        Traceback (most recent call last):
        ...
        ValueError: All parents must have the same length.
        >>> ZipMapDataset([grain.MapDataset.range(2).shuffle(seed=1), [7, 8]])[3]   # index 3: each parent's epoch 1
        (1, 8)
    """

    reads_epochs = True

    def __init__(self, parents: Sequence):
        from portable_loader.dataset.sources import source

        self.children = tuple(p if isinstance(p, Dataset) else source(p) for p in parents)
        if not self.children:
            raise ValueError("At least one parent must be provided.")
        lengths = {len(p) for p in self.children}
        if len(lengths) != 1:
            raise ValueError("All parents must have the same length.")
        self._length = lengths.pop()
        hazards = [p.fork_hazard for p in self.children if p.fork_hazard]
        self.fork_hazard = hazards[0] if hazards else None

    def __len__(self) -> int:
        return self._length

    def __getitems__(self, indices) -> list:
        if not len(indices):
            return []
        return list(zip(*(p.__getitems__(within(p, indices)) for p in self.children)))

    def _identity(self) -> tuple:
        return ("zip", tuple(p.fingerprint() for p in self.children))

    def reopen(self) -> "ZipMapDataset":
        return over_reopened_children(self)

    def __str__(self) -> str:
        return f"ZipMapDataset(parents={len(self.children)})"


class ZipIterDataset(IterDataset):
    """Grain's ``ZipIterDataset(parents, *, strict=True)``: tuples of each parent's next element.

    It ends when the first parent ends; with ``strict``, a parent that ends before (or after) the
    others is Grain's ``ValueError``.

    Example:
        >>> from portable_loader import grain
        >>> a, b = grain.MapDataset.range(3).to_iter_dataset(), grain.MapDataset.range(2).to_iter_dataset()
        >>> list(ZipIterDataset([a, b], strict=False))
        [(0, 0), (1, 1)]
        >>> list(ZipIterDataset([a, b]))
        Traceback (most recent call last):
        ...
        ValueError: ZipIterDataset argument 2 is shorter than argument 1
    """

    def __init__(self, parents: Sequence, *, strict: bool = True):
        from portable_loader.dataset.iter.pack import as_iter_dataset

        super().__init__([as_iter_dataset(p, "ZipIterDataset") for p in parents])
        if not self._parents:
            raise ValueError("At least one parent must be provided.")
        self._strict = bool(strict)

    def _identity(self) -> tuple:
        return ("zip", self._strict, tuple(p._identity() for p in self._parents))

    def _make_part(self, children: list, n: int) -> "ZipIter":
        return ZipIter(children, self._strict)

    def __str__(self) -> str:
        return f"ZipIterDataset(parents={len(self._parents)}, strict={self._strict})"


def _strict_error(i: int, why: str) -> ValueError:
    others = "argument 1" if i == 1 else f"arguments 1-{i}"
    return ValueError(f"ZipIterDataset argument {i + 1} is {why} than {others}")


class ZipIter:
    """The running part of :class:`ZipIterDataset`: its state is its branches' fields, nothing of its own.

    Example:
        >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
        >>> from portable_loader.dataset.iter.iterator import _compile
        >>> part = ZipIter([_compile(to_iter_dataset([1, 2])), _compile(to_iter_dataset([3, 4]))], strict=True)
        >>> part.next(), sorted(part.fields())
        ((1, 3), ['0.source.position'])
    """

    def __init__(self, children: list, strict: bool):
        self.children, self.strict = children, strict

    def next(self):
        items = []
        for i, child in enumerate(self.children):
            try:
                items.append(child.next())
            except StopIteration as end:
                if self.strict and i > 0:
                    raise _strict_error(i, "shorter") from end
                if self.strict:
                    for j, other in enumerate(self.children[1:], start=1):
                        try:
                            other.next()
                        except StopIteration:
                            continue
                        raise _strict_error(j, "longer") from end
                raise
        return tuple(items)

    def fields(self) -> dict:
        out = {}
        for c in self.children:
            out.update(c.fields())
        return out

    def field_names(self) -> list[str]:
        return [name for c in self.children for name in c.field_names()]

    def restore(self, fields: dict, refuse) -> None:
        for c in self.children:
            c.restore(fields, refuse)

    def close(self) -> None:
        for c in self.children:
            c.close()
