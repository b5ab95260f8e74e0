"""portable_loader: deterministic, resumable LLM data loading for JAX and PyTorch trainers.

Example:
    >>> import numpy as np, portable_loader as pl
    >>> from portable_loader.precache import sample_args   # the chat sample bundled with the package
    >>> path = pl.precache(**sample_args(), out="cache")   # tokenized once; the next call is a cache hit
    >>> src = pl.open_cache(path)
    >>> ds = pl.source(src).map(lambda r: {**r, "loss_mask": np.ones_like(r["loss_mask"])}, keeps_lengths=True)
    >>> loader = pl.DataLoader(ds, global_batch_size=8, seq_len=256, seed=0, packing=True)
    >>> with iter(loader) as it:
    ...     batch = next(it)
    ...     state = it.get_state()   # resume later with iter(loader).set_state(state)
    >>> len(src), batch["input_ids"].shape, state["step"]
    (2000, (8, 256), 1)
"""

from portable_loader.batch_size import BatchSchedule, rampup
from portable_loader.cache import open_cache
from portable_loader.corpora import pretokenized, tokenized
from portable_loader.dataset import Dataset, mix, source
from portable_loader.loader import DataLoader
from portable_loader.errors import (BadRowError, CacheError, FilterError, InputError, PortableLoaderError,
                                   PositionOutOfRange, StateError, TokenizerError, WorkerError)
from portable_loader.precache import cache_info, list_caches, precache, remove_cache
from portable_loader.orders.sampler import LCGSampler

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
    "PositionOutOfRange",
    "StateError",
    "TokenizerError",
    "WorkerError",
    "cache_info",
    "list_caches",
    "mix",
    "open_cache",
    "precache",
    "pretokenized",
    "rampup",
    "remove_cache",
    "source",
    "tokenized",
]
__version__ = "0.1.0"
