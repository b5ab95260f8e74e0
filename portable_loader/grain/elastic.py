"""Grain's ``ElasticIterator``: global batches cut into one share per shard, with a state every shard shares.

``ElasticIterator(ds, global_batch_size, shard_options)`` yields, on shard ``k`` of ``K``, its share
of each global batch: of the ``global_batch_size`` consecutive elements of the global stream, the
ones at offsets ``k, k + K, ...`` (so ``global_batch_size / K`` per shard), as Grain does. Every
shard's state after ``s`` steps is the same: the position of the global stream after ``s`` global
batches. Any shard's state restores every shard of another count (and another global batch
size), which continues the global stream: nothing is dropped or repeated.

Two ways to get there, chosen by ``ds``:

- A ``MapDataset`` without filters: Grain's own construction. Shard ``k`` reads only its elements,
  ``ds[g + k::K]`` batched by ``global_batch_size / K`` (drop remainder), ``g`` the global index
  reached; the state is ``g``. The elements are Grain's (where Grain's ``ds`` is the same: our
  shuffles differ), and a shard stops where Grain's stops.
- A ``MapDataset`` with filters (or a flat map, whose unused slots are holes), or any
  ``IterDataset`` (packing, ``concat_then_split``, ...), which Grain refuses: the global stream is
  ``ds`` itself (``to_iter_dataset`` first, for a ``MapDataset``), every shard reads all of it and
  keeps its share of each global batch, and the state is that stream's position, which every
  shard has reached alike. This costs each shard the whole stream's work (with ``mp_prefetch``'s
  workers: their CPU time): what a filter or a packer must pay to agree, without talking, on
  where each global batch ends.

The state is a ``DatasetIterator`` state (a small JSON dict; :mod:`portable_loader.dataset.iter.iterator`):
its fingerprint names ``ds`` only, not the shard, the batch size, the workers or the read options.

Example:
    >>> from portable_loader import grain
    >>> ds = grain.MapDataset.range(10).map(lambda x: x + 1)
    >>> shards = [ElasticIterator(ds, 4, grain.sharding.ShardOptions(k, 2)) for k in range(2)]
    >>> [next(it).tolist() for it in shards]           # global batch [1, 2, 3, 4], 2 elements each
    [[1, 3], [2, 4]]
    >>> state = shards[0].get_state()
    >>> state == shards[1].get_state()
    True
    >>> one = ElasticIterator(ds, 3, grain.sharding.NoSharding())   # resume on 1 shard, batches of 3
    >>> one.set_state(state)
    >>> [b.tolist() for b in one]
    [[5, 6, 7], [8, 9, 10]]
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from portable_loader.dataset.base import Dataset
from portable_loader.dataset.batch import stack
from portable_loader.dataset.iter.dataset import IterDataset, to_iter_dataset
from portable_loader.dataset.iter.runtime import OverChild
from portable_loader.grain.options import ReadOptions
from portable_loader.grain.sharding import shard_of

__all__ = ["ElasticIterator"]


class ElasticIterator(IterDataset):
    """Grain's ``ElasticIterator(ds, global_batch_size, shard_options, *, read_options, multiprocessing_options)``.

    ``ds``: the unbatched, unsharded dataset, a ``MapDataset`` (filters allowed here) or an
    ``IterDataset`` (packing allowed here). ``global_batch_size`` must be a multiple of the shard
    count. Like Grain's it is an ``IterDataset`` that is also its own iterator: ``iter()`` returns
    the one iterator it holds, and ``next``, ``get_state``, ``set_state`` and ``close`` on it act
    on that iterator. ``read_options`` and ``multiprocessing_options`` change how fast, never what.

    Example:
        >>> from portable_loader import grain
        >>> evens = grain.MapDataset.range(12).filter(lambda x: x % 2 == 0)    # Grain refuses a filter
        >>> it = ElasticIterator(evens, 2, grain.sharding.ShardOptions(1, 2))
        >>> [b.tolist() for b in it]                                         # the 2nd of each pair
        [[2], [6], [10]]
    """

    def __init__(self, ds, global_batch_size: int, shard_options, *, read_options=ReadOptions(),
                 multiprocessing_options=None):
        index, count, _ = shard_of(shard_options)
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, (int, np.integer)) \
                or global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
        host_batch_size, remainder = divmod(int(global_batch_size), count)
        if remainder:
            raise ValueError(f"Global batch size {global_batch_size} is not divisible by shard count {count}.")
        self.global_batch_size, self.host_batch_size = int(global_batch_size), host_batch_size
        self.shard_index, self.shard_count = index, count
        self.read_options, self.multiprocessing_options = read_options, multiprocessing_options
        self.ds: Dataset | None = None  # set where each shard reads only its own elements
        if isinstance(ds, IterDataset):
            stream = ds
        else:
            ds = Dataset.source(ds)
            if not ds.filters:
                self.ds = ds
                super().__init__(())
                return
            stream = to_iter_dataset(ds, read_options)
        if multiprocessing_options is not None:
            stream = stream.mp_prefetch(multiprocessing_options)
        super().__init__((stream,))

    def _identity(self) -> tuple:
        return ("elastic", self.ds.fingerprint() if self.ds is not None else self._parent._identity())

    def _make_part(self, children: list, n: int):
        if self.ds is not None:
            return _SlicePart(f"{n}.elastic.index", self)
        return _SharePart(children[0], self)

    def _slice(self, start: int) -> IterDataset:
        """This shard's batches from global index ``start`` on, as Grain builds them."""
        ds = to_iter_dataset(self.ds[start + self.shard_index::self.shard_count], self.read_options)
        ds = ds.batch(self.host_batch_size, drop_remainder=True)
        if self.multiprocessing_options is not None:
            ds = ds.mp_prefetch(self.multiprocessing_options)
        return ds

    @functools.cached_property
    def _default_iterator(self):
        return super().__iter__()

    def __iter__(self):
        """The one iterator this holds, as Grain's ``ElasticIterator`` returns (so a state set on it is kept).

        Example:
            >>> from portable_loader import grain
            >>> it = ElasticIterator(grain.MapDataset.range(4), 2, grain.sharding.NoSharding())
            >>> iter(it) is iter(it)
            True
        """
        return self._default_iterator

    def __next__(self) -> Any:
        """This shard's share of the next global batch.

        Example:
            >>> from portable_loader import grain
            >>> next(ElasticIterator(grain.MapDataset.range(4), 2, grain.sharding.ShardOptions(1, 2))).tolist()
            [1]
        """
        return next(self._default_iterator)

    def get_state(self) -> dict:
        """The global stream's position after the last global batch: the same on every shard.

        Example:
            >>> from portable_loader import grain
            >>> it = ElasticIterator(grain.MapDataset.range(8), 4, grain.sharding.NoSharding())
            >>> _ = next(it)
            >>> it.get_state()["cursor"]
            {'0.elastic.index': '00000000000000000004'}
        """
        return self._default_iterator.get_state()

    def set_state(self, state: dict) -> None:
        """Continue from ``state``, saved by any shard of any count; another dataset's state is refused.

        Example:
            >>> from portable_loader import grain
            >>> it = ElasticIterator(grain.MapDataset.range(8), 4, grain.sharding.NoSharding())
            >>> it.set_state({"global_next_index": 4})      # Grain's own state: not a position of ours
            Traceback (most recent call last):
            ...
            portable_loader.errors.StateError: loader state: field 'version': missing
        """
        self._default_iterator.set_state(state)

    def close(self) -> None:
        """End the iterator's worker processes and reader threads, if it was started.

        Example:
            >>> from portable_loader import grain
            >>> ElasticIterator(grain.MapDataset.range(4), 2, grain.sharding.NoSharding()).close()
        """
        if "_default_iterator" in self.__dict__:
            self._default_iterator.close()

    def __str__(self) -> str:
        return (f"ElasticIterator(global_batch_size={self.global_batch_size}, "
                f"shard={self.shard_index}/{self.shard_count})")


class _SlicePart:
    """Grain's way: this shard reads ``ds[g + k::K]`` in batches; the state is the global index ``g`` reached."""

    def __init__(self, field: str, spec: ElasticIterator):
        self.field, self.spec = field, spec
        self.index = 0
        self.it = None  # built on first use, and again after a restore: the slice starts at ``index``

    def next(self):
        if self.it is None:
            self.it = iter(self.spec._slice(self.index))
        batch = next(self.it)
        self.index += self.spec.global_batch_size
        return batch

    def fields(self) -> dict:
        return {self.field: self.index}

    def field_names(self) -> list[str]:
        return [self.field]

    def restore(self, fields: dict, refuse) -> None:
        self.close()
        self.index, self.it = fields[self.field], None

    def close(self) -> None:
        if self.it is not None:
            self.it.close()


class _SharePart(OverChild):
    """Every shard reads the whole global stream and keeps its share of each global batch; the stream's state is shared."""

    def __init__(self, child, spec: ElasticIterator):
        self.child, self.spec = child, spec

    def next(self):
        spec, pulled = self.spec, []
        for _ in range(spec.global_batch_size):
            try:
                pulled.append(self.child.next())
            except StopIteration:
                break
        own = pulled[spec.shard_index::spec.shard_count]
        if len(own) < spec.host_batch_size:  # Grain's drop_remainder: this shard's share is short
            raise StopIteration
        return stack(own)

