"""Per-element operations of an ``IterDataset`` and how a run of them is computed over source positions.

A ``map``, ``filter``, ``random_map`` or ``map_with_index`` that follows ``to_iter_dataset`` directly
is a pure function of the element and of its *ordinal*: the number of elements that reached that
operation before it (Grain's counter, which ``random_map`` seeds its generator with and
``map_with_index`` passes as the index). Such a run of operations (a :class:`Segment`) can therefore
be computed chunk by chunk over ranges of source positions, in this process or in worker processes,
and give the same elements in any case, provided each chunk is told the ordinals its elements start
at. Without a filter before it, an operation's ordinals are the elements' positions in the
``to_iter_dataset`` stream, known by arithmetic; after a filter they depend on how many elements the
earlier chunks kept. A segment is therefore cut into *stages*: a new stage starts at each
ordinal-using operation that follows something that can drop elements (a filter, or the skipping of
the holes a ``MapDataset`` filter leaves). A stage's ordinals are ``base + i`` over its input
elements, and ``base`` is the number of elements all earlier chunks fed that stage: the caller keeps
those running counts (``running``, one per stage that uses ordinals).

Example:
    >>> from portable_loader.dataset import source
    >>> seg = Segment(allow_nones=False)
    >>> seg.add("0.filter.count", ElementOp("filter", lambda x: x % 3 != 0))
    >>> seg.add("1.map_with_index.count", ElementOp("map_with_index", lambda i, x: (i, x)))
    >>> seg.seal()
    >>> len(seg.stages), seg.ordinal
    (2, [False, True])
    >>> pos, elems, ords, running = run_chunk(source(list(range(10))), seg, 0, 5, [0])
    >>> elems, running                     # 0 and 3 dropped, the survivors numbered 0, 1, 2
    ([(0, 1), (1, 2), (2, 4)], [3])
    >>> run_chunk(source(list(range(10))), seg, 5, 10, running)[1]   # the next chunk continues at 3
    [(3, 5), (4, 7), (5, 8)]
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import numpy as np

from portable_loader.dataset.base import function_identity
from portable_loader.dataset.random_map import keyed

__all__ = ["ElementOp", "Segment", "read_chunk", "run_chunk", "run_slowly"]

_KINDS = {"map": "Map", "filter": "Filter", "random_map": "RandomMap", "map_with_index": "MapWithIndex"}
_METHODS = {"map": "map", "filter": "filter", "random_map": "random_map", "map_with_index": "map_with_index"}


def _grain_transform_class(kind: str):
    # Only an imported module can have made the user's object: no need to import Grain to check.
    mod = sys.modules.get("grain._src.core.transforms")
    return None if mod is None else getattr(mod, _KINDS[kind], None)


def resolve_transform(kind: str, transform) -> Callable:
    """The function an operation calls: a Grain transform's method (``Map.map``, ...) or the callable itself.

    Example:
        >>> import grain
        >>> class Double(grain.transforms.Map):
        ...     def map(self, x):
        ...         return 2 * x
        >>> resolve_transform("map", Double())(4), resolve_transform("map", abs)(-3)
        (8, 3)
    """
    cls = _grain_transform_class(kind)
    if cls is not None and isinstance(transform, cls):
        return getattr(transform, _METHODS[kind])
    if callable(transform):
        return transform
    method = getattr(transform, _METHODS[kind], None)  # a transform of another library, as MapDataset takes it
    if callable(method):
        return method
    raise TypeError(f"{kind}() takes a callable or a grain.transforms.{_KINDS[kind]}, got {type(transform).__name__}")


class ElementOp:
    """One per-element operation: ``kind`` is ``map``, ``filter``, ``random_map`` or ``map_with_index``.

    ``random_map`` calls ``fn(element, rng)`` with Grain's generator: ``Philox(seed)`` with its counter
    set to the element's ordinal, so element ``k`` draws the same numbers as in Grain's single-process
    ``IterDataset.random_map``. A None element (``to_iter_dataset(allow_nones=True)``) is passed by the
    maps unchanged and counted, and given to a filter's predicate, as Grain does.

    Example:
        >>> op = ElementOp("random_map", lambda x, rng: x + rng.integers(100), seed=7)
        >>> op.apply([10, 10], [0, 1]) == op.apply([10, 10], [0, 1])   # a function of (element, ordinal)
        True
    """

    def __init__(self, kind: str, transform, seed: int | None = None):
        if kind not in _KINDS:
            raise ValueError(f"unknown element operation {kind!r}")
        self.kind, self.transform, self.seed = kind, transform, seed
        self._fn_id = function_identity(transform)  # taken as the step is built, never from what it did since
        self.fn = resolve_transform(kind, transform)
        self.ordinal = kind in ("random_map", "map_with_index")
        self.drops = kind == "filter"
        self._rng = None

    def identity(self) -> tuple:
        """What names this operation in a pipeline's fingerprint."""
        return (self.kind, self._fn_id, None if self.seed is None else int(self.seed))

    def __getstate__(self):  # a generator is rebuilt where it is used
        return dict(self.__dict__, _rng=None)

    def apply(self, elems: list, ords: list | None) -> list | np.ndarray:
        """The elements after this operation; for a filter, the list of which elements survive."""
        fn, kind = self.fn, self.kind
        if kind == "map":
            return [None if e is None else fn(e) for e in elems]
        if kind == "filter":
            return [bool(fn(e)) for e in elems]
        if kind == "map_with_index":
            return [None if e is None else fn(k, e) for k, e in zip(ords, elems)]
        if self._rng is None:
            self._rng = np.random.Generator(np.random.Philox(self.seed))
        rng, out = self._rng, []
        for k, e in zip(ords, elems):
            if e is not None:
                keyed(rng, k)
                e = fn(e, rng)
            out.append(e)
        return out


class Segment:
    """The per-element operations right after ``to_iter_dataset``, cut into stages (module docstring).

    ``add(field, op)`` in pipeline order, then ``seal()``. ``ordinal[k]``: stage ``k`` numbers its
    input elements; ``rank[k]``: its index among those stages (its slot in ``running``);
    ``fields[j]`` and ``field_rank[j]``: each ordinal operation's state field and the slot it reads.

    Example:
        >>> seg = Segment(allow_nones=True)
        >>> seg.add("0.random_map.count", ElementOp("random_map", lambda x, rng: x, seed=1))
        >>> seg.seal()
        >>> seg.ordinal, seg.field_rank            # no hole is skipped: the ordinal is the position
        ([True], {'0.random_map.count': 0})
    """

    def __init__(self, allow_nones: bool):
        self.allow_nones = allow_nones
        self.ops: list[tuple[str, ElementOp]] = []
        self.sealed = False

    def add(self, field: str, op: ElementOp) -> None:
        assert not self.sealed
        self.ops.append((field, op))

    def seal(self) -> None:
        if self.sealed:
            return
        self.sealed = True
        stages: list[list[ElementOp]] = [[]]
        ordinal = [False]
        dropped = not self.allow_nones  # skipping holes drops elements too
        self.field_rank: dict[str, int] = {}
        for field, op in self.ops:
            if op.ordinal:
                if dropped:
                    stages.append([])
                    ordinal.append(True)
                    dropped = False
                else:
                    ordinal[-1] = True
                self.field_rank[field] = sum(ordinal) - 1
            stages[-1].append(op)
            dropped = dropped or op.drops
        self.stages, self.ordinal = stages, ordinal
        self.rank = [sum(ordinal[:k]) for k in range(len(stages))]
        self.num_counts = sum(ordinal)

    def run_stage(self, k: int, pos: list, elems: list, ords: list, base: int):
        """Stage ``k`` over elements whose stage input ordinals start at ``base``; returns the survivors.

        ``ords[i]`` lists element ``i``'s ordinal in each ordinal stage so far; this stage appends to it.
        """
        if self.ordinal[k]:
            ords = [o + [base + i] for i, o in enumerate(ords)]
            cur = [base + i for i in range(len(elems))]
        else:
            cur = None
        for op in self.stages[k]:
            out = op.apply(elems, cur)
            if op.drops:
                keep = [i for i, ok in enumerate(out) if ok]
                if len(keep) != len(elems):
                    pos = [pos[i] for i in keep]
                    elems = [elems[i] for i in keep]
                    ords = [ords[i] for i in keep]
                    cur = None if cur is None else [cur[i] for i in keep]
            else:
                elems = out
        return pos, elems, ords


def read_chunk(ds, allow_nones: bool, a: int, b: int) -> tuple[list, list]:
    """Positions and elements ``[a, b)`` of ``ds`` in one batched read, holes dropped unless ``allow_nones``.

    Example:
        >>> from portable_loader.dataset import source
        >>> read_chunk(source([1, None, 3]), False, 0, 3)
        ([0, 2], [1, 3])
    """
    elems = list(ds.__getitems__(list(range(a, b))))
    pos = list(range(a, b))
    if not allow_nones and any(e is None for e in elems):
        keep = [i for i, e in enumerate(elems) if e is not None]
        pos, elems = [pos[i] for i in keep], [elems[i] for i in keep]
    return pos, elems


def run_chunk(ds, seg: Segment, a: int, b: int, running: list, read: tuple | None = None):
    """Source positions ``[a, b)`` through every stage of ``seg``, in this process.

    ``running`` holds the ordinal counts at ``a`` (one per ordinal stage). Returns the surviving
    elements' positions, the elements, their ordinals per ordinal stage, and the counts at ``b``.
    ``read`` is the chunk's ``read_chunk`` result when it was read ahead.

    Example:
        >>> from portable_loader.dataset import source
        >>> seg = Segment(allow_nones=True)
        >>> seg.add("0.map_with_index.count", ElementOp("map_with_index", lambda i, x: i * x))
        >>> seg.seal()
        >>> run_chunk(source([5, 6, 7, 8]), seg, 2, 4, [2])     # ordinals continue from 2
        ([2, 3], [14, 24], [[2], [3]], [4])
    """
    pos, elems = read if read is not None else read_chunk(ds, seg.allow_nones, a, b)
    ords: list = [[] for _ in elems]
    running = list(running)
    for k in range(len(seg.stages)):
        base = 0
        if seg.ordinal[k]:
            r = seg.rank[k]
            base, running[r] = running[r], running[r] + len(elems)
        pos, elems, ords = seg.run_stage(k, pos, elems, ords, base)
    return pos, elems, ords, running


def run_slowly(ds, seg: Segment, a: int, b: int, running: list):
    """``run_chunk`` one position at a time, stopping at the first error.

    A chunk that failed is run again this way so that every element before the failing one is
    still served, and the error surfaces at the same element for any chunk size or worker count.
    Returns ``(positions, elements, ordinals, running, error)``; ``error`` is None if none came up
    (a flaky read), and ``running`` the counts where it stopped.

    Example:
        >>> from portable_loader.dataset import source
        >>> seg = Segment(allow_nones=False)
        >>> seg.add("0.map.count", ElementOp("map", lambda x: 10 // x))
        >>> seg.seal()
        >>> pos, elems, ords, running, error = run_slowly(source([5, 2, 0, 1]), seg, 0, 4, [])
        >>> elems, type(error).__name__
        ([2, 5], 'ZeroDivisionError')
    """
    out_pos: list = []
    out_elems: list = []
    out_ords: list = []
    for p in range(a, b):
        try:
            pos, elems, ords, running = run_chunk(ds, seg, p, p + 1, running)
        except Exception as e:  # noqa: BLE001 - handed to the caller, who raises it in stream order
            return out_pos, out_elems, out_ords, running, e
        out_pos += pos
        out_elems += elems
        out_ords += ords
    return out_pos, out_elems, out_ords, running, None


def apply_one(op: ElementOp, element: Any, ordinal: int | None):
    """``op`` on one element (the main process's operations after a batch or a mix): (keep, element).

    Example:
        >>> apply_one(ElementOp("filter", lambda x: x > 2), 1, None), apply_one(ElementOp("map", abs), -4, None)
        ((False, 1), (True, 4))
    """
    out = op.apply([element], None if ordinal is None else [ordinal])[0]
    return (out, element) if op.drops else (True, out)
