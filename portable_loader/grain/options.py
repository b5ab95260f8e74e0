"""``ReadOptions`` and ``MultiprocessingOptions``: Grain's option classes, with Grain's fields and defaults.

Grain's own instances are accepted wherever these are (everything reads them by attribute), and
these are accepted by real Grain's ``to_iter_dataset`` and ``mp_prefetch`` for the same reason.

Example:
    >>> from portable_loader.grain import MapDataset, MultiprocessingOptions, ReadOptions
    >>> ds = MapDataset.range(6).to_iter_dataset(ReadOptions(num_threads=0)).map(lambda x: x * x)
    >>> with iter(ds.mp_prefetch(MultiprocessingOptions(num_workers=2))) as it:
    ...     list(it)
    [0, 1, 4, 9, 16, 25]
"""

from __future__ import annotations

import dataclasses
import logging

__all__ = ["MultiprocessingOptions", "ReadOptions"]


# Not frozen, as in Grain: code that sets ``options.num_threads = 0`` after building one must still run.
@dataclasses.dataclass(slots=True)
class ReadOptions:
    """How ``to_iter_dataset`` reads its source: ``num_threads`` threads keep ``prefetch_buffer_size`` elements ahead.

    The elements never depend on these (docs/grain.md). ``DataLoader(read_options=None)`` reads
    without threads here, where Grain starts 16: threads slow down Python-bound sources (the GIL)
    and help sources that wait on I/O, so pass ``ReadOptions()`` for those.

    Example:
        >>> ReadOptions()
        ReadOptions(num_threads=16, prefetch_buffer_size=500)
        >>> ReadOptions(num_threads=-1)
        Traceback (most recent call last):
        ...
        ValueError: num_threads must be non-negative, got -1
    """

    num_threads: int = 16
    prefetch_buffer_size: int = 500

    def __post_init__(self):
        if isinstance(self.num_threads, int) and self.num_threads < 0:
            raise ValueError(f"num_threads must be non-negative, got {self.num_threads}")
        if isinstance(self.prefetch_buffer_size, int) and self.prefetch_buffer_size < 0:
            raise ValueError(f"prefetch_buffer_size must be non-negative, got {self.prefetch_buffer_size}")
        if 0 < self.prefetch_buffer_size < self.num_threads:
            # A log line, as Grain's: a slow setting, not a wrong one.
            logging.getLogger(__name__).warning(
                "prefetch_buffer_size=%s is smaller than num_threads=%s: at most %s threads can read at once",
                self.prefetch_buffer_size, self.num_threads, self.prefetch_buffer_size)


@dataclasses.dataclass(slots=True)
class MultiprocessingOptions:
    """Worker processes for ``mp_prefetch`` and ``DataLoader``: ``num_workers`` (0: none), each ``per_worker_buffer_size`` ahead.

    Here the worker count changes speed only: the stream, and what a state means, are the same for
    every count, so a state saved with 4 workers resumes with 0 or 16. ``enable_profiling`` is
    accepted and does nothing.

    Example:
        >>> MultiprocessingOptions(num_workers=4)
        MultiprocessingOptions(num_workers=4, per_worker_buffer_size=1, enable_profiling=False)
    """

    num_workers: int = 0
    per_worker_buffer_size: int = 1
    enable_profiling: bool = False
