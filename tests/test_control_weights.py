"""it.set_weights: a mixture re-weighted while the loader runs, with exact resume and an O(sources) state.

Sources hold records whose tokens name them (source s, record r: tokens 1000 * s + r), so which
source and record each row came from is read off the batch itself, independently of the loader's
own bookkeeping.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portable_loader as pl

SIZES = {"web": 300, "code": 120, "math": 45}


def records(s: int, n: int) -> list[dict]:
    return [{"input_ids": np.full(3 + (r % 5), 1000 * (s + 1) + r, dtype=np.int32)} for r in range(n)]


def mixture(weights=None, unit="records"):
    sources = {name: records(s, n) for s, (name, n) in enumerate(SIZES.items())}
    return pl.mix(sources, weights or {"web": 5, "code": 3, "math": 2}, unit=unit, block=20)


def loader(packing=False, **kw):
    kw = {"global_batch_size": 8, "seq_len": 16, "seed": 3, **kw}
    return pl.DataLoader(mixture(), packing=packing, packing_window=64, **kw)


def rows_of(batch) -> list[tuple[int, int]]:
    """(source, record) of every record that starts in the batch (its tokens name it)."""
    out = []
    for ids, seg in zip(batch["input_ids"], batch.get("segment_ids", batch["attention_mask"])):
        prev = None
        for t, g in zip(ids.tolist(), seg.tolist()):
            if g and (t, g) != prev:
                out.append((t // 1000 - 1, t % 1000))
            prev = (t, g) if g else None
    return out


def run(it, actions):
    """Apply actions (("next",) or ("w", weights)) and return the batches drawn."""
    got = []
    for a in actions:
        if a[0] == "next":
            got.append(next(it))
        else:
            it.set_weights(a[1])
    return got


def same(a, b) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def test_the_next_padded_batch_follows_the_new_weights_and_counts_hold_from_the_change():
    with iter(loader()) as it:
        before = [next(it) for _ in range(3)]
        it.set_weights({"code": 1})
        only_code = [next(it) for _ in range(4)]
        it.set_weights({"web": 1, "math": 3})
        after = [next(it) for _ in range(40)]
    assert {s for b in only_code for s, _ in rows_of(b)} == {1}
    drawn = [s for b in after for s, _ in rows_of(b)]
    for k in range(20, len(drawn) + 1, 20):  # block boundaries counted from the change (block = 20)
        counts = np.bincount(drawn[:k], minlength=3)
        assert counts[1] == 0 and abs(counts[0] - k / 4) < 1 and abs(counts[2] - 3 * k / 4) < 1
    assert len(rows_of(before[0])) == 8


def test_each_source_continues_its_own_epoch_no_record_repeats_early():
    with iter(loader()) as it:
        seen = [rows_of(next(it)) for _ in range(5)]
        for w in ({"code": 1}, {"code": 1, "web": 1}, {"math": 1, "code": 2}):
            it.set_weights(w)
            seen += [rows_of(next(it)) for _ in range(3)]
    code = [r for rows in seen for s, r in rows if s == 1]
    assert len(code) <= SIZES["code"] and len(set(code)) == len(code)  # within its first epoch: no repeat


def test_a_call_that_names_the_weights_in_force_changes_nothing():
    with iter(loader()) as ref:
        want = [next(ref) for _ in range(12)]
    with iter(loader()) as it:
        got = run(it, [("next",)] * 4 + [("w", {"web": 10, "code": 6, "math": 4})] + [("next",)] * 4
                  + [("w", {"math": 1}), ("w", {"web": 0.5, "code": 0.3, "math": 0.2})] + [("next",)] * 4)
        assert "weights" not in it.get_state()
    assert same(got, want)


@pytest.mark.parametrize("bad, message", [
    ({"wiki": 1}, "'wiki', which is not a source"),
    ({"web": -1}, "must be >= 0"),
    ({"web": float("nan")}, "must be finite"),
    ({"web": 0, "code": 0}, "all weights zero"),
    ({}, "non-empty dict"),
    ("web", "non-empty dict"),
])
def test_bad_weights_are_refused_and_the_stream_is_unchanged(bad, message):
    with iter(loader(num_workers=2)) as ref:
        want = [next(ref) for _ in range(6)]
    with iter(loader(num_workers=2)) as it:
        got = [next(it) for _ in range(3)]
        with pytest.raises(ValueError, match=message):
            it.set_weights(bad)
        got += [next(it) for _ in range(3)]
    assert same(got, want)


def test_set_weights_on_a_loader_that_is_not_a_mixture_says_so():
    plain = pl.DataLoader(records(0, 50), global_batch_size=4, seq_len=8)
    with iter(plain) as it, pytest.raises(ValueError, match="does not read a mixture"):
        it.set_weights({"web": 1})


actions = st.lists(st.one_of(st.just(("next",)), st.builds(
    lambda w: ("w", w), st.fixed_dictionaries({}, optional={n: st.integers(0, 4) for n in SIZES}).filter(
        lambda w: sum(w.values()) > 0))), min_size=1, max_size=14)


@pytest.mark.slow
@settings(max_examples=30, deadline=None, derandomize=True)
@given(acts=actions, cut=st.integers(0, 14), packing=st.booleans(), size=st.sampled_from([4, 8, 16]))
def test_a_state_after_any_calls_resumes_exactly_at_another_batch_size(acts, cut, packing, size):
    cut = min(cut, len(acts))
    tail = [("next",)] * 5
    with iter(loader(packing)) as it:
        run(it, acts[:cut])
        state = json.loads(json.dumps(it.get_state()))
        rest = run(it, acts[cut:] + tail)
    flat = np.concatenate([b["input_ids"] for b in rest])
    with iter(loader(packing, global_batch_size=size)) as resumed:
        resumed.set_state(state)
        got = run(resumed, acts[cut:])
        while sum(len(b["input_ids"]) for b in got) < len(flat):
            got.append(next(resumed))
    # the same rows in the same order, cut into batches of another size (calls land on the same rows
    # when the cuts agree: compare up to the first call after the cut whose batch boundary differs)
    if size == 8 or all(a[0] == "next" for a in acts[cut:]):
        assert np.array_equal(np.concatenate([b["input_ids"] for b in got])[: len(flat)], flat)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("packing", [False, True])
def test_resume_after_calls_with_workers_equals_the_uninterrupted_run(workers, packing):
    acts = [("next",)] * 3 + [("w", {"code": 1})] + [("next",)] * 2 + [("w", {"math": 1, "web": 1})] + [("next",)] * 2
    with iter(loader(packing, num_workers=workers)) as it:
        run(it, acts)
        state = it.get_state()
        want = [next(it) for _ in range(20)]
    with iter(loader(packing, num_workers=2 - workers)) as resumed:
        resumed.set_state(state)
        assert same([next(resumed) for _ in range(20)], want)


@pytest.mark.slow
def test_the_state_stays_small_after_a_thousand_calls():
    with iter(loader(prefetch=0)) as it:
        next(it)
        it.set_weights({"code": 1, "web": 1})
        one = json.dumps(it.get_state())
        for k in range(1000):
            it.set_weights({"web": 1 + k % 3, "math": 1})
            next(it)
        many = json.dumps(it.get_state())
    assert len(json.loads(many)["weights"]) <= 4
    # bounded, not growing: at most four stages of three sources each (their counters' digits aside)
    assert len(many) < 2048 and len(many) - len(one) < 3 * 60, (len(one), len(many))
    with iter(loader(prefetch=0)) as it:
        for k in range(2000):
            it.set_weights({"web": 1 + k % 3, "math": 1})
            next(it)
        assert len(json.dumps(it.get_state())) - len(many) < 48  # a digit more in some counters


def test_packed_changes_land_on_the_next_window():
    L = loader(packing=True, prefetch=0)
    with iter(L) as it:
        next(it)
        cur = it._cursor
        it.set_weights({"math": 1})
        rows = []
        while it._cursor.window == cur.window:
            rows.append(rows_of(next(it)))
        later = [rows_of(next(it)) for _ in range(3)]
    assert {s for b in later for s, _ in b} == {2}
    assert any(s != 2 for b in rows for s, _ in b)  # the window being served keeps its packed rows


def test_a_state_from_an_edited_schedule_is_refused_but_appended_stages_are_fine():
    with iter(loader()) as it:
        [next(it) for _ in range(10)]
        it.set_weights({"web": 1})
        state = it.get_state()
    edited = pl.DataLoader(pl.mix({name: records(s, n) for s, (name, n) in enumerate(SIZES.items())},
                                  {"web": 5, "code": 3, "math": 3}, block=20), global_batch_size=8, seq_len=16, seed=3)
    with iter(edited) as it, pytest.raises(pl.StateError, match="schedule"):
        it.set_state(state)
    forged = dict(state, weights=[[state["weights"][0][0], 20, [1, 0, 0], 1, [0, 0, 1]]])
    with iter(loader()) as it, pytest.raises(pl.StateError, match="weights"):
        it.set_state(forged)


def test_a_state_held_from_before_a_change_carries_the_change_made_after_it():
    # A Lightning loop holds the state of the batch it trains on while the next is already fetched:
    # a change made in that step lands after the fetched batch, and the held state must know it.
    with iter(loader(prefetch=0)) as it:
        next(it)
        held = it.state_later()      # the batch being trained on
        fetched = next(it)           # fetched ahead
        it.set_weights({"math": 1})
        want = [fetched] + [next(it) for _ in range(5)]
        state = held()
    with iter(loader(num_workers=2)) as resumed:
        resumed.set_state(state)
        assert same([next(resumed) for _ in range(6)], want)
    assert {s for b in want[1:] for s, _ in rows_of(b)} == {2}


def test_grain_style_iterators_refuse_set_weights_saying_why():
    from portable_loader import grain

    its = [iter(grain.MapDataset.range(8).to_iter_dataset()),
           iter(grain.DataLoader(data_source=list(range(8)), sampler=grain.samplers.IndexSampler(8)))]
    for it in its:
        with pytest.raises(ValueError, match="follows its pipeline's own order.*pl.mix"):
            it.set_weights({"a": 1})
        it.close()
