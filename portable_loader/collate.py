"""Packing and collation: rows of document pieces -> fixed-shape numpy batches.

A *row plan* is a list of pieces ``(record_index, start, end)``: the tokens ``start:end`` of one
record (``end`` is cut to the record's length). ``pack`` turns a window of records into row plans (best-fit decreasing, deterministic: a pure
function of the records' lengths); ``collate`` turns row plans and fetched records into a batch:

* ``input_ids`` int32, ``loss_mask`` uint8: the pieces' tokens and masks, back to back;
* ``segment_ids`` int32: 1, 2, ... per piece in the row, 0 for padding;
* ``positions`` int32: 0, 1, ... restarting at every piece, 0 for padding.

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
from typing import Mapping, Sequence

import numpy as np

__all__ = ["OVERLONG", "pack", "collate", "Piece"]

Piece = tuple  # (record_index, start, end)


OVERLONG = ("split", "truncate", "drop")


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
    pieces: list[Piece] = []
    for idx, n in zip(record_indices.tolist(), lengths.tolist()):
        if n > seq_len and overlong != "split":
            if overlong == "truncate":
                pieces.append((idx, 0, seq_len))
            continue
        for start in range(0, n, seq_len):
            pieces.append((idx, start, min(n, start + seq_len)))
    sizes = np.fromiter((p[2] - p[1] for p in pieces), dtype=np.int64, count=len(pieces))
    rows: list[list[Piece]] = []
    free: list[tuple[int, int]] = []  # (room left, row number), sorted
    for i in np.argsort(-sizes, kind="stable").tolist():
        size = int(sizes[i])
        slot = bisect.bisect_left(free, (size, -1))
        if slot < len(free):
            room, row = free.pop(slot)
        else:
            room, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(pieces[i])
        if room - size > 0:
            bisect.insort(free, (room - size, row))
    return rows


_FEW_PIECES = 24  # below this, per-piece slice assignment beats the vectorized scatter's fixed cost


def collate(
    rows: Sequence[Sequence[Piece]], records: Mapping[int, Mapping[str, np.ndarray]], seq_len: int, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """Fill one ``[len(rows), seq_len]`` batch; rows may be empty (all padding)."""
    n = len(rows)
    out = {
        "input_ids": np.full((n, seq_len), pad_id, dtype=np.int32),
        "loss_mask": np.zeros((n, seq_len), dtype=np.uint8),
        "segment_ids": np.zeros((n, seq_len), dtype=np.int32),
        "positions": np.zeros((n, seq_len), dtype=np.int32),
    }
    pieces = []  # (row, segment, tokens, mask)
    for r, row in enumerate(rows):
        for segment, (idx, start, end) in enumerate(row, start=1):
            record = records[idx]
            tokens = record["input_ids"][start:end]  # end past the record's length: cut to it
            rec_mask = record.get("loss_mask")
            pieces.append((r, segment, tokens, np.ones(tokens.size, np.uint8) if rec_mask is None else rec_mask[start:end]))
    if len(pieces) < _FEW_PIECES:
        _fill_each(out, pieces)
    elif pieces:
        _fill_scatter(out, pieces, seq_len)
    return out


def _fill_each(out: dict, pieces: list) -> None:
    at, last_row = 0, -1
    for r, segment, tokens, mask in pieces:
        at = 0 if r != last_row else at
        last_row, size = r, tokens.size
        out["input_ids"][r, at : at + size] = tokens
        out["loss_mask"][r, at : at + size] = mask
        out["segment_ids"][r, at : at + size] = segment
        out["positions"][r, at : at + size] = np.arange(size, dtype=np.int32)
        at += size


def _fill_scatter(out: dict, pieces: list, seq_len: int) -> None:
    """The same as ``_fill_each`` with one concatenation and one scatter per field."""
    row = np.fromiter((p[0] for p in pieces), dtype=np.int64, count=len(pieces))
    seg = np.fromiter((p[1] for p in pieces), dtype=np.int64, count=len(pieces))
    size = np.fromiter((p[2].size for p in pieces), dtype=np.int64, count=len(pieces))
    ends = np.cumsum(size)
    piece_start = ends - size
    # Where each piece starts in its row: pieces come grouped by row, and segment 1 opens a row.
    row_first = np.flatnonzero(seg == 1)
    row_base = np.repeat(piece_start[row_first], np.diff(np.append(row_first, size.size)))
    within = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(piece_start, size)
    dest = np.repeat(row * seq_len + piece_start - row_base, size) + within
    out["input_ids"].reshape(-1)[dest] = np.concatenate([p[2] for p in pieces])
    out["loss_mask"].reshape(-1)[dest] = np.concatenate([p[3] for p in pieces])
    out["segment_ids"].reshape(-1)[dest] = np.repeat(seg, size)
    out["positions"].reshape(-1)[dest] = within
