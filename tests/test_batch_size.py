"""Changing the global batch size: resume at another size, schedules, Megatron's ramp-up, adapters, mixtures.

The oracle throughout is the stream itself: the rows of an uninterrupted run at one fixed size,
flattened (padding: the records in sampler order; packing: the packed rows), which the batch size only
cuts into steps. Every token of ``make_source`` is unique, so a row's tokens name its records.
"""

import json
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_loader as pl
from portable_loader.batch_size import BatchSchedule, rampup
from portable_loader.orders.sampler import LCGSampler

from test_loader import make_source

SRC = make_source(70, seed=3, max_len=30)
BASE = dict(seq_len=16, seed=4, packing_window=12)


def rows_of(batch):
    """The non-empty rows of a batch as token tuples (a padded or packed row's real tokens)."""
    ids, seg = np.asarray(batch["input_ids"]), np.asarray(batch["attention_mask"])
    return [tuple(r[s > 0].tolist()) for r, s in zip(ids, seg) if s.any()]


def stream(batches):
    return [row for b in batches for row in rows_of(b)]


def uninterrupted(packing, epochs=2):
    """The whole row stream, from a run at one fixed size (7: no size used below)."""
    return stream(iter(pl.DataLoader(SRC, global_batch_size=7, packing=packing, num_epochs=epochs, prefetch=0,
                                     **BASE)))


def padded_oracle(epochs=2):
    """Padding, without the loader: record ``sampler(p)`` at position ``p``, cut to seq_len."""
    sampler = LCGSampler(len(SRC), seed=BASE["seed"])
    n = len(SRC)
    recs = [int(sampler.record_indices([p % n], epoch=p // n)[0]) for p in range(epochs * n)]
    return [tuple(SRC[r]["input_ids"][: BASE["seq_len"]].tolist()) for r in recs]


def run_segments(segments, packing, epochs=2, workers=0, hosts=1):
    """Serve the stream in segments [(size, steps), ...], each a fresh loader resumed from the last state.

    With ``hosts`` > 1 each host's loader serves its slice; the global rows are the hosts' in order.
    Returns (batches as served, the final state).
    """
    out, state = [], None
    for size, steps in segments:
        loaders = [pl.DataLoader(SRC, global_batch_size=size, packing=packing, num_epochs=epochs, num_workers=workers,
                                 prefetch=0, **BASE).with_shard(k, hosts) for k in range(hosts)]
        its = [iter(ld) for ld in loaders]
        for it in its:
            if state is not None:
                it.set_state(state)
        for _ in range(steps):
            try:
                parts = [next(it) for it in its]
            except StopIteration:
                break
            out.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
        states = [it.get_state() for it in its]
        assert all(s == states[0] for s in states)  # the state is global: every host saves the same
        state = states[0]
        for it in its:
            it.close()
    return out, state


SEGMENTS = st.lists(st.tuples(st.sampled_from([2, 4, 6, 8, 12]), st.integers(0, 9)), min_size=1, max_size=5)


# --- 1. resume at another global batch size ----------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(segments=SEGMENTS, packing=st.booleans(), hosts=st.sampled_from([1, 2]))
def test_resume_at_another_size_continues_the_same_stream(segments, packing, hosts):
    want = padded_oracle() if not packing else uninterrupted(True)
    batches, state = run_segments(segments + [(4, 10**6)], packing, hosts=hosts)
    assert stream(batches) == want  # nothing dropped, nothing repeated, in the same order
    sizes = [s for s, n in segments for _ in range(n)]
    assert [len(b["input_ids"]) for b in batches][: len(sizes)] == sizes[: len(batches)]
    assert state["step"] == len(batches)


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("workers", [0, 2])
def test_workers_and_hosts_change_nothing_across_a_size_change(packing, workers):
    segments = [(4, 3), (12, 2), (2, 5), (8, 10**6)]
    want, _ = run_segments(segments, packing)
    got, _ = run_segments(segments, packing, workers=workers, hosts=2)
    assert [b["input_ids"].tolist() for b in got] == [b["input_ids"].tolist() for b in want]


def test_a_size_change_is_accepted_and_every_other_change_is_refused_by_name():
    kw = dict(BASE, packing=True, num_epochs=1)
    _, state = run_segments([(4, 3)], True, epochs=1)
    it = iter(pl.DataLoader(SRC, global_batch_size=10, **kw))
    it.set_state(state)
    assert len(next(it)["input_ids"]) == 10
    for change, field in [(dict(seed=5), "seed"), (dict(seq_len=32), "seq_len"), (dict(packing_window=16),
                          "packing_window"), (dict(num_epochs=2), "num_epochs")]:
        with pytest.raises(pl.StateError, match=f"field 'fingerprint': .*{field}: state"):
            iter(pl.DataLoader(SRC, global_batch_size=10, **{**kw, **change})).set_state(state)


def test_a_size_the_hosts_do_not_divide_is_refused_up_front():
    with pytest.raises(ValueError, match="size 6 is not divisible by shard_count 4"):
        pl.DataLoader(SRC, global_batch_size=[(0, 8), (5, 6)], seq_len=16, shard_index=0, shard_count=4)
    with pytest.raises(ValueError, match="global_batch_size 6 is not divisible by shard_count 4"):
        pl.DataLoader(SRC, global_batch_size=6, seq_len=16).with_shard(1, 4)


def test_positions_are_checked_against_the_stream():
    import sys

    from portable_loader.plan import Cursor
    from portable_loader.state import make_state

    finite = pl.DataLoader(SRC, global_batch_size=[(0, 4), (3, 8)], seq_len=16, num_epochs=1)
    iter(finite).set_state(make_state(finite, Cursor(20, 0, 0, 70)))  # the end of the stream, at any step
    with pytest.raises(pl.StateError, match=r"field 'samples': 71 is past the end of the stream \(70 records\)"):
        iter(finite).set_state(make_state(finite, Cursor(20, 0, 0, 71)))
    endless = pl.DataLoader(SRC, global_batch_size=8, seq_len=16)
    with pytest.raises(pl.StateError, match="field 'samples': .* past the last position"):
        iter(endless).set_state(make_state(endless, Cursor(0, 0, 0, sys.maxsize - 1)))


def test_version_2_states_are_refused_clearly():
    state = iter(pl.DataLoader(SRC, global_batch_size=4, seq_len=16)).get_state()
    old = {k: state[k] for k in ("fingerprint", "config", "step", "window", "row", "digest")}
    with pytest.raises(pl.StateError, match="field 'version': 2 is not 3 .*older portable_loader"):
        iter(pl.DataLoader(SRC, global_batch_size=4, seq_len=16)).set_state(dict(old, version=2))


# --- 2. schedules -----------------------------------------------------------------------------


def schedule_oracle(stages, unit, steps):
    """Sizes of steps 0..steps-1, walking them one at a time."""
    sizes, samples = [], 0
    for step in range(steps):
        at = step if unit == "steps" else samples
        size = [b for s, b in stages if s <= at][-1]
        sizes.append(size)
        samples += size
    return sizes


SCHEDULES = st.lists(st.tuples(st.integers(1, 40), st.sampled_from([1, 2, 3, 4, 6, 8])), max_size=5).map(
    lambda xs: sorted({s: b for s, b in xs}.items()))


@settings(max_examples=300, deadline=None)
@given(first=st.sampled_from([1, 2, 4]), rest=SCHEDULES, unit=st.sampled_from(["steps", "samples"]),
       step=st.integers(0, 80), samples=st.integers(0, 400))
def test_schedule_arithmetic_matches_walking_the_steps(first, rest, unit, step, samples):
    stages = [(0, first)] + rest
    sched = BatchSchedule(stages, unit)
    sizes = schedule_oracle(stages, unit, step + 1)
    assert sched.size_at(step) == sizes[step]
    assert sched.samples_at(step) == sum(sizes[:step])
    walked = schedule_oracle(stages, unit, samples + 1)  # at least 1 per step: enough steps
    cumulative = np.cumsum([0] + walked)
    assert sched.steps_for(samples) == int(np.searchsorted(cumulative, samples))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=st.sampled_from([2, 4]), rest=SCHEDULES.map(lambda xs: [(s, 2 * b) for s, b in xs]),
       unit=st.sampled_from(["steps", "samples"]), packing=st.booleans(), cut=st.integers(0, 30),
       hosts=st.sampled_from([1, 2]))
def test_a_schedule_serves_its_sizes_and_the_same_stream_and_resumes(first, rest, unit, packing, cut, hosts):
    sched = BatchSchedule([(0, first)] + rest, unit)
    loader = pl.DataLoader(SRC, global_batch_size=sched, packing=packing, num_epochs=2, prefetch=0, **BASE)
    served = list(iter(loader))
    assert stream(served) == (padded_oracle() if not packing else uninterrupted(True))
    sizes = [len(b["input_ids"]) for b in served]
    assert sizes == schedule_oracle(sched.stages, unit, len(served))
    assert loader.num_steps() == len(served) == loader.with_shard(0, 2).num_steps()
    assert [loader.batch_size_at(s) for s in range(len(served))] == sizes
    # describe(step) knows each step's size and records (spot checks: packed steps plan forward).
    for s in sorted({0, len(served) // 2, len(served) - 1}):
        rows = loader.describe(s)
        assert len(rows) == sizes[s]
        names = [tuple(t for _, r, a, b in row for t in SRC[r]["input_ids"][a:b].tolist()) for row in rows]
        assert [n for n in names if n] == rows_of(served[s])
    # Resume mid-schedule, on any host count: the same batches follow.
    cut = min(cut, len(served))
    with iter(loader) as it:
        for _ in range(cut):
            next(it)
        state = it.get_state()
    assert len(json.dumps(state)) < 1024
    if cut < len(served):
        assert state["batch_size"] == sizes[cut]
    its = [iter(loader.with_shard(k, hosts)) for k in range(hosts)]
    for it in its:
        it.set_state(state)
    rest_served = [np.concatenate([b["input_ids"] for b in parts]) for parts in zip(*its)]
    assert [b.tolist() for b in rest_served] == [b["input_ids"].tolist() for b in served[cut:]]


def test_schedule_edits_before_the_position_are_refused_after_it_accepted():
    kw = dict(BASE, num_epochs=3, prefetch=0)
    run = [(0, 2), (5, 4), (10, 8)]
    with iter(pl.DataLoader(SRC, global_batch_size=run, **kw)) as it:
        for _ in range(7):
            next(it)
        state = it.get_state()  # step 7: stages 0 and 1 have begun
    for ok in ([(0, 2), (5, 4)], [(0, 2), (5, 4), (7, 6)], [(0, 2), (5, 4), (30, 8), (40, 2)], 6):
        it = iter(pl.DataLoader(SRC, global_batch_size=ok, **kw))
        it.set_state(state)
        size = ok if isinstance(ok, int) else ok[-1][1] if ok[-1][0] == 7 else 4
        assert len(next(it)["input_ids"]) == size
    for bad in ([(0, 2), (4, 4), (10, 8)], [(0, 4), (5, 4)], [(0, 2), (3, 6), (5, 4)],
                BatchSchedule(run, unit="samples")):
        with pytest.raises(pl.StateError, match="field 'batch_schedule': .*stages before the saved position"):
            iter(pl.DataLoader(SRC, global_batch_size=bad, **kw)).set_state(state)


@pytest.mark.parametrize("bad,words", [
    ([(1, 4)], "first stage must start at 0"), ([(0, 4), (0, 8)], "not after stage 0"),
    ([(0, 0)], "size must be an integer >= 1"), ([(0, 4), (3,)], "must be a pair"), ([], "non-empty list"),
])
def test_malformed_schedules_are_refused(bad, words):
    with pytest.raises(ValueError, match=words):
        pl.DataLoader(SRC, global_batch_size=bad, seq_len=16)


def megatron_size(consumed, start, increment, ramp, final):
    """Megatron-LM's RampupBatchsizeNumMicroBatches.update, with exact arithmetic for its float division."""
    if consumed > ramp:
        return final
    per_increment = Fraction(ramp, (final - start) // increment)
    return start + int(consumed / per_increment) * increment


@settings(max_examples=200, deadline=None)
@given(start=st.integers(1, 64), increment=st.integers(1, 32), n=st.integers(1, 20), ramp=st.integers(0, 5000),
       consumed=st.integers(0, 6000))
def test_rampup_matches_megatron(start, increment, n, ramp, consumed):
    final = start + n * increment
    sched = rampup(start, increment, ramp, final)
    if ramp:  # Megatron divides by ramp / n: a ramp of 0 samples means the final size at once
        assert sched.size(0, consumed) == megatron_size(consumed, start, increment, ramp, final)
    steps, total = 0, 0
    while total < consumed:  # the step arithmetic follows the same sizes
        total += megatron_size(total, start, increment, max(ramp, 1), final) if ramp else final
        steps += 1
    assert sched.steps_for(consumed) == steps


def test_rampup_state_stays_small_and_is_refused_when_edited():
    sizes = rampup(16, 16, 20_000, 1024)  # 64 stages
    loader = pl.DataLoader(SRC, global_batch_size=sizes, seq_len=16)
    from portable_loader.state import make_state
    from portable_loader.plan import Cursor

    state = make_state(loader, Cursor(300, 0, 0))
    assert len(json.dumps(state)) < 1024 and state["batch_size"] == megatron_size(state["samples"], 16, 16, 20_000, 1024)
    iter(loader).set_state(state)
    with pytest.raises(pl.StateError, match="batch_schedule"):
        iter(pl.DataLoader(SRC, global_batch_size=rampup(16, 16, 10_000, 1024), seq_len=16)).set_state(state)
    with pytest.raises(ValueError, match="multiple of increment"):
        rampup(16, 10, 100, 64)


# --- 3. adapters ------------------------------------------------------------------------------


def test_torch_loader_hands_out_batches_of_the_current_size():
    pytest.importorskip("torch")
    from portable_loader.adapters.torch import TorchLoader

    kw = dict(BASE, global_batch_size=[(0, 2), (3, 6), (5, 4)], packing=True, num_epochs=1, prefetch=0)
    want = list(iter(pl.DataLoader(SRC, **kw)))
    with TorchLoader(pl.DataLoader(SRC, **kw), async_collation=True) as tl:
        got = list(tl)
    assert [b["input_ids"].numpy().tolist() for b in got] == [b["input_ids"].tolist() for b in want]


def test_jax_loader_gives_each_size_its_global_shape():
    pytest.importorskip("jax")
    from portable_loader.adapters.jax import JaxLoader

    kw = dict(BASE, global_batch_size=[(0, 8), (2, 16), (4, 8)], packing=True, num_epochs=None, prefetch=0)
    want = [b for _, b in zip(range(6), iter(pl.DataLoader(SRC, **kw)))]
    with JaxLoader(pl.DataLoader(SRC, **kw)) as jl:
        got = [next(jl) for _ in range(6)]
        state = jl.get_state()
    assert [b["input_ids"].shape for b in got] == [(8, 16)] * 2 + [(16, 16)] * 2 + [(8, 16)] * 2
    assert all(np.array_equal(np.asarray(g["input_ids"]), w["input_ids"]) for g, w in zip(got, want))
    assert all(len(b["input_ids"].sharding.device_set) == 8 for b in got)
    with JaxLoader(pl.DataLoader(SRC, **{**kw, "global_batch_size": 24})) as jl:  # resumed at another size
        jl.set_state(state)
        assert next(jl)["input_ids"].shape == (24, 16)
    with pytest.raises(ValueError, match="size 12 of the schedule .* cannot be laid out"):
        JaxLoader(pl.DataLoader(SRC, **{**kw, "global_batch_size": [(0, 8), (3, 12)]}))


# --- 4. mixtures ------------------------------------------------------------------------------


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(segments=SEGMENTS)
def test_mixture_weights_hold_at_block_boundaries_across_size_changes(segments):
    a = make_source(30, seed=1, max_len=30)
    b = [{"input_ids": r["input_ids"] + 5_000_000, "loss_mask": r["loss_mask"]} for r in make_source(50, seed=2)]
    block = 10
    m = pl.mix({"a": a, "b": b}, {"a": 3, "b": 7}, block=block)  # a block is the user's integer: it stays
    out, state = [], None
    for size, steps in segments + [(5, 40)]:
        it = iter(pl.DataLoader(m, global_batch_size=size, seq_len=64, seed=1, prefetch=0))
        if state is not None:
            it.set_state(state)
        out += [next(it) for _ in range(steps)]
        state = it.get_state()
    firsts = [row[0] for row in stream(out)]  # tokens are unique: the first names the record
    one = iter(pl.DataLoader(m, global_batch_size=1, seq_len=64, seed=1, prefetch=0))
    whole = [row[0] for row in stream([next(one) for _ in range(len(firsts))])]
    assert firsts == whole  # the mixed record stream continues across every change
    from_b = np.cumsum([t >= 5_000_000 for t in firsts])
    for k in range(block, len(firsts) + 1, block):
        assert abs(int(from_b[k - 1]) - Fraction(7, 10) * k) < 1
