"""collate and pack against oracles: a slow per-token reference, and packing's invariants."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_loader import collate as C


def reference(rows, records, seq_len, pad_id):
    """Token by token, the obvious way."""
    n = len(rows)
    out = {k: np.zeros((n, seq_len), np.int64) for k in ("input_ids", "loss_mask", "segment_ids", "positions")}
    out["input_ids"][:] = pad_id
    for r, row in enumerate(rows):
        at = 0
        for seg, (idx, start, end) in enumerate(row, start=1):
            ids, mask = records[idx]["input_ids"], records[idx]["loss_mask"]
            for k, t in enumerate(range(start, min(end, ids.size))):
                out["input_ids"][r, at] = ids[t]
                out["loss_mask"][r, at] = mask[t]
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


@settings(max_examples=200, deadline=None)
@given(batch=batches(), pad_id=st.integers(0, 5))
def test_collate_matches_token_by_token_reference_on_both_paths(batch, pad_id):
    rows, records, seq_len = batch
    want = reference(rows, records, seq_len, pad_id)
    pieces = [(r, s, records[i]["input_ids"][a:b], records[i]["loss_mask"][a:b])
              for r, row in enumerate(rows) for s, (i, a, b) in enumerate(row, start=1)]
    for fill in (C._fill_each, lambda out, p: C._fill_scatter(out, p, seq_len) if p else None):
        got = {k: np.zeros((len(rows), seq_len), v.dtype) for k, v in C.collate(rows[:0], records, seq_len).items()}
        got["input_ids"][:] = pad_id
        fill(got, pieces)
        for k in want:
            assert np.array_equal(got[k], want[k]), k
    out = C.collate(rows, records, seq_len, pad_id)
    assert all(np.array_equal(out[k], want[k]) for k in want)
    assert out["input_ids"].dtype == np.int32 and out["loss_mask"].dtype == np.uint8


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
