"""Grain's ``DataLoader`` built on the dataset layer, with a state that is one global stream position.

``DataLoader(data_source=..., sampler=..., operations=[...], worker_count=N, shard_options=...)`` is
``MapDataset.source(data_source)`` ordered by the sampler, this shard's positions of that stream,
``to_iter_dataset``, the operations, and ``mp_prefetch(MultiprocessingOptions(num_workers=N))``:
the same parts as any pipeline of :mod:`portable_loader.grain`, not a second engine
(:mod:`portable_loader.grain._pipeline`). What it adds to Grain's:

- The elements do not depend on ``worker_count``: 0, 1 or 16 workers give the same stream.
- ``get_state()`` is a fixed-size JSON position (about 200 bytes, at element 10 as at 10**7), and
  ``set_state`` is O(1), at any worker count.
- Sharding is by position (shard ``k`` of ``K`` loads positions ``k, k + K, ...``), so every shard
  that has loaded as many elements has the same state, the global position; it resumes on any
  number of shards, which continue the same global stream (elastic).
- A state of another pipeline (data source, sampler, operations), an edited one or a malformed one
  raises :class:`portable_loader.errors.StateError`.

Where Grain is deterministic (``IndexSampler(shuffle=False)``, ``NoSharding()``, ``Map``, ``Filter``,
``RandomMap``, ``Batch``) the elements are Grain's.

Example:
    >>> from portable_loader import grain
    >>> class Square(grain.transforms.Map):
    ...     def map(self, x):
    ...         return x * x
    >>> loader = grain.DataLoader(data_source=list(range(10)),
    ...                           sampler=grain.samplers.IndexSampler(10, shuffle=False, num_epochs=1),
    ...                           operations=[Square(), grain.transforms.Batch(4)], worker_count=2)
    >>> with iter(loader) as it:
    ...     first = next(it)
    ...     state = it.get_state()
    ...     rest = list(it)
    >>> first.tolist(), [b.tolist() for b in rest]
    ([0, 1, 4, 9], [[16, 25, 36, 49], [64, 81]])
    >>> with iter(grain.DataLoader(data_source=list(range(10)), sampler=grain.samplers.IndexSampler(10, num_epochs=1),
    ...                            operations=[Square(), grain.transforms.Batch(4)])) as it:   # no workers now
    ...     it.set_state(state)
    ...     [b.tolist() for b in it] == [b.tolist() for b in rest]
    True
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from portable_loader.dataset.base import Dataset, digest
from portable_loader.dataset.iter.iterator import DatasetIterator
from portable_loader.grain import sharding as sharding_mod
from portable_loader.grain._pipeline import StreamRecords, apply_operation, data_of, operation_identity
from portable_loader.grain._state import encode, make_state, read_state
from portable_loader.grain.transforms import kind_of
from portable_loader.grain.options import MultiprocessingOptions, ReadOptions
from portable_loader.grain.samplers import IndexSampler, stream_order
from portable_loader.errors import StateError
from portable_loader.lifecycle import Closing

__all__ = ["DataLoader", "DataLoaderIterator", "load"]


class DataLoader:
    """Grain's ``DataLoader``: records of ``data_source`` in ``sampler``'s order, ``operations`` applied,
    ``worker_count`` worker processes; ``iter()`` gives a :class:`DataLoaderIterator`.

    Args:
        data_source: anything with ``__len__`` and ``__getitem__`` (Grain's ``RandomAccessDataSource``:
            a list, ``grain.sources.ArrayRecordDataSource``, a ``MapDataset``, a portable_loader cache).
        sampler: ``grain.samplers.IndexSampler`` / ``SequentialSampler`` (these or real Grain's), or any
            object whose ``[index]`` is a ``RecordMetadata``.
        operations: ``grain.transforms`` objects (``Map``, ``RandomMap``, ``TfRandomMap``,
            ``MapWithIndex``, ``Filter``, ``Batch``), these classes' or real Grain's. ``MapWithIndex``
            gets the element's global stream position (a batch's: its last element's). ``FlatMap``
            gives piece ``j`` of the record at position ``p`` the index ``p * max_fan_out + j``, as
            Grain does, and runs in this process with what follows it.
        worker_count: worker processes (None: one per CPU); the elements do not depend on it.
        worker_buffer_size: elements each worker keeps ready.
        shard_options: this process's shard (default: the sampler's); by position, see the module docstring.
        read_options: ``ReadOptions`` for reading the source with threads; None reads without threads.
        enable_profiling: accepted for Grain's signature; does nothing.

    Example:
        >>> from portable_loader.grain import samplers, sharding
        >>> src = list(range(7))
        >>> shards = [DataLoader(data_source=src, sampler=samplers.IndexSampler(7, num_epochs=1),
        ...                      shard_options=sharding.ShardOptions(k, 2)) for k in range(2)]
        >>> [list(s) for s in shards]                       # position sharding: every 2nd position
        [[0, 2, 4, 6], [1, 3, 5]]
    """

    def __init__(self, *, data_source, sampler, operations: Sequence = (), worker_count: Optional[int] = 0,
                 worker_buffer_size: int = 1, shard_options=None, read_options: Optional[ReadOptions] = None,
                 enable_profiling: bool = False):
        if worker_count is None:
            worker_count = os.cpu_count() or 1
        if isinstance(worker_count, bool) or not isinstance(worker_count, int) or worker_count < 0:
            raise ValueError(f"Worker count should be greater than or equal zero.Current worker_count is {worker_count}.")
        if worker_buffer_size < 0:
            raise ValueError("Worker buffer size must be greater than or equal zero.Current worker_buffer_size is "
                             f"{worker_buffer_size}.")
        self._order = stream_order(sampler)
        own = self._order.shard_options
        if shard_options is None:
            if own is None:
                raise ValueError("No shard options were provided to the DataLoader. Please pass shard options to the "
                                 "DataLoader (grain.sharding.NoSharding() for none).")
            shard_options = own
        elif own is not None and sharding_mod.shard_of(own)[1] > 1 and \
                sharding_mod.shard_of(own)[:2] != sharding_mod.shard_of(shard_options)[:2]:
            raise ValueError(f"the sampler's shard options {own!r} and the DataLoader's {shard_options!r} name "
                             "different shards; give them once, to the DataLoader")
        self._shard = sharding_mod.shard_of(shard_options)
        self._shard_options = shard_options
        self._operations = list(operations)
        self._sampler, self._data_source, self._read_options = sampler, data_source, read_options
        self._multiprocessing_options = MultiprocessingOptions(
            num_workers=worker_count, per_worker_buffer_size=worker_buffer_size, enable_profiling=enable_profiling)
        self._records = StreamRecords(Dataset.source(data_source), self._order)
        self._flat_maps = sum(1 for op in self._operations if kind_of(op) == "flat_map")
        self._fingerprint = digest("portable_loader.grain.DataLoader", self._records.fingerprint(),
                                   tuple(operation_identity(op) for op in self._operations))

    @property
    def multiprocessing_options(self) -> MultiprocessingOptions:
        """The worker processes' options, built from ``worker_count`` and ``worker_buffer_size``.

        Example:
            >>> from portable_loader.grain import samplers
            >>> DataLoader(data_source=[1], sampler=samplers.SequentialSampler(1), worker_count=3).multiprocessing_options.num_workers
            3
        """
        return self._multiprocessing_options

    def fingerprint(self) -> str:
        """16 hex digits naming data source, sampler and operations: what a state must match to resume here.

        Example:
            >>> from portable_loader.grain import samplers, sharding
            >>> a = DataLoader(data_source=[1, 2], sampler=samplers.IndexSampler(2), worker_count=0)
            >>> b = DataLoader(data_source=[1, 2], sampler=samplers.IndexSampler(2), worker_count=4,
            ...                shard_options=sharding.ShardOptions(1, 2))
            >>> a.fingerprint() == b.fingerprint()        # workers and shards change no stream
            True
        """
        return self._fingerprint

    def _end(self) -> int:
        """Positions of the global stream this shard may read below: all, or a multiple of the shard count."""
        total = self._order.total
        _, count, drop = self._shard
        return total - total % count if drop and total < sys.maxsize else total

    def _pipeline(self, base: int):
        """The ``IterDataset`` of this shard from global position ``base`` on."""
        index, count, _ = self._shard
        stop = self._end()
        ds = self._records.slice(slice(min(base + index, stop), stop, count)).to_iter_dataset(self._read_options)
        for op in self._operations:
            ds = apply_operation(ds, op)
        ds = ds.map(data_of)
        if self._multiprocessing_options.num_workers > 0:
            ds = ds.mp_prefetch(self._multiprocessing_options)
        return ds

    def __iter__(self) -> "DataLoaderIterator":
        return DataLoaderIterator(self)

    def __repr__(self) -> str:
        return (f"DataLoader(sampler={self._sampler!r}, operations={len(self._operations)}, "
                f"worker_count={self._multiprocessing_options.num_workers}, shard={self._shard[0]}/{self._shard[1]}, "
                f"fingerprint={self._fingerprint})")


class DataLoaderIterator(Closing):
    """The iterator of a :class:`DataLoader`: ``next``, ``get_state() -> bytes``, ``set_state(state)``, ``close``.

    ``get_state()`` is JSON bytes of fixed size (:mod:`portable_loader.grain._state`): the global
    position this shard has reached, ``position = base + n * shard_count`` after ``n`` positions of
    its own. ``set_state`` takes those bytes, their text or their dict, and continues in O(1) at any
    worker count; at another shard count too, where every shard saved the same state (with filters,
    shards can drift apart: the checkpoint handler refuses such a set for another count).
    ``validate_state`` is accepted for Grain's signature: states are always checked.

    Example:
        >>> import json
        >>> from portable_loader.grain import DataLoader, samplers
        >>> loader = DataLoader(data_source=list(range(100)), sampler=samplers.IndexSampler(100))
        >>> it = iter(loader)
        >>> [next(it) for _ in range(3)], json.loads(it.get_state())["position"]
        ([0, 1, 2], '00000000000000000003')
        >>> it.set_state(b"{}")
        Traceback (most recent call last):
        ...
        portable_loader.errors.StateError: loader state: field 'version': missing
        >>> it.close()
    """

    def __init__(self, data_loader: DataLoader, state=None, validate_state: bool = True):
        self._closed = True  # until built: a failed build leaves nothing to close
        self._loader = data_loader
        self._base = 0
        self._it = iter(data_loader._pipeline(0))
        self._closed = False
        if state is not None:
            self.set_state(state)

    def __iter__(self) -> "DataLoaderIterator":
        return self

    def __next__(self):
        if self._closed:
            raise ValueError("this DataLoaderIterator is closed")
        return next(self._it)

    def _position(self) -> tuple[int, list[int]]:
        """The global position, and per ``FlatMap`` the pieces emitted of the record there (in pipeline order)."""
        cursor = self._it.get_state()["cursor"]
        (consumed,) = [int(v) for k, v in cursor.items() if k.endswith(".source.position")]
        pieces = [int(cursor[k]) for k in self._piece_fields()]
        return min(self._base + consumed * self._loader._shard[1], self._loader._end()), pieces

    def _piece_fields(self) -> list[str]:
        return sorted((k for k in self._it._names if k.endswith(".flat_map.index")),
                      key=lambda k: int(k.split(".")[0]))

    def get_state(self) -> bytes:
        """The global stream position after the last element returned, as JSON bytes (Grain's type).

        Example:
            >>> from portable_loader.grain import DataLoader, samplers
            >>> it = iter(DataLoader(data_source=[1, 2], sampler=samplers.IndexSampler(2)))
            >>> len(it.get_state()) < 1024
            True
        """
        position, pieces = self._position()
        if not self._loader._flat_maps:
            return encode(make_state(self._loader._fingerprint, position))
        return encode(make_state(self._loader._fingerprint, position, self._loader._shard[:2], pieces))

    def set_state(self, state) -> None:
        """Continue from ``state`` (bytes, text or dict from ``get_state``); ``StateError`` if it is not this pipeline's.

        Example:
            >>> from portable_loader.grain import DataLoader, samplers
            >>> it = iter(DataLoader(data_source=list("abcdef"), sampler=samplers.IndexSampler(6)))
            >>> saved = it.get_state(); _ = next(it)
            >>> it.set_state(saved); next(it)
            'a'
        """
        if self._closed:
            raise ValueError("this DataLoaderIterator is closed")
        loader = self._loader
        position, shard, pieces = read_state(state, loader._fingerprint, loader._order.total, loader._flat_maps)
        if any(pieces) and shard != loader._shard[:2]:
            raise StateError("shard", f"saved by shard {shard[0]} of {shard[1]} inside a record's FlatMap pieces: it "
                                      f"resumes there only, not on shard {loader._shard[0]} of {loader._shard[1]}")
        old, self._it = self._it, iter(loader._pipeline(position))
        self._base = position
        old.close()
        if any(pieces):  # the record at ``position`` is re-read and re-split; these pieces of it are skipped
            fields = {k: 0 for k in self._it._names}
            fields.update(zip(self._piece_fields(), pieces))
            self._it._root.restore(fields, StateError)

    def start_prefetch(self) -> None:
        """Kept for Grain's API (its checkpoint handler calls it): workers start at the first ``next``.

        Example:
            >>> from portable_loader.grain import DataLoader, samplers
            >>> iter(DataLoader(data_source=[1], sampler=samplers.IndexSampler(1))).start_prefetch()
        """
        self._it.start_prefetch()

    set_weights = DatasetIterator.set_weights  # refused, saying why: a sampler's order has no online weights

    def close(self) -> None:
        """End the worker processes and reader threads; safe to call twice.

        Example:
            >>> from portable_loader.grain import DataLoader, samplers
            >>> it = iter(DataLoader(data_source=[1], sampler=samplers.IndexSampler(1), worker_count=1))
            >>> it.close(); it.close()
        """
        if self._closed:
            return
        self._closed = True
        self._it.close()

    def __str__(self) -> str:
        return f"DataLoaderIterator(state={self.get_state().decode()})"


def load(source, *, num_epochs: Optional[int] = None, shuffle: bool = False, seed: Optional[int] = None,
         shard_options=sharding_mod.NoSharding(), transformations: Sequence = (), batch_size: Optional[int] = None,
         drop_remainder: bool = False, worker_count: Optional[int] = 0,
         read_options: Optional[ReadOptions] = None) -> DataLoader:
    """Grain's ``grain.load``: a :class:`DataLoader` over ``source`` with an ``IndexSampler`` and an optional batch.

    Example:
        >>> [b.tolist() for b in load(list(range(5)), num_epochs=1, batch_size=2)]
        [[0, 1], [2, 3], [4]]
    """
    from portable_loader.grain.transforms import Batch

    sampler = IndexSampler(num_records=len(source), shuffle=shuffle, seed=seed, num_epochs=num_epochs,
                           shard_options=shard_options)
    transformations = list(transformations)
    if batch_size is not None:
        transformations.append(Batch(batch_size, drop_remainder=drop_remainder))
    return DataLoader(data_source=source, sampler=sampler, operations=transformations, worker_count=worker_count,
                      read_options=read_options)
