"""Grain's ``PackAndBatchOperation``: the legacy ``DataLoader``'s first-fit packing straight into batches.

Each element (a pytree of arrays whose first axis is the sequence) goes into the first of the
``batch_size`` rows of the open batch where every feature still fits its length in
``length_struct`` (and the row holds fewer than ``max_sequences_per_bin`` elements); when no row
fits, the open batch is emitted and a new one starts with that element. A batch is the tuple
``(data, segmentations, positions)``: data of shape ``(batch_size, length, ...)`` zero-padded,
segment ids counting from 1 within a row, and each token's position in its element. An element
longer than its length is Grain's ``ValueError``.

As in Grain, the operation is a callable over an iterator of ``Record``s; in a ``DataLoader``
(``operations=[..., PackAndBatchOperation(...)]``) it runs in the trainer's process after the
workers, and the state stays a stream position: the position where the open batch began, from
which a resume packs the same batches again.

Example:
    >>> import numpy as np
    >>> from portable_loader import grain
    >>> loader = grain.DataLoader(data_source=[np.arange(1, n + 1) for n in (3, 2, 4, 1)],
    ...                           sampler=grain.samplers.SequentialSampler(4),
    ...                           operations=[PackAndBatchOperation(length_struct=5, batch_size=2)])
    >>> data, segments, positions = next(iter(loader))
    >>> data.tolist(), segments.tolist()
    ([[1, 2, 3, 1, 2], [1, 2, 3, 4, 1]], [[1, 1, 1, 2, 2], [1, 1, 1, 1, 2]])
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import numpy as np

from portable_loader.dataset.batch import _tree_map
from portable_loader.dataset.iter.dataset import IterDataset
from portable_loader.grain.records import Record

__all__ = ["PackAndBatchIterDataset", "PackAndBatchOperation"]


def _leaves(tree) -> list:
    out: list = []
    _tree_map(out.append, tree)
    return out


def _like(template, leaves: list):
    it = iter(leaves)
    return _tree_map(lambda _: next(it), template)


class _OpenBatch:
    """The batch being filled: ``batch_size`` rows per feature, the next free cell of each, the elements in each row."""

    def __init__(self, first, batch_size: int, length_struct, max_per_row: int | None):
        self.template, self.max_per_row = length_struct, max_per_row
        self.lengths = [int(n) for n in _leaves(length_struct)]
        shapes = [np.asarray(x) for x in _leaves(first)]
        if len(shapes) != len(self.lengths):
            raise ValueError(f"PackAndBatchOperation: the element has {len(shapes)} features, length_struct "
                             f"{len(self.lengths)}")
        self.data = [np.zeros((batch_size, n, *x.shape[1:]), x.dtype) for n, x in zip(self.lengths, shapes)]
        self.segments = [np.zeros((batch_size, n), np.int32) for n in self.lengths]
        self.positions = [np.zeros((batch_size, n), np.int32) for n in self.lengths]
        self.free = [np.zeros(batch_size, np.int64) for _ in self.lengths]
        self.count = [0] * batch_size

    def add(self, element) -> bool:
        """Put ``element`` in the first row where it fits; False when none does."""
        values = [np.asarray(x) for x in _leaves(element)]
        sizes = [len(v) for v in values]
        if any(s > n for s, n in zip(sizes, self.lengths)):
            raise ValueError("Inputs to PackAndBatchOperation must be truncated to max length.")
        for row in range(len(self.count)):
            if self.max_per_row is not None and self.count[row] >= self.max_per_row:
                continue
            if all(s + free[row] <= n for s, free, n in zip(sizes, self.free, self.lengths)):
                break
        else:
            return False
        for k, v in enumerate(values):
            a = self.free[k][row]
            self.data[k][row, a:a + len(v)] = v
            self.segments[k][row, a:a + len(v)] = self.count[row] + 1
            self.positions[k][row, a:a + len(v)] = np.arange(len(v))
            self.free[k][row] += len(v)
        self.count[row] += 1
        return True

    def result(self) -> tuple:
        return tuple(_like(self.template, leaves) for leaves in (self.data, self.segments, self.positions))


@dataclasses.dataclass
class PackAndBatchOperation:
    """Grain's ``PackAndBatchOperation(length_struct, batch_size, max_sequences_per_bin=None)``: records in, packed batches out.

    Example:
        >>> import numpy as np
        >>> from portable_loader.grain import Record, RecordMetadata
        >>> records = [Record(RecordMetadata(index=i, record_key=i), {"t": np.full(n, n)}) for i, n in enumerate((2, 2, 3))]
        >>> [r.data[0]["t"].tolist() for r in PackAndBatchOperation(length_struct={"t": 4}, batch_size=1)(iter(records))]
        [[[2, 2, 2, 2]], [[3, 3, 3, 0]]]
    """

    length_struct: Any
    batch_size: int
    max_sequences_per_bin: int | None = None

    def __post_init__(self):
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, (int, np.integer)) or \
                self.batch_size <= 0:
            raise ValueError(f"PackAndBatchOperation: batch_size must be a positive integer, got {self.batch_size!r}")

    def _open(self, first) -> _OpenBatch:
        return _OpenBatch(first, int(self.batch_size), self.length_struct, self.max_sequences_per_bin)

    def __call__(self, input_iterator: Iterator[Record]) -> Iterator[Record]:
        batch, meta = None, None
        for element in input_iterator:
            if batch is None:
                batch = self._open(element.data)
            if not batch.add(element.data):
                yield Record(metadata=meta, data=batch.result())
                batch = self._open(element.data)
                batch.add(element.data)
            meta = element.metadata.remove_record_key()
        if batch is not None:
            yield Record(metadata=meta, data=batch.result())


class PackAndBatchIterDataset(IterDataset):
    """``op`` as a step of our pipelines (how the ``DataLoader`` runs it); ``get_data`` and ``wrap`` see
    through the ``DataLoader``'s records: the data of an element, and the output for the last element packed.

    Example:
        >>> import numpy as np
        >>> from portable_loader import grain
        >>> ds = grain.MapDataset.source([np.ones(n, np.int32) for n in (2, 3, 2)]).to_iter_dataset()
        >>> [d.tolist() for d, _, _ in PackAndBatchIterDataset(ds, PackAndBatchOperation(4, 1))]
        [[[1, 1, 0, 0]], [[1, 1, 1, 0]], [[1, 1, 0, 0]]]
    """

    def __init__(self, parent, op: PackAndBatchOperation, get_data=None, wrap=None):
        from portable_loader.dataset.base import _plain, function_identity

        super().__init__((parent,))
        self.op, self.get_data, self.wrap = op, get_data, wrap
        self._ident = ("pack_and_batch", _plain(op.length_struct), int(op.batch_size), op.max_sequences_per_bin,
                       None if wrap is None else function_identity(wrap))

    def _identity(self) -> tuple:
        return (*self._ident, self._parent._identity())

    def _make_part(self, children: list, n: int) -> "PackAndBatchIter":
        return PackAndBatchIter(children[0], self.op, self.get_data, self.wrap)


class PackAndBatchIter:
    """The running part: its state is the parent's position where the open batch began (no field of its own)."""

    def __init__(self, child, op: PackAndBatchOperation, get_data, wrap):
        self.child, self.op = child, op
        self.get_data = get_data or (lambda e: e)
        self.wrap = wrap or (lambda last, packed: packed)
        self.batch, self.last = None, None
        self.before = child.fields()

    def _emit(self):
        return self.wrap(self.last, self.batch.result())

    def next(self):
        while True:
            before = self.child.fields()
            try:
                element = self.child.next()
            except StopIteration:
                if self.batch is None:
                    raise
                out, self.batch = self._emit(), None
                return out
            data = self.get_data(element)
            if self.batch is None:
                self.batch, self.before = self.op._open(data), before
            if self.batch.add(data):
                self.last = element
                continue
            out = self._emit()
            self.batch, self.before = self.op._open(data), before
            self.batch.add(data)
            self.last = element
            return out

    def fields(self) -> dict:
        return dict(self.before) if self.batch is not None else self.child.fields()

    def field_names(self) -> list[str]:
        return self.child.field_names()

    def restore(self, fields: dict, refuse) -> None:
        self.child.restore(fields, refuse)
        self.batch, self.last, self.before = None, None, self.child.fields()

    def close(self) -> None:
        self.child.close()
