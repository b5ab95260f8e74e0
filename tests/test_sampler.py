"""LCGSampler: bijection, determinism, shuffle quality, sharding, Grain protocol, argument errors."""

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_loader import LCGSampler
from portable_loader.errors import PositionOutOfRange

M64 = (1 << 64) - 1


def assert_permutation(values: np.ndarray, n: int) -> None:
    assert values.dtype == np.int64
    assert values.shape == (n,)
    counts = np.bincount(values, minlength=n)
    assert counts.size == n, f"value >= {n}"
    assert (counts == 1).all(), f"not a bijection of range({n})"


# --- an independent reference: the documented algorithm on Python integers, one value at a time ---


def _sm64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def reference_index(n, seed, epoch, pos, rounds=4):
    bits = (n - 1).bit_length()
    mask = (1 << bits) - 1
    state = _sm64(seed ^ _sm64(epoch ^ 0x5EED0FE90C))
    draws = []
    for _ in range(2 + 2 * rounds):
        state = _sm64(state)
        draws.append(state)
    shift = max(1, (bits + 1) // 2)

    def f(x):
        x = ((x ^ (draws[0] & mask)) * (draws[1] | 1)) & mask
        for r in range(rounds):
            a = (draws[2 + 2 * r] & ~3) | 1
            c = draws[3 + 2 * r] | 1
            x = (a * x + c) & mask
            x ^= x >> shift
        return x

    y = f(pos)
    while y >= n:
        y = f(y)
    return y


@settings(max_examples=200, deadline=None)
@given(
    n=st.one_of(st.integers(1, 5000), st.integers(1, 10**15)),
    seed=st.integers(0, M64),
    epoch=st.integers(0, 10**6),
    data=st.data(),
)
def test_matches_scalar_reference(n, seed, epoch, data):
    positions = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=40))
    got = LCGSampler(n, seed=seed).record_indices(positions, epoch=epoch)
    assert got.tolist() == [reference_index(n, seed, epoch, p) for p in positions]


def test_order_is_stable_across_versions_and_machines():
    # Changing these values changes every resumed run's data order: bump the state version if so.
    got = LCGSampler(1000, seed=0).record_indices(range(8), epoch=0).tolist()
    assert got == [reference_index(1000, 0, 0, p) for p in range(8)]
    assert got == [859, 283, 58, 438, 310, 933, 804, 775]


# --- bijection -------------------------------------------------------------------------------


@pytest.mark.slow
def test_bijection_every_small_n():
    for n in range(1, 3001):
        s = LCGSampler(n, seed=n * 7919)
        assert_permutation(s.record_indices(np.arange(n), epoch=n % 5), n)


@pytest.mark.slow
@pytest.mark.parametrize("k", range(0, 25))
def test_bijection_around_powers_of_two(k):
    for n in {max(1, 2**k - 1), 2**k, 2**k + 1}:
        assert_permutation(LCGSampler(n, seed=k).record_indices(np.arange(n)), n)


@pytest.mark.parametrize("n", [65_537, 262_145])
def test_no_record_lost_where_grain_index_shuffle_loses_one(n):
    assert_permutation(LCGSampler(n, seed=3).record_indices(np.arange(n)), n)


@pytest.mark.slow
@pytest.mark.parametrize("n", [10**9 + 7, 2**40 + 1, 10**12, 2**62 + 3])
def test_large_n_sampled_injective_and_in_range(n):
    rng = np.random.default_rng(n % 1000)
    pos = np.unique(rng.integers(0, n, size=200_000, dtype=np.int64))
    pos = np.concatenate([pos, [0, n - 1]])
    pos = np.unique(pos)
    out = LCGSampler(n, seed=1).record_indices(pos)
    assert out.min() >= 0 and out.max() < n
    assert np.unique(out).size == pos.size


def test_huge_n_needs_no_memory():
    out = LCGSampler(10**12, seed=1).record_indices([0, 10**12 - 1])
    assert out.shape == (2,) and (out < 10**12).all() and out[0] != out[1]


# --- determinism and epochs -------------------------------------------------------------------


def test_orders_differ_by_epoch_and_seed_and_repeat_exactly():
    n = 10_000
    pos = np.arange(n)
    base = LCGSampler(n, seed=5).record_indices(pos, epoch=0)
    assert np.array_equal(base, LCGSampler(n, seed=5).record_indices(pos, epoch=0))
    others = [
        LCGSampler(n, seed=5).record_indices(pos, epoch=1),
        LCGSampler(n, seed=6).record_indices(pos, epoch=0),
        LCGSampler(n, seed=5).record_indices(pos, epoch=2),
    ]
    for other in others:
        # Two independent random permutations agree on about one position.
        assert (other == base).sum() < 20


@pytest.mark.parametrize("n,reachable", [(2, 2), (3, 6), (5, 120)])
def test_small_n_epochs_reach_every_order(n, reachable):
    orders = {tuple(LCGSampler(n, seed=0).record_indices(range(n), epoch=e)) for e in range(3000)}
    assert len(orders) == reachable


def test_shuffle_false_is_identity():
    s = LCGSampler(1000, seed=0, shuffle=False, num_epochs=2)
    assert s.record_indices(range(1000), epoch=1).tolist() == list(range(1000))
    assert s.stream_indices(range(2000)).tolist() == list(range(1000)) * 2


def test_infinite_stream_reshuffles_each_epoch():
    n = 257
    s = LCGSampler(n, seed=9)
    assert len(s) == sys.maxsize
    stream = s.stream_indices(np.arange(5 * n))
    epochs = stream.reshape(5, n)
    for e in range(5):
        assert_permutation(epochs[e], n)
        assert np.array_equal(epochs[e], s.record_indices(np.arange(n), epoch=e))
    assert len({tuple(e) for e in epochs.tolist()}) == 5


# --- shuffle quality against a real random permutation -----------------------------------------


def _ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    fa = np.searchsorted(a, grid, side="right") / a.size
    fb = np.searchsorted(b, grid, side="right") / b.size
    return float(np.abs(fa - fb).max())


def _quality(order: np.ndarray, reference: np.ndarray) -> dict:
    n = order.size
    positions = np.arange(n)
    parity = order & 1
    return {
        # For a permutation, values are their own ranks: Pearson on them is Spearman's rho.
        "rank_z": abs(np.corrcoef(positions, order)[0, 1]) * np.sqrt(n - 1),
        "parity_z": abs((parity[1:] == parity[:-1]).mean() - 0.5) * 2 * np.sqrt(n - 1),
        "gap_ks": _ks_statistic(np.abs(np.diff(order)), np.abs(np.diff(reference))),
    }


N_QUALITY = 10**6
# Two-sample KS critical value at alpha = 1e-4 for n = m = 1e6: 2.15 * sqrt(2 / n).
KS_LIMIT = 2.15 * np.sqrt(2 / N_QUALITY)


@pytest.fixture(scope="module")
def random_reference():
    return np.random.default_rng(12345).permutation(N_QUALITY)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shuffle_statistics_match_a_random_permutation(seed, random_reference):
    order = LCGSampler(N_QUALITY, seed=seed).record_indices(np.arange(N_QUALITY))
    q = _quality(order, random_reference)
    ref = _quality(np.random.default_rng(seed).permutation(N_QUALITY), random_reference)
    # z-scores of a real random permutation are |N(0,1)|: 4.5 is a 1-in-100,000 event.
    assert q["rank_z"] < 4.5, (q, ref)
    assert q["parity_z"] < 4.5, (q, ref)
    assert q["gap_ks"] < KS_LIMIT, (q, ref)


def test_quality_checks_catch_a_bare_lcg(random_reference):
    # The same checks on an unmixed power-of-two LCG (with cycle walking) must fail, or they prove nothing.
    m, a, c, x = 1 << 20, 1103515245 % (1 << 20), 12345, 7
    seq = np.empty(m, dtype=np.int64)
    for i in range(m):
        x = (a * x + c) % m
        seq[i] = x
    bare = seq[seq < N_QUALITY]
    q = _quality(bare, random_reference)
    assert q["parity_z"] > 100


# --- sharding ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), shard_count=st.integers(1, 9), seed=st.integers(0, 2**32), epoch=st.integers(0, 3))
def test_shards_are_disjoint_and_cover_each_epoch(n, shard_count, seed, epoch):
    full = LCGSampler(n, seed=seed).record_indices(np.arange(n), epoch=epoch)
    parts = []
    for k in range(shard_count):
        s = LCGSampler(n, seed=seed, shard_index=k, shard_count=shard_count, num_epochs=epoch + 1)
        length = s.shard_epoch_length
        mine = s.stream_indices(np.arange(epoch * length, (epoch + 1) * length))
        # Shard k holds global positions k, k + K, ... of the one global order.
        assert np.array_equal(mine, full[k::shard_count])
        parts.append(mine)
    assert sorted(np.concatenate(parts).tolist()) == list(range(n))


# --- Grain protocol ---------------------------------------------------------------------------


class _RangeSource:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.int64(i)


@pytest.mark.slow
@pytest.mark.parametrize("n,epochs", [(1, 1), (1000, 1), (513, 2)])
def test_grain_dataloader_sees_every_record_once_per_epoch(n, epochs):
    import grain.python as grain

    sampler = LCGSampler(n, seed=4, num_epochs=epochs)
    loader = grain.DataLoader(data_source=_RangeSource(n), sampler=sampler, worker_count=0)
    seen = np.array([int(x) for x in loader])
    assert seen.size == n * epochs
    for e in range(epochs):
        chunk = seen[e * n : (e + 1) * n]
        assert_permutation(chunk, n)
        assert np.array_equal(chunk, sampler.record_indices(np.arange(n), epoch=e))


def test_getitem_returns_grain_record_metadata():
    import grain.python as grain

    s = LCGSampler(50, seed=1, num_epochs=1)
    md = s[7]
    assert isinstance(md, grain.RecordMetadata)
    assert md.index == 7 and md.record_key == int(s.record_indices([7])[0])


# --- bad arguments ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"num_records": 0, "seed": 0}, "num_records"),
        ({"num_records": -3, "seed": 0}, "num_records"),
        ({"num_records": 2.5, "seed": 0}, "num_records"),
        ({"num_records": 10}, "seed"),
        ({"num_records": 10, "seed": None}, "seed"),
        ({"num_records": 10, "seed": 1.5}, "seed"),
        ({"num_records": 10, "seed": "1"}, "seed"),
        ({"num_records": 10, "seed": -1}, "seed"),
        ({"num_records": 10, "seed": 0, "shard_index": 2, "shard_count": 2}, "shard_index"),
        ({"num_records": 10, "seed": 0, "shard_index": -1}, "shard_index"),
        ({"num_records": 10, "seed": 0, "shard_count": 0}, "shard_count"),
        ({"num_records": 10, "seed": 0, "num_epochs": 0}, "num_epochs"),
    ],
)
def test_bad_constructor_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LCGSampler(**kwargs)


def test_position_past_end_of_finite_stream():
    s = LCGSampler(10, seed=0, num_epochs=2)
    assert len(s) == 20
    with pytest.raises(ValueError, match="index.*25"):
        s[25]
    with pytest.raises(IndexError):  # Grain reads until IndexError
        s[20]
    with pytest.raises(PositionOutOfRange):
        s.stream_indices([3, 20])
    with pytest.raises(ValueError, match="positions.*10"):
        s.record_indices([10])
    with pytest.raises(ValueError, match="epoch"):
        s.record_indices([1], epoch=2)
    with pytest.raises(ValueError, match="positions"):
        s.record_indices([1.5])


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 2**40), st.integers(0, 2**64 - 1), st.integers(0, 2**20))
def test_few_positions_in_python_integers_equal_the_numpy_path(n, seed, epoch):
    from portable_loader.orders.keyed import FEW, KeyedPermutation

    perm = KeyedPermutation(n, seed, epoch)
    pos = np.unique(np.random.default_rng(seed % 1000).integers(0, n, 4 * FEW, dtype=np.int64))
    vectorized = perm(pos.view(np.uint64))  # more than FEW: numpy
    assert [perm.one(x) for x in pos.tolist()] == vectorized.tolist()
    assert perm(pos[:3].view(np.uint64)).tolist() == vectorized[:3].tolist()
    s = LCGSampler(n, seed=seed % 2**32, shard_index=1 % max(1, min(n, 3)), shard_count=max(1, min(n, 3)))
    stream = np.random.default_rng(epoch).integers(0, min(len(s), 10**15), 3 * FEW)
    assert s.stream_indices(stream[:5]).tolist() == s.stream_indices(stream)[:5].tolist()


def test_every_stream_order_keeps_the_written_contract():
    # The planner takes the LCG sampler, a mixture's order and the shard-group order through one
    # interface (dataset/protocols.py): ``few`` must agree with ``stream_indices`` everywhere.
    import numpy as np

    import portable_loader as pl
    from portable_loader.dataset.protocols import StreamOrder
    from portable_loader.orders.shard_order import ShardShuffle
    from portable_loader.orders.sampler import LCGSampler

    a = [{"input_ids": np.arange(1 + i % 5)} for i in range(37)]
    b = [{"input_ids": np.arange(2)} for _ in range(11)]
    orders = [LCGSampler(37, seed=5, num_epochs=3), LCGSampler(37, seed=5, shuffle=False, num_epochs=3),
              ShardShuffle([10, 17, 10], group=2, seed=5, num_epochs=3),
              pl.mix({"a": a, "b": b}, {"a": 3, "b": 1}).stream_order(5, num_epochs=3)]
    rng = np.random.default_rng(0)
    for order in orders:
        assert isinstance(order, StreamOrder)
        positions = rng.integers(0, len(order), 40).tolist()
        assert order.few(positions) == order.stream_indices(np.array(positions)).tolist()
    assert [o.whole_epochs for o in orders] == [True, True, True, False]
