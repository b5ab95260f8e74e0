"""Grain's concat-then-split packing as an ``IterDataset`` step, with a state that is a position.

``ConcatThenSplitIterDataset(parent, length_struct={"ids": L})`` concatenates the elements' features
and cuts the result into rows of ``L`` cells: no padding but in the last row, and an element that
does not fit is split, its rest starting the next row. With several features, a row is complete as
soon as one feature is full; the others are padded. Every packed feature ``k`` comes with
``k_segment_ids`` (1, 2, ... per piece of element in the row, 0 for padding) and ``k_positions``
(0, 1, ... within each piece). Meta features are never split: each piece of an element carries the
whole of them, and they get no segment ids or positions. ``split_full_length_features=False``
passes elements that already fill a feature through unsplit, after the row being filled.
``BOSHandling.REPLACE_FIRST_TOKEN_WITH_BOS`` writes ``bos_token_id`` over the first token of
every piece, so that each row's pieces start with BOS.

The elements are Grain 0.2.18's but where Grain loses track of a piece (docs/grain.md: an element
split twice on one feature while another feature fits whole comes back with the other feature's
tokens again; a scalar feature is repeated in every piece of a split element; BOS is written into a
padding cell after an empty piece): here every token lands in exactly one row.

The state, as Grain's, is taken where a row begins: the parent's position before the element that
the row starts with, how far into that element each feature was consumed, and how many rows were
emitted since. Restoring re-reads from there: one element, or the few that a row (plus elements
passed through unsplit meanwhile) took. No element is saved in the state.

Example:
    >>> import numpy as np
    >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
    >>> ds = to_iter_dataset([{"ids": np.arange(n) + 1} for n in (3, 6, 2)])
    >>> for row in ConcatThenSplitIterDataset(ds, length_struct={"ids": 4}):
    ...     print(row["ids"], row["ids_segment_ids"], row["ids_positions"])
    [1 2 3 1] [1 1 1 2] [0 1 2 0]
    [2 3 4 5] [1 1 1 1] [0 1 2 3]
    [6 1 2 0] [1 2 2 0] [0 0 1 0]
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
import numpy as np

from portable_loader.dataset.iter.dataset import IterDataset
from portable_loader.dataset.iter.pack import as_iter_dataset, check_lengths

__all__ = ["BOSHandling", "ConcatThenSplitIterDataset"]

_NAME = "ConcatThenSplitIterDataset"


class BOSHandling(enum.Enum):
    """Grain's ``BOSHandling``: whether concat-then-split writes a BOS token at the start of every piece.

    Real Grain's members are accepted too (they are matched by name).

    Example:
        >>> [m.name for m in BOSHandling]
        ['DO_NOTHING', 'REPLACE_FIRST_TOKEN_WITH_BOS']
    """

    DO_NOTHING = enum.auto()
    REPLACE_FIRST_TOKEN_WITH_BOS = enum.auto()


def _bos_handling(value) -> BOSHandling:
    name = getattr(value, "name", None)
    if isinstance(value, enum.Enum) and name in BOSHandling.__members__:
        return BOSHandling[name]
    raise ValueError(f"{_NAME}: bos_handling must be a BOSHandling member, got {value!r}")


class ConcatThenSplitIterDataset(IterDataset):
    """Grain's ``ConcatThenSplitIterDataset``: the elements concatenated, then cut into rows of ``length_struct``.

    Elements are flat dicts whose keys are exactly ``length_struct``'s; values are arrays (the first
    axis is the sequence) or scalars (one cell). See the module docstring for the rules and the state.

    Example:
        >>> import numpy as np
        >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
        >>> ds = to_iter_dataset([{"ids": np.array([7, 8, 9])}, {"ids": np.array([5, 6])}])
        >>> packed = ConcatThenSplitIterDataset(ds, length_struct={"ids": 4},
        ...                                     bos_handling=BOSHandling.REPLACE_FIRST_TOKEN_WITH_BOS,
        ...                                     bos_features=["ids"], bos_token_id=1)
        >>> [row["ids"].tolist() for row in packed]      # the second piece of [5, 6] starts with BOS too
        [[1, 8, 9, 1], [1, 0, 0, 0]]
    """

    def __init__(self, parent, *, length_struct: Mapping[str, int], meta_features: Collection[str] = (),
                 split_full_length_features: bool = True, bos_handling: BOSHandling = BOSHandling.DO_NOTHING,
                 bos_features: Collection[str] = (), bos_token_id: int | None = None):
        super().__init__((as_iter_dataset(parent, _NAME),))
        self.lengths = check_lengths(length_struct, _NAME)
        for name, names in (("meta_features", meta_features), ("bos_features", bos_features)):
            if isinstance(names, str):
                raise ValueError(f"{_NAME}: {name} must be a collection of feature names, not the string {names!r}")
        self.meta, self.bos_features = frozenset(meta_features), frozenset(bos_features)
        self.split_full = bool(split_full_length_features)
        self.bos = _bos_handling(bos_handling)
        # Grain's rules, with its wording.
        if self.bos == BOSHandling.DO_NOTHING and (bos_token_id is not None or self.bos_features):
            raise ValueError(f"bos_handling={bos_handling} indicates that BOS handling is not used. So bos_token_id "
                             "and bos_features should not be set.")
        if self.bos != BOSHandling.DO_NOTHING and bos_token_id is None:
            raise ValueError(f"bos_token_id must be set if bos_handling is {bos_handling}.")
        if self.meta & self.bos_features:
            raise ValueError("bos_features and meta_features should not overlap. bos_features: "
                             f"{sorted(self.bos_features)}, meta_features: {sorted(self.meta)}")
        self.bos_token_id = bos_token_id

    def _identity(self) -> tuple:
        return ("concat_then_split", list(self.lengths.items()), sorted(self.meta), self.split_full, self.bos.name,
                sorted(self.bos_features), None if self.bos_token_id is None else repr(self.bos_token_id),
                self._parent._identity())

    def _make_part(self, children: list, n: int) -> "ConcatSplitIter":
        return ConcatSplitIter(f"{n}.concat_then_split", children[0], self)

    def __str__(self) -> str:
        return _NAME


class _Piece:
    """What is left of one element: its features, where each (non-meta) one starts, the parent's fields before it."""

    __slots__ = ("features", "start", "fields")

    def __init__(self, features: dict, start: dict, fields: dict):
        self.features, self.start, self.fields = features, start, fields

    def length(self, key, meta: bool) -> int:
        x = self.features[key]
        n = 1 if np.ndim(x) == 0 else len(x)
        return n if meta else n - self.start[key]


class ConcatSplitIter:
    """The running part of concat-then-split (iter_runtime's protocol: ``next``, ``fields``, ``restore``).

    Fields: the parent's position before the element the current row starts with,
    ``<n>.concat_then_split.emitted`` (rows emitted since that point) and, per non-meta feature,
    ``<n>.concat_then_split.offset.<feature>`` (cells of that element already in earlier rows).

    Example:
        >>> import numpy as np
        >>> from portable_loader.dataset.iter.dataset import to_iter_dataset
        >>> it = iter(ConcatThenSplitIterDataset(to_iter_dataset([{"x": np.arange(10)}]), length_struct={"x": 4}))
        >>> _ = next(it)
        >>> {k[2:]: int(v) for k, v in it.get_state()["cursor"].items()}  # 4 cells of element 0 used
        {'source.position': 0, 'concat_then_split.emitted': 0, 'concat_then_split.offset.x': 4}
    """

    def __init__(self, prefix: str, child, spec: ConcatThenSplitIterDataset):
        self.child, self.spec = child, spec
        self.keys = list(spec.lengths)
        self.split_keys = [k for k in self.keys if k not in spec.meta]
        self.emitted_field = f"{prefix}.emitted"
        self.offset_fields = {k: f"{prefix}.offset.{k}" for k in self.split_keys}
        self.arange = np.arange(max(spec.lengths.values()), dtype=np.int32)
        self.arange.flags.writeable = False
        self.bos = spec.bos_token_id if spec.bos == BOSHandling.REPLACE_FIRST_TOKEN_WITH_BOS else None
        self.rest: _Piece | None = None  # the part of an element that did not fit the last row
        self.rows: list | None = None
        self.emitted = 0  # rows of self.rows handed on, or to skip after a restore
        self.mark: dict | None = None  # the parent's fields where self.rows began; None: its current ones
        self.offsets = dict.fromkeys(self.split_keys, 0)
        self.pending: dict | None = None  # offsets of the element to re-read after a restore
        self.refuse = None

    # --- reading -----------------------------------------------------------------------------------

    def _read(self) -> _Piece | None:
        fields = self.child.fields()
        try:
            element = self.child.next()
        except StopIteration:
            return None
        if not isinstance(element, Mapping):
            raise ValueError(f"Parent elements must be unnested dictionaries but got {type(element).__name__}.")
        if set(element) != set(self.keys):
            raise ValueError(f"{_NAME}: an element has the features {sorted(element, key=str)} but length_struct "
                             f"names {sorted(self.keys, key=str)}; there must be a target length for each feature, "
                             "and each element must have every feature")
        for k, v in element.items():
            if isinstance(v, Mapping) or (np.ndim(v) > 0 and not hasattr(v, "__len__")):
                raise ValueError(f"{_NAME}: feature {k!r} must be an array or a scalar (elements are unnested "
                                 f"dictionaries), got {type(v).__name__}")
        return _Piece(element, dict.fromkeys(self.split_keys, 0), fields)

    def _full_length(self, piece: _Piece) -> bool:
        full = False
        for k, target in self.spec.lengths.items():
            n = piece.length(k, k in self.spec.meta)
            if n > target:
                return False
            full = full or n == target
        return full

    def _take(self, piece: _Piece, row: list, used: dict) -> _Piece | None:
        """Put what fits of ``piece`` in ``row``; the rest (``piece`` itself where nothing fits), or None."""
        take, split = {}, False
        for k, target in self.spec.lengths.items():
            meta = k in self.spec.meta
            n, room = piece.length(k, meta), target - used[k]
            if meta and n > room:
                return piece  # never split: the row ends without this element
            if not meta and n > room:
                n, split = room, True
            take[k] = n
        if split and not any(take[k] for k in self.split_keys):
            return piece
        row.append((piece, dict(piece.start), take))
        for k, n in take.items():
            used[k] += n
        if not split:
            return None
        return _Piece(piece.features, {k: piece.start[k] + take[k] for k in self.split_keys}, piece.fields)

    def _pack(self, parts: list) -> dict:
        """One output row from ``(piece, starts, cells taken)`` triples."""
        out = {}
        for k, target in self.spec.lengths.items():
            meta = k in self.spec.meta
            first = np.asarray(parts[0][0].features[k])
            values = np.zeros((target, *first.shape[1:]), first.dtype)
            if not meta:
                seg, pos = np.zeros(target, np.int32), np.zeros(target, np.int32)
            bos = self.bos is not None and k in self.spec.bos_features
            end = 0
            for segment, (piece, starts, take) in enumerate(parts, 1):
                x, n = piece.features[k], take[k]
                start, end = end, end + n
                if meta:
                    values[start:end] = x
                    continue
                values[start:end] = x if np.ndim(x) == 0 else x[starts[k]:starts[k] + n]
                if bos and n:
                    values[start] = self.bos
                seg[start:end] = segment
                pos[start:end] = self.arange[:n]
            out[k] = values
            if not meta:
                out[f"{k}_segment_ids"], out[f"{k}_positions"] = seg, pos
        return out

    def _fill(self) -> list:
        """The rows that follow from here: the row being filled, then the elements passed through while filling it."""
        row: list = []
        used = dict.fromkeys(self.keys, 0)
        passed: list = []
        rest, self.rest = self.rest, None
        if rest is not None:
            rest = self._take(rest, row, used)
        while rest is None:
            piece = self._read()
            if piece is None:
                break
            if not self.spec.split_full and self._full_length(piece):
                passed.append(self._pack([(piece, piece.start, {k: piece.length(k, k in self.spec.meta)
                                                                for k in self.keys})]))
                continue
            rest = self._take(piece, row, used)
        self.rest = rest
        rows = ([self._pack(row)] if row else []) + passed
        if not rows and rest is not None:
            long = [k for k in self.spec.meta if rest.length(k, True) > self.spec.lengths[k]]
            raise ValueError(f"{_NAME}: meta feature {long[0]!r} has {rest.length(long[0], True)} cells, more than its "
                             f"target length {self.spec.lengths[long[0]]}; meta features are never split")
        return rows

    # --- the part's protocol -----------------------------------------------------------------------

    def next(self):
        if self.rows is None:
            if self.mark is None:
                self.mark = self.child.fields()
            if self.pending is not None:
                self._reread()
            rows = self._fill()
            if not rows:
                raise StopIteration
            if self.emitted >= len(rows):
                raise self.refuse(self.emitted_field, f"{self.emitted} rows emitted, but only {len(rows)} follow")
            self.rows = rows
        out = self.rows[self.emitted]
        self.emitted += 1
        if self.emitted == len(self.rows):
            # The next rows begin with what is left over: the state is the position before its element.
            self.rows, self.emitted = None, 0
            self.mark = None if self.rest is None else self.rest.fields
            self.offsets = dict.fromkeys(self.split_keys, 0) if self.rest is None else dict(self.rest.start)
        return out

    def _reread(self) -> None:
        offsets, self.pending = self.pending, None
        piece = self._read()
        if piece is None:
            raise self.refuse(self.emitted_field, "the state names a part-used element past the end of the stream")
        for k, off in offsets.items():
            if off > piece.length(k, False):
                raise self.refuse(self.offset_fields[k],
                                  f"offset {off} is past the element's {piece.length(k, False)} cells")
        piece.start = offsets
        self.rest = piece

    def fields(self) -> dict:
        out = dict(self.child.fields() if self.mark is None else self.mark)
        out[self.emitted_field] = self.emitted
        for k, name in self.offset_fields.items():
            out[name] = self.offsets[k]
        return out

    def field_names(self) -> list[str]:
        return self.child.field_names() + [self.emitted_field, *self.offset_fields.values()]

    def restore(self, fields: dict, refuse) -> None:
        self.child.restore(fields, refuse)
        self.mark = {k: fields[k] for k in self.child.field_names()}
        self.offsets = {k: fields[name] for k, name in self.offset_fields.items()}
        # An element none of which was used is read afresh, as it was the first time.
        self.pending = dict(self.offsets) if any(self.offsets.values()) else None
        self.emitted, self.rows, self.rest, self.refuse = fields[self.emitted_field], None, None, refuse

    def close(self) -> None:
        self.child.close()
