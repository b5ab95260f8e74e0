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

__all__ = ["pack", "collate", "Piece"]

Piece = tuple  # (record_index, start, end)


def pack(record_indices: np.ndarray, lengths: np.ndarray, seq_len: int) -> list[list[Piece]]:
    """Pack records into rows of at most ``seq_len`` tokens, best-fit decreasing.

    A record is split (into ``seq_len`` pieces and a remainder) only when it is longer than
    ``seq_len``. Ties keep the window's order, so the result depends only on the inputs.
    """
    pieces: list[Piece] = []
    for idx, n in zip(record_indices.tolist(), lengths.tolist()):
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


def collate(
    rows: Sequence[Sequence[Piece]], records: Mapping[int, Mapping[str, np.ndarray]], seq_len: int, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """Fill one ``[len(rows), seq_len]`` batch; rows may be empty (all padding)."""
    n = len(rows)
    ids = np.full((n, seq_len), pad_id, dtype=np.int32)
    mask = np.zeros((n, seq_len), dtype=np.uint8)
    segments = np.zeros((n, seq_len), dtype=np.int32)
    positions = np.zeros((n, seq_len), dtype=np.int32)
    ramp = np.arange(seq_len, dtype=np.int32)
    for r, row in enumerate(rows):
        at = 0
        for segment, (idx, start, end) in enumerate(row, start=1):
            record = records[idx]
            end = min(end, len(record["input_ids"]))  # padding plans ask for up to seq_len
            size = end - start
            ids[r, at : at + size] = record["input_ids"][start:end]
            rec_mask = record.get("loss_mask")
            mask[r, at : at + size] = 1 if rec_mask is None else rec_mask[start:end]
            segments[r, at : at + size] = segment
            positions[r, at : at + size] = ramp[:size]
            at += size
    return {"input_ids": ids, "loss_mask": mask, "segment_ids": segments, "positions": positions}
