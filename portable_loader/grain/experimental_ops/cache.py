"""Grain's ``CacheIterDataset``: the parent's elements kept in memory as they pass, replayed once the parent has ended.

The first pass reads the parent and keeps every element; after the parent ends, a restore to an
earlier position (a ``RepeatIterDataset`` starting its next pass, or ``set_state``) serves the
kept elements without reading the parent again. A step of our pipelines: the state is the
parent's position plus ``<n>.cache.position`` (elements served) and ``<n>.cache.filled`` (whether
the parent has ended), Grain's three fields. A restored state whose elements are not in memory
(a new process) rebuilds them from the parent's first position, as Grain's does.

Example:
    >>> from portable_loader import grain
    >>> reads = []
    >>> ds = CacheIterDataset(grain.MapDataset.range(3).to_iter_dataset().map(lambda x: reads.append(x) or x))
    >>> list(grain.experimental.RepeatIterDataset(ds, num_epochs=3)), reads
    ([0, 1, 2, 0, 1, 2, 0, 1, 2], [0, 1, 2])
"""

from __future__ import annotations

from portable_loader.dataset.iter.dataset import IterDataset

__all__ = ["CacheIterDataset"]


class CacheIterDataset(IterDataset):
    """Grain's ``CacheIterDataset(parent)``: ``parent``'s elements, kept in memory for the next passes.

    Example:
        >>> from portable_loader import grain
        >>> list(CacheIterDataset(grain.MapDataset.range(4).to_iter_dataset()).batch(3))[1].tolist()
        [3]
    """

    def __init__(self, parent):
        from portable_loader.dataset.iter.pack import as_iter_dataset

        super().__init__((as_iter_dataset(parent, "CacheIterDataset"),))

    def _identity(self) -> tuple:
        return ("cache", self._parent._identity())

    def _make_part(self, children: list, n: int) -> "CacheIter":
        return CacheIter(f"{n}.cache", children[0])

    def __str__(self) -> str:
        return "CacheIterDataset()"


class CacheIter:
    """The running part of :class:`CacheIterDataset`.

    Example:
        >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
        >>> from portable_loader.dataset.iter.iterator import _compile
        >>> part = CacheIter("1.cache", _compile(to_iter_dataset([4, 5])))
        >>> part.next(), part.fields()
        (4, {'0.source.position': 1, '1.cache.position': 1, '1.cache.filled': 0})
    """

    def __init__(self, field: str, child):
        self.field, self.child = field, child
        self.start = child.fields()
        self.cache: list = []
        self.position, self.filled, self.rebuild = 0, False, False

    def next(self):
        if self.filled:
            if self.position >= len(self.cache):
                raise StopIteration
            self.position += 1
            return self.cache[self.position - 1]
        if self.rebuild:  # the state's elements are not in memory: read them again from the start
            self.child.restore(self.start, ValueError)
            self.cache = [self.child.next() for _ in range(self.position)]
            self.rebuild = False
        try:
            value = self.child.next()
        except StopIteration:
            self.filled = True
            raise
        if len(self.cache) == self.position:
            self.cache.append(value)
        self.position += 1
        return value

    def fields(self) -> dict:
        return {**self.child.fields(), f"{self.field}.position": self.position, f"{self.field}.filled": int(self.filled)}

    def field_names(self) -> list[str]:
        return self.child.field_names() + [f"{self.field}.position", f"{self.field}.filled"]

    def restore(self, fields: dict, refuse) -> None:
        filled = fields[f"{self.field}.filled"]
        if filled not in (0, 1):
            raise refuse(f"{self.field}.filled", f"must be 0 or 1, got {filled}")
        self.child.restore(fields, refuse)
        self.position = fields[f"{self.field}.position"]
        if (filled and not self.filled) or (self.position > len(self.cache) and not self.filled):
            self.rebuild = True
        if self.filled and self.position > len(self.cache):
            raise refuse(f"{self.field}.position", f"{self.position} is past the {len(self.cache)} elements cached")

    def close(self) -> None:
        self.child.close()
