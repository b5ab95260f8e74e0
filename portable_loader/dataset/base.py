"""The dataset protocol: what every random-access dataset offers the loader, and its fingerprint.

A dataset is immutable and stateless: ``len``, a batched read ``__getitems__(indices)``, token
``lengths(indices)`` (what a packer needs before it reads anything) and ``fingerprint()``, a short
hex digest of the whole tree (sources, transforms, their names) that a loader state carries so that
a state saved for one pipeline is refused by another. ``reopen()`` gives a worker process its own
file handles. ``dataset[key]`` follows :func:`portable_loader.indexing.parse_index`.

Example:
    >>> import numpy as np
    >>> from portable_loader.dataset import source
    >>> ds = source([{"input_ids": np.arange(n)} for n in (3, 5, 2)])
    >>> len(ds), ds.lengths([2, 0]).tolist()
    (3, [2, 3])
    >>> ds[1]["input_ids"].tolist()
    [0, 1, 2, 3, 4]
    >>> [r["input_ids"].size for r in ds[::2]]
    [3, 2]
    >>> len(ds.fingerprint())
    16
"""

from __future__ import annotations

import hashlib
import pickle
import types
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np

from portable_loader.indexing import parse_index

__all__ = ["Dataset", "digest", "function_identity", "records_digest"]

_DIGEST_HEX = 16  # 64 bits: states are compared, never looked up among many


class Dataset:
    """Base of every dataset: subclasses define ``__len__``, ``__getitems__`` and ``_identity``.

    ``__getitems__(indices)`` takes a sequence (or 1-D int array) of indices in ``[0, len)`` and
    returns their records in that order; records are dicts with ``input_ids`` (and optionally
    ``loss_mask``) for the loader. ``_identity()`` returns the parts the fingerprint hashes.

    Example:
        >>> class Squares(Dataset):
        ...     def __len__(self): return 4
        ...     def __getitems__(self, indices): return [{"input_ids": np.arange(i * i)} for i in indices]
        ...     def _identity(self): return ("squares", 4)
        >>> Squares().lengths(np.array([3, 1])).tolist()
        [9, 1]
        >>> Squares()[-1]["input_ids"].size
        9
    """

    _fingerprint: str | None = None
    #: ``lengths`` answers without reading records (the loader then counts over-long records in
    #: padded mode too; reading every record twice for a count is not worth it).
    cheap_lengths: bool = False
    #: Why worker processes forked from this one must not read this dataset, or None when they may.
    fork_hazard: str | None = None
    #: The filters in this tree (their labels); when there are any the loader asks ``accepts``.
    filters: tuple[str, ...] = ()

    @property
    def shard_rows(self) -> list[int] | None:
        """Records per shard of a sharded source (a cache), in index order; None when not sharded.

        ``DataLoader(shuffle="shards")`` groups records by these shards.
        """
        return None

    @property
    def format(self) -> str | None:
        """The record format (``"text"``, ``"alpaca"``, ``"chat"``) when known, else None.

        The loader's ``overlong="auto"`` splits only ``text`` records: a response split off its prompt
        must not be trained on.
        """
        return None

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitems__(self, indices: Sequence[int] | np.ndarray) -> list:
        raise NotImplementedError

    def _identity(self) -> tuple:
        raise NotImplementedError

    def lengths(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Token counts (``len(record["input_ids"])``) of the records at ``indices``, as int64."""
        return np.asarray([len(r["input_ids"]) for r in self.__getitems__(indices)], dtype=np.int64)

    def accepts(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Whether each record at ``indices`` survives the filters in this tree (all True without any)."""
        return np.ones(np.asarray(indices).size, dtype=bool)

    def fingerprint(self) -> str:
        """A 16-hex-digit digest of the whole tree: equal for equal pipelines over equal content."""
        if self._fingerprint is None:
            # Immutable, so computed once; object.__setattr__ keeps subclasses free to freeze attributes.
            object.__setattr__(self, "_fingerprint", digest(type(self).__qualname__, *self._identity()))
        return self._fingerprint

    def stream_order(self, seed: int, *, shuffle: bool = True, num_epochs: int | None = None):
        """The order the loader serves this dataset in: stream position -> index, keyed by ``seed``.

        A plain dataset is shuffled by the LCG sampler, a fresh permutation per epoch; a mixture
        (:mod:`portable_loader.dataset.mixture`) brings its own order, which the loader must not shuffle.

        Example:
            >>> from portable_loader.dataset import source
            >>> sorted(source([{"input_ids": [1]}] * 4).stream_order(0).stream_indices(range(4)).tolist())
            [0, 1, 2, 3]
        """
        from portable_loader.sampler import LCGSampler

        return LCGSampler(len(self), seed=seed, shuffle=shuffle, num_epochs=num_epochs)

    def reopen(self) -> "Dataset":
        """This dataset with its own file handles (what a forked worker needs); ``self`` if it has none."""
        return self

    def __getitem__(self, key):
        idx = parse_index(key, len(self))
        if isinstance(idx, int):
            return self.__getitems__([idx])[0]
        return list(self.__getitems__(idx.tolist()))

    def map(self, fn: Callable[[Any], Any], *, name: str | None = None, keeps_lengths: bool = False) -> "Dataset":
        """A lazy view whose records are ``fn(record)``; see :class:`portable_loader.dataset.transforms.Map`.

        Example:
            >>> from portable_loader.dataset import source
            >>> ds = source([{"input_ids": np.arange(3)}]).map(lambda r: {"input_ids": r["input_ids"] * 2})
            >>> ds[0]["input_ids"].tolist()
            [0, 2, 4]
        """
        from portable_loader.dataset.transforms import Map

        return Map(self, fn, name=name, keeps_lengths=keeps_lengths)

    def filter(self, pred: Callable[[Any], bool], *, name: str | None = None) -> "Dataset":
        """A lazy view of the records for which ``pred`` is True (:class:`~portable_loader.dataset.transforms.Filter`).

        The loader skips rejected records as it plans, so batches stay full and a state stays a
        stream position (docs/datasets.md).

        Example:
            >>> from portable_loader.dataset import source
            >>> ds = source([{"input_ids": np.arange(n)} for n in (3, 0, 2)]).filter(lambda r: r["input_ids"].size > 0)
            >>> ds.accepts([0, 1, 2]).tolist()
            [True, False, True]
        """
        from portable_loader.dataset.transforms import Filter

        return Filter(self, pred, name=name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(records={len(self)}, fingerprint={self.fingerprint()})"


# --- digests ------------------------------------------------------------------------------------


def digest(*parts) -> str:
    """A short hex digest of values (strings, numbers, arrays, dicts, lists, ...), canonically encoded.

    Example:
        >>> digest("a", 1) == digest("a", 1) != digest("a", 2)
        True
    """
    h = hashlib.blake2b(digest_size=_DIGEST_HEX // 2)
    for part in parts:
        _feed(h, part)
    return h.hexdigest()


def _feed(h, value) -> None:
    """Type-tagged, length-prefixed encoding, so that ("ab", "c") and ("a", "bc") differ."""

    def put(tag: bytes, payload: bytes) -> None:
        h.update(tag + len(payload).to_bytes(8, "little") + payload)

    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        put(b"s", f"{type(value).__name__}:{value!r}".encode())
    elif isinstance(value, (np.ndarray, np.generic)):
        a = np.ascontiguousarray(value)
        put(b"a", f"{a.dtype.str}{a.shape}".encode())
        put(b"d", a.tobytes())
    elif isinstance(value, dict):
        put(b"m", str(len(value)).encode())
        for k in sorted(value, key=repr):
            _feed(h, k)
            _feed(h, value[k])
    elif isinstance(value, (list, tuple)):
        put(b"l", f"{type(value).__name__}:{len(value)}".encode())
        for v in value:
            _feed(h, v)
    elif isinstance(value, (set, frozenset)):  # iteration order depends on the process's hash seed
        put(b"e", str(len(value)).encode())
        for v in sorted(value, key=repr):
            _feed(h, v)
    else:
        # Anything else by its pickle: deterministic for plain data, and never a memory address.
        try:
            put(b"p", pickle.dumps(value, protocol=4))
        except Exception:  # noqa: BLE001 - unpicklable (a lock, a lambda): its type is all we can name
            put(b"t", _qualified(type(value)).encode())


# Up to this many records a content digest reads them all; above it, this many at fixed positions.
SMALL = 1024
SAMPLE = 64


def records_digest(read: Callable[[list[int]], list], n: int) -> str:
    """Digest of ``n`` and of the records ``read`` returns: all of them if ``n <= SMALL``, else ``SAMPLE``
    at fixed, evenly spread positions (first and last included).

    Sampling keeps a loader's start-up O(1) on large sources while still catching a different
    corpus, a reordering or a re-tokenization (they change almost every record); an edit to a few
    records between sample positions goes unnoticed, which is why caches, whose manifest carries a
    checksum of every record, are fingerprinted by that instead. A record that cannot be read hashes
    as its error's type: the read fails again, with its traceback, when the loader needs it.

    Example:
        >>> records_digest(lambda ix: [{"x": i} for i in ix], 3) == records_digest(lambda ix: [{"x": i} for i in ix], 3)
        True
    """
    positions = list(range(n)) if n <= SMALL else np.linspace(0, n - 1, SAMPLE).round().astype(int).tolist()
    try:
        records = read(positions)
    except Exception:  # one bad record should not hide the others: read them one by one
        records = []
        for p in positions:
            try:
                records.append(read([p])[0])
            except Exception as e:  # noqa: BLE001 - see the docstring
                records.append(("unreadable", type(e).__qualname__))
    return digest(n, positions, records)


def function_identity(fn) -> tuple:
    """What names a transform's function in a fingerprint.

    A module-level function or class is named by ``module.qualname`` (stable across Python versions
    and edits: give ``name=`` a new value, or rename the function, when its output changes). A lambda or
    a function defined inside another one has no unique name, so its code is hashed instead (bytecode,
    constants, names) together with the plain values it closes over (bytecode differs between
    Python versions: give such a function a ``name=`` when a run must resume after an upgrade);
    ``functools.partial`` adds its arguments; a callable object is named by its class and its plain
    attributes.

    Example:
        >>> function_identity(len)
        ('builtins.len',)
        >>> function_identity(lambda r: r + 1) != function_identity(lambda r: r + 2)
        True
    """
    if isinstance(fn, partial):
        return ("partial", function_identity(fn.func), _plain(fn.args), _plain(fn.keywords))
    if isinstance(fn, types.MethodType):
        return ("method", function_identity(fn.__func__), _qualified(type(fn.__self__)), _plain(vars_of(fn.__self__)))
    qualname = getattr(fn, "__qualname__", None)
    if isinstance(fn, types.FunctionType) and ("<lambda>" in qualname or "<locals>" in qualname):
        cells = [c.cell_contents if _filled(c) else None for c in fn.__closure__ or ()]
        return (_qualified(fn), _code(fn.__code__), _plain(cells), _plain(fn.__defaults__))
    if qualname is not None:
        return (_qualified(fn),)
    return ("object", _qualified(type(fn)), _plain(vars_of(fn)))


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a closure variable not assigned yet
        return False
    return True


def vars_of(obj) -> dict:
    try:
        return dict(vars(obj))
    except TypeError:
        return {}


def _qualified(obj) -> str:
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _code(code: types.CodeType) -> tuple:
    consts = tuple(_code(c) if isinstance(c, types.CodeType) else _plain(c) for c in code.co_consts)
    return (code.co_code, consts, code.co_names)


def _plain(value, depth: int = 0):
    """``value`` if it is plain data (what a digest can hash stably), else its type's name."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, np.ndarray, np.generic)):
        return value
    if depth > 4:  # a self-referencing closure or structure: its type must do
        return ("object", _qualified(type(value)))
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):  # by content, in an order that does not depend on the hash seed
        return ("set", tuple(sorted((_plain(v, depth + 1) for v in value), key=repr)))
    if isinstance(value, types.FunctionType) and value.__closure__:
        return (_qualified(value), _code(value.__code__))
    if callable(value):
        return function_identity(value)
    return ("object", _qualified(type(value)))
