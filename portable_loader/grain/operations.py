"""Grain's legacy ``DataLoader`` operations (``grain.python.MapOperation`` and kin) as the transforms they stand for.

Grain 0.2.18 still accepts them in ``DataLoader(operations=...)``, where each wraps a function over
the records' data. Here each *is* the matching transform (``MapOperation`` a ``transforms.Map``,
``BatchOperation`` a batch), so the ``DataLoader``, ``MapDataset.apply`` and the state treat them
as such. An exception of the function is raised as Grain's ``ValueError`` with it as the cause.
Grain's ``grain.experimental.PackAndBatchOperation`` runs there with a position state
(portable_loader/grain/experimental_ops/pack_and_batch.py); any other callable over an iterator of
records (Grain's ``Operation`` protocol) is refused by the ``DataLoader``: what it keeps between
records cannot be saved in a position.

Example:
    >>> from portable_loader import grain
    >>> loader = grain.DataLoader(data_source=list(range(6)), sampler=grain.samplers.SequentialSampler(6),
    ...                           operations=[MapOperation(lambda x: x * 10), FilterOperation(lambda x: x != 20),
    ...                                       BatchOperation(batch_size=2)])
    >>> [b.tolist() for b in loader]
    [[0, 10], [30, 40], [50]]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from portable_loader.grain import transforms
from portable_loader.grain.records import Record

__all__ = ["BatchOperation", "FilterOperation", "MapOperation", "Operation", "RandomMapOperation"]


class Operation(Protocol):
    """Grain's protocol of a legacy operation: records in, records out (refused by ``DataLoader``, see the module).

    Example:
        >>> from portable_loader import grain
        >>> class Keep:
        ...     def __call__(self, records): yield from records
        >>> grain.DataLoader(data_source=[1], sampler=grain.samplers.SequentialSampler(1), operations=[Keep()])
        Traceback (most recent call last):
        ...
        TypeError: DataLoader operations are grain.transforms objects (...); got Keep (...)
    """

    def __call__(self, input_iterator: Iterator[Record]) -> Iterator[Record]:
        ...


def _call(fn: Callable, what: str, *args):
    try:
        return fn(*args)
    except Exception as e:
        raise ValueError(f"PyGrain encountered an error when calling {what}.") from e


@dataclasses.dataclass
class MapOperation(transforms.Map):
    """``map_function`` on each element: ``transforms.Map``.

    Example:
        >>> from portable_loader import grain
        >>> list(grain.MapDataset.range(3).map(MapOperation(lambda x: x + 1)))
        [1, 2, 3]
    """

    map_function: Callable[[Any], Any]

    def map(self, element):
        return _call(self.map_function, "map function", element)


@dataclasses.dataclass
class RandomMapOperation(transforms.RandomMap):
    """``random_map_function(element, rng)`` on each element: ``transforms.RandomMap``.

    Example:
        >>> from portable_loader import grain
        >>> len(list(grain.MapDataset.range(3).random_map(RandomMapOperation(lambda x, rng: x + rng.random()), seed=0)))
        3
    """

    random_map_function: Callable[[Any, np.random.Generator], Any]

    def random_map(self, element, rng):
        return _call(self.random_map_function, "random map function", element, rng)


@dataclasses.dataclass
class FilterOperation(transforms.Filter):
    """Keeps the elements for which ``condition_function`` is true: ``transforms.Filter``.

    Example:
        >>> from portable_loader import grain
        >>> list(grain.MapDataset.range(5).filter(FilterOperation(lambda x: x % 2)))
        [1, 3]
    """

    condition_function: Callable[[Any], bool]

    def filter(self, element) -> bool:
        return _call(self.condition_function, "condition function", element)


@dataclasses.dataclass
class BatchOperation:
    """``batch_size`` consecutive elements stacked (or ``batch_fn(elements)``): ``transforms.Batch``.

    Example:
        >>> BatchOperation(batch_size=0)
        Traceback (most recent call last):
        ...
        ValueError: batch_size must be a positive integer. Got 0.
    """

    batch_size: int
    drop_remainder: bool = False
    batch_fn: Callable[[Sequence[Any]], Any] | None = None

    def __post_init__(self):
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer. Got {self.batch_size}.")

    def disable_deprecation_message(self) -> None:
        """Grain's switch for its deprecation log line; nothing is logged here."""
