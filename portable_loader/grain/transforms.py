"""Grain's transformation classes: subclass one, define its method, hand an instance to a dataset or a ``DataLoader``.

``Map.map(element)``, ``RandomMap.random_map(element, rng)``, ``TfRandomMap.np_random_map(element,
rng)``, ``Filter.filter(element)``, ``MapWithIndex.map_with_index(index, element)`` and
``FlatMap.flat_map(element)`` (with ``max_fan_out``), plus the ``Batch`` dataclass.
Instances are also callables (``Map()(x)`` is ``map(x)``), so every dataset method that takes a
function takes them. Subclasses of *real* Grain's classes work the same everywhere here.

Example:
    >>> from portable_loader.grain import MapDataset, transforms
    >>> class Square(transforms.Map):
    ...     def map(self, x):
    ...         return x * x
    >>> list(MapDataset.range(5).map(Square()).batch(2))
    [array([0, 1]), array([4, 9]), array([16])]
"""

from __future__ import annotations

import abc
import dataclasses
import sys
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

__all__ = ["Batch", "DatasetSelectionMap", "Filter", "FlatMap", "Map", "MapWithIndex", "RandomMap", "TfRandomMap",
           "Transformation", "Transformations", "kind_of"]


class Map(abc.ABC):
    """A 1:1 transformation: define ``map(element)``.

    Example:
        >>> class Inc(Map):
        ...     def map(self, x):
        ...         return x + 1
        >>> Inc().map(1), Inc()(1)
        (2, 2)
    """

    @abc.abstractmethod
    def map(self, element):
        """The transformed element."""

    def __call__(self, element):
        return self.map(element)


class RandomMap(abc.ABC):
    """A random 1:1 transformation: define ``random_map(element, rng)``, ``rng`` a ``np.random.Generator``.

    Example:
        >>> import numpy as np
        >>> class Noise(RandomMap):
        ...     def random_map(self, x, rng):
        ...         return x + int(rng.integers(10))
        >>> Noise()(5, np.random.default_rng(0)) == Noise().random_map(5, np.random.default_rng(0))
        True
    """

    @abc.abstractmethod
    def random_map(self, element, rng: np.random.Generator):
        """The transformed element, drawing only from ``rng``."""

    def __call__(self, element, rng: np.random.Generator):
        return self.random_map(element, rng)


class TfRandomMap(abc.ABC):
    """Grain's random map for TensorFlow-style code: define ``np_random_map(element, rng)``.

    Example:
        >>> import numpy as np
        >>> class Coin(TfRandomMap):
        ...     def np_random_map(self, x, rng):
        ...         return (x, bool(rng.integers(2)))
        >>> Coin()(1, np.random.default_rng(0))[0]
        1
    """

    @abc.abstractmethod
    def np_random_map(self, element, rng: np.random.Generator):
        """The transformed element, drawing only from ``rng``."""

    def __call__(self, element, rng: np.random.Generator):
        return self.np_random_map(element, rng)


class MapWithIndex(abc.ABC):
    """A 1:1 transformation of an element and its index: define ``map_with_index(index, element)``.

    Example:
        >>> class Tag(MapWithIndex):
        ...     def map_with_index(self, i, x):
        ...         return (i, x)
        >>> Tag()(3, "a")
        (3, 'a')
    """

    @abc.abstractmethod
    def map_with_index(self, index: int, element):
        """The transformed element."""

    def __call__(self, index: int, element):
        return self.map_with_index(index, element)


class Filter(abc.ABC):
    """Keeps the elements for which ``filter(element)`` is true.

    Example:
        >>> class Even(Filter):
        ...     def filter(self, x):
        ...         return x % 2 == 0
        >>> from portable_loader.grain import MapDataset
        >>> list(MapDataset.range(6).filter(Even()))
        [0, 2, 4]
    """

    @abc.abstractmethod
    def filter(self, element) -> bool:
        """Whether to keep ``element``."""

    def __call__(self, element) -> bool:
        return self.filter(element)


class FlatMap(abc.ABC):
    """Splits an element into up to ``max_fan_out`` elements: define ``flat_map(element)`` and ``max_fan_out``.

    Real Grain 0.2.18 names it ``grain.experimental.FlatMapTransform`` (also here). ``apply`` on a
    ``MapDataset`` gives ``max_fan_out`` slots per element (``FlatMapMapDataset``: the unused ones
    are holes, as a filter leaves; more pieces than slots is a ``ValueError``), on an
    ``IterDataset`` every piece in order (``FlatMapIterDataset``); in a ``DataLoader``'s operations,
    piece ``j`` of the record at position ``p`` gets index ``p * max_fan_out + j``, as in Grain.

    Example:
        >>> from portable_loader.grain import MapDataset
        >>> class Split(FlatMap):
        ...     max_fan_out = 2
        ...     def flat_map(self, x):
        ...         return [x] * (x % 3)
        >>> ds = MapDataset.range(4).apply([Split()])
        >>> len(ds), list(ds), list(MapDataset.range(4).to_iter_dataset().apply([Split()]))
        (8, [1, 2, 2], [1, 2, 2])
    """

    max_fan_out: int

    @abc.abstractmethod
    def flat_map(self, element) -> Sequence[Any]:
        """The elements ``element`` splits into."""


@dataclasses.dataclass(frozen=True)
class Batch:
    """Stack ``batch_size`` consecutive elements (``batch_fn(elements)`` when given); ``drop_remainder`` drops a short last batch.

    Example:
        >>> from portable_loader.grain import MapDataset
        >>> list(MapDataset.range(5).apply([Batch(2, drop_remainder=True)]))
        [array([0, 1]), array([2, 3])]
    """

    batch_size: int
    drop_remainder: bool = False
    batch_fn: Callable[[Sequence[Any]], Any] | None = None


class DatasetSelectionMap(abc.ABC):
    """For ``MapDataset.select_from_datasets``: ``self[i]`` is ``(dataset_index, index_in_that_dataset)``.

    Must be deterministic and picklable.

    Example:
        >>> from portable_loader.grain import MapDataset
        >>> class Alternate(DatasetSelectionMap):
        ...     def __len__(self):
        ...         return 4
        ...     def __getitem__(self, i):
        ...         return (i % 2, i // 2)
        >>> list(MapDataset.select_from_datasets([MapDataset.range(2), MapDataset.range(10, 12)], Alternate()))
        [0, 10, 1, 11]
    """

    @abc.abstractmethod
    def __len__(self) -> int:
        """The number of positions."""

    @abc.abstractmethod
    def __getitem__(self, index: int) -> tuple[int, int]:
        """``(dataset_index, index_in_dataset)`` of position ``index``."""


Transformation = Union[Batch, Map, RandomMap, TfRandomMap, Filter, FlatMap, MapWithIndex]
Transformations = Sequence[Transformation]

# Grain's precedence (its DataLoader tests Map first, then RandomMap, ...): an object subclassing two
# of them is the first.
_ORDER = (("map", Map), ("random_map", RandomMap), ("np_random_map", TfRandomMap), ("flat_map", FlatMap),
          ("filter", Filter), ("map_with_index", MapWithIndex), ("batch", Batch))
_GRAIN_NAMES = {"map": "Map", "random_map": "RandomMap", "np_random_map": "TfRandomMap", "flat_map": "FlatMap",
                "filter": "Filter", "map_with_index": "MapWithIndex", "batch": "Batch"}


def kind_of(transform) -> Optional[str]:
    """Which Grain transformation ``transform`` is: ``"map"``, ``"random_map"``, ``"np_random_map"``,
    ``"flat_map"``, ``"filter"``, ``"map_with_index"``, ``"batch"``, or None.

    Instances of these classes, of real Grain's (when Grain is imported: only then can the user
    have made one), and objects that only have the method (another Grain-like library) count.

    Example:
        >>> kind_of(Batch(4)), kind_of(len)
        ('batch', None)
        >>> class Twice:
        ...     def map(self, x):
        ...         return 2 * x
        >>> kind_of(Twice())
        'map'
    """
    for kind, cls in _ORDER:
        if isinstance(transform, cls):
            return kind
    real = sys.modules.get("grain._src.core.transforms")
    if real is not None:
        for kind, _ in _ORDER:
            if isinstance(transform, getattr(real, _GRAIN_NAMES[kind])):
                return kind
    for kind, _ in _ORDER[:-1]:
        if callable(getattr(transform, kind, None)):
            return kind
    if all(hasattr(transform, a) for a in ("batch_size", "drop_remainder")):
        return "batch"
    return None
