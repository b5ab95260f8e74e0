"""Grain's ``DatasetOptions`` and ``WithOptionsIterDataset``: options for a whole ``IterDataset`` pipeline.

``WithOptionsIterDataset(ds, DatasetOptions(...))`` sets options for every step of the pipeline,
before and after it, as in Grain 0.2.18. Where several are set, an option set downstream wins
over the same option set upstream, and an option set nowhere has Grain's default
(:meth:`DatasetOptions.merge`). What they do here:

- ``filter_warn_threshold_ratio`` (default 0.9) and ``filter_raise_threshold_ratio`` (default
  None): over each window of 1,000 elements a filter sees, a warning (at most once a minute), or
  a ``ValueError`` at the window's last element, when the filter dropped at least that share of
  them. ``None`` (or 0, as in Grain) turns a check off. Filters that run right after
  ``to_iter_dataset`` are checked together, with the holes of the ``MapDataset`` (what its own
  filters left): the share is of the source positions.
- ``min_shm_size`` and ``execution_tracking_mode`` are accepted and change nothing: ``mp_prefetch``'s
  workers return elements pickled (no shared memory to size), and no execution statistics are
  collected.

The options do not change which element comes at which position, so they are not part of the
pipeline's fingerprint: a state resumes with other options.

Example:
    >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
    >>> ds = to_iter_dataset(range(2000)).filter(lambda x: x < 50)
    >>> strict = WithOptionsIterDataset(ds, DatasetOptions(filter_raise_threshold_ratio=0.9))
    >>> iter(strict)._ctx.dataset_options.filter_raise_threshold_ratio
    0.9
    >>> try:
    ...     list(strict)
    ... except ValueError as e:
    ...     print(str(e)[:94])
    Transformation FilterDatasetIterator(transform=<lambda>) skipped 95.00 % of the last seen 1000
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from typing import Any

from portable_loader.dataset.iter.dataset import IterDataset

__all__ = ["DatasetOptions", "ExecutionTrackingMode", "IteratorContext", "MultiprocessingContext",
           "WithOptionsIterDataset", "pipeline_options"]


@enum.unique
class ExecutionTrackingMode(enum.Enum):
    """Grain's modes of collecting execution statistics; accepted, and no statistics are collected here.

    Example:
        >>> DatasetOptions(execution_tracking_mode=ExecutionTrackingMode.STAGE_TIMING).execution_tracking_mode.name
        'STAGE_TIMING'
    """

    DISABLED = enum.auto()
    STAGE_TIMING = enum.auto()


class _Unset:
    """The default of a field nobody set: ``merge`` tells it from a value set to the default."""

    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()
_DEFAULTS = {"filter_warn_threshold_ratio": 0.9, "filter_raise_threshold_ratio": None,
             "execution_tracking_mode": ExecutionTrackingMode.DISABLED, "min_shm_size": 0}


@dataclasses.dataclass(kw_only=True, frozen=True)
class DatasetOptions:
    """Grain's ``grain.experimental.DatasetOptions``: its fields, defaults and merge rule (module docstring).

    A field given here is *set*; one left out takes Grain's default and yields to a set value in
    :meth:`merge`. Two options are equal when their values and the fields set are (as in Grain).

    Example:
        >>> a = DatasetOptions(min_shm_size=1024)
        >>> b = DatasetOptions(min_shm_size=512, filter_warn_threshold_ratio=None)
        >>> m = a.merge(b)
        >>> m.min_shm_size, m.filter_warn_threshold_ratio, m.filter_raise_threshold_ratio
        (1024, None, None)
        >>> DatasetOptions().filter_warn_threshold_ratio
        0.9
    """

    filter_warn_threshold_ratio: float | None = _UNSET
    filter_raise_threshold_ratio: float | None = _UNSET
    execution_tracking_mode: ExecutionTrackingMode = _UNSET
    min_shm_size: int = _UNSET
    _user_set_fields: frozenset = dataclasses.field(default=frozenset(), init=False, repr=False)

    def __post_init__(self):
        given = frozenset(name for name in _DEFAULTS if getattr(self, name) is not _UNSET)
        for name in given:
            _check(name, getattr(self, name))
        for name in _DEFAULTS.keys() - given:
            object.__setattr__(self, name, _DEFAULTS[name])
        object.__setattr__(self, "_user_set_fields", given)

    def merge(self, other: "DatasetOptions | None") -> "DatasetOptions":
        """These options over ``other``'s: a field set here wins, then one set in ``other``, then the default.

        Example:
            >>> DatasetOptions(filter_raise_threshold_ratio=0.4).merge(
            ...     DatasetOptions(filter_warn_threshold_ratio=0.1, filter_raise_threshold_ratio=0.2))
            DatasetOptions(filter_warn_threshold_ratio=0.1, filter_raise_threshold_ratio=0.4, execution_tracking_mode=<ExecutionTrackingMode.DISABLED: 1>, min_shm_size=0)
        """
        if other is None:
            return self
        merged = {name: getattr(other, name) for name in other._user_set_fields}
        merged.update({name: getattr(self, name) for name in self._user_set_fields})
        return DatasetOptions(**merged)


def _check(name: str, value) -> None:
    if name.endswith("_ratio"):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                  or not 0 <= value <= 1):
            raise ValueError(f"DatasetOptions.{name} must be None or a ratio in [0, 1], got {value!r}")
    elif name == "min_shm_size":
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"DatasetOptions.min_shm_size must be an integer >= 0, got {value!r}")
    elif not isinstance(value, ExecutionTrackingMode):
        raise ValueError(f"DatasetOptions.execution_tracking_mode must be an ExecutionTrackingMode, got {value!r}")


class WithOptionsIterDataset(IterDataset):
    """Grain's ``WithOptionsIterDataset``: ``parent``'s elements, with ``options`` for the whole pipeline.

    Example:
        >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
        >>> ds = WithOptionsIterDataset(to_iter_dataset(range(3)), DatasetOptions(min_shm_size=10))
        >>> list(ds.map(lambda x: x + 1)), ds.fingerprint() == to_iter_dataset(range(3)).fingerprint()
        ([1, 2, 3], True)
    """

    def __init__(self, parent: IterDataset, options: DatasetOptions):
        if not isinstance(parent, IterDataset):
            raise TypeError(f"WithOptionsIterDataset: expected an IterDataset, got {type(parent).__name__}")
        if not isinstance(options, DatasetOptions):
            raise TypeError(f"WithOptionsIterDataset: expected DatasetOptions, got {type(options).__name__}")
        super().__init__((parent,))
        self.options = options

    def _identity(self) -> tuple:
        return self._parent._identity()  # options never change which element comes where

    def __str__(self) -> str:
        return f"WithOptionsIterDataset(options={self.options})"


@dataclasses.dataclass(frozen=True)
class MultiprocessingContext:
    """Grain's ``MultiprocessingContext``: which worker process an iterator runs in, of how many.

    Here every iterator a user writes runs in the trainer's process, over the ordered stream
    (docs/grain.md, "User-written iterators"), so it is always worker 0 of 1.

    Example:
        >>> MultiprocessingContext()
        MultiprocessingContext(process_index=0, process_count=1)
    """

    process_index: int = 0
    process_count: int = 1


@dataclasses.dataclass
class IteratorContext:
    """What Grain's iterators share as ``_ctx``: the options in force for the iterator's pipeline, and
    Grain's ``mp_context`` and ``is_dataloader_pipeline``.

    Example:
        >>> ctx = IteratorContext(DatasetOptions(min_shm_size=8))
        >>> ctx.merge(IteratorContext(DatasetOptions(min_shm_size=2, filter_warn_threshold_ratio=0.5)))
        >>> options = ctx.dataset_options
        >>> options.min_shm_size, options.filter_warn_threshold_ratio, ctx.mp_context.process_count
        (8, 0.5, 1)
    """

    dataset_options: DatasetOptions = dataclasses.field(default_factory=DatasetOptions)
    mp_context: MultiprocessingContext = MultiprocessingContext()
    is_dataloader_pipeline: bool = False

    def merge(self, other: "IteratorContext") -> None:
        """Grain's merge, in place: these options over ``other``'s (a user's iterator over several parents)."""
        self.dataset_options = self.dataset_options.merge(other.dataset_options)
        self.is_dataloader_pipeline = self.is_dataloader_pipeline or other.is_dataloader_pipeline


def pipeline_options(root: IterDataset) -> DatasetOptions:
    """The options in force for ``root``'s pipeline: every ``WithOptionsIterDataset`` in it, downstream first.

    Example:
        >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
        >>> inner = WithOptionsIterDataset(to_iter_dataset(range(3)), DatasetOptions(min_shm_size=1, filter_warn_threshold_ratio=0.5))
        >>> outer = WithOptionsIterDataset(inner.batch(2), DatasetOptions(min_shm_size=2))
        >>> o = pipeline_options(outer)
        >>> o.min_shm_size, o.filter_warn_threshold_ratio
        (2, 0.5)
    """
    result = DatasetOptions()
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, WithOptionsIterDataset):
            result = result.merge(node.options)
        # A node's parents are upstream of it, so they are merged after it and yield to it.
        stack.extend(p for p in node.parents if isinstance(p, IterDataset))
    return result
