"""``ds.random_map(fn, seed=...)`` and ``ds.map_with_index(fn)``: per-record transforms that see more than the record.

``random_map``'s ``fn(record, rng)`` gets a numpy ``Generator`` keyed by ``(seed, index)``: a
``Philox`` generator whose counter is set from the index before each record, which is Grain's own
keying, so a record's draws depend on its index and seed only (not on the read's batch, the
worker or what was read before) and equal Grain's for the same seed. An index past the end (a
later epoch under ``repeat``) draws afresh. The seed comes from ``seed=`` or a ``ds.seed(...)``
above; with neither it is a ``ValueError``, as in Grain. ``map_with_index``'s ``fn(index, record)``
gets the index the record was read at.

Both keep their parent's index space and stream order, and map None (a filtered record) to None.

Example:
    >>> from portable_loader.dataset import Dataset
    >>> ds = Dataset.range(3).random_map(lambda x, rng: (x, int(rng.integers(1000))), seed=5)
    >>> ds[2] == ds[2] and ds[1][1] != ds[2][1]
    True
    >>> list(Dataset.source(["a", "b"]).map_with_index(lambda i, x: (i, x)))
    [(0, 'a'), (1, 'b')]
"""

from __future__ import annotations

import numpy as np

from portable_loader.dataset.base import as_indices, within
from portable_loader.dataset.seeds import default_seed
from portable_loader.dataset.transforms import _Transform, as_function

__all__ = ["MapWithIndex", "RandomMap"]


def keyed(rng: np.random.Generator, index: int, op_seed: int = 0) -> np.random.Generator:
    """``rng`` reset to the stream of ``index``: Grain's ``_reset_rng_state``."""
    state = rng.bit_generator.state
    state["state"]["counter"] = np.array([0, 0, op_seed, index], dtype=np.uint64)
    state["buffer"] = np.array([0, 0, 0, 0], dtype=np.uint64)
    state["buffer_pos"] = 4
    state["has_uint32"] = 0
    state["uinteger"] = 0
    rng.bit_generator.state = state
    return rng


class _IndexedTransform(_Transform):
    _callable_attr = "fn"
    _method = ""

    def _apply(self, indices: list, records: list) -> list:
        raise NotImplementedError

    def __getitems__(self, indices) -> list:
        idx = as_indices(indices).tolist()
        return self._apply(idx, list(self.parent.__getitems__(within(self.parent, idx))))

    def accepts(self, indices) -> np.ndarray:
        return self.parent.accepts(within(self.parent, indices))

    def _with_parent(self, parent):
        view = type(self).__new__(type(self))
        view.__dict__.update(self.__dict__, parent=parent, _fingerprint=None)
        return view


class RandomMap(_IndexedTransform):
    """Records ``fn(parent[i], rng)``, ``rng`` keyed by ``(seed, i)``; built by :meth:`Dataset.random_map`.

    ``fn`` is a callable or a Grain ``transforms.RandomMap`` (its ``random_map`` is called). The
    fingerprint covers the parent, ``fn`` (or ``name``) and the seed.

    Example:
        >>> from portable_loader.dataset import Dataset
        >>> noisy = RandomMap(Dataset.range(4), lambda x, rng: x + rng.random(), seed=0)
        >>> [int(v) for v in noisy], noisy.fingerprint() != RandomMap(Dataset.range(4), noisy.fn, seed=1).fingerprint()
        ([0, 1, 2, 3], True)
    """

    def __init__(self, parent, fn, *, seed: int | None = None, name: str | None = None):
        self.parent, self.name = parent, name
        self.fn = as_function(fn, "random_map", "RandomMap", refuse=("map", "map_with_index"))
        self._name_function()
        seed = default_seed(parent) if seed is None else seed
        if seed is None:
            raise ValueError(
                "`random_map` requires a seed. Please either provide it with `ds.seed(seed)` before any random "
                "transformations or pass it directly with `ds.random_map(transform, seed=seed)`."
            )
        self._seed = int(seed)
        self.fork_hazard, self.filters = parent.fork_hazard, parent.filters

    def _apply(self, indices: list, records: list) -> list:
        rng = np.random.Generator(np.random.Philox(self._seed))
        return [None if r is None else self.fn(r, keyed(rng, i)) for i, r in zip(indices, records)]

    def _identity(self) -> tuple:
        return (*super()._identity(), "seed", self._seed)


class MapWithIndex(_IndexedTransform):
    """Records ``fn(i, parent[i])``; built by :meth:`Dataset.map_with_index`.

    ``fn`` is a callable or a Grain ``transforms.MapWithIndex`` (its ``map_with_index`` is called).

    Example:
        >>> from portable_loader.dataset import Dataset
        >>> MapWithIndex(Dataset.range(10, 13), lambda i, x: i * x)[2]
        24
    """

    def __init__(self, parent, fn, *, name: str | None = None):
        self.parent, self.name = parent, name
        self.fn = as_function(fn, "map_with_index", "MapWithIndex", refuse=("map", "random_map"))
        self._name_function()
        self.fork_hazard, self.filters = parent.fork_hazard, parent.filters

    def _apply(self, indices: list, records: list) -> list:
        return [None if r is None else self.fn(i, r) for i, r in zip(indices, records)]
