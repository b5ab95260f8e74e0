"""Shared-memory blocks that carry batches from a worker to the trainer's process without a copy.

A block is an anonymous shared memory file (``memfd_create``; an unlinked temporary file where
that is missing): it has no name, so no process, killed or not, can leave it behind in
``/dev/shm``. The parent creates each block, maps it, and hands its descriptor to the worker with
the first task that uses it; the worker maps it too and collates the batch straight into it
(:func:`portable_loader.collate.collating_into`); the parent then serves numpy arrays over its own
mapping. The only bytes that travel are a task and a one-line answer.

**Reuse, never overwrite.** Every array the parent hands out is made over the block's ``mmap``
object, and every view of such an array keeps it referenced, so the mapping's reference count
says whether anything of the trainer still holds a batch in it. The block keeps one array a field
over its mapping and hands out views of those (a view keeps its array referenced, so their
reference counts say the same for them). A block goes to a new task only when nothing
but the block itself refers to either. A block still held when its worker needs one is *retired*: the pool forgets it
(its memory lives on in the caller's arrays and is freed with the last of them) and makes a new
one. So each worker's pool holds at most ``keep`` blocks, and whatever else exists is what the
caller chose to keep, as with any numpy array. Reusing the blocks is what keeps the trainer's
process free of per-batch work: its page tables stay populated, where a fresh mapping a batch
costs a page fault every 4 KiB of it on first read.

Example:
    >>> pool = Pool(keep=2)
    >>> layout = Layout.of(2, 4, ("input_ids", "attention_mask"))
    >>> block, new = pool.take(layout.size)
    >>> worker = WorkerBlocks()
    >>> worker.learn(block.id, os.dup(block.fd) if new else None, layout.size)   # a worker gets its own copy
    >>> from portable_loader.collate import collating_into, new_fields
    >>> with collating_into(worker.allocator(block.id, layout)):
    ...     built = new_fields(2, 4, 5, ("input_ids", "attention_mask"))
    >>> built["input_ids"][0, 0] = 1
    >>> worker.placed(block.id, layout, built)
    True
    >>> batch = pool.arrays(block, layout)          # the parent's arrays over the same memory
    >>> batch["input_ids"].tolist()
    [[1, 5, 5, 5], [5, 5, 5, 5]]
    >>> pool.take(layout.size)[0] is block          # still held by `batch`: another block
    False
    >>> del batch, built; pool.done(block)
    >>> pool.close(); worker.close()
"""

from __future__ import annotations

import functools
import itertools
import mmap
import os
import sys
import tempfile

import numpy as np

from portable_loader.collate import FIELD_DTYPES

__all__ = ["Block", "Layout", "Pool", "WorkerBlocks", "shm_error"]

_ALIGN = 64
_ids = itertools.count()


def _anonymous_file(size: int) -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("portable_loader-batch", os.MFD_CLOEXEC)
    else:  # no memfd: a file unlinked at once, in /dev/shm where it exists
        f = tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        fd = os.dup(f.fileno())
        f.close()
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def shm_error(size: int, e: OSError) -> OSError:
    """The error for a block of ``size`` bytes that could not be made or filled: say what to free or set."""
    return OSError(e.errno, f"could not make a {size:,}-byte shared-memory block for a batch ({e.strerror}): "
                   "shared memory (/dev/shm, and the memory limit of this container) is full or too small for "
                   "the loader's workers: free some, raise it (docker --shm-size), or lower num_workers, "
                   "prefetch or the batch size")


class Layout:
    """Where each field of a batch of ``rows x seq_len`` lies in a block: ``(name, dtype, offset)``."""

    __slots__ = ("rows", "seq_len", "fields", "size")

    def __init__(self, rows: int, seq_len: int, fields: tuple):
        self.rows, self.seq_len, self.size = rows, seq_len, 0
        at, placed = 0, []
        for name in fields:
            dtype = FIELD_DTYPES[name]
            placed.append((name, dtype, at))
            at += -(-rows * seq_len * dtype.itemsize // _ALIGN) * _ALIGN
        self.fields, self.size = tuple(placed), max(at, _ALIGN)

    @classmethod
    def of(cls, rows: int, seq_len: int, fields) -> "Layout":
        """The layout for these sizes, made once (each step asks for one)."""
        return _layout(int(rows), int(seq_len), tuple(fields))


@functools.lru_cache(maxsize=64)
def _layout(rows: int, seq_len: int, fields: tuple) -> Layout:
    return Layout(rows, seq_len, fields)


class Block:
    """One block of a pool: id, descriptor (-1 for a private block), mapping, size in bytes."""

    __slots__ = ("id", "fd", "mm", "size", "handed")

    def __init__(self, size: int, shared: bool = True):
        self.id, self.size = next(_ids), size
        self.handed: tuple | None = None  # (layout, its arrays): what Pool.arrays hands out again
        if not shared:  # the process's own memory: a prefetch thread's batches
            self.fd, self.mm = -1, mmap.mmap(-1, size)
            return
        try:
            self.fd = _anonymous_file(size)
        except OSError as e:
            raise shm_error(size, e) from e
        self.mm = mmap.mmap(self.fd, size)

    def held(self) -> bool:
        """Whether an array handed out over this block is still alive (see the module's docstring)."""
        kept = 0
        if self.handed is not None:  # the arrays kept for reuse: any reference beyond ours is the caller's
            for a in self.handed[1].values():
                if sys.getrefcount(a) > 3:  # the dict, ``a`` and getrefcount's own argument
                    return True
            kept = len(self.handed[1])
        return sys.getrefcount(self.mm) > 2 + kept  # self.mm, getrefcount's argument and the kept arrays

    def forget(self) -> None:
        """Drop the pool's hold: the descriptor closes, the mapping stays while arrays use it."""
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.mm, self.handed = -1, None, None


class Pool:
    """One worker's blocks, as the parent sees them: at most ``keep``; ``take`` one for a task, ``done`` after.

    ``shared=False``: blocks of this process's own memory, for batches collated in this process (a
    prefetch thread's): reused the same way, so their pages stay mapped too.
    """

    def __init__(self, keep: int, shared: bool = True):
        self.keep, self.shared = max(1, keep), shared
        self.blocks: list[Block] = []
        self.busy: set = set()  # ids of blocks a task in flight writes into
        self.retired: list[int] = []  # ids the worker should unmap, told with its next task

    def take(self, size: int) -> tuple[Block, bool]:
        """A block of at least ``size`` bytes that nothing refers to, and whether it is new to the worker."""
        spare = None
        for block in self.blocks:
            if block.id in self.busy or block.held():
                continue
            if block.size >= size:
                self.busy.add(block.id)
                return block, False
            spare = block
        if spare is not None:  # too small: its place goes to a larger block
            self._retire(spare)
        elif len(self.blocks) >= self.keep:  # every block in use: one held by the caller leaves the pool
            held = [b for b in self.blocks if b.id not in self.busy]
            if held:
                self._retire(held[0])
        block = Block(-(-size // mmap.PAGESIZE) * mmap.PAGESIZE, self.shared)
        self.blocks.append(block)
        self.busy.add(block.id)
        return block, True

    def _retire(self, block: Block) -> None:
        self.blocks.remove(block)
        if self.shared:
            self.retired.append(block.id)
        block.forget()

    def done(self, block: Block) -> None:
        """The task writing into ``block`` has answered (or was dropped)."""
        self.busy.discard(block.id)

    def allocator(self, block: Block, layout: Layout):
        """``alloc(name, size)`` for :class:`portable_loader.collate.collating_into`: the field's place in ``block``."""
        return _allocator(block.mm, layout)

    def arrays(self, block: Block, layout: Layout) -> dict[str, np.ndarray]:
        """The batch in ``block``: one array per field over the parent's mapping, no copy.

        A block keeps its arrays over the mapping and hands out views of them, made again each time
        nothing refers to them any more (``held``): making five arrays over a mapping was a tenth of
        the trainer's work a batch, a view costs a sixth of one, and a caller that reshapes or
        freezes its arrays in place changes its views, never the next batch's.
        """
        handed = block.handed
        if handed is None or handed[0] is not layout:
            shape, mm = (layout.rows, layout.seq_len), block.mm
            handed = block.handed = (layout, {name: np.ndarray(shape, dtype, buffer=mm, offset=at)
                                              for name, dtype, at in layout.fields})
        return {name: a.view() for name, a in handed[1].items()}

    def close(self) -> None:
        for block in self.blocks:
            block.forget()
        self.blocks, self.busy = [], set()


def _allocator(mm: mmap.mmap, layout: Layout):
    where = {name: (dtype, at) for name, dtype, at in layout.fields}
    given: set = set()

    def alloc(name: str, size: int) -> np.ndarray:
        dtype, at = where[name]
        if name in given:  # a collate that builds parts and joins them: only one of them may live in the block
            return np.empty(size, dtype)
        given.add(name)
        return np.ndarray((size,), dtype, buffer=mm, offset=at)

    return alloc


class WorkerBlocks:
    """A worker's mappings of its parent's blocks, and the allocator that collates into one."""

    def __init__(self):
        self.maps: dict[int, mmap.mmap] = {}

    def learn(self, block: int, fd: int | None, size: int) -> None:
        """Map a new block (its descriptor came with the task; its memory is reserved here, in the worker,
        not in the trainer's process); ``fd`` None: a block known already."""
        if fd is not None:
            try:
                if hasattr(os, "posix_fallocate"):  # the memory now, or a clear error now: not a SIGBUS mid-batch
                    try:
                        os.posix_fallocate(fd, 0, size)
                    except OSError as e:
                        raise shm_error(size, e) from e
                self.maps[block] = mmap.mmap(fd, size)
            finally:
                os.close(fd)

    def forget(self, blocks) -> None:
        for b in blocks:
            self.maps.pop(b, None)  # closed when collected: a batch of ours may still view it

    def allocator(self, block: int, layout: Layout):
        """``alloc(name, size)`` for :class:`portable_loader.collate.collating_into`: the field's place in ``block``."""
        return _allocator(self.maps[block], layout)

    def placed(self, block: int, layout: Layout, batch: dict) -> bool:
        """Put ``batch`` where ``layout`` says (copying what was not collated in place); False if it does not fit."""
        shape = (layout.rows, layout.seq_len)
        if set(batch) != {name for name, _, _ in layout.fields}:
            return False
        mm = self.maps[block]
        for name, dtype, at in layout.fields:
            values = batch[name]
            if values.shape != shape or values.dtype != dtype:
                return False
            target = np.ndarray(shape, dtype, buffer=mm, offset=at)
            if values.__array_interface__["data"][0] != target.__array_interface__["data"][0]:
                target[...] = values  # not collated in place (a source's own collate): one copy, here
        return True

    def close(self) -> None:
        self.maps.clear()
