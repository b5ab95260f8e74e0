"""``grain.multiprocessing``: ``MultiprocessingOptions`` here; Grain's shared-memory arrays from Grain, on first use.

Workers here hand elements back pickled; ``SharedMemoryArray`` is Grain's own class for Grain's
engine, forwarded so that code naming it imports.

Example:
    >>> from portable_loader.grain import multiprocessing
    >>> multiprocessing.MultiprocessingOptions(num_workers=2).num_workers
    2
"""

from __future__ import annotations

from portable_loader.grain._unsupported import forward
from portable_loader.grain.options import MultiprocessingOptions

__all__ = ["MultiprocessingOptions", "SharedMemoryArray", "SharedMemoryArrayMetadata"]


def __getattr__(name: str):
    if name in ("SharedMemoryArray", "SharedMemoryArrayMetadata"):
        return forward("grain.multiprocessing", name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
