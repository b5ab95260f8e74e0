"""``mix(sources, weights)``: a weighted mixture of datasets that holds its weights exactly.

The mixture is a dataset whose index space is its sources concatenated (``ds[offset_i + r]`` is
record ``r`` of source ``i``), and which brings its own stream order (``stream_order``): the loader
serves it instead of shuffling on top, since a shuffle would undo the per-block counts. The
arithmetic is in :mod:`portable_loader.dataset.mix.order`; docs/mixing.md states the guarantees.

Weights are exact rationals: ints and ``Fraction``\\ s as they are, floats by their shortest decimal
(``0.1`` is 1/10), so the counts never depend on float rounding. A source left out of a stage's
weights has weight 0 in that stage.

Example:
    >>> import numpy as np
    >>> from portable_loader.dataset import source
    >>> a = source([{"input_ids": np.arange(2)}] * 3)
    >>> b = source([{"input_ids": np.arange(5)}] * 10)
    >>> m = mix({"a": a, "b": b}, {"a": 1, "b": 3})
    >>> len(m), m.lengths([0, 3]).tolist(), m.locate([0, 3])
    (13, [2, 5], [('a', 0), ('b', 0)])
    >>> src, _ = m.stream_order(0).sources_at(np.arange(256))
    >>> np.bincount(src).tolist()
    [64, 192]
"""

from __future__ import annotations

import bisect
import copy
import math
import numbers
from fractions import Fraction
from typing import Mapping, Sequence

import numpy as np

from portable_loader.collate import FIELDS, collating_into, new_fields
from portable_loader.cache.readers import KEEP_SPANS_MAX, Spans, join_spans, kept_spans, spans_of
from portable_loader.dataset.base import Dataset, digest
from portable_loader.dataset.mix.order import MixOrder, Stage, name_key

__all__ = ["DEFAULT_BLOCK", "Mix", "mix"]

#: Block size when ``block=None``: raised to ``ceil(1 / smallest nonzero weight)`` where that is larger.
DEFAULT_BLOCK = 256
_ARITHMETIC = 2  # the mixture arithmetic's version, in the fingerprint (see _identity)
_LENGTH_SAMPLE = 4096  # records whose lengths estimate a mean length when no manifest has it
_FEW = 64  # up to this many indices are grouped by source in plain Python


def mix(sources: Mapping[str, object], weights, *, unit: str = "records", block: int | None = None) -> "Mix":
    """A weighted mixture of ``sources`` (name -> dataset, cache, sequence or another mix).

    ``weights``: ``{name: weight}``, or a schedule ``[(start, {name: weight}), ...]`` whose first stage
    starts at record 0 and whose stages take effect at the first block boundary at or after their
    ``start`` (a position in the mixed stream, counted in records). ``unit="tokens"`` reads the weights
    as token shares (each source's record weight is its token weight over its mean record length).
    ``block``: the records per block, at whose boundaries every source's count is within one record
    of its share; default ``max(256, ceil(1 / smallest nonzero weight))``.

    Example:
        >>> import numpy as np
        >>> web = [{"input_ids": np.arange(3)}] * 50
        >>> m = mix({"web": web, "code": web[:5]}, [(0, {"web": 1}), (100, {"web": 1, "code": 1})], block=10)
        >>> [s.start for s in m.stages], [s.block for s in m.stages]
        ([0, 100], [10, 10])
    """
    return Mix(sources, weights, unit=unit, block=block)


class Mix(Dataset):
    """A mixture built by :func:`mix`: sources concatenated, a schedule of exact record weights.

    ``stages`` are the effective stages; ``describe``-style lookups go through ``locate``. Its
    fingerprint covers the sources, their names and the unit (and mean lengths for ``unit="tokens"``)
    but not the schedule: a loader state carries the digests of the stages it has used, so a
    schedule may gain stages after the saved position (see :meth:`schedule_digests`).

    Example:
        >>> import numpy as np
        >>> m = Mix({"x": [{"input_ids": np.arange(4)}], "y": [{"input_ids": np.arange(1)}] * 2}, {"x": 1, "y": 1})
        >>> m[2]["input_ids"].tolist(), m.stages[0].block
        ([0], 256)
    """

    def __init__(self, sources, weights, *, unit: str = "records", block: int | None = None):
        from portable_loader.dataset.sources import source

        if not isinstance(sources, Mapping) or not sources:
            raise ValueError(f"mix() takes a non-empty dict of name -> source, got {type(sources).__name__}")
        if unit not in ("records", "tokens"):
            raise ValueError(f"mix(unit=...) must be 'records' or 'tokens', got {unit!r}")
        if block is not None and (isinstance(block, bool) or not isinstance(block, numbers.Integral) or block < 1):
            raise ValueError(f"mix(block=...) must be None or an integer >= 1, got {block!r}")
        names, children = [], []
        for name, obj in sources.items():
            if not isinstance(name, str) or not name or "/" in name:
                raise ValueError(f"mix(): source names must be non-empty strings without '/', got {name!r}")
            ds = source(obj)
            if len(ds) < 1:
                raise ValueError(f"mix(): source {name!r} is empty")
            names.append(name)
            children.append(ds)
        self.names, self.children, self.unit = tuple(names), tuple(children), unit
        self.block = None if block is None else int(block)
        self.offsets = np.concatenate([[0], np.cumsum([len(c) for c in children])]).astype(np.int64)
        self._offset_list = self.offsets.tolist()
        self.mean_lengths = tuple(_mean_length(c, n) for n, c in zip(names, children)) if unit == "tokens" else None
        self.weights = weights  # as given: rebuilt() makes the same mixture over other sources
        self.stages = self._stages(weights)
        self.cheap_lengths = all(c.cheap_lengths for c in children)
        self.filters = tuple(f"{n}: {f}" for n, c in zip(names, children) for f in c.filters)
        self._flat = not any(c.locate is not None for c in children)  # no nested mix: locate needs no recursion
        self.fork_hazard = next((c.fork_hazard for c in children if c.fork_hazard), None)
        # The loader's workers tokenize packing windows ahead when any source tokenizes on read.
        self.tokenizes_ahead = any(c.tokenizes_ahead for c in children)
        self._spans_ok = all(c.spans is not None for c in children)
        self._span_at: tuple | None = None  # see _span_readers
        self._one_batch: tuple | None = None  # see _one_batch_offsets
        self._sized: tuple[np.ndarray, Spans] | None = None  # (records, their Spans) of the last large call

    # --- the schedule ---------------------------------------------------------------------------

    def _stages(self, weights) -> tuple[Stage, ...]:
        if isinstance(weights, Mapping):
            weights = [(0, weights)]
        if not isinstance(weights, Sequence) or isinstance(weights, (str, bytes)) or not weights:
            raise ValueError(
                "mix(weights=...) takes {name: weight} or a non-empty list of (start_record, {name: weight}), "
                f"got {type(weights).__name__}"
            )
        stages: list[Stage] = []
        base = (0,) * len(self.names)
        prev_start = None
        for k, item in enumerate(weights):
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise ValueError(
                    f"mix(): schedule stage {k} must be a pair (start_record, {{name: weight}}), got {item!r}"
                )
            start, w = item
            if isinstance(start, bool) or not isinstance(start, numbers.Integral) or start < 0:
                raise ValueError(f"mix(): schedule stage {k} start must be an integer >= 0, got {start!r}")
            start = int(start)
            if k == 0 and start != 0:
                raise ValueError(f"mix(): the first schedule stage must start at record 0, got {start}")
            if prev_start is not None and start <= prev_start:
                raise ValueError(
                    f"mix(): schedule stages out of order: stage {k} starts at record {start}, "
                    f"not after stage {k - 1} (record {prev_start})"
                )
            prev_start = start
            nums, den = self._record_weights(w, f"stage {k}" if len(weights) > 1 else "weights")
            if stages:  # the stage takes effect at the previous stage's next block boundary
                last = stages[-1]
                blocks = -(-(start - last.start) // last.block)
                if blocks <= 0:
                    raise ValueError(
                        f"mix(): schedule stage {k} starts at record {start}, not after stage {k - 1}, which "
                        f"takes effect at record {last.start} (its start rounded up to a block of {last.block})"
                    )
                base = tuple(x + y for x, y in zip(last.base, last.counts(blocks)))
                start = last.start + blocks * last.block
            stages.append(Stage(start, self._block_for(nums, den, k), nums, den, base))
        return tuple(stages)

    def _record_weights(self, w, where: str) -> tuple[tuple[int, ...], int]:
        """Exact record weights as integer numerators over a common denominator."""
        if not isinstance(w, Mapping):
            raise ValueError(f"mix(): {where} must be a dict of name -> weight, got {type(w).__name__}")
        unknown = [n for n in w if n not in self.names]
        if unknown:
            raise ValueError(
                f"mix(): {where} names {unknown[0]!r}, which is not a source (sources: {', '.join(self.names)})"
            )
        fracs = []
        for name in self.names:
            x = _fraction(w.get(name, 0), f"{where} weight of {name!r}")
            if self.mean_lengths is not None:
                x = x / self.mean_lengths[self.names.index(name)]
            fracs.append(x)
        total = sum(fracs)
        if total == 0:
            raise ValueError(f"mix(): {where} has all weights zero: at least one source needs a positive weight")
        fracs = [x / total for x in fracs]
        den = math.lcm(*(x.denominator for x in fracs))
        return tuple(int(x * den) for x in fracs), den

    def _block_for(self, nums: tuple[int, ...], den: int, k: int) -> int:
        # K * w_i >= 1 for every drawn source keeps each source's cumulative count from going backwards
        # (largest-remainder rounding is otherwise not monotone: the Alabama paradox).
        smallest = min(a for a in nums if a)
        need = -(-den // smallest)
        if self.block is None:
            return max(DEFAULT_BLOCK, need)
        if self.block < need:
            i = nums.index(smallest)
            raise ValueError(
                f"mix(block={self.block}) is too small for stage {k}: source {self.names[i]!r} has record weight "
                f"{Fraction(smallest, den)}, so the block must be >= {need} (every source with a nonzero weight "
                "needs a record per block, or its count could go backwards)"
            )
        return self.block

    def source_groups(self) -> tuple[tuple[str, ...], np.ndarray]:
        """(source names, where each starts in the index space, plus the end): what the loader counts by."""
        return self.names, self.offsets

    def _stage_digest(self, st: Stage) -> str:
        return digest("stage", st.start, st.block, self.names, st.nums, st.den)[:8]

    def schedule_digests(self, position: int | None = None) -> list[str]:
        """Short digests of the stages that shaped the stream before ``position`` (all when None).

        A loader state stores them: those stages must match on resume, later ones may differ.

        Example:
            >>> import numpy as np
            >>> m = mix({"a": [{"input_ids": np.arange(1)}]}, [(0, {"a": 1}), (512, {"a": 2})])
            >>> len(m.schedule_digests(0)), len(m.schedule_digests(512)), len(m.schedule_digests(513))
            (0, 1, 2)
        """
        return [self._stage_digest(st) for st in self.stages if position is None or st.start < position]

    def schedule_change(self, saved: list, position: int) -> str | None:
        """Why a state whose stages had ``saved`` digests cannot resume at ``position``; None if it can."""
        mine = self.schedule_digests(position)
        for k, (a, b) in enumerate(zip(saved, mine)):
            if a != b:
                st = self.stages[k]
                return (f"schedule stage {k} differs from the one the state was saved with (now: start {st.start}, "
                        f"block {st.block}, weights {self._weights_text(st)}); stages before the saved position "
                        f"{position} must stay as they were")
        if len(saved) != len(mine):
            return (f"the state was saved at position {position} after {len(saved)} schedule stage(s) had begun; "
                    f"this schedule has {len(mine)} stage(s) starting before it: stages before the saved position "
                    "must stay as they were (appending stages after it is fine)")
        return None

    def _weights_text(self, st: Stage) -> str:
        return "{" + ", ".join(f"{n!r}: {Fraction(a, st.den)}" for n, a in zip(self.names, st.nums)) + "}"

    # --- the dataset protocol -------------------------------------------------------------------

    @property
    def format(self) -> str | None:
        formats = {c.format for c in self.children}
        return formats.pop() if len(formats) == 1 else None

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _groups(self, indices) -> tuple[int, list]:
        """(count, [(source, where in ``indices``, records of that source)]) for the sources present.

        A batch's few indices are grouped in plain Python (a handful of numpy calls would cost
        more than the lookups), a chunk's thousands with numpy.
        """
        if isinstance(indices, np.ndarray) and indices.size > _FEW:
            idx = indices.astype(np.int64, copy=False).reshape(-1)
            if idx.min() < 0 or idx.max() >= len(self):
                bad = int(idx[(idx < 0) | (idx >= len(self))][0])
                raise IndexError(f"mixture index {bad} is out of range [0, {len(self)})")
            src = np.searchsorted(self.offsets, idx, side="right") - 1
            order = np.argsort(src, kind="stable")
            ends = np.cumsum(np.bincount(src, minlength=len(self.children))).tolist()
            groups, lo = [], 0
            for i, hi in enumerate(ends):
                if hi > lo:
                    groups.append((i, order[lo:hi], idx[order[lo:hi]] - self.offsets[i]))
                lo = hi
            return idx.size, groups
        values = indices.tolist() if isinstance(indices, np.ndarray) else list(indices)
        offsets, total, found = self._offset_list, self._offset_list[-1], {}
        for j, x in enumerate(values):
            if not 0 <= x < total:
                raise IndexError(f"mixture index {x} is out of range [0, {total})")
            i = bisect.bisect_right(offsets, x) - 1
            group = found.get(i)
            if group is None:
                found[i] = group = ([], [])
            group[0].append(j)
            group[1].append(x - offsets[i])
        return len(values), [(i, w, np.array(r, dtype=np.int64)) for i, (w, r) in sorted(found.items())]

    def __getitems__(self, indices) -> list:
        n, groups = self._groups(indices)
        if len(groups) == 1:
            return list(self.children[groups[0][0]].__getitems__(groups[0][2]))
        out: list = [None] * n
        for i, where, rec in groups:
            for w, r in zip(where, self.children[i].__getitems__(rec)):
                out[w] = r
        return out

    def per_source(self, method: str, indices) -> tuple[int, list]:
        """(count, [(where in ``indices``, the answer of ``method``)]): the batched call ``method``
        made once per source present, with that source's own record numbers; joining the answers
        is the caller's (each capability joins its own way: :func:`join_spans` for ``spans``).

        Example:
            >>> import numpy as np
            >>> m = mix({"a": [{"input_ids": np.arange(2)}] * 3, "b": [{"input_ids": np.arange(5)}]}, {"a": 1, "b": 1})
            >>> n, parts = m.per_source("lengths", [3, 0, 2])
            >>> n, [(where, answer.tolist()) for where, answer in parts]
            (3, [([1, 2], [2, 2]), ([0], [5])])
        """
        n, groups = self._groups(indices)
        return n, [(where, getattr(self.children[i], method)(rec)) for i, where, rec in groups]

    @property
    def spans(self):
        """``spans(indices)``: where the records' tokens lie (a :class:`~portable_loader.cache.readers.Spans`),
        each source asked once for its records and the answers joined in the order asked: the
        loader's fast path, as over a single cache. Only when every source has ``spans`` (caches,
        nested mixes of caches); otherwise None and the loader collates records.

        Example:
            >>> import portable_loader as pl
            >>> from portable_loader.precache import sample_args
            >>> chat = pl.open_cache(pl.precache(**sample_args(), out="cache"))
            >>> m = mix({"a": chat, "b": chat}, {"a": 1, "b": 1})
            >>> m.spans([2000, 1, 2004]).length == m.lengths([2000, 1, 2004]).tolist()
            True
            >>> mix({"a": chat, "b": [{"input_ids": np.arange(3)}]}, {"a": 1, "b": 1}).spans is None
            True
        """
        return self._spans if self._spans_ok else None

    def _spans(self, indices) -> Spans:
        kept = kept_spans(self._sized, indices)  # the records of the last large call: a window sized, then read
        if kept is not None:
            return kept
        at, local = self._span_readers()
        spans = self._located(at, indices)
        if local and type(indices) is np.ndarray and _FEW < indices.size <= KEEP_SPANS_MAX:
            # kept for a lengths() or spans() call with the same records (local caches only: a
            # remote one's spans would hold shard buffers beyond its cache limit)
            self._sized = (indices.copy(), spans)
        return spans

    def _located(self, at: list, indices) -> Spans:
        """``spans`` of ``indices`` located now (``at``: each source's ``span_at``, or None)."""
        if type(indices) is np.ndarray and indices.size <= _FEW * len(at) and None not in at:
            return self._spans_in_order(at, indices.astype(np.int64, copy=False).reshape(-1))
        n, groups = self._groups(indices)
        # A source with few records in the call (60 sources share a window of 1,024) is located
        # record by record: a spans call's fixed costs, paid per source, were most of a window's.
        parts = [(where, _spans_at(at[i], rec.tolist()) if at[i] is not None and rec.size <= _FEW
                  else self.children[i].spans(rec)) for i, where, rec in groups]
        if len(parts) == 1:  # one source: its answer is already in the order asked
            return parts[0][1]
        return join_spans(n, parts)

    def _spans_in_order(self, at: list, idx: np.ndarray) -> Spans:
        """``spans`` of ``idx`` when every source is a local Arrow cache and has few of them on
        average: each record located by its source's ``span_at`` in the order asked, so neither
        grouping by source nor joining the answers (a third of a 60-source window's cost)."""
        if not idx.size:
            return Spans([], [], [], [], [], [])
        if idx.min() < 0 or idx.max() >= len(self):
            bad = int(idx[(idx < 0) | (idx >= len(self))][0])
            raise IndexError(f"mixture index {bad} is out of range [0, {len(self)})")
        src = np.searchsorted(self.offsets, idx, side="right") - 1
        flat = self._one_batch_offsets(at)
        if flat is not None and idx.size > _FEW:
            return _spans_by_source(flat, src, idx - self.offsets[src])
        return spans_of([at[i](r) for i, r in zip(src.tolist(), (idx - self.offsets[src]).tolist())])

    def _one_batch_offsets(self, at: list) -> list | None:
        """Each source's ``(ids buffer, mask buffer, offsets)`` where every source is an Arrow cache
        written in one record batch (a window's records then locate in a numpy gather per source,
        not a ``span_at`` call per record); else None."""
        got = self._one_batch
        if got is None or got[0] is not self.children:
            readers = [getattr(a, "__self__", None) for a in at]
            one = all(r is not None and len(getattr(r, "_offsets", ())) == 1 for r in readers)
            flat = [(r._ids_bytes[0], r._mask_bytes[0], r._offsets[0]) for r in readers] if one else None
            got = self._one_batch = (self.children, flat)
        return got[1]

    def _span_readers(self) -> tuple[list, bool]:
        """(each source's ``span_at`` where it is a local Arrow cache, else None; whether every source
        is one, or a mix of them only), worked out once per set of children (``reopen`` makes new ones)."""
        got = self._span_at
        if got is None or got[0] is not self.children:
            from portable_loader.dataset.sources import Cache

            # (a reader that trims read-ahead, a remote one, is not local)
            at = [getattr(c.cache, "span_at", None) if type(c) is Cache and getattr(c.cache, "read_ahead", None) is None
                  else None for c in self.children]
            local = all(a is not None or (isinstance(c, Mix) and c._span_readers()[1]) for a, c in zip(at, self.children))
            got = self._span_at = (self.children, at, local)
        return got[1], got[2]

    @property
    def read_ahead(self):
        """``read_ahead(now, ahead)``: the records of ``ahead`` worth reading with ``now``'s, each
        source deciding over its own (a remote cache keeps within its ``cache_limit``); there
        with ``spans``, whose read-ahead it bounds, and where a source may narrow it (None over
        local caches only: they read ahead whatever they are given).

        Example:
            >>> import portable_loader as pl
            >>> from portable_loader.precache import sample_args
            >>> chat = pl.open_cache(pl.precache(**sample_args(), out="cache"))
            >>> mix({"a": chat, "b": chat}, {"a": 1, "b": 1}).read_ahead is None   # local caches
            True
        """
        return self._read_ahead if self._spans_ok and not self._span_readers()[1] else None

    def _read_ahead(self, now: np.ndarray, ahead: np.ndarray) -> np.ndarray:
        _, now_groups = self._groups(now)
        now_of = {i: rec for i, _, rec in now_groups}
        keep = None
        for i, where, rec in self._groups(ahead)[1]:
            trim = self.children[i].read_ahead
            kept = rec if trim is None else trim(now_of.get(i, rec[:0]), rec)
            if kept is not rec and kept.size < rec.size:  # a local cache hands back what it was given
                if keep is None:
                    keep = np.ones(ahead.size, dtype=bool)
                keep[where] = np.isin(rec, kept)
        return ahead if keep is None else ahead[keep]

    @property
    def collate_rows(self):
        """``collate_rows(rows, seq_len, pad_id, fields)``: a batch of windows (``packing="concat"``),
        each source filling the rows of its own windows; there when every source has it (else None).

        Example:
            >>> from portable_loader.corpora.windows import concat_windows
            >>> m = concat_windows(mix({"a": [{"input_ids": np.arange(1, 9)}], "b": [{"input_ids": np.arange(9, 13)}]},
            ...                        {"a": 1, "b": 1}), 4)
            >>> m.collate_rows([[(2, 0, 4)], [(0, 0, 4)]], 4, fields=("input_ids", "attention_mask"))["input_ids"].tolist()
            [[9, 10, 11, 12], [1, 2, 3, 4]]
        """
        return self._collate_rows if all(c.collate_rows is not None for c in self.children) else None

    def _collate_rows(self, rows, seq_len: int, pad_id: int = 0, fields=None) -> dict[str, np.ndarray]:
        rows = rows if type(rows) is list else list(rows)  # indexed per row below: a plain list's lookups
        full = [r for r, row in enumerate(rows) if row]
        parts = []
        with collating_into(None):  # the parts in memory of their own: the batch is what a worker's block holds
            for i, where, rec in self._groups([rows[r][0][0] for r in full])[1]:
                part = self.children[i].collate_rows([[(w, 0, seq_len)] for w in rec.tolist()], seq_len, pad_id, fields)
                parts.append((np.asarray(full)[where], part))
        if not parts:
            return new_fields(len(rows), seq_len, pad_id, fields or FIELDS)
        out = new_fields(len(rows), seq_len, pad_id, tuple(parts[0][1]))
        for at, part in parts:
            for name, values in part.items():
                out[name][at] = values
        return out

    def lengths(self, indices) -> np.ndarray:
        if self._spans_ok and type(indices) is np.ndarray and _FEW < indices.size <= KEEP_SPANS_MAX \
                and self._span_readers()[1]:
            # Local caches only (a remote one would fetch shards to size them): a loader sizes a
            # packing window (or a chunk) and reads the same records, so their spans answer both.
            return np.array(self._spans(indices).length, dtype=np.int64)
        n, groups = self._groups(indices)
        out = np.empty(n, dtype=np.int64)
        for i, where, rec in groups:
            out[where] = self.children[i].lengths(rec)
        return out

    # --- tokenizing ahead in the loader's workers (engine/ahead.py) ------------------------------
    # Each call goes to the sources that tokenize ahead with their own record numbers; the others
    # (caches, lists) know every length and report nothing unknown.

    def unknown(self, indices) -> np.ndarray:
        """The distinct ``indices`` whose length is not known yet (records of sources that tokenize
        on read, ``pl.tokenized``), ascending.

        Example:
            >>> import portable_loader as pl
            >>> from portable_loader.precache import sample_args
            >>> m = mix({"chat": pl.tokenized(**sample_args()), "list": [{"input_ids": np.arange(3)}] * 5}, {"chat": 1, "list": 1})
            >>> m.tokenizes_ahead, m.unknown([2001, 7, 2000, 7]).tolist()   # 2000 on: the list's records
            (True, [7])
        """
        idx = np.unique(np.asarray(indices, dtype=np.int64))
        found = [self.children[i].unknown(rec) + self.offsets[i] for i, _, rec in self._groups(idx)[1]
                 if self.children[i].tokenizes_ahead]
        return np.concatenate(found) if found else idx[:0]

    def tokenize_ahead(self, indices: np.ndarray, name: str) -> np.ndarray:
        """(In a loader worker) the lengths of records ``indices``, each source that tokenizes ahead
        tokenizing its own and handing them over as file ``name.<source number>``.

        Example:
            >>> import portable_loader as pl
            >>> from portable_loader.precache import sample_args
            >>> chat = pl.tokenized(**sample_args())
            >>> m = mix({"chat": chat, "list": [{"input_ids": np.arange(3)}] * 5}, {"chat": 1, "list": 1})
            >>> m.tokenize_ahead(np.array([9, 2001, 4]), "w0-p1").tolist()
            [17, 3, 34]
            >>> m.drop_handover()
        """
        n, groups = self._groups(np.asarray(indices, dtype=np.int64))
        out = np.empty(n, dtype=np.int64)
        for i, where, rec in groups:
            child = self.children[i]
            out[where] = child.tokenize_ahead(rec, f"{name}.{i}") if child.tokenizes_ahead else child.lengths(rec)
        return out

    def learn(self, indices: np.ndarray, lengths: np.ndarray) -> None:
        """(In the main process) take lengths a worker computed by :meth:`tokenize_ahead`."""
        lengths = np.asarray(lengths, dtype=np.int64)
        for i, where, rec in self._groups(np.asarray(indices, dtype=np.int64))[1]:
            if self.children[i].tokenizes_ahead:
                self.children[i].learn(rec, lengths[where])

    def drop_handover(self, name: str | None = None) -> None:
        """Remove the sources' hand-over files for ``name`` (see :meth:`tokenize_ahead`), or all of them."""
        for i, child in enumerate(self.children):
            if child.tokenizes_ahead:
                child.drop_handover(None if name is None else f"{name}.{i}")

    def accepts(self, indices) -> np.ndarray:
        n, groups = self._groups(indices)
        out = np.ones(n, dtype=bool)
        for i, where, rec in groups:
            if self.children[i].filters:
                out[where] = self.children[i].accepts(rec)
        return out

    def locate(self, indices) -> list[tuple[str, int]]:
        """(source path, record) of each mixture index; nested mixes name the path, e.g. ``"web/en"``."""
        if self._flat and not isinstance(indices, np.ndarray) and len(indices) <= _FEW:  # a step of describe
            offsets, names, total, out = self._offset_list, self.names, self._offset_list[-1], []
            for x in indices:
                if not 0 <= x < total:
                    raise IndexError(f"mixture index {x} is out of range [0, {total})")
                i = bisect.bisect_right(offsets, x) - 1
                out.append((names[i], int(x - offsets[i])))
            return out
        n, groups = self._groups(indices)
        out: list = [None] * n
        for i, where, rec in groups:
            child, name = self.children[i], self.names[i]
            nested = child.locate  # a mix, or a transform over one
            if nested is not None:
                found = [(f"{name}/{p}", r) for p, r in nested(rec)]
            else:
                found = [(name, int(r)) for r in rec]
            for w, f in zip(where, found):
                out[w] = f
        return out

    def stream_order(self, seed: int, *, shuffle: bool = True, num_epochs: int | None = None) -> MixOrder:
        """The mixture's stream, keyed by ``seed``; each source gets its own key from ``seed`` and its name."""
        kids = [c.stream_order(name_key(seed, n), shuffle=shuffle) for n, c in zip(self.names, self.children)]
        return MixOrder(self.stages, kids, self.offsets, seed=seed, shuffle=shuffle, num_epochs=num_epochs)

    def rebuilt(self, children, *, unit: str | None = None) -> "Mix":
        """The same names, weights and block over ``children`` (e.g. each source cut into windows).

        Example:
            >>> import numpy as np
            >>> m = mix({"a": [{"input_ids": np.arange(2)}], "b": [{"input_ids": np.arange(3)}]}, {"a": 1, "b": 2})
            >>> m.rebuilt([[{"input_ids": np.arange(4)}]] * 2).stages == m.stages
            True
        """
        return Mix(dict(zip(self.names, children)), self.weights, unit=unit or self.unit, block=self.block)

    def online_stage(self, weights, start: int, base: Sequence[int]) -> Stage:
        """The stage ``it.set_weights(weights)`` starts at stream position ``start``, each source's
        draws continuing from ``base``; ``ValueError`` naming what is wrong with ``weights``.

        Example:
            >>> import numpy as np
            >>> m = mix({"a": [{"input_ids": np.arange(2)}], "b": [{"input_ids": np.arange(3)}]}, {"a": 1, "b": 2})
            >>> st = m.online_stage({"a": 3}, 100, [40, 60])
            >>> st.nums, st.den, st.block, st.online
            ((1, 0), 1, 256, True)
        """
        if not isinstance(weights, Mapping) or not weights:
            raise ValueError(f"set_weights takes a non-empty dict of source name -> weight, got {weights!r:.80}")
        nums, den = self._record_weights(weights, "set_weights")
        return Stage(int(start), self._block_for(nums, den, len(self.stages)), nums, den,
                     tuple(int(x) for x in base), online=True)

    def reopen(self) -> "Mix":
        clone = copy.copy(self)
        clone.children = tuple(c.reopen() for c in self.children)
        clone._span_at = clone._sized = clone._one_batch = None  # the spans kept point into the old readers' maps
        return clone

    def __getstate__(self):  # to a spawned worker: the spans kept are memoryviews of this process's maps
        state = dict(self.__dict__)
        state["_sized"] = state["_span_at"] = state["_one_batch"] = None
        return state

    def mean_length(self) -> Fraction:
        """Mean record length of the stream (a one-stage mixture only: a schedule has one per stage)."""
        if len(self.stages) != 1:
            raise ValueError("unit='tokens' over a nested mixture needs that mixture to have one stage of weights")
        st = self.stages[0]
        return sum((Fraction(a, st.den) * _mean_length(c, n) for a, n, c in zip(st.nums, self.names, self.children)),
                   Fraction(0))

    def _identity(self) -> tuple:
        kids = tuple((c.fingerprint(), c.schedule_digests() if c.schedule_digests is not None else None)
                     for c in self.children)
        lengths = None if self.mean_lengths is None else tuple(str(m) for m in self.mean_lengths)
        # 2: a block's draws take their sources' positions in slot order (MixOrder._block_order), so
        # states saved by the earlier arithmetic belong to another stream and are refused.
        return ("mix", _ARITHMETIC, self.names, kids, self.unit, lengths)

    def __repr__(self) -> str:
        names = ", ".join(self.names)
        return f"Mix({names}; records={len(self)}, stages={len(self.stages)}, fingerprint={self.fingerprint()})"


def _fraction(x, what: str) -> Fraction:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ValueError(f"mix(): {what} must be a number, got {x!r}")
    if isinstance(x, numbers.Integral):
        f = Fraction(int(x))
    elif isinstance(x, Fraction):
        f = x
    else:
        x = float(x)
        if not math.isfinite(x):
            raise ValueError(f"mix(): {what} must be finite, got {x!r}")
        f = Fraction(repr(x))  # the shortest decimal that reads back as x: 0.1 is 1/10
    if f < 0:
        raise ValueError(f"mix(): {what} must be >= 0, got {x!r}")
    return f


def _mean_length(ds: Dataset, name: str) -> Fraction:
    """Mean record length: a cache's manifest counts, a nested mix's weights, else lengths of a fixed sample."""
    from portable_loader.dataset.sources import Cache
    from portable_loader.dataset.transforms import Map

    while isinstance(ds, Map) and ds.keeps_lengths:
        ds = ds.parent
    if isinstance(ds, Mix):
        mean = ds.mean_length()
    elif isinstance(ds, Cache) and (ds.cache.manifest.get("counts") or {}).get("tokens", 0) > 0 and \
            ds.cache.manifest["counts"].get("rows_out") == len(ds):
        mean = Fraction(int(ds.cache.manifest["counts"]["tokens"]), len(ds))
    else:
        n = len(ds)
        pos = np.arange(n) if n <= _LENGTH_SAMPLE else np.linspace(0, n - 1, _LENGTH_SAMPLE).round().astype(np.int64)
        mean = Fraction(int(np.asarray(ds.lengths(pos), dtype=np.int64).sum()), len(pos))
    if mean <= 0:
        raise ValueError(f"mix(unit='tokens'): source {name!r} has records of mean length 0")
    return mean


def _spans_at(span_at, records: list[int]) -> Spans:
    """The :class:`Spans` of a few ``records`` of one local cache, each located by its ``span_at``
    (no per-call setup: a mixture asks each of many sources for a handful of records).

    Example:
        >>> import portable_loader as pl
        >>> from portable_loader.precache import sample_args
        >>> chat = pl.open_cache(pl.precache(**sample_args(), out="cache"))
        >>> _spans_at(chat.span_at, [5, 0]).length == chat.spans([5, 0]).length
        True
    """
    return spans_of([span_at(r) for r in records])


def _spans_by_source(flat: list, src: np.ndarray, local: np.ndarray) -> Spans:
    """``Spans`` of records ``local[k]`` of source ``src[k]``, each source an Arrow cache of one
    record batch (``flat[i]``: its ids and mask buffers and its offsets): one stable sort, then a
    gather per source present; entries stay in the order asked.

    Example:
        >>> ids = memoryview(np.arange(6, dtype=np.int32).view(np.uint8)); masks = memoryview(np.ones(6, np.uint8))
        >>> flat = [(ids, masks, np.array([0, 2, 6])), (ids, masks, np.array([0, 1]))]
        >>> sp = _spans_by_source(flat, np.array([0, 1, 0]), np.array([1, 0, 0]))
        >>> sp.buf, sp.mask_at, sp.length
        ([0, 1, 0], [2, 0, 0], [4, 1, 2])
    """
    order = np.argsort(src, kind="stable")
    ordered = src[order]
    edges = [0, *(np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist(), src.size]
    first = np.empty(src.size, dtype=np.int64)
    end = np.empty(src.size, dtype=np.int64)
    buf = np.empty(src.size, dtype=np.int64)
    ids, masks = [], []
    for k, (a, b) in enumerate(zip(edges, edges[1:])):
        sel = order[a:b]
        i_buf, m_buf, offsets = flat[int(ordered[a])]
        j = local[sel]
        first[sel] = offsets[j]
        end[sel] = offsets[j + 1]
        buf[sel] = k
        ids.append(i_buf)
        masks.append(m_buf)
    return Spans(ids, masks, buf.tolist(), (4 * first).tolist(), first.tolist(), (end - first).tolist())
