"""Reading local caches: the Arrow and ArrayRecord record sources ``open_cache`` (``opening.py``) returns.

Opening is O(shards), never O(rows). Sources follow Grain's ``RandomAccessDataSource`` protocol
(``len``, ``[i]``) plus batched reads (``__getitems__``) and vectorized ``lengths``; records are
``{"input_ids": int32 array, "loss_mask": uint8 array}``. ``spans(indices)`` says where many
records' tokens lie (:class:`Spans`), so that collation copies them with no per-record objects.

Example:
    >>> import portable_loader as pl
    >>> from portable_loader.precache import sample_args
    >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache"))
    >>> src, len(src), src[0]["input_ids"].dtype
    (ArrowCacheSource('cache/chat-...', records=2000), 2000, dtype('int32'))
"""

from __future__ import annotations

import bisect
import os
import sys
import threading
from collections import deque
from operator import itemgetter
from typing import NamedTuple, Sequence

import numpy as np

from portable_loader.cache.armap import index_shard, read_record
from portable_loader.cache.writer import ARRAY_RECORD_OPTIONS
from portable_loader.errors import CacheError
from portable_loader.indexing import parse_index


class Spans(NamedTuple):
    """Where records' tokens lie, as plain ints: what a collating loop reads fastest.

    Record ``k`` (the ``k``-th index asked for) has ``length[k]`` tokens; its ``input_ids`` are the
    int32 bytes ``ids[buf[k]][ids_at[k] : ids_at[k] + 4 * length[k]]`` and its ``loss_mask`` the
    bytes ``masks[buf[k]][mask_at[k] : mask_at[k] + length[k]]``. ``ids`` and ``masks`` are
    memoryviews of bytes: an Arrow cache's memory-mapped column buffers, or the ArrayRecord records
    read, one buffer each (nothing is copied). (Memoryviews: a slice copy between two costs
    0.2 µs, between numpy arrays 0.9 µs, and a batch makes three per record.)

    Example:
        >>> import portable_loader as pl
        >>> from portable_loader.precache import sample_args
        >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache"))
        >>> sp = src.spans([4, 9]); sp.length
        [34, 17]
        >>> ids = np.frombuffer(sp.ids[sp.buf[0]][sp.ids_at[0]:][: 4 * sp.length[0]], np.int32)
        >>> bool((ids == src[4]["input_ids"]).all())
        True
    """

    ids: list
    masks: list
    buf: list
    ids_at: list
    mask_at: list
    length: list


def join_spans(n: int, parts: Sequence[tuple[Sequence[int], Spans]]) -> Spans:
    """One :class:`Spans` of ``n`` entries from the answers of several readers, each ``(where,
    spans)``: entry ``k`` of ``spans`` becomes entry ``where[k]``; together the ``where`` cover
    ``0 .. n - 1`` once (a mixture's sources, say, each asked for its records).

    Buffers are not copied: each part's lists are appended and its ``buf`` numbers shifted by the
    buffers before it (``ids`` and ``masks`` are parallel lists: one number names both).

    Example:
        >>> a = Spans(["A"], ["a"], [0, 0], [0, 12], [0, 3], [3, 4])
        >>> b = Spans(["B", "C"], ["b", "c"], [1], [8], [2], [5])
        >>> join_spans(3, [([2, 0], a), ([1], b)])
        Spans(ids=['A', 'B', 'C'], masks=['a', 'b', 'c'], buf=[0, 2, 0], ids_at=[12, 8, 0], mask_at=[3, 2, 0], length=[4, 5, 3])
    """
    ids, masks, buf, ids_at, mask_at, length = [], [], [], [], [], []
    for _, sp in parts:
        shift = len(ids)
        ids += sp.ids
        masks += sp.masks
        buf += [b + shift for b in sp.buf] if shift else sp.buf
        ids_at += sp.ids_at
        mask_at += sp.mask_at
        length += sp.length
    # back[w]: the entry of the parts, back to back, that goes to position w.
    if n > _FEW:  # a loader's chunk (thousands): the permutation in numpy
        back = np.empty(n, dtype=np.int64)
        back[np.concatenate([np.asarray(w, dtype=np.int64) for w, _ in parts])] = np.arange(n)
        back = back.tolist()
    else:  # a step's few: plain Python beats numpy's fixed costs
        back = [0] * n
        for k, w in enumerate(w for where, _ in parts for w in where):
            back[w] = k
    fields = (buf, ids_at, mask_at, length)
    if n < 2:  # itemgetter of one index returns the item, not a tuple
        return Spans(ids, masks, *([values[k] for k in back] for values in fields))
    pick = itemgetter(*back)  # gathers in C: a third of a list comprehension's time
    return Spans(ids, masks, *(list(pick(values)) for values in fields))


def spans_of(located: list) -> Spans:
    """One :class:`Spans` of records each located on its own (an entry ``(ids buffer, mask buffer,
    ids_at, mask_at, length)``, as ``span_at`` answers), each buffer listed once, numbered in the
    order first met: what joins a few records of several readers, or of two read-aheads.

    Example:
        >>> a, b = memoryview(b"ab"), memoryview(b"cd")
        >>> spans_of([(a, a, 0, 0, 1), (b, b, 4, 1, 1), (a, a, 4, 1, 1)]).buf
        [0, 1, 0]
    """
    if not located:
        return Spans([], [], [], [], [], [])
    ids, masks, ids_at, mask_at, length = zip(*located)
    first = ids[0]
    if all(a is first for a in ids):  # one shard batch (up to 65,536 records a cache): one buffer
        return Spans([first], [masks[0]], [0] * len(ids), list(ids_at), list(mask_at), list(length))
    index: dict[int, int] = {}  # id of a buffer -> its number here
    buf = [index.setdefault(id(a), len(index)) for a in ids]
    seen = {id(a): (a, m) for a, m in zip(ids, masks)}  # in the order first met, as ``index`` numbers them
    return Spans([a for a, _ in seen.values()], [m for _, m in seen.values()], buf, list(ids_at),
                 list(mask_at), list(length))


#: The most records a ``lengths`` call answers from their spans and keeps them (a loader's packing
#: window or chunk of positions): a larger call (a whole cache's lengths) goes the vectorized way,
#: without building and keeping a Python list entry per record.
KEEP_SPANS_MAX = 1 << 14


def kept_spans(sized: tuple | None, indices) -> Spans | None:
    """The ``Spans`` of ``sized = (records, spans)`` when ``indices`` are those very records, else
    None: a reader that answered a window's ``lengths`` from its spans serves the read that follows.

    Example:
        >>> sized = (np.array([4, 9]), Spans([], [], [0, 0], [0, 8], [0, 2], [2, 3]))
        >>> kept_spans(sized, np.array([4, 9])).length, kept_spans(sized, np.array([9, 4]))
        ([2, 3], None)
    """
    if sized is not None and type(indices) is np.ndarray and indices.shape == sized[0].shape \
            and np.array_equal(indices, sized[0]):
        return sized[1]
    return None


class _CacheSource:
    """Random access to records; Grain's ``RandomAccessDataSource`` protocol plus batched reads."""

    def __init__(self, path: str, manifest: dict):
        self.path, self.manifest = path, manifest
        counts = [s["rows"] for s in manifest["shards"]]
        self._shard_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._len = int(self._shard_starts[-1])

    def __len__(self) -> int:
        return self._len

    def __reduce__(self):
        # Pickled (into Grain's or torch's worker processes) as what reopens it: maps, readers and
        # locks belong to this process, and a copy of the mapped data would be the whole cache.
        return type(self), (self.path, self.manifest)

    @property
    def shard_rows(self) -> list[int]:
        """Records per shard, in order (what ``shuffle="shards"`` groups by)."""
        return [s["rows"] for s in self.manifest["shards"]]

    def _indices(self, indices) -> np.ndarray:
        """Indices as int64, negative ones counted from the end; IndexError for any out of range.

        The rule of :func:`parse_index` (so ``[1.0]`` or ``["3"]`` is a ``TypeError``), plus a
        ``range`` or a single integer, which batched readers pass.
        """
        if type(indices) is np.ndarray and indices.dtype == np.int64 and indices.ndim == 1:
            # The loader's own reads (already int64): two reductions instead of a per-element check.
            if not indices.size or (indices.min() >= 0 and indices.max() < self._len):
                return indices
        if isinstance(indices, range):
            indices = np.arange(indices.start, indices.stop, indices.step, dtype=np.int64)
        elif isinstance(indices, list) and all(type(i) is int for i in indices):
            indices = np.asarray(indices, dtype=np.int64).reshape(len(indices))  # skips a per-item ABC check
        elif not isinstance(indices, (list, tuple, np.ndarray, slice)):
            indices = [indices]
        try:
            return parse_index(indices, self._len)
        except IndexError as e:
            raise IndexError(f"{e} ({self.path})") from None

    def __getitem__(self, key):
        """One record for an integer; a list of records, in order, for a list, 1-D integer array or slice.

        Example:
            >>> import portable_loader as pl
            >>> from portable_loader.precache import sample_args
            >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache"))
            >>> src[3]["input_ids"].size, len(src[[5, 6, 7]]), len(src[:10:2])
            (33, 3, 5)
        """
        try:
            idx = parse_index(key, self._len)
        except IndexError as e:
            raise IndexError(f"{e} ({self.path})") from None
        if isinstance(idx, int):
            return self.__getitems__([idx])[0]
        return self.__getitems__(idx)

    def prefetch(self, indices: Sequence[int] | np.ndarray) -> None:
        """A hint: ``__getitems__`` will soon ask for these records (say, the next steps' batches).

        Optional for sources; a loader that knows its plan may call it ahead of the fetches.
        Arrow shards are memory-mapped, so there is nothing to read ahead; indices are still checked.

        Example:
            >>> import portable_loader as pl
            >>> from portable_loader.precache import sample_args
            >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache"))
            >>> src.prefetch([7, 3, 9]); len(src[[7, 3]])
            2
            >>> src.prefetch([2000])
            Traceback (most recent call last):
            IndexError: record index 2000 out of range for a dataset of 2000 records (cache/chat-...)
        """
        self._indices(indices)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, records={self._len})"


_FEW = 64  # up to this many indices, plain Python loops beat vectorized numpy


def _view(array, dtype) -> np.ndarray:
    """A zero-copy numpy view of a primitive Arrow array (``to_numpy`` would import pandas)."""
    dtype = np.dtype(dtype)
    data = array.buffers()[1]
    return np.frombuffer(data, dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)


class ArrowCacheSource(_CacheSource):
    """Memory-mapped Arrow shards; records are zero-copy, read-only numpy views.

    Example:
        >>> import portable_loader as pl
        >>> from portable_loader.precache import sample_args
        >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache"))
        >>> [r["input_ids"].size for r in src.__getitems__([0, 5])]
        [23, 34]
        >>> src[0]["input_ids"].flags.writeable    # a view of the memory-mapped shard
        False
    """

    def __init__(self, path: str, manifest: dict):
        import pyarrow as pa

        super().__init__(path, manifest)
        starts, self._offsets, self._ids, self._mask = [], [], [], []
        # Each shard file's mapping as int32 words, and where each batch's offsets start in its
        # file's words: a window's records are then located by one gather per file, not per batch.
        self._words, word_base, file_of = [], [], []
        row = 0
        for file_no, shard in enumerate(manifest["shards"]):
            mapped = pa.memory_map(os.path.join(path, shard["file"]))
            table = pa.ipc.open_stream(mapped).read_all()
            mapped.seek(0)
            whole = mapped.read_buffer()  # the same mapping, zero-copy
            words = np.frombuffer(whole, dtype=np.int32, count=whole.size // 4)
            self._words.append(words)
            ids_col, mask_col = table.column("input_ids"), table.column("loss_mask")
            for ids_chunk, mask_chunk in zip(ids_col.chunks, mask_col.chunks):
                starts.append(row)
                offsets = _view(ids_chunk.offsets, np.int32)
                self._offsets.append(offsets)
                self._ids.append(_view(ids_chunk.values, np.int32))
                self._mask.append(_view(mask_chunk.values, np.uint8))
                at = offsets.__array_interface__["data"][0] - words.__array_interface__["data"][0]
                word_base.append(at // 4 if at % 4 == 0 and 0 <= at and at + offsets.nbytes <= 4 * words.size else -1)
                file_of.append(file_no)
                row += len(ids_chunk)
        self._word_base = np.asarray(word_base, dtype=np.int64) if -1 not in word_base else None
        self._file_of = np.asarray(file_of, dtype=np.int64)
        if row != self._len:
            raise CacheError(f"{path}: shards hold {row} records, the manifest says {self._len}")
        # One entry per written batch (up to 65,536 records), never one per record.
        self._seg_starts = np.asarray(starts + [row], dtype=np.int64)
        # The same, as Python ints: a loader step reads a few records, and for a few, bisect and
        # memoryview reads (plain ints) cost less than the numpy calls' fixed price.
        self._seg_list = starts + [row]
        self._offsets_mv = [memoryview(o) for o in self._offsets]
        # What spans() hands out: byte views of the memory-mapped columns.
        self._ids_bytes = [memoryview(a.view(np.uint8)) for a in self._ids]
        self._mask_bytes = [memoryview(a) for a in self._mask]
        # (records, their Spans) of the last many-record lengths() call: a loader sizes a packing
        # window (or a chunk) and reads the same records next, which then are located once.
        self._sized: tuple[np.ndarray, Spans] | None = None

    def _locate(self, indices) -> tuple[list[int], list[int]]:
        """(shard batch, row within it) of each index, as Python lists."""
        if type(indices) is np.ndarray and indices.dtype == np.int64 and indices.ndim == 1 and indices.size <= _FEW:
            idx = indices.tolist()  # the loader's own reads: checked in Python (numpy's min/max cost µs each)
            if idx and (min(idx) < 0 or max(idx) >= self._len):
                idx = self._indices(indices).tolist()  # negatives counted from the end; IndexError
        else:
            idx = self._indices(indices)
            if idx.size > _FEW:
                segs = np.searchsorted(self._seg_starts, idx, side="right") - 1
                return segs.tolist(), (idx - self._seg_starts[segs]).tolist()
            idx = idx.tolist()
        starts, segs, local = self._seg_list, [], []
        for i in idx:
            s = bisect.bisect_right(starts, i) - 1
            segs.append(s)
            local.append(i - starts[s])
        return segs, local

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        out = []
        all_offsets, all_ids, all_mask = self._offsets_mv, self._ids, self._mask
        for seg, j in zip(*self._locate(indices)):
            offsets = all_offsets[seg]
            a, b = offsets[j], offsets[j + 1]
            out.append({"input_ids": all_ids[seg][a:b], "loss_mask": all_mask[seg][a:b]})
        return out

    def record_at(self, i: int) -> dict:
        """Record ``i`` (a Python int in ``[0, len)``, not checked): the cheapest single read.

        Example:
            >>> import portable_loader as pl
            >>> from portable_loader.precache import sample_args
            >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache"))
            >>> src.record_at(3)["input_ids"].size
            33
        """
        starts = self._seg_list
        seg = bisect.bisect_right(starts, i) - 1
        j = i - starts[seg]
        offsets = self._offsets_mv[seg]
        a, b = offsets[j], offsets[j + 1]
        return {"input_ids": self._ids[seg][a:b], "loss_mask": self._mask[seg][a:b]}

    def span_at(self, i: int) -> tuple:
        """Record ``i``'s ``(ids buffer, mask buffer, ids_at, mask_at, length)``, one entry of a
        :class:`Spans` (``i`` a Python int in ``[0, len)``, not checked): for a caller joining the
        records of several readers (a remote cache's shards) a few at a time.

        Example:
            >>> import portable_loader as pl
            >>> from portable_loader.precache import sample_args
            >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache"))
            >>> src.span_at(3)[4]
            33
        """
        starts = self._seg_list
        seg = bisect.bisect_right(starts, i) - 1
        j = i - starts[seg]
        offsets = self._offsets_mv[seg]
        a = offsets[j]
        return self._ids_bytes[seg], self._mask_bytes[seg], 4 * a, a, offsets[j + 1] - a

    def spans(self, indices: Sequence[int] | np.ndarray) -> Spans:
        """Where the records' tokens lie in the memory-mapped shards (see :class:`Spans`); reads nothing.

        Example:
            >>> import portable_loader as pl
            >>> from portable_loader.precache import sample_args
            >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache"))
            >>> src.spans([0, 5]).length
            [23, 34]
        """
        kept = kept_spans(self._sized, indices)
        if kept is not None:
            return kept
        return self._located(self._indices(indices))[0]

    def _located(self, idx: np.ndarray) -> tuple[Spans, np.ndarray | None]:
        """``spans`` of the checked int64 ``idx``, and their lengths as an array where they were
        computed as one (many records), else None."""
        if idx.size <= _FEW:
            segs, local = self._locate(idx)
        else:
            seg = np.searchsorted(self._seg_starts, idx, side="right") - 1
            local_arr = idx - self._seg_starts[seg]
            got = self._gathered(seg, local_arr)
            if got is not None:
                first, last = got
                length = last - first
                return Spans(self._ids_bytes, self._mask_bytes, seg.tolist(), (4 * first).tolist(), first.tolist(),
                             length.tolist()), length
            segs, local = seg.tolist(), local_arr.tolist()  # records of many batches and files: a loop costs less
        offsets = self._offsets_mv
        starts = [offsets[s][j] for s, j in zip(segs, local)]
        length = [offsets[s][j + 1] - a for s, j, a in zip(segs, local, starts)]
        return Spans(self._ids_bytes, self._mask_bytes, segs, [4 * a for a in starts], starts, length), None

    def _gathered(self, seg: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(first, end) token offsets of records ``local`` of batches ``seg``, int64: one gather per
        shard file met, from the file's mapped words (a window of 1,024 records over 4 files of 17
        batches: 4 gathers, not 17, and no fancy-indexed selection per group), or per batch met
        where the words are not at hand. None when the groups met are so many that a loop over
        the records costs less."""
        if self._word_base is not None:
            keys, groups, arrays = self._word_base[seg] + local, self._file_of[seg], self._words
        else:
            keys, groups, arrays = local, seg, self._offsets
        if len(arrays) == 1:
            only = arrays[0]
            return only[keys].astype(np.int64), only[keys + 1].astype(np.int64)
        # groups as uint16 where they fit: numpy's stable sort of 16-bit keys is a radix sort
        order = np.argsort(groups.astype(np.uint16) if len(arrays) <= 1 << 16 else groups, kind="stable")
        ordered = groups[order]
        edges = [0, *(np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist(), ordered.size]
        if len(edges) - 1 >= ordered.size // 16:
            return None
        keys = keys[order]
        first, last = np.empty(keys.size, dtype=np.int64), np.empty(keys.size, dtype=np.int64)
        for a, b in zip(edges, edges[1:]):  # contiguous runs: slice stores, one gather each
            array, k = arrays[int(ordered[a])], keys[a:b]
            first[a:b] = array[k]
            last[a:b] = array[k + 1]
        out_first, out_last = np.empty_like(first), np.empty_like(last)
        out_first[order], out_last[order] = first, last
        return out_first, out_last

    def lengths(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Token counts of records, vectorized (what a packer needs before it reads anything).

        Many records at once, up to ``KEEP_SPANS_MAX`` (a loader's packing window or chunk), are
        answered from their spans, kept for a ``spans`` call with the same records: the loader reads
        them next. A larger call (a whole cache's lengths) is the same gather per shard file, without
        building or keeping their spans.

        Example:
            >>> import portable_loader as pl
            >>> from portable_loader.precache import sample_args
            >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache"))
            >>> window = np.arange(100, 1124)
            >>> int(src.lengths(window).sum()) == sum(src.spans(window).length)
            True
            >>> src.spans(window) is src.spans(window.copy())   # located once
            True
        """
        if type(indices) is np.ndarray and _FEW < indices.size <= KEEP_SPANS_MAX:
            kept = kept_spans(self._sized, indices)
            spans, length = (kept, None) if kept is not None else self._located(self._indices(indices))
            self._sized = (indices.copy(), spans)
            return np.array(spans.length, dtype=np.int64) if length is None else length
        if isinstance(indices, (list, tuple, np.ndarray)) and len(indices) <= _FEW:  # a padded step's few
            segs, local = self._locate(indices)  # records: a loop beats numpy's setup
        else:
            idx = self._indices(indices)
            seg = np.searchsorted(self._seg_starts, idx, side="right") - 1
            local = idx - self._seg_starts[seg]
            got = self._gathered(seg, local)
            if got is not None:
                return got[1] - got[0]
            segs, local = seg.tolist(), local.tolist()  # records of many batches and files: a loop costs less
        offsets = self._offsets_mv
        return np.array([offsets[s][j + 1] - offsets[s][j] for s, j in zip(segs, local)], dtype=np.int64)


class ArrayRecordCacheSource(_CacheSource):
    """ArrayRecord shards (one record per chunk): memory-mapped, or read through the library.

    Shards written ``group_size:1,uncompressed`` (as the manifest's ``array_record_options`` says;
    what portable_loader writes) are ``mapped``: each shard's records are located at its first read
    (:func:`~portable_loader.cache.armap.index_shard`) and served from a memory map of the file, as
    Arrow's are (nothing copied but a record a block header splits). ``mapped=False`` forces the
    library path, which other shards (compressed, by older versions) take:
    records are read one by one (``read(i, i + 1)``): a list read goes through the library's thread
    pool, which on 2 shared cores costs twice as much per record for a batch of 8, and for a packing
    window of 1,024 records 11-28 us a record against a steady 11 us. With 8 cores or more, calls of
    ``bulk_min`` records or more use one list read per shard, which the pool runs in parallel.
    Records that ``lengths`` or ``prefetch`` read are kept (in blocks, one per call, oldest out first,
    up to ``memo_bytes`` of payload), so
    the batch a planner has just sized, or the steps a loader announced, are served without a read.

    Example:
        >>> import portable_loader as pl
        >>> from portable_loader.precache import sample_args
        >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache", backend="array_record", split="train[:100]"))
        >>> src, src.mapped
        (ArrayRecordCacheSource('cache/chat-...', records=100), True)
        >>> src.lengths([4, 9]).tolist()       # from the shard's index: no record is read
        [34, 17]
        >>> lib = ArrayRecordCacheSource(src.path, src.manifest, mapped=False)   # through the library
        >>> lib.lengths([4, 9]).tolist()       # reads records 4 and 9, and keeps them
        [34, 17]
        >>> lib[[4, 9]][0]["input_ids"].size   # served from the memo
        34
    """

    bulk_min = 64 if (os.cpu_count() or 1) >= 8 else sys.maxsize

    def __init__(self, path: str, manifest: dict, memo_bytes: int = 64 << 20, mapped: bool = True):
        super().__init__(path, manifest)
        options = set(manifest.get("array_record_options", "group_size:1").split(","))
        # Shards of one uncompressed record per chunk are read from a memory map (cache/armap.py);
        # others (compressed, from an older portable_loader) through the library's reader.
        self.mapped = bool(mapped) and options == set(ARRAY_RECORD_OPTIONS.split(","))
        if self.mapped:
            self._readers = []
            self._index: list = [None] * len(manifest["shards"])  # per shard, built at its first read
            self._views: list = [None] * len(manifest["shards"])
        else:
            from array_record.python.array_record_module import ArrayRecordReader

            self._readers = [
                ArrayRecordReader(os.path.join(path, s["file"]), "readahead_buffer_size:0")
                for s in manifest["shards"]
            ]
        self._starts_list = self._shard_starts.tolist()
        self.memo_bytes = int(memo_bytes)
        # The memo: blocks of records, one per remembering call (index -> raw record), oldest first.
        # Whole blocks come and go: a per-record FIFO cost ~1.5 µs a record in inserts and evictions.
        self._memo: deque[dict[int, bytes]] = deque()
        self._memo_sizes: deque[int] = deque()
        self._memo_size = 0
        self._lock = threading.Lock()  # a prefetch thread and the caller may share one source
        # Shards written compressed (before portable_loader wrote them uncompressed) crash a reader
        # in a worker forked after this process read from them: see cache/writer.py.
        compressed = "uncompressed" not in manifest.get("array_record_options", "group_size:1")
        self.fork_hazard = (
            f"{path}: this ArrayRecord cache was written compressed (by an older portable_loader), and "
            "its reader crashes in forked worker processes, so workers start by forkserver for it "
            "(slower to start); rebuild it (precache --force) to have them forked" if compressed else None
        )

    @staticmethod
    def _decode(raw: bytes) -> dict:
        n = len(raw) // 5
        return {
            "input_ids": np.frombuffer(raw, dtype=np.int32, count=n),
            "loss_mask": np.frombuffer(raw, dtype=np.uint8, offset=4 * n),
        }

    def _read(self, idx: np.ndarray) -> list[bytes]:
        """Raw records at global indices ``idx``, in order, straight from the shards."""
        if idx.size < self.bulk_min:
            readers, out = self._readers, []
            if idx.size <= _FEW:
                starts = self._starts_list
                for i in idx.tolist():
                    s = bisect.bisect_right(starts, i) - 1
                    out += readers[s].read(i - starts[s], i - starts[s] + 1)
                return out
            shard = np.searchsorted(self._shard_starts, idx, side="right") - 1
            for s, j in zip(shard.tolist(), (idx - self._shard_starts[shard]).tolist()):
                out += readers[s].read(j, j + 1)
            return out
        shard = np.searchsorted(self._shard_starts, idx, side="right") - 1
        local = idx - self._shard_starts[shard]
        out = [None] * idx.size
        for s in np.unique(shard).tolist():
            where = np.flatnonzero(shard == s)
            for w, raw in zip(where.tolist(), self._readers[s].read(local[where].tolist())):
                out[w] = raw
        return out

    def _raw(self, idx: np.ndarray, remember: bool) -> list[bytes]:
        """Raw records, from the memo where it has them; ``remember`` keeps the ones read."""
        keys = idx.tolist()
        with self._lock:
            blocks = list(self._memo)
        raws = [None] * len(keys)
        for block in reversed(blocks):  # newest first
            found = list(map(block.get, keys))
            if found.count(None) == len(found):
                # A block with none of them: older ones are from earlier steps too (a loader's next
                # chunk or window misses them all), so stop looking rather than scan every block.
                break
            raws = [f if r is None else r for r, f in zip(raws, found)]
            if None not in raws:
                break
        missing = [j for j, r in enumerate(raws) if r is None]
        if missing:
            for j, raw in zip(missing, self._read(idx[missing])):
                raws[j] = raw
            if remember:
                self._remember([keys[j] for j in missing], [raws[j] for j in missing])
        return raws

    def _remember(self, keys: list[int], raws: list[bytes]) -> None:
        """Keep these records as one block; the oldest blocks go while the memo is over its budget."""
        block = dict(zip(keys, raws))
        size = sum(map(len, block.values()))
        with self._lock:
            self._memo.append(block)
            self._memo_sizes.append(size)
            self._memo_size += size
            while self._memo_size > self.memo_bytes and self._memo:
                self._memo.popleft()
                self._memo_size -= self._memo_sizes.popleft()

    def _shard(self, s: int) -> tuple:
        """Shard ``s``'s record payloads as memoryviews (position, byte size, crosses a block
        header) and numpy arrays of the same; located at the shard's first read."""
        with self._lock:
            ix = self._index[s]
            if ix is None:
                shard = self.manifest["shards"][s]
                found = index_shard(os.path.join(self.path, shard["file"]), shard["rows"])
                arrays = (found.pos, found.size, found.cross)
                ix = self._index[s] = tuple(map(memoryview, arrays)) + arrays
                self._views[s] = found.view
        return ix

    def _where(self, idx: np.ndarray, sizes_only: bool = False):
        """Where records ``idx`` lie: (buffers, buffer, position, byte size of each), as lists.

        The buffers are the shards' memory maps, then a copy of each record that a block header
        interrupts (the records themselves are never copied otherwise). ``sizes_only``: the sizes.
        """
        index, starts = self._index, self._starts_list
        if idx.size <= _FEW:
            shards, local = [], []
            for i in idx.tolist():
                s = bisect.bisect_right(starts, i) - 1
                shards.append(s)
                local.append(i - starts[s])
            ixs = [index[s] or self._shard(s) for s in shards]
            size = [ix[1][j] for ix, j in zip(ixs, local)]
            if sizes_only:
                return size
            pos = [ix[0][j] for ix, j in zip(ixs, local)]
            crossing = [k for k, (ix, j) in enumerate(zip(ixs, local)) if ix[2][j]]
        else:
            shard = np.searchsorted(self._shard_starts, idx, side="right") - 1
            local_arr = idx - self._shard_starts[shard]
            pos_arr, size_arr = np.empty(idx.size, np.int64), np.empty(idx.size, np.int64)
            cross_arr = np.empty(idx.size, bool)
            for s in np.unique(shard).tolist():
                ix = index[s] or self._shard(s)
                sel = np.flatnonzero(shard == s)
                j = local_arr[sel]
                size_arr[sel] = ix[4][j]
                if not sizes_only:
                    pos_arr[sel], cross_arr[sel] = ix[3][j], ix[5][j]
            if sizes_only:
                return size_arr
            shards, pos, size = shard.tolist(), pos_arr.tolist(), size_arr.tolist()
            crossing = np.flatnonzero(cross_arr).tolist()
        views = self._views
        if crossing:
            views = views + [read_record(views[shards[k]], pos[k], size[k]) for k in crossing]
            for n, k in enumerate(crossing, start=len(self._index)):
                shards[k], pos[k] = n, 0
        return views, shards, pos, size

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        if self.mapped:
            views, buf, pos, size = self._where(self._indices(indices))
            return [self._decode(views[b][p : p + n]) for b, p, n in zip(buf, pos, size)]
        return [self._decode(raw) for raw in self._raw(self._indices(indices), remember=False)]

    def spans(self, indices: Sequence[int] | np.ndarray) -> Spans:
        """The records read (or taken from the memo), each its own buffer (see :class:`Spans`).

        One call for many records (a loader's next steps) costs a memoryview per record instead of
        a record dict and two numpy views. A call for many records keeps them in the memo: a
        loader reads the next packing window ahead, and its planner then asks for the window's
        lengths (without the memo, every packed record was read twice).

        Example:
            >>> import portable_loader as pl
            >>> from portable_loader.precache import sample_args
            >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache", backend="array_record", split="train[:100]"))
            >>> src.spans([4, 9]).length
            [34, 17]
        """
        idx = self._indices(indices)
        if self.mapped:
            views, buf, pos, size = self._where(idx)
            n = [b // 5 for b in size]
            return Spans(views, views, buf, pos, [p + 4 * m for p, m in zip(pos, n)], n)
        raws = self._raw(idx, remember=idx.size > _FEW)
        views = list(map(memoryview, raws))  # no copy (joining them costs a copy and fresh pages)
        n = [len(raw) // 5 for raw in raws]  # a record is its int32 ids, then its uint8 mask
        return Spans(views, views, list(range(len(raws))), [0] * len(raws), [4 * m for m in n], n)

    def lengths(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Token counts; the records are read to know them, so they are kept for the fetch that follows.

        (Memory-mapped shards know them from their index, and read nothing.)
        """
        if self.mapped:
            return np.asarray(self._where(self._indices(indices), sizes_only=True), dtype=np.int64) // 5
        return np.asarray([len(raw) // 5 for raw in self._raw(self._indices(indices), remember=True)], dtype=np.int64)

    def prefetch(self, indices: Sequence[int] | np.ndarray) -> None:
        """Read records a later ``__getitems__`` will ask for, in one call (see :meth:`_CacheSource.prefetch`).

        Memory-mapped shards have nothing to read ahead; the indices are still checked.
        """
        if self.mapped:
            self._indices(indices)
            return
        self._raw(self._indices(indices), remember=True)

    def reopen(self) -> "ArrayRecordCacheSource":
        """A fresh instance with its own readers and an empty memo (what a forked worker needs)."""
        return ArrayRecordCacheSource(self.path, self.manifest, self.memo_bytes, self.mapped)

    def __reduce__(self):
        return ArrayRecordCacheSource, (self.path, self.manifest, self.memo_bytes, self.mapped)

    def close(self) -> None:
        for r in self._readers:
            r.close()
        if self.mapped:  # the maps close once the records handed out are gone
            self._index = [None] * len(self._index)
            self._views = [None] * len(self._views)
        with self._lock:
            self._memo.clear()
            self._memo_sizes.clear()
            self._memo_size = 0
