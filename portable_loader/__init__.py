"""portable_loader: deterministic, resumable LLM data loading for JAX and PyTorch trainers.

Example:
    >>> import portable_loader as pl
    >>> s = pl.LCGSampler(num_records=100, seed=0)
    >>> path = pl.precache("train.jsonl", tokenizer="tok/", format="text", out="cache/")  # doctest: +SKIP
    >>> src = pl.open_cache(path)                                                         # doctest: +SKIP
    >>> ds = pl.source(src).map(my_fn)                                                   # doctest: +SKIP
"""

from portable_loader.batch_size import BatchSchedule, rampup
from portable_loader.cache import open_cache
from portable_loader.dataset import Dataset, mix, source
from portable_loader.dataset.tokenized import tokenized
from portable_loader.loader import DataLoader
from portable_loader.errors import (BadRowError, CacheError, FilterError, InputError, PortableLoaderError, StateError,
                                   TokenizerError)
from portable_loader.precache import cache_info, list_caches, precache, remove_cache
from portable_loader.sampler import LCGSampler

__all__ = [
    "BadRowError",
    "BatchSchedule",
    "CacheError",
    "DataLoader",
    "Dataset",
    "FilterError",
    "InputError",
    "LCGSampler",
    "PortableLoaderError",
    "StateError",
    "TokenizerError",
    "cache_info",
    "list_caches",
    "mix",
    "open_cache",
    "precache",
    "rampup",
    "remove_cache",
    "source",
    "tokenized",
]
__version__ = "0.1.0"
