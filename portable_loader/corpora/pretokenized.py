"""Token files written by other stacks (Megatron ``.bin/.idx``, OLMo ``.npy``/raw, nanoGPT ``train.bin``), memory-mapped.

:func:`pretokenized` opens them as a dataset of documents (records ``{"input_ids": ...}``, views of
the mapped files: nothing is copied) that ``pl.DataLoader``, ``pl.mix``, ``.map`` and the Grain-style
layer take, and as one token stream (:class:`TokenStream`: the files concatenated in the order given)
that ``DataLoader(packing="concat")`` cuts into windows of exactly ``seq_len`` tokens.

Where documents begin:

* ``"megatron"``: the ``.idx`` says (sequence ``i`` of megatron-core's ``IndexedDataset`` is document
  ``i``); opening reads its 34-byte header and maps the rest.
* ``"numpy"`` / ``"flat"``: each ``eos_token_id`` ends a document (and so does the end of a file).
  Nothing is scanned at open: the window arithmetic needs only the token count, and a window finds
  its own boundaries in its tokens. Counting documents (``len``, ``ds[i]``) scans each file once, in
  chunks, the first time it is asked. Without ``eos_token_id`` a file is one document.

Example:
    >>> import numpy as np, portable_loader as pl
    >>> np.array([5, 6, 0, 7, 0, 8, 9], np.uint16).tofile("train.bin")
    >>> ds = pl.pretokenized("train.bin", format="flat", eos_token_id=0)
    >>> len(ds), ds.num_tokens, ds[1]["input_ids"].tolist()
    (3, 7, [7, 0])
"""

from __future__ import annotations

import bisect
import hashlib
import mmap
import os
import struct
from typing import Sequence

import numpy as np

from portable_loader.dataset.base import Dataset, as_indices
from portable_loader.io.remote import filesystem, is_url, object_identity

__all__ = ["FORMATS", "Pretokenized", "TokenStream", "pretokenized"]

FORMATS = ("auto", "megatron", "numpy", "flat")
_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = len(_MAGIC) + 8 + 1 + 8 + 8  # magic, version <Q, dtype code <B, sequences <Q, documents <Q
#: megatron-core's dtype codes in an .idx header.
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                   8: np.uint16}
_TOKEN_DTYPES = ("uint8", "uint16", "int16", "uint32", "int32", "int64")
_SCAN = 1 << 24  # tokens per chunk when a file is scanned for EOS (64 MiB of uint32 at most)
_SAMPLE = 1 << 16  # bytes at each end of a file that its identity hashes
_NONE = np.zeros(0, dtype=np.int64)
_COARSE = 4096  # pointers per stretch of a Megatron index searched at once
_STRETCHES = 64  # stretches kept (2 MiB): the windows of a small corpus all fall in a few
_REMADE = ("_mapped", "_mapped_index", "_coarse", "_stretches")  # what a process maps or copies for itself


def pretokenized(paths, *, format: str = "auto", dtype=None, eos_token_id: int | None = None) -> "Pretokenized":
    """Open token files as a dataset of documents (see the module docstring for the formats).

    ``paths``: one path (a Megatron prefix, with or without ``.bin``/``.idx``, or a file) or a list,
    concatenated in that order; local, or URLs (``s3://...``: each window is a ranged read, an
    ``.idx`` is read whole once). ``format="auto"`` picks ``"megatron"`` where ``PREFIX.idx`` exists,
    ``"numpy"`` for ``.npy`` files and ``"flat"`` otherwise. ``dtype``: the tokens' type in raw files
    (default ``uint16``, nanoGPT's and OLMo's); ``.idx`` and ``.npy`` files carry their own and a
    ``dtype`` that disagrees is refused.

    Example:
        >>> import numpy as np
        >>> np.save("part.npy", np.array([3, 4, 1, 5, 1], np.uint32))
        >>> ds = pretokenized("part.npy", eos_token_id=1)
        >>> [r["input_ids"].tolist() for r in ds]
        [[3, 4, 1], [5, 1]]
    """
    if format not in FORMATS:
        raise ValueError(f"pretokenized(format=...) must be one of {FORMATS}, got {format!r}")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [p if is_url(p) else os.fspath(p) for p in paths]
    if not paths:
        raise ValueError("pretokenized() needs at least one path")
    if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, (int, np.integer))
                                     or eos_token_id < 0):
        raise ValueError(f"eos_token_id must be a non-negative integer or None, got {eos_token_id!r}")
    files = tuple(_open_file(p, format, dtype, eos_token_id) for p in paths)
    return Pretokenized(files, eos_token_id)


def _prefix(path: str) -> str:
    return path[:-4] if path.endswith((".bin", ".idx")) else path


def _open_file(path: str, format: str, dtype, eos) -> "_TokenFile":
    if format == "auto":
        if _Bytes(_prefix(path) + ".idx").exists():
            format = "megatron"
        elif path.endswith(".npy"):
            format = "numpy"
        else:
            format = "flat"
    if format == "megatron":
        return _MegatronFile(_prefix(path), dtype)
    return _RawFile(path, dtype, eos)


def _check_dtype(dtype, where: str) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"{where}: unknown dtype {dtype!r}; token files hold one of {_TOKEN_DTYPES}") from None
    if dt.name not in _TOKEN_DTYPES:
        raise ValueError(f"{where}: dtype {dt.name} is not a token type; token files hold one of {_TOKEN_DTYPES}")
    return dt


class _Bytes:
    """A local file or an object behind a URL: its size, ranged reads, a map of it, its identity."""

    def __init__(self, path: str):
        self.path, self.remote = path, is_url(path)

    def exists(self) -> bool:
        if not self.remote:
            return os.path.exists(self.path)
        fs, p = filesystem(self.path)
        return fs.exists(p)

    def size(self) -> int:
        if not self.remote:
            return os.path.getsize(self.path)
        return object_identity(self.path)["size"]

    def read(self, start: int, end: int) -> bytes:
        if not self.remote:
            with open(self.path, "rb") as f:
                f.seek(start)
                return f.read(end - start)
        fs, p = filesystem(self.path)
        return fs.cat_file(p, start=start, end=end)

    def array(self, dtype, offset: int = 0, count: int | None = None, scattered: bool = False) -> np.ndarray:
        """The file's bytes from ``offset`` as ``dtype``: a map of a local file; a URL's are read once.

        ``scattered``: reads will land one here, one there (a binary search of an index): the
        kernel's read-ahead around each fault would read, and keep resident, far more than is asked.
        """
        if not self.remote:
            shape = None if count is None else (count,)
            mapped = np.memmap(self.path, dtype=dtype, mode="r", offset=offset, shape=shape)
            if scattered and hasattr(mmap, "MADV_RANDOM"):
                mapped._mmap.madvise(mmap.MADV_RANDOM)
            return mapped.view(np.ndarray)  # a plain ndarray: numpy's memmap subclass costs microseconds a slice
        return _Ranged(self, np.dtype(dtype), offset, count)

    def digest(self, size: int) -> str:
        """The identity without reading it all: a URL's ETag and size, a file's size and both ends."""
        if self.remote:
            return hashlib.sha256(repr(sorted(object_identity(self.path).items())).encode()).hexdigest()[:16]
        h = hashlib.sha256(str(size).encode())
        h.update(self.read(0, _SAMPLE))
        if size > _SAMPLE:
            h.update(self.read(max(_SAMPLE, size - _SAMPLE), size))
        return h.hexdigest()[:16]


class _Ranged:
    """Tokens of an object behind a URL, sliced like an array: each slice is one ranged read."""

    def __init__(self, where: _Bytes, dtype: np.dtype, offset: int, count: int | None):
        self.where, self.dtype, self.offset = where, dtype, offset
        self.size = count if count is not None else (where.size() - offset) // dtype.itemsize
        self.shape = (self.size,)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> np.ndarray:
        lo, hi, step = key.indices(self.size)
        if step != 1:
            raise IndexError("a remote token file is read in contiguous slices")
        if hi <= lo:
            return np.zeros(0, dtype=self.dtype)
        item = self.dtype.itemsize
        return np.frombuffer(self.where.read(self.offset + lo * item, self.offset + hi * item), dtype=self.dtype)


class _TokenFile:
    """One mapped token file: ``tokens`` (mapped on first use, never pickled) and its documents."""

    path: str
    dtype: np.dtype
    num_tokens: int
    eos: int | None = None  # the token that ends a document (raw files); an index says where instead
    _mapped: np.ndarray | None = None

    def __getstate__(self):  # a worker maps the file itself: a pickled memmap would carry every token
        return {k: v for k, v in self.__dict__.items() if k not in _REMADE}

    @property
    def tokens(self) -> np.ndarray:
        if self._mapped is None:
            self._mapped = self._map()
        return self._mapped

    def starts_between(self, lo: int, hi: int, tokens: np.ndarray, scan: bool = True) -> np.ndarray:
        """Offsets (relative to ``lo``) in ``(0, hi - lo)`` where a document starts; ``tokens`` are ``[lo, hi)``.

        ``scan=False``: leave out the starts after EOS tokens (the caller finds them for a whole batch).
        """
        if not scan or self.eos is None or tokens.size < 2:
            return _NONE
        return np.flatnonzero(tokens[:-1] == self.eos) + 1

    def starts_many(self, los: np.ndarray, length: int, scan: bool) -> list[np.ndarray]:
        """``starts_between`` of the windows ``[lo, lo + length)`` for each ``lo`` in ``los``."""
        if not scan or self.eos is None:  # nothing to look for in the tokens
            return [_NONE] * los.size
        t = self.tokens
        return [self.starts_between(lo, lo + length, t[lo : lo + length], scan) for lo in los.tolist()]


class _MegatronFile(_TokenFile):
    """``PREFIX.bin`` and ``PREFIX.idx`` as megatron-core's ``IndexedDatasetBuilder`` writes them."""

    def __init__(self, prefix: str, dtype):
        self.path, idx = prefix + ".bin", prefix + ".idx"
        for p in (self.path, idx):
            if not _Bytes(p).exists():
                raise FileNotFoundError(f"{p}: not found (format='megatron' reads PREFIX.bin and PREFIX.idx)")
        head = _Bytes(idx).read(0, _HEADER)
        if len(head) < _HEADER or head[: len(_MAGIC)] != _MAGIC:
            raise ValueError(f"{idx}: not a Megatron index (no MMIDIDX header)")
        version, code, self.count, docs = struct.unpack("<QBQQ", head[len(_MAGIC):])
        if version != 1:
            raise ValueError(f"{idx}: index version {version}; only version 1 (megatron-core's) is read")
        if code not in MEGATRON_DTYPES:
            raise ValueError(f"{idx}: unknown dtype code {code} in the header")
        self.dtype = _check_dtype(MEGATRON_DTYPES[code], idx)
        if dtype is not None and np.dtype(dtype) != self.dtype:
            raise ValueError(f"{idx}: its tokens are {self.dtype.name}, but dtype={np.dtype(dtype).name} was given")
        need = _HEADER + 12 * self.count + 8 * docs
        idx_size = _Bytes(idx).size()
        if idx_size not in (need, need + self.count):  # + one mode byte per sequence in multimodal indexes
            raise ValueError(f"{idx}: {idx_size} bytes, but its header ({self.count} sequences, {docs} documents) "
                             f"needs {need}: the index is truncated or not megatron-core's")
        self.idx = idx
        self.size = _Bytes(self.path).size()
        item = self.dtype.itemsize
        if self.size % item:
            raise ValueError(f"{self.path}: {self.size} bytes is not a whole number of {self.dtype.name} tokens")
        self.num_tokens = self.size // item
        self._check_ends()
        self.identity = ("megatron", os.path.basename(prefix), self.dtype.name, self.count,
                         _Bytes(self.path).digest(self.size), _Bytes(idx).digest(idx_size))

    def _index(self):
        """(sequence lengths int32, sequence byte pointers int64), mapped."""
        if self._mapped_index is None:
            where = _Bytes(self.idx)
            m = np.frombuffer(where.read(0, where.size()), np.uint8) if where.remote else where.array(np.uint8, scattered=True)
            lengths = m[_HEADER : _HEADER + 4 * self.count].view(np.int32)
            pointers = m[_HEADER + 4 * self.count : _HEADER + 12 * self.count].view(np.int64)
            self._mapped_index = (lengths, pointers)
        return self._mapped_index

    _mapped_index = None

    def _check_ends(self) -> None:
        if not self.count:
            return
        lengths, pointers = self._index()
        first, last, n = int(pointers[0]), int(pointers[-1]), int(lengths[-1])
        end = last + n * self.dtype.itemsize
        if first != 0 or end != self.size:
            raise ValueError(f"{self.path}: {self.size} bytes, but {self.idx} says its {self.count} sequences end at "
                             f"byte {end} (first at {first}): the pair does not match; nothing is served from it")

    def _map(self) -> np.ndarray:
        if not self.num_tokens:
            return np.zeros(0, dtype=self.dtype)
        return _Bytes(self.path).array(self.dtype)

    def num_docs(self) -> int:
        return self.count

    def doc_span(self, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lengths, pointers = self._index()
        return pointers[i] // self.dtype.itemsize, lengths[i].astype(np.int64)

    def starts_between(self, lo: int, hi: int, tokens: np.ndarray, scan: bool = True) -> np.ndarray:
        return self.starts_many(np.array([lo], dtype=np.int64), hi - lo, scan)[0]

    def starts_many(self, los: np.ndarray, length: int, scan: bool) -> list[np.ndarray]:
        """Where documents start inside each window, by binary search of the index.

        The .idx's 34-byte header leaves the mapped pointers unaligned, and numpy's search copies an
        unaligned array whole (at 10^7 documents, 80 MB a search): it runs over every ``_COARSE``-th
        pointer instead (a small aligned copy made once, touching one page in eight), then inside
        the stretch of ``_COARSE`` pointers found, copied aligned and kept for the next windows.
        """
        pointers = self._index()[1]
        item = self.dtype.itemsize
        if self._coarse is None:
            self._coarse = np.array(pointers[::_COARSE])
            self._stretches = {}
        want = np.concatenate([(los + 1) * item, (los + length) * item])  # first pointer >= each
        block = (np.searchsorted(self._coarse, want, side="right") - 1).tolist()
        out = []
        n = los.size
        for j, lo in enumerate(los.tolist()):
            ka, kb = block[j], block[n + j]
            if ka == kb:
                a, b = (np.searchsorted(self._stretch(ka), want[[j, n + j]]) + ka * _COARSE).tolist()
            else:
                a = int(np.searchsorted(self._stretch(ka), want[j])) + ka * _COARSE
                b = int(np.searchsorted(self._stretch(kb), want[n + j])) + kb * _COARSE
            out.append(pointers[a:b] // item - lo)
        return out

    def _stretch(self, k: int) -> np.ndarray:
        got = self._stretches.get(k)
        if got is None:
            if len(self._stretches) >= _STRETCHES:
                self._stretches.pop(next(iter(self._stretches)))
            got = self._stretches[k] = np.array(self._index()[1][k * _COARSE : (k + 1) * _COARSE])
        return got

    _coarse = None


class _RawFile(_TokenFile):
    """An ``.npy`` array or a raw file of tokens; documents end at ``eos`` (found by a scan when asked)."""

    def __init__(self, path: str, dtype, eos):
        where = _Bytes(path)
        if not where.exists():
            raise FileNotFoundError(f"{path}: not found")
        self.path, self.eos, self.size = path, eos, where.size()
        if path.endswith(".npy") and where.read(0, 6) == b"\x93NUMPY":
            shape, fortran, npy_dtype, self.offset = _npy_header(where, path)
            if len(shape) != 1:
                raise ValueError(f"{path}: a {len(shape)}-d array; token files are 1-d")
            self.dtype = _check_dtype(npy_dtype, path)
            if dtype is not None and np.dtype(dtype) != self.dtype:
                raise ValueError(f"{path}: its tokens are {self.dtype.name}, but dtype={np.dtype(dtype).name} was given")
            self.num_tokens = int(shape[0])
        else:
            self.dtype = _check_dtype("uint16" if dtype is None else dtype, path)
            if self.size % self.dtype.itemsize:
                raise ValueError(f"{path}: {self.size} bytes is not a whole number of {self.dtype.name} tokens "
                                 "(is dtype right?)")
            self.offset, self.num_tokens = 0, self.size // self.dtype.itemsize
        self.identity = ("tokens", os.path.basename(path), self.dtype.name, self.num_tokens, where.digest(self.size))
        self._starts: np.ndarray | None = None

    def __getstate__(self):
        state = super().__getstate__()
        state["_starts"] = None  # a scan is cheaper to redo than to pickle to every worker
        return state

    def _map(self) -> np.ndarray:
        if not self.num_tokens:
            return np.zeros(0, dtype=self.dtype)
        return _Bytes(self.path).array(self.dtype, self.offset, self.num_tokens)

    def doc_starts(self) -> np.ndarray:
        """Every document's first token offset, plus ``num_tokens`` at the end (one scan, kept)."""
        if self._starts is None:
            parts = [np.zeros(1, dtype=np.int64)]
            if self.eos is not None:
                t = self.tokens
                for lo in range(0, self.num_tokens, _SCAN):
                    hit = np.flatnonzero(t[lo : lo + _SCAN] == self.eos)
                    parts.append(hit.astype(np.int64) + (lo + 1))
            starts = np.concatenate(parts + [np.array([self.num_tokens], dtype=np.int64)])
            self._starts = np.unique(starts)  # an EOS last in the file starts no document
            if self.num_tokens == 0:
                self._starts = np.zeros(1, dtype=np.int64)
        return self._starts

    def num_docs(self) -> int:
        return self.doc_starts().size - 1

    def doc_span(self, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = self.doc_starts()
        return s[i], s[i + 1] - s[i]


def _npy_header(where: _Bytes, path: str) -> tuple[tuple, bool, np.dtype, int]:
    """(shape, fortran order, dtype, where the data starts) from an ``.npy`` file's header."""
    import io

    head = io.BytesIO(where.read(0, 1 << 16))
    try:
        version = np.lib.format.read_magic(head)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(head)
    except ValueError as e:
        raise ValueError(f"{path}: not a readable .npy file ({e})") from None
    return shape, fortran, dtype, head.tell()


class TokenStream:
    """The files' tokens back to back: ``read(lo, hi)`` -> (tokens, loss mask or None, document starts).

    The starts are offsets in ``(0, hi - lo)`` where a document begins (file boundaries included);
    what ``DataLoader(packing="concat")`` turns into ``segment_ids`` and ``positions``.

    Example:
        >>> import numpy as np, portable_loader as pl
        >>> np.array([5, 6, 0, 7, 0, 8, 9], np.uint16).tofile("stream.bin")
        >>> tokens, mask, starts = pl.pretokenized("stream.bin", eos_token_id=0).stream().read(1, 6)
        >>> tokens.tolist(), mask, starts.tolist()
        ([6, 0, 7, 0, 8], None, [2, 4])
    """

    def __init__(self, files: Sequence[_TokenFile]):
        self.files = tuple(files)
        self.bounds = [0]
        for f in self.files:
            self.bounds.append(self.bounds[-1] + f.num_tokens)
        self.num_tokens = self.bounds[-1]
        eos = {f.eos for f in self.files}
        #: The EOS that ends documents in every file (None where an index or nothing does): a reader
        #: of many windows then finds those starts for all of them at once (``read(..., scan=False)``).
        self.eos = eos.pop() if len(eos) == 1 else None

    def windows(self, los: Sequence[int], length: int, scan: bool = True) -> tuple[list, list, list]:
        """``read`` of the windows ``[lo, lo + length)``: (their tokens, their loss masks: None, their
        document starts), each file's windows searched together.

        Example:
            >>> import numpy as np, portable_loader as pl
            >>> np.array([5, 6, 0, 7, 0, 8, 9], np.uint16).tofile("w.bin")
            >>> tokens, masks, starts = pl.pretokenized("w.bin", eos_token_id=0).stream().windows([0, 3], 3)
            >>> [t.tolist() for t in tokens], masks, [s.tolist() for s in starts]
            ([[5, 6, 0], [7, 0, 8]], [None, None], [[], [2]])
        """
        tokens, starts = [None] * len(los), [None] * len(los)
        inside: dict[int, list[int]] = {}
        for j, lo in enumerate(los):
            k = bisect.bisect_right(self.bounds, lo) - 1
            if lo + length <= self.bounds[k + 1]:
                inside.setdefault(k, []).append(j)
            else:  # across a file's end: rare
                tokens[j], _, starts[j] = self.read(lo, lo + length, scan)
        for k, rows in inside.items():
            f, first = self.files[k], self.bounds[k]
            local = np.array([los[j] for j in rows], dtype=np.int64) - first
            t = f.tokens
            for j, lo, got in zip(rows, local.tolist(), f.starts_many(local, length, scan)):
                tokens[j], starts[j] = t[lo : lo + length], got
        return tokens, [None] * len(los), starts

    def read(self, lo: int, hi: int, scan: bool = True) -> tuple[np.ndarray, None, np.ndarray]:
        if not 0 <= lo <= hi <= self.num_tokens:
            raise IndexError(f"tokens [{lo}, {hi}) are outside the stream's {self.num_tokens}")
        k = bisect.bisect_right(self.bounds, lo) - 1
        first = self.bounds[k]
        if hi <= self.bounds[k + 1]:  # one file: a view of the map
            f = self.files[k]
            tokens = f.tokens[lo - first : hi - first]
            return tokens, None, f.starts_between(lo - first, hi - first, tokens, scan)
        parts, starts = [], []
        while lo < hi:
            while self.bounds[k + 1] <= lo:  # empty files start nothing
                k += 1
            first, f = self.bounds[k], self.files[k]
            end = min(hi, self.bounds[k + 1])
            piece = f.tokens[lo - first : end - first]
            at = sum(p.size for p in parts)
            if at:
                starts.append(np.array([at], dtype=np.int64))  # a new file starts a new document
            starts.append(f.starts_between(lo - first, end - first, piece, scan) + at)
            parts.append(piece)
            lo = end
        return np.concatenate(parts), None, np.concatenate(starts)


class Pretokenized(Dataset):
    """Documents of token files (built by :func:`pretokenized`); ``stream()`` is their token stream.

    Example:
        >>> import numpy as np
        >>> np.array([1, 2, 3, 0, 4], np.uint16).tofile("a.bin")
        >>> ds = pretokenized("a.bin", eos_token_id=0)
        >>> ds.lengths([0, 1]).tolist(), ds.num_tokens
        ([4, 1], 5)
    """

    cheap_lengths = True

    def __init__(self, files: Sequence[_TokenFile], eos_token_id: int | None = None):
        self.files, self.eos_token_id = tuple(files), eos_token_id
        self._stream = TokenStream(self.files)
        self.num_tokens = self._stream.num_tokens
        self._doc_bounds: list[int] | None = None

    def stream(self) -> TokenStream:
        """The token stream (files back to back) that ``packing="concat"`` cuts into windows."""
        return self._stream

    def _docs(self) -> list[int]:
        if self._doc_bounds is None:
            bounds = [0]
            for f in self.files:
                bounds.append(bounds[-1] + f.num_docs())
            self._doc_bounds = bounds
        return self._doc_bounds

    def __getstate__(self):
        return {**self.__dict__, "_doc_bounds": None}

    def __len__(self) -> int:
        return self._docs()[-1]

    def _spans(self, indices) -> list[tuple[_TokenFile, np.ndarray, np.ndarray, np.ndarray]]:
        """Per file: (file, positions in ``indices``, first token, length) of the documents asked for."""
        idx = as_indices(indices)
        n = len(self)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            bad = int(idx[(idx < 0) | (idx >= n)][0])
            raise IndexError(f"document {bad} is out of range: {self._where()} holds {n} documents")
        bounds = np.asarray(self._docs(), dtype=np.int64)
        which = np.searchsorted(bounds, idx, side="right") - 1
        out = []
        for k in np.unique(which).tolist():
            at = np.flatnonzero(which == k)
            start, length = self.files[k].doc_span(idx[at] - bounds[k])
            out.append((self.files[k], at, start, length))
        return out

    def __getitems__(self, indices) -> list:
        records: list = [None] * len(as_indices(indices))
        for f, at, start, length in self._spans(indices):
            tokens = f.tokens
            for j, s, n in zip(at.tolist(), start.tolist(), length.tolist()):
                records[j] = {"input_ids": tokens[s : s + n]}
        return records

    def lengths(self, indices) -> np.ndarray:
        out = np.zeros(len(as_indices(indices)), dtype=np.int64)
        for _, at, _, length in self._spans(indices):
            out[at] = length
        return out

    def _where(self) -> str:
        names = [f.path for f in self.files]
        return names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more files"

    def _identity(self) -> tuple:
        return ("pretokenized", self.eos_token_id, tuple(f.identity for f in self.files))

    def __repr__(self) -> str:
        return f"Pretokenized({self._where()}; tokens={self.num_tokens}, fingerprint={self.fingerprint()})"
