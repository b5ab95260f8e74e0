"""``grain.experimental.ElasticIterator`` (portable_loader/grain/elastic.py) against real Grain.

Oracle: Grain 0.2.18's ``ElasticIterator`` over the same unshuffled ``MapDataset``: every shard's
batches must be equal, end included. On top, what its docstring promises and Grain's tests check:
any shard's state restores every shard of another count and global batch size, which continue the
same global stream (checked batch by batch against the unsharded stream, nothing dropped or
repeated), and pipelines Grain refuses (a filter, packing) work, with exact resume.
"""

from __future__ import annotations

import json
from collections import Counter

import grain
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from portable_loader import grain as pg
from portable_loader.errors import StateError

SETTINGS = dict(derandomize=True, deadline=None, max_examples=100)


def elastic(ds, g, k, count, **kw):
    return pg.experimental.ElasticIterator(ds, g, pg.sharding.ShardOptions(k, count), **kw)


def plain():
    return pg.MapDataset.range(50).map(lambda x: x * 3)


def filtered():  # Grain refuses it
    return pg.MapDataset.range(60).shuffle(seed=1).filter(lambda x: x % 3 != 0).map(lambda x: x * 2)


def packed():  # Grain refuses it: not a MapDataset
    docs = pg.MapDataset.range(40).map(lambda n: {"ids": np.arange(n % 7 + 1, dtype=np.int32) + n})
    return pg.experimental.FirstFitPackIterDataset(docs.to_iter_dataset(), length_struct={"ids": 8},
                                                   num_packing_bins=3, seed=2)


def rows(batches) -> list:
    """The elements of a list of batches, one by one, in a comparable form."""
    out = []
    for b in batches:
        if isinstance(b, dict):
            out.extend(json.dumps({k: v[i].tolist() for k, v in sorted(b.items())}) for i in range(len(b["ids"])))
        else:
            out.extend(np.asarray(b).tolist())
    return out


# --- equal to Grain -----------------------------------------------------------------------------


@pytest.mark.slow
@settings(**SETTINGS)
@given(st.integers(0, 30), st.integers(1, 4), st.integers(1, 4), st.data())
def test_every_shards_batches_equal_grains(n, count, per_shard, data):
    k = data.draw(st.integers(0, count - 1))
    g = count * per_shard
    expected = [b.tolist() for b in grain.experimental.ElasticIterator(
        grain.MapDataset.range(n).map(lambda x: x + 1), g, grain.sharding.ShardOptions(k, count))]
    ours = elastic(pg.MapDataset.range(n).map(lambda x: x + 1), g, k, count)
    assert [b.tolist() for b in ours] == expected
    # The general way (every shard reads the whole stream) gives the same on what both take.
    stream = elastic(pg.MapDataset.range(n).map(lambda x: x + 1).to_iter_dataset(), g, k, count)
    assert [b.tolist() for b in stream] == expected


def test_grains_own_test_cases_and_worker_processes_change_nothing():
    ds = pg.MapDataset.range(10).map(lambda x: x + 1)
    assert [b.tolist() for b in pg.experimental.ElasticIterator(ds, 5, pg.sharding.NoSharding())] == \
        [list(range(1, 6)), list(range(6, 11))]
    assert [b.tolist() for b in elastic(ds, 8, 2, 4)] == [[3, 7]]
    workers = pg.MultiprocessingOptions(num_workers=2)
    it = elastic(ds, 2, 0, 2, multiprocessing_options=workers)
    assert [b.tolist() for b in it] == [[1], [3], [5], [7], [9]]
    it.close()
    it = elastic(filtered(), 4, 1, 2, multiprocessing_options=workers)
    assert rows(it) == rows(elastic(filtered(), 4, 1, 2))
    it.close()


def test_grain_refuses_what_ours_takes_and_both_check_the_batch_size():
    with pytest.raises(ValueError, match="does not support `filter`"):
        grain.experimental.ElasticIterator(grain.MapDataset.range(9).filter(lambda x: x % 2), 2,
                                           grain.sharding.NoSharding())
    assert [b.tolist() for b in elastic(pg.MapDataset.range(9).filter(lambda x: x % 2), 2, 0, 1)] == [[1, 3], [5, 7]]
    with pytest.raises(ValueError, match="Global batch size 5 is not divisible by shard count 2"):
        elastic(plain(), 5, 0, 2)


# --- elastic resume ---------------------------------------------------------------------------------


def make_elastic(make, g, k, count):
    return elastic(make(), g, k, count, read_options=pg.ReadOptions(num_threads=0))


def shares(stream: list, g: int, k: int, count: int) -> list:
    """Shard ``k`` of ``count``'s batches of ``stream`` cut into global batches of ``g``: Grain's rule,
    the elements at offsets ``k, k + count, ...`` of each, where that share is whole."""
    cut = [stream[i:i + g] for i in range(0, len(stream), g)]
    return [b[k::count] for b in cut if len(b[k::count]) == g // count]


@pytest.mark.parametrize("make", [plain, filtered, packed], ids=["map", "filter", "pack"])
@pytest.mark.parametrize("after, g_after", [(1, 3), (4, 8), (4, 4)])
def test_a_state_saved_on_2_shards_continues_the_global_stream_on_1_and_4(make, after, g_after):
    stream = rows(make_elastic(make, 1, 0, 1))  # the global stream, element by element
    steps = 3
    before = [make_elastic(make, 4, k, 2) for k in range(2)]
    seen = [[rows([next(it)]) for _ in range(steps)] for it in before]
    states = [json.loads(json.dumps(it.get_state())) for it in before]
    assert states[0] == states[1]  # any shard's state serves all
    assert len(json.dumps(states[0])) < 500
    assert seen == [shares(stream, 4, k, 2)[:steps] for k in range(2)]

    rest = stream[4 * steps:]
    shards = [make_elastic(make, g_after, k, after) for k in range(after)]
    for it in shards:
        it.set_state(states[0])
    got = [[rows([b]) for b in it] for it in shards]
    assert got == [shares(rest, g_after, k, after) for k in range(after)]
    # Nothing dropped or repeated: every whole global batch was served once, by the shards together.
    served = Counter(x for shard in seen + got for b in shard for x in b)
    whole = 4 * steps + len(rest) // g_after * g_after
    assert served - Counter(stream) == Counter()
    assert Counter(stream[:whole]) - served == Counter()


@pytest.mark.parametrize("make", [plain, filtered, packed], ids=["map", "filter", "pack"])
def test_exact_resume_after_every_step_through_json_and_refusal_of_other_states(make):
    it = make_elastic(make, 4, 1, 2)
    states, batches = [it.get_state()], []
    for b in it:
        batches.append(rows([b]))
        states.append(json.loads(json.dumps(it.get_state())))
    assert len({len(json.dumps(s)) for s in states}) == 1
    for i, state in enumerate(states):
        again = make_elastic(make, 4, 1, 2)
        again.set_state(state)
        assert [rows([b]) for b in again] == batches[i:]
    with pytest.raises(StateError, match="pipeline"):
        make_elastic(lambda: pg.MapDataset.range(51), 4, 1, 2).set_state(states[1])
    with pytest.raises(StateError):
        make_elastic(make, 4, 1, 2).set_state({"global_next_index": 4})  # Grain's own: not a position of ours


def test_iter_returns_the_one_iterator_and_get_state_on_the_dataset_acts_on_it():
    it = elastic(plain(), 4, 0, 2)
    assert iter(it) is iter(it)
    next(iter(it))
    assert it.get_state() == iter(it).get_state()
    assert next(it).tolist() == [12, 18]  # global batch 2: elements 4..7, shard 0: offsets 0 and 2
    it.close()
