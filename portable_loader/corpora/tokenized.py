"""Tokenize on read: ``tokenized(input, tokenizer=..., format=...)``, a dataset with no cache behind it.

Record ``i`` is row ``i`` of the input (files in order, rows in file order, blank lines left out),
rendered and tokenized when it is read, by the same
:class:`~portable_loader.record_options.RecordOptions` (so the same
:class:`~portable_loader.tokenize.Formatter`) as ``precache``. When no row is dropped the records,
in order, equal the cache's, so loader batches (padded or packed, any ``num_workers``, resumed or
not) equal a cache's bit for bit.

A row that the cache would drop (over-long with ``overlong="drop"``, no target, a bad row skipped
with ``on_bad_row="skip"``) reads as an empty record and is counted in :attr:`Tokenized.dropped`
(of this process). Packing leaves an empty record out; padding gives it an all-padding row with no
loss. Record numbers then differ from the cache's (which has no such rows), so the stream differs:
see docs/tokenized.md.

A row index (the byte offset of every line, Parquet row groups) gives random access; tokens and
lengths of recently read records are kept (bounded by ``memo_tokens``). The loader's packing
planner asks for a window's lengths before its records: with worker processes, the workers
tokenize the windows ahead (:mod:`portable_loader.engine.ahead`), report the lengths to the
planner and hand the tokens to each other through :class:`~portable_loader.corpora.spill.Spill`
files; with ``num_workers=0`` the main process tokenizes, and its memo serves the batch. A ``map``
or a mixture over this dataset passes those calls down, so its workers tokenize ahead too.

The ``text`` and ``alpaca`` formats load the tokenizer with
:func:`~portable_loader.tokenize.load_tokenizer_cached`: the backend ``transformers`` built for it
in an earlier run, read back without importing ``transformers`` (the same ids; the ``chat``
format's template still renders through ``transformers``).

Example:
    >>> import portable_loader as pl
    >>> from portable_loader.precache import sample_args
    >>> args = sample_args()   # the bundled chat sample; yours: pl.tokenized("data/", tokenizer="tok/", format="alpaca")
    >>> ds = pl.tokenized(args["input"], tokenizer=args["tokenizer"], format=args["format"], max_length=2048)
    >>> ds[0]["input_ids"][:4], len(ds)
    (array([  2, 203, 297, 295], dtype=int32), 2000)
    >>> loader = pl.DataLoader(ds, global_batch_size=8, seq_len=256, packing=True, num_workers=2)
    >>> with iter(loader) as it:   # the two workers tokenize the packing windows ahead
    ...     batch = next(it)
    >>> batch["input_ids"].shape
    (8, 256)
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import threading
from collections import Counter, OrderedDict
from typing import Sequence

import numpy as np

from portable_loader.dataset.base import Dataset
from portable_loader.corpora.spill import Spill
from portable_loader.record_options import RecordOptions

__all__ = ["Tokenized", "tokenized"]

_EMPTY_IDS = np.zeros(0, dtype=np.int32)
_EMPTY_MASK = np.zeros(0, dtype=np.uint8)
_ENCODE_ROWS = 256  # rows per encode_batch call: the tokenizer's batch, and a bad row's blast radius


def tokenized(input, *, tokenizer: str, format: str, split: str | None = None, memo_tokens: int = 1 << 21,
              **options) -> "Tokenized":
    """A random-access dataset over ``input`` that tokenizes each record when it is read.

    ``input``, ``split`` and ``options`` are those of :func:`portable_loader.precache` that decide the
    records: with ``tokenizer`` and ``format``, the ``options`` make a
    :class:`~portable_loader.record_options.RecordOptions` (``max_length``, ``overlong``, ``fields``,
    ``chat_template``, ``eos_token``, ``on_bad_row``, ``transcript``). ``memo_tokens`` bounds the
    tokens kept for records read recently.

    Example:
        >>> import json
        >>> from portable_loader.precache import sample_args
        >>> with open("x.jsonl", "w") as f:
        ...     for text in ["hello world", "a second line, rather longer than the others", "the third"]:
        ...         print(json.dumps({"text": text}), file=f)
        >>> ds = tokenized("x.jsonl", tokenizer=sample_args()["tokenizer"], format="text", max_length=16)
        >>> ds.validate()["dropped"]
        {'overlong': 1}
    """
    from portable_loader.io import open_inputs

    record, unknown = RecordOptions.take(dict(options, tokenizer=tokenizer, format=format))
    if unknown:
        takes = sorted([f.name for f in dataclasses.fields(RecordOptions)] + ["split", "memo_tokens"])
        raise TypeError(f"tokenized() got options it does not take: {sorted(unknown)} (it takes {takes})")
    return Tokenized(open_inputs(input, split), record, memo_tokens=memo_tokens)


class Tokenized(Dataset):
    """Rows of an input ``table`` (:func:`portable_loader.io.open_inputs`), tokenized by ``record`` when
    read; made by :func:`tokenized`.

    ``dropped`` (a ``Counter`` by reason) and ``encoded`` (records tokenized) count what this
    process did: with loader workers, the main process's ``encoded`` stays 0.

    Example:
        >>> from portable_loader.precache import sample_args
        >>> ds = tokenized(**sample_args())
        >>> ds.lengths([0, 1]), ds.encoded   # a length is a tokenization: of those two records only
        (array([23, 19]), 2)
    """

    cheap_lengths = False  # a length costs a tokenization
    tokenizes_ahead = True  # the loader's workers tokenize packing windows ahead (engine/ahead.py)

    def __init__(self, table, record: RecordOptions, *, memo_tokens: int = 1 << 21):
        from portable_loader.cache.manifest import cache_key, cache_key_parts

        self.table, self.record, self.memo_tokens = table, record, memo_tokens
        self.rows = table.present()  # record i is window row rows[i]
        # A cache's key less its storage (backend, plan): every option that changes a record changes it.
        self.key = cache_key(cache_key_parts(table.identity(), record.key_parts()))
        self.dropped: Counter = Counter()
        self.encoded = 0  # records this process tokenized
        self._lengths = np.full(self.rows.size, -1, dtype=np.int64)
        self._memo: OrderedDict = OrderedDict()
        self._memo_size = 0
        self._lock = threading.Lock()  # the memo is shared by a thread engine's fetch threads
        # Records tokenized by one process reach the others (the loader's workers) through files.
        self._owner, self._spill = os.getpid(), Spill()
        self._formatter()  # fails now, not in a worker, for a tokenizer without EOS or chat template

    @property
    def format(self) -> str:
        return self.record.format

    def __len__(self) -> int:
        return int(self.rows.size)

    def _identity(self) -> tuple:
        return (self.key, len(self))

    def _formatter(self):
        fmt = getattr(self, "_fmt", None)
        if fmt is None:
            tok = None
            if self.record.format != "chat":  # a chat template renders through transformers
                from portable_loader.tokenize import load_tokenizer_cached

                tok = load_tokenizer_cached(self.record.tokenizer, self.record.eos_token)
            fmt = self._fmt = self.record.formatter(self.table.path, tokenizer=tok)
        return fmt

    def __getstate__(self):
        # A spawned worker loads its own tokenizer when it must, starts with no memo and no counts,
        # and reads the hand-over (_owner None: no process owns a pickled copy's spill).
        return dict(self.__dict__, _fmt=None, _memo=OrderedDict(), _memo_size=0, _lock=None, _owner=None,
                    dropped=Counter(), encoded=0)

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())

    def reopen(self) -> "Tokenized":
        # One loader worker per core: the tokenizer's own threads would only oversubscribe.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        return self

    def _tokenize(self, indices: Sequence[int]) -> dict:
        """Tokenize records ``indices`` (not in the memo), keep them, and return {index: (ids, mask)}."""
        fmt = self._formatter()
        out = {}
        todo = sorted(set(indices))
        for at in range(0, len(todo), _ENCODE_ROWS):
            part = todo[at : at + _ENCODE_ROWS]
            window_rows = self.rows[part].tolist()
            rows = self.table.get(window_rows)
            present = [k for k, r in enumerate(rows) if r is not None]
            results = [None] * len(part)
            encoded = fmt.encode([rows[k] for k in present], lambda j: self.table.where(window_rows[present[j]]))
            for k, r in zip(present, encoded):
                results[k] = r
            self.encoded += len(part)
            for k, r in enumerate(results):
                if type(r) is not tuple:
                    self.dropped[r or "empty"] += 1
                    results[k] = (_EMPTY_IDS, _EMPTY_MASK)
            out.update(zip(part, results))
            self._lengths[part] = np.fromiter((r[0].size for r in results), np.int64, len(results))
            self._remember(part, results)
        return out

    def _remember(self, indices: list, records: list) -> None:
        """Keep ``records`` (of ``indices``) in the memo, forgetting the oldest beyond ``memo_tokens``."""
        with self._lock:
            memo, size = self._memo, self._memo_size
            for i, record in zip(indices, records):
                if i not in memo:
                    memo[i] = record
                    size += record[0].size + 1
            while size > self.memo_tokens and memo:
                _, old = memo.popitem(last=False)
                size -= old[0].size + 1
            self._memo_size = size

    def _records(self, indices) -> list[tuple]:
        idx = [int(i) for i in indices]
        n = len(self)
        bad = [i for i in idx if not 0 <= i < n]
        if bad:
            raise IndexError(f"record {bad[0]} out of range for a dataset of {n} records")
        with self._lock:
            have = {i: self._memo[i] for i in idx if i in self._memo}
        missing = [i for i in idx if i not in have]
        if missing and os.getpid() != self._owner:
            have.update(self._spill.read(missing))
            missing = [i for i in idx if i not in have]
        if missing:
            have.update(self._tokenize(missing))
        return [have[i] for i in idx]

    def __getitems__(self, indices) -> list[dict]:
        return [{"input_ids": ids, "loss_mask": mask} for ids, mask in self._records(indices)]

    def lengths(self, indices) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"record index out of range for a dataset of {len(self)} records")
        unknown = np.unique(idx[self._lengths[idx] < 0]).tolist()
        if unknown:
            fresh = self._tokenize(unknown)
            # Handed over only where a worker could read it: with num_workers=0 the memo serves.
            if os.getpid() == self._owner and multiprocessing.active_children():
                self._spill.write(fresh)
        return self._lengths[idx].copy()

    # --- tokenizing ahead in the loader's workers (engine/ahead.py) ------------------------------

    def unknown(self, indices) -> np.ndarray:
        """The distinct ``indices`` whose length this process does not know yet, ascending."""
        idx = np.unique(np.asarray(indices, dtype=np.int64))
        return idx[self._lengths[idx] < 0]

    def tokenize_ahead(self, indices: np.ndarray, name: str) -> np.ndarray:
        """(In a loader worker) tokenize ``indices``, hand their records over as file ``name``, and
        return their lengths, for the planner in the main process.

        Example:
            >>> from portable_loader.precache import sample_args
            >>> worker_ds = tokenized(**sample_args())   # in a worker: the loader's dataset, forked
            >>> worker_ds.tokenize_ahead(np.array([4, 9]), "w0-p1")
            array([34, 17])
            >>> worker_ds.drop_handover()                # (in the main process, once served)
        """
        records = self._records(indices)
        self._spill.write(dict(zip(np.asarray(indices).tolist(), records)), name)
        return np.array([ids.size for ids, _ in records], dtype=np.int64)

    def learn(self, indices: np.ndarray, lengths: np.ndarray) -> None:
        """(In the main process) take lengths a worker computed for ``indices``."""
        self._lengths[np.asarray(indices, dtype=np.int64)] = lengths

    def drop_handover(self, name: str | None = None) -> None:
        """Remove the hand-over file ``name`` (a window already served), or every file (a loader closed)."""
        if name is None:
            self._spill.clear()
        else:
            self._spill.drop(name)

    def validate(self) -> dict:
        """Tokenize the whole input once, in order: the first bad row raises (naming file and line).

        Returns the counts a precache run reports: ``rows_in``, ``rows_out``, ``dropped``,
        ``truncated``, ``tokens``, ``trainable_tokens``. Afterwards every length is known.

        Example:
            >>> from portable_loader.precache import sample_args
            >>> counts = tokenized(**sample_args()).validate()   # the counts precache reports for the sample
            >>> counts["rows_out"], counts["dropped"], counts["tokens"]
            (2000, {}, 73528)
        """
        fmt = self._formatter()
        before, truncated_before = Counter(self.dropped), fmt.truncated
        tokens = trainable = 0
        for at in range(0, len(self), _ENCODE_ROWS):
            part = list(range(at, min(len(self), at + _ENCODE_ROWS)))
            records = self._tokenize(part)
            for ids, mask in records.values():
                tokens += ids.size
                trainable += int(mask.sum())
        dropped = self.dropped - before
        return {
            "rows_in": len(self),
            "rows_out": len(self) - sum(dropped.values()),
            "dropped": dict(sorted(dropped.items())),
            "truncated": fmt.truncated - truncated_before,
            "tokens": tokens,
            "trainable_tokens": trainable,
        }
