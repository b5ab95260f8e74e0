"""How ``DataLoader`` builds its pipeline from dataset-layer parts, as Grain's DataLoader builds its own.

The global stream is a random-access dataset (:class:`StreamRecords`): position ``p`` holds a
:class:`Rec`, the record the sampler names at ``p`` with ``p`` itself attached (Grain's
``Record`` with its metadata). A shard is a slice of it (``[start + k::K]``); ``to_iter_dataset``
then runs the operations on the ``Rec``s exactly as Grain's ``DataLoader`` runs them on its
``Record``s (``Map`` on the data, ``RandomMap`` with the record's generator, ``Batch`` keeping the
last record's metadata), and ``mp_prefetch`` puts the operations before the first batch into worker
processes without changing the stream. Carrying the position is what lets ``MapWithIndex`` and
``RandomMap`` see the global position, whatever the shard or the worker count.

Example:
    >>> from portable_loader.dataset import Dataset
    >>> from portable_loader.grain import samplers, transforms
    >>> class Twice(transforms.Map):
    ...     def map(self, x):
    ...         return 2 * x
    >>> ds = StreamRecords(Dataset.source([5, 6, 7]), samplers.stream_order(samplers.IndexSampler(3, num_epochs=1)))
    >>> it = apply_operation(ds[1::2].to_iter_dataset(), Twice()).map(data_of)
    >>> list(it)
    [12]
"""

from __future__ import annotations

import sys

import numpy as np

from portable_loader.dataset.base import Dataset, _plain, as_indices, function_identity
from portable_loader.dataset.batch import stack
from portable_loader.dataset.flat_map import flat_map_function, pieces_of
from portable_loader.dataset.remap import over_reopened_parent
from portable_loader.dataset.iter.flat_map import FlatMapIterDataset
from portable_loader.grain.transforms import kind_of

__all__ = ["Rec", "StreamRecords", "apply_operation", "check_operation", "data_of", "operation_identity"]


class Rec:
    """An element on its way through a ``DataLoader``: its stream position ``index``, its ``data``, and
    the generator a ``RandomMap`` draws from (Grain's ``Philox(key=seed + index)``, built when first asked for).

    Example:
        >>> r = Rec(4, "x", seed=1)
        >>> r.with_data("y").data, int(r.rng.integers(10**6)) == int(Rec(4, "z", seed=1).rng.integers(10**6))
        ('y', True)
    """

    __slots__ = ("index", "data", "seed", "_rng")

    def __init__(self, index: int, data, seed=None, rng=None):
        self.index, self.data, self.seed, self._rng = index, data, seed, rng

    @property
    def rng(self):
        if self._rng is None and self.seed is not None:
            self._rng = np.random.Generator(np.random.Philox(key=self.seed + self.index))
        return self._rng

    def with_data(self, data) -> "Rec":
        # The same generator object once drawn from, as Grain's Record keeps its metadata: a second
        # RandomMap continues the first one's draws. Not drawn yet: the copy builds the same one.
        return Rec(self.index, data, self.seed, self._rng)

    def __reduce__(self):
        return (Rec, (self.index, self.data, self.seed, self._rng))


class StreamRecords(Dataset):
    """The sampler's global stream as a dataset: position ``p`` is ``Rec(p, source[key(p)])``.

    Its fingerprint is the source's and the sampler's (not the shard's, the workers' or the read
    options'), which is what a ``DataLoader`` state names.

    Example:
        >>> from portable_loader.grain import samplers
        >>> ds = StreamRecords(Dataset.source(["a", "b"]), samplers.stream_order(samplers.IndexSampler(2)))
        >>> [(r.index, r.data) for r in ds.__getitems__([0, 3])]
        [(0, 'a'), (3, 'b')]
    """

    reads_epochs = True  # positions are never past the end: the stream's length is the sampler's

    def __init__(self, source: Dataset, order):
        self.parent, self.order = source, order
        self.fork_hazard = source.fork_hazard

    def __len__(self) -> int:
        return self.order.total

    def __getitems__(self, indices) -> list:
        pos = as_indices(indices)
        order = self.order
        if order.keys is not None:
            data = self.parent.__getitems__(order.keys(pos).tolist())
            return [Rec(p, d, order.seed) for p, d in zip(pos.tolist(), data)]
        metadata = [order.metadata(p) for p in pos.tolist()]
        data = self.parent.__getitems__([int(m.record_key) for m in metadata])
        return [Rec(p, d, None, getattr(m, "rng", None)) for p, d, m in zip(pos.tolist(), data, metadata)]

    def _identity(self) -> tuple:
        return (self.parent.fingerprint(), self.order.identity)

    def reopen(self) -> "StreamRecords":
        return over_reopened_parent(self)


class _OnData:
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, r: Rec) -> Rec:
        return r.with_data(self.fn(r.data))


class _OnDataWithRng(_OnData):
    def __call__(self, r: Rec) -> Rec:
        return r.with_data(self.fn(r.data, r.rng))


class _OnDataWithIndex(_OnData):
    def __call__(self, r: Rec) -> Rec:
        return r.with_data(self.fn(r.index, r.data))


class _KeepData(_OnData):
    def __call__(self, r: Rec) -> bool:
        return self.fn(r.data)


class _BatchRecs:
    """Grain's batch of records: the data batched, the last record's position and generator kept."""

    def __init__(self, batch_fn):
        self.batch_fn = batch_fn

    def __call__(self, recs) -> Rec:
        last = recs[-1]
        return Rec(last.index, stack([r.data for r in recs], self.batch_fn), last.seed, last._rng)


class _SplitRec:
    """Grain's DataLoader flat map: piece ``j`` of the record at ``p`` is at ``p * max_fan_out + j``, without a generator."""

    def __init__(self, transform):
        self.fn, self.fan_out = flat_map_function(transform), int(transform.max_fan_out)

    def flat_map(self, r: Rec) -> list:
        start = r.index * self.fan_out
        return [Rec(start + j, piece) for j, piece in enumerate(pieces_of(self.fn, r.data))]


def _is_pack_and_batch(op) -> bool:
    """Whether ``op`` is Grain's legacy ``PackAndBatchOperation`` (ours, or real Grain's where it is imported)."""
    from portable_loader.grain.experimental_ops.pack_and_batch import PackAndBatchOperation

    real = sys.modules.get("grain._src.python.experimental.example_packing.packing")
    ours = isinstance(op, PackAndBatchOperation)
    return ours or (real is not None and isinstance(op, real.PackAndBatchOperation))


def _packed_rec(last: Rec, packed) -> Rec:
    """A packed batch as Grain's ``DataLoader`` makes it: the data, with the last packed record's position."""
    return Rec(last.index, packed, last.seed, last._rng)


def data_of(r: Rec):
    """The data of a :class:`Rec` (the ``DataLoader``'s last step).

    Example:
        >>> data_of(Rec(0, "x"))
        'x'
    """
    return r.data


def check_operation(op) -> str:
    """The kind of a ``DataLoader`` operation (:func:`portable_loader.grain.transforms.kind_of`); an error for what is not supported.

    Example:
        >>> from portable_loader.grain import transforms
        >>> check_operation(transforms.Batch(2))
        'batch'
        >>> check_operation(len)
        Traceback (most recent call last):
        ...
        TypeError: DataLoader operations are grain.transforms objects (Map, RandomMap, TfRandomMap, MapWithIndex, Filter, FlatMap, Batch); got builtin_function_or_method ...
    """
    if _is_pack_and_batch(op):
        return "pack_and_batch"
    kind = kind_of(op)
    if kind == "flat_map":
        fan_out = getattr(op, "max_fan_out", None)
        if isinstance(fan_out, bool) or not isinstance(fan_out, (int, np.integer)) or fan_out <= 0:
            raise ValueError(f"{type(op).__name__}.max_fan_out must be a positive integer, got {fan_out!r}")
    if kind is None:
        raise TypeError(
            "DataLoader operations are grain.transforms objects (Map, RandomMap, TfRandomMap, MapWithIndex, Filter, "
            f"FlatMap, Batch); got {type(op).__name__} (Grain's legacy iterator operations are not supported: their state "
            "cannot be saved)")
    return kind


def apply_operation(ds, op):
    """``ds`` (an ``IterDataset`` of :class:`Rec`) with the Grain operation ``op`` applied, as Grain's DataLoader applies it.

    Example:
        >>> from portable_loader.grain import samplers, transforms
        >>> order = samplers.stream_order(samplers.SequentialSampler(3))
        >>> ds = StreamRecords(Dataset.source([1, 2, 3]), order).to_iter_dataset()
        >>> [b.tolist() for b in apply_operation(ds, transforms.Batch(2)).map(data_of)]
        [[1, 2], [3]]
    """
    kind = check_operation(op)
    if kind == "batch":
        return ds.batch(op.batch_size, drop_remainder=op.drop_remainder, batch_fn=_BatchRecs(op.batch_fn))
    if kind == "pack_and_batch":
        from portable_loader.grain.experimental_ops.pack_and_batch import PackAndBatchIterDataset

        return PackAndBatchIterDataset(ds, op, get_data=data_of, wrap=_packed_rec)
    if kind == "filter":
        return ds.filter(_KeepData(op.filter))
    if kind == "flat_map":
        return FlatMapIterDataset(ds, _SplitRec(op))
    wrap = {"map": _OnData, "random_map": _OnDataWithRng, "np_random_map": _OnDataWithRng,
            "map_with_index": _OnDataWithIndex}[kind]
    return ds.map(wrap(getattr(op, kind)))


def operation_identity(op) -> tuple:
    """What names ``op`` in a ``DataLoader``'s fingerprint: its kind and its class and settings (a
    ``Batch``: ``drop_remainder`` and ``batch_fn``; its size only cuts the stream, so a state resumes at another).

    Example:
        >>> from portable_loader.grain import transforms
        >>> operation_identity(transforms.Batch(2)) == operation_identity(transforms.Batch(8))
        True
    """
    kind = check_operation(op)
    if kind == "batch":
        fn = op.batch_fn
        return ("batch", bool(op.drop_remainder), None if fn is None else function_identity(fn))
    if kind == "pack_and_batch":  # its batch size decides what is packed together, so it is part of it
        return (kind, _plain(op.length_struct), int(op.batch_size), op.max_sequences_per_bin)
    return (kind, function_identity(op))
