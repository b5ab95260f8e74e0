"""Packing as IterDataset steps (portable_loader/dataset/iter/pack.py, iter_concat_split.py) against real Grain.

Oracle: the same pipeline built with ``grain.MapDataset.source(...).to_iter_dataset()`` and
``grain.experimental.FirstFitPackIterDataset`` / ``BestFitPackIterDataset`` /
``ConcatThenSplitIterDataset`` (Grain 0.2.18). All three are deterministic in Grain (the bin
shuffle is seeded by the row count), so elements must be equal: keys, dtypes, shapes and values,
up to the same error where Grain raises. Concat-then-split is compared on every input where Grain
keeps each token once; where it does not (an element split twice on one feature while another
feature fits whole), ours keeps each token once and Grain's output repeats tokens: tested apart.
On top, what Grain's state lacks: a small JSON position, the same size at any point, that
resumes exactly, after a batch, across worker counts, and is refused by another pipeline.
"""

from __future__ import annotations

import json

import grain
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import canon, take
from portable_loader import grain as pg
from portable_loader.errors import StateError

SETTINGS = dict(derandomize=True, deadline=None, max_examples=300)
KEYS = ("a", "b", "c")
DTYPES = ("int32", "int64", "float32", "uint8")


# --- helpers -------------------------------------------------------------------------------------


def canon_ordered(x):
    """``canon`` keeping dicts' key order: packing's outputs must have Grain's order of keys too."""
    return canon(x, key_order=True)


def outcome(ds) -> tuple[list, str | None]:
    """The elements up to the end or to the first error, and whether it ended in an error."""
    out = []
    try:
        for x in ds:
            out.append(canon_ordered(x))
    except Exception as e:  # noqa: BLE001 - compared with the oracle's
        return out, type(e).__name__
    return out, None


def both(step: str, recs: list, **kw):
    """(Grain's dataset, ours) for ``step`` over the records ``recs``."""
    g = getattr(grain.experimental, step)(grain.MapDataset.source(recs).to_iter_dataset(), **kw)
    o = getattr(pg.experimental, step)(pg.MapDataset.source(recs).to_iter_dataset(), **kw)
    return g, o


def grain_kwargs(kw: dict) -> dict:
    """``kw`` with our BOSHandling member replaced by Grain's."""
    if "bos_handling" in kw:
        kw = dict(kw, bos_handling=getattr(grain.experimental.BOSHandling, kw["bos_handling"].name))
    return kw


def assert_resumes(ds, k: int) -> dict:
    """A state after ``k`` elements, through JSON, continues a fresh iterator exactly; returns the state."""
    full = [canon_ordered(x) for x in ds]
    it = iter(ds)
    head = [canon_ordered(x) for x in take(it, k)]
    state = json.loads(json.dumps(it.get_state()))
    fresh = iter(ds)
    fresh.set_state(state)
    assert head + [canon_ordered(x) for x in fresh] == full
    return state


def records(lengths: list[dict], dtypes: dict, trailing: dict, seed: int, doc: bool = False) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i, ls in enumerate(lengths):
        r = {k: rng.integers(1, 100, size=(n, *trailing.get(k, ()))).astype(dtypes[k]) for k, n in ls.items()}
        if doc:
            r["doc"] = i
        r["extra"] = "dropped by packing"
        out.append(r)
    return out


# --- strategies ----------------------------------------------------------------------------------


@st.composite
def pack_case(draw, allow_overlong: bool = True):
    keys = list(KEYS[:draw(st.integers(1, 3))])
    caps = {k: draw(st.integers(1, 10)) for k in keys}
    dtypes = {k: draw(st.sampled_from(DTYPES)) for k in keys}
    trailing = {k: draw(st.sampled_from([(), (2,)])) for k in keys}
    n = draw(st.integers(0, 25))
    lengths = [{k: draw(st.integers(0, caps[k])) for k in keys} for _ in range(n)]
    if allow_overlong and n and draw(st.integers(0, 4)) == 0:
        lengths[draw(st.integers(0, n - 1))][keys[0]] = caps[keys[0]] + draw(st.integers(1, 3))
    doc = draw(st.booleans())
    recs = records(lengths, dtypes, trailing, draw(st.integers(0, 2**16)), doc)
    seq_meta = [keys[-1]] if len(keys) > 1 and draw(st.booleans()) else []
    kw = dict(length_struct=caps, num_packing_bins=draw(st.integers(1, 5)), shuffle_bins=draw(st.booleans()),
              seed=draw(st.integers(0, 1000)), meta_features=seq_meta + (["doc"] if doc else []))
    if draw(st.booleans()):
        kw["pack_alignment_struct"] = {k: draw(st.integers(1, 3)) for k in keys}
    if draw(st.booleans()):
        kw["padding_struct"] = {k: draw(st.sampled_from([None, 7])) for k in keys}
    if draw(st.booleans()):
        kw["max_sequences_per_bin"] = draw(st.integers(1, 3))
    if kw["shuffle_bins"] and draw(st.integers(0, 3)) == 0:
        kw["shuffle_bins_group_by_feature"] = keys[0]
    return draw(st.sampled_from(["FirstFitPackIterDataset", "BestFitPackIterDataset"])), recs, kw


@st.composite
def cts_case(draw, mode: str):
    """``mode``: "single" (one split feature, any length, BOS), "fits" (several, none over its target), "any"."""
    if mode == "single":
        keys = ["a"]
    else:
        keys = list(KEYS[:draw(st.integers(2, 3))])
    caps = {k: draw(st.integers(1, 8)) for k in keys}
    meta = [] if mode == "any" or not draw(st.booleans()) else ["m"]
    if meta:
        caps["m"] = draw(st.integers(1, 6))
    dtypes = {k: draw(st.sampled_from(DTYPES)) for k in caps}
    trailing = {k: draw(st.sampled_from([(), (2,)])) for k in keys}
    bos = mode == "single" and draw(st.booleans())
    low = 1 if bos else 0
    n = draw(st.integers(0, 20))

    def top(k):
        if k == "m":
            return caps[k] + (1 if draw(st.integers(0, 5)) == 0 else 0)  # now and then too long for a meta feature
        return caps[k] if mode == "fits" else 3 * caps[k]

    lengths = [{k: draw(st.integers(low, max(low, top(k)))) for k in caps} for _ in range(n)]
    recs = records(lengths, dtypes, trailing, draw(st.integers(0, 2**16)))
    for r in recs:
        del r["extra"]  # concat-then-split takes exactly the features of length_struct
    kw = dict(length_struct=caps, meta_features=meta)
    if mode != "any":
        kw["split_full_length_features"] = draw(st.booleans())
    if bos:
        kw.update(bos_handling=pg.experimental.BOSHandling.REPLACE_FIRST_TOKEN_WITH_BOS, bos_features=["a"],
                  bos_token_id=draw(st.sampled_from([0, 99])))
    return recs, kw


def conserves(rows: list, recs: list, keys) -> bool:
    """Every token of every split feature, in order, exactly once (split_full_length_features=True keeps order)."""
    for k in keys:
        got = [r[k][r[f"{k}_segment_ids"] > 0] for r in rows]
        want = [rec[k] for rec in recs]
        a, b = (np.concatenate([np.ravel(x) for x in xs] + [np.zeros(0)]) for xs in (got, want))
        if not np.array_equal(a, b):
            return False
    return True


# --- equal to Grain ------------------------------------------------------------------------------


@pytest.mark.slow
@settings(**SETTINGS)
@given(pack_case())
def test_first_fit_and_best_fit_equal_grains_elements(case):
    step, recs, kw = case
    g, o = both(step, recs, **kw)
    assert outcome(o) == outcome(g)


@pytest.mark.slow
@settings(**SETTINGS)
@given(cts_case("single"))
def test_concat_then_split_equals_grain_with_one_split_feature(case):
    recs, kw = case
    g = grain.experimental.ConcatThenSplitIterDataset(grain.MapDataset.source(recs).to_iter_dataset(),
                                                      **grain_kwargs(kw))
    o = pg.experimental.ConcatThenSplitIterDataset(pg.MapDataset.source(recs).to_iter_dataset(), **kw)
    ours, theirs = outcome(o), outcome(g)
    assert ours[0] == theirs[0]
    assert (ours[1] is None) == (theirs[1] is None)  # a too-long meta feature: Grain's internal error, our ValueError
    assert ours[1] in (None, "ValueError")


@pytest.mark.slow
@settings(**SETTINGS)
@given(cts_case("fits"))
def test_concat_then_split_equals_grain_with_several_features_within_their_lengths(case):
    recs, kw = case
    g, o = both("ConcatThenSplitIterDataset", recs, **kw)
    ours, theirs = outcome(o), outcome(g)
    assert ours[0] == theirs[0] and (ours[1] is None) == (theirs[1] is None)


@pytest.mark.slow
@settings(**SETTINGS)
@given(cts_case("any"))
def test_concat_then_split_keeps_every_token_once_and_equals_grain_until_grain_splits_a_rest_again(case):
    recs, kw = case
    # An id per element, as a meta feature (one cell per piece, never limiting): which rows hold its pieces.
    recs = [dict(r, id=np.array([i + 1])) for i, r in enumerate(recs)]
    kw = dict(kw, length_struct=dict(kw["length_struct"], id=64), meta_features=["id"])
    g, o = both("ConcatThenSplitIterDataset", recs, **kw)
    ours = list(o)
    theirs = take(iter(g), len(ours) + 1)  # where Grain repeats tokens its stream can be endless
    assert conserves(ours, recs, [k for k in kw["length_struct"] if k != "id"])
    rows_of: dict = {}
    for r, row in enumerate(ours):
        for i in row["id"][row["id"] > 0].tolist():
            rows_of.setdefault(i, []).append(r)
    # Grain goes wrong where the rest of a split element is split again: from its second row on.
    split_twice = [rows[1] for rows in rows_of.values() if len(rows) >= 3]
    same_until = min(split_twice, default=len(ours))
    assert [canon_ordered(x) for x in ours[:same_until]] == [canon_ordered(x) for x in theirs[:same_until]]
    if not split_twice:
        assert len(theirs) == len(ours)


def test_first_fit_hand_case_with_two_features_of_different_lengths_and_meta_features():
    recs = [{"ids": np.arange(n, dtype=np.int32) + 10 * n, "mask": np.ones(n % 3 + 1, np.uint8), "doc": n}
            for n in (3, 5, 2, 7, 1)]
    kw = dict(length_struct={"ids": 8, "mask": 4}, num_packing_bins=2, shuffle_bins=False, meta_features=["doc"])
    g, o = both("FirstFitPackIterDataset", recs, **kw)
    rows = list(o)
    assert [canon_ordered(x) for x in rows] == [canon_ordered(x) for x in g]
    assert list(rows[0]) == ["doc", "ids", "ids_positions", "ids_segment_ids", "mask", "mask_positions",
                             "mask_segment_ids"]
    assert [r["doc"] for r in rows] == [[3, 5], [2], [7, 1]]  # mask (3 + 1 > 4) sends 2 to the second bin
    assert rows[0]["ids"].tolist() == [30, 31, 32, 50, 51, 52, 53, 54]
    assert rows[0]["ids_segment_ids"].tolist() == [1, 1, 1, 2, 2, 2, 2, 2]
    assert rows[0]["mask_segment_ids"].tolist() == [1, 2, 2, 2] and rows[0]["mask"].dtype == np.uint8


def test_a_sequence_meta_feature_is_packed_without_segment_ids():
    recs = [{"ids": np.arange(n) + 1, "pos": np.arange(n) * 10} for n in (2, 3, 1)]
    for step in ("FirstFitPackIterDataset", "BestFitPackIterDataset"):
        g, o = both(step, recs, length_struct={"ids": 4, "pos": 4}, num_packing_bins=2, meta_features=["pos"], seed=4)
        rows = list(o)
        assert [canon_ordered(x) for x in rows] == [canon_ordered(x) for x in g]
        assert "pos_segment_ids" not in rows[0] and "ids_segment_ids" in rows[0]


def test_an_over_long_element_raises_where_grain_raises_after_the_same_rows():
    recs = [{"ids": np.arange(n)} for n in (2, 2, 2, 2, 2, 9, 1)]
    for step in ("FirstFitPackIterDataset", "BestFitPackIterDataset"):
        g, o = both(step, recs, length_struct={"ids": 4}, num_packing_bins=2, shuffle_bins=False)
        assert outcome(o) == outcome(g)
        assert len(outcome(o)[0]) == 2 and outcome(o)[1] == "ValueError"
        with pytest.raises(ValueError, match=r"truncated.*\('ids', 9, 4\)"):
            list(o)


def test_concat_then_split_splits_an_over_long_element_over_rows():
    recs = [{"ids": np.arange(11, dtype=np.int32)}, {"ids": np.array([50, 51], np.int32)}]
    g, o = both("ConcatThenSplitIterDataset", recs, length_struct={"ids": 4})
    rows = list(o)
    assert [canon_ordered(x) for x in rows] == [canon_ordered(x) for x in g]
    assert [r["ids"].tolist() for r in rows] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 50], [51, 0, 0, 0]]
    assert rows[2]["ids_segment_ids"].tolist() == [1, 1, 1, 2] and rows[2]["ids_positions"].tolist() == [0, 1, 2, 0]


def test_bos_handling_equals_grains():
    recs = [{"ids": np.array([1, 5, 6, 7, 8, 9], np.int64), "doc": np.array([3])},
            {"ids": np.array([1, 4], np.int64), "doc": np.array([4])}]
    kw = dict(length_struct={"ids": 4, "doc": 2}, meta_features=["doc"],
              bos_handling=pg.experimental.BOSHandling.REPLACE_FIRST_TOKEN_WITH_BOS, bos_features=["ids"],
              bos_token_id=1)
    o = pg.experimental.ConcatThenSplitIterDataset(pg.MapDataset.source(recs).to_iter_dataset(), **kw)
    g = grain.experimental.ConcatThenSplitIterDataset(grain.MapDataset.source(recs).to_iter_dataset(),
                                                      **grain_kwargs(kw))
    rows = list(o)
    assert [canon_ordered(x) for x in rows] == [canon_ordered(x) for x in g]
    assert [r["ids"].tolist() for r in rows] == [[1, 5, 6, 7], [1, 9, 1, 4]]  # 8 became BOS: the piece's first token
    assert [r["doc"].tolist() for r in rows] == [[3, 0], [3, 4]]  # meta: the whole of it with every piece
    # real Grain's enum is accepted too
    assert [canon_ordered(x) for x in pg.experimental.ConcatThenSplitIterDataset(
        pg.MapDataset.source(recs).to_iter_dataset(), **grain_kwargs(kw))] == [canon_ordered(x) for x in rows]


def test_split_full_length_features_false_passes_full_elements_after_the_row_being_filled():
    recs = [{"ids": np.arange(n) + 10 * n} for n in (3, 6, 2, 5, 6, 4)]
    g, o = both("ConcatThenSplitIterDataset", recs, length_struct={"ids": 6}, split_full_length_features=False)
    rows = list(o)
    assert [canon_ordered(x) for x in rows] == [canon_ordered(x) for x in g]
    assert [r["ids_segment_ids"].tolist() for r in rows] == [
        [1, 1, 1, 2, 2, 3], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]]


# --- where ours differs from Grain, on purpose -----------------------------------------------------


def test_concat_then_split_does_not_repeat_a_feature_when_an_element_is_split_twice():
    recs = [{"a": np.arange(10, dtype=np.int32) + 1, "b": np.array([100, 101], np.int32)}]
    g, o = both("ConcatThenSplitIterDataset", recs, length_struct={"a": 4, "b": 4})
    ours, theirs = list(o), list(g)
    assert [r["a"].tolist() for r in ours] == [r["a"].tolist() for r in theirs] == [[1, 2, 3, 4], [5, 6, 7, 8],
                                                                                     [9, 10, 0, 0]]
    assert [r["b"].tolist() for r in theirs] == [[100, 101, 0, 0], [0, 0, 0, 0], [100, 101, 0, 0]]  # Grain: b twice
    assert [r["b"].tolist() for r in ours] == [[100, 101, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert [canon_ordered(x) for x in ours[:2]] == [canon_ordered(x) for x in theirs[:2]]
    assert conserves(ours, recs, ["a", "b"]) and not conserves(theirs, recs, ["a", "b"])


def test_concat_then_split_gives_one_row_per_target_where_grain_repeats_tokens_over_many():
    recs = [{"a": np.arange(12) + 1, "b": np.arange(11) + 100}]
    g, o = both("ConcatThenSplitIterDataset", recs, length_struct={"a": 1, "b": 2})
    assert len(take(iter(g), 100)) == 56  # Grain: 56 rows of one element of 12 + 11 tokens (others never end)
    ours = list(o)
    assert len(ours) == 12 and conserves(ours, recs, ["a", "b"])


def test_concat_then_split_treats_a_scalar_feature_as_one_cell():
    recs = [{"a": np.arange(6) + 1, "s": 7}, {"a": np.arange(2) + 1, "s": 8}]
    o = pg.experimental.ConcatThenSplitIterDataset(pg.MapDataset.source(recs).to_iter_dataset(),
                                                   length_struct={"a": 4, "s": 2})
    rows = list(o)
    assert [r["s"].tolist() for r in rows] == [[7, 0], [8, 0]]  # Grain repeats 7 in the second row's piece of 0
    assert rows[1]["s_segment_ids"].tolist() == [2, 0] and rows[1]["a_segment_ids"].tolist() == [1, 1, 2, 2]


# --- the state -----------------------------------------------------------------------------------


@pytest.mark.slow
@settings(**SETTINGS)
@given(pack_case(allow_overlong=False), st.data())
def test_packing_resumes_exactly_from_a_state_after_any_element(case, data):
    step, recs, kw = case
    ds = getattr(pg.experimental, step)(pg.MapDataset.source(recs).to_iter_dataset(), **kw)
    n = len(list(ds))
    state = assert_resumes(ds, data.draw(st.integers(0, n)))
    assert len(json.dumps(state)) < 1000


@pytest.mark.slow
@settings(**SETTINGS)
@given(st.sampled_from(["single", "fits", "any"]).flatmap(cts_case), st.data())
def test_concat_then_split_resumes_exactly_from_a_state_after_any_element(case, data):
    recs, kw = case
    ds = pg.experimental.ConcatThenSplitIterDataset(pg.MapDataset.source(recs).to_iter_dataset(), **kw)
    ours = outcome(ds)
    if ours[1] is not None:
        return  # a too-long meta feature: nothing to resume past
    assert_resumes(ds, data.draw(st.integers(0, len(ours[0]))))


def test_the_state_is_a_small_position_of_the_same_size_anywhere():
    docs = pg.MapDataset.range(10**6).map(lambda i: {"ids": np.arange(i % 37 + 1)}).to_iter_dataset()
    steps = [pg.experimental.FirstFitPackIterDataset(docs, length_struct={"ids": 64}, num_packing_bins=8),
             pg.experimental.BestFitPackIterDataset(docs, length_struct={"ids": 64}, num_packing_bins=8),
             pg.experimental.ConcatThenSplitIterDataset(docs, length_struct={"ids": 64})]
    for ds in steps:
        it = iter(ds)
        sizes = set()
        for k in (1, 7, 300):
            take(it, k)
            state = it.get_state()
            sizes.add(len(json.dumps(state)))
            assert all(isinstance(v, str) for v in state["cursor"].values())  # positions, no element data
        assert len(sizes) == 1 and sizes.pop() < 600


def test_resume_after_a_downstream_batch_and_an_upstream_filter_and_grain_equality_of_that_pipeline():
    recs = [{"ids": np.arange(n % 9 + 1, dtype=np.int32) + n} for n in range(80)]

    def build(lib):
        ds = lib.MapDataset.source(recs).to_iter_dataset().filter(lambda r: len(r["ids"]) != 4)
        return lib.experimental.FirstFitPackIterDataset(ds, length_struct={"ids": 16}, num_packing_bins=3,
                                                        seed=9).batch(2)

    ours = build(pg)
    assert [canon_ordered(x) for x in ours] == [canon_ordered(x) for x in build(grain)]
    for k in range(0, 12, 3):
        assert_resumes(ours, k)


def test_a_state_resumes_at_another_worker_count():
    recs = [{"ids": np.arange(n % 7 + 1) * n} for n in range(120)]
    base = pg.MapDataset.source(recs).to_iter_dataset().map(lambda r: {"ids": r["ids"] + 1})

    def build(workers):
        src = base.mp_prefetch(pg.MultiprocessingOptions(num_workers=workers)) if workers else base
        return pg.experimental.ConcatThenSplitIterDataset(src, length_struct={"ids": 10})

    full = [canon_ordered(x) for x in build(0)]
    with iter(build(2)) as it:
        head = [canon_ordered(x) for x in take(it, 9)]
        state = it.get_state()
    with iter(build(0)) as it:
        it.set_state(state)
        assert head + [canon_ordered(x) for x in it] == full


def test_a_state_of_another_packing_is_refused():
    docs = pg.MapDataset.source([{"ids": np.arange(3)}] * 10).to_iter_dataset()
    a = pg.experimental.FirstFitPackIterDataset(docs, length_struct={"ids": 8}, num_packing_bins=2)
    for other in (pg.experimental.FirstFitPackIterDataset(docs, length_struct={"ids": 8}, num_packing_bins=3),
                  pg.experimental.BestFitPackIterDataset(docs, length_struct={"ids": 8}, num_packing_bins=2),
                  pg.experimental.ConcatThenSplitIterDataset(docs, length_struct={"ids": 8})):
        it = iter(a)
        next(it)
        with pytest.raises(StateError, match="another pipeline"):
            iter(other).set_state(it.get_state())


# --- bad input -----------------------------------------------------------------------------------


def test_bad_arguments_raise_a_value_error_naming_the_problem():
    docs = pg.MapDataset.source([{"ids": np.arange(3)}]).to_iter_dataset()
    ff, cts = pg.experimental.FirstFitPackIterDataset, pg.experimental.ConcatThenSplitIterDataset
    BOS = pg.experimental.BOSHandling
    cases = [
        (lambda: ff(docs, length_struct={"ids": 0}, num_packing_bins=2), r"length_struct\['ids'\] must be a positive"),
        (lambda: ff(docs, length_struct={"ids": -3}, num_packing_bins=2), "must be a positive integer, got -3"),
        (lambda: ff(docs, length_struct=8, num_packing_bins=2), "length_struct must be a non-empty dict"),
        (lambda: ff(docs, length_struct={"ids": 8}, num_packing_bins=0), "num_packing_bins must be a positive"),
        (lambda: ff(docs, length_struct={"ids": 8}, num_packing_bins=2, max_sequences_per_bin=0),
         "max_sequences_per_bin` must be a positive integer"),
        (lambda: ff(docs, length_struct={"ids": 8}, num_packing_bins=2, pack_alignment_struct={"x": 2}),
         "pack_alignment_struct must be a dict with the keys of length_struct"),
        (lambda: cts(docs, length_struct={"ids": 0}), r"length_struct\['ids'\]"),
        (lambda: cts(docs, length_struct={"ids": 8}, bos_token_id=1),
         "bos_token_id and bos_features should not be set"),
        (lambda: cts(docs, length_struct={"ids": 8}, bos_handling=BOS.REPLACE_FIRST_TOKEN_WITH_BOS),
         "bos_token_id must be set"),
        (lambda: cts(docs, length_struct={"ids": 8, "m": 2}, meta_features=["m"], bos_features=["m"],
                     bos_handling=BOS.REPLACE_FIRST_TOKEN_WITH_BOS, bos_token_id=1), "should not overlap"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message):
            make()


def test_bad_elements_raise_a_value_error_naming_the_feature_where_grain_raises():
    def run(step, recs, **kw):
        g, o = both(step, recs, **kw)
        with pytest.raises(Exception):  # noqa: B017 - Grain raises KeyError, TypeError or its internal error
            list(g)
        with pytest.raises(ValueError) as e:
            list(o)
        return str(e.value)

    recs = [{"ids": np.arange(3)}]
    assert "no feature 'mask'" in run("FirstFitPackIterDataset", recs, length_struct={"ids": 4, "mask": 4},
                                      num_packing_bins=2)
    assert "no feature 'doc'" in run("BestFitPackIterDataset", recs, length_struct={"ids": 4}, num_packing_bins=2,
                                     meta_features=["doc"])
    assert "must be dicts of features, got int" in run("FirstFitPackIterDataset", [1, 2], length_struct={"ids": 4},
                                                       num_packing_bins=2)
    assert "length_struct names ['ids', 'mask']" in run("ConcatThenSplitIterDataset", recs,
                                                         length_struct={"ids": 4, "mask": 4})
    assert "meta feature 'm' has 5 cells, more than its target length 2" in run(
        "ConcatThenSplitIterDataset", [{"ids": np.arange(3), "m": np.arange(5)}], length_struct={"ids": 4, "m": 2},
        meta_features=["m"])


def test_the_names_are_exported_and_documented():
    from portable_loader.dataset.iter import concat_split as iter_concat_split, pack as iter_pack
    from portable_loader.grain.experimental import (BestFitPackIterDataset, BOSHandling, ConcatThenSplitIterDataset,
                                                    FirstFitPackIterDataset)

    assert (FirstFitPackIterDataset, BestFitPackIterDataset) == (iter_pack.FirstFitPackIterDataset,
                                                                 iter_pack.BestFitPackIterDataset)
    assert (ConcatThenSplitIterDataset, BOSHandling) == (iter_concat_split.ConcatThenSplitIterDataset,
                                                         iter_concat_split.BOSHandling)
    for name in ("FirstFitPackIterDataset", "BestFitPackIterDataset", "ConcatThenSplitIterDataset", "BOSHandling"):
        assert name in pg.experimental.__all__
    assert str(FirstFitPackIterDataset(pg.MapDataset.range(1).to_iter_dataset(), length_struct={"x": 1},
                                       num_packing_bins=1)) == "FirstFitPackIterDataset"


def test_empty_elements_under_a_sequence_cap_pack_as_grain_packs_them():
    # Grain's best fit lets a bin at its cap take another element while bin and element are empty;
    # its first fit does not. A derandomized draw met this only in some runs: pinned here.
    els = [{"a": np.array([], dtype=np.int32)} for _ in range(3)] + [{"a": np.arange(1, dtype=np.int32)}]
    kw = dict(length_struct={"a": 1}, num_packing_bins=1, shuffle_bins=False, seed=0, max_sequences_per_bin=1)
    for name in ("BestFitPackIterDataset", "FirstFitPackIterDataset"):
        got, want = ([{k: v.tolist() for k, v in row.items()}
                      for row in getattr(lib.experimental, name)(lib.MapDataset.source(els).to_iter_dataset(), **kw)]
                     for lib in (pg, grain))
        assert got == want, name


@pytest.mark.slow
@given(n=st.integers(1, 40), seed=st.integers(0, 2**16), shuffle=st.booleans(),
       step=st.sampled_from(["FirstFitPackIterDataset", "BestFitPackIterDataset"]), data=st.data())
@settings(**dict(SETTINGS, max_examples=60))
def test_a_nested_meta_feature_in_length_struct_is_packed_as_grain_packs_it(n, seed, shuffle, step, data):
    # Grain's packing_test::test_nested_feature: a dict in length_struct packs its leaves, when it is a meta feature.
    rng = np.random.default_rng(seed)
    recs = [{"row": rng.integers(0, 10, size=int(rng.integers(1, 12))).astype(np.int32),
             "nested": {"inner": int(rng.integers(0, 5)), "span": rng.integers(0, 9, size=int(rng.integers(0, 4)))}}
            for _ in range(n)]
    kw = dict(length_struct={"row": 16, "nested": {"inner": 6, "span": 10}}, num_packing_bins=3, seed=seed,
              shuffle_bins=shuffle, meta_features=["nested"])
    g, o = both(step, recs, **kw)
    expected = outcome(g)
    assert outcome(o) == expected
    if expected[0] and expected[1] is None:
        assert_resumes(o, data.draw(st.integers(0, len(expected[0]))))
    g, o = both(step, recs, **dict(kw, meta_features=[]))  # not a meta feature: Grain's error, at the first element
    with pytest.raises(ValueError, match="Failed to extract segment ids for 'nested'.*meta feature") as theirs:
        next(iter(g))
    with pytest.raises(ValueError) as ours:
        next(iter(o))
    assert str(ours.value) == str(theirs.value)
