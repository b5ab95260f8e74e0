"""Grain's ``FlatMapIterDataset``: every element split into its pieces, all of them in order; a position state.

``FlatMapIterDataset(parent, transform)`` yields ``transform.flat_map(x)``'s pieces for each
element ``x`` of ``parent``, one after the other; an element with no pieces yields nothing. Unlike
the ``MapDataset`` version (:mod:`portable_loader.dataset.flat_map`) there are no slots, so
``max_fan_out`` is not needed and not checked, as in Grain.

The state: Grain saves its parent's state before the element being split and the index of the
next piece. Ours is the same in our format: the parent's position fields before that element and
``<n>.flat_map.index`` (its pieces already emitted); once the last piece is out, the state is the
parent's position after the element and index 0. Restoring re-reads and re-splits one element
and skips what was emitted: no piece is saved. The split runs in the main process, after
``mp_prefetch``'s workers.

Example:
    >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
    >>> class Chars:
    ...     def flat_map(self, word):
    ...         return list(word)
    >>> ds = FlatMapIterDataset(to_iter_dataset(["ab", "", "cde"]), Chars())
    >>> it = iter(ds)
    >>> next(it), next(it), next(it)
    ('a', 'b', 'c')
    >>> state = it.get_state()
    >>> {k[2:]: int(v) for k, v in state["cursor"].items()}   # "cde" begins at source position 2; one piece out
    {'source.position': 2, 'flat_map.index': 1}
    >>> it2 = iter(ds); it2.set_state(state); list(it2)
    ['d', 'e']
"""

from __future__ import annotations

from portable_loader.dataset.base import function_identity
from portable_loader.dataset.flat_map import flat_map_function, pieces_of
from portable_loader.dataset.iter.dataset import IterDataset
from portable_loader.dataset.iter.pack import as_iter_dataset
from portable_loader.dataset.iter.runtime import MAX_REJECTED, _rejected_all

__all__ = ["FlatMapIterDataset"]


class FlatMapIterDataset(IterDataset):
    """Grain's ``FlatMapIterDataset(parent, transform)``: the pieces ``transform.flat_map(x)`` of every element.

    ``transform`` is a ``grain.transforms.FlatMap`` (ours, real Grain's, or any object with a
    ``flat_map`` method); ``flat_map`` may return any iterable. ``parent`` is an ``IterDataset``
    or a random-access dataset, read in order.

    Example:
        >>> from portable_loader.grain import MapDataset, transforms
        >>> class Halves(transforms.FlatMap):
        ...     max_fan_out = 2
        ...     def flat_map(self, x):
        ...         return [x // 2, x - x // 2]
        >>> [b.tolist() for b in FlatMapIterDataset(MapDataset.range(3, 6).to_iter_dataset(), Halves()).batch(4)]
        [[1, 2, 2, 2], [2, 3]]
    """

    def __init__(self, parent, transform):
        super().__init__((as_iter_dataset(parent, "FlatMapIterDataset"),))
        self.transform, self.fn = transform, flat_map_function(transform)
        self._fn_id = function_identity(self.fn)  # taken as the step is built, never from what fn did since

    def _identity(self) -> tuple:
        return ("flat_map", self._fn_id, self._parent._identity())

    def _make_part(self, children: list, n: int) -> "FlatMapIter":
        return FlatMapIter(f"{n}.flat_map.index", children[0], self.fn)

    def __str__(self) -> str:
        return f"FlatMapIterDataset(transform={type(self.transform).__name__})"


class FlatMapIter:
    """The running part of a flat map (iter_runtime's protocol: ``next``, ``fields``, ``restore``).

    Example:
        >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
        >>> from portable_loader.dataset.iter.iterator import _compile
        >>> part = FlatMapIter("1.flat_map.index", _compile(to_iter_dataset([2, 3])), lambda x: [x] * x)
        >>> part.next(), part.next(), part.next(), part.fields()
        (2, 2, 3, {'0.source.position': 1, '1.flat_map.index': 1})
    """

    def __init__(self, field: str, child, fn):
        self.field, self.child, self.fn = field, child, fn
        self.pieces: list = []
        self.index = 0  # the next piece of ``pieces`` to emit
        self.start_fields: dict = {}  # the parent's fields before the element ``pieces`` came from
        self.skip, self.refuse = 0, None  # pieces a restored state had emitted of the element read next

    def next(self):
        empty = 0
        while self.index >= len(self.pieces):
            fields = self.child.fields()
            element = self.child.next()  # StopIteration ends this stream too
            self.pieces, self.index, self.start_fields = pieces_of(self.fn, element), 0, fields
            if self.skip:
                if self.skip >= len(self.pieces):
                    raise self.refuse(self.field, f"piece {self.skip} is past the {len(self.pieces)} pieces this "
                                                  "element splits into")
                self.index, self.skip = self.skip, 0
            if not self.pieces:
                empty += 1
                if empty >= MAX_REJECTED:  # an endless stream of elements without pieces would never yield
                    raise _rejected_all(f"flat_map {self.field}", empty)
        piece = self.pieces[self.index]
        self.index += 1
        return piece

    def fields(self) -> dict:
        if self.index >= len(self.pieces):  # the element is done: the position after it
            return {**self.child.fields(), self.field: self.skip}
        return {**self.start_fields, self.field: self.index}

    def field_names(self) -> list[str]:
        return self.child.field_names() + [self.field]

    def restore(self, fields: dict, refuse) -> None:
        self.child.restore(fields, refuse)
        self.pieces, self.index, self.start_fields = [], 0, {}
        self.skip, self.refuse = fields[self.field], refuse

    def close(self) -> None:
        self.child.close()
