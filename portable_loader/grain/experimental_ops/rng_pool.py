"""Grain's ``RngPool``: reusable Philox generators, each reset to the stream of an element's index.

Grain keeps it because building a ``np.random.Philox`` per element is slow; Grain code that draws
its own numbers the way Grain's ``random_map`` does uses it. ``acquire_rng(index, op_seed=k)``
gives the generator of ``Philox(seed)`` with its counter at ``[0, 0, k, index]``, Grain's keying
(the one our ``random_map`` uses), so the numbers equal Grain's.

Example:
    >>> pool = RngPool(seed=42)
    >>> rng = pool.acquire_rng(7)
    >>> first = rng.integers(1000, size=3).tolist()
    >>> pool.release_rng(rng)
    >>> pool.acquire_rng(7).integers(1000, size=3).tolist() == first
    True
"""

from __future__ import annotations

import threading

import numpy as np

from portable_loader.dataset.random_map import keyed

__all__ = ["RngPool"]


class RngPool:
    """Grain's ``RngPool(seed)``: ``acquire_rng(index, *, op_seed=0)`` and ``release_rng(rng)``, thread-safe.

    Example:
        >>> import pickle
        >>> pool = pickle.loads(pickle.dumps(RngPool(3)))   # pickled as its seed, as Grain's
        >>> pool.acquire_rng(0, op_seed=1).random() == RngPool(3).acquire_rng(0, op_seed=1).random()
        True
    """

    def __init__(self, seed: int):
        self._seed = seed
        self._generator_cache: list[np.random.Generator] = []
        self._lock = threading.Lock()

    def __reduce__(self):
        return (RngPool, (self._seed,))

    def acquire_rng(self, index: int, *, op_seed: int = 0) -> np.random.Generator:
        with self._lock:
            rng = self._generator_cache.pop() if self._generator_cache else None
        if rng is None:
            rng = np.random.Generator(np.random.Philox(self._seed))
        return keyed(rng, index, op_seed)

    def release_rng(self, rng: np.random.Generator) -> None:
        with self._lock:
            self._generator_cache.append(rng)
