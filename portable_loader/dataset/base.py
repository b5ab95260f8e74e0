"""The dataset protocol: what every random-access dataset offers the loader, and its fingerprint.

A dataset is immutable and stateless: ``len``, a batched read ``__getitems__(indices)``, token
``lengths(indices)`` (what a packer needs before it reads anything) and ``fingerprint()``, a short
hex digest of the whole tree (sources, transforms, their names) that a loader state carries so that
a state saved for one pipeline is refused by another. ``reopen()`` gives a worker process its own
file handles. ``dataset[key]`` follows :func:`portable_loader.indexing.parse_index`.

Example:
    >>> import numpy as np
    >>> from portable_loader.dataset import source
    >>> ds = source([{"input_ids": np.arange(n)} for n in (3, 5, 2)])
    >>> len(ds), ds.lengths([2, 0]).tolist()
    (3, [2, 3])
    >>> ds[1]["input_ids"].tolist()
    [0, 1, 2, 3, 4]
    >>> [r["input_ids"].size for r in ds[::2]]
    [3, 2]
    >>> len(ds.fingerprint())
    16

``Dataset`` is also Grain's ``MapDataset`` (``portable_loader.grain.MapDataset`` is this class):
``Dataset.range``, ``source``, ``mix``, ``concatenate``, ``select_from_datasets`` and the methods
``map``, ``filter``, ``random_map``, ``map_with_index``, ``shuffle``, ``slice`` (and ``ds[a:b:c]``),
``batch``, ``repeat``, ``seed``, ``apply``, ``pipe``, ``to_iter_dataset`` and iteration, with
Grain's results, element for element (shuffles in Grain's order, :mod:`portable_loader.dataset.shuffle`).

    >>> from portable_loader.dataset import Dataset
    >>> list(Dataset.range(10).map(lambda x: x * 2)[1:7:2].batch(2))
    [array([2, 6]), array([10])]
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import pickle
import queue
import socket
import threading
import types
from functools import partial, wraps
from typing import Any, Callable, Sequence

import numpy as np

from portable_loader.collate import check_token_records
from portable_loader.dataset.protocols import Capabilities
from portable_loader.indexing import parse_index

__all__ = ["INT64_MAX", "Dataset", "as_indices", "attributes_of", "digest", "exact", "function_identity", "narrow",
           "records_digest", "within"]

_DIGEST_HEX = 16  # 64 bits: states are compared, never looked up among many


class Dataset(Capabilities):
    """Base of every dataset: subclasses define ``__len__``, ``__getitems__`` and ``_identity``.

    ``__getitems__(indices)`` takes a sequence (or 1-D int array) of indices in ``[0, len)`` and
    returns their records in that order; records are dicts with ``input_ids`` (and optionally
    ``loss_mask``) for the loader. ``_identity()`` returns the parts the fingerprint hashes.

    Example:
        >>> class Squares(Dataset):
        ...     def __len__(self): return 4
        ...     def __getitems__(self, indices): return [{"input_ids": np.arange(i * i)} for i in indices]
        ...     def _identity(self): return ("squares", 4)
        >>> Squares().lengths(np.array([3, 1])).tolist()
        [9, 1]
        >>> Squares()[-1]["input_ids"].size
        9
    """

    #: ``MapDataset[int]``, as Grain code annotates and subclasses it (the parameter is not checked).
    __class_getitem__ = classmethod(types.GenericAlias)
    _fingerprint: str | None = None
    #: ``lengths`` answers without reading records (the loader then counts over-long records in
    #: padded mode too; reading every record twice for a count is not worth it).
    cheap_lengths: bool = False
    #: The filters in this tree (their labels); when there are any the loader asks ``accepts``.
    filters: tuple[str, ...] = ()
    #: Whether ``__getitems__``, ``lengths`` and ``accepts`` take indices past ``len`` by Grain's rule
    #: (index ``i`` is position ``i % len`` of epoch ``i // len``: a shuffle below reshuffles, a random
    #: map redraws). Views of this package do; a source does not and is read modulo its length
    #: (:func:`within`), all its epochs being alike.
    reads_epochs: bool = False
    _iter_chunk = 64  # indices per batched read while iterating

    def __init__(self, parents=()):
        # Only a Grain-style subclass calls this (``super().__init__(parent)``); ours set their own fields.
        self._parents = (parents,) if isinstance(parents, Dataset) else tuple(parents)

    @property
    def parents(self) -> tuple:
        """The datasets this one reads, as Grain's ``MapDataset.parents``; ``()`` for a source."""
        own = self.__dict__
        if "parent" in own:
            return (own["parent"],)
        return tuple(own.get("children", ()) or own.get("_parents", ()))

    @property
    def _default_seed(self) -> int | None:
        """Grain's default seed at this node (from the nearest ``seed()`` above), for Grain-style subclasses."""
        from portable_loader.dataset.seeds import default_seed

        return default_seed(self, depth=0)

    @property
    def _parent(self) -> "Dataset":
        """The one parent, as a Grain-style subclass reads it (``self._parent[index]``)."""
        (parent,) = self.parents
        return parent

    @property
    def shard_rows(self) -> list[int] | None:
        """Records per shard of a sharded source (a cache), in index order; None when not sharded.

        ``DataLoader(shuffle="shards")`` groups records by these shards.
        """
        return None

    @property
    def format(self) -> str | None:
        """The record format (``"text"``, ``"alpaca"``, ``"chat"``) when known, else None.

        The loader's ``overlong="auto"`` splits only ``text`` records: a response split off its prompt
        must not be trained on.
        """
        return None

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitems__(self, indices: Sequence[int] | np.ndarray) -> list:
        # A Grain-style subclass defines Grain's methods instead: a batched _getitems, or __getitem__.
        if type(self)._getitems is not Dataset._getitems:
            return list(self._getitems([int(i) for i in indices]))
        if type(self).__getitem__ is not Dataset.__getitem__:
            return [self[int(i)] for i in indices]
        raise NotImplementedError(f"{type(self).__name__} defines neither __getitems__ nor __getitem__")

    def _getitems(self, indices: Sequence[int]) -> list:
        """Grain's name for the batched read: ``__getitems__``."""
        return self.__getitems__(indices)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__ and cls._identity is Dataset._identity:
            cls.__init__ = _naming_at_build(cls.__dict__["__init__"])

    def _identity(self) -> tuple:
        """What a Grain-style subclass (one that defines no ``_identity``) is fingerprinted by: its class,
        its attributes as its constructor left them (:func:`attributes_of`) and its parents'
        fingerprints, or, without parents, its content (as :func:`records_digest` samples it)."""
        fields = self.__dict__.get("_built_fields")
        if fields is None:  # a subclass that defines no __init__ of its own
            fields = _own_fields(self)
        parents = self.parents
        content = records_digest(self.__getitems__, len(self)) if not parents else None
        return (_qualified(type(self)), fields, tuple(p.fingerprint() for p in parents), content)

    def lengths(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Token counts (``len(record["input_ids"])``) of the records at ``indices``, as int64."""
        records = self.__getitems__(indices)
        check_token_records(indices, records)
        return np.asarray([len(r["input_ids"]) for r in records], dtype=np.int64)

    def accepts(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Whether each record at ``indices`` survives the filters in this tree (all True without any)."""
        return np.ones(np.asarray(indices).size, dtype=bool)

    def fingerprint(self) -> str:
        """A 16-hex-digit digest of the whole tree: equal for equal pipelines over equal content."""
        if self._fingerprint is None:
            # Immutable, so computed once; object.__setattr__ keeps subclasses free to freeze attributes.
            object.__setattr__(self, "_fingerprint", digest(type(self).__qualname__, *self._identity()))
        return self._fingerprint

    def stream_order(self, seed: int, *, shuffle: bool = True, num_epochs: int | None = None):
        """The order the loader serves this dataset in: stream position -> index, keyed by ``seed``.

        A plain dataset is shuffled by the LCG sampler, a fresh permutation per epoch; a mixture
        (:mod:`portable_loader.dataset.mix.mixture`) brings its own order, which the loader must not shuffle.

        Example:
            >>> from portable_loader.dataset import source
            >>> sorted(source([{"input_ids": [1]}] * 4).stream_order(0).stream_indices(range(4)).tolist())
            [0, 1, 2, 3]
        """
        from portable_loader.orders.sampler import LCGSampler

        return LCGSampler(len(self), seed=seed, shuffle=shuffle, num_epochs=num_epochs)

    def reopen(self) -> "Dataset":
        """This dataset with its own file handles (what a forked worker needs); ``self`` if it has none."""
        return self

    def __getitem__(self, key):
        """``ds[i]`` a record (None where a filter rejected it), ``ds[a:b:c]`` a :meth:`slice` view,
        ``ds[[i, j]]`` a list of records.

        An integer ``i >= len(ds)`` reads epoch ``i // len(ds)`` at ``i % len(ds)``, as Grain does: a
        shuffle below draws that epoch's order, a random map that epoch's seeds (``repeat`` reads
        epochs the same way). A list or array of indices (not Grain's) stays bounds-checked, as do
        ``__getitems__`` of sources and caches: an ``IndexError`` there is a caller's bug, not an
        epoch. A negative index below ``-len(ds)``, an empty dataset or a key that is not an
        integer, a slice or a sequence of integers raises.

        Example:
            >>> from portable_loader.dataset import Dataset
            >>> ds = Dataset.range(4).shuffle(seed=0)
            >>> sorted(ds[i] for i in range(4, 8)), [ds[i] for i in range(4)] == ds[[0, 1, 2, 3]]
            ([0, 1, 2, 3], True)
        """
        if isinstance(key, slice):
            return self.slice(key)
        n = len(self)
        if n and _is_index(key) and int(key) >= n:
            return self.__getitems__(within(self, [int(key)]))[0]
        idx = parse_index(key, n)
        if isinstance(idx, int):
            return self.__getitems__([idx])[0]
        return list(self.__getitems__(idx.tolist()))

    def __iter__(self):
        """The records in index order, skipping the None a filter leaves, as Grain's ``iter(MapDataset)``:
        a :class:`~portable_loader.dataset.iter.iterator.DatasetIterator` of ``to_iter_dataset()``, so
        it has ``get_state``/``set_state``; lazy, so an infinite (``repeat()``) dataset can be iterated too.

        Example:
            >>> from portable_loader.dataset import Dataset
            >>> it = iter(Dataset.range(6).filter(lambda x: x % 3 > 0))
            >>> next(it), it.get_state()["cursor"]
            (1, {'0.source.position': '00000000000000000002'})
            >>> list(it)
            [2, 4, 5]
        """
        return iter(self.to_iter_dataset())

    # --- Grain's MapDataset constructors -------------------------------------------------------

    @staticmethod
    def source(obj) -> "Dataset":
        """``MapDataset.source``: ``obj`` as a dataset (:func:`portable_loader.dataset.source`).

        Example:
            >>> list(Dataset.source(["a", "b"]))
            ['a', 'b']
        """
        from portable_loader.dataset.sources import source

        return source(obj)

    @staticmethod
    def range(start: int, stop: int | None = None, step: int = 1) -> "Dataset":
        """``MapDataset.range``: the integers of ``range(start, stop, step)`` (:class:`~portable_loader.dataset.ranges.Range`).

        Example:
            >>> list(Dataset.range(2, 9, 3))
            [2, 5, 8]
        """
        from portable_loader.dataset.ranges import Range

        return Range(start, stop, step)

    @staticmethod
    def mix(datasets: Sequence, weights: Sequence[float] | None = None) -> "Dataset":
        """``MapDataset.mix``: Grain's proportional interleaving, element for element (:mod:`~portable_loader.dataset.mix.combine`).

        Its length is the longest for which no dataset is read past its end. (``pl.mix`` is the
        loader's exact-weight mixture of named sources, a different thing.)

        Example:
            >>> list(Dataset.mix([Dataset.range(5), Dataset.range(7, 10)]))
            [0, 7, 1, 8, 2, 9]
        """
        from portable_loader.dataset.mix.combine import mix_datasets

        return mix_datasets(datasets, weights)

    @staticmethod
    def concatenate(datasets: Sequence) -> "Dataset":
        """``MapDataset.concatenate``: the datasets one after the other.

        Example:
            >>> list(Dataset.concatenate([Dataset.range(3), Dataset.range(3, 5)]))
            [0, 1, 2, 3, 4]
        """
        from portable_loader.dataset.mix.combine import concatenate

        return concatenate(datasets)

    @staticmethod
    def select_from_datasets(datasets: Sequence, selection_map) -> "Dataset":
        """``MapDataset.select_from_datasets``: element ``i`` is ``datasets[d][k]`` for ``(d, k) = selection_map[i]``.

        Example:
            >>> list(Dataset.select_from_datasets([Dataset.range(3), Dataset.range(10, 13)], [(1, 0), (0, 2)]))
            [10, 2]
        """
        from portable_loader.dataset.mix.combine import select_from_datasets

        return select_from_datasets(datasets, selection_map)

    # --- transformations -----------------------------------------------------------------------

    def map(self, transform, *, name: str | None = None, keeps_lengths: bool = False) -> "Dataset":
        """A lazy view whose records are ``transform(record)``; see :class:`portable_loader.dataset.transforms.Map`.

        ``transform`` is a callable or a Grain ``transforms.Map`` (its ``map`` method is called).

        Example:
            >>> from portable_loader.dataset import source
            >>> ds = source([{"input_ids": np.arange(3)}]).map(lambda r: {"input_ids": r["input_ids"] * 2})
            >>> ds[0]["input_ids"].tolist()
            [0, 2, 4]
        """
        from portable_loader.dataset.transforms import Map

        return Map(self, transform, name=name, keeps_lengths=keeps_lengths)

    def filter(self, transform, *, name: str | None = None) -> "Dataset":
        """A lazy view of the records for which ``transform`` is True (:class:`~portable_loader.dataset.transforms.Filter`).

        ``transform`` is a predicate or a Grain ``transforms.Filter``. The loader skips rejected
        records as it plans, so batches stay full and a state stays a stream position (docs/datasets.md).

        Example:
            >>> from portable_loader.dataset import source
            >>> ds = source([{"input_ids": np.arange(n)} for n in (3, 0, 2)]).filter(lambda r: r["input_ids"].size > 0)
            >>> ds.accepts([0, 1, 2]).tolist()
            [True, False, True]
        """
        from portable_loader.dataset.transforms import Filter

        return Filter(self, transform, name=name)

    def random_map(self, transform, *, seed: int | None = None, name: str | None = None) -> "Dataset":
        """Records ``transform(record, rng)`` with ``rng`` a numpy ``Generator`` keyed by ``(seed, index)``
        (:class:`~portable_loader.dataset.random_map.RandomMap`).

        Example:
            >>> a = Dataset.range(4).random_map(lambda x, rng: x + int(rng.integers(100)), seed=1)
            >>> list(a) == list(Dataset.range(4).random_map(lambda x, rng: x + int(rng.integers(100)), seed=1))
            True
        """
        from portable_loader.dataset.random_map import RandomMap

        return RandomMap(self, transform, seed=seed, name=name)

    def map_with_index(self, transform, *, name: str | None = None) -> "Dataset":
        """Records ``transform(index, record)`` (:class:`~portable_loader.dataset.random_map.MapWithIndex`).

        Example:
            >>> list(Dataset.source(["a", "b"]).map_with_index(lambda i, x: x + str(i)))
            ['a0', 'b1']
        """
        from portable_loader.dataset.random_map import MapWithIndex

        return MapWithIndex(self, transform, name=name)

    def shuffle(self, seed: int | None = None) -> "Dataset":
        """The records in a keyed order, a fresh one per epoch (:class:`~portable_loader.dataset.shuffle.Shuffle`).

        Example:
            >>> sorted(Dataset.range(5).shuffle(seed=3)) == [0, 1, 2, 3, 4]
            True
        """
        from portable_loader.dataset.shuffle import Shuffle

        return Shuffle(self, seed=seed)

    def slice(self, sl: slice) -> "Dataset":
        """The records at the indices of ``sl``, as Python slices them (:class:`~portable_loader.dataset.slicing.Slice`).

        Example:
            >>> list(Dataset.range(10).slice(slice(8, 1, -3)))
            [8, 5, 2]
        """
        from portable_loader.dataset.slicing import Slice

        return Slice(self, sl)

    def batch(self, batch_size: int, *, drop_remainder: bool = False, batch_fn=None) -> "Dataset":
        """Consecutive records stacked along a new first axis (:class:`~portable_loader.dataset.batch.Batch`).

        Example:
            >>> list(Dataset.range(5).batch(2, drop_remainder=True))
            [array([0, 1]), array([2, 3])]
        """
        from portable_loader.dataset.batch import Batch

        return Batch(self, batch_size, drop_remainder=drop_remainder, batch_fn=batch_fn)

    def repeat(self, num_epochs: int | None = None, *, reseed_each_epoch: bool = True) -> "Dataset":
        """The records ``num_epochs`` times over, or endlessly (length ``sys.maxsize``) (:class:`~portable_loader.dataset.repeat.Repeat`).

        Example:
            >>> list(Dataset.range(3).repeat(2))
            [0, 1, 2, 0, 1, 2]
        """
        from portable_loader.dataset.repeat import Repeat

        return Repeat(self, num_epochs, reseed_each_epoch=reseed_each_epoch)

    def seed(self, seed: int) -> "Dataset":
        """This dataset, with ``seed`` as the seed that unseeded random transforms below derive theirs from
        (:class:`~portable_loader.dataset.seeds.WithSeed`).

        Example:
            >>> sorted(Dataset.range(4).seed(0).shuffle())
            [0, 1, 2, 3]
        """
        from portable_loader.dataset.seeds import WithSeed

        return WithSeed(self, seed)

    def apply(self, transformations) -> "Dataset":
        """Grain transform objects (``Map``, ``RandomMap``, ``MapWithIndex``, ``Filter``, ``Batch``), applied in order.

        Example:
            >>> import grain
            >>> class Twice(grain.transforms.Map):
            ...     def map(self, x): return 2 * x
            >>> list(Dataset.range(5).apply([Twice(), grain.transforms.Batch(2)]))
            [array([0, 2]), array([4, 6]), array([8])]
        """
        from portable_loader.dataset.transforms import apply_transformations

        return apply_transformations(self, transformations)

    def pipe(self, func: Callable[..., Any], /, *args, **kwargs):
        """``func(self, *args, **kwargs)``: a transformation written as a function, kept in a method chain.

        Example:
            >>> Dataset.range(6).pipe(lambda ds, k: ds[::k], 2)[2]
            4
        """
        return func(self, *args, **kwargs)

    def to_iter_dataset(self, read_options=None, *, allow_nones: bool = False):
        """This dataset as a Grain-style ``IterDataset`` (:mod:`portable_loader.dataset.iter.dataset`)."""
        from portable_loader.dataset.iter.dataset import to_iter_dataset

        return to_iter_dataset(self, read_options, allow_nones=allow_nones)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(records={len(self)}, fingerprint={self.fingerprint()})"


def _naming_at_build(init):
    """``init``, then the instance's fields taken once, as its constructor leaves them: a subclass that
    fills a cache or opens a file on its first read keeps the fingerprint it was built with."""

    @wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        # Each level of a subclass chain takes them; the outermost, last to return, has the last word.
        object.__setattr__(self, "_built_fields", _own_fields(self))

    return __init__


def _own_fields(ds) -> dict:
    skip = ("_parents", "_fingerprint", "_built_fields")
    return _plain({k: v for k, v in attributes_of(ds).items() if k not in skip})


def _is_index(key) -> bool:
    return isinstance(key, (int, np.integer)) and not isinstance(key, bool)


#: The largest index an int64 holds. An index past it is legal: epoch ``e >= 1`` of an endless
#: (``sys.maxsize`` long) dataset starts at ``e * sys.maxsize``, and Grain, in Python integers, reads it there.
INT64_MAX = int(np.iinfo(np.int64).max)


def as_indices(indices) -> np.ndarray:
    """``indices`` (a sequence or array of integers) as a flat int64 array, or, where one is past
    :data:`INT64_MAX`, an array of Python integers (dtype object), which numpy's arithmetic keeps exact.

    Example:
        >>> as_indices([3, 1]).tolist()
        [3, 1]
        >>> import sys; as_indices([1, 2 * sys.maxsize]).dtype
        dtype('O')
    """
    try:
        return np.asarray(indices, dtype=np.int64).reshape(-1)
    except OverflowError:
        return np.asarray([int(i) for i in np.asarray(indices, dtype=object).reshape(-1)], dtype=object)


def exact(indices: np.ndarray, largest: int) -> np.ndarray:
    """``indices`` ready for arithmetic whose results reach ``largest``: as Python integers where that
    is past :data:`INT64_MAX` (an int64 would wrap silently), else as they are.

    Example:
        >>> import sys; exact(np.arange(2), 2 * sys.maxsize).dtype, exact(np.arange(2), 10).dtype
        (dtype('O'), dtype('int64'))
    """
    return indices.astype(object) if largest > INT64_MAX and indices.dtype != object else indices


def narrow(indices: np.ndarray) -> np.ndarray:
    """``indices`` as int64 where every one fits (the fast path below), else unchanged.

    Example:
        >>> import sys; narrow(np.array([1, 2], dtype=object)).dtype, narrow(np.array([2 * sys.maxsize], dtype=object)).dtype
        (dtype('int64'), dtype('O'))
    """
    if indices.dtype == object and (not indices.size or (min(indices) >= -INT64_MAX and max(indices) <= INT64_MAX)):
        return indices.astype(np.int64)
    return indices


def within(ds: Dataset, indices):
    """``indices`` as ``ds`` takes them: unchanged where ``ds`` reads epochs (or all are in range),
    else modulo ``len(ds)``, as Grain's source reads an index past its end.

    Example:
        >>> from portable_loader.dataset import source
        >>> within(source([1, 2, 3]), [1, 4, 6]).tolist()
        [1, 1, 0]
    """
    if ds.reads_epochs:
        return indices
    idx = as_indices(indices)
    n = len(ds)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        if n == 0:
            raise IndexError("cannot read from an empty dataset")
        return narrow(idx % n)
    return indices


# --- digests ------------------------------------------------------------------------------------


def digest(*parts) -> str:
    """A short hex digest of values (strings, numbers, arrays, dicts, lists, ...), canonically encoded.

    Example:
        >>> digest("a", 1) == digest("a", 1) != digest("a", 2)
        True
    """
    h = hashlib.blake2b(digest_size=_DIGEST_HEX // 2)
    for part in parts:
        _feed(h, part)
    return h.hexdigest()


def _feed(h, value) -> None:
    """Type-tagged, length-prefixed encoding, so that ("ab", "c") and ("a", "bc") differ."""

    def put(tag: bytes, payload: bytes) -> None:
        h.update(tag + len(payload).to_bytes(8, "little") + payload)

    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        put(b"s", f"{type(value).__name__}:{value!r}".encode())
    elif isinstance(value, (np.ndarray, np.generic)):
        a = np.ascontiguousarray(value)
        put(b"a", f"{a.dtype.str}{a.shape}".encode())
        put(b"d", a.tobytes())
    elif isinstance(value, dict):
        put(b"m", str(len(value)).encode())
        for k in sorted(value, key=repr):
            _feed(h, k)
            _feed(h, value[k])
    elif isinstance(value, (list, tuple)):
        put(b"l", f"{type(value).__name__}:{len(value)}".encode())
        for v in value:
            _feed(h, v)
    elif isinstance(value, (set, frozenset)):  # iteration order depends on the process's hash seed
        put(b"e", str(len(value)).encode())
        for v in sorted(value, key=repr):
            _feed(h, v)
    else:
        # Anything else by its pickle: deterministic for plain data, and never a memory address.
        try:
            put(b"p", pickle.dumps(value, protocol=4))
        except Exception:  # noqa: BLE001 - unpicklable (a lock, a lambda): its type is all we can name
            put(b"t", _qualified(type(value)).encode())


# Up to this many records a content digest reads them all; above it, this many at fixed positions.
SMALL = 1024
SAMPLE = 64


def records_digest(read: Callable[[list[int]], list], n: int) -> str:
    """Digest of ``n`` and of the records ``read`` returns: all of them if ``n <= SMALL``, else ``SAMPLE``
    at fixed, evenly spread positions (first and last included).

    Sampling keeps a loader's start-up O(1) on large sources while still catching a different
    corpus, a reordering or a re-tokenization (they change almost every record); an edit to a few
    records between sample positions goes unnoticed, which is why caches, whose manifest carries a
    checksum of every record, are fingerprinted by that instead. A record that cannot be read hashes
    as its error's type: the read fails again, with its traceback, when the loader needs it.

    Example:
        >>> records_digest(lambda ix: [{"x": i} for i in ix], 3) == records_digest(lambda ix: [{"x": i} for i in ix], 3)
        True
    """
    positions = list(range(n)) if n <= SMALL else np.linspace(0, n - 1, SAMPLE).round().astype(int).tolist()
    try:
        records = read(positions)
    except Exception:  # one bad record should not hide the others: read them one by one
        records = []
        for p in positions:
            try:
                records.append(read([p])[0])
            except Exception as e:  # noqa: BLE001 - see the docstring
                records.append(("unreadable", type(e).__qualname__))
    return digest(n, positions, records)


def function_identity(fn) -> tuple:
    """What names a transform's function in a fingerprint.

    A module-level function or class is named by ``module.qualname`` (stable across Python versions
    and edits: give ``name=`` a new value, or rename the function, when its output changes). A lambda or
    a function defined inside another one has no unique name, so its code is hashed instead (bytecode,
    constants, names) together with the plain values it closes over (bytecode differs between
    Python versions: give such a function a ``name=`` when a run must resume after an upgrade);
    ``functools.partial`` adds its arguments; a callable object (a Grain transform) is named by its
    class and :func:`attributes_of` it.

    A pipeline step calls this once, when it is built, and keeps the result: what a transform does
    to itself while it runs (a tokenizer made on first use, a call counter) never reaches a
    fingerprint, so the same pipeline built again, in this process or a new one, accepts its state.

    Example:
        >>> function_identity(len)
        ('builtins.len',)
        >>> function_identity(lambda r: r + 1) != function_identity(lambda r: r + 2)
        True
    """
    if isinstance(fn, partial):
        return ("partial", function_identity(fn.func), _plain(fn.args), _plain(fn.keywords))
    if isinstance(fn, types.MethodType):
        return ("method", function_identity(fn.__func__), _qualified(type(fn.__self__)), _plain(attributes_of(fn.__self__)))
    qualname = getattr(fn, "__qualname__", None)
    if isinstance(fn, types.FunctionType) and ("<lambda>" in qualname or "<locals>" in qualname):
        cells = [c.cell_contents if _filled(c) else None for c in fn.__closure__ or ()]
        return (_qualified(fn), _code(fn.__code__), _plain(cells), _plain(fn.__defaults__))
    if qualname is not None:
        return (_qualified(fn),)
    return ("object", _qualified(type(fn)), _plain(attributes_of(fn)))


# What an object holds only while it runs: never part of what it is.
_RUNTIME = (type(threading.Lock()), type(threading.RLock()), threading.Condition, threading.Event,
            threading.Semaphore, threading.Thread, threading.local, io.IOBase, socket.socket, queue.Queue,
            types.GeneratorType)


def attributes_of(obj) -> dict:
    """What names an object in a fingerprint: a dataclass's constructor fields (``init=True``), any
    other object's attributes; locks, threads, open files, sockets, queues and generators left out.

    Fields set in ``__post_init__`` (a processor made on first use, its lock) are not what the
    dataclass was built with; a plain class has no such line between its arguments and its caches,
    so it is named by all its attributes, as they are when the pipeline step is built.

    Example:
        >>> import dataclasses, threading
        >>> @dataclasses.dataclass
        ... class Tokenize:
        ...     max_len: int
        ...     def __post_init__(self):
        ...         self._processor, self._lock = None, threading.Lock()
        >>> attributes_of(Tokenize(8))
        {'max_len': 8}
        >>> class Plain:
        ...     def __init__(self): self.n, self.log = 3, open(__file__)
        >>> p = Plain(); attributes_of(p), p.log.close()
        ({'n': 3}, None)
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        own = {f.name: getattr(obj, f.name, None) for f in dataclasses.fields(obj) if f.init}
    else:
        own = vars_of(obj)
    return {k: v for k, v in own.items() if not isinstance(v, _RUNTIME)}


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a closure variable not assigned yet
        return False
    return True


def vars_of(obj) -> dict:
    try:
        return dict(vars(obj))
    except TypeError:
        return {}


# A fingerprint names our classes by the module they were first released in: the folders were laid
# out anew (docs/design.md, "Layout"), and states saved before that must still load.
_FIRST_MODULE = {
    "portable_loader.corpora.pretokenized": "portable_loader.dataset.pretokenized",
    "portable_loader.corpora.spill": "portable_loader.dataset.spill",
    "portable_loader.corpora.tokenized": "portable_loader.dataset.tokenized",
    "portable_loader.corpora.windows": "portable_loader.dataset.windows",
    "portable_loader.dataset.iter.concat_split": "portable_loader.dataset.iter_concat_split",
    "portable_loader.dataset.iter.dataset": "portable_loader.dataset.iter_dataset",
    "portable_loader.dataset.iter.flat_map": "portable_loader.dataset.iter_flat_map",
    "portable_loader.dataset.iter.iterator": "portable_loader.dataset.iter_iterator",
    "portable_loader.dataset.iter.mp_prefetch": "portable_loader.dataset.mp_prefetch",
    "portable_loader.dataset.iter.ops": "portable_loader.dataset.iter_ops",
    "portable_loader.dataset.iter.options": "portable_loader.dataset.iter_options",
    "portable_loader.dataset.iter.pack": "portable_loader.dataset.iter_pack",
    "portable_loader.dataset.iter.repeat": "portable_loader.dataset.iter_repeat",
    "portable_loader.dataset.iter.runtime": "portable_loader.dataset.iter_runtime",
    "portable_loader.dataset.iter.window_shuffle": "portable_loader.dataset.iter_window_shuffle",
    "portable_loader.dataset.mix.combine": "portable_loader.dataset.combine",
    "portable_loader.dataset.mix.mixture": "portable_loader.dataset.mixture",
    "portable_loader.dataset.mix.order": "portable_loader.dataset.order",
    "portable_loader.orders.index_shuffle": "portable_loader.dataset.index_shuffle",
    "portable_loader.orders.keyed": "portable_loader.keyed",
    "portable_loader.orders.sampler": "portable_loader.sampler",
    "portable_loader.orders.shard_order": "portable_loader.dataset.shard_order",
}


def _qualified(obj) -> str:
    module = getattr(obj, "__module__", None)
    return f"{_FIRST_MODULE.get(module, module)}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _code(code: types.CodeType) -> tuple:
    consts = tuple(_code(c) if isinstance(c, types.CodeType) else _plain(c) for c in code.co_consts)
    return (code.co_code, consts, code.co_names)


def _plain(value, depth: int = 0):
    """``value`` if it is plain data (what a digest can hash stably), else its type's name."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, np.ndarray, np.generic)):
        return value
    if depth > 4:  # a self-referencing closure or structure: its type must do
        return ("object", _qualified(type(value)))
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):  # by content, in an order that does not depend on the hash seed
        return ("set", tuple(sorted((_plain(v, depth + 1) for v in value), key=repr)))
    if isinstance(value, types.FunctionType) and value.__closure__:
        return (_qualified(value), _code(value.__code__))
    if callable(value):
        return function_identity(value)
    return ("object", _qualified(type(value)))
