"""One rule for ``dataset[key]`` across every random-access dataset in the package.

An integer (Python or numpy, negative counts from the end) names one record; a list, tuple or
1-D integer numpy array names several, returned in that order; a slice names a range. Anything else
(strings, floats, booleans, boolean masks, nested lists) is a ``TypeError`` that says what is
accepted: a loader that silently read record 5 for ``[5, 6, 7]`` would train on the wrong data.

Example:
    >>> parse_index(3, 10)
    3
    >>> parse_index(-1, 10)
    9
    >>> parse_index([5, 6, 7], 10).tolist()
    [5, 6, 7]
    >>> parse_index(slice(0, 6, 2), 10).tolist()
    [0, 2, 4]
    >>> parse_index("3", 10)
    Traceback (most recent call last):
    ...
    TypeError: dataset indices must be integers, slices, or lists/1-D arrays of integers; got str '3'
"""

from __future__ import annotations

import numbers

import numpy as np

__all__ = ["parse_index"]


def _refuse(key) -> TypeError:
    shown = repr(key)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return TypeError(
        "dataset indices must be integers, slices, or lists/1-D arrays of integers; "
        f"got {type(key).__name__} {shown}"
    )


def _is_int(x) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def parse_index(key, n: int) -> int | np.ndarray:
    """``key`` -> one record index (``int``) or an ``int64`` array of indices, bounds-checked.

    Example:
        >>> parse_index(np.array([1, 0]), 2).tolist()
        [1, 0]
    """
    if _is_int(key):
        i = int(key)
        if not -n <= i < n:
            raise IndexError(f"record index {i} out of range for a dataset of {n} records")
        return i + n if i < 0 else i
    if isinstance(key, slice):
        return np.arange(*key.indices(n), dtype=np.int64)
    if isinstance(key, np.ndarray):
        if key.ndim != 1 or not np.issubdtype(key.dtype, np.integer):
            raise _refuse(key)
        idx = key.astype(np.int64, copy=False)
    elif isinstance(key, (list, tuple)):
        if not all(_is_int(x) for x in key):
            raise _refuse(key)
        idx = np.asarray(key, dtype=np.int64).reshape(len(key))
    else:
        raise _refuse(key)
    if idx.size and (idx.min() < -n or idx.max() >= n):
        bad = int(idx[(idx < -n) | (idx >= n)][0])
        raise IndexError(f"record index {bad} out of range for a dataset of {n} records")
    return np.where(idx < 0, idx + n, idx)
