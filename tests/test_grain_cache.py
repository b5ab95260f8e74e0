"""grain.experimental.CacheIterDataset against real Grain 0.2.18: the same elements through
repeats and batches, the parent read once across passes, and a position state that resumes at
every step, in the same iterator (from memory) and in a new one (rebuilt from the parent)."""

import grain
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_loader import grain as pg
from portable_loader.errors import StateError


def _pipeline(g, n, epochs, batch, reads):
    def count(x):
        reads.append(x)
        return x * 10

    ds = g.experimental.CacheIterDataset(g.MapDataset.range(n).to_iter_dataset().map(count).filter(lambda v: v % 30))
    return g.experimental.RepeatIterDataset(ds, num_epochs=epochs).batch(batch)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 12), epochs=st.integers(1, 3), batch=st.integers(1, 4))
def test_elements_and_reads_equal_grains_and_every_state_resumes_from_memory_or_rebuilt(n, epochs, batch):
    real_reads, our_reads = [], []
    want = [b.tolist() for b in _pipeline(grain, n, epochs, batch, real_reads)]
    it = iter(_pipeline(pg, n, epochs, batch, our_reads))
    states, got = [it.get_state()], []
    for b in it:
        got.append(b.tolist())
        states.append(it.get_state())
    assert got == want and our_reads == real_reads == list(range(n))
    for k, state in enumerate(states):
        fresh = iter(_pipeline(pg, n, epochs, batch, []))
        fresh.set_state(state)
        assert [b.tolist() for b in fresh] == want[k:]
        it.set_state(state)                       # the same iterator: its cache serves
        assert [b.tolist() for b in it] == want[k:]


def test_a_cache_state_with_an_edited_filled_flag_is_refused():
    it = iter(pg.experimental.CacheIterDataset(pg.MapDataset.range(3).to_iter_dataset()))
    next(it)
    state = it.get_state()
    state["cursor"]["1.cache.filled"] = "%020d" % 2
    with pytest.raises(StateError):
        it.set_state(state)
