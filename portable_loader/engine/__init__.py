"""Fetch and collate engines: inline, a prefetch thread, or worker processes.

Every engine carries out the finished plans of a ``StepPlans`` (rows the ``Planner`` already
fixed) through the same ``build_batch``, so the engine changes how fast batches come, never what
they hold. An engine receives the loader's ``BatchSpec``, its dataset and the plans, never the
loader. ``start`` picks one from the spec's ``num_workers`` and ``prefetch``; over a remote cache
(or a mixture of them), a :class:`FetchAhead` thread per cache also reserves the shards of the
steps ahead (after the workers are forked). Nothing here imports ``portable_loader.loader``.

Example:
    >>> from contextlib import closing
    >>> import portable_loader as pl
    >>> from portable_loader.precache import sample_args
    >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache"))
    >>> loader = pl.DataLoader(src, global_batch_size=8, seq_len=128)   # no workers, prefetch=2
    >>> plans = StepPlans(loader.spec, loader.planner(), Cursor(0, 0, 0))
    >>> with closing(start(loader.spec, loader.source, plans)) as engine:
    ...     batch, cursor = engine.next()
    >>> type(engine).__name__, batch["input_ids"].shape, cursor.step   # the prefetch thread's engine
    ('Producer', (8, 128), 1)
"""

from __future__ import annotations

from portable_loader.engine.fetch_ahead import FetchAhead, remotes_of
from portable_loader.engine.inline import InlineEngine, build_batch
from portable_loader.engine.processes import ProcessEngine
from portable_loader.engine.threads import Producer, WorkerError, thread_engine
from portable_loader.step_plans import Cursor, StepPlans

__all__ = ["FetchAhead", "InlineEngine", "ProcessEngine", "Producer", "WorkerError", "build_batch", "start", "thread_engine"]


def start(spec, source, plans: StepPlans, thread: bool = True):
    """The engine for ``spec`` over ``source``, carrying out ``plans`` from their cursor on:
    processes, a thread, or inline (``thread=False``: inline instead of the prefetch thread)."""
    cursor = plans.cursor
    if spec.num_workers > 0:
        engine = ProcessEngine(spec, source, plans)
    elif spec.prefetch > 0 and thread:
        engine = thread_engine(spec, source, plans)
    else:
        engine = InlineEngine(spec, source, plans)
    for lo, hi, remote in remotes_of(source):  # one fetch-ahead thread per remote cache
        engine = FetchAhead(engine, spec, plans, remote, cursor, part=(lo, hi))
    return engine
