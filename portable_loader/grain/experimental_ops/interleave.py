"""Grain's ``InterleaveIterDataset``: up to ``cycle_length`` datasets read in turn, each replaced by the next when it ends.

The order is Grain's: slot ``k`` of the cycle gives one element, then slot ``k + 1``; an empty
slot takes the next dataset (in order) and gives its first element at once; a dataset that ends
frees its slot for the next turn. ``cycle_length=1`` chains the datasets. ``datasets`` is a
sequence of ``IterDataset``s or ``MapDataset``s, or a ``MapDataset`` whose elements are datasets
(``MapDataset.source(files).map(make_source)``), made into iterators only when their turn comes.

The iterator is written as a Grain user writes one, and its state is Grain's: the cycle's position,
the next dataset, and each slot's dataset index, iterator state and whether it ended (the slots'
states are the inner iterators' own: Grain's where the inner iterator is Grain-shaped, as a
``ParquetIterDataset`` file's, our positions for our pipelines). ``num_make_iter_threads``,
``make_iter_buffer_size`` and ``iter_buffer_size`` are Grain's read-ahead settings; here the inner
iterators are made and read in the caller's thread, so they change nothing. Its state is not a
flat position: inside our pipelines, where its inner iterators' states are flat dicts of integers
with the same keys (files: ``ParquetIterDataset``, ``TFRecordIterDataset``), it is laid out as
integer fields (:class:`InterleavePart`); over other datasets (``MapDataset``s, pipelines) it runs
as an opaque step (:mod:`portable_loader.dataset.iter.opaque`): its iterator as written, its Grain
state nested under the pipeline state's ``steps`` (:func:`interleave_part`).

Example:
    >>> from portable_loader import grain
    >>> parts = [grain.MapDataset.range(s, s + n) for s, n in ((0, 3), (10, 1), (20, 2))]
    >>> list(InterleaveIterDataset(parts, cycle_length=2))
    [0, 10, 1, 2, 20, 21]
    >>> list(InterleaveIterDataset(parts, cycle_length=1))
    [0, 1, 2, 10, 20, 21]
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

from portable_loader.dataset.base import Dataset
from portable_loader.dataset.iter.dataset import IterDataset
from portable_loader.dataset.iter.opaque import OpaqueIter
from portable_loader.errors import StateError
from portable_loader.grain.experimental_ops.parts import GrainStyleIterator

__all__ = ["InterleaveDatasetIterator", "InterleaveIterDataset", "interleave_part"]

_STATE_KEYS = ("next_index_in_cycle", "next_index_in_datasets", "iterators_in_use_indices", "iterators_in_use_states",
               "exhausted")


def _make_iterator(ds):
    return iter(ds.to_iter_dataset() if isinstance(ds, Dataset) else ds)


class InterleaveDatasetIterator(GrainStyleIterator):
    """The iterator of :class:`InterleaveIterDataset`, with Grain's state.

    Example:
        >>> from portable_loader import grain
        >>> it = InterleaveDatasetIterator([grain.MapDataset.range(2), grain.MapDataset.range(5, 6)], cycle_length=2)
        >>> next(it), it.get_state()["next_index_in_cycle"], list(it)
        (0, 1, [5, 1])
    """

    def __init__(self, datasets, cycle_length: int):
        super().__init__()
        self._datasets = datasets
        self._cycle_length = min(cycle_length, len(datasets))
        self._next_index_in_cycle = 0
        self._next_index_in_datasets = 0
        self._iterators_in_use_indices = list(range(self._cycle_length))
        self._iterators_in_use: list = [None] * self._cycle_length
        self._exhausted_iterator_state: list = [None] * self._cycle_length

    def _open_next(self, slot: int) -> None:
        self._iterators_in_use[slot] = _make_iterator(self._datasets[self._next_index_in_datasets])
        self._exhausted_iterator_state[slot] = None
        self._iterators_in_use_indices[slot] = self._next_index_in_datasets
        self._next_index_in_datasets += 1

    def __next__(self) -> Any:
        if self._closed:
            raise ValueError("this DatasetIterator is closed")
        while True:
            slot = self._next_index_in_cycle
            it = self._iterators_in_use[slot] if self._cycle_length else None
            if it is not None:
                try:
                    element = next(it)
                except StopIteration:
                    self._exhausted_iterator_state[slot] = it.get_state()
                    it.close()
                    self._iterators_in_use[slot] = None
                    self._next_index_in_cycle = (slot + 1) % self._cycle_length
                    continue
                self._next_index_in_cycle = (slot + 1) % self._cycle_length
                return element
            if self._next_index_in_datasets < len(self._datasets):
                self._open_next(slot)
            elif not any(x is not None for x in self._iterators_in_use):
                raise StopIteration
            else:
                self._next_index_in_cycle = (slot + 1) % self._cycle_length

    def get_state(self) -> dict:
        states: list = [None] * self._cycle_length
        for slot in range(self._cycle_length):
            it = self._iterators_in_use[slot]
            if it is not None:
                states[slot] = it.get_state()
            elif self._exhausted_iterator_state[slot] is not None:
                states[slot] = self._exhausted_iterator_state[slot]
            elif self._next_index_in_datasets >= len(self._datasets):
                break
            else:  # as Grain: a free slot is filled, so the state names the dataset it will read
                self._open_next(slot)
                states[slot] = self._iterators_in_use[slot].get_state()
        return {
            "next_index_in_cycle": self._next_index_in_cycle,
            "next_index_in_datasets": self._next_index_in_datasets,
            "iterators_in_use_indices": list(self._iterators_in_use_indices),
            "iterators_in_use_states": copy.deepcopy(states),
            "exhausted": [int(s is not None) for s in self._exhausted_iterator_state],
            "future_states": {},
        }

    def set_state(self, state) -> None:
        if not isinstance(state, dict) or any(k not in state for k in _STATE_KEYS):
            raise StateError(None, f"an InterleaveIterDataset state has the keys {list(_STATE_KEYS)}, got {state!r}")
        n, cycle = len(self._datasets), self._cycle_length
        indices, states, exhausted = (state["iterators_in_use_indices"], state["iterators_in_use_states"],
                                      state["exhausted"])
        if not (len(indices) == len(states) == len(exhausted) == cycle):
            raise StateError("iterators_in_use_indices", f"the state has {len(indices)} slots, this cycle {cycle}")
        if not 0 <= state["next_index_in_datasets"] <= n or any(not 0 <= i < max(n, 1) for i in indices):
            raise StateError("next_index_in_datasets", f"a dataset index past the {n} datasets")
        if cycle and not 0 <= state["next_index_in_cycle"] < cycle:
            raise StateError("next_index_in_cycle", f"{state['next_index_in_cycle']} is not in [0, {cycle})")
        for slot, (index, inner, ended) in enumerate(zip(indices, states, exhausted)):
            old = self._iterators_in_use[slot]
            if inner is None or ended:
                if old is not None:
                    old.close()
                self._iterators_in_use[slot] = None
                self._exhausted_iterator_state[slot] = inner if ended else None
                continue
            if old is None or index != self._iterators_in_use_indices[slot]:
                if old is not None:
                    old.close()
                old = _make_iterator(self._datasets[index])
            old.set_state(inner)
            self._iterators_in_use[slot] = old
            self._exhausted_iterator_state[slot] = None
        self._next_index_in_cycle = state["next_index_in_cycle"]
        self._next_index_in_datasets = state["next_index_in_datasets"]
        self._iterators_in_use_indices = list(indices)

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        for it in self._iterators_in_use:
            if it is not None:
                it.close()
        super().close()


class InterleaveIterDataset(IterDataset):
    """Grain's ``InterleaveIterDataset(datasets, *, cycle_length, num_make_iter_threads=1, make_iter_buffer_size=1,
    iter_buffer_size=1)``.

    Example:
        >>> from portable_loader import grain
        >>> files = grain.MapDataset.source([3, 2]).map(lambda n: grain.MapDataset.range(n).map(lambda i: n * 10 + i))
        >>> list(InterleaveIterDataset(files, cycle_length=2))
        [30, 20, 31, 21, 32]
    """

    def __init__(self, datasets: Sequence, *, cycle_length: int, num_make_iter_threads: int = 1,
                 make_iter_buffer_size: int = 1, iter_buffer_size: int = 1):
        super().__init__()
        if isinstance(cycle_length, bool) or not isinstance(cycle_length, int) or cycle_length <= 0:
            raise ValueError(f"cycle_length must be a positive integer, got {cycle_length!r}")
        self._datasets = datasets
        self._cycle_length = cycle_length
        self._num_make_iter_threads = num_make_iter_threads
        self._make_iter_buffer_size = make_iter_buffer_size
        self._iter_buffer_size = iter_buffer_size

    def __iter__(self) -> InterleaveDatasetIterator:
        return InterleaveDatasetIterator(self._datasets, cycle_length=self._cycle_length)

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Grain's hook for slicing the datasets (what its ``mp_prefetch`` workers do): keep ``datasets[sl]``.

        Example:
            >>> from portable_loader import grain
            >>> ds = InterleaveIterDataset([grain.MapDataset.range(2), grain.MapDataset.range(5, 6)], cycle_length=2)
            >>> ds.set_slice(slice(1, None)); list(ds)
            [5]
        """
        self._datasets = self._datasets[sl]

    def _identity(self) -> tuple:
        if isinstance(self._datasets, Dataset):  # a MapDataset of datasets: named by its own tree, nothing built
            return ("interleave", self._cycle_length, self._datasets.fingerprint())
        parts = tuple((ds.fingerprint() if hasattr(ds, "fingerprint") else repr(ds)) for ds in self._datasets)
        return ("interleave", self._cycle_length, parts)

    def _make_part(self, children: list, n: int):
        return interleave_part(f"{n}.interleave", self.__iter__())

    def __str__(self) -> str:
        return f"InterleaveIterDataset([{len(self._datasets)} datasets], cycle_length={self._cycle_length})"


class InterleavePart:
    """An interleave inside one of our pipelines, where its inner iterators' states are flat dicts of
    integers with the same keys (files: ``ParquetIterDataset``, ``TFRecordIterDataset``): Grain's state,
    laid out as integer fields (the cycle's position, the next dataset, and per slot its dataset, whether
    it holds a state and whether that dataset ended, and the state's integers).

    Example:
        >>> import os, tempfile
        >>> from portable_loader.grain.experimental_ops.tfrecord import TFRecordIterDataset, write_tfrecord
        >>> folder = tempfile.mkdtemp()
        >>> for name in "ab":
        ...     write_tfrecord(os.path.join(folder, name), [name.encode() * k for k in (1, 2)])
        >>> files = [TFRecordIterDataset(os.path.join(folder, name)) for name in "ab"]
        >>> list(InterleaveIterDataset(files, cycle_length=2).map(len))
        [1, 1, 2, 2]
    """

    def __init__(self, field: str, iterator: InterleaveDatasetIterator):
        self.field, self.iterator = field, iterator
        self.cycle = iterator._cycle_length
        self.keys = self._keys(iterator)

    def _keys(self, iterator) -> list[str]:
        if not len(iterator._datasets):
            return []
        first = _make_iterator(iterator._datasets[0])
        state = first.get_state()
        first.close()
        if not _flat(state):
            raise TypeError("InterleaveIterDataset: its datasets' iterators have states that are not flat dicts of "
                            f"integers ({state!r}), so they cannot be fields of a position; interleave_part runs "
                            "it as an opaque step")
        return sorted(state)

    def next(self):
        return next(self.iterator)

    def field_names(self) -> list[str]:
        f = self.field
        names = [f"{f}.cycle", f"{f}.next"]
        for k in range(self.cycle):
            names += [f"{f}.{k}.dataset", f"{f}.{k}.held", f"{f}.{k}.ended"] + [f"{f}.{k}.{key}" for key in self.keys]
        return names

    def fields(self) -> dict:
        state, f = self.iterator.get_state(), self.field
        out = {f"{f}.cycle": state["next_index_in_cycle"], f"{f}.next": state["next_index_in_datasets"]}
        for k, (index, inner, ended) in enumerate(zip(state["iterators_in_use_indices"],
                                                      state["iterators_in_use_states"], state["exhausted"])):
            if inner is not None and sorted(inner) != self.keys:
                raise TypeError(f"InterleaveIterDataset: dataset {index}'s state has the keys {sorted(inner)}, the "
                                f"first dataset's {self.keys}: inside a pipeline they must be the same")
            out.update({f"{f}.{k}.dataset": index, f"{f}.{k}.held": int(inner is not None), f"{f}.{k}.ended": ended})
            out.update({f"{f}.{k}.{key}": 0 if inner is None else int(inner[key]) for key in self.keys})
        return out

    def restore(self, fields: dict, refuse) -> None:
        f = self.field
        slots = range(self.cycle)
        state = {
            "next_index_in_cycle": fields[f"{f}.cycle"],
            "next_index_in_datasets": fields[f"{f}.next"],
            "iterators_in_use_indices": [fields[f"{f}.{k}.dataset"] for k in slots],
            "iterators_in_use_states": [{key: fields[f"{f}.{k}.{key}"] for key in self.keys}
                                        if fields[f"{f}.{k}.held"] else None for k in slots],
            "exhausted": [fields[f"{f}.{k}.ended"] for k in slots],
        }
        try:
            self.iterator.set_state(state)
        except StateError as e:
            raise refuse(e.field or self.field, e.problem) from e

    def close(self) -> None:
        self.iterator.close()


def _flat(state) -> bool:
    return isinstance(state, dict) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                           for v in state.values())


def interleave_part(field: str, iterator: InterleaveDatasetIterator) -> InterleavePart | OpaqueIter:
    """The part that runs an interleave inside a pipeline: integer fields (:class:`InterleavePart`) where
    its first dataset's iterator has a flat integer state (files), else an opaque step: the iterator as
    written, its Grain state nested under the pipeline state's ``steps`` (as Grain nests it).

    Example:
        >>> from portable_loader import grain
        >>> it = InterleaveDatasetIterator([grain.MapDataset.range(2), grain.MapDataset.range(5, 6)], cycle_length=2)
        >>> part = interleave_part("0.interleave", it)
        >>> type(part).__name__, part.next(), sorted(part.fields()["0.interleave"])[:2]
        ('OpaqueIter', 0, ['exhausted', 'future_states'])
    """
    datasets = iterator._datasets
    if len(datasets):
        first = _make_iterator(datasets[0])
        state = first.get_state()
        first.close()
        if not _flat(state):
            return OpaqueIter(field, iterator)
    return InterleavePart(field, iterator)

