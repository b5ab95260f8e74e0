"""``ds.seed(seed)``: a pipeline-level seed that random transforms below it derive their own from.

Grain's rule, kept exactly so that a ``random_map`` seeded this way draws what Grain's draws: a
transform given no seed walks the tree breadth-first from itself, collects ``(seed, depth)`` for
the nearest ``seed`` node on each path, and hashes them with ``np.random.SeedSequence``. Two random
transforms at different depths get different seeds, and a ``seed`` further down overrides one above.

Example:
    >>> from portable_loader.dataset import Dataset
    >>> ds = Dataset.range(6).seed(7)
    >>> sorted(ds.shuffle()) == list(range(6))
    True
    >>> Dataset.range(6).shuffle()
    Traceback (most recent call last):
    ...
    ValueError: `shuffle` requires a seed. Please provide it with `ds.seed(seed)`
"""

from __future__ import annotations

import numpy as np

from portable_loader.dataset.remap import Remap
from portable_loader.dataset.transforms import PassesMixture

__all__ = ["WithSeed", "default_seed", "parents_of"]


def parents_of(node) -> tuple:
    """A node's parents for the walk: ours and Grain's (``_parents``, ``parents``) or a ``parent``.

    Example:
        >>> from portable_loader.dataset import Dataset
        >>> ds = Dataset.range(3)
        >>> parents_of(ds.map(abs)) == (ds,), parents_of([1, 2])
        (True, ())
    """
    for name in ("_parents", "parents"):
        ps = getattr(node, name, None)
        if isinstance(ps, (list, tuple)):
            return tuple(ps)
    parent = getattr(node, "parent", None)
    return (parent,) if parent is not None else ()


def default_seed(parent, depth: int = 1) -> int | None:
    """The seed Grain's ``_default_seed`` gives a new transform over ``parent``; None without a ``seed`` node.

    ``depth=0`` gives ``parent``'s own default seed (Grain's ``ds._default_seed``). The walk goes
    through MapDatasets, IterDatasets and real Grain nodes alike.

    Example:
        >>> from portable_loader.dataset import Dataset
        >>> default_seed(Dataset.range(3).seed(1)) == default_seed(Dataset.range(3).seed(1))
        True
        >>> default_seed(Dataset.range(3)) is None
        True
    """
    aggregated = []
    to_visit = [(parent, depth)]  # depth 1: the new transform is depth 0 and holds no seed of its own
    while to_visit:
        node, depth = to_visit.pop(0)
        seed = getattr(node, "_seed_rng_seed", None)
        if seed is not None:
            aggregated.extend((seed, depth))
        else:
            to_visit.extend((p, depth + 1) for p in parents_of(node))
    if not aggregated:
        return None
    return int(np.random.SeedSequence(aggregated).generate_state(1, dtype=np.uint32)[0])


class WithSeed(PassesMixture, Remap):
    """The parent unchanged, carrying the seed that random transforms below derive theirs from.

    Its records, index space and stream order are the parent's; the seed enters the fingerprint.

    Example:
        >>> from portable_loader.dataset import Dataset
        >>> ds = Dataset.range(4).seed(3)
        >>> list(ds), ds.fingerprint() != Dataset.range(4).seed(4).fingerprint()
        ([0, 1, 2, 3], True)
    """

    def __init__(self, parent, seed: int):
        super().__init__(parent)
        self._seed_rng_seed = seed

    def _remap(self, idx: np.ndarray) -> np.ndarray:
        return idx

    def _params(self) -> tuple:
        return ("seed", self._seed_rng_seed)

    def stream_order(self, seed: int, *, shuffle: bool = True, num_epochs: int | None = None):
        # Nothing moves, so a mixture below keeps its own order (and its lookups: PassesMixture).
        return self.parent.stream_order(seed, shuffle=shuffle, num_epochs=num_epochs)
