"""``grain.experimental``: every name of Grain 0.2.18's, on portable_loader's pipelines.

Packing: ``FirstFitPackIterDataset``, ``BestFitPackIterDataset`` (portable_loader/dataset/iter/pack.py)
and ``ConcatThenSplitIterDataset`` with ``BOSHandling`` (portable_loader/dataset/iter/concat_split.py):
Grain's elements, and a state that is a position (docs/grain.md says where they differ).
Flat maps: ``FlatMapMapDataset`` (portable_loader/dataset/flat_map.py) and ``FlatMapIterDataset``
(portable_loader/dataset/iter/flat_map.py), Grain's elements. ``RepeatIterDataset``
(portable_loader/dataset/iter/repeat.py): Grain's passes, a position state. ``WindowShuffleIterDataset``
(portable_loader/dataset/iter/window_shuffle.py): Grain's windows in Grain's order. ``ElasticIterator``
(portable_loader/grain/elastic.py): Grain's global batches per shard, and it takes filters and
packing too. ``DatasetOptions``, ``WithOptionsIterDataset`` (portable_loader/dataset/iter/options.py):
Grain's options and their filter checks. ``get_next_index`` / ``set_next_index``: where the index
is arithmetic.

Sources and iterator steps written as Grain writes them (portable_loader/grain/experimental_ops/):
``TFRecordIterDataset`` (checksums checked), ``ParquetIterDataset``, ``InterleaveIterDataset``,
``ZipMapDataset``, ``ZipIterDataset``, ``LimitIterDataset``, ``RebatchIterDataset``,
``CacheIterDataset``, the thread read-ahead (``ThreadPrefetchIterDataset``,
``ThreadPrefetchDatasetIterator``, ``multithread_prefetch``, ``device_put``), ``RngPool`` and the
legacy ``PackAndBatchOperation``.

Example:
    >>> import numpy as np
    >>> from portable_loader import grain
    >>> from portable_loader.grain import experimental
    >>> sorted(experimental.index_shuffle(i, max_index=9, seed=5, rounds=4) for i in range(10))
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    >>> docs = grain.MapDataset.source([{"ids": np.arange(n)} for n in (3, 5, 2)]).to_iter_dataset()
    >>> packed = experimental.FirstFitPackIterDataset(docs, length_struct={"ids": 6}, num_packing_bins=2, seed=0)
    >>> sorted(row["ids_segment_ids"].tolist() for row in packed)
    [[1, 1, 1, 1, 1, 0], [1, 1, 1, 2, 2, 0]]
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol, Sequence

import numpy as np

from portable_loader.dataset.batch import _tree_map, stack
from portable_loader.dataset.flat_map import FlatMapMapDataset
from portable_loader.orders.index_shuffle import IndexShuffle
from portable_loader.dataset.iter.concat_split import BOSHandling, ConcatThenSplitIterDataset
from portable_loader.dataset.iter.flat_map import FlatMapIterDataset
from portable_loader.dataset.iter.options import DatasetOptions, ExecutionTrackingMode, WithOptionsIterDataset
from portable_loader.dataset.iter.pack import BestFitPackIterDataset, FirstFitPackIterDataset
from portable_loader.dataset.iter.repeat import RepeatIterDataset
from portable_loader.dataset.iter.window_shuffle import WindowShuffleIterDataset
from portable_loader.dataset.transforms import apply_transformations
from portable_loader.dataset.window_shuffle import WindowShuffle as WindowShuffleMapDataset
from portable_loader.grain.elastic import ElasticIterator
from portable_loader.grain.experimental_ops.cache import CacheIterDataset
from portable_loader.grain.experimental_ops.interleave import InterleaveIterDataset
from portable_loader.grain.experimental_ops.limit import LimitIterDataset
from portable_loader.grain.experimental_ops.pack_and_batch import PackAndBatchOperation
from portable_loader.grain.experimental_ops.parquet import ParquetIterDataset
from portable_loader.grain.experimental_ops.rebatch import RebatchIterDataset
from portable_loader.grain.experimental_ops.rng_pool import RngPool
from portable_loader.grain.experimental_ops.tfrecord import TFRecordIterDataset
from portable_loader.grain.experimental_ops.zip import ZipIterDataset, ZipMapDataset
from portable_loader.grain.experimental_ops.prefetch import (ThreadPrefetchDatasetIterator, ThreadPrefetchIterDataset,
                                                             device_put, multithread_prefetch)
from portable_loader.grain.performance import PerformanceConfig, pick_performance_config
from portable_loader.grain.testing import assert_equal_output_after_checkpoint
from portable_loader.grain.transforms import FlatMap as FlatMapTransform
from portable_loader.grain.transforms import MapWithIndex as MapWithIndexTransform

__all__ = ["BOSHandling", "BestFitPackIterDataset", "CacheIterDataset", "ConcatThenSplitIterDataset", "DatasetOptions",
           "ElasticIterator", "ExecutionTrackingMode", "FirstFitPackIterDataset", "FlatMapIterDataset",
           "FlatMapMapDataset", "FlatMapTransform", "InterleaveIterDataset", "LimitIterDataset",
           "MapWithIndexTransform", "PackAndBatchOperation", "ParquetIterDataset", "PerformanceConfig", "RebatchIterDataset",
           "RepeatIterDataset", "RngPool", "ShapeDtypeStruct", "ShapeDtypeStructProtocol", "TFRecordIterDataset",
           "ThreadPrefetchDatasetIterator", "ThreadPrefetchIterDataset", "WindowShuffleIterDataset",
           "WindowShuffleMapDataset", "WithOptionsIterDataset", "ZipIterDataset", "ZipMapDataset",
           "apply_transformations", "assert_equal_output_after_checkpoint", "batch_and_pad", "device_put",
           "get_element_spec", "get_next_index", "index_shuffle", "multithread_prefetch", "pick_performance_config",
           "set_next_index"]

@functools.lru_cache(maxsize=16)
def _permutation(max_index: int, seed: int, rounds: int) -> IndexShuffle:
    # A loop over one permutation's indices builds it once (small ones are tabulated when built).
    return IndexShuffle(max_index, seed, rounds)


def index_shuffle(index: int, max_index: int, seed: int, rounds: int) -> int:
    """Grain's ``index_shuffle``: the image of ``index`` under a keyed bijection of ``[0, max_index]`` (both ends included).

    The same function as Grain 0.2.18's (:mod:`portable_loader.orders.index_shuffle`: its Feistel
    cipher, its keys from ``seed`` and ``rounds``, its cycle walking), with the same checks, except
    where Grain's loses records (``max_index`` an even power of two from ``2**16``: there index
    ``max_index`` maps to itself here, where Grain's repeats another index's image).

    Example:
        >>> import grain   # real Grain 0.2.18
        >>> all(index_shuffle(i, 999, 7, 6) == grain.experimental.index_shuffle(i, 999, 7, 6) for i in range(1000))
        True
        >>> index_shuffle(10, max_index=9, seed=0, rounds=4)
        Traceback (most recent call last):
        ...
        ValueError: index must be in [0, max_index], but got index = 10 and max_index = 9
    """
    for name, v in (("index", index), ("max_index", max_index), ("seed", seed), ("rounds", rounds)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"index_shuffle(): {name} must be an integer, got {type(v).__name__}")
    if not 0 <= seed < 1 << 32:
        raise TypeError(f"index_shuffle(): seed must be a 32-bit unsigned integer, got {seed}")
    if rounds % 2 or not 4 <= rounds <= 1024:
        raise ValueError(f"rounds must be an even integer between 4 and 1024, got {rounds}")
    if not 0 <= index <= max_index:
        raise ValueError(f"index must be in [0, max_index], but got index = {index} and max_index = {max_index}")
    if max_index >= 1 << 63:
        raise ValueError(f"max_index must be below 2**63, got {max_index}")
    return _permutation(int(max_index), int(seed), int(rounds)).one(int(index))


def get_next_index(ds_iter) -> int:
    """Grain's ``get_next_index``: the index of the element ``next(ds_iter)`` returns.

    Defined through ``to_iter_dataset``, maps, batches and ``mp_prefetch``; a filter, a mixture or
    packing on the way makes it a ``ValueError``: there the iterator's ``get_state()`` (a position)
    is what to save.

    Example:
        >>> from portable_loader import grain
        >>> it = iter(grain.MapDataset.range(10).to_iter_dataset().batch(4))
        >>> next(it).tolist(), get_next_index(it)
        ([0, 1, 2, 3], 1)
    """
    return ds_iter._get_next_index()


def set_next_index(ds_iter, index: int) -> None:
    """Grain's ``set_next_index``: ``next(ds_iter)`` returns the element of index ``index`` (:func:`get_next_index`).

    Example:
        >>> from portable_loader import grain
        >>> it = iter(grain.MapDataset.range(10).to_iter_dataset())
        >>> set_next_index(it, 8); list(it)
        [8, 9]
    """
    ds_iter._set_next_index(index)


def batch_and_pad(values: Sequence[Any], *, batch_size: int, pad_value: Any = 0) -> Any:
    """Grain's ``batch_and_pad``: the values stacked, and a short batch padded with ``pad_value`` to ``batch_size``.

    Pass it as a ``batch_fn`` (``functools.partial(batch_and_pad, batch_size=B)``) to keep the last,
    short batch at the full size.

    Example:
        >>> import functools
        >>> from portable_loader.grain import MapDataset
        >>> list(MapDataset.range(1, 5).batch(3, batch_fn=functools.partial(batch_and_pad, batch_size=3)))
        [array([1, 2, 3]), array([4, 0, 0])]
    """
    if not values:
        raise ValueError("Cannot batch 0 values.")
    if len(values) > batch_size:
        raise ValueError(f"Cannot batch {len(values)} values to {batch_size}.")
    batch = stack(list(values))
    missing = batch_size - len(values)
    if not missing:
        return batch
    return _tree_map(lambda x: np.concatenate([x, np.full((missing,) + x.shape[1:], pad_value, dtype=x.dtype)]), batch)


class ShapeDtypeStructProtocol(Protocol):
    """Grain's ``ShapeDtypeStructProtocol``: anything with a ``shape`` and a ``dtype`` (a typing protocol,
    not checked at run time, as Grain's); :class:`ShapeDtypeStruct` (and a ``jax.ShapeDtypeStruct``) is one.

    Example:
        >>> ShapeDtypeStructProtocol in ShapeDtypeStruct.__mro__
        True
    """

    @property
    def shape(self) -> tuple: ...

    @property
    def dtype(self) -> Any: ...


@dataclasses.dataclass(frozen=True, slots=True)
class ShapeDtypeStruct(ShapeDtypeStructProtocol):
    """Grain's ``ShapeDtypeStruct``: the ``shape`` and ``dtype`` of one leaf of an element.

    Example:
        >>> import numpy as np
        >>> ShapeDtypeStruct(shape=(2, 3), dtype=np.dtype("int32"))
        ShapeDtypeStruct(shape=(2, 3), dtype=dtype('int32'))
    """

    # field(): without it the protocol's properties would be taken as defaults (Grain's takes them).
    shape: tuple = dataclasses.field()
    dtype: Any = dataclasses.field()


def get_element_spec(ds) -> Any:
    """Grain's ``get_element_spec``: the element's structure with a :class:`ShapeDtypeStruct` for each leaf.

    Grain derives it from the pipeline without reading data; here it is read off the first element
    (of ``ds.to_iter_dataset()`` for a ``MapDataset``, of a new iterator for an ``IterDataset``,
    which is closed at once), so it is exact for any transform, and costs one element. A leaf is
    described as ``np.asarray`` sees it (a Python int is ``int64``, as in Grain). An empty dataset
    raises ``ValueError``.

    Example:
        >>> import numpy as np
        >>> from portable_loader import grain
        >>> get_element_spec(grain.MapDataset.range(10))
        ShapeDtypeStruct(shape=(), dtype=dtype('int64'))
        >>> ds = grain.MapDataset.range(4).map(lambda x: {"ids": np.zeros(3, np.int32)})
        >>> get_element_spec(ds.to_iter_dataset().batch(2))
        {'ids': ShapeDtypeStruct(shape=(2, 3), dtype=dtype('int32'))}
    """
    from portable_loader.dataset.base import Dataset
    from portable_loader.dataset.iter.dataset import IterDataset

    if isinstance(ds, Dataset):
        ds = ds.to_iter_dataset()
    if not isinstance(ds, IterDataset):
        raise TypeError(f"get_element_spec: expected a MapDataset or IterDataset, got {type(ds).__name__}")
    it = iter(ds)
    try:
        first = next(it)
    except StopIteration:
        raise ValueError("get_element_spec: the dataset is empty, so it has no element to describe") from None
    finally:
        it.close()

    def spec(leaf):
        a = np.asarray(leaf)
        return ShapeDtypeStruct(shape=tuple(a.shape), dtype=a.dtype)

    return _tree_map(spec, first)
