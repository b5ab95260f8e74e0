"""``grain.python``, Grain 0.2.18's backwards-compatibility namespace (``import grain.python as grain``, as MaxText does).

The same objects as the top-level names, under Grain's old spellings (``MapTransform`` is
``transforms.Map``, ``PyGrainCheckpointHandler`` is ``checkpoint.CheckpointHandler``, ...), plus the
legacy ``DataLoader`` operations (:mod:`portable_loader.grain.operations`). Names that are real
Grain's own objects (``config``, ``ArrayRecordDataSource``, ``InMemoryDataSource``,
``SharedMemoryArray``) and the Orbax args are loaded when first used, as in ``portable_loader.grain``.

Example:
    >>> from portable_loader.grain import python as grain
    >>> class AddOne(grain.MapTransform):
    ...     def map(self, x):
    ...         return x + 1
    >>> list(grain.MapDataset.source([1, 2]).map(AddOne()))
    [2, 3]
    >>> grain.ShardOptions(shard_index=0, shard_count=2).shard_count
    2
"""

from portable_loader.dataset.base import Dataset as MapDataset
from portable_loader.dataset.iter.dataset import IterDataset
from portable_loader.dataset.iter.iterator import DatasetIterator
from portable_loader.grain.checkpoint import CheckpointHandler as PyGrainCheckpointHandler
from portable_loader.grain.constants import DATASET_INDEX, EPOCH, INDEX, META_FEATURES, RECORD, RECORD_KEY, SEED
from portable_loader.grain.data_loader import DataLoader
from portable_loader.grain.data_loader import DataLoaderIterator as PyGrainDatasetIterator
from portable_loader.grain.data_loader import load
from portable_loader.grain.operations import (BatchOperation, FilterOperation, MapOperation, Operation,
                                              RandomMapOperation)
from portable_loader.grain.options import MultiprocessingOptions, ReadOptions
from portable_loader.grain.python import experimental
from portable_loader.grain.records import Record, RecordMetadata
from portable_loader.grain.samplers import IndexSampler, Sampler, SequentialSampler
from portable_loader.grain.sharding import NoSharding, ShardByJaxProcess, ShardOptions
from portable_loader.grain.sources import RandomAccessDataSource, RangeDataSource
from portable_loader.grain.transforms import Batch, DatasetSelectionMap
from portable_loader.grain.transforms import Filter as FilterTransform
from portable_loader.grain.transforms import Map as MapTransform
from portable_loader.grain.transforms import MapWithIndex as MapWithIndexTransform
from portable_loader.grain.transforms import RandomMap as RandomMapTransform
from portable_loader.grain.transforms import Transformation, Transformations

__all__ = ["ArrayRecordDataSource", "Batch", "BatchOperation", "DATASET_INDEX", "DataLoader", "DatasetIterator",
           "DatasetSelectionMap", "EPOCH", "FilterOperation", "FilterTransform", "INDEX", "InMemoryDataSource",
           "IndexSampler", "IterDataset", "META_FEATURES", "MapDataset", "MapOperation", "MapTransform",
           "MapWithIndexTransform", "MultiprocessingOptions", "NoSharding", "Operation", "PyGrainCheckpointHandler",
           "PyGrainCheckpointRestore", "PyGrainCheckpointSave", "PyGrainDatasetIterator", "RECORD", "RECORD_KEY",
           "RandomAccessDataSource", "RandomMapOperation", "RandomMapTransform", "RangeDataSource", "ReadOptions",
           "Record", "RecordMetadata", "SEED", "Sampler", "SequentialSampler", "ShardByJaxProcess", "ShardOptions",
           "SharedMemoryArray", "Transformation", "Transformations", "config", "experimental", "load"]

#: Old name -> (our module, its name there), loaded on first use (real Grain's objects, Orbax's args).
_LAZY = {"ArrayRecordDataSource": ("sources", "ArrayRecordDataSource"),
         "InMemoryDataSource": ("sources", "SharedMemoryDataSource"),
         "SharedMemoryArray": ("multiprocessing", "SharedMemoryArray"),
         "PyGrainCheckpointSave": ("checkpoint", "CheckpointSave"),
         "PyGrainCheckpointRestore": ("checkpoint", "CheckpointRestore"),
         "config": (None, "config")}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, new = _LAZY[name]
        return getattr(importlib.import_module("portable_loader.grain" + (f".{module}" if module else "")), new)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
