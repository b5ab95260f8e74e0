"""Per-source counts (``it.stats["sources"]``): the records and tokens the delivered batches hold, per
source of a mixture, exact, continued by a resumed state, and a small state (docs/loader.md)."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_loader as pl

from test_loader import make_source

A, B, C = make_source(40, seed=1, max_len=30), make_source(70, seed=2, max_len=50), make_source(9, seed=3, max_len=12)


def mixture():
    return pl.mix({"a": A, "b": B, "c": C}, {"a": 1, "b": 2, "c": 1})


def kw(mode, **more):
    base = dict(global_batch_size=4, seq_len=16, seed=3)
    if mode == "packed":
        base.update(packing=True, packing_window=16)
    return dict(base, **more)


def oracle(loader, steps):
    """Per-source counts from describe: a record counts where its first piece is served, tokens as served."""
    names = getattr(loader.source, "names", (None,))
    out = {n: {"records": 0, "tokens": 0} for n in names}
    for k in range(steps):
        for row in loader.describe(k):
            for name, _, s, e in row:
                out[name]["tokens"] += e - s
                out[name]["records"] += s == 0
    return out


def served_tokens(batch):
    return int(np.count_nonzero(batch["attention_mask"] if "attention_mask" in batch else batch["segment_ids"]))


@pytest.mark.parametrize("mode", ["padded", "packed"])
@pytest.mark.parametrize("workers", [0, 2])
def test_counts_equal_what_the_batches_hold(mode, workers):
    loader = pl.DataLoader(mixture(), num_workers=workers, **kw(mode, overlong="truncate" if mode == "padded" else "split"))
    with iter(loader) as it:
        batches = [next(it) for _ in range(12)]
        got = it.stats["sources"]
    assert got == oracle(loader, 12)
    assert sum(v["tokens"] for v in got.values()) == sum(served_tokens(b) for b in batches) == it.stats["tokens"]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["padded", "packed"]), stops=st.lists(st.integers(0, 6), min_size=1, max_size=4),
       size=st.sampled_from([2, 4, 6]), skip=st.integers(0, 3))
def test_counts_continue_across_resumes_at_other_sizes_and_skips(mode, stops, size, skip):
    state, gap = None, range(0)
    for k, stop in enumerate(stops):
        loader = pl.DataLoader(mixture(), prefetch=0, **kw(mode, global_batch_size=size if k % 2 else 4))
        with iter(loader) as it:
            if state is not None:
                it.set_state(state)
            if k == 1:  # skipped batches count for nothing
                before = it.get_state()["samples"]
                it.skip(skip)
                gap = range(before, it.get_state()["samples"])
            for _ in range(stop):
                next(it)
            state = it.get_state()
            counts = it.stats["sources"]
    # the same rows, served by one run at size 1 (the stream does not depend on the size): row r is step r
    ref = pl.DataLoader(mixture(), prefetch=0, **kw(mode, global_batch_size=1))
    expected = {n: {"records": 0, "tokens": 0} for n in "abc"}
    for r in range(state["samples"]):
        if r in gap:
            continue
        for name, _, s, e in ref.describe(r)[0]:
            expected[name]["tokens"] += e - s
            expected[name]["records"] += s == 0
    assert counts == expected
    assert state["sources"] == ",".join(f"{expected[n]['records']}:{expected[n]['tokens']}" for n in "abc")


def test_a_plain_source_has_one_entry_named_none():
    loader = pl.DataLoader(A, **kw("padded", num_epochs=1))
    with iter(loader) as it:
        batches = list(it)
        got = it.stats["sources"]
    assert got == {None: {"records": 40, "tokens": sum(served_tokens(b) for b in batches)}}
    assert got == oracle(loader, len(batches))


def test_filtered_and_dropped_records_count_for_nothing():
    m = pl.mix({"a": pl.source(A).filter(lambda r: len(r["input_ids"]) % 3 != 0), "b": B}, {"a": 1, "b": 1})
    for mode in ("padded", "packed"):
        loader = pl.DataLoader(m, **kw(mode, overlong="drop"))
        with iter(loader) as it:
            batches = [next(it) for _ in range(8)]
            got = it.stats["sources"]
        assert got == oracle(loader, 8)
        assert sum(v["tokens"] for v in got.values()) == sum(served_tokens(b) for b in batches)


def test_hosts_count_the_global_batch_and_states_stay_small():
    sources = {f"s{i:02d}": make_source(3 + i % 5, seed=i, max_len=9) for i in range(60)}
    m = pl.mix(sources, {n: 1 + i % 4 for i, n in enumerate(sources)})
    loader = pl.DataLoader(m, global_batch_size=8, seq_len=16, seed=2, shard_index=1, shard_count=2)
    with iter(loader) as it:
        for _ in range(3):
            next(it)
        state = it.get_state()
        counts = it.stats["sources"]
    assert counts == oracle(pl.DataLoader(m, global_batch_size=8, seq_len=16, seed=2), 3)  # all hosts' rows
    assert len(json.dumps(state)) < 1024


def test_bad_counts_in_a_state_are_refused_and_old_states_restart_them():
    from portable_loader.state import _digest

    loader = pl.DataLoader(mixture(), **kw("padded"))
    with iter(loader) as it:
        next(it)
        state = it.get_state()
    for bad, words in (("1:2,3:4", "counts of 2 source"), ("1:2,3:x,0:0", "is not records:tokens"), (7, "must be a string")):
        edited = dict(state, sources=bad)
        edited["digest"] = _digest(edited)
        with pytest.raises(pl.StateError, match=f"field 'sources': .*{words}"):
            iter(loader).set_state(edited)
    old = {k: v for k, v in state.items() if k != "sources"}
    old["digest"] = _digest(old)
    it = iter(loader)
    it.set_state(old)  # a state saved before the counts: they start again from 0
    next(it)
    assert sum(v["records"] for v in it.stats["sources"].values()) == 4
    it.close()


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from portable_loader.precache import sample_args

    return pl.precache(**sample_args(), out=str(tmp_path_factory.mktemp("sources") / "cache"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_counts_over_caches_equal_what_the_batches_hold_across_many_steps(chat, mode):
    # Caches know their lengths: a padded step's records go to the iterator as served and are
    # counted per source many steps at a time (every 256 steps, and when the counts are read)
    caches = {n: pl.open_cache(chat) for n in "abc"}
    loader = pl.DataLoader(pl.mix(caches, {"a": 3, "b": 1, "c": 2}), **kw(mode, seq_len=64, global_batch_size=8))
    with iter(loader) as it:
        batches = [next(it) for _ in range(100)]
        assert it.stats["sources"] == oracle(loader, 100)
        batches += [next(it) for _ in range(200)]
        state = it.get_state()  # 44 steps since the last fold: counted into the state
    with iter(loader) as it:
        it.set_state(state)
        batches += [next(it) for _ in range(300)]
        got = it.stats["sources"]
    assert got == oracle(loader, 600)
    assert sum(v["tokens"] for v in got.values()) == sum(served_tokens(b) for b in batches) == it.stats["tokens"] + sum(
        served_tokens(b) for b in batches[:300])
