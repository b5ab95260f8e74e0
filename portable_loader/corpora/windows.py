"""Concatenate and chunk: documents back to back, cut into windows of exactly ``seq_len`` tokens.

``DataLoader(packing="concat")`` reads a dataset through :func:`concat_windows`: window ``k`` is
tokens ``[k * seq_len, (k + 1) * seq_len)`` of the documents' concatenation (storage order), the
tail shorter than one window is left out, and the loader's keyed sampler orders the windows as it
orders any records (an LCG over window indices, a fresh order each epoch): every row is full, no
token is padding, and the state is the number of windows served. No per-window index exists: a
window's tokens are a slice of the stream and its document boundaries come from the ``.idx``
(Megatron), from the EOS tokens inside it (numpy, flat), or from the documents' cumulative lengths
(any other dataset of token records, computed once: 8 bytes a document).

In a window's row, ``segment_ids`` count 1, 2, ... and change exactly where a document starts;
``positions`` restart at 0 at each document start and at the row's start (a document continued from
the window before is a segment of its own: attention never reaches the part in another row, so its
positions restart as a split record's do when packing).

Example:
    >>> import numpy as np, portable_loader as pl
    >>> np.array([1, 2, 0, 3, 4, 5, 0, 6, 7], np.uint16).tofile("corpus.bin")
    >>> w = concat_windows(pl.pretokenized("corpus.bin", eos_token_id=0), seq_len=4)
    >>> len(w), w[1]["input_ids"].tolist(), w[1]["segment_ids"].tolist(), w[1]["positions"].tolist()
    (2, [4, 5, 0, 6], [1, 1, 1, 2], [0, 1, 2, 0])
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from portable_loader.collate import _CHECKED, _RAMPS, _RUN_MAX, _RUNS, FIELDS, _ramp, _runs, check_fields, check_token_records, new_fields
from portable_loader.dataset.base import Dataset, as_indices

__all__ = ["ConcatWindows", "RecordStream", "concat_windows"]


def concat_windows(dataset, seq_len: int) -> Dataset:
    """``dataset``'s documents as windows of ``seq_len`` tokens; a mixture's sources each cut alike.

    A mixture (``pl.mix``) stays a mixture of the same weights over its sources' windows: every
    window holds ``seq_len`` tokens, so a window share is a token share (Megatron's blend of
    ``--data-path 0.3 A 0.7 B``), whichever ``unit`` the mixture was built with.

    Example:
        >>> import numpy as np
        >>> docs = [{"input_ids": np.arange(1, 4)}, {"input_ids": np.arange(4, 9)}]
        >>> [r["input_ids"].tolist() for r in concat_windows(docs, 3)]
        [[1, 2, 3], [4, 5, 6]]
    """
    from portable_loader.dataset.mix.mixture import Mix
    from portable_loader.dataset.sources import source

    ds = source(dataset)
    if isinstance(ds, ConcatWindows):
        if ds.seq_len != seq_len:
            raise ValueError(f"packing='concat': the dataset is already cut into windows of {ds.seq_len} tokens, "
                             f"not seq_len={seq_len}")
        return ds
    if isinstance(ds, Mix):
        return ds.rebuilt([concat_windows(c, seq_len) for c in ds.children], unit="records")
    return ConcatWindows(ds, seq_len)


class RecordStream:
    """Any dataset of token records as a token stream (``TokenStream``'s ``read``), by cumulative lengths.

    Example:
        >>> import numpy as np
        >>> s = RecordStream(Dataset.source([{"input_ids": np.arange(3)}, {"input_ids": np.arange(2)}]))
        >>> tokens, mask, starts = s.read(1, 5)
        >>> tokens.tolist(), mask.tolist(), starts.tolist()
        ([1, 2, 0, 1], [1, 1, 1, 1], [2])
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        n = len(dataset)
        lengths = np.zeros(n + 1, dtype=np.int64)
        for lo in range(0, n, 1 << 16):
            lengths[lo + 1 : min(n, lo + (1 << 16)) + 1] = dataset.lengths(np.arange(lo, min(n, lo + (1 << 16))))
        self.offsets = np.cumsum(lengths)
        self.num_tokens = int(self.offsets[-1])

    eos = None  # documents end where the records do

    def windows(self, los, length: int, scan: bool = True) -> tuple[list, list, list]:
        """``read`` of each window ``[lo, lo + length)``: (tokens, loss masks, document starts), as a
        token stream's ``windows`` gives them."""
        got = [self.read(lo, lo + length, scan) for lo in los]
        return [g[0] for g in got], [g[1] for g in got], [g[2] for g in got]

    def read(self, lo: int, hi: int, scan: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a = int(np.searchsorted(self.offsets, lo, side="right")) - 1
        b = int(np.searchsorted(self.offsets, hi, side="left"))
        ids = np.arange(a, b, dtype=np.int64)
        records = self.dataset.__getitems__(ids)
        check_token_records(ids, records)
        tokens, masks = [], []
        for i, r in zip(ids.tolist(), records):
            s = max(lo, int(self.offsets[i])) - int(self.offsets[i])
            e = min(hi, int(self.offsets[i + 1])) - int(self.offsets[i])
            t = np.asarray(r["input_ids"])[s:e]
            m = r.get("loss_mask")
            tokens.append(t)
            masks.append(np.ones(t.size, np.uint8) if m is None else np.asarray(m, dtype=np.uint8)[s:e])
        starts = self.offsets[a + 1 : b] - lo
        return np.concatenate(tokens), np.concatenate(masks), np.unique(starts[starts > 0])


class ConcatWindows(Dataset):
    """Windows of ``seq_len`` tokens over a dataset's concatenated documents (see the module docstring).

    Records are ``{"input_ids", "segment_ids", "positions"}`` (and ``loss_mask`` where the documents
    carry one) of ``seq_len`` tokens each; ``collate_rows`` fills a loader's batch straight from the
    stream.

    Example:
        >>> import numpy as np
        >>> w = ConcatWindows(Dataset.source([{"input_ids": np.arange(5)}] * 3), seq_len=4)
        >>> len(w), w.lengths([0, 2]).tolist()
        (3, [4, 4])
    """

    cheap_lengths = True

    def __init__(self, parent: Dataset, seq_len: int):
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise ValueError(f"seq_len must be an integer >= 1, got {seq_len!r}")
        self.parent, self.seq_len = parent, int(seq_len)
        self.stream = parent.stream() if parent.stream is not None else RecordStream(parent)
        self._n = self.stream.num_tokens // self.seq_len
        if self._n < 1:
            raise ValueError(f"packing='concat': seq_len {self.seq_len} is larger than the whole corpus "
                             f"({self.stream.num_tokens} tokens): not one window")

    def __len__(self) -> int:
        return self._n

    def _check(self, idx: np.ndarray) -> None:
        if idx.size and (idx.min() < 0 or idx.max() >= self._n):
            bad = int(idx[(idx < 0) | (idx >= self._n)][0])
            raise IndexError(f"window {bad} is out of range: the corpus holds {self._n} windows of {self.seq_len} tokens")

    def __getitems__(self, indices) -> list:
        idx = as_indices(indices)
        self._check(idx)
        batch = self.collate_rows([[(int(w), 0, self.seq_len)] for w in idx.tolist()], self.seq_len, 0,
                                  ("input_ids", "loss_mask", "segment_ids", "positions"))
        out = []
        for r in range(idx.size):
            rec = {"input_ids": batch["input_ids"][r], "segment_ids": batch["segment_ids"][r],
                   "positions": batch["positions"][r]}
            if self._masked:
                rec["loss_mask"] = batch["loss_mask"][r]
            out.append(rec)
        return out

    @property
    def _masked(self) -> bool:
        return isinstance(self.stream, RecordStream)

    def lengths(self, indices) -> np.ndarray:
        idx = as_indices(indices)
        self._check(idx)
        return np.full(idx.size, self.seq_len, dtype=np.int64)

    def collate_rows(self, rows: Sequence[Sequence[tuple]], seq_len: int, pad_id: int = 0,
                     fields: Sequence[str] = FIELDS) -> dict[str, np.ndarray]:
        """The batch of ``rows`` (each ``[(window, 0, seq_len)]``, or ``[]``: a padding row past a finite stream's end).

        Segment numbers and positions go in by memoryview slice copies from ready runs and ramps, a
        copy per document piece (as ``collate_spans`` does: a numpy fill costs five times more); the
        starts after EOS tokens are found for the whole batch in one pass.

        Example:
            >>> import numpy as np
            >>> w = ConcatWindows(Dataset.source([{"input_ids": np.arange(1, 4)}] * 2), seq_len=2)
            >>> w.collate_rows([[(1, 0, 2)], []], 2, fields=("input_ids", "segment_ids"))["segment_ids"].tolist()
            [[1, 2], [0, 0]]
        """
        if seq_len != self.seq_len:
            raise ValueError(f"these windows hold {self.seq_len} tokens, not seq_len={seq_len}")
        fields = fields if fields in _CHECKED else check_fields(fields)
        rows = rows if type(rows) is list else list(rows)  # indexed per row below: a plain list's lookups
        n, L = len(rows), self.seq_len
        full = [r for r, row in enumerate(rows) if row]
        # Every element of a batch of full rows is written below: only padding rows need the fill.
        out = new_fields(n, L, pad_id, fields, fill=len(full) < n)
        ids = out["input_ids"]
        lm, att = out.get("loss_mask"), out.get("attention_mask")
        cut = "segment_ids" in out or "positions" in out
        eos = self.stream.eos if cut else None
        got, masks, found = self.stream.windows([rows[r][0][0] * L for r in full], L, eos is None)
        starts: list = [None] * n
        masked, unmasked = False, []
        for r, tokens, mask, at in zip(full, got, masks, found):
            ids[r] = tokens
            if lm is not None:
                if mask is not None:
                    lm[r] = mask
                    masked = True
                else:
                    unmasked.append(r)
            starts[r] = at
        if masked and unmasked:  # windows of a stream without masks, beside masked ones: none of their tokens count
            lm[unmasked] = 0
        for name, values in (("attention_mask", att), ("loss_mask", None if masked else lm)):
            if values is not None:  # one fill for the batch
                if len(full) == n:
                    values.fill(1)
                else:
                    values[full] = 1
        if cut:
            if eos is not None:  # every EOS but a row's last token starts a document
                hits = np.flatnonzero(ids.reshape(-1) == eos) + 1
                cuts = np.searchsorted(hits, np.arange(1, n + 1) * L).tolist()
                hits, a = hits.tolist(), 0
                for r, b in enumerate(cuts):
                    if starts[r] is not None:
                        mine = [h - r * L for h in hits[a:b] if h % L]  # (an EOS last in the row starts none)
                        starts[r] = np.union1d(starts[r], mine) if starts[r].size else mine
                    a = b
            _segments(out.get("segment_ids"), out.get("positions"), starts, L)
        return out

    def _identity(self) -> tuple:
        return ("concat", self.parent.fingerprint(), self.seq_len)

    def __repr__(self) -> str:
        return f"ConcatWindows({len(self)} x {self.seq_len} tokens; fingerprint={self.fingerprint()})"


def _segments(seg, pos, starts: list, length: int) -> None:
    """Segment numbers and positions of each row, a document starting at each of its ``starts``."""
    seg_mv = memoryview(seg.reshape(-1)) if seg is not None else None
    pos_mv = memoryview(pos.reshape(-1)) if pos is not None else None
    runs = (_RUNS.get(length) or _runs(length)) if seg is not None else None
    ramp = (_RAMPS.get(length) or _ramp(length)) if pos is not None else None
    limit = _RUN_MAX * length
    for r, at in enumerate(starts):
        if at is None:
            continue
        base, number, a = r * length, 0, 0
        for b in (at.tolist() if isinstance(at, np.ndarray) else at) + [length]:
            if b <= a:  # an empty document starts where the next does
                continue
            number += 1
            if seg_mv is not None:
                k = number * length
                if k < limit:
                    seg_mv[base + a : base + b] = runs[k : k + b - a]
                else:  # more documents in a row than the runs cover
                    seg[r, a:b] = number
            if pos_mv is not None:
                pos_mv[base + a : base + b] = ramp[: b - a]
            a = b
