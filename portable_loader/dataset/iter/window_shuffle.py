"""Grain's ``WindowShuffleIterDataset``: the stream cut into windows of ``window_size`` elements, each shuffled.

``WindowShuffleIterDataset(parent, window_size=W, seed=s)`` reads ``W`` elements of ``parent``,
emits them in a shuffled order, reads the next ``W``, and so on; the last window holds what is
left. As in Grain, every element of a window comes out before the next window is read, and each
window comes out in Grain's order: window ``w`` of ``n`` elements is permuted by Grain's
``index_shuffle`` keyed by ``seed + w`` (:mod:`portable_loader.orders.index_shuffle`) and emitted
from its last slot to its first, as Grain pops it, so the elements are Grain's one for one.

The state is a position, in our format: the parent's position fields at the start of the current
window, ``<n>.window_shuffle.window`` (its number) and ``<n>.window_shuffle.index`` (how many of its
elements were emitted). Grain saves the parent's state at the window's start too, and replays the
window's reads on restore; so does this: restoring re-reads at most ``W`` elements and holds no
element in the state. Once a window is emitted in full, the state is the parent's position after
it, the next window's number and index 0.

Example:
    >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
    >>> ds = WindowShuffleIterDataset(to_iter_dataset(range(10)), window_size=4, seed=1)
    >>> out = list(ds)
    >>> [sorted(out[i:i + 4]) for i in (0, 4, 8)]
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    >>> it = iter(ds); _ = [next(it) for _ in range(6)]
    >>> {k[2:]: int(v) for k, v in it.get_state()["cursor"].items()}
    {'source.position': 4, 'window_shuffle.window': 1, 'window_shuffle.index': 2}
    >>> state = it.get_state(); it2 = iter(ds); it2.set_state(state); list(it2) == out[6:]
    True
"""

from __future__ import annotations

import numpy as np

from portable_loader.orders.index_shuffle import ORDER, IndexShuffle
from portable_loader.dataset.iter.dataset import IterDataset
from portable_loader.dataset.iter.pack import as_iter_dataset

__all__ = ["WindowShuffleIterDataset"]


def window_order(n: int, seed: int, window: int) -> np.ndarray:
    """The order in which window ``window``'s ``n`` elements are emitted: Grain's.

    Grain shuffles the window with ``index_shuffle(., n - 1, seed + window, 4)`` and pops from the
    end. Its key must be a 32-bit integer there; here it wraps (``(seed + window) % 2**32``) where
    Grain's would raise.

    Example:
        >>> sorted(window_order(5, seed=3, window=0).tolist())
        [0, 1, 2, 3, 4]
        >>> window_order(8, 3, 0).tolist() != window_order(8, 3, 1).tolist()
        True
    """
    return IndexShuffle(n - 1, (int(seed) + int(window)) & 0xFFFFFFFF)(np.arange(n - 1, -1, -1))


class WindowShuffleIterDataset(IterDataset):
    """Grain's ``WindowShuffleIterDataset(parent, *, window_size, seed)``: windows of elements, each shuffled.

    ``window_size`` must be a positive integer, ``seed`` an integer (as in Grain, no default
    seeding: it is required). ``parent`` is an ``IterDataset`` or a random-access dataset.

    Example:
        >>> from portable_loader.grain import MapDataset
        >>> ds = WindowShuffleIterDataset(MapDataset.range(6).to_iter_dataset(), window_size=3, seed=0)
        >>> out = list(ds)
        >>> sorted(out[:3]), sorted(out[3:])
        ([0, 1, 2], [3, 4, 5])
    """

    def __init__(self, parent, *, window_size: int, seed: int):
        super().__init__((as_iter_dataset(parent, "WindowShuffleIterDataset"),))
        if isinstance(window_size, bool) or not isinstance(window_size, (int, np.integer)) or window_size <= 0:
            raise ValueError(f"window_size must be a positive integer, got {window_size!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an integer, got {type(seed).__name__}")
        self.window_size, self.seed = int(window_size), int(seed)

    def _identity(self) -> tuple:
        # ORDER names the order within windows: a state saved when it was another one is refused.
        return ("window_shuffle", ORDER, self.window_size, self.seed, self._parent._identity())

    def _make_part(self, children: list, n: int) -> "WindowShuffleIter":
        return WindowShuffleIter(f"{n}.window_shuffle", children[0], self.window_size, self.seed)

    def __str__(self) -> str:
        return f"WindowShuffleIterDataset(window_size={self.window_size}, seed={self.seed})"


class WindowShuffleIter:
    """The running part of a window shuffle (iter_runtime's protocol: ``next``, ``fields``, ``restore``).

    Example:
        >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
        >>> from portable_loader.dataset.iter.iterator import _compile
        >>> part = WindowShuffleIter("1.window_shuffle", _compile(to_iter_dataset(range(5))), 2, seed=7)
        >>> sorted([part.next(), part.next()]), part.fields()["1.window_shuffle.window"]
        ([0, 1], 1)
    """

    def __init__(self, field: str, child, window_size: int, seed: int):
        self.child, self.size, self.seed = child, window_size, seed
        self.f_window, self.f_index = f"{field}.window", f"{field}.index"
        self.window = 0  # the number of the window in ``buf`` (or of the next one, when ``buf`` is done)
        self.buf: list = []
        self.index = 0  # elements of ``buf`` emitted
        self.start: dict = {}  # the child's fields before ``buf`` was read
        self.skip = 0  # elements of the next window a restored state had emitted
        self.refuse = None

    def _fill(self) -> None:
        self.start = self.child.fields()
        elems = []
        try:
            while len(elems) < self.size:
                elems.append(self.child.next())
        except StopIteration:
            if not elems:
                raise
        order = window_order(len(elems), self.seed, self.window)
        self.buf, self.index = [elems[i] for i in order], 0
        if self.skip:
            if self.skip >= len(self.buf):
                raise self.refuse(self.f_index, f"{self.skip} elements emitted, but window {self.window} holds "
                                                f"{len(self.buf)}")
            self.index, self.skip = self.skip, 0

    def next(self):
        if self.index >= len(self.buf):
            if self.buf:
                self.window += 1
            self.buf = []
            self._fill()
        element = self.buf[self.index]
        self.index += 1
        return element

    def fields(self) -> dict:
        if self.index >= len(self.buf):  # no window open: the position after the last one
            done = 1 if self.buf else 0
            return {**self.child.fields(), self.f_window: self.window + done, self.f_index: self.skip}
        return {**self.start, self.f_window: self.window, self.f_index: self.index}

    def field_names(self) -> list[str]:
        return self.child.field_names() + [self.f_window, self.f_index]

    def grain_keys(self, fields: dict) -> dict:
        """Grain's top-level ``window_index`` (windows fully emitted), read off the cursor's fields.

        Grain code reads it from the state of an iterator whose last step is a window shuffle; it is
        what ``<n>.window_shuffle.window`` counts.
        """
        return {"window_index": int(fields[self.f_window])}

    def restore(self, fields: dict, refuse) -> None:
        index = fields[self.f_index]
        if index >= self.size:
            raise refuse(self.f_index, f"{index} is not below window_size={self.size}")
        self.child.restore(fields, refuse)
        self.window, self.buf, self.index, self.start = fields[self.f_window], [], 0, {}
        self.skip, self.refuse = index, refuse

    def close(self) -> None:
        self.child.close()
