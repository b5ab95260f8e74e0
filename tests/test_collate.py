"""collate and pack against oracles: a slow per-token reference, and packing's invariants."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_loader import collate as C


def reference(rows, records, seq_len, pad_id):
    """Token by token, the obvious way."""
    n = len(rows)
    out = {k: np.zeros((n, seq_len), np.int64) for k in C.FIELDS}
    out["input_ids"][:] = pad_id
    for r, row in enumerate(rows):
        at = 0
        for seg, (idx, start, end) in enumerate(row, start=1):
            ids, mask = records[idx]["input_ids"], records[idx].get("loss_mask")
            for k, t in enumerate(range(start, min(end, ids.size))):
                out["input_ids"][r, at] = ids[t]
                out["loss_mask"][r, at] = 1 if mask is None else mask[t]
                out["attention_mask"][r, at] = 1
                out["segment_ids"][r, at] = seg
                out["positions"][r, at] = k
                at += 1
    return out


@st.composite
def batches(draw):
    seq_len = draw(st.integers(1, 40))
    lengths = draw(st.lists(st.integers(1, 60), min_size=1, max_size=30))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    records = {i: {"input_ids": rng.integers(1, 1000, n).astype(np.int32), "loss_mask": rng.integers(0, 2, n).astype(np.uint8)}
               for i, n in enumerate(lengths)}
    rows = C.pack(np.arange(len(lengths)), np.asarray(lengths), seq_len)
    rows += [[] for _ in range(draw(st.integers(0, 3)))]
    return rows, records, seq_len


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(batch=batches(), pad_id=st.integers(0, 5), some=st.sets(st.sampled_from(C.FIELDS[1:]), min_size=0),
       few=st.sampled_from([0, 10**6]), no_mask=st.booleans())
def test_collate_matches_token_by_token_reference_on_both_paths(batch, pad_id, some, few, no_mask):
    rows, records, seq_len = batch
    if no_mask:  # a record without loss_mask trains on every token
        records = {i: {"input_ids": r["input_ids"]} for i, r in records.items()}
    want = reference(rows, records, seq_len, pad_id)
    fields = ["input_ids", "attention_mask", *some]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(C, "_FEW_PIECES", few)  # 0: always concatenations; 10**6: always per piece
        out = C.collate(rows, records, seq_len, pad_id, fields)
    assert set(out) == set(fields)
    for k in fields:
        assert np.array_equal(out[k], want[k]), k
    assert out["input_ids"].dtype == np.int32 and out["attention_mask"].dtype == np.uint8
    assert C.collate(rows, records, seq_len, pad_id).keys() == set(C.FIELDS)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 100), min_size=1, max_size=80), seq_len=st.integers(1, 64))
def test_pack_places_every_token_once_and_splits_only_long_records(lengths, seq_len):
    rows = C.pack(np.arange(len(lengths)), np.asarray(lengths), seq_len)
    covered = {i: [] for i in range(len(lengths))}
    for row in rows:
        assert sum(b - a for _, a, b in row) <= seq_len
        for i, a, b in row:
            covered[i].append((a, b))
    for i, n in enumerate(lengths):
        spans = sorted(covered[i])
        assert sum(b - a for a, b in spans) == n
        assert all(s[1] == t[0] for s, t in zip(spans, spans[1:]))
        assert len(spans) == -(-n // seq_len)  # split only when longer than seq_len
    # Best fit decreasing never needs more rows than twice the token count allows.
    assert len(rows) <= max(1, 2 * -(-sum(lengths) // seq_len))


def reference_pack(indices, lengths, seq_len, overlong):
    """Best fit decreasing the obvious way: pieces by size (largest first, ties in window order),
    each into the open row with the least room that fits (the lowest-numbered among equals)."""
    pieces = []
    for i, n in zip(indices, lengths):
        if n > seq_len and overlong == "drop":
            continue
        if n > seq_len and overlong == "truncate":
            pieces.append((i, 0, seq_len))
            continue
        pieces += [(i, s, min(n, s + seq_len)) for s in range(0, n, seq_len)]  # none for an empty record
    order = sorted(range(len(pieces)), key=lambda k: -(pieces[k][2] - pieces[k][1]))
    rows, room = [], []
    for k in order:
        size = pieces[k][2] - pieces[k][1]
        fits = [r for r in range(len(rows)) if room[r] >= size]
        if fits:
            r = min(fits, key=lambda r: (room[r], r))
        else:
            r = len(rows)
            rows.append([])
            room.append(seq_len)
        rows[r].append(pieces[k])
        room[r] -= size
    return rows


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(0, 100), max_size=60), seq_len=st.integers(1, 64),
       overlong=st.sampled_from(C.OVERLONG))
def test_pack_equals_a_plain_best_fit_decreasing(lengths, seq_len, overlong):
    indices = [7 * i + 3 for i in range(len(lengths))]
    got = C.pack(np.asarray(indices, dtype=np.int64), np.asarray(lengths, dtype=np.int64), seq_len, overlong)
    assert got == reference_pack(indices, lengths, seq_len, overlong)


def as_spans(records):
    """``Spans`` over ``records`` (two buffers, records alternating between them), and record -> entry."""
    from portable_loader.cache.readers import Spans

    keys = sorted(records)
    ids, masks, buf, ids_at, mask_at = [b"", b""], [b"", b""], [], [], []
    for k in keys:
        b = k % 2
        buf.append(b)
        ids_at.append(len(ids[b]))
        mask_at.append(len(masks[b]))
        ids[b] += records[k]["input_ids"].astype(np.int32).tobytes()
        masks[b] += records[k]["loss_mask"].astype(np.uint8).tobytes()
    spans = Spans([memoryview(x) for x in ids], [memoryview(x) for x in masks], buf, ids_at, mask_at,
                  [records[k]["input_ids"].size for k in keys])
    return spans, {k: e for e, k in enumerate(keys)}


@settings(max_examples=200, deadline=None)
@given(batch=batches(), pad_id=st.integers(0, 5), some=st.sets(st.sampled_from(C.FIELDS[1:]), min_size=0))
def test_collate_spans_matches_the_reference_for_every_field_set(batch, pad_id, some):
    # All five fields take their own loop (the packed default); any other set, the general one.
    rows, records, seq_len = batch
    spans, where = as_spans(records)
    want = reference(rows, records, seq_len, pad_id)
    for fields in (["input_ids", "attention_mask", *some], list(C.FIELDS)):
        out = C.collate_spans(rows, spans, where, seq_len, pad_id, fields)
        assert set(out) == set(fields)
        for k in fields:
            assert np.array_equal(out[k], want[k]), k
            assert out[k].dtype == (np.int32 if k in ("input_ids", "segment_ids", "positions") else np.uint8)


def test_collate_spans_rows_of_more_pieces_than_the_segment_runs():
    # Past _RUN_MAX pieces in a row, segment numbers come from numpy's fill instead of a ready run.
    n = C._RUN_MAX + 6
    records = {i: {"input_ids": np.array([i + 1]), "loss_mask": np.array([i % 2])} for i in range(n)}
    rows = [[(i, 0, 1) for i in range(n)], [(0, 0, 1)]]
    spans, where = as_spans(records)
    for fields in (C.FIELDS, ("input_ids", "segment_ids")):
        out = C.collate_spans(rows, spans, where, n + 2, 0, fields)
        want = reference(rows, records, n + 2, 0)
        assert all(np.array_equal(out[k], want[k]) for k in fields)
    assert out["segment_ids"][0, :n].tolist() == list(range(1, n + 1))
    with pytest.raises(ValueError, match="does not fit seq_len"):
        C.collate_spans(rows, spans, where, n - 1, 0, C.FIELDS)
