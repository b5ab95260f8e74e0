"""The inline engine: plan, fetch and collate a step in the calling thread.

``build_batch`` is the one function every engine (inline, prefetch thread, worker process) runs
to turn a row plan into a batch, so the engine never changes what a batch holds. Over a source
with ``spans`` (a cache) it collates from where the records' tokens lie (``collate_spans``);
otherwise from the records ``__getitems__`` returns (``collate``): the same batch either way.

The inline engine (which the prefetch thread also runs) carries out finished plans
(``StepPlans``) and reads ahead over a cache: one ``spans`` call covers the records of the next
steps the plan already knows (``StepPlans.upcoming``: the rest of a chunk of 4,096 positions, or
a packing window), so the per-call costs (an ArrayRecord read batch, the locating of records in
Arrow shards) are paid once per chunk, not once per step. A source with ``read_ahead`` (a remote
cache) narrows those records to what its ``cache_limit`` holds. A packing window is read ahead
by itself: the planner has just sized it through the source's ``lengths``, and a cache keeps
the spans it answered that from, so a window's records are located once.

Example:
    >>> from portable_loader.dataset import source
    >>> src = source([{"input_ids": np.arange(3, dtype=np.int32)}])
    >>> build_batch(src, [[(0, 0, 4)]], seq_len=4, pad_id=0)["input_ids"].tolist()
    [[0, 1, 2, 0]]
"""

from __future__ import annotations

import numpy as np

from portable_loader.cache.readers import spans_of
from portable_loader.collate import FIELD_DTYPES, FIELDS, check_token_records, collate, collate_spans, collating_into
from portable_loader.engine.blocks import Layout, Pool
from portable_loader.step_plans import Cursor, StepPlans

__all__ = ["InlineEngine", "build_batch"]

_SPARE_BLOCKS = 2  # the batch the caller holds, and one more
# Smaller batches come from the heap, which reuses its memory anyway; a block is a mapping of its own,
# and a caller keeping many small batches (a whole epoch in a list) would run out of mappings.
_POOLED_MIN = 1 << 20


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
    """No prefetch: fetch and collate the next finished plan in the caller's thread.

    ``spec``: the loader's ``BatchSpec`` (``seq_len``, ``pad_id``, ``fields``); ``source``: its
    dataset; ``plans``: the ``StepPlans`` to carry out. ``next()`` returns ``(batch, cursor after
    it)``. Over a source with ``spans`` it reads ahead (see the module's docstring).

    Example:
        >>> import portable_loader as pl
        >>> from portable_loader.precache import sample_args
        >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache"))
        >>> loader = pl.DataLoader(src, global_batch_size=8, seq_len=128)
        >>> engine = InlineEngine(loader.spec, loader.source, StepPlans(loader.spec, loader.planner(), Cursor(0, 0, 0)))
        >>> batch, cursor = engine.next()
        >>> engine.close()
        >>> batch["input_ids"].shape, cursor
        ((8, 128), Cursor(step=1, window=0, row=0, samples=8))
    """

    def __init__(self, spec, source, plans: StepPlans, keep: int = 2):
        self.spec, self.source, self.plans = spec, source, plans
        # Batches are collated into blocks of this process's memory, reused once nothing refers to
        # them (engine/blocks.py): a fresh allocation a batch cost a page fault every 4 KiB of it.
        # ``keep``: batches that may be alive besides the one being built and the caller's (a
        # prefetch thread's queue, an adapter's converted batch waiting in its own); a block is
        # made only when every other one is in use.
        self._pool = Pool(keep + _SPARE_BLOCKS, shared=False) if all(f in FIELD_DTYPES for f in spec.fields) else None
        self._spans, self._trim = source.spans, source.read_ahead
        self._ahead: tuple | None = None  # (Spans, record -> entry) of the records read ahead
        self._window: int | None = None  # packing: the window whose records _ahead holds

    def next(self) -> tuple[dict, Cursor]:
        before = self.plans.cursor
        planned = self.plans.next()
        if planned is None:
            raise StopIteration
        rows, cursor = planned
        pool = self._pool
        layout = None if pool is None else Layout.of(len(rows), self.spec.seq_len, self.spec.fields)
        if layout is None or layout.size < _POOLED_MIN:
            return self._build(rows, before, cursor), cursor
        block, _ = pool.take(layout.size)
        try:
            with collating_into(pool.allocator(block, layout)):
                return self._build(rows, before, cursor), cursor
        finally:
            pool.done(block)

    def _build(self, rows, before: Cursor, cursor: Cursor) -> dict:
        spec = self.spec
        if self._spans is None:
            return build_batch(self.source, rows, spec.seq_len, spec.pad_id, spec.fields)
        if spec.packing and self._trim is None:
            return self._packed(rows, before.window, cursor)
        if self._ahead is not None:
            try:
                return collate_spans(rows, *self._ahead, spec.seq_len, spec.pad_id, spec.fields)
            except KeyError:  # a record not read ahead: this step opens the next chunk (or window)
                pass
        now = np.asarray(_records_of(rows), dtype=np.int64)
        ahead = self.plans.upcoming()
        if self._trim is not None:  # a remote cache: read ahead only what its cache_limit holds
            ahead = self._trim(now, ahead)
        wanted = np.concatenate([now, ahead])
        self._ahead = None  # let the old buffers go before the new ones are read
        self._ahead = _keyed(wanted, self._spans(wanted))
        return collate_spans(rows, *self._ahead, spec.seq_len, spec.pad_id, spec.fields)

    def _packed(self, rows, first: int, after: Cursor) -> dict:
        """A packed step's batch, from the window read ahead when the step lies in it.

        A window is read ahead by itself once a step ends inside it: the planner has just sized
        it through the source's ``lengths``, and a cache keeps the spans it answered that from,
        so its records are located once. A step that crosses into it takes its records from the
        two windows read ahead (``_picked``); one that a skip moved reads its own. (A remote cache
        goes the padded way: a miss reads the step's records and what its ``cache_limit`` holds of
        the window's, narrowed again at each miss as shards arrive.)
        """
        spec = self.spec
        last = after.window if after.row else after.window - 1  # the window of the step's last row
        before = self._ahead if self._window == first else None  # the window the step starts in
        if after.row and self._window != after.window:
            ahead = self.plans.upcoming()
            self._ahead = None  # let the old buffers go before the new ones are read (unless ``before`` holds them)
            self._ahead, self._window = (_keyed(ahead, self._spans(ahead)) if ahead.size else None), after.window
        if self._ahead is not None and first == last == self._window:
            try:
                return collate_spans(rows, *self._ahead, spec.seq_len, spec.pad_id, spec.fields)
            except KeyError:  # (a skip moved the step)
                pass
        now = _records_of(rows)
        if before is not None and self._ahead is not None and last == first + 1 == self._window:
            # A step that crosses into the window just read ahead: its records are in the two
            # read-aheads (a spans call of its own located them again).
            try:
                return collate_spans(rows, *_picked(now, before, self._ahead), spec.seq_len, spec.pad_id, spec.fields)
            except KeyError:  # (a skip moved the step)
                pass
        now = np.asarray(now, dtype=np.int64)
        return collate_spans(rows, *_keyed(now, self._spans(now)), spec.seq_len, spec.pad_id, spec.fields)

    def close(self) -> None:
        self._ahead = self._window = None
        if self._pool is not None:
            self._pool.close()


def _picked(records: list[int], *aheads: tuple) -> tuple:
    """``(spans, record -> its entry)`` of ``records``, each taken from the first of ``aheads``
    (``_keyed`` pairs) that holds it; ``KeyError`` if none does."""
    located = []
    for r in records:
        for sp, where in aheads:
            k = where.get(r)
            if k is not None:
                b = sp.buf[k]
                located.append((sp.ids[b], sp.masks[b], sp.ids_at[k], sp.mask_at[k], sp.length[k]))
                break
        else:
            raise KeyError(r)
    return spans_of(located), dict(zip(records, range(len(records))))


def _keyed(records: np.ndarray, spans) -> tuple:
    """``(spans, record -> its entry)``: what ``collate_spans`` looks records up in."""
    keys = records.tolist()
    return spans, dict(zip(keys, range(len(keys))))
