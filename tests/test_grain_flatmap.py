"""FlatMap (portable_loader/dataset/flat_map.py, iter_flat_map.py, and in the DataLoader) against real Grain.

Oracle: Grain 0.2.18's ``grain.experimental.FlatMapMapDataset`` / ``FlatMapIterDataset`` and its
``DataLoader`` with a ``FlatMapTransform``, all deterministic (no shuffle, no sharding, no
workers), so elements must be equal: every slot of the ``MapDataset`` version (value, hole or
the same error), every piece of the ``IterDataset`` version, every batch of the ``DataLoader``.
On top, what Grain's state lacks: a small JSON position that resumes exactly after any element,
inside a record's pieces too, at another worker count, and is refused elsewhere.
"""

from __future__ import annotations

import json

import grain
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from portable_loader import grain as pg
from portable_loader.errors import StateError

SETTINGS = dict(derandomize=True, deadline=None, max_examples=150)


class Pieces(grain.experimental.FlatMapTransform):
    """Record ``x`` splits into ``counts[x % len(counts)]`` pieces ``100 * x + j`` (a real Grain transform)."""

    def __init__(self, max_fan_out: int, counts: tuple):
        self.max_fan_out, self.counts = max_fan_out, counts

    def flat_map(self, x):
        return [100 * int(x) + j for j in range(self.counts[int(x) % len(self.counts)])]


class OurPieces(pg.transforms.FlatMap):
    """The same, subclassing ours; returns a generator, which Grain's flat maps may."""

    def __init__(self, max_fan_out: int, counts: tuple):
        self.max_fan_out, self.counts = max_fan_out, counts

    def flat_map(self, x):
        return (100 * int(x) + j for j in range(self.counts[int(x) % len(self.counts)]))


class Plus1(grain.transforms.Map):
    def map(self, x):
        return x + 1


def slot(ds, i):
    try:
        v = ds[i]
    except Exception as e:  # noqa: BLE001 - compared with the oracle's
        return ("error", type(e).__name__)
    return None if v is None else int(v)


def outcome(it) -> tuple[list, str | None]:
    out = []
    try:
        for x in it:
            out.append(np.asarray(x).tolist())
    except Exception as e:  # noqa: BLE001 - compared with the oracle's
        return out, type(e).__name__
    return out, None


@st.composite
def case(draw, overflow: bool = False):
    n = draw(st.integers(0, 12))
    fan_out = draw(st.integers(1, 4))
    counts = tuple(draw(st.lists(st.integers(0, fan_out + (1 if overflow else 0)), min_size=1, max_size=5)))
    return n, fan_out, counts


def loader(G, n, ops, **kw):
    n = max(n, 1)  # samplers need a record
    return G.DataLoader(data_source=list(range(n)),
                        sampler=G.samplers.IndexSampler(n, shard_options=G.sharding.NoSharding(), num_epochs=1),
                        operations=ops, **kw)


# --- equal to Grain -----------------------------------------------------------------------------


@pytest.mark.slow
@settings(**SETTINGS)
@given(case(overflow=True))
def test_map_dataset_flat_map_equals_grains_slots_length_and_errors(c):
    n, fan_out, counts = c
    g = grain.experimental.FlatMapMapDataset(grain.MapDataset.range(n).map(Plus1()), Pieces(fan_out, counts))
    for transform in (Pieces(fan_out, counts), OurPieces(fan_out, counts)):
        ours = pg.experimental.FlatMapMapDataset(pg.MapDataset.range(n).map(Plus1()), transform)
        assert len(ours) == len(g) == n * fan_out
        assert [slot(ours, i) for i in range(len(g))] == [slot(g, i) for i in range(len(g))]
    assert [slot(ours, i) for i in range(len(ours))] == [slot(ours[i:i + 1], 0) for i in range(len(ours))]


@pytest.mark.slow
@settings(**SETTINGS)
@given(case())
def test_map_dataset_flat_map_iterates_as_grains_and_through_apply(c):
    n, fan_out, counts = c
    g = grain.experimental.FlatMapMapDataset(grain.MapDataset.range(n), Pieces(fan_out, counts))
    expected = outcome(g)
    assert outcome(pg.experimental.FlatMapMapDataset(pg.MapDataset.range(n), Pieces(fan_out, counts))) == expected
    assert outcome(pg.MapDataset.range(n).apply([Pieces(fan_out, counts)])) == expected
    assert outcome(pg.MapDataset.range(n).apply([OurPieces(fan_out, counts)]).to_iter_dataset()) == expected
    assert outcome(pg.experimental.apply_transformations(pg.MapDataset.range(n), Pieces(fan_out, counts))) == expected


@pytest.mark.slow
@settings(**SETTINGS)
@given(case(overflow=True), st.integers(1, 4))
def test_iter_dataset_flat_map_yields_every_piece_as_grains_with_a_batch_after_it(c, batch):
    n, fan_out, counts = c
    g = grain.experimental.FlatMapIterDataset(grain.MapDataset.range(n).to_iter_dataset(), Pieces(fan_out, counts))
    ours = pg.experimental.FlatMapIterDataset(pg.MapDataset.range(n).to_iter_dataset(), OurPieces(fan_out, counts))
    assert outcome(ours) == outcome(g)
    assert outcome(ours.batch(batch)) == outcome(g.batch(batch))
    via_apply = pg.MapDataset.range(n).to_iter_dataset().apply([Pieces(fan_out, counts), pg.transforms.Batch(batch)])
    assert outcome(via_apply) == outcome(g.batch(batch))


@pytest.mark.slow
@settings(**SETTINGS)
@given(case(overflow=True), st.integers(1, 3))
def test_data_loader_flat_map_equals_grains_data_loader(c, batch):
    n, fan_out, counts = c
    ops = [Plus1(), Pieces(fan_out, counts), Plus1(), grain.transforms.Batch(batch)]
    expected = outcome(loader(grain, n, ops))
    assert outcome(loader(pg, n, ops)) == expected
    assert outcome(loader(pg, n, [Plus1(), OurPieces(fan_out, counts), Plus1(), pg.transforms.Batch(batch)])) == expected


class Indexed(grain.experimental.FlatMapTransform):
    max_fan_out = 3

    def flat_map(self, x):
        return ["a", "b"][: x % 3]


def test_data_loader_gives_pieces_grains_index_position_times_fan_out_plus_piece():
    class Where(pg.transforms.MapWithIndex):  # Grain's DataLoader refuses MapWithIndex; the index is its metadata's
        def map_with_index(self, i, x):
            return f"{x}{i}"

    got = list(loader(pg, 4, [Indexed(), Where()]))
    assert got == ["a3", "a6", "b7"]  # record 1 at 1 * 3 + 0, record 2 at 2 * 3 + 0 and + 1


def test_hand_cases_fan_out_overflow_holes_and_batch_refusal_as_grain():
    t = Pieces(2, (3,))
    for G in (grain, pg):
        ds = G.experimental.FlatMapMapDataset(G.MapDataset.range(3), t)
        with pytest.raises(ValueError, match="exceeds specified max fan-out"):
            ds[0]
        ok = G.experimental.FlatMapMapDataset(G.MapDataset.range(3), Pieces(2, (1, 2, 0)))
        assert [ok[i] for i in range(6)] == [0, None, 100, 101, None, None]
        with pytest.raises(ValueError, match="can not follow"):
            ok.batch(2)  # holes would make batches short: iterate first, as Grain says
    endless = pg.experimental.FlatMapMapDataset(pg.MapDataset.range(3).repeat(), Pieces(2, (1,)))
    assert len(endless) == len(grain.experimental.FlatMapMapDataset(grain.MapDataset.range(3).repeat(),
                                                                    Pieces(2, (1,))))
    with pytest.raises(ValueError, match="max_fan_out must be a positive integer"):
        pg.experimental.FlatMapMapDataset(pg.MapDataset.range(3), Pieces(0, (1,)))
    with pytest.raises(TypeError, match="FlatMap transform"):
        pg.experimental.FlatMapIterDataset(pg.MapDataset.range(3).to_iter_dataset(), len)


def test_a_flat_map_map_dataset_is_a_filter_for_everything_that_skips_holes():
    ds = pg.experimental.FlatMapMapDataset(pg.MapDataset.range(4), Pieces(3, (0, 1, 3)))
    assert ds.accepts(range(12)).tolist() == [False] * 3 + [True, False, False] + [True] * 3 + [False] * 3
    assert list(ds.to_iter_dataset()) == list(ds) == [100, 200, 201, 202]
    assert ds.fingerprint() != pg.experimental.FlatMapMapDataset(pg.MapDataset.range(4), Pieces(3, (0, 1, 2))).fingerprint()


# --- exact resume ---------------------------------------------------------------------------------


def assert_resumes(make, k: int):
    """The state after ``k`` elements, through JSON, continues with exactly the rest, in a new iterator."""
    with iter(make()) as it:
        head = [next(it) for _ in range(k)]
        state = it.get_state()
        state = state if isinstance(state, bytes) else json.loads(json.dumps(state))  # a DataLoader's: JSON bytes
        rest = outcome(it)
    with iter(make()) as again:
        again.set_state(state)
        assert outcome(again) == rest
    return head, state


@pytest.mark.slow
@settings(**SETTINGS)
@given(case(), st.integers(1, 3), st.data())
def test_iter_flat_map_resumes_exactly_after_any_element_inside_a_record_too(c, batch, data):
    n, fan_out, counts = c
    make = lambda: (pg.MapDataset.range(n).to_iter_dataset().filter(lambda x: x % 5 != 4)  # noqa: E731
                    .apply([Pieces(fan_out, counts), Plus1()]).batch(batch))
    total = len(list(make()))
    assert_resumes(make, data.draw(st.integers(0, total)))


@pytest.mark.slow
@settings(**SETTINGS)
@given(case(), st.integers(1, 3), st.data())
def test_data_loader_with_flat_maps_resumes_exactly_after_any_batch(c, batch, data):
    n, fan_out, counts = c
    ops = [Pieces(fan_out, counts), Plus1(), OurPieces(2, (1, 2)), pg.transforms.Batch(batch)]
    total = len(list(loader(pg, n, ops)))
    assert_resumes(lambda: loader(pg, n, ops), data.draw(st.integers(0, total)))


@pytest.mark.slow
def test_state_is_a_small_position_resumes_at_another_worker_count_and_is_refused_elsewhere():
    ops = [Pieces(4, (4,)), pg.transforms.Batch(3)]  # 4 pieces per record, batches of 3: states inside records
    with iter(loader(pg, 40, ops)) as it:
        sizes = set()
        for _ in range(5):
            next(it)
            sizes.add(len(it.get_state()))
        state = it.get_state()
        rest = [b.tolist() for b in it]
    assert len(sizes) == 1 and sizes.pop() < 600
    assert json.loads(state)["pieces"] == ["%020d" % 3]  # 15 pieces out: record 3's first 3
    with iter(loader(pg, 40, ops, worker_count=2)) as it:
        it.set_state(state)
        assert [b.tolist() for b in it] == rest
    other = pg.DataLoader(data_source=list(range(40)), sampler=pg.samplers.IndexSampler(40, num_epochs=1),
                          operations=ops, shard_options=pg.sharding.ShardOptions(1, 2))
    with iter(other) as it, pytest.raises(StateError, match="shard"):
        it.set_state(state)  # those pieces belong to shard 0's record
    with iter(loader(pg, 40, [Pieces(4, (3,)), pg.transforms.Batch(3)])) as it, pytest.raises(StateError, match="pipeline"):
        it.set_state(state)
    with iter(loader(pg, 40, [pg.transforms.Batch(3)])) as it, pytest.raises(StateError):
        it.set_state(state)


def test_iter_flat_map_state_names_the_parent_position_and_the_piece():
    ds = pg.experimental.FlatMapIterDataset(pg.MapDataset.range(5).to_iter_dataset(), Pieces(3, (3,)))
    with iter(ds) as it:
        for _ in range(4):
            next(it)
        cursor = {k: int(v) for k, v in it.get_state()["cursor"].items()}
        assert cursor == {"0.source.position": 1, "1.flat_map.index": 1}
        for _ in range(2):
            next(it)
        assert {k: int(v) for k, v in it.get_state()["cursor"].items()} == {"0.source.position": 2,
                                                                           "1.flat_map.index": 0}
        bad = iter(pg.experimental.FlatMapIterDataset(pg.MapDataset.range(5).to_iter_dataset(), Pieces(3, (1,))))
        state = it.get_state()
    with iter(ds.mp_prefetch(pg.MultiprocessingOptions(num_workers=2))) as again:
        again.set_state(state)
        assert list(again) == [200, 201, 202, 300, 301, 302, 400, 401, 402]
    with pytest.raises(StateError, match="pipeline"):
        bad.set_state(state)
    bad.close()
