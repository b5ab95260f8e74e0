"""Copies to a CUDA device straight from the loader's batch blocks, registered as page-locked memory.

A batch arrives in one of the loader's blocks (``engine/blocks.py``: a worker's shared memory, or
the trainer's process's own memory without workers). torch's ``pin_memory()`` would copy it once
more, into memory of its pinned allocator, before the copy to the device. Instead
:class:`HostBlocks` registers each block once with ``cudaHostRegister`` (blocks are reused, so a
registration serves every batch the block carries) and the device copy reads what the worker
wrote, by DMA, asynchronously. A block is unregistered when its mapping goes (the pool retired or
closed it and no array of it is left).

Registered memory has no guard of torch's caching host allocator: nothing would stop the loader
from reusing a block while a copy out of it still runs. So :class:`InFlight` keeps each batch's host
arrays referenced (the loader reuses a block only when nothing refers to it) until the event
recorded after its copies has completed.

A block that cannot be registered (an error from the driver, a platform without it) is copied the
ordinary way, through ``pin_memory()``.

Example (needs a CUDA GPU):
    >>> import portable_loader as pl
    >>> from portable_loader.precache import sample_args
    >>> loader = pl.DataLoader(pl.open_cache(pl.precache(**sample_args(), out="cache")), global_batch_size=8, seq_len=128)
    >>> blocks, flight = HostBlocks(), InFlight()
    >>> with iter(loader) as it:                        # needs a CUDA GPU  # doctest: +SKIP
    ...     batch = next(it)
    ...     host = {k: blocks.pinned(v) for k, v in batch.items()}   # page-locked views, no copy
    ...     on_gpu = {k: t.to("cuda", non_blocking=True) for k, t in host.items()}
    ...     flight.add(host)                                    # kept until the copies are done
"""

from __future__ import annotations

import collections
import mmap
import weakref

import numpy as np
import torch

__all__ = ["HostBlocks", "InFlight"]

_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context


def block_of(array: np.ndarray) -> mmap.mmap | None:
    """The loader block ``array`` views (the ``mmap`` at the end of its base chain), or None."""
    base = array.base
    while isinstance(base, np.ndarray):
        base = base.base
    return base if isinstance(base, mmap.mmap) else None


class HostBlocks:
    """Registers the loader's blocks with CUDA as page-locked memory, each once, while they live."""

    def __init__(self):
        self._registered: dict[int, bool] = {}  # id of a live block's mmap -> registered (False: it failed)

    def pinned(self, array: np.ndarray) -> torch.Tensor:
        """``array`` as a page-locked CPU tensor: a view of its registered block, else a pinned copy."""
        mm = block_of(array)
        if mm is None or not array.flags.c_contiguous or not self._register(mm):
            return torch.from_numpy(np.ascontiguousarray(array)).pin_memory()
        return torch.from_numpy(array)

    def _register(self, mm: mmap.mmap) -> bool:
        key = id(mm)
        done = self._registered.get(key)
        if done is not None:
            return done
        whole = np.frombuffer(mm, np.uint8)
        ptr, size = whole.ctypes.data, whole.size
        del whole  # (a buffer exported from the mmap would stop its close)
        cudart = torch.cuda.cudart()
        ok = int(cudart.cudaHostRegister(ptr, size, _PORTABLE)) == 0
        if not ok:
            torch.cuda.cudart().cudaGetLastError()  # the failed call's error is not a later kernel's
        self._registered[key] = ok
        # The mapping is gone (no array of it left, so no copy from it in flight): forget it, and
        # release the driver's hold on its pages.
        weakref.finalize(mm, _forget, self._registered, key, ptr if ok else None).atexit = False  # (the driver frees all at exit)
        return ok


def _forget(registered: dict, key: int, ptr: int | None) -> None:
    registered.pop(key, None)
    if ptr is not None:
        torch.cuda.cudart().cudaHostUnregister(ptr)


class InFlight:
    """Host arrays of batches whose copies to the device may still run, each kept until its event
    (recorded on the copying stream after the copies) has completed."""

    def __init__(self):
        self._pending: collections.deque = collections.deque()

    def add(self, host, stream: torch.cuda.Stream | None = None) -> None:
        """Keep ``host`` (the batch's page-locked tensors) until the copies issued so far on ``stream``
        (the current stream by default) are done."""
        event = torch.cuda.Event()
        event.record(stream)
        self._pending.append((event, host))
        while self._pending and self._pending[0][0].query():  # (in order: each event is later than the one before)
            self._pending.popleft()

    def drain(self) -> None:
        """Wait for every copy still running; then nothing is kept."""
        while self._pending:
            self._pending.popleft()[0].synchronize()
