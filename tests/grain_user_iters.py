"""User-written ``IterDataset``/``DatasetIterator`` classes, written once over a module ``grain``.

``classes(grain)`` builds them over real Grain's base classes (``import grain``) or ours
(``from portable_loader import grain``), the way Grain's documentation and real frameworks write
them: a host-sharding step that keeps every n-th element, an unbatching step that holds its
position inside a batch, a source of one's own with no parent, and a round robin over several
parents. Each iterator's state marks itself with ``"user"``, so that tests can pick out the
user's own fields in either library's state (:func:`user_parts`).

    python tests/grain_user_iters.py PIPELINE STATE_FILE OUT_FILE

restores the state in ``STATE_FILE`` into a fresh pipeline ``PIPELINE`` (of :func:`pipeline`, on
portable_loader) and writes the elements that follow as JSON: the resume in a new process.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import types

import numpy as np


@functools.cache
def classes(grain) -> types.SimpleNamespace:
    class EveryNth(grain.IterDataset):
        """Keeps elements k, k + n, k + 2n, ... of its parent (a host's share)."""

        def __init__(self, parent, n, k):
            super().__init__(parent)
            self.n, self.k = n, k

        def __iter__(self):
            return EveryNthIterator(self._parent.__iter__(), self.n, self.k)

    class EveryNthIterator(grain.DatasetIterator):
        def __init__(self, parent, n, k):
            super().__init__(parent)
            self.n, self.k, self.seen = n, k, 0

        def __next__(self):
            while True:
                x = next(self._parent)
                self.seen += 1
                if (self.seen - 1) % self.n == self.k:
                    return x

        def get_state(self):
            return {"user": "EveryNth", "parent": self._parent.get_state(), "seen": self.seen}

        def set_state(self, state):
            self._parent.set_state(state["parent"])
            self.seen = state["seen"]

    class Unbatch(grain.IterDataset):
        """The rows of its parent's batches, one at a time."""

        def __iter__(self):
            return UnbatchIterator(self._parent.__iter__())

    class UnbatchIterator(grain.DatasetIterator):
        def __init__(self, parent):
            super().__init__(parent)
            self.batch, self.index = None, 0
            self.before = parent.get_state()  # the parent's state before the batch being emitted

        def __next__(self):
            while self.batch is None or self.index >= len(self.batch):
                before = self._parent.get_state()
                self.batch, self.index = next(self._parent), 0
                self.before = before  # only once read: at the end the state stays after the last row
            row = self.batch[self.index]
            self.index += 1
            return row

        def get_state(self):
            return {"user": "Unbatch", "parent": self.before, "index": self.index}

        def set_state(self, state):
            self._parent.set_state(state["parent"])
            self.before, self.batch, self.index = state["parent"], None, state["index"]
            if self.index:
                self.batch = next(self._parent)

    class Squares(grain.IterDataset):
        """A source of one's own: 0, 1, 4, ... (n of them), no parent."""

        def __init__(self, n, empty_list=False):
            super().__init__([]) if empty_list else super().__init__()
            self.n = n

        def __iter__(self):
            return SquaresIterator(self.n)

    class SquaresIterator(grain.DatasetIterator):
        def __init__(self, n):
            super().__init__()
            self.n, self.i = n, 0

        def __next__(self):
            if self.i >= self.n:
                raise StopIteration
            self.i += 1
            return (self.i - 1) ** 2

        def get_state(self):
            return {"user": "Squares", "i": self.i}

        def set_state(self, state):
            self.i = state["i"]

    class RoundRobin(grain.IterDataset):
        """One element of each parent in turn; ends when the parent whose turn it is ends."""

        def __init__(self, parents):
            super().__init__(parents)

        def __iter__(self):
            return RoundRobinIterator([p.__iter__() for p in self.parents])

    class RoundRobinIterator(grain.DatasetIterator):
        def __init__(self, parents):
            super().__init__(parents)
            self.turn = 0

        def __next__(self):
            x = next(self._parents[self.turn % len(self._parents)])
            self.turn += 1
            return x

        def get_state(self):
            return {"user": "RoundRobin", "parents": [p.get_state() for p in self._parents], "turn": self.turn}

        def set_state(self, state):
            for p, s in zip(self._parents, state["parents"]):
                p.set_state(s)
            self.turn = state["turn"]

    class Repeat(grain.experimental.FlatMapTransform):
        max_fan_out = 3

        def flat_map(self, x):
            return [x] * (int(x) % 3)

    return types.SimpleNamespace(**{k: v for k, v in locals().items() if isinstance(v, type)})


def user_parts(state) -> list:
    """The user's own fields in a state of either library: each ``"user"``-marked dict without its
    parents' states (those are each library's own format), depth first, parents after children.

    Example:
        >>> user_parts({"parent": {"user": "A", "parent": {"x": 1}, "seen": 2}, "index": 0})
        [{'user': 'A', 'seen': 2}]
    """
    found = []

    def walk(value):
        if isinstance(value, dict):
            if "user" in value:
                found.append({k: _plain(v) for k, v in value.items() if k not in ("parent", "parents")})
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(state)
    return found


def _plain(v):
    return v.item() if isinstance(v, np.generic) else v


def double(x):
    return x * 2 + 1


def with_pid(x):
    return (int(x), os.getpid())


def pipeline(name: str, grain):
    """The pipelines the tests compare, by name, built with ``grain`` (real or ours)."""
    c = classes(grain)
    ds = grain.MapDataset
    if name == "sharded":
        return c.EveryNth(ds.range(60).shuffle(seed=5).to_iter_dataset().map(double).filter(lambda x: x % 7 != 0),
                          n=3, k=1).map(lambda x: x - 1).batch(4)
    if name == "unbatched":
        return c.Unbatch(ds.range(50).to_iter_dataset().map(double).batch(6)).filter(lambda x: x % 5 != 0).batch(4)
    if name == "nested":
        return c.EveryNth(c.Unbatch(ds.range(80).to_iter_dataset().batch(5)), n=2, k=0).batch(3)
    if name == "source":
        return c.Squares(23).map(lambda x: x + 1).batch(5)
    if name == "source_empty_list":
        return c.Squares(9, empty_list=True).batch(2)
    if name == "mixed":
        a = c.EveryNth(ds.range(100, 160).to_iter_dataset(), n=2, k=1)
        b = ds.range(0, 40).to_iter_dataset().map(double)
        return grain.IterDataset.mix([a, b], [0.6, 0.4]).batch(3)
    if name == "packed":
        tokens = ds.range(1, 60).map(lambda n: {"ids": np.arange(n % 6 + 1, dtype=np.int32)}).to_iter_dataset()
        return grain.experimental.FirstFitPackIterDataset(c.EveryNth(tokens, n=2, k=0), length_struct={"ids": 8},
                                                          num_packing_bins=2, shuffle_bins=False)
    if name == "round_robin":
        return c.RoundRobin([ds.range(20).to_iter_dataset().map(double), c.Squares(15),
                             ds.range(200, 230).to_iter_dataset()]).batch(2)
    if name == "repeated":
        return grain.experimental.RepeatIterDataset(c.EveryNth(ds.range(10).to_iter_dataset(), n=2, k=1),
                                                    num_epochs=3).batch(2)
    if name == "window_shuffled":
        return grain.experimental.WindowShuffleIterDataset(c.Unbatch(ds.range(30).to_iter_dataset().batch(4)),
                                                           window_size=5, seed=3)
    if name == "flat_mapped":
        return grain.experimental.FlatMapIterDataset(c.EveryNth(ds.range(25).to_iter_dataset(), n=2, k=0), c.Repeat())
    if name == "concat_split":
        tokens = ds.range(1, 40).map(lambda n: {"ids": np.arange(n % 5 + 1, dtype=np.int32)}).to_iter_dataset()
        return grain.experimental.ConcatThenSplitIterDataset(c.EveryNth(tokens, n=3, k=2), length_struct={"ids": 8})
    if name == "top":
        return c.EveryNth(ds.range(40).to_iter_dataset().map(double).batch(2), n=2, k=1)
    raise ValueError(name)


#: Pipelines whose step above the user's (flat map, window shuffle, concat-then-split) keeps its parent's
#: state from another element than Grain's does: an equal position, another snapshot (docs/grain.md).
SNAPSHOT_ELSEWHERE = {"window_shuffled", "flat_mapped", "concat_split"}
NAMES = ["sharded", "unbatched", "nested", "source", "source_empty_list", "mixed", "packed", "round_robin", "repeated",
         "window_shuffled", "flat_mapped", "concat_split", "top"]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import grain_user_iters  # by its module name, as the tests import it: that name is in the fingerprint
    from conftest import canon
    from portable_loader import grain as ours

    name, state_file, out_file = sys.argv[1:4]
    with open(state_file) as f:
        saved = json.load(f)
    it = iter(grain_user_iters.pipeline(name, ours))
    it.set_state(saved)
    with open(out_file, "w") as f:
        json.dump([canon(x) for x in it], f)
