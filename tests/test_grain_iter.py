"""The Grain-style ``IterDataset`` (portable_loader/dataset/iter/dataset.py) against real Grain, and our guarantees.

Oracle: the same pipeline built with ``grain.MapDataset....to_iter_dataset()...`` (Grain 0.2.18)
without worker processes, where Grain is deterministic: to_iter_dataset, map, filter,
map_with_index, batch, mix, and random_map too (Grain seeds each element's generator with the
operation's element counter, which we reproduce bit for bit). On top, what Grain lacks: the stream
is the same for every ``mp_prefetch`` worker count, a state restores exactly at another worker
count, its JSON has a fixed size under 1 KB (element 10 and element 10**7 alike), and a state of
another pipeline or an edited one is refused.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import re
import threading
import time

import grain
import numpy as np
import psutil
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from conftest import canon, loader_processes, take
from worker_fns import CALLS, affine, counted, fail_at_13, flaky_in_workers, jitter, not_mod, plus_index, write_marker
from portable_loader.dataset import Dataset, source
from portable_loader.dataset.iter import iterator as iterator_mod
from portable_loader.dataset.iter import mp_prefetch as mp_mod
from portable_loader.dataset.iter.dataset import DatasetIterator, IterDataset, to_iter_dataset
from portable_loader.dataset.random_map import keyed
from portable_loader.engine.threads import WorkerError
from portable_loader.errors import StateError
from portable_loader import grain as pg


# --- helpers -------------------------------------------------------------------------------------


def canon_all(xs) -> list:
    return [canon(x) for x in xs]


def outcome(ds) -> tuple[list, str | None]:
    """The elements up to the end or to the first error, and that error's type (ragged batches of batches fail in Grain too)."""
    out, it = [], iter(ds)
    try:
        for x in it:
            out.append(canon(x))
    except Exception as e:  # noqa: BLE001 - compared with the oracle's
        return out, type(e).__name__
    finally:
        getattr(it, "close", lambda: None)()
    return out, None


def workers(n: int):
    return grain.MultiprocessingOptions(num_workers=n)


def children() -> set[int]:
    return {p.pid for p in loader_processes()}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4 positions: small test streams then spread over every worker and many stages."""
    monkeypatch.setattr(mp_mod, "POOL_CHUNK", 4)
    monkeypatch.setattr(iterator_mod, "InlineExec", functools.partial(iterator_mod.InlineExec, chunk=5))


# Pipeline steps as plain functions (the same objects for Grain and for us) live in worker_fns, imported
# at the top: a worker started by forkserver imports the module of each one, and importing this one
# (real Grain, JAX, hypothesis) cost seconds per worker.


def apply_steps(ds, steps):
    """The same steps on a Grain IterDataset or one of ours."""
    for step in steps:
        kind, args = step[0], step[1:]
        if kind == "map":
            ds = ds.map(functools.partial(affine, *args))
        elif kind == "filter":
            ds = ds.filter(functools.partial(not_mod, *args))
        elif kind == "random_map":
            ds = ds.random_map(jitter, seed=args[0])
        elif kind == "map_with_index":
            ds = ds.map_with_index(plus_index)
        elif kind == "batch":
            ds = ds.batch(args[0], drop_remainder=args[1])
    return ds


STEP = st.one_of(
    st.tuples(st.just("map"), st.integers(-5, 5)),
    st.tuples(st.just("filter"), st.integers(2, 4), st.integers(0, 1)),
    st.tuples(st.just("random_map"), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("map_with_index")),
    st.tuples(st.just("batch"), st.integers(1, 4), st.booleans()),
)
PIPELINE = st.lists(STEP, min_size=1, max_size=5)


# --- equal to Grain --------------------------------------------------------------------------------


def test_to_iter_dataset_map_filter_batch_equal_grain():
    data = list(range(37))
    g = grain.MapDataset.source(data).filter(lambda x: x % 5 != 0).map(lambda x: x * 2).to_iter_dataset()
    ours = Dataset.source(data).filter(lambda x: x % 5 != 0).map(lambda x: x * 2).to_iter_dataset()
    assert list(ours) == list(g)
    assert list(to_iter_dataset(source(data).filter(lambda x: x % 5 != 0), allow_nones=True)) == list(
        grain.MapDataset.source(data).filter(lambda x: x % 5 != 0).to_iter_dataset(allow_nones=True))
    for drop in (False, True):
        for size in (1, 4, 37, 50):
            gb = g.filter(lambda x: x % 3 != 1).batch(size, drop_remainder=drop)
            ob = ours.filter(lambda x: x % 3 != 1).batch(size, drop_remainder=drop)
            assert canon_all(ob) == canon_all(gb)


def test_pytrees_of_dicts_tuples_arrays_and_strings_batch_as_grain():
    recs = [{"ids": np.arange(3, dtype=np.int32) + i, "text": "x" * (i % 4), "pair": (i, np.float32(i) / 2),
             "nested": {"b": [i, i + 1], "a": np.array([[i]], dtype=np.uint8)}} for i in range(11)]
    for drop in (False, True):
        g = grain.MapDataset.source(recs).to_iter_dataset().batch(4, drop_remainder=drop)
        ours = to_iter_dataset(recs).batch(4, drop_remainder=drop)
        assert canon_all(ours) == canon_all(g)
    g = grain.MapDataset.source(recs).to_iter_dataset().batch(3, batch_fn=lambda xs: [x["text"] for x in xs])
    assert list(to_iter_dataset(recs).batch(3, batch_fn=lambda xs: [x["text"] for x in xs])) == list(g)


def test_random_map_and_map_with_index_equal_grain_bit_for_bit_after_filters():
    def draw(x, rng):
        return (x, int(rng.integers(1 << 40)), float(rng.normal()))

    data = list(range(60))
    g = (grain.MapDataset.source(data).filter(lambda x: x % 4 != 0).to_iter_dataset()
         .random_map(draw, seed=11).filter(lambda t: t[0] % 3 != 0).map_with_index(lambda i, t: (i, *t))
         .batch(5).map_with_index(lambda i, b: (i, b)))
    ours = (to_iter_dataset(source(data).filter(lambda x: x % 4 != 0))
            .random_map(draw, seed=11).filter(lambda t: t[0] % 3 != 0).map_with_index(lambda i, t: (i, *t))
            .batch(5).map_with_index(lambda i, b: (i, b)))
    assert canon_all(ours) == canon_all(g)


def test_seed_gives_grains_default_seeds():
    def draw(x, rng):
        return int(rng.integers(1 << 30))

    g = grain.MapDataset.range(20).to_iter_dataset().seed(5).random_map(draw).map(lambda x: x).random_map(draw)
    ours = to_iter_dataset(range(20)).seed(5).random_map(draw).map(lambda x: x).random_map(draw)
    assert list(ours) == list(g)
    g = grain.MapDataset.range(20).seed(9).to_iter_dataset().random_map(draw)  # a seed set on the MapDataset
    assert list(Dataset.range(20).seed(9).to_iter_dataset().random_map(draw)) == list(g)
    with pytest.raises(ValueError, match="requires a seed"):
        to_iter_dataset(range(3)).random_map(draw)


class AddOne(grain.transforms.Map):
    def map(self, x):
        return x + 1


class Noise(grain.transforms.RandomMap):
    def random_map(self, x, rng):
        return x + int(rng.integers(100))


class Odd(grain.transforms.Filter):
    def filter(self, x):
        return x % 2 == 1


class Tag(grain.transforms.MapWithIndex):
    def map_with_index(self, i, x):
        return (i, x)


def test_grain_transform_subclasses_and_apply_work_unchanged():
    steps = [AddOne(), Noise(), Odd(), Tag(), grain.transforms.Batch(3, drop_remainder=False)]
    g = grain.MapDataset.range(30).to_iter_dataset().seed(3).apply(steps)
    ours = to_iter_dataset(range(30)).seed(3).apply(steps)
    assert canon_all(ours) == canon_all(g)
    g = grain.MapDataset.range(30).to_iter_dataset().map(AddOne()).random_map(Noise(), seed=1).filter(Odd()).map_with_index(Tag())
    ours = to_iter_dataset(range(30)).map(AddOne()).random_map(Noise(), seed=1).filter(Odd()).map_with_index(Tag())
    assert list(ours) == list(g)
    assert list(to_iter_dataset(range(4)).pipe(lambda ds, k: ds.map(lambda x: x * k), 3)) == [0, 3, 6, 9]
    with pytest.warns(DeprecationWarning):
        assert list(to_iter_dataset(range(3)).prefetch(workers(0))) == [0, 1, 2]


@pytest.mark.parametrize("weights", [None, [0.7, 0.3], [1, 2, 5]])
def test_mix_equals_grain(weights):
    sizes = [(0, 40), (100, 130), (200, 290)][: 3 if weights and len(weights) == 3 else 2]
    g = grain.IterDataset.mix([grain.MapDataset.range(a, b).to_iter_dataset() for a, b in sizes], weights)
    ours = IterDataset.mix([to_iter_dataset(range(a, b)) for a, b in sizes], weights)
    assert list(ours) == list(g)
    g = grain.IterDataset.mix({"z": grain.MapDataset.range(9).to_iter_dataset(),
                               "a": grain.MapDataset.range(50, 70).to_iter_dataset()}, {"z": 2, "a": 1})
    ours = IterDataset.mix({"z": to_iter_dataset(range(9)), "a": to_iter_dataset(range(50, 70))}, {"z": 2, "a": 1})
    assert list(ours) == list(g)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 40), steps=PIPELINE)
def test_random_pipelines_equal_grain(n, steps):
    g = apply_steps(grain.MapDataset.source(list(range(n))).to_iter_dataset(), steps)
    ours = apply_steps(to_iter_dataset(list(range(n))), steps)
    assert outcome(ours) == outcome(g)


# --- the same stream at every worker count, exact resume, a fixed-size state --------------------------


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(n=st.integers(0, 60), steps=PIPELINE, stop=st.integers(0, 30), counts=st.permutations([0, 1, 2, 3]))
def test_stream_and_resume_are_independent_of_the_worker_count(small_chunks, n, steps, stop, counts):
    ds = apply_steps(to_iter_dataset(list(range(n))), steps)
    expected, error = outcome(apply_steps(grain.MapDataset.source(list(range(n))).to_iter_dataset(), steps))
    for w in (0, 1, 2, 3):
        assert outcome(ds.mp_prefetch(workers(w))) == (expected, error), f"{w} workers"
    stop = min(stop, len(expected))  # a state is taken between elements that were served
    # A state saved at element `stop` with one worker count continues exactly with another.
    saved_with, restored_with = counts[0], counts[1]
    with iter(ds.mp_prefetch(workers(saved_with))) as it:
        head = take(it, stop)
        state = json.loads(json.dumps(it.get_state()))
    assert canon_all(head) == expected[:stop]
    with iter(ds.mp_prefetch(workers(restored_with))) as it:
        it.set_state(state)
        try:
            take(it, 3)              # chunks in flight when the state is set again are dropped
        except ValueError:           # the pipeline fails there (a ragged batch), as Grain's does
            pass
        it.set_state(state)
        rest = outcome(it)
    assert rest == (expected[stop:], error)
    sizes = {len(json.dumps(s)) for s in (state, iter(ds).get_state())}
    assert len(sizes) == 1 and sizes.pop() < 1024


@pytest.mark.slow
def test_resume_after_every_element_mid_epoch_filters_batches_and_mix(small_chunks):
    def build():
        a = to_iter_dataset(source(list(range(50))).filter(lambda x: x % 7 != 3)).random_map(jitter, seed=4)
        b = to_iter_dataset(range(1000, 1080)).filter(lambda x: x % 3 != 0).map_with_index(plus_index)
        return IterDataset.mix([a, b], [2, 1]).batch(3).map_with_index(lambda i, x: (i, x))

    expected = canon_all(build())
    assert len(expected) > 20
    for k in range(len(expected) + 1):
        it = iter(build())
        take(it, k)
        state = it.get_state()
        fresh = iter(build().mp_prefetch(workers(k % 3)))
        fresh.set_state(state)
        assert canon_all(fresh) == expected[k:], k
        fresh.close()


def test_state_is_small_and_of_fixed_size_and_far_set_state_is_o1():
    def pipeline():
        return Dataset.range(10**8).to_iter_dataset().map(counted).random_map(jitter, seed=2).map_with_index(plus_index).batch(4)

    it = iter(pipeline())
    take(it, 3)                                                   # after element 12 of the source
    near = it.get_state()
    far = json.loads(json.dumps(near))
    # A state far into the stream: the fields a run would have there (position and counts 4 * 2.5M).
    far["cursor"] = {k: f"{10**7:020d}" for k in near["cursor"]}
    far["check"] = iterator_mod._check(near["pipeline"], far["cursor"])
    fresh = iter(pipeline())
    CALLS["map"] = 0
    fresh.set_state(far)
    batch = next(fresh)
    assert CALLS["map"] < 1000                                    # a chunk read ahead, no replay of 10**7 elements
    rng = np.random.Generator(np.random.Philox(2))
    first = []
    for k in range(10**7, 10**7 + 4):                            # Grain's generator for element k
        keyed(rng, k)
        first.append(k + rng.integers(0, 1000) + 7 * k)
    assert batch.tolist() == first
    later = fresh.get_state()
    sizes = {len(json.dumps(near)), len(json.dumps(later))}
    assert len(sizes) == 1 and sizes.pop() < 1024, (near, later)
    assert int(later["cursor"]["0.source.position"]) == 10**7 + 4


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=PIPELINE, n=st.sampled_from([0, 2]))
def test_for_any_pipeline_the_state_at_element_10_and_at_10_million_has_one_size(steps, n):
    # A filter after an affine map can reject every element (3x + a is constant mod 3): then there is no element 10.
    assume(len(take(iter(apply_steps(Dataset.range(400).to_iter_dataset(), steps)), 12)) >= 12)
    ds = apply_steps(Dataset.range(10**8).to_iter_dataset().map(counted), steps).mp_prefetch(workers(n))
    with iter(ds) as it:
        take(it, 10)
        near = it.get_state()
    far = json.loads(json.dumps(near))
    # Position 10**7 and every count there (a count never exceeds the position; equal counts are consistent).
    far["cursor"] = {k: f"{10**7:020d}" for k in near["cursor"]}
    far["check"] = iterator_mod._check(near["pipeline"], far["cursor"])
    with iter(ds) as it:
        CALLS["map"] = 0
        it.set_state(far)
        take(it, 10)
        later = it.get_state()
    if n == 0:  # read in this process: ten elements' worth, not the 10**7 before them (workers read their own)
        assert CALLS["map"] < 10**6
    assert int(later["cursor"]["0.source.position"]) > 10**7
    assert len(json.dumps(near)) == len(json.dumps(later)) < 1024


def test_batch_size_is_not_part_of_the_state():
    data = list(range(40))
    it = iter(to_iter_dataset(data).filter(lambda x: x % 3 != 0).batch(4))
    take(it, 3)
    state = it.get_state()
    other = iter(to_iter_dataset(data).filter(lambda x: x % 3 != 0).batch(5))
    other.set_state(state)
    assert [b.tolist() for b in other] == [[19, 20, 22, 23, 25], [26, 28, 29, 31, 32], [34, 35, 37, 38]]


# --- states that are not this pipeline's are refused, never served --------------------------------


def test_foreign_edited_and_malformed_states_are_refused():
    def base(fn=lambda x: x + 1, seed=3, data=tuple(range(30))):
        return to_iter_dataset(list(data)).map(fn).random_map(jitter, seed=seed).filter(lambda x: x % 2 == 0)

    it = iter(base())
    take(it, 4)
    state = it.get_state()
    before = it.get_state()
    others = [base(fn=lambda x: x + 2), base(seed=4), base(data=range(31)),
              to_iter_dataset(list(range(30))).map(lambda x: x + 1).random_map(jitter, seed=3)]
    for other in others:
        with pytest.raises(StateError, match="another pipeline"):
            iter(other).set_state(state)
    bad = [
        (None, "expected the dict"),
        ({k: v for k, v in state.items() if k != "check"}, "'check': missing"),
        ({**state, "version": 2}, "'version'"),
        ({**state, "cursor": {**state["cursor"], "0.source.position": "5"}}, "20-digit"),
        ({**state, "cursor": {**state["cursor"], "0.source.position": f"{9:020d}"}}, "edited or damaged"),
        ({**state, "cursor": {"0.source.position": state["cursor"]["0.source.position"]}}, "not this pipeline's"),
        ({**state, "check": "0" * 16}, "edited or damaged"),
        ([state], "expected the dict"),
    ]
    for value, message in bad:
        with pytest.raises(StateError, match=message):
            it.set_state(value)
    assert it.get_state() == before                               # a refused state changed nothing
    past = {**state, "cursor": {**state["cursor"], "0.source.position": f"{31:020d}"}}
    past["check"] = iterator_mod._check(state["pipeline"], past["cursor"])
    with pytest.raises(StateError, match="past the end"):
        it.set_state(past)
    assert canon_all(it) == canon_all(base())[4:]


# --- workers: errors, init, lifetime -------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 2])
def test_an_error_surfaces_at_its_element_after_every_earlier_one(small_chunks, n):
    ds = to_iter_dataset(range(30)).filter(lambda x: x % 4 != 2).map(fail_at_13).map_with_index(plus_index)
    with iter(ds.mp_prefetch(workers(n))) as it:
        got = []
        with pytest.raises(KeyError, match="bad element 13"):
            while True:
                got.append(next(it))
        state = it.get_state()
    assert got == [plus_index(i, 2 * x) for i, x in enumerate(x for x in range(13) if x % 4 != 2)]
    assert int(state["cursor"]["0.source.position"]) == 13         # the failing element is next


def test_worker_init_fn_runs_in_each_worker(tmp_path):
    ds = to_iter_dataset(range(200)).map(lambda x: x + 1)
    with iter(ds.mp_prefetch(workers(3), worker_init_fn=functools.partial(write_marker, str(tmp_path)))) as it:
        assert list(it) == list(range(1, 201))
    assert sorted(os.listdir(tmp_path)) == ["0-of-3", "1-of-3", "2-of-3"]


@pytest.mark.slow
def test_no_worker_outlives_its_iterator(small_chunks):
    before = children()
    ds = to_iter_dataset(range(100)).map(lambda x: x * 2).mp_prefetch(workers(3))
    it = iter(ds)
    next(it)
    assert len(children() - before) == 3
    it.close()
    assert children() == before
    with iter(ds) as it:
        next(it)
    assert children() == before
    it = iter(ds)
    next(it)
    del it
    gc.collect()
    assert children() == before


def test_a_killed_worker_is_reported_not_waited_for(small_chunks):
    ds = to_iter_dataset(range(10**6)).map(lambda x: x).mp_prefetch(workers(2))
    before = children()
    it = iter(ds)
    next(it)
    for pid in children() - before:
        os.kill(pid, 9)
    with pytest.raises(WorkerError, match="terminated unexpectedly"):
        for _ in range(10**6):
            next(it)
    it.close()
    assert children() == before


def test_closed_iterator_refuses_to_continue():
    it = iter(to_iter_dataset(range(3)))
    it.close()
    with pytest.raises(ValueError, match="closed"):
        next(it)
    assert isinstance(iter(to_iter_dataset(range(3))), DatasetIterator)


def test_a_transient_worker_failure_is_retried_and_changes_nothing(small_chunks):
    ds = to_iter_dataset(range(80)).filter(lambda x: x % 5 != 0).map(functools.partial(flaky_in_workers, os.getpid())).map_with_index(plus_index)
    with iter(ds.mp_prefetch(workers(2))) as it:
        assert list(it) == list(ds)


def test_elements_that_cannot_be_pickled_are_a_clear_error_with_workers():
    ds = to_iter_dataset(range(10)).map(lambda x: (lambda: x))
    assert len(list(ds)) == 10                                     # in this process they need no pickling
    with iter(ds.mp_prefetch(workers(2))) as it:
        with pytest.raises(Exception, match="pickle"):
            next(it)


def test_nones_are_counted_and_passed_as_grain_does_at_any_worker_count(small_chunks):
    def draw(x, rng):
        return x * 1000 + int(rng.integers(1000))

    g = (grain.MapDataset.source(list(range(40))).filter(lambda x: x % 3 != 0).to_iter_dataset(allow_nones=True)
         .random_map(draw, seed=8).map_with_index(lambda i, x: (i, x)).filter(lambda t: t is None or t[1] % 2 == 0))
    ours = (to_iter_dataset(source(list(range(40))).filter(lambda x: x % 3 != 0), allow_nones=True)
            .random_map(draw, seed=8).map_with_index(lambda i, x: (i, x)).filter(lambda t: t is None or t[1] % 2 == 0))
    expected = list(g)
    assert None in expected and list(ours) == expected
    for n in (2, 3):
        with iter(ours.mp_prefetch(workers(n))) as it:
            assert list(it) == expected


def test_read_threads_and_mp_prefetch_placement_change_nothing(small_chunks):
    def steps(ds):
        return ds.filter(lambda x: x % 4 != 3).random_map(jitter, seed=5)

    expected = canon_all(steps(to_iter_dataset(range(70))).map_with_index(plus_index).batch(3))
    threaded = steps(to_iter_dataset(range(70), grain.ReadOptions(num_threads=3, prefetch_buffer_size=12)))
    with iter(threaded.map_with_index(plus_index).batch(3)) as it:
        first = canon(next(it))
        assert any(t.name.startswith("portable_loader-read") for t in threading.enumerate())
        assert [first, *canon_all(it)] == expected
    assert not any(t.name.startswith("portable_loader-read") for t in threading.enumerate())
    # mp_prefetch in the middle: what follows it runs in this process; states cross between the two.
    middle = steps(to_iter_dataset(range(70))).mp_prefetch(workers(2)).map_with_index(plus_index).batch(3)
    assert middle.fingerprint() == threaded.map_with_index(plus_index).batch(3).fingerprint()
    with iter(middle) as it:
        assert canon_all(take(it, 5)) == expected[:5]
        state = it.get_state()
    it = iter(threaded.map_with_index(plus_index).batch(3))
    it.set_state(state)
    assert canon_all(it) == expected[5:]
    it.close()


def test_dataset_to_iter_dataset_is_this_module():
    ds = Dataset.range(10).filter(lambda x: x % 2 == 0).to_iter_dataset()
    assert isinstance(ds, IterDataset) and list(ds) == [0, 2, 4, 6, 8]
    assert list(Dataset.range(10).filter(lambda x: x % 2 == 0).to_iter_dataset(allow_nones=True))[:3] == [0, None, 2]


# One pipeline, in a module that a child process and this one both import: a state travels between runs.
_PIPELINE_MODULE = """
import grain
from portable_loader.dataset.iter.dataset import to_iter_dataset

def build(workers=0):
    return (to_iter_dataset(range(10**6)).filter(lambda x: x % 3 != 1)
            .random_map(lambda x, rng: x + int(rng.integers(9)), seed=1).batch(4)
            .mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)))
"""
_CHILD = """
import json, sys, psutil
import iter_pipeline
it = iter(iter_pipeline.build(workers=2))
for _ in range(5):
    next(it)
print(json.dumps({"state": it.get_state(), "workers": [p.pid for p in psutil.Process().children()]}), flush=True)
if sys.argv[1] == "hang":
    sys.stdin.read()
"""


def _gone(pids, seconds=5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_workers_end_with_their_process_and_its_state_resumes_here(tmp_path, how):
    import subprocess
    import sys

    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    (tmp_path / "iter_pipeline.py").write_text(_PIPELINE_MODULE)
    proc = subprocess.Popen([sys.executable, str(script), "hang" if how == "sigkill" else "exit"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    report = json.loads(proc.stdout.readline())
    assert len(report["workers"]) == 2
    if how == "sigkill":
        proc.kill()
    out, err = proc.communicate(timeout=30)
    assert how == "sigkill" or proc.returncode == 0, err
    assert _gone(report["workers"]), "a worker outlived its process"
    sys.path.insert(0, str(tmp_path))
    try:
        import iter_pipeline
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("iter_pipeline", None)
    it = iter(iter_pipeline.build(workers=0))
    it.set_state(report["state"])
    expected = iter(iter_pipeline.build(workers=3))
    take(expected, 5)
    assert canon_all(take(it, 3)) == canon_all(take(expected, 3))
    expected.close()


def test_grains_checkpoint_handler_saves_and_restores_our_iterator(tmp_path):
    from etils import epath

    ds = to_iter_dataset(range(100)).filter(lambda x: x % 3 != 0).random_map(jitter, seed=6).batch(4)
    it = iter(ds)
    assert isinstance(it, grain.DatasetIterator)
    take(it, 3)
    grain.checkpoint.CheckpointHandler().save(epath.Path(tmp_path), it)
    restored = grain.checkpoint.CheckpointHandler().restore(epath.Path(tmp_path), iter(ds))
    assert canon_all(restored) == canon_all(it)


@pytest.mark.parametrize("where", ["source", "after_batch"])
def test_an_endless_stream_whose_filter_rejects_everything_raises_instead_of_hanging(monkeypatch, where):
    # Grain's iterator loops forever here; ours gives up after MAX_REJECTED rejections in a row.
    from portable_loader.dataset.iter import runtime as iter_runtime
    from portable_loader.errors import FilterError

    monkeypatch.setattr(iter_runtime, "MAX_REJECTED", 500)
    endless = Dataset.range(1, 2).repeat()  # the one element 1, forever
    if where == "source":
        it = iter(endless.to_iter_dataset().filter(lambda x: x != 1))
    else:  # batches of [1, 1, 1], whose sum 3 is rejected
        it = iter(endless.to_iter_dataset().batch(3).filter(lambda b: int(b.sum()) % 3 != 0))
    with pytest.raises(FilterError, match="rejected .* in a row"):
        next(it)
    finite = Dataset.range(1, 2).repeat(2).to_iter_dataset().filter(lambda x: x != 1)
    assert list(finite) == []  # a finite stream with no survivor simply ends


def test_a_filter_that_drops_nearly_everything_warns_as_grain(caplog):
    # Grain 0.2.18 warns when a 1,000-element window loses >= 90% (filter_test::test_filter_all_elements_warns).
    class FilterAllElements(pg.transforms.Filter):
        def filter(self, x):
            return False

    with caplog.at_level(logging.WARNING):
        assert list(pg.MapDataset.range(0, 1000).to_iter_dataset().filter(FilterAllElements())) == []
    assert re.search(r"Transformation FilterDatasetIterator\(transform=FilterAllElements\) skipped 100.00 % of the "
                     r"last seen 1000 elements.", caplog.text)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert len(list(pg.MapDataset.range(0, 3000).to_iter_dataset().filter(lambda x: x % 2))) == 1500
    assert "skipped" not in caplog.text


@pytest.mark.parametrize("seed", [0, 129, 2**31 + 5])
def test_default_seed_and_random_map_seed_equal_grains(seed):
    def seeds(g):
        ds = g.MapDataset.range(15).to_iter_dataset().seed(seed)
        first = ds.random_map(lambda x, rng: x)
        second = first.random_map(lambda x, rng: x)
        return (ds._default_seed, first._seed, second._seed, ds.map(abs)._default_seed,
                g.MapDataset.range(15).seed(seed)._default_seed, g.MapDataset.range(3).to_iter_dataset()._default_seed)

    got = seeds(pg)
    assert got == seeds(grain)
    assert got[1] != got[2] and got[-1] is None


def test_a_few_elements_read_compute_about_as_many():
    calls = []

    def f(x):
        calls.append(x)
        return x

    ds = pg.MapDataset.range(1000).map(f).to_iter_dataset(pg.ReadOptions(num_threads=0))
    for start in (None, 500):
        calls.clear()
        it = iter(ds)
        if start is not None:
            it.set_state(next_state_at(ds, start))
            calls.clear()
        assert [next(it) for _ in range(5)] == list(range(start or 0, (start or 0) + 5))
        assert len(calls) <= 7, calls  # chunks of 1, 2, 4 after a start, not 64
    calls.clear()
    assert list(ds) == list(range(1000)) and len(calls) == 1000  # a long read computes each once


def next_state_at(ds, k):
    it = iter(ds)
    for _ in range(k):
        next(it)
    return it.get_state()


class _SlowCounting:
    """16 records, each read sleeping 50 ms and counted (Grain's prefetch_test::test_early_break_continues_prefetching)."""

    def __init__(self):
        self.count, self.lock = 0, threading.Lock()

    def __len__(self):
        return 16

    def __getitem__(self, i):
        time.sleep(0.05)
        with self.lock:
            self.count += 1
        return i


def _wait_for(cond, seconds=10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


@pytest.mark.slow
@pytest.mark.parametrize("g", [grain, pg], ids=["grain", "ours"])
def test_reading_ahead_starts_at_the_first_next_and_goes_on_in_the_background_as_grains(g):
    src = _SlowCounting()
    it = iter(g.MapDataset.source(src).to_iter_dataset(g.ReadOptions(num_threads=2)))
    time.sleep(0.2)
    assert src.count == 0  # iter() reads nothing (ours takes its fingerprint when a state is first taken)
    assert next(it) == 0 and src.count >= 1
    assert _wait_for(lambda: src.count == 16)  # the threads read on while nobody asks
    assert list(it) == list(range(1, 16))
    it.close()


def test_close_right_after_the_first_element_leaves_little_read_and_nothing_after_it():
    src = _SlowCounting()
    it = iter(pg.MapDataset.source(src).to_iter_dataset(pg.ReadOptions(num_threads=2)))
    next(it)
    it.close()  # cancels what is queued and waits for the reads in flight
    after = src.count
    time.sleep(0.3)
    # Chunks ramp 1, 2, 4, ... after a start, so two threads hold at most a few records in flight.
    assert src.count == after < 16
