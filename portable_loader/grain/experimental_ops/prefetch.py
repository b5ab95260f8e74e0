"""Reading ahead in a thread: Grain's ``ThreadPrefetchIterDataset``, ``ThreadPrefetchDatasetIterator``,
``multithread_prefetch`` and ``device_put``.

A thread calls the parent's ``next`` and reads its state after each element into a bounded queue;
``next`` takes the oldest. The elements are the parent's, in the parent's order, and the state is
the state of the elements taken, never of those read ahead (as Grain's). ``set_state`` stops the
thread, drops what was read ahead and restores the parent; ``close`` (or ``with``, garbage
collection, interpreter exit) stops and joins the thread and closes the parent, so closing the
outermost iterator of a pipeline leaves no thread behind. A buffer of 0 reads in the caller's
thread. An error in the parent reaches the caller at the element where it happened.

Inside our pipelines ``ThreadPrefetchIterDataset`` is a step whose state is its parent's position
(no field of its own) and whose fingerprint is its parent's. ``multithread_prefetch`` reads ahead
with one such thread at any ``num_threads``: Grain's splits the dataset into ``num_threads`` slices
read by as many threads and interleaves them, so its order changes with the thread count; here,
as for ``mp_prefetch``, it does not (``mp_prefetch`` is where per-element work runs in parallel).

Example:
    >>> import threading
    >>> from portable_loader import grain
    >>> ds = ThreadPrefetchIterDataset(grain.MapDataset.range(6).to_iter_dataset(), prefetch_buffer_size=2)
    >>> with iter(ds.batch(2)) as it:
    ...     first = next(it).tolist()
    ...     state = it.get_state()
    >>> first, {k[2:]: int(v) for k, v in state["cursor"].items()}
    ([0, 1], {'source.position': 2})
    >>> [t.name for t in threading.enumerate() if t.name.startswith("portable-loader-prefetch")]
    []
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable

import numpy as np

from portable_loader.dataset.iter.dataset import IterDataset
from portable_loader.dataset.iter.iterator import DatasetIterator
from portable_loader.dataset.iter.runtime import next_index, set_next_index
from portable_loader.grain.experimental_ops.parts import GrainStyleIterator

__all__ = ["ThreadPrefetchDatasetIterator", "ThreadPrefetchIterDataset", "device_put", "multithread_prefetch"]

_POLL_S = 0.05  # how often a thread blocked on a full queue checks whether it is told to stop


class ReadAhead:
    """A thread that calls ``produce()`` (an element and the state after it) into a queue of ``size``.

    Example:
        >>> items = iter(range(3))
        >>> ahead = ReadAhead(lambda: (next(items), "s"), size=2)
        >>> ahead.get(), ahead.get(), ahead.get()
        ((0, 's'), (1, 's'), (2, 's'))
        >>> ahead.get()
        Traceback (most recent call last):
        ...
        StopIteration
        >>> ahead.halt(); ahead.thread is None
        True
    """

    def __init__(self, produce: Callable[[], tuple], size: int):
        self.produce, self.size = produce, size
        self.queue: queue.Queue = queue.Queue(maxsize=max(size, 1))
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def get(self) -> tuple:
        """The next (element, state), or the parent's exception (``StopIteration`` at its end)."""
        if self.size == 0:
            return self.produce()
        if self.thread is None:
            self.stop.clear()
            self.thread = threading.Thread(target=self._run, args=(self.stop,), daemon=True,
                                           name="portable-loader-prefetch")
            self.thread.start()
        element, state, error = self.queue.get()
        if error is not None:
            self.halt()  # the next call starts over from the parent, as Grain's does
            raise error
        return element, state

    def _run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                element, state = self.produce()
                if not self._put((element, state, None), stop):
                    return
        except BaseException as e:  # noqa: BLE001 (StopIteration and any error travel to the caller)
            self._put((None, None, e), stop)

    def _put(self, item: tuple, stop: threading.Event) -> bool:
        while not stop.is_set():
            try:
                self.queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def halt(self) -> None:
        """Stop and join the thread and drop what it read ahead; safe to call when none runs."""
        if self.thread is None:
            return
        self.stop.set()
        self.thread.join()
        self.thread = None
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                return


def _check_size(size) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise TypeError(f"prefetch_buffer_size must be an integer, got {type(size).__name__}")
    if size < 0:
        raise ValueError(f"`prefetch_buffer_size` must be greater than or equal to 0, got {size}.")
    return int(size)


class ThreadPrefetchIterDataset(IterDataset):
    """Grain's ``ThreadPrefetchIterDataset(parent, *, prefetch_buffer_size)``: ``parent`` read ahead in a thread.

    Example:
        >>> from portable_loader import grain
        >>> list(ThreadPrefetchIterDataset(grain.MapDataset.range(3).to_iter_dataset(), prefetch_buffer_size=10))
        [0, 1, 2]
        >>> ThreadPrefetchIterDataset(grain.MapDataset.range(3).to_iter_dataset(), prefetch_buffer_size=-1)
        Traceback (most recent call last):
        ...
        ValueError: `prefetch_buffer_size` must be greater than or equal to 0, got -1.
    """

    def __init__(self, parent, *, prefetch_buffer_size: int):
        from portable_loader.dataset.iter.pack import as_iter_dataset

        self._prefetch_buffer_size = _check_size(prefetch_buffer_size)
        super().__init__((as_iter_dataset(parent, "ThreadPrefetchIterDataset"),))

    def _identity(self) -> tuple:
        return self._parent._identity()  # reading ahead changes no element, so a state resumes without it

    def __iter__(self) -> DatasetIterator:
        """The pipeline's iterator; over a user's own ``IterDataset`` (its ``__iter__`` is its iterator),
        that iterator read ahead by a :class:`ThreadPrefetchDatasetIterator`, as Grain does.

        Example:
            >>> from portable_loader import grain
            >>> class Evens(grain.IterDataset):
            ...     def __iter__(self):
            ...         return iter(grain.MapDataset.range(0, 6, 2).to_iter_dataset())
            >>> list(ThreadPrefetchIterDataset(Evens(), prefetch_buffer_size=2))
            [0, 2, 4]
        """
        parent = self._parent
        if type(parent).__iter__ is not IterDataset.__iter__ and not hasattr(parent, "_make_part"):
            return ThreadPrefetchDatasetIterator(parent.__iter__(), self._prefetch_buffer_size)
        return super().__iter__()

    def _make_part(self, children: list, n: int) -> "ThreadPrefetchIter":
        return ThreadPrefetchIter(children[0], self._prefetch_buffer_size)

    def __str__(self) -> str:
        return f"ThreadPrefetchIterDataset(prefetch_buffer_size={self._prefetch_buffer_size})"


class ThreadPrefetchIter:
    """The running part of :class:`ThreadPrefetchIterDataset`: its state is the parent's, at the elements taken.

    Example:
        >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
        >>> from portable_loader.dataset.iter.iterator import _compile
        >>> part = ThreadPrefetchIter(_compile(to_iter_dataset(range(100))), 8)
        >>> part.next(), part.fields()
        (0, {'0.source.position': 1})
        >>> part.close()
    """

    def __init__(self, child, size: int):
        self.child = child
        self.current = child.fields()
        self.ahead = ReadAhead(self._produce, size)

    def _produce(self) -> tuple:
        element = self.child.next()
        return element, self.child.fields()

    def next(self):
        element, self.current = self.ahead.get()
        return element

    def fields(self) -> dict:
        return dict(self.current)

    def field_names(self) -> list[str]:
        return self.child.field_names()

    def restore(self, fields: dict, refuse) -> None:
        self.ahead.halt()
        self.child.restore(fields, refuse)
        self.current = self.child.fields()

    def next_index(self) -> int:
        self.ahead.halt()
        self.child.restore(self.current, ValueError)
        return next_index(self.child)

    def set_next_index(self, index: int) -> None:
        self.ahead.halt()
        set_next_index(self.child, index)
        self.current = self.child.fields()

    def close(self) -> None:
        self.ahead.halt()
        self.child.close()


class ThreadPrefetchDatasetIterator(GrainStyleIterator):
    """Grain's ``ThreadPrefetchDatasetIterator(parent, prefetch_buffer_size)``: any iterator with
    ``get_state``/``set_state`` read ahead in a thread; ``get_state`` is the parent's state at the elements taken.

    Example:
        >>> from portable_loader import grain
        >>> parent = iter(grain.MapDataset.range(5).to_iter_dataset())
        >>> with ThreadPrefetchDatasetIterator(parent, 3) as it:
        ...     next(it), next(it), it.get_state()["cursor"]
        (0, 1, {'0.source.position': '00000000000000000002'})
    """

    def __init__(self, parent, prefetch_buffer_size: int):
        super().__init__(parent if isinstance(parent, DatasetIterator) else ())
        self._maybe_nonnative_parent = parent
        self._state = copy.deepcopy(parent.get_state())
        self._ahead = ReadAhead(self._produce, _check_size(prefetch_buffer_size))

    def _produce(self) -> tuple:
        element = next(self._maybe_nonnative_parent)
        return element, copy.deepcopy(self._maybe_nonnative_parent.get_state())

    def __next__(self):
        if self._closed:
            raise ValueError("Attempting to use a closed iterator.")
        element, self._state = self._ahead.get()
        return element

    def get_state(self):
        return self._state

    def set_state(self, state) -> None:
        self._ahead.halt()
        self._maybe_nonnative_parent.set_state(state)
        self._state = copy.deepcopy(self._maybe_nonnative_parent.get_state())

    def start_prefetch(self) -> None:
        """Nothing to do ahead of the first ``next``: the thread starts then.

        Example:
            >>> from portable_loader import grain
            >>> with ThreadPrefetchDatasetIterator(iter(grain.MapDataset.range(2).to_iter_dataset()), 1) as it:
            ...     it.start_prefetch(); list(it)
            [0, 1]
        """

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._ahead.halt()
        super().close()

    def __str__(self) -> str:
        return f"ThreadPrefetchDatasetIterator(prefetch_buffer_size={self._ahead.size})"


def multithread_prefetch(ds, num_threads: int, buffer_size: int, sequential_slice: bool = False):
    """Grain's ``multithread_prefetch``: ``ds`` read ahead by a thread, in ``ds``'s order at any ``num_threads``.

    ``num_threads=0`` returns ``ds`` (as Grain); ``sequential_slice`` changes nothing (no thread
    owns a slice here).

    Example:
        >>> from portable_loader import grain
        >>> list(multithread_prefetch(grain.MapDataset.range(5).to_iter_dataset(), num_threads=4, buffer_size=2))
        [0, 1, 2, 3, 4]
    """
    if isinstance(num_threads, bool) or not isinstance(num_threads, (int, np.integer)) or num_threads < 0:
        raise ValueError(f"num_threads must be an integer >= 0, got {num_threads!r}")
    _check_size(buffer_size)
    if num_threads == 0:
        return ds
    return ThreadPrefetchIterDataset(ds, prefetch_buffer_size=buffer_size)


class _DevicePut:
    """The map of :func:`device_put`: ``jax.device_put(element, device)``."""

    def __init__(self, device):
        self.device = device

    def __call__(self, element):
        import jax

        return jax.device_put(element, self.device)


def device_put(ds, device, *, cpu_buffer_size: int = 4, device_buffer_size: int = 2) -> IterDataset:
    """Grain's ``device_put``: ``ds``'s elements put on ``device`` (what ``jax.device_put`` takes), read ahead.

    A thread reads ``cpu_buffer_size`` elements ahead, a second one puts ``device_buffer_size``
    on the device ahead; closing the iterator stops and joins both.

    Example:
        >>> import jax   # needs jax
        >>> from portable_loader import grain
        >>> ds = device_put(grain.MapDataset.range(4).to_iter_dataset().batch(2), jax.devices()[0])
        >>> with iter(ds) as it:
        ...     [type(b).__name__ for b in it]
        ['ArrayImpl', 'ArrayImpl']
    """
    import jax  # noqa: F401 (as Grain: without JAX this is an ImportError when called, not when imported)

    ds = ThreadPrefetchIterDataset(ds, prefetch_buffer_size=cpu_buffer_size)
    ds = ds.map(_DevicePut(device))
    return ThreadPrefetchIterDataset(ds, prefetch_buffer_size=device_buffer_size)
