"""Weighted mixtures: exact counts per block, per-source epochs, schedules, describe, resume, refusals.

Records carry their identity in their tokens (``tag * 1000 + record``), so what a batch holds is
checked against the tokens themselves, not against the code that planned it.
"""

import json
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portable_loader as pl
from portable_loader.dataset.mix.mixture import DEFAULT_BLOCK
from portable_loader.dataset.mix.order import hamilton
from portable_loader.errors import StateError


def recs(n, tag, lengths=None, seed=0):
    lens = np.random.default_rng(seed + tag).integers(1, 20, n) if lengths is None else np.full(n, lengths)
    return [{"input_ids": np.full(int(k), tag * 1000 + r, np.int32)} for r, k in enumerate(lens)]


def drawn(m, seed, n):
    """(source names, records) of the first ``n`` stream positions, read back through the index space."""
    idx = m.stream_order(seed).stream_indices(np.arange(n))
    return m.locate(idx)


def batches(loader, n, state=None):
    it = iter(loader)
    if state is not None:
        it.set_state(state)
    with it:
        out = [next(it) for _ in range(n)]
        return out, it.get_state()


def same(xs, ys):
    return len(xs) == len(ys) and all(all(np.array_equal(a[k], b[k]) for k in a) for a, b in zip(xs, ys))


# --- the arithmetic -----------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=7), st.integers(0, 40), st.integers(0, 2**32))
def test_counts_never_go_backwards_when_every_weight_fills_a_slot(raw, extra, n_blocks):
    den = sum(raw)
    k = -(-den // min(raw)) + extra  # the smallest block mix() accepts, and larger ones
    before, after = hamilton(raw, den, n_blocks * k), hamilton(raw, den, (n_blocks + 1) * k)
    assert sum(after) - sum(before) == k
    assert all(a >= b for a, b in zip(after, before))
    assert all(abs(Fraction(c * den) - a * n_blocks * k) < den for c, a in zip(before, raw))


def test_alabama_paradox_is_why_small_blocks_are_refused():
    raw = [46, 39, 10, 20, 7, 47]
    counts = [hamilton(raw, sum(raw), 2 * b) for b in range(12)]
    assert any(counts[b + 1][4] < counts[b][4] for b in range(11))  # the paradox with K = 2
    names = "abcdef"
    sources = {n: recs(3, i) for i, n in enumerate(names)}
    with pytest.raises(ValueError, match=r"block must be >= 25"):
        pl.mix(sources, dict(zip(names, raw)), block=2)
    m = pl.mix(sources, dict(zip(names, raw)), block=25)
    src, _ = m.stream_order(0).sources_at(np.arange(25 * 40))
    assert all(len(set(block)) == 6 for block in src.reshape(40, 25).tolist())  # every source in every block


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 9), st.integers(1, 40)), min_size=1, max_size=5),
    st.integers(0, 24),
    st.integers(0, 2**64 - 1),
)
def test_count_bound_and_source_epochs(spec, block_extra, seed):
    weights = [w for w, _ in spec]
    if not any(weights):
        weights[0] = 1
    names = [f"s{i}" for i in range(len(spec))]
    total = sum(weights)
    need = -(-total // min(w for w in weights if w))
    block = need + block_extra
    m = pl.mix({n: recs(size, i) for i, (n, (_, size)) in enumerate(zip(names, spec))},
               dict(zip(names, weights)), block=block)
    n_blocks = 6
    got = drawn(m, seed, block * n_blocks)
    for b in range(1, n_blocks + 1):
        upto = got[: b * block]
        for name, w in zip(names, weights):
            count = sum(1 for s, _ in upto if s == name)
            assert abs(Fraction(count) - Fraction(w * b * block, total)) < 1, (name, b, count)
    for name, (_, size) in zip(names, spec):
        # the source's draws in its own stream order: the stream order of source i is its position order
        positions = m.stream_order(seed).sources_at(np.arange(block * n_blocks))
        mine = np.flatnonzero(positions[0] == names.index(name))
        order = np.argsort(positions[1][mine], kind="stable")
        records = [got[j][1] for j in mine[order]]
        assert sorted(positions[1][mine].tolist()) == list(range(len(mine)))  # no source position skipped
        for e in range(len(records) // size):
            assert sorted(records[e * size : (e + 1) * size]) == list(range(size))
        epochs = [tuple(records[e * size : (e + 1) * size]) for e in range(len(records) // size)]
        if size >= 8 and len(epochs) >= 3:  # three equal orders of 8+ records: odds below 1 in 10^9
            assert len(set(epochs)) > 1  # a fresh order per source epoch


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=12), block_extra=st.integers(0, 40),
       seed=st.integers(0, 2**64 - 1), shuffle=st.booleans(), nested=st.booleans(), start=st.integers(0, 10**12),
       scattered=st.booleans())
def test_a_chunks_lookup_equals_position_by_position(sizes, block_extra, seed, shuffle, nested, start, scattered):
    """A planner's chunk (thousands of positions: its blocks and the sources' samplers all at once)
    and scattered positions give each position the record that looking it up alone gives (a few
    positions go block by block, in Python integers)."""
    sources = {f"s{i}": recs(n, i) for i, n in enumerate(sizes)}
    weights = {f"s{i}": 1 + i % 4 for i in range(len(sizes))}
    if nested and len(sizes) > 1:
        sources = {"in": pl.mix({"s0": sources["s0"], "s1": sources["s1"]}, {"s0": 1, "s1": 2}),
                   **{k: v for k, v in sources.items() if k not in ("s0", "s1")}}
        weights = {"in": 3, **{k: v for k, v in weights.items() if k not in ("s0", "s1")}}
    floor = -(-sum(weights.values()) // min(weights.values()))
    m = pl.mix(sources, weights, block=floor + block_extra)
    m = pl.mix(sources, [(0, weights), (start // 2 + 1, dict(zip(weights, reversed(list(weights.values())))))],
               block=None if block_extra % 2 else m.stages[0].block)
    if scattered:
        pos = np.random.default_rng(start).integers(0, 2 * start + 5000, 3000)
    else:
        pos = np.arange(start, start + 3000)
    got = m.stream_order(seed, shuffle=shuffle).stream_indices(pos)
    one = m.stream_order(seed, shuffle=shuffle)
    want = [int(one.stream_indices(pos[j : j + 1])[0]) for j in range(0, pos.size, 7)]
    assert got[::7].tolist() == want


def test_block_equal_to_batch_holds_weights_at_every_batch():
    m = pl.mix({"a": recs(5, 1), "b": recs(40, 2), "c": recs(9, 3)}, {"a": 1, "b": 5, "c": 2}, block=16)
    loader = pl.DataLoader(m, global_batch_size=16, seq_len=32, seed=7)
    tags = {"a": 0, "b": 0, "c": 0}
    for step in range(30):
        for row in loader.describe(step):
            tags[row[0][0]] += 1
        drawn_so_far = 16 * (step + 1)
        for name, w in (("a", 1), ("b", 5), ("c", 2)):
            assert abs(Fraction(tags[name]) - Fraction(w * drawn_so_far, 8)) < 1


def test_default_block_grows_for_small_weights():
    m = pl.mix({"a": recs(3, 1), "b": recs(3, 2)}, {"a": 1, "b": 999})
    assert m.stages[0].block == 1000
    assert pl.mix({"a": recs(3, 1), "b": recs(3, 2)}, {"a": 1, "b": 1}).stages[0].block == DEFAULT_BLOCK


def test_float_weights_are_their_decimals():
    m = pl.mix({"a": recs(3, 1), "b": recs(3, 2)}, {"a": 0.1, "b": 0.9}, block=10)
    assert Fraction(m.stages[0].nums[0], m.stages[0].den) == Fraction(1, 10)


# --- the loader ---------------------------------------------------------------------------------


def sources3():
    return {"a": recs(7, 1), "b": recs(50, 2), "c": pl.mix({"x": recs(3, 3), "y": recs(11, 4)}, {"x": 1, "y": 2})}


def mixture(weights=None):
    return pl.mix(sources3(), weights or {"a": 1, "b": 2, "c": 1}, block=8)


@pytest.mark.parametrize("packing", [False, True])
def test_describe_names_what_the_batch_holds(packing):
    m = mixture()
    tags = {"a": 1, "b": 2, "c/x": 3, "c/y": 4}
    loader = pl.DataLoader(m, global_batch_size=8, seq_len=16, seed=3, packing=packing, packing_window=32, prefetch=0)
    got, _ = batches(loader, 12)
    for step, batch in enumerate(got):
        for r, row in enumerate(loader.describe(step)):
            at = 0
            for name, rec, start, end in row:
                ids = batch["input_ids"][r, at : at + end - start]
                assert (ids == tags[name] * 1000 + rec).all() and len(ids) == end - start
                at += end - start
            assert batch["attention_mask"][r, at:].sum() == 0
    assert loader.describe(3) == pl.DataLoader(m, global_batch_size=8, seq_len=16, seed=3, packing=packing,
                                               packing_window=32).describe(3)  # random access = sequential


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True])
def test_describe_in_any_order_matches_describe_in_sequence(packing):
    kw = dict(global_batch_size=8, seq_len=16, seed=4, packing=packing, packing_window=24, overlong="drop")
    in_order = [pl.DataLoader(mixture(), **kw).describe(s) for s in range(40)]
    loader = pl.DataLoader(mixture(), **kw)
    for s in np.random.default_rng(1).permutation(40).tolist():
        assert loader.describe(s) == in_order[s]
    assert all(len(rows) == 8 for rows in in_order)


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_exact_resume_at_random_steps(packing, workers):
    rng = np.random.default_rng(packing * 2 + workers)
    kw = dict(global_batch_size=8, seq_len=16, seed=11, packing=packing, packing_window=24)
    whole, _ = batches(pl.DataLoader(mixture(), **kw, prefetch=0), 24)
    for cut in rng.integers(1, 23, 2).tolist():
        _, state = batches(pl.DataLoader(mixture(), **kw, prefetch=0), cut)
        state = json.loads(json.dumps(state))
        rest, _ = batches(pl.DataLoader(mixture(), **kw, num_workers=workers), 24 - cut, state)
        assert same(rest, whole[cut:]), cut


@pytest.mark.parametrize("packing", [False, True])
def test_hosts_split_one_stream_and_resume_elastically(packing):
    kw = dict(global_batch_size=8, seq_len=16, seed=5, packing=packing, packing_window=24, prefetch=0)
    one, _ = batches(pl.DataLoader(mixture(), **kw), 10)
    hosts = [batches(pl.DataLoader(mixture(), **kw, shard_index=h, shard_count=2), 6) for h in range(2)]
    for s in range(6):
        joined = {k: np.concatenate([hosts[0][0][s][k], hosts[1][0][s][k]]) for k in one[s]}
        assert same([joined], [one[s]])
    assert hosts[0][1] == hosts[1][1]
    rest, _ = batches(pl.DataLoader(mixture(), **kw), 4, hosts[0][1])  # 2 hosts -> 1
    assert same(rest, one[6:])


def test_finite_epochs_of_a_mixture():
    m = mixture()
    loader = pl.DataLoader(m, global_batch_size=8, seq_len=16, seed=1, num_epochs=2)
    assert loader.num_steps() == -(-2 * len(m) // 8)
    assert sum(1 for _ in loader) == loader.num_steps()


def test_state_is_small_with_sixty_sources_and_refused_by_other_mixtures():
    sources = {f"s{i:02d}": recs(3 + i % 5, i) for i in range(60)}
    weights = {n: 1 + i % 4 for i, n in enumerate(sources)}
    kw = dict(global_batch_size=8, seq_len=16, seed=2)
    loader = pl.DataLoader(pl.mix(sources, weights), **kw)
    _, state = batches(loader, 3)
    assert len(json.dumps(state)) < 1024
    batches(pl.DataLoader(pl.mix(sources, weights), **kw), 1, state)  # accepted by the same mixture
    other = dict(weights, s00=9)
    with pytest.raises(StateError, match="schedule stage 0 differs.*'s00': 9/"):
        batches(pl.DataLoader(pl.mix(sources, other), **kw), 1, state)
    fewer = {n: s for n, s in sources.items() if n != "s59"}
    with pytest.raises(StateError, match="fingerprint"):
        batches(pl.DataLoader(pl.mix(fewer, {n: weights[n] for n in fewer}), **kw), 1, state)
    plain = pl.DataLoader(recs(10, 1), **kw)
    with pytest.raises(StateError):
        batches(plain, 1, state)
    _, plain_state = batches(plain, 1)
    with pytest.raises(StateError, match="schedule.*missing|fingerprint"):
        batches(loader, 1, plain_state)


# --- schedules ----------------------------------------------------------------------------------


def test_schedule_changes_weights_at_a_block_boundary():
    m = pl.mix({"a": recs(5, 1), "b": recs(30, 2)}, [(0, {"a": 1, "b": 1}), (37, {"b": 1}), (100, {"a": 3, "b": 1})],
               block=10)
    assert [s.start for s in m.stages] == [0, 40, 100]
    got = [s for s, _ in drawn(m, 4, 180)]
    assert got[:40].count("a") == 20 and got[40:100].count("a") == 0
    for b in range(1, 9):  # within the third stage, counts follow its weights block by block
        assert abs(got[100 : 100 + 10 * b].count("a") - Fraction(3 * 10 * b, 4)) < 1


@pytest.mark.slow
def test_schedule_states_accept_appended_stages_and_refuse_edits():
    kw = dict(global_batch_size=8, seq_len=16, seed=9, prefetch=0)
    s1 = [(0, {"a": 1, "b": 1}), (64, {"a": 1, "b": 3})]
    ds = lambda sched: pl.mix({"a": recs(5, 1), "b": recs(30, 2)}, sched, block=8)  # noqa: E731
    whole, state = batches(pl.DataLoader(ds(s1), **kw), 12)  # position 96: both stages in use
    _, state5 = batches(pl.DataLoader(ds(s1), **kw), 5)  # position 40: stage 1 not begun
    appended = s1 + [(200, {"a": 1})]
    rest, _ = batches(pl.DataLoader(ds(appended), **kw), 4, state)
    full, _ = batches(pl.DataLoader(ds(appended), **kw), 16)
    assert same(full[:12], whole) and same(rest, full[12:])
    # re-weighting from the saved position on: stage 1 had not begun at position 40
    reweighted = [(0, {"a": 1, "b": 1}), (40, {"b": 1})]
    rest, _ = batches(pl.DataLoader(ds(reweighted), **kw), 3, state5)
    assert all(row[0][0] == "b" for s in range(5, 8) for row in pl.DataLoader(ds(reweighted), **kw).describe(s))
    with pytest.raises(StateError, match="schedule stage 1 differs"):
        batches(pl.DataLoader(ds([(0, {"a": 1, "b": 1}), (64, {"a": 1, "b": 2})]), **kw), 1, state)
    with pytest.raises(StateError, match="schedule stage 0 differs"):
        batches(pl.DataLoader(ds([(0, {"a": 2, "b": 1}), (64, {"a": 1, "b": 3})]), **kw), 1, state)
    with pytest.raises(StateError, match="after 2 schedule stage"):
        batches(pl.DataLoader(ds([(0, {"a": 1, "b": 1})]), **kw), 1, state)
    with pytest.raises(StateError, match="digest"):
        batches(pl.DataLoader(ds(s1), **kw), 1, dict(state, schedule=state["schedule"][:1]))


# --- unit="tokens" ------------------------------------------------------------------------------


def test_token_weights_hold_token_shares():
    short = recs(40, 1, lengths=None, seed=1)  # lengths 1..19
    long = [{"input_ids": np.full(50 + r % 30, 2000 + r, np.int32)} for r in range(25)]
    m = pl.mix({"short": short, "long": long}, {"short": 3, "long": 1}, unit="tokens")
    n = 40 * 25 * 4
    idx = m.stream_order(0).stream_indices(np.arange(n))
    tokens = {"short": 0, "long": 0}
    for (name, _), k in zip(m.locate(idx), m.lengths(idx).tolist()):
        tokens[name] += k
    share = tokens["short"] / sum(tokens.values())
    assert abs(share - 0.75) < 0.02 * 0.75
    records = pl.mix({"short": short, "long": long}, {"short": 3, "long": 1})
    assert records.fingerprint() != m.fingerprint()


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("sources, weights, kw, message", [
    ({"a": recs(2, 1)}, {"a": -1}, {}, "must be >= 0"),
    ({"a": recs(2, 1), "b": recs(2, 2)}, {"a": 0, "b": 0}, {}, "all weights zero"),
    ({"a": recs(2, 1)}, {"zz": 1}, {}, "'zz', which is not a source"),
    ({"a": recs(2, 1)}, [(0, {"a": 1}), (0, {"a": 2})], {}, "out of order"),
    ({"a": recs(2, 1)}, [(5, {"a": 1})], {}, "must start at record 0"),
    ({"a": recs(2, 1)}, [(0, {"a": 1}), (300, {"a": 2}), (200, {"a": 1})], {}, "out of order"),
    ({"a": recs(2, 1)}, [(0, {"a": 1}), (10, {"a": 2}), (100, {"a": 1})], {}, "takes effect at record 256"),
    ({"a": [], "b": recs(2, 1)}, {"b": 1}, {}, "source 'a' is empty"),
    ({}, {}, {}, "non-empty dict"),
    ({"a/b": recs(2, 1)}, {"a/b": 1}, {}, "without '/'"),
    ({"a": recs(2, 1)}, {"a": float("nan")}, {}, "must be finite"),
    ({"a": recs(2, 1)}, {"a": "1"}, {}, "must be a number"),
    ({"a": recs(2, 1)}, {"a": 1}, {"unit": "bytes"}, "'records' or 'tokens'"),
    ({"a": recs(2, 1), "b": recs(2, 2)}, {"a": 1, "b": 9}, {"block": 5}, "block must be >= 10"),
])
def test_bad_input_is_refused_clearly(sources, weights, kw, message):
    with pytest.raises(ValueError, match=message):
        pl.mix(sources, weights, **kw)


def test_describe_refuses_bad_steps():
    loader = pl.DataLoader(mixture(), global_batch_size=8, seq_len=16, num_epochs=1)
    with pytest.raises(ValueError, match="step must be"):
        loader.describe(-1)
    with pytest.raises(IndexError, match="past the end"):
        loader.describe(loader.num_steps())


# --- nesting, packing positions, no shuffle ------------------------------------------------------


def test_nested_mix_holds_its_own_weights_inside_its_share():
    inner = pl.mix({"x": recs(3, 3), "y": recs(11, 4)}, {"x": 1, "y": 2}, block=6)
    outer = pl.mix({"a": recs(7, 1), "c": inner}, {"a": 1, "c": 3}, block=8)
    order = outer.stream_order(5)
    src, spos = order.sources_at(np.arange(8 * 60))
    assert all(abs(np.count_nonzero(src[: 8 * b] == 1) - 6 * b) < 1 for b in range(1, 61))
    # the inner mix's draws, in its own stream order, follow its weights at its block boundaries
    mine = np.sort(spos[src == 1])
    assert mine.tolist() == list(range(len(mine)))
    names = [outer.locate([i])[0][0] for i in order.children[1].stream_indices(mine) + outer.offsets[1]]
    for b in range(1, len(mine) // 6 + 1):
        assert abs(names[: 6 * b].count("c/x") - 2 * b) < 1


def test_nested_mix_in_token_units():
    inner = pl.mix({"x": recs(30, 3, lengths=4), "y": recs(30, 4, lengths=12)}, {"x": 1, "y": 1})
    m = pl.mix({"a": recs(20, 1, lengths=8), "c": inner}, {"a": 1, "c": 1}, unit="tokens")
    assert m.mean_lengths == (8, 8)  # the inner mix draws 4- and 12-token records 1:1
    staged = pl.mix({"x": recs(3, 3)}, [(0, {"x": 1}), (512, {"x": 2})])
    with pytest.raises(ValueError, match="one stage"):
        pl.mix({"a": recs(20, 1), "c": staged}, {"a": 1, "c": 1}, unit="tokens")


def test_packed_state_counts_its_whole_window_as_used():
    kw = dict(global_batch_size=4, seq_len=16, seed=2, packing=True, packing_window=16, prefetch=0)
    ds = lambda sched: pl.mix({"a": recs(5, 1), "b": recs(30, 2)}, sched, block=8)  # noqa: E731
    base = [(0, {"a": 1, "b": 1})]
    it = iter(pl.DataLoader(ds(base), **kw))
    while True:
        next(it)
        state = it.get_state()
        if state["row"]:
            break
    end_of_window = (state["window"] + 1) * 16
    with pytest.raises(StateError, match="schedule"):  # a stage inside the window already planned
        batches(pl.DataLoader(ds(base + [(end_of_window - 8, {"b": 1})]), **kw), 1, state)
    batches(pl.DataLoader(ds(base + [(end_of_window, {"b": 1})]), **kw), 1, state)


def test_no_shuffle_serves_blocks_and_sources_in_order():
    m = pl.mix({"a": recs(3, 1), "b": recs(5, 2)}, {"a": 1, "b": 1}, block=4)
    got = m.locate(m.stream_order(0, shuffle=False).stream_indices(np.arange(12)))
    assert got == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("a", 2), ("a", 0), ("b", 2), ("b", 3),
                   ("a", 1), ("a", 2), ("b", 4), ("b", 0)]


def test_describe_without_a_mixture_names_no_source():
    data = recs(30, 5)
    loader = pl.DataLoader(data, global_batch_size=4, seq_len=8, seed=3, prefetch=0)
    got, _ = batches(loader, 3)
    for step, batch in enumerate(got):
        for r, [(name, rec, start, end)] in enumerate(loader.describe(step)):
            assert name is None and start == 0 and end == min(8, len(data[rec]["input_ids"]))
            assert (batch["input_ids"][r, :end] == 5000 + rec).all() and batch["attention_mask"][r, end:].sum() == 0
