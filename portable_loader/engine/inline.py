"""The inline engine: plan, fetch and collate a step in the calling thread.

``build_batch`` is the one function every engine (inline, prefetch thread, worker process) runs
to turn a row plan into a batch, so the engine never changes what a batch holds. Over a source
with ``spans`` (a cache) it collates from where the records' tokens lie (``collate_spans``);
otherwise from the records ``__getitems__`` returns (``collate``): the same batch either way.

The inline engine (which the prefetch thread also runs) reads ahead over a cache: one ``spans``
call covers the records of the next steps the plan already knows (``Planner.upcoming``: the rest
of a chunk of 4,096 positions, or a packing window), so the per-call costs (an ArrayRecord read
batch, the locating of records in Arrow shards) are paid once per chunk, not once per step. A source with
``read_ahead`` (a remote cache) narrows those records to what its ``cache_limit`` holds. When
packing a local cache on one host without filters, the planner sizes each window through that
same ``spans`` call (its lengths are the spans' lengths), so a window's records are located once,
not once for the packer and again for the read-ahead.

Example:
    >>> from portable_loader.dataset import source
    >>> src = source([{"input_ids": np.arange(3, dtype=np.int32)}])
    >>> build_batch(src, [[(0, 0, 4)]], seq_len=4, pad_id=0)["input_ids"].tolist()
    [[0, 1, 2, 0]]
"""

from __future__ import annotations

import numpy as np

from portable_loader.collate import FIELDS, check_token_records, collate, collate_spans
from portable_loader.engine.fetch_ahead import remotes_of
from portable_loader.plan import Cursor, Planner

__all__ = ["InlineEngine", "build_batch"]


def _records_of(rows) -> list[int]:
    return [piece[0] for row in rows for piece in row]


def build_batch(source, rows, seq_len: int, pad_id: int, fields=FIELDS) -> dict[str, np.ndarray]:
    """Fetch the records a row plan names (one batched read) and collate ``fields`` of them."""
    if source.collate_rows is not None:  # windows of a token stream (packing="concat")
        return source.collate_rows(rows, seq_len, pad_id, fields)
    spans = source.spans
    if spans is not None:
        wanted = _records_of(rows)
        return collate_spans(rows, spans(np.asarray(wanted, dtype=np.int64)), dict(zip(wanted, range(len(wanted)))),
                             seq_len, pad_id, fields)
    wanted = sorted(set(_records_of(rows)))
    records = dict(zip(wanted, source.__getitems__(np.asarray(wanted, dtype=np.int64))))
    check_token_records(wanted, records.values())
    if any(r is None for r in records.values()):  # a filter's hole: the plan only names records it accepted
        i = next(k for k, r in records.items() if r is None)
        raise ValueError(f"record {i} was planned as accepted but a filter rejects it now: a filter's predicate must be "
                         "a pure function of the record (same answer in every process and every call)")
    return collate(rows, records, seq_len, pad_id, fields)


class InlineEngine:
    """No prefetch: plan, fetch and collate in the caller's thread.

    ``loader`` is a ``DataLoader`` (its ``source``, ``seq_len``, ``pad_id``, ``fields``, shard and
    batch-size settings and ``local_rows``); ``next()`` returns ``(batch, cursor after it)``. Over a
    source with ``spans`` it reads ahead (see the module's docstring).

    Example:
        >>> import portable_loader as pl
        >>> from portable_loader.precache import sample_args
        >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache"))
        >>> loader = pl.DataLoader(src, global_batch_size=8, seq_len=128)
        >>> engine = InlineEngine(loader, loader.planner(), Cursor(0, 0, 0))
        >>> batch, cursor = engine.next()
        >>> engine.close()
        >>> batch["input_ids"].shape, cursor
        ((8, 128), Cursor(step=1, window=0, row=0, samples=8))
    """

    def __init__(self, loader, planner: Planner, cursor: Cursor):
        self.loader, self.planner, self.cursor = loader, planner, cursor
        self._spans, self._trim = loader.source.spans, loader.source.read_ahead
        self._ahead: tuple | None = None  # (Spans, record -> entry) of the records read ahead
        # Packing one host's local cache without filters: a window the planner sizes is exactly
        # the next read-ahead, so it is sized through spans (a remote cache would fetch its shards
        # to size them; a filter or other hosts read ahead other records).
        self._sizes_by_spans = (self._spans is not None and loader.packing and loader.shard_count == 1
                                and not loader.source.filters and not remotes_of(loader.source))
        self._sized: tuple | None = None  # (records, their Spans) of the window last sized so

    def next(self) -> tuple[dict, Cursor]:
        if self._sizes_by_spans:
            # Lent for this step only: the planner outlives the engine (set_state, close).
            lengths = self.planner.use_lengths(self._size)
            try:
                planned = self.planner.step(self.cursor)
            finally:
                self.planner.use_lengths(lengths)
        else:
            planned = self.planner.step(self.cursor)
        if planned is None:
            raise StopIteration
        rows, self.cursor = planned
        loader = self.loader
        if loader.shard_count > 1:
            rows = loader.local_rows(rows)
        if self._spans is None:
            return build_batch(loader.source, rows, loader.seq_len, loader.pad_id, loader.fields), self.cursor
        sized, self._sized = self._sized, None
        if self._ahead is not None and sized is None:  # (a step that sized a window holds its records)
            try:
                return collate_spans(rows, *self._ahead, loader.seq_len, loader.pad_id, loader.fields), self.cursor
            except KeyError:  # a record not read ahead: this step opens the next chunk or window
                pass
        now = np.asarray(_records_of(rows), dtype=np.int64)
        ahead = self._upcoming(self.cursor)
        if self._trim is not None:  # a remote cache: read ahead only what its cache_limit holds
            ahead = self._trim(now, ahead)
        if sized is not None and np.array_equal(sized[0], ahead):  # the window this step opened
            keys = ahead.tolist()
            self._ahead = (sized[1], dict(zip(keys, range(len(keys)))))
            try:
                return collate_spans(rows, *self._ahead, loader.seq_len, loader.pad_id, loader.fields), self.cursor
            except KeyError:  # the step also ends the window before: its own records, read now
                keys = now.tolist()
                mine = (self._spans(now), dict(zip(keys, range(len(keys)))))
                return collate_spans(rows, *mine, loader.seq_len, loader.pad_id, loader.fields), self.cursor
        wanted = np.concatenate([now, ahead])
        self._ahead = None  # let the old buffers go before the new ones are read
        keys = wanted.tolist()
        self._ahead = (self._spans(wanted), dict(zip(keys, range(len(keys)))))
        return collate_spans(rows, *self._ahead, loader.seq_len, loader.pad_id, loader.fields), self.cursor

    def _size(self, records: np.ndarray) -> np.ndarray:
        """The planner's lengths of a window's ``records``, from their ``Spans`` (kept to read ahead)."""
        spans = self._spans(records)
        self._sized = (records, spans)
        return np.array(spans.length, dtype=np.int64)

    def _upcoming(self, cur: Cursor) -> np.ndarray:
        """This host's records among the next steps' that the plan knows (none when that is unclear)."""
        loader = self.loader
        recs = self.planner.upcoming(cur)
        if loader.shard_count == 1:
            return recs
        if loader.packing or not loader.batch_schedule.fixed:
            return recs[:0]  # other hosts' rows are not worth reading; each step reads its own
        # Padding at a fixed size: position lo + j is row j % B of its step, and this host's rows
        # are [shard * b, (shard + 1) * b).
        b = loader.global_batch_size // loader.shard_count
        row = np.arange(recs.size) % loader.global_batch_size
        return recs[row // b == loader.shard_index]

    def close(self) -> None:
        self._ahead = self._sized = None
