"""Grain's ``IterDataset`` API over our random-access datasets, with a state that is a stream position.

``to_iter_dataset(ds)`` turns a random-access dataset (anything :func:`portable_loader.dataset.source`
accepts) into an :class:`IterDataset`: its elements in index order, holes (None, what a filter
leaves) skipped. On it, Grain 0.2.18's methods: ``map``, ``random_map``, ``filter``,
``map_with_index``, ``batch``, ``seed``, ``mp_prefetch`` (and the deprecated ``prefetch``),
``apply``, ``pipe`` and ``IterDataset.mix``, with Grain's results: a pipeline built here gives the
elements Grain gives without worker processes, ``random_map``'s random numbers included.

What Grain lacks, and the point of this module (docs/design.md, promises 1 to 3 and 7):

- ``get_state()`` is a stream position: the source position of the next element plus a count per
  ``random_map`` / ``map_with_index`` and an index per mixture, each written with a fixed number of
  digits. It is a few hundred bytes of JSON, the same size at element 10 and at element 10**7, and
  ``set_state`` is O(1): nothing is replayed.
- Restoring gives exactly the continuation, mid-epoch, after filters and batches.
- ``mp_prefetch(MultiprocessingOptions(num_workers=N))`` gives the same stream for every ``N``
  (0 included), and a state saved with ``N`` workers restores with ``M``
  (:mod:`portable_loader.dataset.iter.mp_prefetch`).
- A state carries the pipeline's fingerprint (source, operations, functions, seeds) and a digest of
  its fields: a state of another pipeline, or an edited one, is refused with a ``StateError``.

The pieces: this module builds the (immutable) pipeline; :mod:`~portable_loader.dataset.iter.iterator`
compiles it into an iterator and owns the state format; :mod:`~portable_loader.dataset.iter.ops` and
:mod:`~portable_loader.dataset.iter.runtime` compute elements; :mod:`~portable_loader.dataset.iter.mp_prefetch`
runs the per-element operations in worker processes.

Example:
    >>> from portable_loader.dataset import source
    >>> ds = to_iter_dataset(source(list(range(10)))).filter(lambda x: x % 3 != 0).batch(2)
    >>> it = iter(ds)
    >>> next(it).tolist(), next(it).tolist()
    ([1, 2], [4, 5])
    >>> state = it.get_state()
    >>> rest = list(it)
    >>> it2 = iter(ds); it2.set_state(state)
    >>> [b.tolist() for b in it2] == [b.tolist() for b in rest] == [[7, 8]]
    True
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from portable_loader.dataset.base import Dataset, digest, function_identity
from portable_loader.dataset.iter.opaque import is_opaque, nested, nesting, opaque_identity, record_arguments
from portable_loader.dataset.iter.ops import ElementOp
from portable_loader.dataset.iter.runtime import int_proportions
from portable_loader.dataset.seeds import default_seed

if TYPE_CHECKING:  # at run time, through __getattr__ below: its module imports this one
    from portable_loader.dataset.iter.iterator import DatasetIterator

__all__ = ["DatasetIterator", "IterDataset", "to_iter_dataset"]

_GRAIN_MP_DEFAULT_WORKERS = 10  # grain's mp_prefetch(options=None)


def to_iter_dataset(ds, read_options=None, allow_nones: bool = False) -> "IterDataset":
    """An :class:`IterDataset` over the random-access dataset ``ds``: its elements in index order.

    ``ds`` is anything :func:`portable_loader.dataset.source` accepts (one of our datasets, a Grain
    ``MapDataset``, a list, ...). Holes (None, where a ``MapDataset`` filter rejected an element) are
    skipped unless ``allow_nones``. Reads are batched (``ds.__getitems__`` over chunks of 1, 2,
    4, ... up to 64 positions after a start), and start at the first ``next``. ``read_options``
    (a ``grain.ReadOptions``): with ``num_threads`` and ``prefetch_buffer_size`` both positive, that
    many threads (at most one per chunk ahead) read up to ``prefetch_buffer_size`` elements ahead;
    the elements do not depend on it. Without
    ``read_options`` nothing is read ahead (Grain would start 16 threads): threads helped a local
    cache (40,000 records in 0.07 s instead of 0.13 s) but slowed a ``MapDataset`` whose map is
    Python code (100,000 in 0.39 s instead of 0.29 s, the GIL), and ``mp_prefetch`` is the tool for
    CPU-bound work. Pass ``ReadOptions`` for a source that waits on I/O.

    Example:
        >>> import grain
        >>> list(to_iter_dataset([3, None, 5]))
        [3, 5]
        >>> list(to_iter_dataset([3, None, 5], grain.ReadOptions(num_threads=0), allow_nones=True))
        [3, None, 5]
    """
    return _SourceNode(ds, read_options, bool(allow_nones))


class IterDataset:
    """A pipeline of Grain's ``IterDataset`` transformations; ``iter()`` gives a :class:`DatasetIterator`.

    Immutable: every method returns a new dataset. Build one with :func:`to_iter_dataset` (or
    ``Dataset.to_iter_dataset()``). Transforms are callables or instances of Grain's
    ``grain.transforms.Map`` / ``RandomMap`` / ``Filter`` / ``MapWithIndex`` (their method is called).

    Example:
        >>> ds = to_iter_dataset(list(range(6))).map(lambda x: x * 10).batch(4)
        >>> [b.tolist() for b in ds]
        [[0, 10, 20, 30], [40, 50]]
    """

    #: ``MapDataset[int]``, as Grain code annotates and subclasses it (the parameter is not checked).
    __class_getitem__ = classmethod(types.GenericAlias)
    _seed_rng_seed = None
    _fp: str | None = None
    _parents: tuple = ()  # a user's subclass that never calls super().__init__ has none

    def __init__(self, parents: "IterDataset | Dataset | Sequence" = ()):
        """``parents``: one dataset (ours or a ``MapDataset``) or a sequence of them, as Grain's.

        Example:
            >>> from portable_loader.dataset import Dataset
            >>> endless = Dataset.range(3).repeat()
            >>> IterDataset(endless).parents == (endless,)
            True
        """
        self._parents = (parents,) if _is_dataset(parents) else tuple(parents)

    def __new__(cls, *args, **kwargs):
        # A user's step is named by the arguments it was built with (opaque.record_arguments).
        self = super().__new__(cls)
        record_arguments(self, args, kwargs)
        return self

    @property
    def parents(self) -> tuple:
        """The datasets this one reads from."""
        return self._parents

    @property
    def _parent(self):
        assert len(self._parents) == 1, self._parents
        return self._parents[0]

    def _identity(self) -> tuple:
        return opaque_identity(self)  # the built-in steps define their own

    @property
    def _default_seed(self) -> int | None:
        """Grain's ``_default_seed``: the seed a random transform added here without ``seed=`` derives.

        None where no ``.seed`` is upstream.

        Example:
            >>> ds = to_iter_dataset(range(3))
            >>> ds.seed(5)._default_seed == ds.seed(5)._default_seed != ds.seed(6)._default_seed
            True
            >>> ds._default_seed is None
            True
        """
        return default_seed(self, depth=0)

    def fingerprint(self) -> str:
        """16 hex digits naming the pipeline: source, operations, functions, seeds, mixture weights.

        ``mp_prefetch``, ``read_options`` and ``batch_size`` are not part of it: they do not change
        which element comes at which stream position, so a state resumes across them.

        Example:
            >>> a = to_iter_dataset(list(range(4))).map(abs)
            >>> a.fingerprint() == to_iter_dataset(list(range(4))).map(abs).batch(2).fingerprint()
            False
            >>> a.fingerprint() == to_iter_dataset(list(range(4))).map(abs).mp_prefetch().fingerprint()
            True
        """
        if self._fp is None:
            self._fp = digest("IterDataset", self._identity())
        return self._fp

    # --- transformations (Grain 0.2.18's signatures) ---------------------------------------------

    def map(self, transform) -> "IterDataset":
        """Elements ``transform(x)`` (or ``transform.map(x)`` for a ``grain.transforms.Map``); None passes.

        Example:
            >>> list(to_iter_dataset([1, 2]).map(lambda x: x + 10))
            [11, 12]
        """
        return _OpNode(self, ElementOp("map", transform))

    def random_map(self, transform, *, seed: int | None = None) -> "IterDataset":
        """Elements ``transform(x, rng)``, ``rng`` a ``np.random.Generator`` set for the element's ordinal.

        The generator is Grain's: ``Philox(seed)`` with its counter at the number of elements this
        operation saw before, so the numbers equal Grain's single-process ``IterDataset.random_map``
        and do not depend on ``mp_prefetch``'s worker count. ``seed`` defaults to one derived from an
        upstream ``.seed(...)``, as in Grain; without either it is an error.

        Example:
            >>> ds = to_iter_dataset([0, 0, 0]).random_map(lambda x, rng: int(rng.integers(1000)), seed=3)
            >>> list(ds) == list(ds)
            True
        """
        return _OpNode(self, ElementOp("random_map", transform), seed=seed)

    def filter(self, transform) -> "IterDataset":
        """The elements for which ``transform(x)`` (or ``transform.filter(x)``) is true.

        Example:
            >>> list(to_iter_dataset(range(6)).filter(lambda x: x % 2 == 0))
            [0, 2, 4]
        """
        return _OpNode(self, ElementOp("filter", transform))

    def map_with_index(self, transform) -> "IterDataset":
        """Elements ``transform(i, x)``, ``i`` counting the elements this operation saw (Grain's counter).

        Example:
            >>> list(to_iter_dataset(["a", "b"]).map_with_index(lambda i, x: f"{i}{x}"))
            ['0a', '1b']
        """
        return _OpNode(self, ElementOp("map_with_index", transform))

    def batch(self, batch_size: int, *, drop_remainder: bool = False,
              batch_fn: Callable[[Sequence], Any] | None = None) -> "IterDataset":
        """Batches of ``batch_size`` elements, stacked leaf by leaf along a new first axis (or ``batch_fn``).

        Example:
            >>> [b["x"].tolist() for b in to_iter_dataset([{"x": i} for i in range(5)]).batch(2, drop_remainder=True)]
            [[0, 1], [2, 3]]
        """
        return _BatchNode(self, batch_size, bool(drop_remainder), batch_fn)

    def seed(self, seed: int) -> "IterDataset":
        """Seeds the random transformations downstream that get no ``seed=`` (Grain's default seeding).

        Example:
            >>> ds = to_iter_dataset([0, 0]).seed(42).random_map(lambda x, rng: int(rng.integers(10**6)))
            >>> list(ds) == list(to_iter_dataset([0, 0]).seed(42).random_map(lambda x, rng: int(rng.integers(10**6))))
            True
        """
        return _SeedNode(self, seed)

    def mp_prefetch(self, options=None, worker_init_fn: Callable[[int, int], None] | None = None,
                    sequential_slice: bool = False) -> "IterDataset":
        """Runs the per-element operations upstream in ``options.num_workers`` processes; the stream is unchanged.

        ``options`` is a ``grain.MultiprocessingOptions`` (default: 10 workers, as Grain).
        Workers run the ``map`` / ``filter`` / ``random_map`` / ``map_with_index`` that follow
        ``to_iter_dataset`` directly; this process runs ``batch``, ``mix`` and what follows them. The
        elements, and what a state means, are the same for every worker count, 0 included.
        ``worker_init_fn(worker_index, worker_count)`` runs in each worker first.
        ``sequential_slice`` is accepted for Grain's signature and changes nothing: no worker owns a
        slice here.

        Example:
            >>> import grain
            >>> ds = to_iter_dataset(range(40)).map(lambda x: x * x)
            >>> with iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2))) as it:
            ...     list(it) == list(ds)
            True
        """
        return _PrefetchNode(self, options, worker_init_fn)

    def prefetch(self, multiprocessing_options) -> "IterDataset":
        """Deprecated in Grain: ``mp_prefetch(multiprocessing_options)``.

        Example:
            >>> import grain, warnings
            >>> with warnings.catch_warnings():
            ...     warnings.simplefilter("ignore")
            ...     list(to_iter_dataset([1, 2]).prefetch(grain.MultiprocessingOptions(num_workers=0)))
            [1, 2]
        """
        warnings.warn("Please use `mp_prefetch` instead.", DeprecationWarning, stacklevel=2)
        return self.mp_prefetch(multiprocessing_options)

    def apply(self, transformations) -> "IterDataset":
        """Applies Grain transformation objects in order (``Batch``, ``Map``, ``RandomMap``, ``MapWithIndex``, ``Filter``).

        Example:
            >>> import grain
            >>> class AddOne(grain.transforms.Map):
            ...     def map(self, x):
            ...         return x + 1
            >>> [b.tolist() for b in to_iter_dataset(range(5)).apply([AddOne(), grain.transforms.Batch(2)])]
            [[1, 2], [3, 4], [5]]
        """
        from portable_loader.dataset.transforms import apply_transformations

        return apply_transformations(self, transformations)  # the same methods on both kinds of dataset

    def pipe(self, func: Callable[..., Any], /, *args, **kwargs) -> Any:
        """``func(self, *args, **kwargs)``: method chaining with functions that are not methods.

        Example:
            >>> list(to_iter_dataset(range(3)).pipe(lambda ds, k: ds.map(lambda x: x * k), 5))
            [0, 5, 10]
        """
        return func(self, *args, **kwargs)

    @staticmethod
    def mix(datasets, weights=None) -> "IterDataset":
        """Grain's ``IterDataset.mix``: a fixed interleaving by weight; it ends when any input ends.

        Weights become integers as in Grain (scaled so the smallest is 100, truncated) and element
        ``k`` comes from the input that Grain's exact integer rule names, so the order is
        deterministic and equals Grain's. A mapping of datasets is taken in sorted key order (what
        Grain does when JAX is installed; without JAX it uses insertion order). ``weights`` default
        to equal.

        Example:
            >>> a, b = to_iter_dataset(range(5)), to_iter_dataset(range(7, 10))
            >>> list(IterDataset.mix([a, b]))
            [0, 7, 1, 8, 2, 9, 3]
        """
        return _MixNode(datasets, weights)

    def __iter__(self) -> "DatasetIterator":
        from portable_loader.dataset.iter.iterator import DatasetIterator

        if is_opaque(self):  # super().__iter__() from a user's override of a built-in step: the built-in iterator
            with nested(*nesting(), self):
                return DatasetIterator(self)
        return DatasetIterator(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__.lstrip('_')}(fingerprint={self.fingerprint()})"


class _SourceNode(IterDataset):
    def __init__(self, ds, read_options, allow_nones: bool):
        from portable_loader.dataset.sources import source

        super().__init__((ds,))  # the original object: Grain's default-seed walk continues into it
        self.ds = source(ds)
        threads, buffer = 0, 0
        if read_options is not None:
            threads = getattr(read_options, "num_threads", threads)
            buffer = getattr(read_options, "prefetch_buffer_size", buffer)
        if not isinstance(threads, int) or not isinstance(buffer, int) or threads < 0 or buffer < 0:
            raise ValueError(f"read_options: num_threads and prefetch_buffer_size must be integers >= 0, "
                             f"got {threads!r} and {buffer!r}")
        self.threads, self.buffer, self.allow_nones = threads, buffer, allow_nones

    def _identity(self) -> tuple:
        return ("source", self.ds.fingerprint(), self.allow_nones)


class _OpNode(IterDataset):
    def __init__(self, parent: IterDataset, op: ElementOp, seed: int | None = None):
        super().__init__((parent,))
        if op.kind == "random_map":
            seed = default_seed(self, depth=0) if seed is None else seed
            if seed is None:
                raise ValueError(
                    "`random_map` requires a seed. Please either provide it with `ds.seed(seed)` before any "
                    "random transformations or pass it directly with `ds.random_map(transform, seed=seed)`."
                )
            op.seed = seed
        self.op = op

    @property
    def _seed(self) -> int | None:
        """Grain's ``_seed`` of a ``random_map``: the seed its generator uses (None for other operations).

        Example:
            >>> ds = to_iter_dataset(range(3)).seed(9).random_map(lambda x, rng: x)
            >>> ds._seed != ds.random_map(lambda x, rng: x)._seed   # each depth derives its own
            True
        """
        return self.op.seed

    def _identity(self) -> tuple:
        return (self.op.identity(), self._parent._identity())


class _BatchNode(IterDataset):
    def __init__(self, parent: IterDataset, batch_size: int, drop_remainder: bool, batch_fn):
        super().__init__((parent,))
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
            raise ValueError("batch_size must be positive.")
        if batch_fn is not None and not callable(batch_fn):
            raise TypeError(f"batch_fn must be callable, got {type(batch_fn).__name__}")
        self.batch_size, self.drop_remainder, self.batch_fn = int(batch_size), drop_remainder, batch_fn
        self._fn_id = None if batch_fn is None else function_identity(batch_fn)  # as built, see ops.ElementOp

    def _identity(self) -> tuple:
        # batch_size is left out: a state is a position between batches, so it resumes at another size.
        return ("batch", self.drop_remainder, self._fn_id, self._parent._identity())


class _SeedNode(IterDataset):
    def __init__(self, parent: IterDataset, seed: int):
        super().__init__((parent,))
        self._seed_rng_seed = seed

    def _identity(self) -> tuple:
        return self._parent._identity()  # seeds enter through the random_maps that use them


class _PrefetchNode(IterDataset):
    def __init__(self, parent: IterDataset, options, worker_init_fn):
        super().__init__((parent,))
        workers = _GRAIN_MP_DEFAULT_WORKERS if options is None else getattr(options, "num_workers", 0)
        buffer = 1 if options is None else getattr(options, "per_worker_buffer_size", 1)
        if not isinstance(workers, int) or workers < 0:
            raise ValueError(f"mp_prefetch: num_workers must be an integer >= 0, got {workers!r}")
        if worker_init_fn is not None and not callable(worker_init_fn):
            raise TypeError(f"worker_init_fn must be callable, got {type(worker_init_fn).__name__}")
        self.num_workers, self.buffer, self.worker_init_fn = workers, max(1, int(buffer)), worker_init_fn

    def _identity(self) -> tuple:
        return self._parent._identity()  # the whole point: the stream does not depend on it


class _MixNode(IterDataset):
    def __init__(self, datasets, weights):
        if isinstance(datasets, Mapping):
            keys = sorted(datasets)
            parents = [datasets[k] for k in keys]
            if weights is not None:
                if not isinstance(weights, Mapping) or sorted(weights) != keys:
                    raise ValueError(f"mix: weights must be a mapping with the datasets' keys {keys}")
                weights = [weights[k] for k in keys]
        else:
            keys = None
            parents = list(datasets)
            if weights is not None:
                weights = list(weights.values()) if isinstance(weights, Mapping) else list(weights)
        if not parents:
            raise ValueError("mix: no datasets given")
        weights = [1] * len(parents) if weights is None else weights
        if len(weights) != len(parents):
            raise ValueError(f"mix: {len(parents)} datasets but {len(weights)} weights")
        if 0 in weights:
            raise ValueError("Must specify all non-zero proportions for mixing.")
        if any(not isinstance(w, (int, float, np.integer, np.floating)) or w < 0 for w in weights):
            raise ValueError(f"mix: weights must be positive numbers, got {weights}")
        parents = [p if isinstance(p, IterDataset) else _as_iter(p) for p in parents]
        super().__init__(parents)
        self.keys, self.proportions = keys, int_proportions(weights)

    def _identity(self) -> tuple:
        return ("mix", self.keys, tuple(self.proportions), tuple(p._identity() for p in self._parents))


def _is_dataset(obj) -> bool:
    """One dataset, not a sequence of them: ours, or a real Grain ``MapDataset``/``IterDataset``."""
    if isinstance(obj, (IterDataset, Dataset)):
        return True
    grain_ds = sys.modules.get("grain._src.python.dataset.dataset")
    return grain_ds is not None and isinstance(obj, (grain_ds.MapDataset, grain_ds.IterDataset))


def _as_iter(obj) -> IterDataset:
    grain_ds = sys.modules.get("grain._src.python.dataset.dataset")
    if grain_ds is not None and isinstance(obj, grain_ds.IterDataset):
        raise TypeError("mix: a Grain IterDataset cannot be mixed here; build it with portable_loader's "
                        "to_iter_dataset (or from portable_loader import grain)")
    return to_iter_dataset(obj)  # a random-access dataset, as Grain's mix of MapDatasets iterates them


def __getattr__(name: str):
    # The iterator lives in its own module, which imports the node classes above: loaded on first use.
    if name == "DatasetIterator":
        from portable_loader.dataset.iter.iterator import DatasetIterator

        return DatasetIterator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
