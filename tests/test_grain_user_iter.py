"""User-written ``IterDataset``/``DatasetIterator`` subclasses in pipelines (portable_loader/dataset/iter/opaque.py).

Oracle: real Grain 0.2.18 running the same user classes, written once over a module ``grain``
(``tests/grain_user_iters.py``) and built over real Grain's base classes, at 0 workers: element
for element, and the user's own fields of the state at every element (each library nests its own
parent state, in its own format). On top, what docs/grain.md promises: the same stream and states
at 2 ``mp_prefetch`` workers, with the operations below the step still in the workers; resume
from any state, across worker counts and in a fresh process; the Orbax handler; refusal of a state
of another step (class or constructor argument) or an edited one.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import grain
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import grain_user_iters as users
from conftest import canon
from portable_loader import grain as pg
from portable_loader.errors import StateError

ROOT = Path(__file__).resolve().parents[1]
OURS, REAL = users.classes(pg), users.classes(grain)
TWO = pg.MultiprocessingOptions(num_workers=2)


def run(ds, limit: int = 10_000):
    """(elements, states after each) of ``iter(ds)``, closed at the end."""
    it = iter(ds)
    out, states = [], []
    try:
        for x in it:
            out.append(canon(x))
            states.append(it.get_state())
            if len(out) >= limit:
                break
    finally:
        getattr(it, "close", lambda: None)()
    return out, states


def rest_after(ds, state) -> list:
    it = iter(ds)
    try:
        it.set_state(state)
        return [canon(x) for x in it]
    finally:
        getattr(it, "close", lambda: None)()


@pytest.mark.parametrize("name", users.NAMES)
def test_elements_and_user_states_equal_real_grain_at_0_workers(name):
    theirs, their_states = run(users.pipeline(name, grain))
    ours, our_states = run(users.pipeline(name, pg))
    assert ours == theirs and len(ours) >= 5
    assert all(users.user_parts(s) for s in our_states)  # the user's fields are there to compare
    if name not in users.SNAPSHOT_ELSEWHERE:
        assert [users.user_parts(s) for s in our_states] == [users.user_parts(s) for s in their_states]
    for k in (len(ours) // 3, 2 * len(ours) // 3):  # each library's state is the same position in the stream
        assert rest_after(users.pipeline(name, grain), their_states[k]) == ours[k + 1:]
        assert rest_after(users.pipeline(name, pg), our_states[k]) == ours[k + 1:]


@pytest.mark.slow
@pytest.mark.parametrize("name", users.NAMES)
def test_two_workers_equal_zero_and_states_resume_across_counts(name):
    ds = users.pipeline(name, pg)
    zero, zero_states = run(ds)
    two, two_states = run(ds.mp_prefetch(TWO))
    assert two == zero
    assert two_states == zero_states  # the same state at any worker count, nested parts included
    for k in sorted({0, len(zero) // 2, len(zero) - 1}):
        assert rest_after(ds.mp_prefetch(TWO), zero_states[k]) == zero[k + 1:]
        assert rest_after(ds, two_states[k]) == zero[k + 1:]


def test_operations_below_the_step_run_in_the_workers_and_the_step_here():
    ds = OURS.EveryNth(pg.MapDataset.range(200).to_iter_dataset().map(users.with_pid), n=2, k=0)
    with iter(ds.mp_prefetch(TWO)) as it:
        got = list(it)
    assert os.getpid() not in {pid for _, pid in got} and len({pid for _, pid in got}) == 2
    assert [x for x, _ in got] == list(range(0, 200, 2))

    class Where(pg.IterDataset):
        def __iter__(self):
            return WhereIterator(self._parent.__iter__())

    class WhereIterator(pg.DatasetIterator):
        def __next__(self):
            return (next(self._parent), os.getpid(), self._ctx.mp_context.process_count)

        def get_state(self):
            return self._parent.get_state()

        def set_state(self, state):
            self._parent.set_state(state)

    with iter(Where(pg.MapDataset.range(10).to_iter_dataset()).mp_prefetch(TWO)) as it:
        got = list(it)
    assert [x for x, _, _ in got] == list(range(10))
    assert {(pid, count) for _, pid, count in got} == {(os.getpid(), 1)}


@pytest.mark.parametrize("name", users.NAMES)
def test_resume_from_every_state_continues_the_stream(name):
    ds = users.pipeline(name, pg)
    whole, states = run(ds)
    for k in range(len(whole)):
        restored = json.loads(json.dumps(states[k]))  # as a checkpoint holds it
        assert rest_after(ds, restored) == whole[k + 1:], k


@pytest.mark.slow
def test_resume_in_a_fresh_process(tmp_path):
    ds = users.pipeline("nested", pg)
    whole, states = run(ds.mp_prefetch(TWO))
    k = len(whole) // 3
    (tmp_path / "state.json").write_text(json.dumps(states[k]))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    subprocess.run([sys.executable, str(ROOT / "tests" / "grain_user_iters.py"), "nested",
                    str(tmp_path / "state.json"), str(tmp_path / "rest.json")], check=True, env=env, timeout=120)
    assert json.loads((tmp_path / "rest.json").read_text()) == json.loads(json.dumps(whole[k + 1:]))


@pytest.mark.parametrize("name", ["sharded", "top"])
def test_orbax_handler_round_trip(tmp_path, name):
    ocp = pytest.importorskip("orbax.checkpoint")
    ds = users.pipeline(name, pg)
    whole, _ = run(ds)
    it = iter(ds)
    for _ in range(3):
        next(it)
    mngr = ocp.CheckpointManager(str(tmp_path / "ckpt"))
    mngr.save(1, args=ocp.args.Composite(data_iter=pg.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
    it.close()
    restored = mngr.restore(1, args=ocp.args.Composite(data_iter=pg.checkpoint.CheckpointRestore(iter(ds))))
    assert [canon(x) for x in restored["data_iter"]] == whole[3:]
    mngr.close()


def test_a_dataset_iterator_built_directly_over_another_iterator():
    def direct(g, c):
        return c.EveryNthIterator(iter(g.MapDataset.range(30).to_iter_dataset().map(users.double)), 4, 2)

    theirs, their_states = run_iterator(direct(grain, REAL))
    ours, our_states = run_iterator(direct(pg, OURS))
    assert ours == theirs == [canon(2 * x + 1) for x in range(2, 30, 4)]
    assert [users.user_parts(s) for s in our_states] == [users.user_parts(s) for s in their_states]
    it = direct(pg, OURS)
    it.set_state(our_states[2])
    assert [canon(x) for x in it] == ours[3:]
    plain = OURS.EveryNthIterator(iter(range(10)), 3, 0)  # any Python iterator is one parent
    assert list(plain) == [0, 3, 6, 9]


def run_iterator(it):
    out, states = [], []
    for x in it:
        out.append(canon(x))
        states.append(it.get_state())
    it.close()
    return out, states


def test_a_user_iterator_over_a_data_loader_iterator_resumes():
    def make():
        loader = pg.DataLoader(data_source=list(range(30)), sampler=pg.samplers.IndexSampler(30, num_epochs=1),
                               operations=[pg.transforms.Batch(2)], worker_count=0)
        return OURS.EveryNthIterator(iter(loader), 3, 1)

    whole, states = run_iterator(make())
    assert whole == [canon(np.array([x, x + 1])) for x in range(2, 30, 6)]
    again = make()
    again.set_state(states[1])
    assert [canon(x) for x in again] == whole[2:]


def test_options_set_above_a_step_reach_its_iterator_as_in_grain():
    def seen(g):
        class Opts(g.IterDataset):
            def __iter__(self):
                return OptsIterator(self._parent.__iter__())

        class OptsIterator(g.DatasetIterator):
            def __next__(self):
                return (int(next(self._parent)), self._ctx.dataset_options.filter_warn_threshold_ratio)

            def get_state(self):
                return self._parent.get_state()

            def set_state(self, state):
                self._parent.set_state(state)

        below = g.experimental.WithOptionsIterDataset(
            g.MapDataset.range(3).to_iter_dataset(), g.experimental.DatasetOptions(filter_warn_threshold_ratio=0.3))
        above = g.experimental.DatasetOptions(filter_warn_threshold_ratio=0.6)
        return (list(Opts(below).map(lambda x: x)),
                list(g.experimental.WithOptionsIterDataset(Opts(below).map(lambda x: x), above)))

    assert seen(pg) == seen(grain) == ([(0, 0.3), (1, 0.3), (2, 0.3)], [(0, 0.6), (1, 0.6), (2, 0.6)])


def test_one_parent_is_one_dataset_even_an_infinite_one():
    endless = pg.MapDataset.range(5).repeat()
    step = OURS.EveryNth(endless, 3, 1)
    assert step.parents == (endless,)
    assert pg.IterDataset(endless).parents == (endless,)
    ours = [canon(x) for x, _ in zip(step, range(12))]
    theirs = [canon(x) for x, _ in zip(REAL.EveryNth(grain.MapDataset.range(5).repeat(), 3, 1), range(12))]
    assert ours == theirs == [canon(x % 5) for x in range(1, 36, 3)]
    assert pg.IterDataset([endless, endless]).parents == (endless, endless)


def test_states_of_another_step_or_edited_ones_are_refused():
    def make(n, cls=OURS.EveryNth):
        return cls(pg.MapDataset.range(40).to_iter_dataset(), n=n, k=0).map(users.double)

    it = iter(make(3))
    next(it), next(it)
    state = it.get_state()
    assert rest_after(make(3), state)  # its own pipeline takes it
    with pytest.raises(StateError, match="'pipeline'"):
        rest_after(make(4), state)  # another constructor argument

    class OtherNth(OURS.EveryNth):
        pass

    with pytest.raises(StateError, match="'pipeline'"):
        rest_after(make(3, OtherNth), state)  # another class
    edited = json.loads(json.dumps(state))
    edited["steps"]["0.EveryNth"]["seen"] += 1
    with pytest.raises(StateError, match="'check'"):
        rest_after(make(3), edited)
    missing = {k: v for k, v in state.items() if k != "steps"}
    with pytest.raises(StateError, match="'steps'"):
        rest_after(make(3), missing)


def test_the_fingerprint_ignores_what_the_step_does_to_itself():
    class Lazy(pg.IterDataset):
        def __init__(self, parent, scale):
            super().__init__(parent)
            self.scale, self.calls = scale, 0

        def __iter__(self):
            self.calls += 1
            self.table = {i: i * self.scale for i in range(5)}  # built on first use
            return OURS.EveryNthIterator(self._parent.__iter__(), 1, 0)

    def make():
        return Lazy(pg.MapDataset.range(8).to_iter_dataset(), 2).batch(3)

    used = make()
    it = iter(used)
    next(it)
    state = it.get_state()
    used.scale = 99  # changed after construction: not what names it
    assert used.fingerprint() == make().fingerprint()
    assert rest_after(make(), state) == [canon(np.array([3, 4, 5])), canon(np.array([6, 7]))]


def test_a_dataclass_step_is_named_by_its_fields_and_survives_copies():
    @dataclasses.dataclass(eq=False)
    class Shard(pg.IterDataset):
        parent: object
        n: int

        def __iter__(self):
            return OURS.EveryNthIterator(self.parent.__iter__(), self.n, 0)

    def make(n):
        return Shard(pg.MapDataset.range(12).to_iter_dataset(), n).batch(2)

    assert make(3).fingerprint() == make(3).fingerprint() != make(4).fingerprint()
    assert [canon(b) for b in make(3)] == [canon(np.array([0, 3])), canon(np.array([6, 9]))]
    step = OURS.EveryNth(pg.MapDataset.range(12).to_iter_dataset(), 3, 0)
    assert copy.deepcopy(step).fingerprint() == copy.copy(step).fingerprint() == step.fingerprint()


def test_a_subclass_of_a_built_in_step_with_its_own_iter_runs_its_iterator():
    class Tagged(pg.experimental.RepeatIterDataset):
        def __iter__(self):
            return OURS.EveryNthIterator(super().__iter__(), 2, 0)  # Grain's built-in iterator, wrapped

    def make(g, cls):
        return cls(g.MapDataset.range(5).to_iter_dataset(), num_epochs=2).map(users.double)

    class RealTagged(grain.experimental.RepeatIterDataset):
        def __iter__(self):
            return REAL.EveryNthIterator(super().__iter__(), 2, 0)

    ours, states = run(make(pg, Tagged))
    assert ours == run(make(grain, RealTagged))[0] == [canon(2 * x + 1) for x in [0, 2, 4, 1, 3]]
    assert rest_after(make(pg, Tagged), states[1]) == ours[2:]
    alone = Tagged(pg.MapDataset.range(3).to_iter_dataset(), num_epochs=2)  # the last step: iter() is the user's
    assert list(alone) == list(RealTagged(grain.MapDataset.range(3).to_iter_dataset(), num_epochs=2)) == [0, 2, 1]


def test_a_subclass_without_iter_or_state_methods_is_a_clear_error():
    class NoIter(pg.IterDataset):
        pass

    with pytest.raises(TypeError, match="defines no __iter__"):
        iter(NoIter(pg.MapDataset.range(3).to_iter_dataset()).map(users.double))

    class NoState(pg.DatasetIterator):
        def __next__(self):
            return 1

    with pytest.raises(TypeError, match="'get_state', 'set_state'"):
        NoState()


def test_closing_the_pipeline_closes_the_user_iterator_and_its_workers():
    ds = OURS.EveryNth(pg.MapDataset.range(100).to_iter_dataset().map(users.double), 2, 0).batch(2)
    it = iter(ds.mp_prefetch(TWO))
    next(it)
    user = it._root.child.iterator
    parent = user._parent
    it.close()
    assert user._closed and parent._closed
    with pytest.raises(ValueError):
        next(it)


_STEPS = st.lists(st.one_of(
    st.tuples(st.just("map")),
    st.tuples(st.just("filter"), st.integers(2, 5)),
    st.tuples(st.just("every"), st.integers(1, 4), st.integers(0, 3)),
    st.tuples(st.just("batch"), st.integers(1, 4)),
), min_size=1, max_size=5)


def _chain(g, c, size: int, steps: list):
    ds, batched = g.MapDataset.range(size).to_iter_dataset(), 0
    for step in steps:
        if step[0] == "map":
            ds = ds.map(users.double)
        elif step[0] == "filter":
            ds = ds.filter(lambda x, m=step[1]: int(np.sum(x)) % m != 0)
        elif step[0] == "every":
            ds = c.EveryNth(ds, step[1], step[2] % step[1])
        elif batched:  # the last batch's rows again, the step holding its place inside a batch
            ds, batched = c.Unbatch(ds), 0
        else:
            ds, batched = ds.batch(step[1]), 1
    return ds


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(0, 40), steps=_STEPS, cut=st.integers(0, 100))
def test_random_chains_equal_real_grain_and_resume(size, steps, cut):
    theirs, their_states = run(_chain(grain, REAL, size, steps))
    ds = _chain(pg, OURS, size, steps)
    ours, our_states = run(ds)
    assert ours == theirs
    assert [users.user_parts(s) for s in our_states] == [users.user_parts(s) for s in their_states]
    if ours:
        k = cut % len(ours)
        assert rest_after(ds, json.loads(json.dumps(our_states[k]))) == ours[k + 1:]


def _source_classes(g):
    """A source iterator as MaxText writes its remote-file reader: no parent, Grain's base
    ``__init__`` called as ``grain.DatasetIterator.__init__(self)``, a state of its own."""

    class Lines(g.DatasetIterator):
        def __init__(self, n):
            g.DatasetIterator.__init__(self)
            self.n, self.i = n, 0

        def __next__(self):
            if self.i >= self.n:
                raise StopIteration
            self.i += 1
            return f"line {self.i - 1}"

        def get_state(self):
            return {"file": "gs://bucket/a.txt", "i": self.i}

        def set_state(self, state):
            self.i = state["i"]

    class LinesDataset(g.IterDataset):
        def __init__(self, n):
            super().__init__()
            self.n = n

        def __iter__(self):
            return Lines(self.n)

    return Lines, LinesDataset


def test_a_source_iterator_calling_grains_base_init_with_no_arguments():
    (ours, our_ds), (theirs, their_ds) = _source_classes(pg), _source_classes(grain)
    alone = ours(5)
    assert alone._parents == () and isinstance(alone, grain.DatasetIterator) and isinstance(alone, pg.DatasetIterator)
    assert list(alone) == list(theirs(5)) == [f"line {i}" for i in range(5)]

    def build(g, ds):
        return ds(7).map(len).batch(3)

    want = [canon(b) for b in build(grain, their_ds)]
    it = iter(build(pg, our_ds))
    states = [it.get_state()] + [it.get_state() for _ in it]
    assert rest_after(build(pg, our_ds), states[0]) == want
    assert states[1]["steps"] == {"0.LinesDataset": {"file": "gs://bucket/a.txt", "i": 3}}
    for k, state in enumerate(states):
        assert rest_after(build(pg, our_ds), json.loads(json.dumps(state))) == want[k:]
