"""The training loop's controls on an adapter that prefetches: ``set_weights``, ``skip``, ``stats``.

An adapter (``TorchLoader``, ``JaxLoader``) keeps batches ready ahead of the trainer, so a control
applied to its loader iterator as it stands would land after the batches already prepared. These
first rewind the adapter to the last batch it handed out (its state: O(1), the prepared batches are
dropped and planned again), then apply the control there: the next batch the trainer receives
follows it (a packed mixture: the next packing window). ``stats["sources"]`` counts what was handed
out, not what was prepared.

Example:
    >>> import numpy as np, portable_loader as pl
    >>> from portable_loader.adapters.torch import TorchLoader
    >>> web, code = [{"input_ids": np.full(4, 1)}] * 40, [{"input_ids": np.full(4, 2)}] * 40
    >>> loader = pl.DataLoader(pl.mix({"web": web, "code": code}, {"web": 1, "code": 1}), global_batch_size=4, seq_len=4)
    >>> with TorchLoader(loader) as tl:
    ...     first = next(tl)                   # the collator thread has the next batch ready already
    ...     tl.set_weights({"code": 1})
    ...     sorted(set(next(tl)["input_ids"][:, 0].tolist())), tl.stats["sources"]["code"]["records"]
    ([2], 6)
"""

from __future__ import annotations

from portable_loader.state import parse_sources

__all__ = ["Steering"]


class Steering:
    """Mixed into an adapter with ``_it`` (its ``LoaderIterator``), ``_state`` (the state of the last
    batch handed out, a callable) and ``_rewind()`` (drop what was prepared, back to ``_state``)."""

    def set_weights(self, weights) -> None:
        """``LoaderIterator.set_weights`` from the next batch the trainer receives (see the module)."""
        self._rewind()
        self._it.set_weights(weights)
        self._state = self._it.state_later()

    def skip(self, n: int) -> None:
        """``LoaderIterator.skip``: the next batch the trainer receives is the one ``n`` further on."""
        self._rewind()
        self._it.skip(n)
        self._state = self._it.state_later()

    @property
    def stats(self) -> dict:
        """The loader iterator's ``stats``, with ``sources`` as of the last batch handed out."""
        names = self._it.loader._groups[0]
        counts = parse_sources(self._state()["sources"], len(names))
        return {**self._it.stats, "sources": {n: {"records": r, "tokens": t} for n, (r, t) in zip(names, counts)}}
