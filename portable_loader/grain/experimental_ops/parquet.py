"""Grain's ``ParquetIterDataset``: the rows of Parquet files as dicts of column values, row group by row group.

One file: rows in file order, each a dict of column name to that row's value (numpy scalars and
objects, as ``Table.column(i).to_numpy()`` gives them, Grain's elements). The state is Grain's:
``{"row_group": g, "index_within_row_group": i}``; inside our pipelines those two integers are
fields of the position state. Several files: Grain's ``InterleaveIterDataset`` over one dataset per
file with a cycle of 16, so the rows and the state are Grain's too; inside our pipelines that
state is laid out as integer fields. ``read_kwargs`` go to
``pyarrow.parquet.ParquetFile`` (``filesystem=`` for remote files, as MaxText passes).

Example:
    >>> import os, tempfile
    >>> import pyarrow as pa, pyarrow.parquet as pq
    >>> path = os.path.join(tempfile.mkdtemp(), "a.parquet")
    >>> pq.write_table(pa.table({"x": [1, 2, 3], "s": ["a", "b", "c"]}), path, row_group_size=2)
    >>> it = iter(ParquetIterDataset(path))
    >>> [(int(r["x"]), r["s"]) for r in [next(it), next(it), next(it)]], it.get_state()
    ([(1, 'a'), (2, 'b'), (3, 'c')], {'row_group': 1, 'index_within_row_group': 1})
    >>> [int(r["x"]) for r in ParquetIterDataset(path).filter(lambda r: r["x"] != 2)]
    [1, 3]
"""

from __future__ import annotations

import os
from typing import Sequence

from portable_loader.dataset.iter.dataset import IterDataset
from portable_loader.errors import StateError
from portable_loader.grain.experimental_ops.interleave import (InterleaveDatasetIterator, InterleaveIterDataset,
                                                               interleave_part)
from portable_loader.grain.experimental_ops.parts import GrainStyleIterator, iterator_part

__all__ = ["ParquetIterDataset"]

_CYCLE_LENGTH = 16  # Grain's: files read in turn when there are several


class _ParquetDatasetIterator(GrainStyleIterator):
    """The rows of one Parquet file; Grain's state ``{"row_group": g, "index_within_row_group": i}``."""

    def __init__(self, path: str, **read_kwargs):
        import pyarrow.parquet as pq

        super().__init__()
        self._path = path
        self._file = pq.ParquetFile(path, **read_kwargs)
        self._row_group, self._index = 0, 0
        self._columns: dict = {}
        self._length = 0
        self._read(0)

    def _read(self, group: int) -> None:
        self._row_group = group
        if group >= self._file.num_row_groups:  # an empty file has no row group to read
            self._columns, self._length = {}, 0
            return
        table = self._file.read_row_group(group)
        self._length = len(table)
        self._columns = {table.field(i).name: table.column(i).to_numpy() for i in range(table.num_columns)}

    def __next__(self) -> dict:
        if self._closed:
            raise ValueError("this DatasetIterator is closed")
        while self._index >= self._length:
            if self._row_group + 1 >= self._file.num_row_groups:
                raise StopIteration
            self._read(self._row_group + 1)
            self._index = 0
        row = {k: v[self._index] for k, v in self._columns.items()}
        self._index += 1
        return row

    def get_state(self) -> dict:
        return {"row_group": self._row_group, "index_within_row_group": self._index}

    def set_state(self, state) -> None:
        group = state.get("row_group") if isinstance(state, dict) else None
        index = state.get("index_within_row_group") if isinstance(state, dict) else None
        groups = self._file.num_row_groups
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (group, index)):
            raise StateError(None, f"expected {{'row_group': <int>, 'index_within_row_group': <int>}}, got {state!r}")
        if not 0 <= group < max(groups, 1):
            raise StateError("row_group", f"{group} is not in [0, {groups}), the row groups of {self._path}")
        rows = self._file.metadata.row_group(group).num_rows if groups else 0
        if not 0 <= index <= rows:
            raise StateError("index_within_row_group", f"{index} is not in [0, {rows}], the rows of row group "
                                                       f"{group} of {self._path}")
        self._read(group)
        self._index = index

    def close(self) -> None:
        if not getattr(self, "_closed", True):
            self._file.close()
        super().close()


class ParquetIterDataset(IterDataset):
    """Grain's ``ParquetIterDataset(path, **read_kwargs)``: ``path`` one file or a sequence of files.

    Example:
        >>> import os, tempfile
        >>> import pyarrow as pa, pyarrow.parquet as pq
        >>> folder = tempfile.mkdtemp()
        >>> for name, xs in (("a", [1, 2]), ("b", [10])):
        ...     pq.write_table(pa.table({"x": xs}), os.path.join(folder, name + ".parquet"))
        >>> [int(r["x"]) for r in ParquetIterDataset([os.path.join(folder, n + ".parquet") for n in "ab"])]
        [1, 10, 2]
    """

    def __init__(self, path: str | Sequence[str], **read_kwargs):
        super().__init__()
        self._paths = [path] if isinstance(path, (str, bytes, os.PathLike)) else list(path)
        self._read_kwargs = read_kwargs

    def __iter__(self) -> GrainStyleIterator:
        if len(self._paths) == 1:
            return _ParquetDatasetIterator(self._paths[0], **self._read_kwargs)
        files = [ParquetIterDataset(p, **self._read_kwargs) for p in self._paths]
        return iter(InterleaveIterDataset(files, cycle_length=_CYCLE_LENGTH))

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Grain's hook for slicing the files (what its ``mp_prefetch`` workers do): keep ``paths[sl]``.

        Example:
            >>> ds = ParquetIterDataset(["a.parquet", "b.parquet", "c.parquet"])
            >>> ds.set_slice(slice(1, None, 2)); ds._paths
            ['b.parquet']
        """
        self._paths = self._paths[sl]

    def _identity(self) -> tuple:
        files = tuple((os.fspath(p), os.path.getsize(p) if os.path.exists(p) else None) for p in self._paths)
        return ("parquet", type(self).__qualname__, files, sorted(self._read_kwargs))

    def _make_part(self, children: list, n: int):
        it = self.__iter__()
        return interleave_part(f"{n}.parquet", it) if isinstance(it, InterleaveDatasetIterator) else \
            iterator_part(f"{n}.parquet", it)

    def __str__(self) -> str:
        return f"ParquetIterDataset(paths={self._paths!r})"
