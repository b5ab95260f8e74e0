"""Grain's public API on portable_loader: ``from portable_loader import grain`` runs Grain code unchanged.

Change ``import grain`` to ``from portable_loader import grain`` and the pipeline runs on
portable_loader's dataset layer, with what Grain lacks on top: a stream that does not depend on the
number of worker processes, a state that is a fixed-size JSON position restored in O(1), resumes
on another worker count and (``DataLoader``) another number of hosts, and a refusal of states of
another pipeline. ``MapDataset`` *is* ``portable_loader.Dataset``.

Importing this package imports neither Grain nor JAX nor torch: the few names that are real Grain's
own (``sources.ArrayRecordDataSource``, ``config``, ...) and the Orbax checkpoint args are loaded
when first used. docs/grain.md lists every Grain name and how it compares.

Example:
    >>> from portable_loader import grain
    >>> ds = (grain.MapDataset.range(20)
    ...       .shuffle(seed=42)
    ...       .map(lambda x: x * 2)
    ...       .filter(lambda x: x % 3 != 0)
    ...       .to_iter_dataset()
    ...       .batch(4))
    >>> it = iter(ds)
    >>> first = next(it)
    >>> state = it.get_state()                     # a small dict: the stream position
    >>> second = next(it)
    >>> it.set_state(state)
    >>> next(it).tolist() == second.tolist()
    True
"""

from portable_loader.dataset.base import Dataset as MapDataset
from portable_loader.dataset.iter.dataset import IterDataset
from portable_loader.dataset.iter.iterator import DatasetIterator
from portable_loader.grain import (checkpoint, constants, experimental, multiprocessing, samplers, sharding, sources,
                                   transforms)
from portable_loader.grain._unsupported import forward
from portable_loader.grain.data_loader import DataLoader, DataLoaderIterator, load
from portable_loader.grain.options import MultiprocessingOptions, ReadOptions
from portable_loader.grain.records import Record, RecordMetadata

__all__ = [
    "DataLoader",
    "DataLoaderIterator",
    "DatasetIterator",
    "IterDataset",
    "MapDataset",
    "MultiprocessingOptions",
    "ReadOptions",
    "Record",
    "RecordMetadata",
    "checkpoint",
    "constants",
    "experimental",
    "load",
    "multiprocessing",
    "samplers",
    "sharding",
    "sources",
    "transforms",
]

#: The Grain release whose public API these names follow (code that checks Grain's version reads it).
__version__ = "0.2.18"
__version_info__ = (0, 2, 18)

#: Real Grain's own objects, imported on first use: they configure or describe Grain's engine.
_FROM_GRAIN = {"config": "grain", "monitoring": "grain", "proto": "grain"}


def __getattr__(name: str):
    if name in _FROM_GRAIN:
        return forward(_FROM_GRAIN[name], name)
    if name == "python":  # Grain's backwards-compatibility namespace, imported only when asked for
        import importlib

        return importlib.import_module("portable_loader.grain.python")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
