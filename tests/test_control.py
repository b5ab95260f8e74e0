"""Skipping batches (``skip_batches=``, ``it.skip(n)``): the delivered stream is the unskipped one with
the skipped batches left out, resumes exactly, costs no reading, and refuses bad input (docs/loader.md)."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_loader as pl

from test_loader import make_source, same

SRC = make_source(300, seed=3, max_len=30)
KW = {
    "padded": dict(global_batch_size=4, seq_len=16, seed=5),
    "packed": dict(global_batch_size=4, seq_len=16, seed=5, packing=True, packing_window=16),
}
_FULL: dict = {}


def full(mode, n=120):
    """The unskipped stream's first ``n`` batches (0 workers, no prefetch), computed once per mode."""
    if len(_FULL.get(mode, ())) < n:
        with iter(pl.DataLoader(SRC, prefetch=0, **KW[mode])) as it:
            _FULL[mode] = [next(it) for _ in range(n)]
    return _FULL[mode][:n]


def expected(loader, mode, first, count):
    ref = full(mode, loader.unskipped(first + count) + 1)
    return [ref[loader.unskipped(k)] for k in range(first, first + count)]


ranges = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6)), max_size=4).map(
    lambda pairs: sorted({a: (a, a + n) for a, n in pairs}.values()))


def disjoint(rs):
    out = []
    for a, b in rs:
        if not out or a >= out[-1][1]:
            out.append((a, b))
    return out


@pytest.mark.parametrize("mode", ["padded", "packed"])
@pytest.mark.parametrize("workers", [0, 2])
def test_skip_batches_leave_the_ranges_out_and_nothing_else(mode, workers):
    skips = [(2, 5), (5, 6), (9, 20)]
    loader = pl.DataLoader(SRC, skip_batches=skips, num_workers=workers, **KW[mode])
    assert [loader.unskipped(k) for k in range(5)] == [0, 1, 6, 7, 8]
    with iter(loader) as it:
        got = [next(it) for _ in range(30)]
    assert same(got, expected(loader, mode, 0, 30))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["padded", "packed"]), skips=ranges.map(disjoint), stop=st.integers(0, 25),
       requeue=st.booleans())
def test_a_state_saved_anywhere_resumes_to_the_same_batches(mode, skips, stop, requeue):
    loader = pl.DataLoader(SRC, skip_batches=skips, prefetch=0, **KW[mode])
    with iter(loader) as it:
        first = [next(it) for _ in range(stop)]
        state = it.get_state()
    assert same(first, expected(loader, mode, 0, stop))
    # a requeued job: the same arguments (a fresh loader) from the state; or one saved without skips
    if requeue:
        with iter(pl.DataLoader(SRC, prefetch=0, **KW[mode])) as it:
            for _ in range(stop):
                next(it)
            state = it.get_state()
        # the position is the unskipped batch `stop`; the skipping loader goes on from there
        after = [k for k in range(stop, 200) if all(not a <= k < b for a, b in skips)][:8]
        with iter(pl.DataLoader(SRC, skip_batches=skips, **KW[mode])) as it:
            it.set_state(state)
            got = [next(it) for _ in range(8)]
        assert same(got, [full(mode, max(after) + 1)[k] for k in after])
        return
    with iter(pl.DataLoader(SRC, skip_batches=skips, **KW[mode])) as it:
        it.set_state(state)
        got = [next(it) for _ in range(8)]
    assert same(got, expected(loader, mode, stop, 8))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["padded", "packed"]), skips=ranges.map(disjoint),
       ops=st.lists(st.one_of(st.just("next"), st.just("save"), st.integers(0, 12)), max_size=14))
def test_live_skips_move_the_position_and_states_hold_it(mode, skips, ops):
    loader = pl.DataLoader(SRC, skip_batches=skips, prefetch=1, **KW[mode])
    ref = full(mode, 260)
    delivered, sizes = 0, set()
    it = iter(loader)
    try:
        for op in ops:
            if op == "next":
                assert same([next(it)], [ref[loader.unskipped(delivered)]])
                delivered += 1
            elif op == "save":
                state = it.get_state()
                sizes.add(len(json.dumps(state)))
                it.close()
                it = iter(pl.DataLoader(SRC, skip_batches=skips, prefetch=0, **KW[mode]))
                it.set_state(state)
            else:
                it.skip(op)
                delivered += op
        assert same([next(it)], [ref[loader.unskipped(delivered)]])
    finally:
        it.close()
    assert not sizes or max(sizes) < 600  # the state is a position: no record of the skips


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_describe_and_num_steps_follow_the_delivered_stream(mode):
    skips = [(1, 3), (6, 9)]
    kw = dict(KW[mode], num_epochs=1)
    loader = pl.DataLoader(SRC, skip_batches=skips, **kw)
    plain = pl.DataLoader(SRC, **kw)
    with iter(loader) as it:
        got = list(it)
    assert len(got) == loader.num_steps() == plain.num_steps() - 5
    for k in (0, 1, 4, 7, len(got) - 1):
        assert loader.describe(k) == plain.describe(loader.unskipped(k))


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_skipping_past_the_end_ends_the_stream(mode):
    kw = dict(KW[mode], num_epochs=1)
    n = pl.DataLoader(SRC, **kw).num_steps()
    with iter(pl.DataLoader(SRC, skip_batches=[(2, n + 50)], **kw)) as it:
        assert len(list(it)) == 2
    with iter(pl.DataLoader(SRC, **kw)) as it:
        next(it)
        it.skip(n + 7)
        with pytest.raises(StopIteration):
            next(it)
        state = it.get_state()
    pl.DataLoader(SRC, **kw).check_state(state)  # a state at the end is a valid state


def test_a_skip_of_100000_batches_reads_nothing_and_costs_no_replay():
    reads = []

    class Counting(list):
        def __getitem__(self, i):
            reads.append(i)
            return list.__getitem__(self, i)

    src = Counting(make_source(5000, seed=1, max_len=60))
    kw = dict(global_batch_size=8, seq_len=64, seed=0, prefetch=0)
    with iter(pl.DataLoader(src, **kw)) as it:
        next(it)
        ref = next(pl.DataLoader(src, skip_batches=[(0, 100_001)], **kw).__iter__())
        reads.clear()
        it.skip(100_000)
        got = next(it)
    assert same([got], [ref]) and len(reads) <= 8  # the one batch served, nothing for the skipped ones
    served = []
    for skip in ([], [(3, 100_003)]):
        reads.clear()
        with iter(pl.DataLoader(src, skip_batches=skip, **kw)) as it:
            for _ in range(4):
                next(it)
        served.append(len(reads))
    assert served[1] <= served[0]  # what four batches read, nothing for the 100,000 skipped


@pytest.mark.parametrize("bad, words", [
    ([(5, 5)], "empty or reversed"), ([(6, 2)], "empty or reversed"), ([(-1, 3)], "negative"),
    ([(0, 4), (3, 8)], "overlap"), ([(1, 2, 3)], "must be a pair"), ([("a", 2)], "must be an integer"),
    ("0-4", "list of"),
])
def test_bad_skip_ranges_are_refused_naming_the_problem(bad, words):
    with pytest.raises(ValueError, match=words):
        pl.DataLoader(SRC, skip_batches=bad, **KW["padded"])


def test_bad_live_skips_and_unsupported_configs_are_refused():
    with iter(pl.DataLoader(SRC, **KW["padded"])) as it:
        for n in (-1, 1.5, True):
            with pytest.raises(ValueError, match="n must be an integer >= 0"):
                it.skip(n)
    with pytest.raises(ValueError, match="schedule by steps"):
        pl.DataLoader(SRC, skip_batches=[(1, 2)], global_batch_size=[(0, 2), (4, 4)], seq_len=16)
    by_samples = pl.BatchSchedule([(0, 2), (8, 4)], unit="samples")
    loader = pl.DataLoader(SRC, skip_batches=[(1, 3)], global_batch_size=by_samples, seq_len=16)
    plain = pl.DataLoader(SRC, global_batch_size=by_samples, seq_len=16)
    assert loader.describe(1) == plain.describe(3) and loader.describe(4) == plain.describe(6)
    with pytest.raises(ValueError, match="filtered source"):
        pl.DataLoader(pl.source(SRC).filter(lambda r: len(r["input_ids"]) > 3), skip_batches=[(1, 2)],
                      **KW["padded"])


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_hosts_and_workers_skip_the_same_global_batches(mode):
    skips = [(1, 4)]
    loader = pl.DataLoader(SRC, skip_batches=skips, **KW[mode])
    want = expected(loader, mode, 0, 10)
    hosts = [iter(loader.with_shard(k, 2)) for k in range(2)]
    with iter(pl.DataLoader(SRC, skip_batches=skips, num_workers=2, **KW[mode])) as it:
        try:
            for k in range(10):
                if k == 5:  # a live skip, with batches prefetched by the workers and the hosts
                    it.skip(2)
                    for h in hosts:
                        h.skip(2)
                    want = want[:5] + expected(loader, mode, 7, 5)
                glob, parts = next(it), [next(h) for h in hosts]
                for key in glob:
                    assert np.array_equal(glob[key], want[k][key])
                    assert np.array_equal(np.concatenate([p[key] for p in parts]), want[k][key])
        finally:
            for h in hosts:
                h.close()
