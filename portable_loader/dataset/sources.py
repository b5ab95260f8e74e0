"""``source(obj)``: any random-access collection of tokenized records as a :class:`Dataset`.

Accepted: a cache from ``open_cache`` (either backend), a Grain ``MapDataset``, a Hugging Face
``datasets.Dataset`` with an ``input_ids`` column (and optionally ``loss_mask``), a plain list or
tuple of dicts, and any other object with ``__len__`` and ``__getitem__`` (Grain's
``RandomAccessDataSource``). A :class:`Dataset` is returned as is.

Example:
    >>> import numpy as np
    >>> ds = source([{"input_ids": np.arange(4)}, {"input_ids": np.arange(2)}])
    >>> type(ds).__name__, len(ds), ds.lengths([1, 0]).tolist()
    ('Records', 2, [2, 4])
    >>> source(ds) is ds
    True
"""

from __future__ import annotations

import sys
import numpy as np

from portable_loader.dataset.base import Dataset, attributes_of, function_identity, records_digest

__all__ = ["source", "Cache", "GrainTree", "HFDataset", "Records"]


def source(obj) -> Dataset:
    """Wrap ``obj`` as a :class:`Dataset` (see the module docstring for what is accepted).

    Example:
        >>> source([{"input_ids": [1, 2, 3]}])[0]
        {'input_ids': [1, 2, 3]}
        >>> source(42)
        Traceback (most recent call last):
        ...
        TypeError: source() takes a cache, a grain.MapDataset, a datasets.Dataset or a sequence of records (__len__ and __getitem__); got int
    """
    if isinstance(obj, Dataset):
        return obj
    from portable_loader.cache.readers import _CacheSource

    if isinstance(obj, _CacheSource):
        return Cache(obj)
    # Only a module already imported can have made obj: checking sys.modules avoids importing them.
    grain_ds = sys.modules.get("grain._src.python.dataset.dataset")
    if grain_ds is not None and isinstance(obj, grain_ds.MapDataset):
        # Grain's filter leaves holes (None) in place: served as our filter's rejections, batches stay full.
        return GrainTree(obj).filter(not_a_hole, name="grain holes") if _filters(obj) else GrainTree(obj)
    hf = sys.modules.get("datasets")
    if hf is not None and isinstance(obj, hf.Dataset):
        return HFDataset(obj)
    if hasattr(obj, "__len__") and hasattr(obj, "__getitem__") and not isinstance(obj, (str, bytes, dict)):
        return Records(obj)
    raise TypeError(
        "source() takes a cache, a grain.MapDataset, a datasets.Dataset or a sequence of records "
        f"(__len__ and __getitem__); got {type(obj).__name__}"
    )


class Cache(Dataset):
    """A cache from ``open_cache``: reads and lengths straight from its shards, no decoding for lengths.

    Fingerprint: the cache key (which hashes the input, tokenizer and options) and the manifest's
    checksum over every record's content.

    Example:
        >>> import portable_loader as pl
        >>> from portable_loader.precache import sample_args
        >>> ds = source(pl.open_cache(pl.precache(**sample_args(), out="cache")))
        >>> type(ds).__name__, ds.lengths([0, 1])
        ('Cache', array([23, 19]))
    """

    cheap_lengths = True

    def __init__(self, cache):
        self.cache = cache
        self.fork_hazard = getattr(cache, "fork_hazard", None)
        self.cheap_lengths = getattr(cache, "cheap_lengths", True)  # a remote cache's are not

    @property
    def format(self) -> str | None:
        return self.cache.manifest.get("config", {}).get("format")

    def __len__(self) -> int:
        return len(self.cache)

    @property
    def shard_rows(self) -> list[int]:
        return self.cache.shard_rows

    def __getitems__(self, indices):
        return self.cache.__getitems__(indices)

    def lengths(self, indices) -> np.ndarray:
        return np.asarray(self.cache.lengths(indices), dtype=np.int64)

    def spans(self, indices):
        """Where the records' tokens lie (``portable_loader.cache.readers.Spans``): the loader's fast path."""
        return self.cache.spans(indices)

    @property
    def read_ahead(self):
        """``read_ahead(now, ahead)``: the records of ``ahead`` worth reading with ``now``'s, which a
        remote cache's ``cache_limit`` bounds; None for a local cache, which reads them all (the
        inline engine then reads a packing window ahead by itself: a method that handed back
        ``ahead`` unchanged sent every local cache the padded way)."""
        return getattr(self.cache, "read_ahead", None)

    def _identity(self) -> tuple:
        m = self.cache.manifest
        return (m["key"], m.get("content_checksum", ""), len(self))

    def reopen(self) -> "Cache":
        reopen = getattr(self.cache, "reopen", None)
        return self if reopen is None else Cache(reopen())


class Records(Dataset):
    """A plain sequence of records (a list of dicts, or any object with ``__len__``/``__getitem__``).

    Reads use the object's own ``__getitems__`` when it has one, and lengths its ``lengths``.
    Fingerprint: its length and content, every record up to 1,024 records and 64 at fixed positions
    beyond (see :func:`portable_loader.dataset.base.records_digest`), or the object's own
    ``fingerprint()`` when it has one.

    Example:
        >>> ds = source([{"input_ids": [7, 8]}, {"input_ids": [9]}])
        >>> ds.__getitems__([1, 0])
        [{'input_ids': [9]}, {'input_ids': [7, 8]}]
        >>> ds.fingerprint() == source([{"input_ids": [7, 8]}, {"input_ids": [9]}]).fingerprint()
        True
        >>> ds.fingerprint() == source([{"input_ids": [7, 8]}, {"input_ids": [10]}]).fingerprint()
        False
    """

    def __init__(self, records):
        self.records = records
        self.cheap_lengths = callable(getattr(records, "lengths", None))

    @property
    def format(self) -> str | None:
        """A ``format`` string the object declares, or the one its cache-like ``manifest`` names."""
        fmt = getattr(self.records, "format", None)
        if isinstance(fmt, str):
            return fmt
        manifest = getattr(self.records, "manifest", None)
        return manifest.get("config", {}).get("format") if isinstance(manifest, dict) else None

    def __len__(self) -> int:
        return len(self.records)

    def __getitems__(self, indices) -> list:
        batched = getattr(self.records, "__getitems__", None)
        if batched is not None:
            return list(batched(indices))
        return [self.records[int(i)] for i in indices]

    def lengths(self, indices) -> np.ndarray:
        fast = getattr(self.records, "lengths", None)
        return super().lengths(indices) if fast is None else np.asarray(fast(indices), dtype=np.int64)

    def _identity(self) -> tuple:
        own = getattr(self.records, "fingerprint", None)
        if callable(own):
            return ("own", type(self.records).__qualname__, own())
        return ("content", records_digest(self.__getitems__, len(self)))


class HFDataset(Dataset):
    """A Hugging Face ``datasets.Dataset`` with a tokenized ``input_ids`` column (``loss_mask`` optional).

    Records hold those columns only, as numpy arrays; lengths come from Arrow's list offsets (no
    token is decoded). Fingerprint: the dataset's own ``_fingerprint`` (which ``datasets`` updates
    with every transform) and its length.

    Example:
        >>> import datasets
        >>> ds = source(datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4]], "text": ["a", "b"]}))
        >>> ds[1]["input_ids"].tolist(), list(ds[1]), ds.lengths([0, 1]).tolist()
        ([4], ['input_ids'], [3, 1])
    """

    cheap_lengths = True  # list lengths straight from Arrow's offsets

    def __init__(self, ds):
        import pyarrow as pa

        schema = ds.data.schema
        if "input_ids" not in schema.names:
            raise ValueError(
                f"datasets.Dataset has no 'input_ids' column (columns: {schema.names}): tokenize it first, "
                "or precache it"
            )
        self.columns = [c for c in ("input_ids", "loss_mask") if c in schema.names]
        for c in self.columns:
            t = schema.field(c).type
            if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_integer(t.value_type):
                raise ValueError(f"datasets.Dataset column {c!r} must be a list of integers per row, got {t}")
        self.ds = ds
        self._arrow = ds.with_format("arrow", columns=self.columns)

    def __len__(self) -> int:
        return len(self.ds)

    def _table(self, indices):
        return self._arrow[np.asarray(indices, dtype=np.int64).tolist()]

    def __getitems__(self, indices) -> list:
        table = self._table(indices)
        cols = {}
        for c in self.columns:
            arr = table.column(c).combine_chunks()
            offsets = np.asarray(arr.offsets)
            values = np.asarray(arr.values)
            cols[c] = [values[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
        return [dict(zip(self.columns, row)) for row in zip(*(cols[c] for c in self.columns))]

    def lengths(self, indices) -> np.ndarray:
        arr = self._table(indices).column("input_ids").combine_chunks()
        return np.diff(np.asarray(arr.offsets)).astype(np.int64)

    def _identity(self) -> tuple:
        return (self.ds._fingerprint, len(self), self.columns)


class GrainTree(Dataset):
    """A Grain ``MapDataset`` (any tree of its transformations), read through its batched ``_getitems``.

    Fingerprint: a walk over the tree from the root through ``_parents``: each node's type, its
    transform function (:func:`portable_loader.dataset.base.function_identity`) and its plain
    parameters (seeds, slice bounds); each leaf source through :func:`source` (a cache by its
    manifest, anything else by its length and a content sample). A tree with a Grain ``filter``
    comes wrapped in ``.filter(not_a_hole)``: the loader skips the holes (None) Grain leaves, so
    batches stay full. Lengths are read from the mapped
    records, since a Grain map may change them. Workers use the tree as it is: wrap a cache as
    ``source(cache).map(f)`` to have each worker reopen its files.

    Example:
        >>> import grain
        >>> tree = grain.MapDataset.source([{"input_ids": [1, 2]}] * 3).map(lambda r: {"input_ids": r["input_ids"] * 2})
        >>> source(tree).lengths([0]).tolist()
        [4]
        >>> source(tree).fingerprint() != source(grain.MapDataset.source([{"input_ids": [1, 2]}] * 3)).fingerprint()
        True
    """

    def __init__(self, tree):
        self.tree = tree
        # Taken now, as the pipeline is built: a transform that fills a cache on its first read keeps
        # its name. The leaves' content is read only when a fingerprint is asked for.
        self._tree_id = _node_identity(tree)

    def __len__(self) -> int:
        return len(self.tree)

    def __getitems__(self, indices) -> list:
        indices = np.asarray(indices, dtype=np.int64).tolist()
        batched = getattr(self.tree, "_getitems", None)  # Grain's batched read (absent in old releases)
        return list(batched(indices)) if batched is not None else [self.tree[i] for i in indices]

    def _identity(self) -> tuple:
        return (_with_leaf_fingerprints(self._tree_id),)


def not_a_hole(record) -> bool:
    """False for the None that Grain's ``MapDataset.filter`` leaves where it rejected a record."""
    return record is not None


def _filters(node) -> bool:
    """Whether a Grain tree has a ``filter`` node (whose rejected records read as None)."""
    if type(node).__name__ == "FilterMapDataset":
        return True
    return any(_filters(p) for p in getattr(node, "_parents", ()) or ())


# Attributes Grain fills in on the first read (statistics, a name derived from the transform, which
# is hashed anyway): hashing them made a pipeline's fingerprint change once it had been read, so a
# state saved by a run that had read it was refused by a fresh run of the same pipeline.
_SET_ON_READ = frozenset({"_stats", "_transform_name", "_source_name"})


def _node_identity(node) -> tuple:
    params, fn = {}, ()
    for k, v in sorted(attributes_of(node).items()):
        if k == "_transform":
            fn = function_identity(v)
        elif k in _SET_ON_READ:
            continue
        elif v is None or isinstance(v, (bool, int, float, str, bytes)):
            params[k] = v
    parents = tuple(_node_identity(p) for p in getattr(node, "_parents", ()) or ())
    leaf = None if parents else getattr(node, "_source", None)
    return (f"{type(node).__module__}.{type(node).__qualname__}", fn, params, leaf, parents)


def _with_leaf_fingerprints(node_id: tuple) -> tuple:
    """A :func:`_node_identity` with each leaf source replaced by its fingerprint (:func:`source`)."""
    name, fn, params, leaf, parents = node_id
    leaf_id = None if leaf is None else source(leaf).fingerprint()
    return (name, fn, params, leaf_id, tuple(_with_leaf_fingerprints(p) for p in parents))

