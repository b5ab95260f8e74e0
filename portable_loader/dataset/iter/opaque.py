"""User-written ``IterDataset`` / ``DatasetIterator`` subclasses as steps of a pipeline ("opaque steps").

Grain's extension point is a subclass of ``IterDataset`` whose ``__iter__`` returns the user's own
``DatasetIterator``. Such a step cannot be planned by position, so a pipeline is cut there
(docs/grain.md, "User-written iterators"): its parents are ordinary pipelines, each iterated by its
own positional ``DatasetIterator``; the step's iterator runs as written, in this process; the
built-in steps above it run over that iterator. Its state is what its ``get_state`` returns, nested
in the pipeline's state under ``steps``; its fingerprint names its class and the arguments its
constructor was called with, recorded before its ``__init__`` runs.

Under ``mp_prefetch`` the step runs once, in the trainer's process, over the ordered stream of its
parent; its parent pipeline is built with the same worker pool (:func:`nested`), so the per-element
operations below it still run in the workers, and nothing depends on the worker count.

Example:
    >>> from portable_loader import grain
    >>> class Pairs(grain.IterDataset):
    ...     def __iter__(self):
    ...         return PairsIterator(self._parent.__iter__())
    >>> class PairsIterator(grain.DatasetIterator):
    ...     def __next__(self):
    ...         return (next(self._parent), next(self._parent))
    ...     def get_state(self):
    ...         return {"parent": self._parent.get_state()}
    ...     def set_state(self, state):
    ...         self._parent.set_state(state["parent"])
    >>> ds = Pairs(grain.MapDataset.range(7).to_iter_dataset()).map(sum)
    >>> it = iter(ds)
    >>> next(it), sorted(it.get_state()["steps"])
    (1, ['0.Pairs'])
    >>> state = it.get_state()
    >>> list(it), it.set_state(state), list(it)
    ([5, 9], None, [5, 9])
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading

import numpy as np

from portable_loader.dataset.base import Dataset, _plain, _qualified

__all__ = ["OpaqueIter", "building", "copy_state", "is_opaque", "nested", "nesting", "opaque_identity", "record_arguments",
           "state_form"]

_context = threading.local()


def is_opaque(node) -> bool:
    """Whether ``node`` (a dataset or a class) is a user's step: its own ``__iter__``, none of the built-in steps.

    Built-in steps are compiled into running parts (they define ``_make_part``, or are the core nodes
    of :mod:`portable_loader.dataset.iter.dataset`); only a class that brings its own iterator is
    opaque, a user's subclass of a built-in step that overrides ``__iter__`` included.

    Example:
        >>> from portable_loader.dataset.iter.dataset import IterDataset, to_iter_dataset
        >>> from portable_loader.dataset.iter.repeat import RepeatIterDataset
        >>> class Mine(IterDataset):
        ...     def __iter__(self):
        ...         return iter(self._parent)
        >>> class Wrapped(RepeatIterDataset):
        ...     def __iter__(self):
        ...         return iter(self._parent)
        >>> is_opaque(Mine(to_iter_dataset([1]))), is_opaque(Mine), is_opaque(Wrapped), is_opaque(RepeatIterDataset)
        (True, True, True, False)
    """
    from portable_loader.dataset.iter.dataset import IterDataset

    cls = node if isinstance(node, type) else type(node)
    if not issubclass(cls, IterDataset):
        return False
    own_iter, make_part = _definer(cls, "__iter__"), _definer(cls, "_make_part")
    return own_iter is not IterDataset and (make_part is None or (own_iter is not make_part
                                                                  and issubclass(own_iter, make_part)))


def _definer(cls: type, name: str) -> type | None:
    """The class in ``cls``'s MRO that defines ``name``."""
    return next((c for c in cls.__mro__ if name in c.__dict__), None)


def record_arguments(obj, args: tuple, kwargs: dict) -> None:
    """Record, on a user's step ``obj`` being created, the arguments its constructor is called with.

    Called from ``IterDataset.__new__``, before any ``__init__`` runs (a dataclass's included), so
    nothing the object sets on itself, then or while it runs, can enter its fingerprint. Values
    are snapshotted at once (:func:`_snapshot`); datasets are kept and named by their own
    fingerprint when one is asked for.

    Example:
        >>> from portable_loader.dataset.iter.dataset import IterDataset, to_iter_dataset
        >>> class Mine(IterDataset):
        ...     def __init__(self, parent, n):
        ...         super().__init__(parent)
        ...         self.cache = {}
        ...     def __iter__(self):
        ...         return iter(self._parent)
        >>> Mine(to_iter_dataset([1]), n=3)._arguments[1]
        {'n': 3}
    """
    if is_opaque(obj):
        obj.__dict__["_arguments"] = (_snapshot(args), {k: _snapshot(v) for k, v in kwargs.items()})


class _DatasetRef:
    """A dataset among a step's arguments: named by its fingerprint when one is asked for (datasets are immutable)."""

    __slots__ = ("ds",)

    def __init__(self, ds):
        self.ds = ds

    def identity(self):
        return _dataset_identity(self.ds)


def _snapshot(value, depth: int = 0):
    from portable_loader.dataset.iter.dataset import IterDataset

    if isinstance(value, (IterDataset, Dataset)):
        return _DatasetRef(value)
    if depth <= 4 and isinstance(value, (list, tuple)):
        return tuple(_snapshot(v, depth + 1) for v in value)
    if depth <= 4 and isinstance(value, dict):
        return {k: _snapshot(v, depth + 1) for k, v in value.items()}
    if depth <= 4 and dataclasses.is_dataclass(value) and not isinstance(value, type):
        # A config object: its fields are what it was built with.
        return ("object", _qualified(type(value)),
                {f.name: _snapshot(getattr(value, f.name, None), depth + 1) for f in dataclasses.fields(value)})
    return _plain(value)


def _resolve(value):
    if isinstance(value, _DatasetRef):
        return value.identity()
    if isinstance(value, tuple):
        return tuple(_resolve(v) for v in value)
    if isinstance(value, dict):
        return {k: _resolve(v) for k, v in value.items()}
    return value


def _dataset_identity(ds) -> tuple:
    from portable_loader.dataset.iter.dataset import IterDataset

    if isinstance(ds, IterDataset):
        return ds._identity()
    if isinstance(ds, Dataset):
        return ("map_dataset", ds.fingerprint())
    return ("object", _qualified(type(ds)))


def opaque_identity(node) -> tuple:
    """What names a user's step in a fingerprint: its class, its constructor's arguments and its parents.

    Example:
        >>> from portable_loader.dataset.iter.dataset import IterDataset, to_iter_dataset
        >>> class Every(IterDataset):
        ...     def __init__(self, parent, n):
        ...         super().__init__(parent)
        ...         self.n = n
        ...     def __iter__(self):
        ...         return iter(self._parent)
        >>> a, src = Every(to_iter_dataset(range(4)), 2), to_iter_dataset(range(4))
        >>> a.fingerprint() == Every(src, 2).fingerprint() != Every(src, 3).fingerprint()
        True
        >>> a.n = 7                          # set after construction: not part of what names it
        >>> a._identity() == Every(to_iter_dataset(range(4)), 2)._identity()
        True
    """
    arguments = node.__dict__.get("_arguments", ((), {}))
    parents = tuple(_dataset_identity(p) for p in getattr(node, "_parents", ()))
    return ("iterator", _qualified(type(node)), _resolve(arguments), parents)


@contextlib.contextmanager
def nested(pool, options, step=None):
    """While a user's ``step`` builds its iterator, pipelines built inside it share ``pool`` and ``options``.

    Its parent's ``__iter__`` compiles the parent pipeline (:func:`nesting` tells it the outer
    pipeline's worker pool and options), so the operations below the step still run in
    ``mp_prefetch``'s workers and see the whole pipeline's options. A step that subclasses a
    built-in one and calls ``super().__iter__()`` gets the built-in iterator (:func:`building`).

    Example:
        >>> with nested("pool", "options"):
        ...     nesting()
        ('pool', 'options')
        >>> nesting()
        (None, None)
    """
    before = getattr(_context, "value", None)
    steps = getattr(_context, "steps", ())
    _context.value, _context.steps = (pool, options), steps + (id(step),)
    try:
        yield
    finally:
        _context.value, _context.steps = before, steps


def building(step) -> bool:
    """Whether ``step``'s own ``__iter__`` is running now: a pipeline it builds then runs it as its built-in class.

    Example:
        >>> step = object()
        >>> with nested(None, None, step):
        ...     building(step)
        True
        >>> building(step)
        False
    """
    return id(step) in getattr(_context, "steps", ())


def nesting():
    """``(pool, options)`` of the pipeline whose user step is building its iterator now, or ``(None, None)``.

    Example:
        >>> nesting()
        (None, None)
    """
    value = getattr(_context, "value", None)
    return (None, None) if value is None else value


def state_form(value):
    """``value`` as it reads back from JSON (tuples as lists, numpy scalars and arrays as numbers and
    lists, keys as strings), so a step's state checks the same before and after a checkpoint.

    A value JSON cannot hold is kept by its ``repr``: the same object checks the same.

    Example:
        >>> state_form({"i": np.int64(3), 1: (1.5, None)})
        {'i': 3, '1': [1.5, None]}
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [state_form(v) for v in value]
    if isinstance(value, dict):
        return {str(k): state_form(v) for k, v in value.items()}
    return repr(value)


def copy_state(value):
    """A copy of a state, so that what an iterator later does to its own dict changes no saved state.

    Dicts, lists and tuples are copied level by level and plain values kept (a state taken at
    every element, under packing or a flat map, would spend most of its time in ``copy.deepcopy``);
    anything else is deep-copied.

    Example:
        >>> inner = {"i": [1, 2]}
        >>> saved = copy_state({"parent": inner, "n": 3})
        >>> inner["i"].append(3); saved
        {'parent': {'i': [1, 2]}, 'n': 3}
    """
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if type(value) is dict:
        return {k: copy_state(v) for k, v in value.items()}
    if type(value) is list:
        return [copy_state(v) for v in value]
    if type(value) is tuple:
        return tuple(copy_state(v) for v in value)
    return copy.deepcopy(value)


class OpaqueIter:
    """The running part of a user's step: ``next`` from its iterator; its state is the iterator's own.

    ``fields()`` holds ``{field: a copy of iterator.get_state()}``; ``restore`` hands that value to
    ``iterator.set_state``. The pipeline's state keeps the field under ``steps``, not among the
    cursor's integers (the compiler lists the opaque fields).

    Example:
        >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
        >>> part = OpaqueIter("0.Mine", iter(to_iter_dataset(range(3))))
        >>> part.next(), part.fields()["0.Mine"]["cursor"]
        (0, {'0.source.position': '00000000000000000001'})
    """

    def __init__(self, field: str, iterator):
        self.field, self.iterator = field, iterator

    def next(self):
        return next(self.iterator)

    def fields(self) -> dict:
        return {self.field: copy_state(self.iterator.get_state())}

    def field_names(self) -> list[str]:
        return [self.field]

    def restore(self, fields: dict, refuse) -> None:
        self.iterator.set_state(copy_state(fields[self.field]))

    def next_index(self) -> int:
        try:
            return self.iterator._get_next_index()
        except (NotImplementedError, AttributeError):
            raise ValueError(f"get_next_index/set_next_index: {type(self.iterator).__name__} does not define "
                             "_get_next_index; use get_state()/set_state()") from None

    def set_next_index(self, index: int) -> None:
        self.iterator._set_next_index(index)

    def close(self) -> None:
        close = getattr(self.iterator, "close", None)
        if close is not None:
            close()
