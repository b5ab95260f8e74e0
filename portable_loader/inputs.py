"""Input tables: a row count, a content identity, and independent reads of row ranges.

Every tokenizer worker opens the input itself and reads only its own ``[lo, hi)`` row range, so no
row is ever pickled between processes. Supported: JSONL (also ``.gz``), plain ``.txt`` (one row per
non-empty line, field ``text``), a JSON list, Parquet, and a folder written by
``datasets.Dataset.save_to_disk`` (or ``DatasetDict``). A Hugging Face split spec such as
``train[:1000]`` or ``train[10%:20%]`` selects a row window of any of them.

Example:
    >>> import json, tempfile, os
    >>> d = tempfile.mkdtemp(); p = os.path.join(d, "x.jsonl")
    >>> _ = open(p, "w").write("\\n".join(json.dumps({"text": t}) for t in "abc"))
    >>> table = open_input(p, split="train[1:]")
    >>> len(table), [row["text"] for _, row in table.read(0, len(table))]
    (2, ['b', 'c'])
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import zlib
from typing import Any, Iterator

import numpy as np

from portable_loader.errors import BadRowError, InputError

__all__ = ["InputTable", "open_input", "file_digest"]

_CHECKPOINT_EVERY = 4096  # JSONL/txt: remember the byte offset of every 4096th line
_SCAN_CHUNK = 16 << 20


def file_digest(path: str, h=None) -> str:
    """sha256 of a file's bytes (or fed into ``h``), read in 1 MiB pieces."""
    own = h is None
    h = hashlib.sha256() if own else h
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest() if own else ""


def _folder_digest(path: str) -> str:
    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            h.update(os.path.relpath(full, path).encode() + b"\0")
            file_digest(full, h)
    return h.hexdigest()


class InputTable:
    """Rows ``[0, len)`` of one input, after the split window. Subclasses read one kind of file.

    ``read(lo, hi)`` yields ``(row_number, row_dict)``, or ``(row_number, BadRowError)`` for a row that
    cannot be parsed (the caller decides whether to stop or skip); ``where(row_number)`` says where
    that row lives in the file (``line 12`` for line-based files, ``row 11`` otherwise).
    """

    kind = "?"

    def __init__(self, path: str, total_rows: int, split: str | None):
        self.path = path
        self.split = split
        self.start, self.stop = _split_window(split, total_rows, getattr(self, "split_name", "train"))
        if self.stop <= self.start:
            raise InputError(f"{path}: no rows" + (f" in split {split!r}" if split else ""))

    def __len__(self) -> int:
        return self.stop - self.start

    def identity(self) -> dict:
        return {"kind": self.kind, "sha256": self._content_digest(), "split": self.split, "rows": len(self)}

    def _content_digest(self) -> str:
        return _folder_digest(self.path) if os.path.isdir(self.path) else file_digest(self.path)

    def where(self, row: int) -> str:
        return f"row {self.start + row}"

    def read(self, lo: int, hi: int) -> Iterator[tuple[int, dict]]:
        """Rows ``lo..hi-1`` of the window, numbered from 0 at the window's start."""
        for raw_index, row in self._read_raw(self.start + lo, self.start + hi):
            yield raw_index - self.start, row

    def _read_raw(self, lo: int, hi: int) -> Iterator[tuple[int, Any]]:
        raise NotImplementedError


def _split_window(split: str | None, total: int, name: str) -> tuple[int, int]:
    if not split:
        return 0, total
    from datasets import ReadInstruction

    try:
        parts = ReadInstruction.from_spec(split).to_absolute({name: total})
    except (ValueError, AssertionError, KeyError) as e:
        raise InputError(f"bad split {split!r} for a split named {name!r}: {e}") from None
    if len(parts) != 1:
        raise InputError(f"split {split!r}: only one contiguous slice is supported")
    return parts[0].from_, parts[0].to


# --- line-based files: JSONL, JSONL.gz, txt ---------------------------------------------------


def _open_bytes(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


class _LineTable(InputTable):
    def __init__(self, path: str, split: str | None):
        self.gz = path.endswith(".gz")
        self.checkpoints, total = self._scan(path)
        super().__init__(path, total, split)

    def _scan(self, path: str) -> tuple[list[int], int]:
        """Count lines and remember where every _CHECKPOINT_EVERY-th line starts (byte offsets)."""
        checkpoints = [0]
        lines = 0
        offset = 0
        last = b"\n"
        # A plain file's bytes are its identity: hash them in this pass rather than read them again.
        h = None if self.gz else hashlib.sha256()
        try:
            with _open_bytes(path) as f:
                while chunk := f.read(_SCAN_CHUNK):
                    if h is not None:
                        h.update(chunk)
                    nl = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
                    # Line number lines + j + 1 starts right after the j-th newline of this chunk.
                    starts = lines + np.arange(1, nl.size + 1)
                    take = nl[starts % _CHECKPOINT_EVERY == 0]
                    checkpoints.extend((offset + take + 1).tolist())
                    lines += nl.size
                    offset += len(chunk)
                    last = chunk[-1:]
        except (OSError, EOFError, zlib.error) as e:
            raise InputError(f"{path}: cannot read: {e}") from None
        if last != b"\n":
            lines += 1  # a last line without a newline
        self._digest = None if h is None else h.hexdigest()
        return checkpoints, lines

    def _content_digest(self) -> str:
        return self._digest or super()._content_digest()

    def where(self, row: int) -> str:
        return f"line {self.start + row + 1}"

    def _lines(self, lo: int, hi: int) -> Iterator[tuple[int, bytes]]:
        with _open_bytes(self.path) as f:
            first = lo // _CHECKPOINT_EVERY
            if self.gz:
                line_no = 0
            else:
                f.seek(self.checkpoints[first])
                line_no = first * _CHECKPOINT_EVERY
            for line in f:
                if line_no >= hi:
                    break
                if line_no >= lo:
                    yield line_no, line
                line_no += 1


class JsonLinesTable(_LineTable):
    """JSONL (optionally gzipped): one JSON object per line; blank lines are skipped."""

    kind = "jsonl"

    def _read_raw(self, lo, hi):
        for line_no, line in self._lines(lo, hi):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except UnicodeDecodeError as e:
                row = BadRowError(self.path, f"line {line_no + 1}", None, f"not UTF-8: {e.reason}")
            except json.JSONDecodeError as e:
                row = BadRowError(self.path, f"line {line_no + 1}", None, f"malformed JSON: {e.msg} at column {e.colno}")
            except RecursionError:
                row = BadRowError(self.path, f"line {line_no + 1}", None, "JSON nested too deeply")
            if not isinstance(row, (dict, BadRowError)):
                row = BadRowError(self.path, f"line {line_no + 1}", None, f"expected a JSON object, got {type(row).__name__}")
            yield line_no, row


class TextLinesTable(_LineTable):
    """Plain text: each non-empty line is one row ``{"text": line}``."""

    kind = "txt"

    def _read_raw(self, lo, hi):
        for line_no, line in self._lines(lo, hi):
            try:
                text = line.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                yield line_no, BadRowError(self.path, f"line {line_no + 1}", None, f"not UTF-8: {e.reason}")
                continue
            if text.strip():
                yield line_no, {"text": text}


# --- whole-file and columnar formats -----------------------------------------------------------


class JsonListTable(InputTable):
    """A JSON file holding a list of objects (parsed whole by each reader)."""

    kind = "json"

    def __init__(self, path: str, split: str | None):
        self.path = path
        super().__init__(path, len(self._load()), split)

    def _load(self) -> list:
        try:
            with open(self.path, "rb") as f:
                rows = json.load(f)
        except UnicodeDecodeError as e:
            raise InputError(f"{self.path}: not UTF-8: {e.reason}") from None
        except json.JSONDecodeError as e:
            raise BadRowError(self.path, f"line {e.lineno}", None, f"malformed JSON: {e.msg} at column {e.colno}") from None
        except RecursionError:
            raise InputError(f"{self.path}: JSON nested too deeply") from None
        except OSError as e:
            raise InputError(f"{self.path}: cannot read: {e}") from None
        if not isinstance(rows, list):
            raise InputError(f"{self.path}: expected a JSON list of objects, got {type(rows).__name__}")
        return rows

    def _read_raw(self, lo, hi):
        rows = self._load()
        for i in range(lo, hi):
            row = rows[i]
            if not isinstance(row, dict):
                row = BadRowError(self.path, f"row {i}", None, f"expected a JSON object, got {type(row).__name__}")
            yield i, row


class ParquetTable(InputTable):
    """A Parquet file, read by row group."""

    kind = "parquet"

    def __init__(self, path: str, split: str | None):
        import pyarrow.parquet as pq

        try:
            total = pq.ParquetFile(path).metadata.num_rows
        except Exception as e:  # pyarrow raises several types for a bad file
            raise InputError(f"{path}: not a readable Parquet file: {e}") from None
        super().__init__(path, total, split)

    def _read_raw(self, lo, hi):
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(self.path)
        first = 0
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if first + n > lo and first < hi:
                rows = pf.read_row_group(g).slice(max(lo - first, 0), min(hi, first + n) - max(lo, first))
                for j, row in enumerate(rows.to_pylist()):
                    yield max(lo, first) + j, row
            first += n


class HFDiskTable(InputTable):
    """A folder written by ``datasets`` ``save_to_disk`` (a Dataset, or one split of a DatasetDict)."""

    kind = "hf_disk"

    def __init__(self, path: str, split: str | None):
        self.path, self.split, self.split_name = path, split, _split_name(split) or "train"
        super().__init__(path, len(self._dataset()), split)

    def _dataset(self):
        from datasets import DatasetDict, load_from_disk

        try:
            ds = load_from_disk(self.path)
        except Exception as e:  # datasets raises FileNotFoundError, ValueError, ...
            raise InputError(f"{self.path}: not a datasets.save_to_disk folder: {e}") from None
        if isinstance(ds, DatasetDict):
            names = list(ds)
            if self.split_name not in ds:
                if len(names) == 1 and not getattr(self, "split", None):
                    return ds[names[0]]
                raise InputError(f"{self.path}: no split {self.split_name!r}; splits are {names}")
            return ds[self.split_name]
        return ds

    def _read_raw(self, lo, hi):
        ds = self._dataset()
        for start in range(lo, hi, 1024):
            batch = ds[start : min(hi, start + 1024)]
            keys = list(batch)
            for j in range(len(batch[keys[0]]) if keys else 0):
                yield start + j, {k: batch[k][j] for k in keys}


def _split_name(split: str | None) -> str | None:
    if not split:
        return None
    return split.split("[", 1)[0].split("+", 1)[0].strip() or None


def _first_byte(path: str) -> bytes:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head[:1]


def open_input(path: str, split: str | None = None) -> InputTable:
    """Open an input by its path's form: a folder (datasets), ``.parquet``, a ``.json`` list, ``.txt``, else JSONL.

    Example:
        >>> open_input("missing.jsonl")
        Traceback (most recent call last):
        portable_loader.errors.InputError: missing.jsonl: no such file or folder
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise InputError(f"{path}: no such file or folder")
    if os.path.isdir(path):
        return HFDiskTable(path, split)
    name = path.lower()
    if name.endswith(".parquet"):
        return ParquetTable(path, split)
    if name.endswith(".json") and _first_byte(path) == b"[":
        return JsonListTable(path, split)
    if name.endswith(".txt") or name.endswith(".txt.gz"):
        return TextLinesTable(path, split)
    return JsonLinesTable(path, split)
