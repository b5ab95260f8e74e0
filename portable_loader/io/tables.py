"""Input tables: a row count, a content identity, reads of row ranges, and random access by row.

Every tokenizer worker opens the input itself and reads only its own ``[lo, hi)`` row range, so no
row is ever pickled between processes. Supported: JSONL (also ``.gz``), plain ``.txt`` (one row per
non-empty line, field ``text``), a JSON list, Parquet, and a folder written by
``datasets.Dataset.save_to_disk`` (or ``DatasetDict``). A Hugging Face split spec such as
``train[:1000]`` or ``train[10%:20%]`` selects a row window of any of them.

Example:
    >>> import json
    >>> p = "x.jsonl"
    >>> _ = open(p, "w").write("\\n".join(json.dumps({"text": t}) for t in "abc"))
    >>> table = open_input(p, split="train[1:]")
    >>> len(table), [row["text"] for _, row in table.read(0, len(table))]
    (2, ['b', 'c'])
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import tempfile
import zlib
from typing import Any, Iterator, Sequence

import numpy as np

from portable_loader.errors import BadRowError, InputError
from portable_loader.io.remote import is_url, open_binary
from portable_loader.lifecycle import private_path

__all__ = ["InputTable", "open_input", "file_digest", "SUPPORTED"]

# What a folder listing picks up; an explicitly named file must end with one of these too.
SUPPORTED = (".parquet", ".jsonl", ".jsonl.gz", ".ndjson", ".json", ".txt", ".txt.gz")

_CHECKPOINT_EVERY = 4096  # JSONL/txt: remember the byte offset of every 4096th line
# The scan holds a chunk and its newline mask (2x this) at once: small enough that a precache driver,
# which lists the input, stays far below its size; big enough that numpy's per-chunk cost is noise.
_SCAN_CHUNK = 4 << 20


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
    storage_options: dict | None = None  # fsspec options for a URL path (None: its env config)

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

    def seek_point(self, raw_row: int) -> tuple[int, int, int] | None:
        """``(rows, line, byte)`` that :func:`open_input` ``seek=`` takes to read from ``raw_row`` on
        without listing the file again; None where opening costs no scan (Parquet, ...).

        Example:
            >>> with open("big.txt", "w") as f:
            ...     _ = f.write("".join(f"line {i}\\n" for i in range(10000)))
            >>> open_input("big.txt").seek_point(5000)   # rows, the checkpointed line at or before 5000, its byte
            (10000, 4096, 39850)
            >>> t = open_input("big.txt", seek=(10000, 4096, 39850))   # opens without scanning the file
            >>> [row["text"] for _, row in t.read(5000, 5002)]
            ['line 5000', 'line 5001']
        """
        return None

    def read(self, lo: int, hi: int) -> Iterator[tuple[int, dict]]:
        """Rows ``lo..hi-1`` of the window, numbered from 0 at the window's start."""
        for raw_index, row in self._read_raw(self.start + lo, self.start + hi):
            yield raw_index - self.start, row

    def _read_raw(self, lo: int, hi: int) -> Iterator[tuple[int, Any]]:
        raise NotImplementedError

    def present(self) -> np.ndarray:
        """Window row numbers that ``read`` yields (all of them, but for blank lines), as int64."""
        return np.arange(len(self), dtype=np.int64)

    def get(self, rows: Sequence[int]) -> list:
        """Random access: the rows (dicts, or ``BadRowError``) at window row numbers ``rows``, in order.

        A row ``read`` would skip (a blank line) comes back as None.
        """
        raw = sorted(set(self.start + int(r) for r in rows))
        found = dict(self._get_raw(raw))
        return [found.get(self.start + int(r)) for r in rows]

    def _get_raw(self, raw_rows: list[int]) -> Iterator[tuple[int, Any]]:
        """``(raw_row, row)`` for sorted raw row numbers; by default one contiguous read per run."""
        i = 0
        while i < len(raw_rows):
            j = i
            while j + 1 < len(raw_rows) and raw_rows[j + 1] == raw_rows[j] + 1:
                j += 1
            yield from self._read_raw(raw_rows[i], raw_rows[j] + 1)
            i = j + 1


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

# json.loads(bytes) less its per-call work (encoding detection, wrappers): ~2x faster on short lines.
# Anything it would not parse the same way (another encoding, a BOM, errors) goes through json.loads.
_RAW_DECODE = json.JSONDecoder().raw_decode
_WHITESPACE = json.decoder.WHITESPACE.match


def _open_bytes(path: str, storage_options: dict | None = None):
    if not is_url(path):
        return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
    raw = open_binary(path, storage_options)
    return gzip.GzipFile(fileobj=raw, mode="rb") if path.endswith(".gz") else raw


def _parquet(path: str, storage_options: dict | None = None):
    import pyarrow.parquet as pq

    return pq.ParquetFile(open_binary(path, storage_options) if is_url(path) else path)


class _LineTable(InputTable):
    def __init__(self, path: str, split: str | None, storage_options: dict | None = None,
                 seek: tuple[int, int, int] | None = None):
        self.storage_options = storage_options
        self.gz = path.endswith(".gz")
        if seek is None:
            self.checkpoints, self.total = self._scan(path)
            self._known = None
        else:  # what a listing found: no scan (a precache task reads one range of a file it never listed)
            self.total, line, byte = (int(x) for x in seek)
            self.checkpoints, self._known, self._digest = None, (line, byte), None
        super().__init__(path, self.total, split)

    def _scan(self, path: str) -> tuple[list[int], int]:
        """Count lines and remember where every _CHECKPOINT_EVERY-th line starts (byte offsets)."""
        checkpoints = [0]
        lines = 0
        offset = 0
        last = b"\n"
        # A plain file's bytes are its identity: hash them in this pass rather than read them again.
        h = None if self.gz else hashlib.sha256()
        try:
            with _open_bytes(path, self.storage_options) as f:
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

    def seek_point(self, raw_row: int) -> tuple[int, int, int]:
        line, byte = self._start(raw_row)
        return self.total, line, byte

    def _start(self, line: int) -> tuple[int, int]:
        """``(line, byte)``: the nearest known line start at or before ``line`` (a gzip file: its start)."""
        if self.gz:
            return 0, 0
        if self._known is not None:
            return self._known if self._known[0] <= line else (0, 0)
        first = line // _CHECKPOINT_EVERY
        return first * _CHECKPOINT_EVERY, self.checkpoints[first]

    def _lines(self, lo: int, hi: int) -> Iterator[tuple[int, bytes]]:
        with _open_bytes(self.path, self.storage_options) as f:
            line_no, byte = self._start(lo)
            if byte:
                f.seek(byte)
            for line in f:
                if line_no >= hi:
                    break
                if line_no >= lo:
                    yield line_no, line
                line_no += 1

    def _read_raw(self, lo, hi):
        for line_no, line in self._lines(lo, hi):
            yield from self._parse(line_no, line)

    def _parse(self, line_no: int, line: bytes) -> Iterator[tuple[int, Any]]:
        raise NotImplementedError

    # Random access: the byte offset of every line, from a second scan made only when asked for.

    def _line_index(self) -> tuple[np.ndarray, np.ndarray]:
        """(bounds, blank): line k is bytes ``bounds[k]:bounds[k+1]``; ``blank[k]`` marks an empty line."""
        if getattr(self, "_bounds", None) is None:
            starts, blanks = [np.zeros(1, dtype=np.int64)], []
            offset, last_nl, last_byte = 0, -1, 10
            # A .gz file cannot seek: each random read would decompress it from the start (and
            # download it again from a bucket). This pass decompresses it anyway, so it keeps the
            # bytes in a private temp file that reads seek in.
            plain = private_path(tempfile.gettempdir(), "portable_loader-gunzip-", owner=self) if self.gz else None
            with _open_bytes(self.path, self.storage_options) as f, \
                    (open(plain, "wb") if plain else contextlib.nullcontext()) as copy:
                while chunk := f.read(_SCAN_CHUNK):
                    if copy is not None:
                        copy.write(chunk)
                    a = np.frombuffer(chunk, dtype=np.uint8)
                    nl = np.flatnonzero(a == 10)
                    at = offset + nl
                    length = at - np.concatenate([[last_nl], at[:-1]])
                    before = np.where(nl > 0, a[np.maximum(nl - 1, 0)], last_byte)
                    # "\n", "\r\n", " \n": what the readers skip; rarer whitespace-only lines are
                    # skipped when read (and then counted as dropped).
                    blanks.append((length == 1) | ((length == 2) & np.isin(before, (9, 13, 32))))
                    starts.append(at + 1)
                    if nl.size:
                        last_nl = int(at[-1])
                    last_byte = int(a[-1])
                    offset += len(chunk)
            bounds = np.concatenate(starts)
            blank = np.concatenate(blanks) if blanks else np.zeros(0, dtype=bool)
            if bounds[-1] != offset:  # a last line without a newline
                bounds = np.append(bounds, offset)
                blank = np.append(blank, False)
            self._bounds, self._blank, self._plain = bounds[: self.total + 1], blank[: self.total], plain
        return self._bounds, self._blank

    def present(self) -> np.ndarray:
        _, blank = self._line_index()
        return np.flatnonzero(~blank[self.start : self.stop]).astype(np.int64)

    def _get_raw(self, raw_rows):
        bounds, _ = self._line_index()
        local = self._plain or (None if self.gz or is_url(self.path) else self.path)
        if local is not None and hasattr(os, "pread"):  # one pread a row: no seek, no 8 KiB buffer refill
            at = np.asarray(raw_rows, dtype=np.int64)
            fd = os.open(local, os.O_RDONLY)
            try:
                for r, a, b in zip(raw_rows, bounds[at].tolist(), bounds[at + 1].tolist()):
                    yield from self._parse(r, os.pread(fd, b - a, a))
            finally:
                os.close(fd)
            return
        with open(self._plain, "rb") if self._plain else _open_bytes(self.path, self.storage_options) as f:
            for r in raw_rows:
                f.seek(int(bounds[r]))
                yield from self._parse(r, f.read(int(bounds[r + 1] - bounds[r])))


class JsonLinesTable(_LineTable):
    """JSONL (optionally gzipped): one JSON object per line; blank lines are skipped."""

    kind = "jsonl"

    def _parse(self, line_no, line):
        if not line.strip():
            return
        try:  # the common case, cheaper: UTF-8 holding one JSON object (what json.loads returns then)
            text = line.decode("utf-8")
            row, end = _RAW_DECODE(text, _WHITESPACE(text, 0).end())
            if type(row) is dict and _WHITESPACE(text, end).end() == len(text):
                yield line_no, row
                return
        except (ValueError, RecursionError):  # not that: json.loads below says what it is
            pass
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

    def _parse(self, line_no, line):
        try:
            text = line.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            yield line_no, BadRowError(self.path, f"line {line_no + 1}", None, f"not UTF-8: {e.reason}")
            return
        if text.strip():
            yield line_no, {"text": text}


# --- whole-file and columnar formats -----------------------------------------------------------


class JsonListTable(InputTable):
    """A JSON file holding a list of objects (parsed whole by each reader)."""

    kind = "json"

    def __init__(self, path: str, split: str | None, storage_options: dict | None = None):
        self.path, self.storage_options = path, storage_options
        super().__init__(path, len(self._load()), split)

    def _load(self) -> list:
        try:
            with _open_bytes(self.path, self.storage_options) as f:
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
        if getattr(self, "_rows", None) is None:
            self._rows = self._load()  # kept: a random-access reader would otherwise parse it per read
        rows = self._rows
        for i in range(lo, hi):
            row = rows[i]
            if not isinstance(row, dict):
                row = BadRowError(self.path, f"row {i}", None, f"expected a JSON object, got {type(row).__name__}")
            yield i, row


class ParquetTable(InputTable):
    """A Parquet file, read by row group."""

    kind = "parquet"

    def __init__(self, path: str, split: str | None, storage_options: dict | None = None):
        self.storage_options = storage_options
        try:
            total = _parquet(path, storage_options).metadata.num_rows
        except Exception as e:  # pyarrow raises several types for a bad file
            raise InputError(f"{path}: not a readable Parquet file: {e}") from None
        super().__init__(path, total, split)

    def _read_raw(self, lo, hi):
        pf = _parquet(self.path, self.storage_options)
        first = 0
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if first + n > lo and first < hi:
                rows = pf.read_row_group(g).slice(max(lo - first, 0), min(hi, first + n) - max(lo, first))
                for j, row in enumerate(rows.to_pylist()):
                    yield max(lo, first) + j, row
            first += n

    def _get_raw(self, raw_rows):
        if getattr(self, "_group_starts", None) is None:
            meta = _parquet(self.path, self.storage_options).metadata
            self._group_starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
            self._group = (-1, None)  # the last row group read, decoded: a window reads each one a few times
        rows = np.asarray(raw_rows, dtype=np.int64)
        groups = np.searchsorted(self._group_starts, rows, side="right") - 1
        for g in np.unique(groups):
            if self._group[0] != g:
                self._group = (g, _parquet(self.path, self.storage_options).read_row_group(int(g)))
            mine = rows[groups == g]
            for r, row in zip(mine.tolist(), self._group[1].take(mine - self._group_starts[g]).to_pylist()):
                yield r, row


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
        if getattr(self, "_ds", None) is None:
            self._ds = self._dataset()  # memory-mapped: cheap to keep, and loading it costs per read
        ds = self._ds
        for start in range(lo, hi, 1024):
            batch = ds[start : min(hi, start + 1024)]
            keys = list(batch)
            for j in range(len(batch[keys[0]]) if keys else 0):
                yield start + j, {k: batch[k][j] for k in keys}

    def _get_raw(self, raw_rows):
        if getattr(self, "_ds", None) is None:
            self._ds = self._dataset()
        batch = self._ds[list(raw_rows)]
        for j, r in enumerate(raw_rows):
            yield r, {k: v[j] for k, v in batch.items()}


def _split_name(split: str | None) -> str | None:
    if not split:
        return None
    return split.split("[", 1)[0].split("+", 1)[0].strip() or None


def _first_byte(path: str, storage_options: dict | None) -> bytes:
    with _open_bytes(path, storage_options) as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head[:1]


def open_input(path: str, split: str | None = None, storage_options: dict | None = None, *,
               seek: tuple[int, int, int] | None = None) -> InputTable:
    """Open an input by its path's form: a folder (datasets), ``.parquet``, a ``.json`` list, ``.txt``, else JSONL.

    ``seek``: the table's ``seek_point(row)`` from an earlier opening of this file. A JSONL or text
    file then opens without being scanned, and reads from ``row`` on start at that byte (so a precache
    task on another node reads only its own rows). Other kinds ignore it.

    Example:
        >>> open_input("missing.jsonl")
        Traceback (most recent call last):
        portable_loader.errors.InputError: missing.jsonl: no such file or folder
    """
    path = os.fspath(path)
    if is_url(path):
        if not path.lower().endswith(SUPPORTED):
            raise InputError(f"{path}: unsupported object type (supported: {', '.join(SUPPORTED)}; "
                             "a datasets.save_to_disk folder must be local)")
    elif not os.path.exists(path):
        raise InputError(f"{path}: no such file or folder")
    elif os.path.isdir(path):
        return HFDiskTable(path, split)
    name = path.lower()
    so = storage_options if is_url(path) else None
    if name.endswith(".parquet"):
        return ParquetTable(path, split, so)
    if name.endswith(".json") and _first_byte(path, so) == b"[":
        return JsonListTable(path, split, so)
    if name.endswith(".txt") or name.endswith(".txt.gz"):
        return TextLinesTable(path, split, so, seek)
    return JsonLinesTable(path, split, so, seek)
