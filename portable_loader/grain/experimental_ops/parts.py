"""The two shapes the steps of this package take: a Grain-style iterator, and a pipeline part over one.

:class:`GrainStyleIterator` is what a Grain user subclasses (``super().__init__(parent)``,
``__next__`` over ``self._parent``, ``get_state``/``set_state``): it is one of our
``DatasetIterator``s (``isinstance`` and the checkpoint handler see it as one) but compiles no
pipeline. :class:`IteratorPart` runs such an iterator inside a compiled pipeline where its state is
a flat dict of non-negative integers: each key becomes a field of the pipeline's position state.
Where it is anything else (a subclass's own state), :func:`iterator_part` runs the iterator as an
opaque step (:mod:`portable_loader.dataset.iter.opaque`): as written, its state nested under
``steps``, as Grain nests a step's state in its parent's.

Example:
    >>> class Count(GrainStyleIterator):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.i = 0
    ...     def __next__(self):
    ...         self.i += 1
    ...         return self.i
    ...     def get_state(self):
    ...         return {"i": self.i}
    ...     def set_state(self, state):
    ...         self.i = state["i"]
    >>> part = IteratorPart("3.count", Count())
    >>> part.next(), part.next(), part.fields()
    (1, 2, {'3.count.i': 2})
    >>> part.restore({"3.count.i": 7}, ValueError); part.next()
    8
"""

from __future__ import annotations

from collections.abc import Mapping

from portable_loader.dataset.iter.iterator import DatasetIterator
from portable_loader.dataset.iter.opaque import OpaqueIter
from portable_loader.errors import StateError

__all__ = ["GrainStyleIterator", "IteratorPart", "iterator_part"]


class GrainStyleIterator(DatasetIterator):
    """A ``DatasetIterator`` written as Grain's are: its own ``__next__``, ``get_state`` and ``set_state``.

    Its ``__init__`` and ``close`` are ``DatasetIterator``'s as Grain's base class: ``parents`` (one
    iterator, a sequence of them, or none) share one context and are closed with it. What it adds:
    ``get_next_index`` refused with a ``ValueError`` (these steps have no element index).

    Example:
        >>> class Twice(GrainStyleIterator):
        ...     def __next__(self):
        ...         return 2 * next(self._parent)
        ...     def get_state(self):
        ...         return {"parent": self._parent.get_state()}
        ...     def set_state(self, state):
        ...         self._parent.set_state(state["parent"])
        >>> from portable_loader import grain
        >>> it = Twice(iter(grain.MapDataset.range(3).to_iter_dataset()))
        >>> list(it), isinstance(it, grain.DatasetIterator)
        ([0, 2, 4], True)
        >>> it.close(); it.close(); it._parent._closed
        True
    """

    def __next__(self):
        raise NotImplementedError

    def get_state(self) -> dict:
        raise NotImplementedError

    def set_state(self, state) -> None:
        raise NotImplementedError

    def _get_next_index(self) -> int:
        raise ValueError(f"get_next_index: {type(self).__name__} does not define an element index; "
                         "use get_state()/set_state()")

    def _set_next_index(self, index: int) -> None:
        self._get_next_index()


class IteratorPart:
    """A running part of a compiled pipeline (``next``, ``fields``, ``restore``) over a Grain-style iterator.

    The iterator's state must be a flat dict of non-negative integers with fixed keys (a file
    offset, a row group and a row): the keys, prefixed with ``field``, are the part's fields. For any
    other iterator use :func:`iterator_part`, which runs it as an opaque step instead.

    Example:
        >>> class Bad(GrainStyleIterator):
        ...     def get_state(self):
        ...         return {"name": "x"}
        >>> IteratorPart("0.bad", Bad())
        Traceback (most recent call last):
        ...
        TypeError: Bad: its state {'name': 'x'} is not a flat dict of non-negative integers, so it cannot be fields of a position; iterator_part runs it as an opaque step
    """

    def __init__(self, field: str, iterator):
        self.field, self.iterator = field, iterator
        state = iterator.get_state()
        if not isinstance(state, Mapping) or not all(_is_count(v) for v in state.values()):
            raise TypeError(f"{type(iterator).__name__}: its state {state!r} is not a flat dict of non-negative "
                            "integers, so it cannot be fields of a position; iterator_part runs it as an opaque step")
        self.keys = sorted(state)

    def next(self):
        return next(self.iterator)

    def fields(self) -> dict:
        state = self.iterator.get_state()
        return {f"{self.field}.{k}": int(state[k]) for k in self.keys}

    def field_names(self) -> list[str]:
        return [f"{self.field}.{k}" for k in self.keys]

    def restore(self, fields: dict, refuse) -> None:
        try:
            self.iterator.set_state({k: fields[f"{self.field}.{k}"] for k in self.keys})
        except StateError:
            raise
        except (ValueError, TypeError, KeyError) as e:
            raise refuse(self.field, str(e)) from e

    def close(self) -> None:
        close = getattr(self.iterator, "close", None)
        if close is not None:
            close()


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def iterator_part(field: str, iterator) -> IteratorPart | OpaqueIter:
    """The part that runs ``iterator`` inside a pipeline: its integers as fields where its state is a
    flat dict of them (:class:`IteratorPart`), else an opaque step whose state nests under ``steps``.

    Example:
        >>> class Named(GrainStyleIterator):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.i = 0
        ...     def __next__(self):
        ...         self.i += 1
        ...         return self.i
        ...     def get_state(self):
        ...         return {"name": "x", "i": self.i}
        ...     def set_state(self, state):
        ...         self.i = state["i"]
        >>> part = iterator_part("0.named", Named())
        >>> type(part).__name__, part.next(), part.fields()
        ('OpaqueIter', 1, {'0.named': {'name': 'x', 'i': 1}})
    """
    state = iterator.get_state()
    if isinstance(state, Mapping) and all(_is_count(v) for v in state.values()):
        return IteratorPart(field, iterator)
    return OpaqueIter(field, iterator)

