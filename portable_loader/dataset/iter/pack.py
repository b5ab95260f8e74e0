"""Grain's first-fit and best-fit packing as ``IterDataset`` steps, with a state that is a position.

``FirstFitPackIterDataset(parent, length_struct=..., num_packing_bins=N)`` reads elements (dicts of
variable-length arrays) and places each in the first of ``N`` bins where every feature still fits
(``BestFitPackIterDataset``: in the fullest bin where it fits). When an element fits no bin, the
bins are emitted one per element (shuffled unless ``shuffle_bins=False``) and a new set of bins
starts with that element. Each packed feature ``k`` comes with ``k_segment_ids`` (1, 2, ... per
packed element, 0 for padding) and ``k_positions`` (0, 1, ... within each element). The elements
are Grain 0.2.18's, shuffled bins included: the shuffle is ``default_rng(seed + rows emitted
before the bins)``, which depends only on the position.

The state: Grain saves its parent's state at the start of the current set of bins, the next row
and a row counter. Ours is the same idea in our format: the parent's position fields as they were
when the first element of the current bins was read, the row about to be emitted, and (when
shuffling) the rows emitted before these bins. Restoring re-reads the elements of one set of bins
(at most the ``N`` bins' worth) and skips the rows already emitted; no buffered element is saved.

Example:
    >>> import numpy as np
    >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
    >>> ds = to_iter_dataset([{"ids": np.arange(n) + 1} for n in (3, 2, 4, 1)])
    >>> packed = FirstFitPackIterDataset(ds, length_struct={"ids": 5}, num_packing_bins=2, shuffle_bins=False)
    >>> for row in packed:
    ...     print(row["ids"], row["ids_segment_ids"], row["ids_positions"])
    [1 2 3 1 2] [1 1 1 2 2] [0 1 2 0 1]
    [1 2 3 4 1] [1 1 1 1 2] [0 1 2 3 0]
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import numpy as np

from portable_loader.dataset.iter.dataset import IterDataset, to_iter_dataset

__all__ = ["BestFitPackIterDataset", "FirstFitPackIterDataset"]


def as_iter_dataset(parent, step: str) -> IterDataset:
    """``parent`` as one of our IterDatasets: a random-access dataset is read in order, as Grain iterates a MapDataset.

    Example:
        >>> list(as_iter_dataset([1, 2], "pack"))
        [1, 2]
    """
    if isinstance(parent, IterDataset):
        return parent
    grain_ds = sys.modules.get("grain._src.python.dataset.dataset")
    if grain_ds is not None and isinstance(parent, grain_ds.IterDataset):
        raise TypeError(f"{step}: the parent is a real Grain IterDataset; build it with portable_loader's "
                        "to_iter_dataset (or from portable_loader import grain)")
    return to_iter_dataset(parent)


def check_lengths(length_struct, step: str) -> dict:
    """``length_struct`` as a dict of feature name to positive int, or a ValueError naming what is wrong.

    Example:
        >>> check_lengths({"ids": 0}, "pack")
        Traceback (most recent call last):
        ...
        ValueError: pack: length_struct['ids'] must be a positive integer, got 0
    """
    if not isinstance(length_struct, Mapping) or not length_struct:
        raise ValueError(f"{step}: length_struct must be a non-empty dict of feature name to target length, "
                         f"got {length_struct!r}")
    out = {}
    for k, v in length_struct.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{step}: length_struct[{k!r}] must be a positive integer, got {v!r}")
        out[k] = int(v)
    return out


def flat_lengths(length_struct, step: str) -> dict:
    """Packing's ``length_struct``, where a feature may be a nested dict of lengths (Grain packs those
    as meta features): feature name, or a tuple path for a nested leaf, to positive int.

    Example:
        >>> flat_lengths({"ids": 8, "extra": {"a": 4}}, "pack")
        {'ids': 8, ('extra', 'a'): 4}
    """
    nested = {k: v for k, v in length_struct.items() if isinstance(v, Mapping)} \
        if isinstance(length_struct, Mapping) else {}
    out = check_lengths({k: v for k, v in length_struct.items() if k not in nested}, step) if len(nested) < len(
        length_struct) else {}
    for k, inner in nested.items():
        if not inner:
            raise ValueError(f"{step}: length_struct[{k!r}] must be a positive integer or a non-empty dict of them, "
                             "got {}")
        for path, n in flat_lengths(inner, step).items():
            out[(k, *path) if isinstance(path, tuple) else (k, path)] = n
    return out


def leaf(element: Mapping, key):
    """The value of ``element`` at a feature name or a tuple path (a nested feature's leaf)."""
    if not isinstance(key, tuple):
        return element[key]
    for part in key:
        element = element[part]
    return element


def top(key):
    """The top-level feature of a name or a tuple path."""
    return key[0] if isinstance(key, tuple) else key


def seq_len(x) -> int:
    """A feature's length along its first axis; a scalar counts as one cell, as in Grain."""
    return 1 if np.ndim(x) == 0 else len(x)


def _per_feature(struct, lengths: dict, name: str, check: Callable[[Any], bool], what: str) -> dict | None:
    if struct is None:
        return None
    if isinstance(struct, Mapping) and any(isinstance(v, Mapping) for v in struct.values()):
        struct = _flatten(struct)
    if not isinstance(struct, Mapping) or set(struct) != set(lengths):
        raise ValueError(f"pack: {name} must be a dict with the keys of length_struct {sorted(lengths)}, "
                         f"got {struct!r}")
    for k, v in struct.items():
        if not check(v):
            raise ValueError(f"pack: {name}[{k!r}] must be {what}, got {v!r}")
    return dict(struct)


def _flatten(struct: Mapping, prefix: tuple = ()) -> dict:
    out = {}
    for k, v in struct.items():
        path = (*prefix, k)
        if isinstance(v, Mapping):
            out.update(_flatten(v, path))
        else:
            out[path if len(path) > 1 else k] = v
    return out


def _by_key(struct: dict) -> list:
    """Items in key order: feature names as before (so fingerprints stay), then nested paths."""
    return sorted(struct.items(), key=lambda kv: (isinstance(kv[0], tuple), kv[0] if isinstance(kv[0], str) else
                                                  tuple(map(str, kv[0]))))


class _PackNode(IterDataset):
    """The immutable step; ``FirstFitPackIterDataset`` and ``BestFitPackIterDataset`` name the strategy."""

    _strategy = ""

    def __init__(self, parent, *, length_struct: Any, num_packing_bins: int, seed: int = 0,
                 shuffle_bins: bool = True, shuffle_bins_group_by_feature: str | None = None,
                 meta_features: Sequence[str] = (), pack_alignment_struct: Any = None, padding_struct: Any = None,
                 max_sequences_per_bin: int | None = None):
        name = type(self).__name__
        super().__init__((as_iter_dataset(parent, name),))
        if not isinstance(length_struct, Mapping) or not length_struct:
            check_lengths(length_struct, name)  # its error
        self.lengths = flat_lengths(length_struct, name)
        if isinstance(num_packing_bins, bool) or not isinstance(num_packing_bins, (int, np.integer)) \
                or num_packing_bins <= 0:
            raise ValueError(f"{name}: num_packing_bins must be a positive integer, got {num_packing_bins!r}")
        if max_sequences_per_bin is not None and (not isinstance(max_sequences_per_bin, (int, np.integer))
                                                  or max_sequences_per_bin <= 0):
            raise ValueError("If specified, `max_sequences_per_bin` must be a positive integer, "
                             f"but got {max_sequences_per_bin}.")
        if isinstance(meta_features, str):
            raise ValueError(f"{name}: meta_features must be a sequence of feature names, not the string "
                             f"{meta_features!r}")
        self.num_bins, self.seed, self.shuffle = int(num_packing_bins), int(seed), bool(shuffle_bins)
        self.group_by = shuffle_bins_group_by_feature
        self.meta = tuple(meta_features)
        self.align = _per_feature(pack_alignment_struct, self.lengths, "pack_alignment_struct",
                                  lambda v: isinstance(v, (int, np.integer)) and v > 0, "a positive integer")
        self.padding = _per_feature(padding_struct, self.lengths, "padding_struct",
                                    lambda v: v is None or np.ndim(v) == 0, "None or a scalar")
        self.max_per_bin = None if max_sequences_per_bin is None else int(max_sequences_per_bin)

    def _identity(self) -> tuple:
        return (self._strategy, _by_key(self.lengths), self.num_bins, self.seed, self.shuffle, self.group_by,
                self.meta, None if self.align is None else _by_key(self.align),
                None if self.padding is None else [(k, repr(v)) for k, v in _by_key(self.padding)],
                self.max_per_bin, self._parent._identity())

    def _make_part(self, children: list, n: int) -> "PackIter":
        return PackIter(f"{n}.pack", children[0], self)

    def __str__(self) -> str:
        return type(self).__name__


class FirstFitPackIterDataset(_PackNode):
    """Grain's ``FirstFitPackIterDataset``: each element goes to the first of ``num_packing_bins`` bins it fits.

    Arguments and elements are Grain 0.2.18's (module docstring): ``length_struct`` maps each
    packed feature to its target length; ``meta_features`` are not given segment ids and positions
    (those also in ``length_struct`` are packed and padded, the others become a list per bin; a
    meta feature may be a dict, its lengths a dict in ``length_struct``: each leaf is packed);
    ``pack_alignment_struct`` rounds where the next element of a feature may start,
    ``padding_struct`` sets the padding values, ``max_sequences_per_bin`` caps the elements per bin.
    An element longer than its target length raises a ValueError, as in Grain: truncate first.

    Example:
        >>> import numpy as np
        >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
        >>> ds = to_iter_dataset([{"x": np.arange(n), "doc": n} for n in (2, 3, 2)])
        >>> it = iter(FirstFitPackIterDataset(ds, length_struct={"x": 4}, num_packing_bins=2, meta_features=["doc"]))
        >>> [(row["x"].tolist(), row["doc"]) for row in it]
        [([0, 1, 0, 1], [2, 2]), ([0, 1, 2, 0], [3])]
    """

    _strategy = "first_fit"


class BestFitPackIterDataset(_PackNode):
    """Grain's ``BestFitPackIterDataset``: each element goes to the fullest bin it fits (the first of equals).

    The same arguments as :class:`FirstFitPackIterDataset`; "fullest" counts the cells used over all
    packed features, as Grain does. Less padding than first fit where lengths vary.

    Example:
        >>> import numpy as np
        >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
        >>> ds = to_iter_dataset([{"x": np.arange(n) + 1} for n in (5, 3, 2, 1, 4)])
        >>> [row["x"].tolist() for row in BestFitPackIterDataset(ds, length_struct={"x": 6}, num_packing_bins=3,
        ...                                                       shuffle_bins=False)]
        [[1, 2, 3, 4, 5, 1], [1, 2, 3, 1, 2, 0], [1, 2, 3, 4, 0, 0]]
    """

    _strategy = "best_fit"


class _Bins:
    """One set of bins being filled: Grain's buffers, shaped and typed after the set's first element."""

    def __init__(self, spec: "_PackNode", first: dict):
        n = spec.num_bins
        self.values, self.seg, self.pos = {}, {}, {}
        for k, cap in spec.lengths.items():
            if isinstance(k, tuple) and k[0] not in spec.meta:
                raise ValueError(f"Failed to extract segment ids for {k[0]!r}, which has type <class 'dict'> rather "
                                 "than np.ndarray. Perhaps it should be marked as a meta feature?")
            x = leaf(first, k)
            if np.ndim(x) == 0:
                shape, dtype = (), (np.int64 if isinstance(x, int) else np.asarray(x).dtype)
            elif isinstance(x, np.ndarray):
                shape, dtype = x.shape[1:], x.dtype
            else:
                raise ValueError(f"{type(spec).__name__}: feature {k!r} must be a NumPy array or a scalar, "
                                 f"got {type(x).__name__}")
            pad = None if spec.padding is None else spec.padding[k]
            self.values[k] = np.zeros((n, cap, *shape), dtype) if pad is None else np.full((n, cap, *shape), pad, dtype)
            if top(k) not in spec.meta:
                self.seg[k] = np.zeros((n, cap), np.int32)
                self.pos[k] = np.zeros((n, cap), np.int32)
        self.keys = list(spec.lengths)
        self.caps = [spec.lengths[k] for k in self.keys]
        self.align = [1 if spec.align is None else spec.align[k] for k in self.keys]
        self.used = [[0] * n for _ in self.keys]  # per feature, per bin: the first free cell
        self.count = [0] * n  # elements per bin
        packed = {top(k) for k in spec.lengths}
        self.lists = {k: [[] for _ in range(n)] for k in spec.meta if k not in packed}
        self.best = spec._strategy == "best_fit"
        self.max_per_bin = spec.max_per_bin

    def place(self, element: dict, lengths: list, arange: np.ndarray) -> bool:
        """Put ``element`` in its bin; False where it fits none (the set is then complete)."""
        row, best_score = -1, -1
        for b in range(len(self.count)):
            if self.max_per_bin is not None and self.count[b] >= self.max_per_bin:
                # Grain's best fit marks a full bin by adding its capacity to the free cells it checks,
                # which an empty bin still passes with an empty element: it takes one more there.
                if not (self.best and all(used[b] + n == 0 for used, n in zip(self.used, lengths))):
                    continue
            if all(used[b] + n <= cap for used, n, cap in zip(self.used, lengths, self.caps)):
                if not self.best:
                    row = b
                    break
                score = sum(used[b] for used in self.used)
                if score > best_score:
                    row, best_score = b, score
        if row < 0:
            return False
        self.count[row] += 1
        segment = self.count[row]
        for i, k in enumerate(self.keys):
            start, n = self.used[i][row], lengths[i]
            end = start + n
            self.values[k][row, start:end] = leaf(element, k)
            if k in self.seg:
                self.seg[k][row, start:end] = segment
                self.pos[k][row, start:end] = arange[:n]
            a = self.align[i]
            self.used[i][row] = -(-end // a) * a
        for k, lists in self.lists.items():
            lists[row].append(element[k])
        return True

    def rows(self) -> list[dict]:
        """The filled bins as elements, keys sorted as Grain's tree functions leave them."""
        filled = sum(1 for c in self.count if c)  # the filled bins are always the first ones
        out = []
        for r in range(filled):
            row: dict = {}
            for k, v in self.values.items():  # a nested feature's leaves go back into its dicts
                at = row
                for part in k[:-1] if isinstance(k, tuple) else ():
                    at = at.setdefault(part, {})
                at[k[-1] if isinstance(k, tuple) else k] = v[r]
            for k, lists in self.lists.items():
                row[k] = lists[r]
            for k in self.seg:
                row[f"{k}_segment_ids"] = self.seg[k][r]
                row[f"{k}_positions"] = self.pos[k][r]
            out.append(_sorted(row))
        return out


def _has(element, key) -> bool:
    try:
        leaf(element, key)
        return True
    except (KeyError, TypeError, IndexError):
        return False


def _sorted(row: dict) -> dict:
    return {k: _sorted(row[k]) if isinstance(row[k], dict) else row[k] for k in sorted(row)}


class PackIter:
    """The running part of a packing step (iter_runtime's protocol: ``next``, ``fields``, ``restore``).

    Fields: the parent's position when the current bins' first element was read,
    ``<n>.pack.row`` (rows of these bins already emitted) and, when shuffling,
    ``<n>.pack.count`` (rows emitted before these bins: the shuffle's seed offset).

    Example:
        >>> import numpy as np
        >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
        >>> ds = FirstFitPackIterDataset(to_iter_dataset([{"x": np.arange(3)}] * 5), length_struct={"x": 4},
        ...                              num_packing_bins=3, shuffle_bins=False)
        >>> it = iter(ds)
        >>> _ = next(it)
        >>> {k[2:]: int(v) for k, v in it.get_state()["cursor"].items()}   # the bins began at position 0
        {'source.position': 0, 'pack.row': 1}
    """

    def __init__(self, prefix: str, child, spec: _PackNode):
        self.child, self.spec = child, spec
        self.row_field = f"{prefix}.row"
        self.count_field = f"{prefix}.count" if spec.shuffle else None
        self.keep = {top(k) for k in spec.lengths} | set(spec.meta)
        self.arange = np.arange(max(spec.lengths.values()), dtype=np.int32)
        self.arange.flags.writeable = False
        self.start_fields: dict | None = None  # None: the parent's current position
        self.before = 0  # rows emitted before the current bins
        self.row = 0
        self.batch: list | None = None
        self.carry = None  # (element, its lengths, the parent's fields before it): what did not fit
        self.refuse = None

    def _read(self):
        """The next element, checked and with its lengths, and the parent's fields before it; None at the end."""
        fields = self.child.fields()  # the next bins may begin with this element: their state is the position before it
        try:
            element = self.child.next()
        except StopIteration:
            return None
        name = type(self.spec).__name__
        if not isinstance(element, Mapping):
            raise ValueError(f"{name}: elements must be dicts of features, got {type(element).__name__}")
        missing = [k for k in self.keep if k not in element]
        if missing:
            raise ValueError(f"{name}: an element has no feature {sorted(missing, key=str)[0]!r} (length_struct and "
                             f"meta_features name {sorted(self.keep, key=str)}; the element has "
                             f"{sorted(element, key=str)})")
        try:
            lengths = [seq_len(leaf(element, k)) for k in self.spec.lengths]
        except (KeyError, TypeError, IndexError):
            bad = next(k for k in self.spec.lengths if not _has(element, k))
            raise ValueError(f"{name}: an element has no {bad!r} (a nested feature of length_struct)") from None
        too_long = [(k, n, cap) for (k, cap), n in zip(self.spec.lengths.items(), lengths) if n > cap]
        if too_long:
            raise ValueError(f"{name}: inputs must be truncated to the target length first; (feature, length, target "
                             f"length) = {too_long}")
        return element, lengths, fields

    def _fill(self) -> None:
        """Fill a new set of bins and put its rows in emission order."""
        bins = None
        if self.carry is not None:
            element, lengths, _ = self.carry
            self.carry = None
            bins = _Bins(self.spec, element)
            bins.place(element, lengths, self.arange)  # an empty bin takes any element of legal length
        while True:
            read = self._read()
            if read is None:
                break
            element, lengths, _ = read
            if bins is None:
                bins = _Bins(self.spec, element)
            if not bins.place(element, lengths, self.arange):
                self.carry = read
                break
        if bins is None:
            raise StopIteration
        rows = bins.rows()
        if self.spec.shuffle:
            rows = [rows[i] for i in self._order(rows)]
        self.batch = rows

    def _order(self, rows: list) -> list:
        perm = np.random.default_rng(self.spec.seed + self.before).permuted(range(len(rows)))
        key = self.spec.group_by
        if key is None:
            return [int(i) for i in perm]
        if key not in rows[0]:
            raise ValueError(f"{type(self.spec).__name__}: shuffle_bins_group_by_feature {key!r} is not a feature of "
                             f"the packed elements {sorted(rows[0])}")

        def mean_group(row) -> float:  # the mean of the distinct non-zero values, 0 where there are none
            groups = np.unique(row[key])
            nonzero = np.count_nonzero(groups)
            return float(np.sum(groups) / nonzero) if nonzero else 0.0

        means = [mean_group(r) for r in rows]
        return sorted(range(len(rows)), key=lambda i: (means[i], perm[i]))

    def next(self):
        if self.batch is None:
            if self.start_fields is None:
                self.start_fields = self.child.fields()
            skip, self.row = self.row, 0
            self._fill()
            if skip >= len(self.batch):
                raise self.refuse(self.row_field, f"row {skip} is past the {len(self.batch)} rows these bins hold")
            self.row = skip
        out = self.batch[self.row]
        self.row += 1
        if self.row == len(self.batch):
            # The next bins begin with the element that did not fit: the position before it is the state.
            self.start_fields = self.carry[2] if self.carry is not None else None
            self.before += len(self.batch)
            self.row, self.batch = 0, None
        return out

    def fields(self) -> dict:
        out = dict(self.child.fields() if self.start_fields is None else self.start_fields)
        out[self.row_field] = self.row
        if self.count_field:
            out[self.count_field] = self.before
        return out

    def field_names(self) -> list[str]:
        return self.child.field_names() + [self.row_field] + ([self.count_field] if self.count_field else [])

    def restore(self, fields: dict, refuse) -> None:
        row = fields[self.row_field]
        if row >= self.spec.num_bins:
            raise refuse(self.row_field, f"row {row} is not below num_packing_bins ({self.spec.num_bins})")
        self.child.restore(fields, refuse)
        self.start_fields = {k: fields[k] for k in self.child.field_names()}
        self.row, self.before = row, fields[self.count_field] if self.count_field else 0
        self.batch, self.carry, self.refuse = None, None, refuse

    def close(self) -> None:
        self.child.close()
