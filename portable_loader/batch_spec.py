"""BatchSpec: what a batch is, as one frozen value; the engines and their workers receive only it.

A ``DataLoader`` checks its options and builds its ``BatchSpec`` once (``loader.spec``). The spec
holds what decides a batch (the batch sizes, ``seq_len``, packing, the over-long policy, the
fields, padding, seeds, skips, this host's rows) and how the engines run (workers, prefetch);
with a dataset it gives the stream order (:meth:`BatchSpec.order`) and the planner of that order
(:meth:`BatchSpec.planner`), which gets record lengths through the dataset's own ``lengths``.
An engine takes a spec, a dataset and the finished plans of a :class:`~portable_loader.step_plans.StepPlans`;
a worker process receives the spec and the dataset, never the loader.

Example:
    >>> import dataclasses
    >>> import numpy as np
    >>> from portable_loader.dataset import source
    >>> ds = source([{"input_ids": np.arange(n)} for n in (3, 5, 2, 7)])
    >>> spec = BatchSpec(as_schedule(2), seq_len=4)
    >>> rows, cursor = spec.planner(ds, spec.order(ds)).step(Cursor(0, 0, 0))
    >>> rows, cursor.samples        # two records, one a row, each cut to seq_len
    ([[(1, 0, 4)], [(0, 0, 4)]], 2)
    >>> host1 = dataclasses.replace(spec, shard_index=1, shard_count=2)
    >>> host1.local_rows(rows)      # host 1 of 2 serves the second row
    [[(0, 0, 4)]]
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from portable_loader.batch_size import BatchSchedule, as_schedule
from portable_loader.collate import PADDED_FIELDS
from portable_loader.plan import Cursor, Planner, RecordRows

__all__ = ["BatchSpec", "as_schedule"]


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """What a global batch is (sizes, packing, fields, seeds, schedule), and this host's part of it.

    ``schedule``: the global batch size per step; ``skips``: spans of stream positions
    (``[start, end)`` in rows served) that are never delivered; ``drop_remainder``: a finite
    stream's last step is planned only if full; ``shard_index``/``shard_count``:
    which of the global rows this host gets. ``num_workers``/``prefetch`` choose the engine: they
    change how fast batches come, never what they hold. Values are the ``DataLoader``'s, checked.

    Example:
        >>> spec = BatchSpec(as_schedule([(0, 4), (2, 8)]), seq_len=128, packing=True, overlong="split")
        >>> spec.resolve(Cursor(3, 0, 0)).samples, spec.fields      # steps 0-2 served 4 + 4 + 8 rows
        (16, ('input_ids', 'loss_mask', 'attention_mask'))
    """

    schedule: BatchSchedule
    seq_len: int
    packing: bool = False
    packing_window: int = 1024
    overlong: str = "truncate"
    pad_id: int = 0
    fields: tuple[str, ...] = PADDED_FIELDS
    seed: int = 0
    shuffle: bool | str = True
    shuffle_shards: int | None = None
    num_epochs: int | None = None
    skips: tuple[tuple[int, int], ...] = ()
    shard_index: int = 0
    shard_count: int = 1
    num_workers: int = 0
    prefetch: int = 2
    drop_remainder: bool = False

    def order(self, source, num_epochs: int | None = ...):
        """Stream position -> record of ``source``: the LCG sampler, a mixture's own order, or the
        shard-group order (``shuffle="shards"``); ``num_epochs`` other than the spec's for counting."""
        epochs = self.num_epochs if num_epochs is ... else num_epochs
        if self.shuffle == "shards":
            from portable_loader.orders.shard_order import ShardShuffle

            return ShardShuffle(source.shard_rows, self.shuffle_shards, self.seed, num_epochs=epochs)
        return source.stream_order(self.seed, shuffle=self.shuffle, num_epochs=epochs)

    def planner(self, source, order) -> Planner:
        """A planner of ``order`` over ``source``: lengths, filters and per-source groups come from
        the dataset's contract (``lengths``, ``cheap_lengths``, ``accepts``, ``source_groups``)."""
        filters = source.filters
        groups = source.source_groups
        offsets = groups()[1] if groups is not None else np.array([0, len(source)], dtype=np.int64)
        return Planner(
            order, len(source), global_batch_size=self.schedule, seq_len=self.seq_len, packing=self.packing,
            window=self.packing_window, lengths=lambda idx: np.asarray(source.lengths(idx), dtype=np.int64),
            overlong=self.overlong, cheap_lengths=source.cheap_lengths, accept=source.accepts if filters else None,
            filters=filters, skips=self.skips, groups=offsets,
            count_lengths=self.shard_count > 1,  # per-source token counts cover every host's rows
            drop_remainder=self.drop_remainder,
        )

    def local_rows(self, rows: Sequence) -> Sequence:
        """This host's rows of a global step's ``rows`` (their number is that step's batch size)."""
        if self.shard_count == 1:
            return rows
        b = len(rows) // self.shard_count
        lo, hi = self.shard_index * b, (self.shard_index + 1) * b
        return rows.part(lo, hi) if type(rows) is RecordRows else rows[lo:hi]

    def resolve(self, cursor: Cursor) -> Cursor:
        """``cursor`` with ``samples`` filled in (the schedule followed from step 0) where it is None."""
        return cursor if cursor.samples is not None else cursor._replace(samples=self.schedule.samples_at(cursor.step))
