"""Inputs of many files: a folder, a glob, a list, or a ``datasets.Dataset``, read as one table.

``open_inputs(spec)`` takes what ``pl.precache``, ``pl.tokenized`` and the CLI accept:

* a file (``.parquet``, ``.jsonl``, ``.jsonl.gz``, ``.ndjson``, ``.json``, ``.txt``, ``.txt.gz``);
* a folder: every supported file inside, recursively, sorted by path (other files, such as
  ``_SUCCESS`` or ``README.md``, are ignored); a ``datasets.save_to_disk`` folder is one input;
* a glob (``data/part-*.parquet``, ``**`` recursive): its matches sorted by path;
* a list of any of these, read in the list's order (formats may mix);
* in the API, a ``datasets.Dataset`` (or one split of a ``DatasetDict``) already in memory.

Rows are numbered across files: the first file's rows, in file order, then the next file's. Every
file must have the same columns (a mismatch names both files). The identity hashes every file's
content, in order, so the cache key changes when any file does.

Example:
    >>> import json, os
    >>> d = "parts"; os.makedirs(d)
    >>> for i in range(3):
    ...     _ = open(os.path.join(d, f"part-{i}.jsonl"), "w").write(json.dumps({"text": str(i)}) + "\\n")
    >>> table = open_inputs(d)
    >>> len(table), [row["text"] for _, row in table.read(0, 3)], table.where(2)[1]
    (3, ['0', '1', '2'], 'line 1')
"""

from __future__ import annotations

import glob as globbing
import os
from typing import Any, Sequence

import numpy as np

from portable_loader.errors import InputError
from portable_loader.io.remote import filesystem, is_url, object_identity
from portable_loader.io.tables import SUPPORTED, HFDiskTable, InputTable, _parquet, open_input

__all__ = ["open_inputs", "list_files", "describe", "MultiTable", "HFMemoryTable"]


def _is_hf_folder(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, n)) for n in ("state.json", "dataset_dict.json"))


def _supported(path: str) -> bool:
    return path.lower().endswith(SUPPORTED)


def _unsupported(path: str) -> InputError:
    return InputError(f"{path}: unsupported file type (supported: {', '.join(SUPPORTED)}, or a datasets.save_to_disk folder)")


def _expand_url(entry: str, storage_options: dict | None) -> list[str]:
    """The objects a URL names: itself, every supported object under a prefix, or a glob's matches."""
    fs, path = filesystem(entry, storage_options)
    proto = entry.split("://", 1)[0]
    if any(c in path for c in "*?["):
        found = [p for p in sorted(fs.glob(path)) if _supported(p)]
        if not found:
            raise InputError(f"{entry}: the glob matches no supported object (supported: {', '.join(SUPPORTED)})")
    elif fs.isfile(path):
        if not _supported(path):
            raise _unsupported(entry)
        return [entry]
    elif fs.isdir(path):
        found = sorted(p for p in fs.find(path) if _supported(p) and not os.path.basename(p).startswith("."))
        if not found:
            raise InputError(f"{entry}: empty prefix: no supported object under it (supported: {', '.join(SUPPORTED)})")
    else:
        raise InputError(f"{entry}: no such object or prefix")
    return [f"{proto}://{p}" for p in found]


def _expand(entry: str, storage_options: dict | None = None) -> list[str]:
    """The files (or save_to_disk folders) one entry of a spec names, in reading order."""
    if is_url(entry):
        return _expand_url(entry, storage_options)
    if os.path.isdir(entry):
        if _is_hf_folder(entry):
            return [entry]
        found = []
        for root, dirs, files in os.walk(entry):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            found += [os.path.join(root, f) for f in files if not f.startswith(".") and _supported(f)]
        if not found:
            raise InputError(f"{entry}: empty folder: no supported file inside (supported: {', '.join(SUPPORTED)})")
        return sorted(found)
    if os.path.exists(entry):
        if not _supported(entry):
            raise _unsupported(entry)
        return [entry]
    if any(c in entry for c in "*?["):
        matches = sorted(globbing.glob(entry, recursive=True))
        if not matches:
            raise InputError(f"{entry}: the glob matches nothing")
        files = []
        for m in matches:
            files += _expand(m) if os.path.isdir(m) else ([m] if _supported(m) else [])
        if not files:
            raise InputError(f"{entry}: the glob matches no supported file (supported: {', '.join(SUPPORTED)})")
        return files
    raise InputError(f"{entry}: no such file or folder")


def list_files(spec, storage_options: dict | None = None) -> list[str]:
    """The files (and ``save_to_disk`` folders) a path, folder, glob or list names, in reading order.

    Example:
        >>> os.makedirs("in")
        >>> for name in ("b.jsonl", "a.jsonl", "notes.md"):
        ...     open(os.path.join("in", name), "w").close()
        >>> list_files(["in/b.jsonl", "in/a.jsonl"])   # a list: in its order
        ['in/b.jsonl', 'in/a.jsonl']
        >>> list_files("in")                           # a folder: its supported files, sorted
        ['in/a.jsonl', 'in/b.jsonl']
    """
    entries = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not entries:
        raise InputError("an empty list of inputs")
    files = []
    for e in entries:
        if not isinstance(e, (str, os.PathLike)):
            raise InputError(f"inputs must be paths, folders or globs; got {type(e).__name__} in the list")
        files += _expand(os.fspath(e), storage_options)
    return files


def _hf_dataset(spec):
    """``spec`` as a ``datasets.Dataset`` if it is one (a one-split ``DatasetDict`` too), else None."""
    import sys

    hf = sys.modules.get("datasets")  # only an imported module can have made spec
    if hf is None:
        return None
    if isinstance(spec, hf.DatasetDict):
        if len(spec) != 1:
            raise InputError(f"a DatasetDict with splits {list(spec)}: pass one split, e.g. dd['train']")
        return next(iter(spec.values()))
    return spec if isinstance(spec, hf.Dataset) else None


def describe(spec) -> Any:
    """What a cache's config records as its input: an absolute path, a list of them, or a dataset's name."""
    ds = _hf_dataset(spec)
    if ds is not None:
        return f"<datasets.Dataset {ds._fingerprint}>"
    if isinstance(spec, (str, os.PathLike)):
        return _absolute(spec)
    return [_absolute(e) for e in spec]


def _absolute(entry) -> str:
    entry = os.fspath(entry)
    return entry if is_url(entry) else os.path.abspath(entry)


def open_inputs(spec, split: str | None = None, storage_options: dict | None = None) -> InputTable:
    """One table over everything ``spec`` names (see the module docstring); ``split`` cuts the whole.

    A single file or ``save_to_disk`` folder opens as itself (its identity, so its cache key, is the one
    it always had); anything else as a :class:`MultiTable`. Specs with URLs open as
    :class:`RemoteInputs` (``storage_options``: fsspec's, for every URL).

    Example:
        >>> import pyarrow as pa, pyarrow.parquet as pq
        >>> os.makedirs("data")
        >>> for i in range(2):
        ...     pq.write_table(pa.table({"text": [f"{i}a", f"{i}b"]}), f"data/part-{i}.parquet")
        >>> t = open_inputs("data/*.parquet")
        >>> len(t), [row["text"] for _, row in t.read(0, 4)], t.where(3)
        (4, ['0a', '0b', '1a', '1b'], ('data/part-1.parquet', 'row 1'))
        >>> open_inputs("nothing-*.jsonl")
        Traceback (most recent call last):
        portable_loader.errors.InputError: nothing-*.jsonl: the glob matches nothing
    """
    ds = _hf_dataset(spec)
    if ds is not None:
        return HFMemoryTable(ds, split)
    files = list_files(spec, storage_options)
    if any(is_url(f) for f in files):
        return RemoteInputs(spec, files, split, storage_options)
    return _open_files(spec, files, split)


def _open_files(spec, files: list[str], split: str | None, storage_options: dict | None = None) -> InputTable:
    single = isinstance(spec, (str, os.PathLike)) and (os.path.isfile(spec) or len(files) == 1 and files[0] == os.fspath(spec))
    if single:
        return open_input(files[0], split, storage_options)
    return MultiTable([open_input(f, None, storage_options) for f in files], split, name=_name(spec, files))


def _name(spec, files: list[str]) -> str:
    if isinstance(spec, (str, os.PathLike)):
        return os.fspath(spec)
    return f"{len(files)} files ({files[0]}, ...)"


class RemoteInputs:
    """Inputs that include objects in a store: identified by metadata, opened (read) only when used.

    ``identity()`` is every object's URL, ETag and size (local files in the list: their sha256), so a
    cache hit downloads nothing and an overwritten object gives a new key. Anything else (``len``,
    ``read``, ``where``, ...) opens the table, reading the objects through fsspec.

    Example:
        >>> with open("train.jsonl", "w") as f:
        ...     _ = f.write('{"text": "hi"}\\n')
        >>> t = open_inputs("local://" + os.path.abspath("train.jsonl"))   # as s3://bucket/train.jsonl would
        >>> type(t).__name__, t.identity()["objects"][0]   # local:// has no ETag: the mtime stands in
        ('RemoteInputs', {'url': 'local:///.../train.jsonl', 'etag': '...', 'size': 15})
        >>> len(t)    # opens the table: reads the object
        1
    """

    kind = "remote"

    def __init__(self, spec, files: list[str], split: str | None, storage_options: dict | None = None):
        self.spec, self.files, self.split, self._table = spec, files, split, None
        self.path, self.storage_options = _name(spec, files), storage_options

    def identity(self) -> dict:
        so = self.storage_options
        objects = [object_identity(f, so) if is_url(f) else open_input(f).identity() for f in self.files]
        return {"kind": self.kind, "objects": objects, "split": self.split}

    def table(self) -> InputTable:
        """The opened table (its files read through fsspec)."""
        if self._table is None:
            self._table = _open_files(self.spec, self.files, self.split, self.storage_options)
        return self._table

    def __len__(self) -> int:
        return len(self.table())

    def __getattr__(self, name):
        if name.startswith("__") or name in ("spec", "files", "split", "_table", "path", "storage_options"):
            raise AttributeError(name)
        return getattr(self.table(), name)


class HFMemoryTable(HFDiskTable):
    """A ``datasets.Dataset`` in memory (or memory-mapped from its own cache files).

    Identity: the dataset's own fingerprint (``datasets`` derives it from its source files and every
    transform applied), its length and the split.
    """

    kind = "hf_dataset"

    def __init__(self, ds, split: str | None):
        self._ds = ds
        self.path, self.split, self.split_name = f"<datasets.Dataset {ds._fingerprint}>", split, "train"
        InputTable.__init__(self, self.path, len(ds), split)

    def _dataset(self):
        return self._ds

    def _content_digest(self) -> str:
        return self._ds._fingerprint


def _columns(table: InputTable) -> list[str] | None:
    """The table's column names: the schema where the file has one, else the first row's keys."""
    if table.kind == "parquet":
        return sorted(_parquet(table.path, table.storage_options).schema_arrow.names)
    if table.kind in ("hf_disk", "hf_dataset"):
        return sorted(table._dataset().column_names)
    if table.kind == "txt":
        return ["text"]
    for _, row in table.read(0, min(len(table), 64)):
        return sorted(row) if isinstance(row, dict) else None
    return None


class MultiTable(InputTable):
    """Several tables read as one: rows of the first, then of the next; ``where`` names the file.

    ``where(row)`` returns ``(file, "line 12")``; :class:`portable_loader.tokenize.Formatter` puts the
    file into the error it raises for that row.

    Example:
        >>> import json, pyarrow as pa, pyarrow.parquet as pq
        >>> with open("a.jsonl", "w") as f:
        ...     _ = f.write(json.dumps({"text": "from a"}) + "\\n")
        >>> pq.write_table(pa.table({"text": ["from b"]}), "b.parquet")
        >>> t = MultiTable([open_input("a.jsonl"), open_input("b.parquet")], None, name="2 files")
        >>> len(t), t.get([1, 0]), t.where(1)
        (2, [{'text': 'from b'}, {'text': 'from a'}], ('b.parquet', 'row 0'))
    """

    kind = "files"

    def __init__(self, tables: Sequence[InputTable], split: str | None, *, name: str):
        self.tables = list(tables)
        first_cols, first = None, None
        for t in self.tables:
            cols = _columns(t)
            if cols is None:
                continue
            if first_cols is None:
                first_cols, first = cols, t
            elif cols != first_cols:
                only_a = sorted(set(first_cols) - set(cols))
                only_b = sorted(set(cols) - set(first_cols))
                raise InputError(
                    f"columns differ between {first.path} and {t.path}: only in the first: {only_a or 'none'}; "
                    f"only in the second: {only_b or 'none'}"
                )
        self.bounds = np.cumsum([0] + [len(t) for t in self.tables])
        super().__init__(name, int(self.bounds[-1]), split)

    def identity(self) -> dict:
        return {"kind": self.kind, "files": [t.identity() for t in self.tables], "split": self.split, "rows": len(self)}

    def _locate(self, raw: int) -> tuple[int, int]:
        k = int(np.searchsorted(self.bounds, raw, side="right")) - 1
        return k, raw - int(self.bounds[k])

    def where(self, row: int) -> tuple[str, str]:
        k, local = self._locate(self.start + row)
        return self.tables[k].path, self.tables[k].where(local)

    def _read_raw(self, lo, hi):
        for k, t in enumerate(self.tables):
            a, b = max(lo, int(self.bounds[k])), min(hi, int(self.bounds[k + 1]))
            if a < b:
                for local, row in t.read(a - int(self.bounds[k]), b - int(self.bounds[k])):
                    yield int(self.bounds[k]) + local, row

    def present(self) -> np.ndarray:
        raw = np.concatenate([t.present() + self.bounds[k] for k, t in enumerate(self.tables)])
        return raw[(raw >= self.start) & (raw < self.stop)] - self.start

    def _get_raw(self, raw_rows):
        rows = np.asarray(raw_rows, dtype=np.int64)
        which = np.searchsorted(self.bounds, rows, side="right") - 1
        for k in np.unique(which):
            mine = rows[which == k]
            got = self.tables[k].get((mine - self.bounds[k]).tolist())
            yield from zip(mine.tolist(), got)
