"""The two shapes the steps of this package take: a Grain-style iterator, and a pipeline part over one.

:class:`GrainStyleIterator` is what a Grain user subclasses (``super().__init__(parent)``,
``__next__`` over ``self._parent``, ``get_state``/``set_state``): it is one of our
``DatasetIterator``s (``isinstance`` and the checkpoint handler see it as one) but compiles no
pipeline. :class:`IteratorPart` runs such an iterator inside a compiled pipeline where its state is
a flat dict of non-negative integers: each key becomes a field of the pipeline's position state.

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

from collections.abc import Iterator, Mapping

from portable_loader.dataset.iter.iterator import DatasetIterator, _register_with_grain
from portable_loader.dataset.iter.options import DatasetOptions, IteratorContext
from portable_loader.errors import StateError

__all__ = ["GrainStyleIterator", "IteratorPart"]


class GrainStyleIterator(DatasetIterator):
    """A ``DatasetIterator`` written as Grain's are: its own ``__next__``, ``get_state`` and ``set_state``.

    ``parents`` (one iterator or a sequence of them, as in Grain) are closed with it.

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
    """

    def __init__(self, parents=()):  # noqa: D107 (the parent class compiles a pipeline; this has none)
        self._closed = False
        self._parents = (parents,) if isinstance(parents, Iterator) else tuple(parents)
        self._ctx = IteratorContext(DatasetOptions())
        _register_with_grain()  # Grain's checkpoint handler then saves it as one of Grain's iterators

    @property
    def _parent(self):
        (parent,) = self._parents
        return parent

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

    def close(self) -> None:
        """Close the parents (safe to call twice).

        Example:
            >>> from portable_loader import grain
            >>> it = GrainStyleIterator(iter(grain.MapDataset.range(3).to_iter_dataset()))
            >>> it.close(); it.close(); it._parent._closed
            True
        """
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for parent in self._parents:
            close = getattr(parent, "close", None)
            if close is not None:
                close()


class IteratorPart:
    """A running part of a compiled pipeline (``next``, ``fields``, ``restore``) over a Grain-style iterator.

    The iterator's state must be a flat dict of non-negative integers with fixed keys (a file
    offset, a row group and a row): the keys, prefixed with ``field``, are the part's fields. An
    iterator whose state is anything else is refused with a ``TypeError`` when the pipeline is built.

    Example:
        >>> class Bad(GrainStyleIterator):
        ...     def get_state(self):
        ...         return {"name": "x"}
        >>> IteratorPart("0.bad", Bad())
        Traceback (most recent call last):
        ...
        TypeError: Bad: its state {'name': 'x'} is not a flat dict of non-negative integers, so it cannot be a position inside a pipeline; iterate it on its own
    """

    def __init__(self, field: str, iterator):
        self.field, self.iterator = field, iterator
        state = iterator.get_state()
        if not isinstance(state, Mapping) or not all(_is_count(v) for v in state.values()):
            raise TypeError(f"{type(iterator).__name__}: its state {state!r} is not a flat dict of non-negative "
                            "integers, so it cannot be a position inside a pipeline; iterate it on its own")
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
