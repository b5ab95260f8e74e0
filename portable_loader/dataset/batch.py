"""``ds.batch(batch_size, drop_remainder=False, batch_fn=None)`` and :func:`stack`, Grain's batching.

:func:`stack` is Grain's ``make_batch``: the elements' common pytree structure with each leaf
stacked along a new first axis (``np.stack``; a single element gets ``np.expand_dims``), so the
dtypes and shapes are numpy's: Python ints give ``int64``, strings ``<U…``, arrays keep theirs.
Pytrees follow ``jax.tree_util`` as Grain does where JAX is installed: dicts come out with sorted
keys, ``OrderedDict`` keeps its order, ``None`` is an empty subtree, and the first element's
structure leads (an element whose structure differs is a ``ValueError``; a leaf in the first
element takes whatever the others hold there). Where ``jax`` is already imported its
``tree_map`` is used itself, so pytree nodes registered with JAX work too.

Example:
    >>> import numpy as np
    >>> b = stack([{"x": np.zeros(2, np.int32), "s": "ab"}, {"x": np.ones(2, np.int32), "s": "c"}])
    >>> b["x"].shape, b["x"].dtype, b["s"].tolist()
    ((2, 2), dtype('int32'), ['ab', 'c'])
"""

from __future__ import annotations

import collections
import math
import pprint
import sys
from typing import Any, Callable, Sequence

import numpy as np

from portable_loader.dataset.base import Dataset, as_indices, function_identity, within

__all__ = ["Batch", "stack"]


def stack(elements: Sequence[Any], batch_fn: Callable[[Sequence[Any]], Any] | None = None) -> Any:
    """The batch of ``elements``: ``batch_fn(elements)`` when given, else Grain's stacking (module docstring).

    Example:
        >>> stack([(1, "a"), (2, "b")])
        (array([1, 2]), array(['a', 'b'], dtype='<U1'))
        >>> stack([3]), stack([1, 2], batch_fn=sum)
        (array([3]), 3)
    """
    if batch_fn is not None:
        return batch_fn(elements)
    if not elements:
        raise ValueError("Cannot batch 0 values.")
    try:
        if len(elements) == 1:
            return _tree_map(lambda x: np.expand_dims(x, axis=0), elements[0])
        return _tree_map(lambda *xs: np.stack(xs), *elements)
    except ValueError as e:  # numpy's message names neither the shapes nor the structures
        shown = pprint.pformat(_spec(elements))
        raise ValueError(f"Expected all input elements to have the same structure but got:\n{shown}") from e


def _tree_map(fn, *trees):
    jax = sys.modules.get("jax")
    if jax is not None:
        return jax.tree_util.tree_map(fn, *trees)
    return _map(fn, trees)


def _is_namedtuple(x) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


# Exactly the node types jax registers by default; a subclass of dict or list is a leaf, as in jax.
_NODES = (type(None), list, tuple, dict, collections.OrderedDict, collections.defaultdict)


def _map(fn, trees: tuple):
    first = trees[0]
    if type(first) not in _NODES and not _is_namedtuple(first):
        return fn(*trees)
    for other in trees[1:]:
        if type(other) is not type(first):
            raise ValueError(f"pytree structure differs: {type(first).__name__} and {type(other).__name__}")
    if first is None:
        return None
    if isinstance(first, (list, tuple)):
        if any(len(t) != len(first) for t in trees):
            raise ValueError(f"pytree structure differs: {type(first).__name__}s of lengths {[len(t) for t in trees]}")
        items = [_map(fn, column) for column in zip(*trees)]
        return type(first)(*items) if _is_namedtuple(first) else type(first)(items)
    ordered = type(first) is collections.OrderedDict
    keys = list(first) if ordered else sorted(first)  # jax flattens a dict in sorted key order
    for other in trees[1:]:
        if (list(other) if ordered else sorted(other)) != keys:
            raise ValueError(f"pytree structure differs: keys {keys} and {list(other)}")
        if type(first) is collections.defaultdict and other.default_factory is not first.default_factory:
            raise ValueError("pytree structure differs: defaultdicts with different default factories")
    items = [(k, _map(fn, tuple(t[k] for t in trees))) for k in keys]
    if type(first) is collections.defaultdict:
        return collections.defaultdict(first.default_factory, items)
    return type(first)(items)


def _spec(elements) -> list:
    def leaf(x):
        a = np.asarray(x) if not isinstance(x, np.ndarray) else x
        return f"{type(x).__name__}[{a.dtype}{list(a.shape)}]" if a.dtype != object else type(x).__name__

    out = []
    for e in elements:
        try:
            out.append(_map(leaf, (e,)))
        except Exception:  # noqa: BLE001 - a description must never fail
            out.append(type(e).__name__)
    return out


class Batch(Dataset):
    """Batches of ``batch_size`` consecutive records of ``parent``; built by :meth:`Dataset.batch`.

    Grain's ``BatchMapDataset``: ``ceil(len / batch_size)`` batches (``floor`` with
    ``drop_remainder``), each epoch batched on its own (the last batch of an epoch never takes
    records of the next; ``repeat`` first to batch across epochs). As in Grain a batch may not
    follow a ``filter``, whose holes would make batches short: that is a ``ValueError`` saying to
    batch after ``to_iter_dataset()`` (or let the ``DataLoader`` skip filtered records itself). A
    map that returns None leaves the None in the window, where stacking decides (module docstring).

    Example:
        >>> from portable_loader.dataset import Dataset
        >>> list(Batch(Dataset.range(5), 2)), len(Batch(Dataset.range(5), 2, drop_remainder=True))
        ([array([0, 1]), array([2, 3]), array([4])], 2)
        >>> Batch(Dataset.range(5).filter(lambda x: x > 1), 2)
        Traceback (most recent call last):
        ...
        ValueError: `MapDataset.batch` can not follow `MapDataset.filter` because `filter` can discard elements. Convert `MapDataset` to `IterDataset` with `to_iter_dataset()` before calling `batch`.
    """

    reads_epochs = True

    def __init__(self, parent: Dataset, batch_size: int, *, drop_remainder: bool = False, batch_fn=None):
        if batch_size <= 0:
            raise ValueError("batch_size must be positive.")
        if parent.filters:
            raise ValueError(
                "`MapDataset.batch` can not follow `MapDataset.filter` because `filter` can discard elements. "
                "Convert `MapDataset` to `IterDataset` with `to_iter_dataset()` before calling `batch`."
            )
        self.parent, self.batch_size = parent, int(batch_size)
        self.drop_remainder, self.batch_fn = bool(drop_remainder), batch_fn
        # Taken as the step is built, never from what batch_fn did to itself since.
        self._fn_id = ("stack",) if batch_fn is None else function_identity(batch_fn)
        self.fork_hazard = parent.fork_hazard
        n = len(parent)
        self._length = n // self.batch_size if self.drop_remainder else math.ceil(n / self.batch_size)
        self._iter_chunk = max(1, 64 // self.batch_size)

    def __len__(self) -> int:
        return self._length

    def _windows(self, indices) -> list[range]:
        n, size, out = len(self.parent), self.batch_size, []
        for i in as_indices(indices).tolist():
            epoch, k = divmod(i, self._length)
            start = k * size
            out.append(range(start + epoch * n, min(n, start + size) + epoch * n))
        return out

    def __getitems__(self, indices) -> list:
        windows = self._windows(indices)
        flat = [i for w in windows for i in w]
        records = list(self.parent.__getitems__(within(self.parent, flat))) if flat else []
        out, at = [], 0
        for w in windows:
            out.append(stack(records[at : at + len(w)], self.batch_fn))
            at += len(w)
        return out

    def _identity(self) -> tuple:
        return (self.parent.fingerprint(), self.batch_size, self.drop_remainder, self._fn_id)

    def reopen(self) -> "Batch":
        parent = self.parent.reopen()
        if parent is self.parent:
            return self
        view = Batch(parent, self.batch_size, drop_remainder=self.drop_remainder, batch_fn=self.batch_fn)
        view._fn_id = self._fn_id
        return view
