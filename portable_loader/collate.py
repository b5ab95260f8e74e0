"""Packing and collation: rows of document pieces -> fixed-shape numpy batches.

A *row plan* is a list of pieces ``(record_index, start, end)``: the tokens ``start:end`` of one
record (``end`` is cut to the record's length). ``pack`` turns a window of records into row plans (best-fit decreasing, deterministic: a pure
function of the records' lengths); ``collate`` turns row plans and fetched records into a batch:

* ``input_ids`` int32, ``loss_mask`` uint8: the pieces' tokens and masks, back to back;
* ``attention_mask`` uint8: 1 on real tokens, 0 on padding;
* ``segment_ids`` int32: 1, 2, ... per piece in the row, 0 for padding;
* ``positions`` int32: 0, 1, ... restarting at every piece, 0 for padding.

``fields`` picks which of them a batch holds (each costs a fill): the loader asks for
``PADDED_FIELDS`` when padding and all of ``FIELDS`` when packing, unless told otherwise.
``collate_spans`` fills the same batch from a cache's ``Spans`` (where the records' bytes lie)
instead of record dicts: the loader's path for caches.

Example:
    >>> rows = pack(np.array([7, 8]), np.array([3, 2]), seq_len=4)
    >>> rows
    [[(7, 0, 3)], [(8, 0, 2)]]
    >>> recs = {7: {"input_ids": np.array([1, 2, 3]), "loss_mask": np.array([0, 1, 1])},
    ...         8: {"input_ids": np.array([4, 5]), "loss_mask": np.array([1, 1])}}
    >>> collate(rows, recs, seq_len=4)["segment_ids"].tolist()
    [[1, 1, 1, 0], [1, 1, 0, 0]]
"""

from __future__ import annotations

import bisect
import threading
from typing import Mapping, Sequence

import numpy as np

__all__ = ["FIELDS", "FIELD_DTYPES", "OVERLONG", "PADDED_FIELDS", "Piece", "check_fields", "check_token_records", "collate",
           "collate_spans", "collating_into", "new_fields", "pack"]

Piece = tuple  # (record_index, start, end)


OVERLONG = ("split", "truncate", "drop")
FIELDS = ("input_ids", "loss_mask", "attention_mask", "segment_ids", "positions")
PADDED_FIELDS = ("input_ids", "loss_mask", "attention_mask")
_CHECKED = {FIELDS, PADDED_FIELDS}  # already valid: skip the check on the hot path
FIELD_DTYPES = {"input_ids": np.dtype(np.int32), "loss_mask": np.dtype(np.uint8), "attention_mask": np.dtype(np.uint8),
                "segment_ids": np.dtype(np.int32), "positions": np.dtype(np.int32)}
# The allocator of the batch this thread builds (collating_into), else None: numpy's. Per thread: a
# prefetch thread collates into its pool while the trainer's thread may build batches of its own.
_local = threading.local()


class collating_into:
    """Within this block, :func:`new_fields` takes each field's memory from ``alloc(name, size)``.

    ``alloc`` returns a writable array of ``size`` elements of the field's dtype (``FIELD_DTYPES``),
    in any state: :func:`new_fields` fills it. A loader worker passes its shared-memory block's
    allocator, so a batch is collated where the trainer's process will read it (no copy after).

    Example:
        >>> buf = np.full(16, 7, np.int32)
        >>> with collating_into(lambda name, size: buf[:size]):
        ...     out = new_fields(2, 4, 0, ("input_ids",))
        >>> out["input_ids"].base is buf, buf[:8].tolist()
        (True, [0, 0, 0, 0, 0, 0, 0, 0])
    """

    def __init__(self, alloc):
        self.alloc = alloc

    def __enter__(self):
        self._before = getattr(_local, "into", None)
        _local.into = self.alloc
        return self

    def __exit__(self, *exc) -> None:
        _local.into = self._before


def new_fields(n: int, seq_len: int, pad_id: int, fields: Sequence[str], flat: bool = False,
               fill: bool = True) -> dict[str, np.ndarray]:
    """The empty arrays of a batch: ``input_ids`` filled with ``pad_id``, the other fields with 0.

    Shaped ``[n, seq_len]``, or ``[n * seq_len]`` with ``flat=True``. Inside :class:`collating_into`
    the memory comes from its allocator. ``fill=False``: left as they are, for a caller that writes
    every element (reused memory would otherwise be filled twice).

    Example:
        >>> new_fields(1, 3, 9, ("input_ids", "loss_mask"))["input_ids"].tolist()
        [[9, 9, 9]]
    """
    shape = (n * seq_len,) if flat else (n, seq_len)
    into = getattr(_local, "into", None)
    if into is None:
        if not fill:
            return {name: np.empty(shape, FIELD_DTYPES[name]) for name in fields}
        out = {"input_ids": np.full(shape, pad_id, dtype=np.int32) if pad_id else np.zeros(shape, np.int32)}
        for name in fields[1:]:
            out[name] = np.zeros(shape, dtype=FIELD_DTYPES[name])
        return out
    out = {}
    for name in fields:
        values = into(name, n * seq_len).reshape(shape)
        if fill:
            values.fill(pad_id if name == "input_ids" else 0)
        out[name] = values
    return out


def pack(record_indices: np.ndarray, lengths: np.ndarray, seq_len: int, overlong: str = "split") -> list[list[Piece]]:
    """Pack records into rows of at most ``seq_len`` tokens, best-fit decreasing.

    A record longer than ``seq_len`` follows ``overlong``: ``"split"`` cuts it into ``seq_len``
    pieces and a remainder, ``"truncate"`` keeps its first ``seq_len`` tokens, ``"drop"`` leaves it
    out. Ties keep the window's order, so the result depends only on the inputs. The rows come out
    in creation order, which runs from the fullest rows to the emptiest: callers that train on them
    reorder them (``Planner`` does).

    Example:
        >>> pack(np.array([1, 2]), np.array([5, 2]), seq_len=4, overlong="drop")
        [[(2, 0, 2)]]
    """
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {OVERLONG}, got {overlong!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if not lengths.size or (lengths.max() <= seq_len and lengths.min() > 0):  # common: a record, a piece
        order = np.argsort(-lengths, kind="stable")
        by_size = lengths[order]
        sizes = by_size.tolist()
        pieces = list(zip(np.asarray(record_indices)[order].tolist(), [0] * len(sizes), sizes))
    else:
        unsorted = []
        for idx, n in zip(np.asarray(record_indices).tolist(), lengths.tolist()):
            if n > seq_len and overlong != "split":
                if overlong == "truncate":
                    unsorted.append((idx, 0, seq_len))
                continue
            for start in range(0, n, seq_len):
                unsorted.append((idx, start, min(n, start + seq_len)))
        order = np.argsort(-np.fromiter((p[2] - p[1] for p in unsorted), np.int64, len(unsorted)), kind="stable")
        pieces = [unsorted[i] for i in order.tolist()]
        sizes = [p[2] - p[1] for p in pieces]
        by_size = np.asarray(sizes, dtype=np.int64)
    # Pieces of more than half a row open a row each (the room any larger piece left is too small
    # for them): they are a prefix of the sorted pieces, placed without the search, and their
    # rooms come out already in order.
    big = int(np.count_nonzero(by_size * 2 > seq_len))
    rows: list[list[Piece]] = [[p] for p in pieces[:big]]
    # Free rows as one sorted list of ints room << 32 | row: the same order as (room, row) tuples,
    # compared several times faster. The first entry >= size << 32 is the row with the least room
    # that fits, the lowest-numbered among equals. A last entry above every room means "open a
    # row", so the search always lands on an entry.
    rooms = by_size[:big]
    has_room = rooms < seq_len
    free: list[int] = ((seq_len - rooms[has_room]) << 32 | np.arange(big)[has_room]).tolist()
    opens = seq_len << 32
    free.append(opens)
    find, insort = bisect.bisect_left, bisect.insort
    count = big
    # Each piece's size << 32, shifted in one numpy pass: the key of the room it needs.
    for need, piece in zip((by_size[big:] << 32).tolist(), pieces[big:]):
        slot = find(free, need)
        key = free[slot]
        if key == opens:
            rows.append([piece])
            if need < opens:
                insort(free, (opens - need) | count)
            count += 1
            continue
        rows[key & 0xFFFFFFFF].append(piece)
        key -= need  # the same row with less room: it moves towards the front of the list, or stays
        if key > 0xFFFFFFFF:  # room left (a compare: a shift makes a new int)
            if not slot or free[slot - 1] < key:  # often: it stays, one store
                free[slot] = key
            else:
                del free[slot]
                free.insert(find(free, key, 0, slot), key)
        else:
            del free[slot]
    return rows


def count_rows(lengths: np.ndarray, seq_len: int, overlong: str = "split") -> int:
    """``len(pack(records, lengths, seq_len, overlong))``, without building the rows (for skips).

    The row count of best-fit decreasing depends only on the multiset of rooms left, so only rooms
    are kept; a piece of ``seq_len`` tokens fills a row of its own.

    Example:
        >>> lengths = np.array([5, 2, 9, 3, 1])
        >>> count_rows(lengths, 6, "split") == len(pack(np.arange(5), lengths, 6, "split"))
        True
    """
    n = np.asarray(lengths, dtype=np.int64)
    n = n[n > 0]  # a record of no tokens makes no piece
    if overlong == "split":
        full = int((n // seq_len).sum())
        rest = n % seq_len
    else:
        if overlong == "drop":
            n = n[n <= seq_len]
        n = np.minimum(n, seq_len)
        full, rest = int(np.count_nonzero(n == seq_len)), n
    rest = rest[(rest > 0) & (rest < seq_len)]
    if not rest.size:
        return full
    rooms: list[int] = []
    find, insort, take = bisect.bisect_left, bisect.insort, rooms.pop
    rows = full
    for size in np.sort(rest)[::-1].tolist():
        k = find(rooms, size)
        if k < len(rooms):
            room = take(k)
        else:
            room, rows = seq_len, rows + 1
        if room > size:
            insort(rooms, room - size)
    return rows


_FEW_PIECES = 24  # below this, per-piece slice assignment beats the concatenations' fixed cost


def check_fields(fields) -> tuple[str, ...]:
    """``fields`` as a tuple in ``FIELDS`` order; ``ValueError`` naming what is wrong.

    A batch always holds ``input_ids``, and ``attention_mask`` or ``segment_ids`` (what tells
    real tokens from padding).

    Example:
        >>> check_fields(["positions", "input_ids", "segment_ids"])
        ('input_ids', 'segment_ids', 'positions')
    """
    if isinstance(fields, str) or not all(isinstance(f, str) for f in fields):
        raise ValueError(f"fields must be a list of names from {FIELDS}, got {fields!r}")
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise ValueError(f"fields: unknown {unknown}; choose from {FIELDS}")
    if "input_ids" not in fields or not {"attention_mask", "segment_ids"} & set(fields):
        raise ValueError(f"fields must include 'input_ids' and 'attention_mask' or 'segment_ids', got {list(fields)}")
    return tuple(f for f in FIELDS if f in fields)


def collate(
    rows: Sequence[Sequence[Piece]], records: Mapping[int, Mapping[str, np.ndarray]], seq_len: int, pad_id: int = 0,
    fields: Sequence[str] = FIELDS,
) -> dict[str, np.ndarray]:
    """Fill one ``[len(rows), seq_len]`` batch with ``fields``; rows may be empty (all padding)."""
    fields = fields if type(fields) is tuple and fields in _CHECKED else check_fields(fields)
    n = len(rows)
    out = new_fields(n, seq_len, pad_id, fields)
    if sum(map(len, rows)) < _FEW_PIECES:
        row_len = _fill_each(out, rows, records)
    else:
        row_len = _fill_concat(out, rows, records)
    att = out.get("attention_mask")
    if att is not None:
        for r, length in enumerate(row_len):  # each row's tokens are a prefix of it
            att[r, :length] = 1  # (per row: a broadcast compare costs several times more)
    return out


def _fill_each(out: dict, rows, records) -> list[int]:
    """Slice assignment per piece (few pieces: cheaper than any vectorized setup); each row's length."""
    ids, lm = out["input_ids"], out.get("loss_mask")
    seg, pos = out.get("segment_ids"), out.get("positions")
    row_len = []
    for r, row in enumerate(rows):
        at = 0
        for segment, (idx, start, end) in enumerate(row, start=1):
            record = records[idx]
            piece = record["input_ids"][start:end]  # end past the record's length: cut to it
            stop = at + piece.size
            ids[r, at:stop] = piece
            if lm is not None:
                mask = record.get("loss_mask")
                lm[r, at:stop] = 1 if mask is None else mask[start:end]
            if seg is not None:
                seg[r, at:stop] = segment
            if pos is not None:
                pos[r, at:stop] = np.arange(piece.size, dtype=np.int32)
            at = stop
        row_len.append(at)
    return row_len


def _fill_concat(out: dict, rows, records) -> list[int]:
    """The same as ``_fill_each`` with one concatenation per field and one slice per row and field.

    Each row's tokens are a prefix of the row, so the batch's real slots, read row by row, are the
    pieces back to back: slices of the concatenation fill them (a fancy-index scatter or a
    boolean-mask store writes token by token, several times slower).
    """
    tokens, masks, segments = [], [], []  # per piece: tokens, mask (None: all ones), its number in its row
    row_len = []
    for row in rows:
        at = 0
        for segment, (idx, start, end) in enumerate(row, start=1):
            record = records[idx]
            piece = record["input_ids"][start:end]
            mask = record.get("loss_mask")
            tokens.append(piece)
            masks.append(None if mask is None else mask[start:end])
            segments.append(segment)
            at += piece.size
        row_len.append(at)
    if not tokens:
        return row_len
    flat = {"input_ids": np.concatenate(tokens)}
    if "loss_mask" in out:
        flat["loss_mask"] = np.concatenate([np.ones(t.size, np.uint8) if m is None else m for t, m in zip(tokens, masks)])
    if "segment_ids" in out or "positions" in out:
        size = np.fromiter((t.size for t in tokens), dtype=np.int64, count=len(tokens))
        if "segment_ids" in out:
            flat["segment_ids"] = np.repeat(np.asarray(segments, dtype=np.int32), size)
        if "positions" in out:
            flat["positions"] = np.arange(flat["input_ids"].size, dtype=np.int32) - np.repeat(
                (np.cumsum(size) - size).astype(np.int32), size)
    at = 0
    for r, length in enumerate(row_len):  # a row's real slots are a prefix: one slice per row and field
        for name, values in flat.items():
            out[name][r, :length] = values[at : at + length]
        at += length
    return row_len


def collate_spans(
    rows: Sequence[Sequence[Piece]], spans, where: Mapping[int, int], seq_len: int, pad_id: int = 0,
    fields: Sequence[str] = FIELDS,
) -> dict[str, np.ndarray]:
    """``collate`` from ``spans`` (a cache's ``Spans``): record ``i`` is entry ``where[i]`` of it.

    The same batch as ``collate`` over the records, bit for bit. Every field goes by one memoryview
    slice copy per piece into the flat output (no record dicts, no numpy views per record: 0.2 µs
    a copy against 0.9 µs through numpy): ``positions`` from a ramp 0, 1, ..., ``segment_ids`` from
    a run of the piece's number (a numpy scalar fill cost 1 µs a piece, 35 of a packed batch's 80 µs;
    both also beat building them for the batch with ``np.repeat``). A record missing from ``where``
    raises ``KeyError``.

    Why a loop over pieces and not a boolean-mask or fancy-index store: at 8 x 2048 those write
    every slot of the batch (17-27 µs measured) where per-piece copies write only the real tokens.

    Example:
        >>> from portable_loader.cache.readers import Spans
        >>> buf = memoryview(np.array([5, 6, 7], np.int32).tobytes() + bytes([0, 1, 1]))
        >>> sp = Spans([buf], [buf], [0], [0], [12], [3])
        >>> collate_spans([[(42, 1, 9)]], sp, {42: 0}, seq_len=4)["input_ids"].tolist()
        [[6, 7, 0, 0]]
    """
    fields = fields if type(fields) is tuple and fields in _CHECKED else check_fields(fields)
    n = len(rows)
    # Flat arrays, written through byte memoryviews and shaped [n, seq_len] once filled.
    flat = new_fields(n, seq_len, pad_id, fields, flat=True)
    ids8 = memoryview(flat["input_ids"]).cast("B")
    lm = memoryview(flat["loss_mask"]) if "loss_mask" in flat else None
    att = memoryview(flat["attention_mask"]) if "attention_mask" in flat else None
    ones = (_ONES.get(seq_len) or _ones(seq_len)) if att is not None else None
    seg = memoryview(flat["segment_ids"]) if "segment_ids" in flat else None
    runs = (_RUNS.get(seq_len) or _runs(seq_len)) if seg is not None else None
    run_max = _RUN_MAX * seq_len
    pos = memoryview(flat["positions"]) if "positions" in flat else None
    ramp = (_RAMPS.get(seq_len) or _ramp(seq_len)) if pos is not None else None
    if lm is not None and att is not None and seg is not None and pos is not None:  # packing's default
        _fill_all(rows, spans, where, seq_len, ids8, lm, att, seg, pos, ones, runs, ramp, flat["segment_ids"])
        return {name: values.reshape(n, seq_len) for name, values in flat.items()}
    id_bufs, mask_bufs, buf, ids_at, mask_at, length = spans
    base = 0
    for row in rows:
        at = base
        for number, (idx, start, end) in enumerate(row, start=1):
            k = where[idx]
            m = length[k]
            size = (end if end < m else m) - start  # end past the record's length: cut to it
            if size < 0:
                size = 0
            b = buf[k]
            p = ids_at[k] + 4 * start
            ids8[4 * at : 4 * (at + size)] = id_bufs[b][p : p + 4 * size]
            if lm is not None:
                q = mask_at[k] + start
                lm[at : at + size] = mask_bufs[b][q : q + size]
            if seg is not None:
                r = number * seq_len
                if r < run_max:
                    seg[at : at + size] = runs[r : r + size]
                else:  # a row of more pieces than the runs cover: numpy's scalar fill
                    flat["segment_ids"][at : at + size] = number
            if pos is not None:
                pos[at : at + size] = ramp[:size]
            at += size
        if at - base > seq_len:  # the flat output would run on into the next row: refuse the plan
            raise ValueError(f"a row of {at - base} tokens does not fit seq_len {seq_len}: {row!r:.200}")
        if att is not None:  # each row's tokens are a prefix of it
            att[base:at] = ones[: at - base]
        base += seq_len
    return {name: values.reshape(n, seq_len) for name, values in flat.items()}


def _fill_all(rows, spans, where, seq_len, ids8, lm, att, seg, pos, ones, runs, ramp, segment_ids) -> None:
    """``collate_spans``' loop for all five fields, the packed default.

    The general loop with its four field checks per piece taken out, and the segment run's start
    counted instead of multiplied: a packed batch is ~40 pieces. With ``pack``'s last changes, the
    inline packed loop of ``bench_peers.py``'s setup went from 143 to 138 µs a batch (docs/performance.md).
    """
    id_bufs, mask_bufs, buf, ids_at, mask_at, length = spans
    run_max = _RUN_MAX * seq_len
    base = 0
    for row in rows:
        at = base
        r = 0  # where this piece's segment number starts in the runs: number * seq_len
        for idx, start, end in row:
            r += seq_len
            k = where[idx]
            m = length[k]
            size = (end if end < m else m) - start  # end past the record's length: cut to it
            if size < 0:
                size = 0
            stop = at + size
            b = buf[k]
            p = ids_at[k] + 4 * start
            ids8[4 * at : 4 * stop] = id_bufs[b][p : p + 4 * size]
            q = mask_at[k] + start
            lm[at:stop] = mask_bufs[b][q : q + size]
            if r < run_max:
                seg[at:stop] = runs[r : r + size]
            else:  # a row of more pieces than the runs cover: numpy's scalar fill
                segment_ids[at:stop] = r // seq_len
            pos[at:stop] = ramp[:size]
            at = stop
        if at - base > seq_len:  # the flat output would run on into the next row: refuse the plan
            raise ValueError(f"a row of {at - base} tokens does not fit seq_len {seq_len}: {row!r:.200}")
        att[base:at] = ones[: at - base]  # each row's tokens are a prefix of it
        base += seq_len


_ONES: dict[int, memoryview] = {}
_RAMPS: dict[int, memoryview] = {}
_RUNS: dict[int, memoryview] = {}
# Segment numbers with a ready run of ``seq_len`` copies: a row packs ~seq_len / mean length pieces,
# rarely more than 64; past that a numpy fill (~1 µs a piece against 0.2 µs for a copy).
_RUN_MAX = 64


def _ones(n: int) -> memoryview:
    """``n`` bytes of 1 (the attention mask's source), made once per row length."""
    ones = _ONES[n] = memoryview(b"\x01" * n)
    return ones


def _runs(n: int) -> memoryview:
    """``n`` copies of each of 0 .. ``_RUN_MAX`` - 1 as int32 (the segment ids' source), once per row length."""
    runs = _RUNS[n] = memoryview(np.repeat(np.arange(_RUN_MAX, dtype=np.int32), n))
    return runs


def _ramp(n: int) -> memoryview:
    """0, 1, ..., n - 1 as int32 (the positions' source), made once per row length."""
    ramp = _RAMPS[n] = memoryview(np.arange(n, dtype=np.int32))
    return ramp


def check_token_records(indices, records) -> None:
    """``TypeError`` naming the first record the token loader cannot read (not a dict with ``input_ids``).

    Raw records (bytes from an ArrayRecord file, say) need a decode step before the loader packs
    them; Grain-style pipelines of other elements are fine until they reach ``pl.DataLoader``.

    Example:
        >>> check_token_records([7], [b"\\x01\\x02"])
        Traceback (most recent call last):
        ...
        TypeError: record 7 is bytes, not a dict with 'input_ids': pl.DataLoader reads token records; add a decode step (.map(decode)) that returns {"input_ids": ...}
    """
    for i, r in zip(np.asarray(indices).reshape(-1).tolist(), records):
        if r is not None and not (isinstance(r, dict) and "input_ids" in r):
            what = f"a dict with keys {sorted(map(str, r))[:6]}" if isinstance(r, dict) else type(r).__name__
            raise TypeError(f"record {i} is {what}, not a dict with 'input_ids': pl.DataLoader reads token records; "
                            'add a decode step (.map(decode)) that returns {"input_ids": ...}')
