"""Grain's shard options: which share of the data this process loads.

``portable_loader.grain.DataLoader`` shards by **position**: the sampler defines one global stream and
shard ``k`` of ``K`` loads its positions ``k, k + K, k + 2K, ...``. Grain's ``IndexSampler`` gives each
shard a contiguous range of records instead. Positions are what makes a state elastic: every shard
at the same point of its stream has the same state (the global position), which resumes on any
number of shards (docs/grain.md).

Example:
    >>> from portable_loader.grain import sharding
    >>> sharding.ShardOptions(shard_index=1, shard_count=4)
    ShardOptions(shard_index=1, shard_count=4, drop_remainder=False)
    >>> sharding.NoSharding()
    NoSharding(shard_index=0, shard_count=1, drop_remainder=False)
"""

from __future__ import annotations

import dataclasses

__all__ = ["NoSharding", "ShardByJaxProcess", "ShardOptions"]


@dataclasses.dataclass(frozen=True)
class ShardOptions:
    """Load shard ``shard_index`` of ``shard_count``; ``drop_remainder`` gives every shard of a finite
    stream the same number of elements (the last ``total % shard_count`` positions are dropped).

    Example:
        >>> ShardOptions(shard_index=2, shard_count=2)
        Traceback (most recent call last):
        ...
        ValueError: Shard shard_index must be in [0, shard_count - 1], shard_count was 2 and shard_index was 2.
    """

    shard_index: int
    shard_count: int
    drop_remainder: bool = False

    def __post_init__(self):
        if self.shard_count <= 0:
            raise ValueError(f"Number of shards must be a positive integer but got {self.shard_count}.")
        if self.shard_index < 0 or self.shard_index >= self.shard_count:
            raise ValueError("Shard shard_index must be in [0, shard_count - 1], shard_count was "
                             f"{self.shard_count} and shard_index was {self.shard_index}.")


class NoSharding(ShardOptions):
    """Every process loads the whole stream.

    Example:
        >>> NoSharding().shard_count
        1
    """

    def __init__(self):
        super().__init__(shard_index=0, shard_count=1, drop_remainder=False)


class ShardByJaxProcess(ShardOptions):
    """One shard per JAX process: ``jax.process_index()`` of ``jax.process_count()`` (0 of 1 without JAX).

    JAX is imported when one is built, never before.

    Example:
        >>> ShardByJaxProcess(drop_remainder=True)   # one process here
        ShardByJaxProcess(shard_index=0, shard_count=1, drop_remainder=True)
    """

    def __init__(self, drop_remainder: bool = False):
        index, count = process_index_and_count()
        super().__init__(shard_index=index, shard_count=count, drop_remainder=drop_remainder)


def process_index_and_count() -> tuple[int, int]:
    """``(jax.process_index(), jax.process_count())``, or ``(0, 1)`` where JAX is not installed (as Grain).

    Example:
        >>> process_index_and_count()
        (0, 1)
    """
    try:
        import jax
    except ImportError:
        return 0, 1
    return jax.process_index(), jax.process_count()


def shard_of(options) -> tuple[int, int, bool]:
    """``(shard_index, shard_count, drop_remainder)`` of these or real Grain's shard options (read by attribute).

    Example:
        >>> shard_of(ShardOptions(1, 3))
        (1, 3, False)
    """
    index, count = int(options.shard_index), int(options.shard_count)
    if count <= 0 or not 0 <= index < count:
        raise ValueError(f"shard_index {index} is not in [0, shard_count={count})")
    return index, count, bool(getattr(options, "drop_remainder", False))
