"""The random-access layer: stateless datasets, the one thing the loader consumes.

``source(obj)`` wraps a cache, a Grain ``MapDataset``, a ``datasets.Dataset`` or a sequence of
records; ``.map(fn)`` and ``.filter(pred)`` transform records lazily; ``mix({name: ds}, weights)`` mixes datasets by exact weights;
``fingerprint()`` names the whole tree. Its subpackages are ``iter/`` (Grain's ``IterDataset`` layer)
and ``mix/`` (weighted mixtures); token corpora live in ``portable_loader.corpora``, record orders in
``portable_loader.orders``. Modules here import ``orders``, ``collate``, ``indexing`` and ``errors``
at module level, never ``iter/``, the corpora or the loader: the fluent methods that build those
(``to_iter_dataset``, ``mix``) import them when called.

Example:
    >>> import numpy as np
    >>> from portable_loader.dataset import source
    >>> ds = source([{"input_ids": np.arange(n)} for n in (3, 5)]).map(lambda r: {"input_ids": r["input_ids"][::-1]})
    >>> ds[0]["input_ids"].tolist()
    [2, 1, 0]
"""

from portable_loader.dataset.base import Dataset
from portable_loader.dataset.mix.mixture import Mix, mix
from portable_loader.dataset.sources import source
from portable_loader.dataset.transforms import Filter, Map

__all__ = ["Dataset", "Filter", "Map", "Mix", "mix", "source"]
