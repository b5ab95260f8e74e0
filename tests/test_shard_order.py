"""``shuffle="shards"``: every epoch visits each record once, a group reads only K shards, exact resume,
worker and host independence, its place in the fingerprint, and clear errors."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import portable_loader as pl
from portable_loader.dataset import Dataset
from portable_loader.orders.shard_order import ShardShuffle
from portable_loader.errors import StateError

shard_rows = st.lists(st.integers(0, 25), min_size=1, max_size=24).filter(lambda r: sum(r) > 0)


def owner(rows):
    """Record index -> its shard, computed by listing (the oracle's own way)."""
    return np.repeat(np.arange(len(rows)), rows)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(rows=shard_rows, k=st.integers(1, 6), seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 5))
def test_each_epoch_is_a_permutation_grouped_k_shards_at_a_time(rows, k, seed, epoch):
    order = ShardShuffle(rows, k, seed)
    n = sum(rows)
    recs = order.stream_indices(np.arange(epoch * n, (epoch + 1) * n))
    assert sorted(recs.tolist()) == list(range(n))
    # Walk the stream: it is groups of k consecutive shards of one shard permutation, each group's
    # records together (all of them, none of another shard).
    shards_seen = owner(rows)[recs]
    perm = order.layout(epoch)[0].tolist()
    assert sorted(perm) == list(range(len(rows)))
    pos = 0
    for g in range(0, len(rows), k):
        group = perm[g : g + k]
        size = sum(rows[s] for s in group)
        assert set(shards_seen[pos : pos + size].tolist()) == {s for s in group if rows[s]}
        pos += size
    assert pos == n
    # Random access agrees with the whole epoch, in any order and across epochs.
    pick = np.random.default_rng(seed % 1000).integers(0, 2 * n, size=min(50, 2 * n)) + epoch * n
    whole = order.stream_indices(np.arange(epoch * n, (epoch + 2) * n))
    assert order.stream_indices(pick).tolist() == whole[pick - epoch * n].tolist()


def test_epochs_and_seeds_give_other_orders():
    rows = [40] * 10
    a = ShardShuffle(rows, 2, seed=1)
    one, two = a.stream_indices(range(400)), a.stream_indices(range(400, 800))
    assert sorted(one.tolist()) == sorted(two.tolist()) and not np.array_equal(one, two)
    assert not np.array_equal(one, ShardShuffle(rows, 2, seed=2).stream_indices(range(400)))
    assert a.layout(0)[0].tolist() != a.layout(1)[0].tolist()  # shards permuted per epoch too


class Sharded(Dataset):
    """Records of known lengths in shards: any sharded source, not only a cache."""

    def __init__(self, rows, seed=0):
        self.rows = list(rows)
        self._lengths = np.random.default_rng(seed).integers(1, 40, size=sum(rows))

    def __len__(self):
        return len(self._lengths)

    @property
    def shard_rows(self):
        return self.rows

    def __getitems__(self, indices):
        return [{"input_ids": np.arange(int(self._lengths[i]), dtype=np.int32) + 1000 * int(i)} for i in indices]

    def lengths(self, indices):
        return self._lengths[np.asarray(indices, dtype=np.int64)]

    def _identity(self):
        return (self.rows, self._lengths)


def batches(loader, state=None, steps=None):
    it = iter(loader)
    if state is not None:
        it.set_state(state)
    out = []
    with it:
        for b in it:
            out.append(b)
            if steps is not None and len(out) == steps:
                return out, it.get_state()
    return out, None


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert all(np.array_equal(x[k], y[k]) for k in x)


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.integers(1, 30), min_size=2, max_size=12), k=st.integers(1, 4), packing=st.booleans(),
       stop=st.integers(1, 30), seed=st.integers(0, 2**32))
def test_resume_anywhere_gives_the_rest_of_the_stream(rows, k, packing, stop, seed):
    loader = pl.DataLoader(Sharded(rows), global_batch_size=4, seq_len=32, seed=seed, packing=packing,
                           packing_window=16, shuffle="shards", shuffle_shards=k, num_epochs=2, prefetch=0)
    whole, _ = batches(loader)
    assume(len(whole) >= 2)
    stop = min(stop, len(whole) - 1)
    head, state = batches(loader, steps=stop)
    same(head, whole[:stop])
    same(batches(loader, state=state)[0], whole[stop:])


def test_worker_and_host_independent():
    src = Sharded([17, 5, 30, 22, 9, 14])
    config = dict(global_batch_size=4, seq_len=32, seed=7, shuffle="shards", shuffle_shards=2, num_epochs=2)
    base = pl.DataLoader(src, prefetch=0, **config)
    want, _ = batches(base)
    same(batches(pl.DataLoader(src, num_workers=2, **config))[0], want)
    hosts = [batches(base.with_shard(i, 2))[0] for i in range(2)]
    for full, h0, h1 in zip(want, *hosts):
        assert all(np.array_equal(full[k], np.concatenate([h0[k], h1[k]])) for k in full)


def test_fingerprint_and_states_tell_the_orders_apart():
    src = Sharded([10, 10, 10])
    make = lambda **kw: pl.DataLoader(src, global_batch_size=2, seq_len=16, **kw)  # noqa: E731
    prints = {make().fingerprint, make(shuffle="shards", shuffle_shards=2).fingerprint,
              make(shuffle="shards", shuffle_shards=3).fingerprint, make(shuffle=False).fingerprint}
    assert len(prints) == 4
    assert "shuffle_shards" not in make().config  # other configs keep the fingerprints they had
    it = iter(make(shuffle="shards", shuffle_shards=2))
    next(it)
    with pytest.raises(StateError):
        iter(make(shuffle="shards", shuffle_shards=3)).set_state(it.get_state())


def test_errors_are_named():
    with pytest.raises(ValueError, match="needs shuffle_shards, an integer >= 1"):
        pl.DataLoader(Sharded([3, 3]), global_batch_size=2, seq_len=8, shuffle="shards")
    with pytest.raises(ValueError, match="needs a sharded source .* got Records"):
        pl.DataLoader([{"input_ids": [1]}] * 4, global_batch_size=2, seq_len=8, shuffle="shards", shuffle_shards=2)
    with pytest.raises(ValueError, match="shuffle_shards=2 needs shuffle='shards'"):
        pl.DataLoader(Sharded([3, 3]), global_batch_size=2, seq_len=8, shuffle_shards=2)
    with pytest.raises(ValueError, match="shuffle must be True, False or 'shards', got 'global'"):
        pl.DataLoader(Sharded([3, 3]), global_batch_size=2, seq_len=8, shuffle="global")
