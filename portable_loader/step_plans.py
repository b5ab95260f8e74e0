"""The finished plans of one host's steps, in order: what an engine fetches and collates.

An engine never plans: it takes :meth:`StepPlans.next` (this host's rows of the next global step,
and the cursor after it) and asks what to read ahead (:meth:`StepPlans.upcoming`: the records of
the next steps the plan already knows) or, for a source whose lengths cost a tokenization, which
stream positions the next step will read lengths of (:meth:`StepPlans.lengths_ahead`), so that it
can have them computed first. The planner reads lengths through the dataset's ``lengths`` only.

Example:
    >>> import numpy as np
    >>> from portable_loader.batch_spec import BatchSpec, as_schedule
    >>> from portable_loader.dataset import source
    >>> ds = source([{"input_ids": np.arange(n)} for n in range(1, 11)])
    >>> spec = BatchSpec(as_schedule(4), seq_len=8, num_epochs=1)
    >>> plans = StepPlans(spec, spec.planner(ds, spec.order(ds)), Cursor(0, 0, 0))
    >>> rows, cursor = plans.next()
    >>> len(rows), cursor.samples, plans.upcoming().size   # 4 records served; 6 more in this epoch
    (4, 4, 6)
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from portable_loader.plan import Cursor, Planner

__all__ = ["Cursor", "StepPlans"]


class StepPlans:
    """This host's step plans from ``cursor`` on, planned by ``planner`` (``spec``'s stream).

    ``cursor`` is where the next step starts; ``next()`` returns ``(rows, cursor after the step)``
    or None at the end of a finite stream.

    Example:
        >>> import numpy as np
        >>> from portable_loader.batch_spec import BatchSpec, as_schedule
        >>> from portable_loader.dataset import source
        >>> ds = source([{"input_ids": np.arange(n)} for n in (9, 3, 4, 12)])
        >>> spec = BatchSpec(as_schedule(2), seq_len=8, packing=True, overlong="split", num_epochs=1)
        >>> plans = StepPlans(spec, spec.planner(ds, spec.order(ds)), Cursor(0, 0, 0))
        >>> list(plans.lengths_ahead())     # the next step packs window 0: positions 0..3
        [(0, 4)]
        >>> steps = []
        >>> while (planned := plans.next()) is not None:
        ...     steps.append(planned[0])
        >>> sum(end - start for rows in steps for row in rows for _, start, end in row)   # every token once
        28
    """

    def __init__(self, spec, planner: Planner, cursor: Cursor):
        self.spec, self.planner, self.cursor = spec, planner, cursor

    @property
    def order(self):
        """The stream order the plans follow (a mixture's online stages included)."""
        return self.planner.sampler

    @property
    def total(self) -> int | None:
        """Stream positions in a finite stream (epochs x records); None when endless."""
        return self.planner.total

    def records(self, lo: int, hi: int) -> np.ndarray:
        """The record indices at stream positions ``[lo, hi)`` (what a block of positions reads)."""
        return self.planner.records(lo, hi)

    def next(self) -> tuple[list, Cursor] | None:
        planned = self.planner.step(self.cursor)
        if planned is None:
            return None
        rows, self.cursor = planned
        return self.spec.local_rows(rows), self.cursor

    def upcoming(self) -> np.ndarray:
        """This host's records among the next steps' that the plan knows (none when that is unclear).

        Padding: the rest of the chunk of positions the next step is in; packing: the window it is
        in, on one host only (other hosts' rows of a window are not worth reading).
        """
        spec = self.spec
        recs = self.planner.upcoming(self.cursor)
        if spec.shard_count == 1:
            return recs
        if spec.packing or not spec.schedule.fixed:
            return recs[:0]  # other hosts' rows are not worth reading; each step reads its own
        # Padding at a fixed size: position lo + j is row j % B of its step, and this host's rows
        # are [shard * b, (shard + 1) * b).
        size = spec.schedule.stages[0][1]
        b = size // spec.shard_count
        row = np.arange(recs.size) % size
        return recs[row // b == spec.shard_index]

    def lengths_ahead(self) -> Iterator[tuple[int, int]]:
        """Spans ``[lo, hi)`` of stream positions whose record lengths the next step reads.

        Each span is yielded before the planner reads its lengths: a caller that makes them known
        (tokenizes them elsewhere) as they come leaves the planner nothing to compute. Packing: the
        windows a skip passes over (their rows are counted), then those the step takes rows from
        (whether it needs one more is known only once the window before is packed, from the
        lengths the caller made known); padding: the step's positions (with a filter, more
        positions may follow: the dataset computes those itself).
        """
        planner = self.planner
        cur = planner.resolve(self.cursor)
        if not planner.packing:
            cur = planner.jump(cur) if planner.skips else cur
            hi = cur.samples + planner.sizes.size(cur.step, cur.samples)
            if planner.total is not None:
                hi = min(hi, planner.total)
            if cur.samples < hi:
                yield cur.samples, hi
            return
        skipped = planner.skip_target(cur.samples) - cur.samples
        if skipped:
            yield from self._windows(cur.window, cur.row, skipped)
            cur = planner.jump(cur)  # its windows are packed now: the jump reads nothing new
        yield from self._windows(cur.window, cur.row, planner.sizes.size(cur.step, cur.samples))

    def _windows(self, w: int, r: int, rows: int) -> Iterator[tuple[int, int]]:
        """The positions of each window holding the next ``rows`` rows from row ``r`` of window ``w``,
        each yielded before the window is packed."""
        planner = self.planner
        last, size, empty = planner.num_windows, planner.window, 0
        # Windows a filter leaves empty: as many as the planner passes before it gives up (FilterError).
        while rows > 0 and (last is None or w < last) and empty * size < planner.max_rejected:
            lo = w * size
            yield lo, lo + size if planner.total is None else min(lo + size, planner.total)
            n = planner.rows_in_window(w)
            rows -= n - r
            w, r, empty = w + 1, 0, 0 if n else empty + 1
