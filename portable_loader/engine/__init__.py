"""Fetch and collate engines: inline, a prefetch thread, or worker processes.

Every engine carries out row plans the ``Planner`` already fixed, through the same ``build_batch``,
so the engine changes how fast batches come, never what they hold. ``start`` picks one from the
loader's ``num_workers`` and ``prefetch``; over a remote cache (or a mixture of them), a
:class:`FetchAhead` thread per cache also reserves the shards of the steps ahead (after the
workers are forked). Nothing here imports ``portable_loader.loader``.

Example:
    >>> from contextlib import closing
    >>> import portable_loader as pl
    >>> from portable_loader.plan import Cursor
    >>> from portable_loader.precache import sample_args
    >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache"))
    >>> loader = pl.DataLoader(src, global_batch_size=8, seq_len=128)   # no workers, prefetch=2
    >>> with closing(start(loader, loader.planner(), Cursor(0, 0, 0))) as engine:
    ...     batch, cursor = engine.next()
    >>> type(engine).__name__, batch["input_ids"].shape, cursor.step   # the prefetch thread's engine
    ('Producer', (8, 128), 1)
"""

from __future__ import annotations

from portable_loader.engine.fetch_ahead import FetchAhead, remotes_of
from portable_loader.engine.inline import InlineEngine, build_batch
from portable_loader.engine.processes import ProcessEngine
from portable_loader.engine.threads import Producer, WorkerError, thread_engine
from portable_loader.plan import Cursor, Planner

__all__ = ["FetchAhead", "InlineEngine", "ProcessEngine", "Producer", "WorkerError", "build_batch", "start", "thread_engine"]


def start(loader, planner: Planner, cursor: Cursor, thread: bool = True):
    """The engine for ``loader``'s settings, starting at ``cursor``: processes, a thread, or inline
    (``thread=False``: inline instead of the prefetch thread)."""
    if loader.num_workers > 0:
        engine = ProcessEngine(loader, planner, cursor)
    elif loader.prefetch > 0 and thread:
        engine = thread_engine(loader, planner, cursor)
    else:
        engine = InlineEngine(loader, planner, cursor)
    for lo, hi, remote in remotes_of(loader.source):  # one fetch-ahead thread per remote cache
        engine = FetchAhead(engine, loader, remote, cursor, part=(lo, hi))
    return engine
