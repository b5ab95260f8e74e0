"""The adapter core: a loader's batches, converted for a framework and prepared ahead by one thread.

``Feed`` is what ``TorchLoader`` and ``JaxLoader`` are made of; each adds only its conversion and
its framework's state protocol. A ``Feed`` iterates a ``LoaderIterator``, converts each batch
(``convert``: numpy in, the framework's arrays out) and, with ``depth`` > 0, keeps that many
converted batches ready in a background thread (a ``Producer``). Whatever it has prepared, its state
is the state after the last batch the trainer *took*: batches prepared and not handed out are
dropped, and the loader is rewound in O(1), whenever they would be wrong (a ``close``, a restore,
``set_weights``, ``skip``).

By default every batch handed out is taken. A trainer that fetches ahead of its step (Lightning)
says instead which batches it trained on: ``count_takes()``, then ``take()`` once per step; the
state is then that of the last batch taken, and a new pass (``iter()``) serves the batches handed
out but not taken again. So that counting may begin after the trainer has fetched, a ``Feed`` keeps
the states of the current pass (up to ``MAX_AHEAD`` batches; a state costs nothing until read).

The controls of a running mixture act from the next batch the trainer receives, not from the
next one prepared: ``set_weights``, ``skip``; ``stats["sources"]`` counts what was handed out.

Example:
    >>> import numpy as np, portable_loader as pl
    >>> web, code = [{"input_ids": np.full(4, 1)}] * 40, [{"input_ids": np.full(4, 2)}] * 40
    >>> loader = pl.DataLoader(pl.mix({"web": web, "code": code}, {"web": 1, "code": 1}), global_batch_size=4, seq_len=4)
    >>> with Feed(loader, lambda batch: batch["input_ids"].tolist(), depth=1) as feed:
    ...     first = next(feed)                 # the thread has the next batch ready already
    ...     feed.set_weights({"code": 1})      # the prepared batch is dropped, planned again
    ...     next(feed), feed.stats["sources"]["code"]["records"]
    ([[2, 2, 2, 2], [2, 2, 2, 2], [2, 2, 2, 2], [2, 2, 2, 2]], 6)
"""

from __future__ import annotations

import collections
from typing import Any, Callable

from portable_loader.engine import Producer
from portable_loader.lifecycle import Closing, close_at_exit
from portable_loader.loader import DataLoader, LoaderIterator
from portable_loader.state import parse_sources

__all__ = ["Feed", "MAX_AHEAD"]

# More batches than this handed out and never taken means nothing takes them (a trainer that counts
# takes in a hook its loop bypasses): refused rather than keep a state that no checkpoint should hold.
MAX_AHEAD = 64


class Feed(Closing):
    """Iterate a ``DataLoader`` as converted batches, ``depth`` of them prepared ahead; resumable.

    Args:
        loader: the framework-neutral ``DataLoader``.
        convert: numpy batch -> the framework's batch. It runs in the background thread, so it must
            not hold the adapter (a thread holding it would keep a dropped adapter alive, open).
        depth: batches kept ready by a background thread; 0: each is built in the caller's thread
            (through the loader's own prefetch thread, if it has one).
        name: the background thread's name.
        handoff: with ``depth`` > 0, an object that converts on the background thread in its own way
            and finishes the hand-off on the trainer's (the torch adapter's CUDA side stream):
            ``convert(batch) -> parcel`` there, ``receive(parcel) -> batch`` here, and ``settle()``
            once the thread has stopped.

    Example:
        >>> import numpy as np
        >>> loader = DataLoader([{"input_ids": np.full(4, n)} for n in range(1, 41)], global_batch_size=2, seq_len=4)
        >>> with Feed(loader, lambda batch: batch["input_ids"][:, 0].tolist(), depth=2) as feed:
        ...     first, second = next(feed), next(feed)   # a trainer that fetches one batch ahead ...
        ...     feed.count_takes(); feed.take()          # ... trains on the first
        ...     next(iter(feed)) == second               # a new pass serves the one not taken again
        True
    """

    def __init__(self, loader: DataLoader, convert: Callable[[dict], Any], depth: int, *,
                 name: str = "portable_loader-feed", handoff=None):
        self.loader = loader
        self._convert = convert
        self._depth = int(depth)
        self._name = name
        self._handoff = handoff
        # With a thread of its own, the Feed builds the batches there: no second thread under it.
        self._it = LoaderIterator(loader, thread=self._depth == 0)
        self._producer: Producer | None = None
        # The states of this pass (state_later: computed only when read): where it started, then one
        # per batch handed out. Counting takes, the first is the last batch taken.
        self._trail = _trail(self._it.state_later())
        self._counting = False
        self._ended = False  # this pass met the stream's end
        close_at_exit(self)  # its thread and the loader's workers stop before the frameworks' exit handlers

    # --- iteration ----------------------------------------------------------------------------

    def __iter__(self):
        """A new pass. Counting takes, the batches handed out and not taken are served again."""
        if self._counting:
            self._drop_untaken()
        else:
            self._trail = _trail(self._trail[-1])
        self._ended = False
        return self

    def __next__(self):
        if self._counting and len(self._trail) > MAX_AHEAD:
            raise RuntimeError(f"{MAX_AHEAD} batches were handed out and never taken: take() is called once per "
                               "batch trained on (Lightning's ExactResume calls it in on_train_batch_start, which "
                               "training_step(dataloader_iter) bypasses)")
        try:
            batch, state = self._next_converted()
        except StopIteration:
            self._ended = True
            raise
        self._trail.append(state)
        return batch

    def _next_converted(self):
        if self._depth == 0:
            return self._convert(next(self._it)), self._it.state_later()
        if self._producer is None:
            convert = self._convert if self._handoff is None else self._handoff.convert
            self._producer = Producer(_producing(self._it, convert), self._depth, self._name)
        parcel, state = self._producer.next()
        return (parcel if self._handoff is None else self._handoff.receive(parcel)), state

    def close(self) -> None:
        """Stop the background thread and the loader's workers.

        Batches prepared but not handed out are dropped and the loader is rewound to the last one
        handed out (O(1)), so iterating again after ``close`` loses nothing.
        """
        self._rewind()
        self._it.close()

    def _stop_producer(self) -> bool:
        producer, self._producer = self._producer, None
        if producer is None:
            return False
        producer.close()  # drops the prepared batches (and their buffers) now
        if self._handoff is not None:
            self._handoff.settle()
        return True

    def _rewind(self) -> None:
        """Drop the batches prepared ahead, back to the last one handed out."""
        if self._stop_producer():
            self._it.set_state(self._trail[-1]())

    def _drop_untaken(self) -> None:
        """Forget the batches handed out and not taken: the loader goes back to serve them again, unless
        this pass met the stream's end (a finite loader stays at its end, as it was handed out)."""
        if len(self._trail) > 1:
            if not self._ended:
                self._stop_producer()
                self._it.set_state(self._trail[0]())
            self._trail = _trail(self._trail[0])

    # --- state ------------------------------------------------------------------------------------

    def _taken_state(self) -> dict[str, Any]:
        """The loader state after the last batch the trainer took (a JSON-serializable dict)."""
        return (self._trail[0] if self._counting else self._trail[-1])()

    def _restore(self, state) -> None:
        """Continue right after the saved batch; refuses a state of another source or config."""
        # Checked before the thread is stopped, so a refused state changes nothing.
        state = self.loader.check_state(state)
        self._stop_producer()
        self._it.set_state(state)
        self._trail = _trail(self._it.state_later())
        self._ended = False

    # --- a trainer that fetches ahead of its step --------------------------------------------------

    def count_takes(self) -> None:
        """From now on the state is that of the batches the trainer ``take()``s; none handed out in this
        pass so far is taken yet."""
        if not self._counting:
            if len(self._trail) == self._trail.maxlen:
                raise RuntimeError(f"count_takes(): {MAX_AHEAD} batches or more were handed out in this pass; "
                                   "begin counting before a trainer's first step")
            self._counting = True

    def take(self) -> None:
        """The trainer trains on the oldest batch handed out and not taken yet (if there is one)."""
        if self._counting and len(self._trail) > 1:
            self._trail.popleft()

    def stop_counting(self) -> None:
        """Every batch handed out is taken again; those handed out and not taken are served again."""
        if self._counting:
            self._drop_untaken()
            self._counting = False

    # --- controls of a running mixture --------------------------------------------------------------

    def set_weights(self, weights) -> None:
        """``LoaderIterator.set_weights`` from the next batch the trainer receives (see the module)."""
        self._rewind()
        self._it.set_weights(weights)
        self._trail[-1] = self._it.state_later()

    def skip(self, n: int) -> None:
        """``LoaderIterator.skip``: the next batch the trainer receives is the one ``n`` further on."""
        self._rewind()
        self._it.skip(n)
        self._trail[-1] = self._it.state_later()

    @property
    def stats(self) -> dict:
        """The loader iterator's ``stats``, with ``sources`` as of the last batch handed out."""
        names = self._it.loader._groups[0]
        counts = parse_sources(self._trail[-1]()["sources"], len(names))
        return {**self._it.stats, "sources": {n: {"records": r, "tokens": t} for n, (r, t) in zip(names, counts)}}


def _trail(start) -> collections.deque:
    return collections.deque([start], maxlen=MAX_AHEAD + 1)


def _producing(it: LoaderIterator, convert) -> Callable[[], tuple]:
    """The background thread's work: the next batch converted, and the state after it. Given the iterator
    and the conversion, never the ``Feed``: a thread holding it would keep a dropped ``Feed`` alive."""
    def produce():
        batch = next(it)
        state = it.state_later()
        return convert(batch), state

    return produce
