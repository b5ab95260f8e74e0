"""Stateless random-access datasets: the one thing the loader consumes.

``source(obj)`` wraps a cache, a Grain ``MapDataset``, a ``datasets.Dataset`` or a sequence of
records; ``.map(fn)`` and ``.filter(pred)`` transform records lazily; ``mix({name: ds}, weights)`` mixes datasets by exact weights;
``fingerprint()`` names the whole tree.

Example:
    >>> import numpy as np
    >>> from portable_loader.dataset import source
    >>> ds = source([{"input_ids": np.arange(n)} for n in (3, 5)]).map(lambda r: {"input_ids": r["input_ids"][::-1]})
    >>> ds[0]["input_ids"].tolist()
    [2, 1, 0]
"""

from portable_loader.dataset.base import Dataset
from portable_loader.dataset.mixture import Mix, mix
from portable_loader.dataset.pretokenized import Pretokenized, pretokenized
from portable_loader.dataset.sources import source
from portable_loader.dataset.transforms import Filter, Map
from portable_loader.dataset.tokenized import Tokenized, tokenized  # noqa: F401

__all__ = ["Dataset", "Filter", "Map", "Mix", "Pretokenized", "Tokenized", "mix", "pretokenized", "source", "tokenized"]
