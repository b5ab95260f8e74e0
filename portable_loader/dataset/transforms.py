"""Lazy per-record transforms: ``dataset.map(fn)`` (``filter`` comes in a later release).

A transform holds its parent and a function and does nothing until records are read: ``fn`` runs on
exactly the records a batched read asks for, in the reading process (a loader worker, when there
are workers). Its fingerprint hashes the parent's fingerprint and the function's identity, so a
loader state saved over ``source(x).map(f)`` is refused by ``source(x).map(g)``.

Example:
    >>> import numpy as np
    >>> from portable_loader.dataset import source
    >>> def shift(r):
    ...     return {"input_ids": r["input_ids"] + 1}
    >>> ds = source([{"input_ids": np.arange(3)}]).map(shift, keeps_lengths=True)
    >>> ds[0]["input_ids"].tolist(), ds.lengths([0]).tolist()
    ([1, 2, 3], [3])
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from portable_loader.dataset.base import Dataset, function_identity

__all__ = ["Map"]


class Map(Dataset):
    """Records ``fn(parent[i])``, computed on read; built by :meth:`Dataset.map`.

    ``name``: what identifies ``fn`` in the fingerprint, instead of its qualified name (or, for a
    lambda or nested function, its code): change it when ``fn``'s output changes. ``keeps_lengths``:
    a promise that ``fn`` leaves ``len(record["input_ids"])`` as it is, so ``lengths`` asks the parent
    (a cache answers without decoding) instead of mapping records; every read checks the promise and
    a broken one raises ``ValueError``. It does not enter the fingerprint: a true promise changes no
    batch.

    Example:
        >>> from portable_loader.dataset import source
        >>> crop = source([{"input_ids": list(range(5))}]).map(lambda r: {"input_ids": r["input_ids"][:2]})
        >>> crop.lengths([0]).tolist()
        [2]
        >>> bad = source([{"input_ids": list(range(5))}]).map(lambda r: {"input_ids": r["input_ids"][:2]}, keeps_lengths=True)
        >>> bad[0]
        Traceback (most recent call last):
        ...
        ValueError: map <lambda> promised keeps_lengths but changed record 0 from 5 to 2 tokens
    """

    def __init__(self, parent: Dataset, fn: Callable[[Any], Any], *, name: str | None = None, keeps_lengths: bool = False):
        if not callable(fn):
            raise TypeError(f"map() takes a callable, got {type(fn).__name__}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"map(name=...) must be a string, got {type(name).__name__}")
        self.parent, self.fn, self.name, self.keeps_lengths = parent, fn, name, bool(keeps_lengths)
        self.cheap_lengths = self.keeps_lengths and parent.cheap_lengths
        self.fork_hazard = parent.fork_hazard

    @property
    def format(self) -> str | None:
        return self.parent.format

    def __len__(self) -> int:
        return len(self.parent)

    @property
    def shard_rows(self) -> list[int] | None:
        return self.parent.shard_rows  # one record out per record in: the parent's shards

    def __getitems__(self, indices) -> list:
        records = self.parent.__getitems__(indices)
        out = [self.fn(r) for r in records]
        if self.keeps_lengths:
            for i, before, after in zip(indices, records, out):
                if len(before["input_ids"]) != len(after["input_ids"]):
                    raise ValueError(
                        f"map {self.name or getattr(self.fn, '__qualname__', self.fn)} promised keeps_lengths but "
                        f"changed record {int(i)} from {len(before['input_ids'])} to {len(after['input_ids'])} tokens"
                    )
        return out

    def lengths(self, indices) -> np.ndarray:
        return self.parent.lengths(indices) if self.keeps_lengths else super().lengths(indices)

    def _identity(self) -> tuple:
        fn = ("name", self.name) if self.name is not None else function_identity(self.fn)
        return (self.parent.fingerprint(), fn)

    def reopen(self) -> "Map":
        parent = self.parent.reopen()
        if parent is self.parent:
            return self
        return Map(parent, self.fn, name=self.name, keeps_lengths=self.keeps_lengths)
