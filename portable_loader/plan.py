"""The global plan: which record pieces fill which rows of global step ``s``, by arithmetic.

The global record stream is position ``p -> (epoch p // N, sampler(epoch, p % N))``.

* Padding: a step of ``B`` rows takes the next ``B`` positions, one record per row (cut to ``seq_len``);
  the position is the number of records consumed, so a batch size that changes (a schedule, or a
  resume at another size) continues the same record stream.
* Packing: the stream is cut into windows of ``W`` positions; each window is packed on its own (a
  pure function of its records' lengths) and the row stream is each window's rows in a keyed
  pseudo-random order, a pure function of (seed, window). The packer creates rows from the fullest
  to the emptiest; served in that order, the documents per row would rise and fall with a period of
  one window (a length curriculum nobody asked for). A step of ``B`` rows takes the next ``B`` rows.
* Filters (``accept``: record indices -> bools): a rejected record is skipped where the plan meets it.
  Padding: a step takes positions until it holds ``B`` accepted records, so ``samples`` (the
  position) can grow by more than ``B``; packing: each window packs its accepted records only. Steps
  then depend on earlier steps, as packed ones do. ``MAX_REJECTED`` consecutive rejections (or twice
  the dataset's length, which contains a whole epoch, when that is fewer), or a finite stream with
  no survivor at all, raise ``FilterError`` instead of scanning on forever.
* ``drop_remainder``: a finite stream's last step, when it would hold fewer rows than its batch size,
  is not planned (``step`` returns None there, ``num_steps`` counts full steps only). Every other
  step is the same as without it: only where the stream ends moves.
* Records longer than ``seq_len`` follow the ``overlong`` policy (``"split"`` only when packing,
  ``"truncate"`` or ``"drop"``); ``counts`` holds, per step planned, how many records each policy
  touched (and ``"filtered"``: records skipped by filters), until the caller takes it. Without
  packing, lengths are read only where they are cheap (``cheap_lengths``: the source has ``lengths()``) or the policy is ``"drop"``; otherwise a
  truncation is left to collation and not counted (None).

The batch size of a step comes from a ``BatchSchedule`` (portable_loader.batch_size), a function of
(step, samples consumed). A ``Cursor`` (step, window, row, samples) is where the next step starts:
``samples`` counts the rows served so far (padding: the record position, so ``window``/``row`` are 0).
Restoring one re-plans at most one window, O(W), never O(steps). Hosts cut the same global rows at
different offsets, so their number never changes the stream.

Example:
    >>> from portable_loader.orders.sampler import LCGSampler
    >>> p = Planner(LCGSampler(10, seed=0, num_epochs=1), 10, global_batch_size=4, seq_len=8)
    >>> rows, nxt = p.step(Cursor(0, 0, 0))
    >>> len(rows), nxt
    (4, Cursor(step=1, window=0, row=0, samples=4))
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np

from portable_loader.batch_size import BatchSchedule, as_schedule
from portable_loader.collate import OVERLONG, Piece, count_rows, pack
from portable_loader.errors import FilterError
from portable_loader.orders.keyed import KeyedPermutation
from portable_loader.orders.keyed import splitmix64 as _splitmix64
from portable_loader.orders.sampler import LCGSampler

if TYPE_CHECKING:  # the dataset package imports the planner's module
    from portable_loader.dataset.protocols import StreamOrder

__all__ = ["Cursor", "MAX_REJECTED", "Planner", "RecordRows", "packed_rows"]

_CHUNK = 4096
_KEPT_CHUNKS = 8  # 32 KiB of record indices each (and as much of lengths)
_ROW_ORDER_SALT = 0x0DE5_0F_1005  # keeps the row-order key apart from the sampler's epoch keys
_KEPT_COUNTS = 1024  # per-step counts nobody takes (e.g. a bare Planner) stop growing here
#: Consecutive rejected records after which a filter is taken to reject everything.
MAX_REJECTED = 1_000_000
_FEW = 24  # positions a sampler maps in Python integers (sampler.few) when a step jumps
_FEW_BY_SOURCE = 64  # records of a padded step counted per source in Python integers (numpy calls cost more)
_FIRST_SPAN = 16  # positions a filtered padded step tests first; doubled while too few survive


def _keep(cache: dict, key: int, value) -> None:
    if len(cache) >= _KEPT_CHUNKS:
        cache.pop(next(iter(cache)))
    cache[key] = value


class Cursor(NamedTuple):
    """Where the next global step starts (``window``/``row`` are used in packing mode only).

    ``samples``: rows served before it (padding: records consumed, the stream position). None stands
    for the schedule followed from step 0 (``Planner.resolve`` fills it in).
    """

    step: int
    window: int
    row: int
    samples: int | None = None


class Planner:
    """Plans global steps; ``step(cursor)`` -> (rows of pieces, next cursor), or None at the end."""

    def __init__(
        self,
        sampler: StreamOrder,
        num_records: int,
        *,
        global_batch_size: int | BatchSchedule,
        seq_len: int,
        packing: bool = False,
        window: int = 1024,
        lengths: Callable[[np.ndarray], np.ndarray] | None = None,
        overlong: str | None = None,
        cheap_lengths: bool = True,
        accept: Callable[[np.ndarray], np.ndarray] | None = None,
        filters: tuple[str, ...] = (),
        skips: tuple[tuple[int, int], ...] = (),
        groups: np.ndarray | None = None,
        count_lengths: bool = False,
        drop_remainder: bool = False,
    ):
        overlong = overlong or ("split" if packing else "truncate")
        if overlong not in OVERLONG or (overlong == "split" and not packing):
            raise ValueError(f"overlong must be one of {OVERLONG} ('split' only when packing), got {overlong!r}")
        self.sampler, self.n = sampler, num_records
        self.sizes = as_schedule(global_batch_size)
        self.batch, self.seq_len, self.packing, self.window = global_batch_size, seq_len, packing, window
        self.total = None if sampler.num_epochs is None else sampler.num_epochs * num_records
        self.overlong, self.cheap_lengths = overlong, cheap_lengths
        self._lengths = lengths
        self._accept, self.filters = accept, tuple(filters)
        self.max_rejected = min(MAX_REJECTED, 2 * num_records)  # 2N consecutive positions hold a whole epoch
        self._mask: tuple[int, np.ndarray] | None = None  # (first position, accepted?) last tested
        self._windows: dict[int, tuple[list[list[Piece]], int, int] | None] = {}
        # The last chunks of positions looked up (and their lengths): describe near one step, or a
        # trainer going back a few steps, finds them again.
        self._chunks: dict[int, np.ndarray] = {}
        self._chunk_lengths: dict[int, np.ndarray] = {}
        self._span_lengths: tuple[tuple[int, int], np.ndarray] | None = None
        self._last_chunk: int | None = None
        # step -> {policy: records it touched}; ordered so that trimming is one atomic popitem while
        # a consumer thread pops its steps.
        self.counts: OrderedDict[int, dict[str, int]] = OrderedDict()
        # Skipped spans of positions (rows served: padding records, packing rows), sorted and disjoint:
        # a step that would start inside one starts at its end (see ``jump``).
        self.skips = tuple(skips)
        self._skip_starts = [lo for lo, _ in self.skips]
        self._row_counts: dict[int, int] = {}  # window -> its number of rows, for jumps
        # Where each source of a mixture starts among the record indices ([0, n] for one source):
        # each step's counts get "sources", its records and tokens per source (see _by_source).
        self.groups = None if groups is None else np.asarray(groups, dtype=np.int64)
        self._group_list = [] if groups is None else self.groups.tolist()
        # Padding: read lengths for the per-source token counts even where they cost a read (several
        # hosts: no host's batch holds every row).
        self.count_lengths = count_lengths
        self.drop_remainder = drop_remainder
        # Packs a window elsewhere (``w -> _pack_window(w)``'s result): a worker process, which the
        # engine sets while it runs (engine/pack_ahead.py). None: packed here.
        self.packer: Callable[[int], tuple[list[list[Piece]], int, int]] | None = None

    def records(self, lo: int, hi: int) -> np.ndarray:
        """Record indices at global stream positions ``[lo, hi)``.

        Looked up a chunk of ``_CHUNK`` positions at a time: one vectorized sampler call costs about
        as much for 4096 positions as for 8, and consecutive steps read consecutive positions. A
        jump (a resume, ``describe`` at random steps) looks up only the positions asked for; the
        next step in the same chunk then fills the chunk.
        """
        chunk = lo // _CHUNK
        got = self._chunks.get(chunk)
        jump = self._last_chunk is None or not 0 <= chunk - self._last_chunk <= 1
        self._last_chunk = chunk
        if got is not None and hi <= (chunk + 1) * _CHUNK:
            return got[lo - chunk * _CHUNK : hi - chunk * _CHUNK]
        if jump and hi - lo <= _CHUNK // 8:
            if hi - lo <= _FEW and (self.total is None or hi <= self.total):  # in Python integers
                return np.array(self.sampler.few(list(range(lo, hi))), dtype=np.int64)
            return self.sampler.stream_indices(np.arange(lo, hi, dtype=np.int64))
        parts = []
        while lo < hi:
            chunk = lo // _CHUNK
            got = self._chunks.get(chunk)
            if got is None:
                first = chunk * _CHUNK
                last = first + _CHUNK if self.total is None else min(first + _CHUNK, self.total)
                got = self.sampler.stream_indices(np.arange(first, last, dtype=np.int64))
                _keep(self._chunks, chunk, got)
            end = min(hi, (chunk + 1) * _CHUNK)
            parts.append(got[lo - chunk * _CHUNK : end - chunk * _CHUNK])
            lo = end
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def lengths_at(self, lo: int, hi: int, recs: np.ndarray) -> np.ndarray:
        """Lengths of ``recs``, the records at positions ``[lo, hi)`` (from :meth:`records`).

        Cheap lengths of a chunk already looked up come in one call for the whole chunk: one call
        per 4096 positions costs less than one per step, most of all for a mixture, whose every call
        reaches each of its sources.
        """
        chunk = lo // _CHUNK
        got = self._chunks.get(chunk)
        if not (self.cheap_lengths and got is not None and hi <= (chunk + 1) * _CHUNK):
            if self._span_lengths is None or self._span_lengths[0] != (lo, hi):  # describe asks again for a step's
                self._span_lengths = ((lo, hi), self._lengths(recs))
            return self._span_lengths[1]
        lengths = self._chunk_lengths.get(chunk)
        if lengths is None:
            lengths = self._lengths(got)
            _keep(self._chunk_lengths, chunk, lengths)
        first = chunk * _CHUNK
        return lengths[lo - first : hi - first]

    def upcoming(self, cur: Cursor) -> np.ndarray:
        """Records of the steps from ``cur`` on that the plan knows at no extra cost, in stream order.

        Padding: the rest of the chunk of positions ``cur`` is in; packing: window ``cur.window``'s
        records. A reader fetches them in one call ahead of the steps that need them.

        Example:
            >>> p = Planner(LCGSampler(10, seed=0, num_epochs=1), 10, global_batch_size=4, seq_len=8)
            >>> p.upcoming(Cursor(1, 0, 0)).size    # positions 4..9
            6
        """
        if self.skips:  # never read ahead the records of a skipped span
            cur = self.jump(self.resolve(cur))
        if self.packing:
            if self.num_windows is not None and cur.window >= self.num_windows:
                return np.empty(0, dtype=np.int64)
            return self._window_records(cur.window)
        lo = self.resolve(cur).samples
        hi = (lo // _CHUNK + 1) * _CHUNK
        hi = hi if self.total is None else min(hi, self.total)
        return self.records(lo, hi) if lo < hi else np.empty(0, dtype=np.int64)

    @property
    def num_windows(self) -> int | None:
        """Packing windows in a finite stream (the last one may be short); None when endless."""
        return None if self.total is None else -(-self.total // self.window)

    def _window_records(self, w: int) -> np.ndarray:
        lo = w * self.window
        hi = lo + self.window if self.total is None else min(lo + self.window, self.total)
        return self.records(lo, hi)

    def window_rows(self, w: int) -> list[list[Piece]] | None:
        """Window ``w``'s rows in serving order, or None past the end of a finite stream."""
        planned = self._planned(w)
        return None if planned is None else planned[0]

    def window_input(self, w: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """What window ``w`` is packed from: its accepted records, their lengths, how many of them are
        over-long and how many records the filters rejected."""
        recs = self._window_records(w)
        rejected = 0
        if self._accept is not None:
            ok = self._accept(recs)
            rejected = int(recs.size - np.count_nonzero(ok))
            recs = recs[ok]
        lengths = self._lengths(recs) if recs.size else np.zeros(0, dtype=np.int64)
        return recs, lengths, int(np.count_nonzero(lengths > self.seq_len)), rejected

    def _pack_window(self, w: int) -> tuple[list[list[Piece]], int, int]:
        """Window ``w`` packed (rows in serving order), its over-long records and its rejected ones."""
        recs, lengths, over, rejected = self.window_input(w)
        return packed_rows(recs, lengths, self.seq_len, self.overlong, self.row_key(w)), over, rejected

    def _planned(self, w: int) -> tuple[list[list[Piece]], int, int] | None:
        if w not in self._windows:
            if self.num_windows is not None and w >= self.num_windows:
                planned = None
            else:
                planned = (self.packer or self._pack_window)(w)
            if len(self._windows) >= 2:
                self._windows.pop(min(self._windows))
            self._windows[w] = planned
        return self._windows[w]

    def row_key(self, w: int) -> int | None:
        """The key of window ``w``'s row order (``packed_rows``): a function of (seed, w) only, or
        None without shuffling (an evaluation pass keeps the packer's order).

        The window index counts windows of the whole stream, so it also tells the epoch.
        """
        if not self.sampler.shuffle:
            return None
        return _splitmix64(self.sampler.seed ^ _splitmix64(w ^ _ROW_ORDER_SALT))

    def _count(self, step: int, touched: int | None, rejected: int = 0) -> None:
        if len(self.counts) >= _KEPT_COUNTS:
            self.counts.popitem(last=False)
        self.counts[step] = {self.overlong: touched, "filtered": rejected}

    def _accepted(self, lo: int, hi: int, recs: np.ndarray) -> np.ndarray:
        """Whether the records ``recs`` at positions ``[lo, hi)`` pass the filters.

        The last span tested is kept: a step tests ahead of what it takes, and the next step starts
        inside that span, so no record is tested twice.
        """
        m = self._mask
        if m is not None and m[0] <= lo < m[0] + m[1].size:
            have = m[1][lo - m[0] :]
            if have.size >= hi - lo:
                return have[: hi - lo]
            mask = np.concatenate([have, self._accept(recs[have.size :])])
        else:
            mask = self._accept(recs)
        self._mask = (lo, mask)
        return mask

    def _survivors(self, lo: int, need: int) -> tuple[np.ndarray, int, int]:
        """(the first ``need`` accepted records from position ``lo``, the position after the last
        one taken, the records rejected before it); fewer where a finite stream ends."""
        taken, rejected, run, p, span = [], 0, 0, lo, max(need, _FIRST_SPAN)
        while need:
            hi = p + span if self.total is None else min(p + span, self.total)
            if p >= hi:
                break
            recs = self.records(p, hi)
            where = np.flatnonzero(self._accepted(p, hi, recs))
            if where.size >= need:
                end = int(where[need - 1]) + 1
                taken.append(recs[where[:need]])
                rejected += end - need
                p, need = p + end, 0
                break
            taken.append(recs[where])
            rejected += (hi - p) - where.size
            run = run + hi - p if not where.size else hi - p - int(where[-1]) - 1
            if run >= self.max_rejected and (self.total is None or hi < self.total):
                raise self._reject_all(hi - run, run)
            # (At the end of a finite stream the loop ends instead: the caller says whether it
            # served anything, or that the filter rejected the whole stream.)
            p, need, span = hi, need - where.size, min(span * 2, _CHUNK)
        return (np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)), p, rejected

    def _reject_all(self, at: int, run: int | None) -> FilterError:
        what = " and ".join(self.filters) or "the filter"
        if run is None:
            return FilterError(f"{what} rejected every record of this finite stream ({self.total} positions): "
                               "there is nothing to serve")
        proof = run >= 2 * self.n and self.sampler.whole_epochs
        why = (f"any {2 * self.n} positions hold a whole epoch of the dataset's {self.n} records: "
               "it rejects every record" if proof else "it rejects everything, or so nearly everything that batches cannot be filled")
        return FilterError(f"{what} rejected {run} records in a row from stream position {at} ({why})")

    def resolve(self, cur: Cursor) -> Cursor:
        """``cur`` with ``samples`` filled in (the schedule followed from step 0) where it is None."""
        if cur.samples is not None:
            return cur
        return cur._replace(samples=self.sizes.samples_at(cur.step))

    def skip_target(self, samples: int) -> int:
        """``samples`` moved past every skipped span it lies in (adjacent spans chain)."""
        while self.skips:
            k = bisect.bisect_right(self._skip_starts, samples) - 1
            if k < 0 or samples >= self.skips[k][1]:
                break
            samples = self.skips[k][1]
        return samples

    def jump(self, cur: Cursor) -> Cursor:
        """``cur`` (resolved) moved past the skipped span it starts in, if any; the step counter stays."""
        target = self.skip_target(cur.samples)
        return cur if target == cur.samples else self.advance(cur, target - cur.samples)

    def advance(self, cur: Cursor, rows: int) -> Cursor:
        """``cur`` (resolved) moved ``rows`` positions on, without planning a step.

        Padding: arithmetic, O(1). Packing: the rows of each window passed over are counted by
        packing it (its records' lengths, never their tokens): O(windows passed over).
        """
        target = cur.samples + rows
        if not self.packing:
            return cur._replace(samples=target if self.total is None else min(target, self.total))
        w, r, left, empty = cur.window, cur.row, rows, 0
        while left > 0:
            if self.num_windows is not None and w >= self.num_windows:
                return Cursor(cur.step, self.num_windows, 0, target)  # past the end: nothing more to serve
            n = self._row_count(w)
            empty = 0 if n else empty + 1
            if self._accept is not None and empty * self.window >= self.max_rejected:
                raise self._reject_all((w + 1 - empty) * self.window, empty * self.window)
            if left < n - r:
                r += left
                break
            left -= n - r
            w, r = w + 1, 0
        return Cursor(cur.step, w, r, target)

    def rows_in_window(self, w: int) -> int:
        """How many rows packing window ``w`` makes (0 past the end); the window stays packed for
        the step that serves it."""
        planned = self._planned(w)
        return 0 if planned is None else len(planned[0])

    def _row_count(self, w: int) -> int:
        planned = self._windows.get(w)
        if planned is not None:
            return len(planned[0])
        n = self._row_counts.get(w)
        if n is None:
            recs = self._window_records(w)
            if self._accept is not None:
                recs = recs[self._accept(recs)]
            n = count_rows(self._lengths(recs), self.seq_len, self.overlong) if recs.size else 0
            if len(self._row_counts) >= 64:
                self._row_counts.pop(next(iter(self._row_counts)))
            self._row_counts[w] = n
        return n

    def step(self, cur: Cursor) -> tuple[list[list[Piece]], Cursor] | None:
        cur = self.resolve(cur)
        if self.skips:
            cur = self.jump(cur)
        batch = self.sizes.size(cur.step, cur.samples)
        if not self.packing:
            lo = cur.samples
            if self.total is not None and lo >= self.total:
                return None
            rejected = 0
            if self._accept is None:
                hi = lo + batch if self.total is None else min(lo + batch, self.total)
                recs = self.records(lo, hi)
            else:
                recs, hi, rejected = self._survivors(lo, batch)
                if not recs.size:
                    if lo == 0:
                        raise self._reject_all(0, None)
                    return None
            if self.drop_remainder and recs.size < batch:  # only where a finite stream ends
                return None
            touched = lengths = None  # not counted: reading lengths here would fetch each record twice
            if self._lengths is not None and (self.overlong == "drop" or self.cheap_lengths):
                lengths = self.lengths_at(lo, hi, recs) if self._accept is None else self._lengths(recs)
                over = lengths > self.seq_len
                touched = int(np.count_nonzero(over))
                if self.overlong == "drop":
                    recs = np.where(over, -1, recs)
            # End = seq_len: collate cuts each record to its own length. A dropped record leaves
            # its row empty, so positions and rows stay in step.
            rows = RecordRows(recs, self.seq_len, batch)
            self._count(cur.step, touched, rejected)
            if self.groups is not None and self.groups.size <= 2 and not self.count_lengths:
                # one source, one host: its tokens are the batch's, which the consumer counts anyway
                served = recs.size if self.overlong != "drop" else int(np.count_nonzero(recs >= 0))
                self.counts[cur.step]["sources"] = ([served], None, None)
            elif self.groups is not None:
                if lengths is None and self.count_lengths:  # several hosts: no batch holds every row
                    lengths = self._lengths(recs)
                if lengths is None:  # lengths cost a read here: the consumer counts tokens from the batch
                    self._by_source(cur.step, recs, None)
                else:
                    tokens = np.minimum(lengths, self.seq_len)
                    if self.overlong == "drop":  # a dropped record (-1) serves nothing
                        kept = recs >= 0
                        recs, tokens = recs[kept], tokens[kept]
                    self._by_source(cur.step, recs, tokens)
            return rows, Cursor(cur.step + 1, 0, 0, hi)
        rows: list[list[Piece]] = []
        w, r = cur.window, cur.row
        touched = rejected = empty = 0
        segments = []  # (window, its rows, first row, end row, its over-long records) this step takes
        while len(rows) < batch:
            planned = self._planned(w)
            if planned is None:
                break
            window, over, skipped = planned
            if r == 0:  # a window's records count once, in the step that opens it
                touched += over
                rejected += skipped
            empty = 0 if window else empty + 1
            if self._accept is not None and empty * self.window >= self.max_rejected:
                raise self._reject_all((w + 1 - empty) * self.window, empty * self.window)
            take = window[r : r + batch - len(rows)]
            rows += take
            segments.append((w, window, r, r + len(take), over))
            r += len(take)
            if r >= len(window):
                w, r = w + 1, 0
        if not rows:
            if self._accept is not None and cur.window == cur.row == 0:
                raise self._reject_all(0, None)
            return None
        if self.drop_remainder and len(rows) < batch:  # only where a finite stream ends
            return None
        self._count(cur.step, touched, rejected)
        if self.groups is not None and self.groups.size <= 2 and not self.count_lengths:
            # one source, one host: its tokens are the batch's, which the consumer counts anyway. Its
            # records are the pieces that start one: every piece but a split's tails, which only a
            # window with over-long records has (a generator over every piece cost 3% of a step).
            heads = sum(map(len, rows))
            for _, window, lo, hi, over in segments:
                if over:
                    heads -= sum(1 for row in window[lo:hi] for p in row if p[1])
            self.counts[cur.step]["sources"] = ([heads], None, None)
        elif self.groups is not None:  # its rows as they are: the consumer counts many steps' at once
            self.counts[cur.step]["sources"] = ServedRows(rows)
        return rows + [[] for _ in range(batch - len(rows))], Cursor(cur.step + 1, w, r, cur.samples + batch)

    def _by_source(self, step: int, recs: np.ndarray, tokens: np.ndarray | None) -> None:
        """Record what padded step ``step`` served per source, as ``counts[step]["sources"]``: its
        records ``recs`` and their ``tokens`` as they are (``Served``: a mixture's, counted by the
        consumer many steps at once), ``([records], [tokens], None)`` for one source, or, with
        ``tokens`` None (lengths not read), ``(records per source, None, source of each row)`` for
        the consumer to count the batch's tokens."""
        groups = self.groups
        if tokens is not None:
            self.counts[step]["sources"] = (Served(recs, tokens) if groups.size > 2
                                            else ([recs.size], [int(tokens.sum())], None))
            return
        if recs.size <= _FEW_BY_SOURCE:  # a step's few records: plain Python beats numpy
            offsets, k = self._group_list, groups.size - 1
            src = [bisect.bisect_right(offsets, x) - 1 for x in recs.tolist()]
            records = [0] * k
            for i in src:
                records[i] += 1
            got = (records, None, src)
        else:
            src = np.searchsorted(groups, recs, side="right") - 1
            records = np.bincount(src, minlength=groups.size - 1).tolist()
            got = (records, None, src[recs >= 0] if (recs < 0).any() else src)
        self.counts[step]["sources"] = got

    def num_steps(self, estimate: bool = False, sample_windows: int = 32) -> int:
        """Global steps in this finite stream (the last one may be partly padding).

        The fewest steps, at the schedule's sizes from step 0, that hold every record (padding) or
        every packed row; with ``drop_remainder``, the most steps those fill completely. Padding:
        exact arithmetic (through a filter: planning every step, or with ``estimate=True`` the share
        that passes of ``sample_windows`` spans). Packing: exact by packing every window
        (O(records)), or with ``estimate=True`` from ``sample_windows`` evenly spaced full windows
        scaled to all of them.
        """
        if self.total is None:
            raise ValueError("an endless stream (num_epochs=None) has no number of steps")
        if not self.packing and self._accept is not None:
            return self._filtered_steps(estimate, sample_windows)
        if not self.packing:
            return self._steps_for(self.total)
        nwin = self.num_windows
        if estimate and nwin > sample_windows + 1:
            full = nwin - 1 if self.total % self.window else nwin
            picks = np.linspace(0, full - 1, sample_windows).round().astype(np.int64)
            per_window = np.mean([self._rows_in(int(w)) for w in picks])
            rows = round(per_window * full) + (self._rows_in(nwin - 1) if full < nwin else 0)
        else:
            rows = sum(self._rows_in(w) for w in range(nwin))
        return self._steps_for(rows)

    def _steps_for(self, samples: int) -> int:
        """Steps that serve ``samples`` rows from step 0: the last one partial, or dropped."""
        return self.sizes.full_steps(samples) if self.drop_remainder else self.sizes.steps_for(samples)

    def _rows_in(self, w: int) -> int:
        recs, lengths, _, _ = self.window_input(w)
        return len(pack(recs, lengths, self.seq_len, self.overlong))  # (counted: the serving order is not needed)

    def _filtered_steps(self, estimate: bool, samples: int) -> int:
        """Padded steps through a filter: planned one by one (exact), or from the share of ``samples``
        spans of ``_CHUNK`` positions that pass."""
        spans = -(-self.total // _CHUNK)
        if estimate and spans > samples + 1:
            picks = np.linspace(0, spans - 2, samples).round().astype(np.int64).tolist()
            passed = sum(int(np.count_nonzero(self._accept(self.records(k * _CHUNK, (k + 1) * _CHUNK)))) for k in picks)
            return self._steps_for(round(passed / (samples * _CHUNK) * self.total))
        cur, steps = Cursor(0, 0, 0, 0), 0
        while (planned := self.step(cur)) is not None:
            cur, steps = planned[1], steps + 1
            self.counts.pop(steps - 1, None)
        return steps


class RecordRows(Sequence):
    """The rows of a padded step: ``[(record, 0, end)]`` each, ``[]`` where ``recs`` holds -1 (a
    dropped record) and past its end, up to ``batch`` rows.

    A sequence of rows like any plan's, kept as one array of records until someone reads the rows:
    the trainer's process plans a step and sends it to a worker without a Python object per row,
    and it pickles as the records' bytes (64 rows in ~1 µs instead of 12).

    Example:
        >>> import pickle
        >>> rows = RecordRows(np.array([7, -1, 3]), 8, batch=4)
        >>> rows
        [[(7, 0, 8)], [], [(3, 0, 8)], []]
        >>> len(rows), rows[0], rows[1:3]
        (4, [(7, 0, 8)], [[], [(3, 0, 8)]])
        >>> pickle.loads(pickle.dumps(rows)) == rows == [[(7, 0, 8)], [], [(3, 0, 8)], []]
        True
    """

    __slots__ = ("recs", "end", "_rows")

    def __init__(self, recs: np.ndarray, end: int, batch: int | None = None):
        recs = np.asarray(recs, dtype=np.int64)
        if batch is not None and recs.size < batch:  # a finite stream's last step: empty rows after it
            recs = np.concatenate([recs, np.full(batch - recs.size, -1, dtype=np.int64)])
        self.recs, self.end, self._rows = recs, end, None

    def rows(self) -> list[list[Piece]]:
        """The rows as lists, made once."""
        if self._rows is None:
            end = self.end
            self._rows = [[(i, 0, end)] if i >= 0 else [] for i in self.recs.tolist()]
        return self._rows

    def part(self, lo: int, hi: int) -> "RecordRows":
        """Rows ``[lo, hi)``, still a ``RecordRows`` (a host's share of a step)."""
        return RecordRows(self.recs[lo:hi], self.end)

    def __len__(self) -> int:
        return len(self.recs)

    def __getitem__(self, i):
        return self.rows()[i]

    def __iter__(self):
        return iter(self.rows())

    def __eq__(self, other) -> bool:
        if isinstance(other, RecordRows):
            other = other.rows()
        return self.rows() == other if isinstance(other, list) else NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self.rows())

    def __reduce__(self):
        return _record_rows, (self.recs.tobytes(), self.end)


def _record_rows(raw: bytes, end: int) -> RecordRows:
    return RecordRows(np.frombuffer(raw, dtype=np.int64), end)


class Served(NamedTuple):
    """The records (mixture indices) a padded step served and their tokens, for the consumer to
    count per source (``served_by_source``) many steps at once."""

    recs: np.ndarray
    tokens: np.ndarray


class ServedRows(NamedTuple):
    """The rows of pieces ``(record, start, end)`` a packed step served (all hosts'), for the
    consumer to count per source (``served_by_source``) many steps at once."""

    rows: list


def packed_rows(recs: np.ndarray, lengths: np.ndarray, seq_len: int, overlong: str, key: int | None) -> list[list[Piece]]:
    """A packing window's rows in serving order: ``recs`` packed (``collate.pack``), then put in the
    keyed order of ``key`` (``Planner.row_key``; None keeps the packer's order). A pure function of
    its arguments, so a worker process computes the same rows as the planner would.

    Example:
        >>> rows = packed_rows(np.arange(6), np.array([5, 2, 9, 3, 1, 4]), 8, "split", key=7)
        >>> sorted(rows) == sorted(pack(np.arange(6), np.array([5, 2, 9, 3, 1, 4]), 8, "split"))
        True
    """
    rows = pack(recs, lengths, seq_len, overlong)
    if key is None or len(rows) < 2:
        return rows
    # LCGSampler(n, key)'s order, taken from its bijection of [0, 2**k) (its permutation of
    # 2**k records) by cycle walking in Python: a few hundred rows walk in half the time of the
    # vectorized walk's numpy passes.
    n = len(rows)
    size = 1 << (n - 1).bit_length()
    table = KeyedPermutation(size, key)(np.arange(size, dtype=np.uint64)).tolist()  # LCGSampler(size, key)'s epoch 0
    out = []
    for i in table[:n]:
        while i >= n:
            i = table[i]
        out.append(rows[i])
    return out


def served_by_source(groups: np.ndarray, served: list) -> np.ndarray:
    """Records, then tokens, per source of the steps ``served`` (``Served`` and ``ServedRows``;
    source ``i`` owns indices ``groups[i] .. groups[i + 1] - 1``), as one int64 array. A piece
    counts its tokens, and a record where it starts (a split's tails count tokens only).

    One pass over hundreds of steps: per step, with 60 sources, the counts cost ~9 µs of a padded
    step's 60 and, kept as running counts per packing window, ~4 µs of a packed step.

    Example:
        >>> served_by_source(np.array([0, 10, 30]), [Served(np.array([12, 3]), np.array([5, 7])),
        ...                                          ServedRows([[(29, 0, 1), (12, 4, 6)], []])]).tolist()
        [1, 2, 7, 8]
    """
    from itertools import chain

    k = groups.size - 1
    recs, tokens, heads = [], [], []
    rows = [row for s in served if type(s) is ServedRows for row in s.rows]
    n = sum(map(len, rows))
    if n:
        pieces = np.fromiter(chain.from_iterable(chain.from_iterable(rows)), dtype=np.int64, count=3 * n).reshape(n, 3)
        recs.append(pieces[:, 0])
        tokens.append(pieces[:, 2] - pieces[:, 1])
        heads.append(pieces[:, 1] == 0)
    for s in served:
        if type(s) is Served:
            recs.append(s.recs)
            tokens.append(s.tokens)
            heads.append(np.ones(s.recs.size, dtype=bool))
    if not recs:
        return np.zeros(2 * k, dtype=np.int64)
    src = np.searchsorted(groups, np.concatenate(recs), side="right") - 1
    counted = np.bincount(src, weights=np.concatenate(tokens), minlength=k)  # float64 sums: exact below 2**53
    return np.concatenate([np.bincount(src[np.concatenate(heads)], minlength=k), counted.astype(np.int64)])
