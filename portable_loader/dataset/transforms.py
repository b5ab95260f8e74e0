"""Lazy per-record transforms: ``dataset.map(fn)`` and ``dataset.filter(pred)``.

A transform holds its parent and a function and does nothing until records are read. Its
fingerprint hashes the parent's fingerprint and the function's identity, so a loader state saved
over ``source(x).map(f)`` is refused by ``source(x).map(g)``, and one saved over ``.filter(p)`` by
``.filter(q)``. A transform keeps its parent's index space and stream order: a transform over a
mixture is still served in the mixture's order, and ``describe`` still names its sources.

``map``'s ``fn`` runs on exactly the records a batched read asks for, in the reading process (a
loader worker, when there are workers). ``filter``'s predicate decides which records the loader
serves; it runs where the loader plans (the main process), see :class:`Filter`.

Example:
    >>> import numpy as np
    >>> from portable_loader.dataset import source
    >>> def shift(r):
    ...     return {"input_ids": r["input_ids"] + 1}
    >>> ds = source([{"input_ids": np.arange(3)}]).map(shift, keeps_lengths=True)
    >>> ds[0]["input_ids"].tolist(), ds.lengths([0]).tolist()
    ([1, 2, 3], [3])
"""

from __future__ import annotations

import threading
from collections import OrderedDict
import numbers
import sys
from typing import Any, Callable, Sequence

import numpy as np

from portable_loader.dataset.base import Dataset, as_indices, function_identity, within

__all__ = ["Filter", "Map", "PassesMixture", "apply_transformations", "as_function"]

_MEMO_TOKENS = 1 << 21  # tokens of records a filter read for its predicate, kept for the fetch that follows


def as_function(transform, method: str, kind: str, *, refuse: tuple[str, ...] = ()):
    """The function ``transform`` stands for: the bound ``method`` of a Grain transform object
    (``grain.transforms.Map`` -> ``.map``, ...), else ``transform`` itself when it is callable.

    An object that is not callable but has ``method`` (a transform class of another Grain-like
    library) counts as a transform too; one that has a ``refuse`` method instead (a ``RandomMap``
    given to ``map``) is a ``TypeError`` naming the method to use, as Grain fails on it.

    Example:
        >>> import grain
        >>> class Inc(grain.transforms.Map):
        ...     def map(self, x): return x + 1
        >>> as_function(Inc(), "map", "Map")(1), as_function(len, "map", "Map") is len
        (2, True)
    """
    grain_transforms = sys.modules.get("grain._src.core.transforms")
    grain_cls = getattr(grain_transforms, kind, None) if grain_transforms is not None else None
    if grain_cls is not None and isinstance(transform, grain_cls):
        return getattr(transform, method)
    if callable(transform):
        return transform
    bound = getattr(transform, method, None)
    if callable(bound) and not isinstance(transform, Dataset):
        return bound
    for other in refuse:
        if callable(getattr(transform, other, None)):
            raise TypeError(f"{method}() takes a callable or a {kind} transform, got {type(transform).__name__}, "
                            f"whose {other}() needs ds.{other}(...)")
    raise TypeError(f"{method}() takes a callable or a {kind} transform, got {type(transform).__name__}")


def apply_transformations(ds: Dataset, transformations) -> Dataset:
    """``ds.apply(...)``: Grain's ``apply_transformations`` over our datasets (one transform or a sequence).

    ``Batch`` becomes ``ds.batch``, ``Map`` ``ds.map``, ``RandomMap`` ``ds.random_map``, ``MapWithIndex``
    ``ds.map_with_index``, ``Filter`` ``ds.filter`` and ``FlatMap`` a ``FlatMapMapDataset`` (or
    ``FlatMapIterDataset`` on an ``IterDataset``); anything else is ``NotImplementedError``, as Grain
    says of what it does not know.

    Example:
        >>> import grain
        >>> from portable_loader.dataset import Dataset
        >>> list(apply_transformations(Dataset.range(3), grain.transforms.Batch(2, drop_remainder=True)))
        [array([0, 1])]
    """
    if not isinstance(transformations, Sequence):
        transformations = (transformations,)
    t = sys.modules.get("grain._src.core.transforms")
    for tr in transformations:
        kind = _grain_kind(tr, t) if t is not None else None
        if kind is None:  # duck-typed, in Grain's order of precedence
            kind = next((k for k, m in _KINDS if callable(getattr(tr, m, None))), None)
            if kind is None and all(hasattr(tr, a) for a in ("batch_size", "drop_remainder")):
                kind = "Batch"
        if kind == "Batch":
            ds = ds.batch(tr.batch_size, drop_remainder=tr.drop_remainder, batch_fn=getattr(tr, "batch_fn", None))
        elif kind == "Map":
            ds = ds.map(tr)
        elif kind == "RandomMap":
            ds = ds.random_map(tr)
        elif kind == "MapWithIndex":
            ds = ds.map_with_index(tr)
        elif kind == "Filter":
            ds = ds.filter(tr)
        elif kind == "FlatMap":
            ds = _flat_map(ds, tr)
        else:
            raise NotImplementedError(f"Transformation type: {tr} is not supported.")
    return ds


def _flat_map(ds, transform):
    # Imported here: both modules build on this one's datasets.
    from portable_loader.dataset.flat_map import FlatMapMapDataset
    from portable_loader.dataset.iter.dataset import IterDataset
    from portable_loader.dataset.iter.flat_map import FlatMapIterDataset

    return FlatMapIterDataset(ds, transform) if isinstance(ds, IterDataset) else FlatMapMapDataset(ds, transform)


_KINDS = (("Map", "map"), ("RandomMap", "random_map"), ("MapWithIndex", "map_with_index"), ("FlatMap", "flat_map"),
          ("Filter", "filter"))


def _grain_kind(tr, t) -> str | None:
    if isinstance(tr, t.Batch):
        return "Batch"
    return next((k for k, _ in _KINDS if isinstance(tr, getattr(t, k))), None)


class PassesMixture:
    """A dataset over one ``parent`` whose index ``i`` is the parent's ``i``: it passes the parent's
    mixture capabilities through (``dataset.protocols.Capabilities``): which source a record is, and
    the schedule checks a state carries.

    Example:
        >>> import numpy as np
        >>> from portable_loader.dataset import mix
        >>> m = mix({"a": [{"input_ids": np.arange(2)}], "b": [{"input_ids": np.arange(3)}]}, {"a": 1, "b": 1})
        >>> m.map(dict).locate([1])
        [('b', 0)]
    """

    @property
    def source_groups(self):
        return self.parent.source_groups

    @property
    def locate(self):
        return self.parent.locate

    @property
    def schedule_digests(self):
        return self.parent.schedule_digests

    @property
    def schedule_change(self):
        return self.parent.schedule_change


class _Transform(PassesMixture, Dataset):
    """A dataset over ``parent`` with the same indices, order, format and mixture lookups."""

    parent: Dataset
    reads_epochs = True  # an index past the end goes to the parent as it is

    @property
    def format(self) -> str | None:
        return self.parent.format

    def __len__(self) -> int:
        return len(self.parent)

    def stream_order(self, seed: int, *, shuffle: bool = True, num_epochs: int | None = None):
        return self.parent.stream_order(seed, shuffle=shuffle, num_epochs=num_epochs)

    _callable_attr: str  # the attribute holding the user's function: "fn" or "pred"

    def _with_parent(self, parent: Dataset) -> "_Transform":
        raise NotImplementedError

    def _name_function(self) -> None:
        """Take the function's identity now, as the step is built (:func:`function_identity`)."""
        fn = self.__dict__[self._callable_attr]
        self._fn_id = ("name", self.name) if self.name is not None else function_identity(fn)

    def _identity(self) -> tuple:
        return (self.parent.fingerprint(), self._fn_id)

    def reopen(self) -> "_Transform":
        parent = self.parent.reopen()
        if parent is self.parent:
            return self
        view = self._with_parent(parent)
        view._fn_id = self._fn_id  # named as the step was built, whatever the function did since
        return view


def _label(kind: str, fn, name: str | None) -> str:
    return f"{kind} {name or getattr(fn, '__qualname__', type(fn).__qualname__)}"


class Map(_Transform):
    """Records ``fn(parent[i])``, computed on read; built by :meth:`Dataset.map`.

    ``name``: what identifies ``fn`` in the fingerprint, instead of its qualified name (or, for a
    lambda or nested function, its code): change it when ``fn``'s output changes. ``keeps_lengths``:
    a promise that ``fn`` leaves ``len(record["input_ids"])`` as it is, so ``lengths`` asks the parent
    (a cache answers without decoding) instead of mapping records; every read checks the promise and
    a broken one raises ``ValueError``. It does not enter the fingerprint: a true promise changes no
    batch. A record a filter below rejected (None) stays None.

    Example:
        >>> from portable_loader.dataset import source
        >>> crop = source([{"input_ids": list(range(5))}]).map(lambda r: {"input_ids": r["input_ids"][:2]})
        >>> crop.lengths([0]).tolist()
        [2]
        >>> bad = source([{"input_ids": list(range(5))}]).map(lambda r: {"input_ids": r["input_ids"][:2]}, keeps_lengths=True)
        >>> bad[0]
        Traceback (most recent call last):
        ...
        ValueError: map <lambda> promised keeps_lengths but changed record 0 from 5 to 2 tokens
    """

    _callable_attr = "fn"

    def __init__(self, parent: Dataset, fn: Callable[[Any], Any], *, name: str | None = None, keeps_lengths: bool = False):
        fn = as_function(fn, "map", "Map", refuse=("random_map", "map_with_index"))
        if name is not None and not isinstance(name, str):
            raise TypeError(f"map(name=...) must be a string, got {type(name).__name__}")
        self.parent, self.fn, self.name, self.keeps_lengths = parent, fn, name, bool(keeps_lengths)
        self._name_function()
        self.cheap_lengths = self.keeps_lengths and parent.cheap_lengths
        self.fork_hazard = parent.fork_hazard
        self.filters = parent.filters
        # Over a source that tokenizes on read, the loader's workers tokenize packing windows ahead
        # through this map (see the tokenize-ahead methods below).
        self.tokenizes_ahead = bool(parent.tokenizes_ahead)
        # The lengths of fn's records, once known: without keeps_lengths they are not the parent's,
        # and each one costs a tokenization and a call of fn. 8 bytes a record, made on first use.
        self._lengths: np.ndarray | None = None

    @property
    def shard_rows(self) -> list[int] | None:
        return self.parent.shard_rows  # one record out per record in: the parent's shards

    def __getitems__(self, indices) -> list:
        records = self.parent.__getitems__(within(self.parent, indices))
        out = [None if r is None else self.fn(r) for r in records]
        if self.keeps_lengths:
            for i, before, after in zip(indices, records, out):
                if before is not None and len(before["input_ids"]) != len(after["input_ids"]):
                    raise ValueError(
                        f"{_label('map', self.fn, self.name)} promised keeps_lengths but "
                        f"changed record {int(i)} from {len(before['input_ids'])} to {len(after['input_ids'])} tokens"
                    )
        return out

    def lengths(self, indices) -> np.ndarray:
        if self.keeps_lengths:
            return self.parent.lengths(within(self.parent, indices))
        idx = as_indices(indices)
        if not self.tokenizes_ahead or (idx.size and (idx.min() < 0 or idx.max() >= len(self))):
            return super().lengths(indices)
        known = self._known()
        out = known[idx]
        rest = np.flatnonzero(out < 0)
        if rest.size:
            out[rest] = known[idx[rest]] = super().lengths(idx[rest])
        return out

    def accepts(self, indices) -> np.ndarray:
        return self.parent.accepts(within(self.parent, indices))

    # --- tokenizing ahead in the loader's workers (engine/ahead.py), over a tokenizing parent -----
    # With keeps_lengths a length is the parent's: every call goes to the parent as it is. Without
    # it, the lengths planned are those of fn's records, so this map keeps its own: a worker
    # tokenizes through the parent (which hands the tokens over to the other workers), applies fn
    # and answers the mapped lengths; the main process learns them here, never the parent's.

    def _known(self) -> np.ndarray:
        if self._lengths is None:
            self._lengths = np.full(len(self), -1, dtype=np.int64)
        return self._lengths

    def unknown(self, indices) -> np.ndarray:
        """The distinct ``indices`` whose length the planner does not know yet, ascending (over a
        parent that tokenizes ahead: ``pl.tokenized``, or a mixture of it).

        Example:
            >>> import portable_loader as pl
            >>> from portable_loader.precache import sample_args
            >>> ds = pl.tokenized(**sample_args()).map(lambda r: dict(r, input_ids=r["input_ids"][:8]))
            >>> ds.tokenizes_ahead, ds.unknown([3, 1, 3]).tolist()
            (True, [1, 3])
            >>> ds.lengths([1]).tolist(), ds.unknown([3, 1]).tolist()   # fn's record is 8 tokens long
            ([8], [3])
        """
        if self.keeps_lengths:
            return self.parent.unknown(within(self.parent, indices))
        idx = np.unique(np.asarray(indices, dtype=np.int64))
        return idx[self._known()[idx] < 0]

    def tokenize_ahead(self, indices: np.ndarray, name: str) -> np.ndarray:
        """(In a loader worker) tokenize ``indices`` through the parent, which hands their tokens over
        as file ``name``, and return the lengths of this map's records.

        Example:
            >>> import portable_loader as pl
            >>> from portable_loader.precache import sample_args
            >>> ds = pl.tokenized(**sample_args()).map(lambda r: dict(r, input_ids=r["input_ids"][:20]))
            >>> ds.tokenize_ahead(np.array([4, 9]), "w0-p1").tolist()   # the parent's: 34 and 17 tokens
            [20, 17]
            >>> ds.drop_handover()
        """
        lengths = self.parent.tokenize_ahead(within(self.parent, indices), name)
        if self.keeps_lengths:
            return lengths
        return super().lengths(indices)  # the parent's records are in its memo now: fn only

    def learn(self, indices: np.ndarray, lengths: np.ndarray) -> None:
        """(In the main process) take lengths a worker computed by :meth:`tokenize_ahead`."""
        if self.keeps_lengths:
            self.parent.learn(within(self.parent, indices), lengths)
        else:
            self._known()[np.asarray(indices, dtype=np.int64)] = lengths

    def drop_handover(self, name: str | None = None) -> None:
        """Remove the parent's hand-over file ``name``, or all of them (``None``)."""
        self.parent.drop_handover(name)

    def _with_parent(self, parent: Dataset) -> "Map":
        return Map(parent, self.fn, name=self.name, keeps_lengths=self.keeps_lengths)


class Filter(_Transform):
    """The records of ``parent`` for which ``pred(record)`` is True; built by :meth:`Dataset.filter`.

    The index space stays the parent's: a rejected index reads as None (as in Grain's
    ``MapDataset.filter``), and ``accepts(indices)`` says which indices survive. The loader, not the
    dataset, skips rejected records: it asks ``accepts`` for stream positions as it plans, so
    batches stay full, nothing like an index of survivors is ever built, and the loader state stays
    a stream position (rejected positions included). ``pred`` must return a ``bool`` (or, as Grain
    lets it, a number, read by its truth: ``lambda x: x % 2``) and be a pure function of the record: it runs in the process that plans (the loader's main process) on every
    record the stream passes over, and again in a worker on each record it fetches, where a
    record planned as accepted but now rejected raises.

    Records read for the predicate are kept (up to about 2M tokens) for the fetch that follows, so
    without worker processes every record is read once; a worker reads accepted records again.
    ``name``: what identifies ``pred`` in the fingerprint, as for :meth:`Dataset.map`.

    Example:
        >>> import numpy as np
        >>> from portable_loader.dataset import source
        >>> ds = source([{"input_ids": np.arange(n)} for n in (1, 4, 2, 6)]).filter(lambda r: r["input_ids"].size > 1)
        >>> ds.accepts([0, 1, 2, 3]).tolist(), len(ds), ds[0]
        ([False, True, True, True], 4, None)
        >>> source([{"input_ids": [1]}]).filter(lambda r: r["input_ids"]).accepts([0])
        Traceback (most recent call last):
        ...
        TypeError: filter <lambda> returned list for record 0; a predicate must return a bool or a number
        >>> source([1, 2, 3]).filter(lambda x: x % 2).accepts([0, 1, 2]).tolist()
        [True, False, True]
    """

    _callable_attr = "pred"

    def __init__(self, parent: Dataset, pred: Callable[[Any], bool], *, name: str | None = None):
        pred = as_function(pred, "filter", "Filter")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"filter(name=...) must be a string, got {type(name).__name__}")
        self.parent, self.pred, self.name = parent, pred, name
        self._name_function()
        self.label = _label("filter", pred, name)
        self.cheap_lengths = parent.cheap_lengths
        self.fork_hazard = parent.fork_hazard
        self.filters = parent.filters + (self.label,)
        self._memo: OrderedDict = OrderedDict()  # index -> parent record that pred accepted
        self._memo_tokens = 0
        self._lock = threading.Lock()  # describe() may plan in the trainer's thread while a prefetch thread plans

    def _test(self, index: int, record) -> bool:
        ok = self.pred(record)
        # A number's truth is plain; a container's (a token list, None from a missing return) is a bug.
        if not isinstance(ok, (bool, np.bool_, numbers.Number, np.number)):
            raise TypeError(
                f"{self.label} returned {type(ok).__name__} for record {index}; a predicate must return a bool or a number"
            )
        return bool(ok)

    def accepts(self, indices) -> np.ndarray:
        """Whether each of ``indices`` survives this filter (and every filter below it), as bools.

        Example:
            >>> from portable_loader.dataset import source
            >>> ds = source([{"input_ids": [1]}, {"input_ids": []}]).filter(lambda r: len(r["input_ids"]) > 0)
            >>> ds.accepts([1, 0]).tolist()
            [False, True]
        """
        idx = as_indices(indices)
        ok = self.parent.accepts(within(self.parent, idx)) if self.parent.filters else np.ones(idx.size, dtype=bool)
        where = np.flatnonzero(ok)
        if where.size:
            keys = idx[where]
            records = self.parent.__getitems__(within(self.parent, keys))
            kept = []
            for j, i, record in zip(where.tolist(), keys.tolist(), records):
                ok[j] = self._test(i, record)
                if ok[j]:
                    kept.append((i, record))
            self._remember(kept)
        return ok

    def _remember(self, kept: list) -> None:
        with self._lock:
            for i, record in kept:
                if i not in self._memo:
                    self._memo[i] = record
                    self._memo_tokens += _size(record)
            while self._memo_tokens > _MEMO_TOKENS and self._memo:
                self._memo_tokens -= _size(self._memo.popitem(last=False)[1])

    def __getitems__(self, indices) -> list:
        keys = [int(i) for i in (indices.tolist() if isinstance(indices, np.ndarray) else indices)]
        with self._lock:
            # A copy of each kept record: a map above that sets a key in place must not reach the memo.
            out = [_copy(self._memo.get(i)) for i in keys]
        missing = [j for j, r in enumerate(out) if r is None]
        if missing:
            read = self.parent.__getitems__(within(self.parent, as_indices([keys[j] for j in missing])))
            for j, record in zip(missing, read):
                out[j] = record if record is not None and self._test(keys[j], record) else None
        return out

    def lengths(self, indices) -> np.ndarray:
        if self.parent.cheap_lengths:
            return self.parent.lengths(within(self.parent, indices))
        idx = as_indices(indices)
        with self._lock:
            known = [self._memo.get(i) for i in idx.tolist()]
        out = np.empty(idx.size, dtype=np.int64)
        rest = [j for j, r in enumerate(known) if r is None]
        for j, r in enumerate(known):
            if r is not None:
                out[j] = len(r["input_ids"])
        if rest:  # a rejected record has a length too: its parent's
            out[rest] = self.parent.lengths(within(self.parent, idx[rest]))
        return out

    def _with_parent(self, parent: Dataset) -> "Filter":
        return Filter(parent, self.pred, name=self.name)

    def __getstate__(self):  # a spawned worker starts with no memo
        return dict(self.__dict__, _memo=OrderedDict(), _memo_tokens=0, _lock=None)

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())


def _copy(record):
    return dict(record) if isinstance(record, dict) else record


def _size(record) -> int:
    ids = record.get("input_ids") if isinstance(record, dict) else None
    return 1 + (len(ids) if ids is not None else 0)
