"""``grain.experimental.pick_performance_config`` on portable_loader's pipelines.

``pick_performance_config`` sizes the workers and the read-ahead buffer from a RAM budget and the
measured size of a few elements, as Grain's does: workers = budget / element size (at most
``max_workers``, default the CPU count), buffer = budget / element size of what the source yields
(at most ``max_buffer_size``, default 1,000). MaxText calls it for ``grain_worker_count=-1``.

Example:
    >>> import numpy as np
    >>> from portable_loader import grain
    >>> ds = grain.MapDataset.range(100).map(lambda i: np.zeros(1024 * 1024, np.uint8)).to_iter_dataset()
    >>> config = pick_performance_config(ds, ram_budget_mb=8, max_workers=16, max_buffer_size=None)
    >>> config.multiprocessing_options.num_workers, config.read_options.prefetch_buffer_size
    (8, 8)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import sys
from typing import Any

import numpy as np

from portable_loader.grain.options import MultiprocessingOptions, ReadOptions

__all__ = ["PerformanceConfig", "pick_performance_config"]

_log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class PerformanceConfig:
    """What :func:`pick_performance_config` chose: options for ``mp_prefetch`` and for ``to_iter_dataset``.

    Example:
        >>> PerformanceConfig().read_options is None
        True
    """

    multiprocessing_options: MultiprocessingOptions | None = None
    read_options: ReadOptions | None = None


def _nbytes(element: Any) -> int:
    if isinstance(element, dict):
        return sum(_nbytes(v) for v in element.values())
    if isinstance(element, (list, tuple)):
        return sum(_nbytes(v) for v in element)
    if isinstance(element, np.ndarray):
        return element.nbytes
    return sys.getsizeof(element)


def _mean_mb(datasets: list, samples: int) -> float:
    """Mean size in MB of the first elements of ``datasets`` (``samples`` in all); 0 when there are fewer."""
    each = -(-samples // len(datasets)) if datasets else 0
    elements = [e for ds in datasets for e in itertools.islice(iter(ds), each)]
    if not datasets or len(elements) < samples:
        _log.warning("pick_performance_config: fewer than %d elements to measure", samples)
        return 0.0
    return float(np.mean([_nbytes(e) for e in elements])) / (1 << 20)


def _unbatched(ds) -> list:
    """The datasets that feed ``to_iter_dataset`` in ``ds``: their elements are what a read-ahead buffer holds."""
    from portable_loader.dataset.iter.dataset import _SourceNode

    if isinstance(ds, _SourceNode):
        return [ds.ds]
    found = [x for parent in getattr(ds, "parents", ()) for x in _unbatched(parent)]
    return found


def pick_performance_config(ds, *, ram_budget_mb: int | None, max_workers: int | None,
                            max_buffer_size: int | None, samples_to_check: int = 5) -> PerformanceConfig:
    """Grain's ``pick_performance_config``: worker count and read-ahead buffer that fit ``ram_budget_mb``.

    Example:
        >>> from portable_loader import grain
        >>> config = pick_performance_config(grain.MapDataset.range(10).to_iter_dataset(), ram_budget_mb=1,
        ...                                  max_workers=4, max_buffer_size=50)
        >>> config.multiprocessing_options.num_workers, config.read_options.prefetch_buffer_size
        (4, 50)
    """
    workers_cap = os.cpu_count() if max_workers is None else max_workers
    buffer_cap = 1000 if max_buffer_size is None else max_buffer_size
    size = _mean_mb([ds], samples_to_check)
    workers = workers_cap if size <= 0 else min(int(ram_budget_mb / size), workers_cap)
    sources = _unbatched(ds)
    source_size = _mean_mb(sources, samples_to_check)
    buffer = buffer_cap if source_size <= 0 else min(int(ram_budget_mb / (source_size * len(sources))), buffer_cap)
    return PerformanceConfig(MultiprocessingOptions(num_workers=workers), ReadOptions(prefetch_buffer_size=buffer))
