"""Packed rows are served in a keyed random order per window, not in the packer's (length-sorted) order.

Each statistical check runs on the loader's plan and, as a control that shows the check can fail, on
the same plan served in the packer's creation order (the stream before this order existed).
"""

import numpy as np
import pytest
from scipy import stats

import portable_loader as pl
from portable_loader.collate import pack
from portable_loader.plan import Cursor, Planner


class Lengths:
    """A source that only knows its records' lengths (the planner reads nothing else)."""

    def __init__(self, lengths):
        self._lengths = np.asarray(lengths, dtype=np.int64)

    def __len__(self):
        return self._lengths.size

    def __getitem__(self, i):
        return {"input_ids": np.zeros(int(self._lengths[i]), np.int32)}

    def lengths(self, indices):
        return self._lengths[np.asarray(indices)]


def long_tailed(n, seed=0):  # pretraining-like: lognormal, many records longer than seq_len
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(350), 1.3, n), 1, 30_000).astype(np.int64)


def narrow(n, seed=0):  # SFT-like: prompt + answer, a few hundred tokens
    rng = np.random.default_rng(seed)
    return np.clip(rng.normal(260, 70, n), 20, 1500).astype(np.int64)


DISTRIBUTIONS = {"long_tailed": long_tailed, "narrow": narrow}
KW = dict(global_batch_size=16, seq_len=2048, seed=3, packing=True, packing_window=1024, overlong="split")


class CreationOrder(Planner):
    """The plan as served before: each window's rows in the order the packer created them."""

    def row_key(self, w):
        return None  # the packer's order


def planned_steps(loader, planner_cls=Planner, steps=600):
    """Documents (pieces) per row of each global step: an array [steps, global_batch_size]."""
    p = loader.planner()
    planner = planner_cls(p.sampler, p.n, global_batch_size=p.batch, seq_len=p.seq_len, packing=True,
                          window=p.window, lengths=p._lengths, overlong=p.overlong)
    out, cur = [], Cursor(0, 0, 0)
    for _ in range(steps):
        rows, cur = planner.step(cur)
        out.append([len(r) for r in rows])
    return np.array(out)


def served_windows(loader, planner_cls=Planner, windows=50):
    """Documents per row of each window, in serving order (a list of arrays)."""
    p = loader.planner()
    planner = planner_cls(p.sampler, p.n, global_batch_size=p.batch, seq_len=p.seq_len, packing=True,
                          window=p.window, lengths=p._lengths, overlong=p.overlong)
    return [np.array([len(r) for r in planner.window_rows(w)]) for w in range(windows)]


def lag1(x):
    x = x - x.mean()
    return float((x[:-1] * x[1:]).sum() / (x * x).sum())


def place_vs_length(places, docs):
    return stats.spearmanr(np.concatenate(places), np.concatenate(docs)).statistic


def halves_pvalue(first, second):
    return stats.ks_2samp(np.concatenate(first), np.concatenate(second), method="asymp").pvalue


@pytest.fixture(scope="module", params=sorted(DISTRIBUTIONS))
def loaders(request):
    lengths = DISTRIBUTIONS[request.param](60_000)
    return {b: pl.DataLoader(Lengths(lengths), **{**KW, "global_batch_size": b}) for b in (8, 64)}


@pytest.mark.slow
def test_per_step_documents_per_row_have_no_positive_lag1_autocorrelation(loaders):
    # 8 rows a step: a window lasts 16 to 50 steps, over which the packer's order climbs from
    # few documents per row to many (the control), then starts again.
    assert lag1(planned_steps(loaders[8], CreationOrder).mean(axis=1)) > 0.5
    for loader in loaders.values():
        assert lag1(planned_steps(loader).mean(axis=1)) < 0.1


@pytest.mark.slow
def test_a_rows_place_does_not_predict_its_length(loaders):
    # Where a batch lines up with a window, its place in the batch is its place in the window.
    for planner_cls, check in ((CreationOrder, lambda rho: rho > 0.8), (Planner, lambda rho: abs(rho) < 0.04)):
        docs = served_windows(loaders[64], planner_cls)
        assert check(place_vs_length([np.arange(d.size) / d.size for d in docs], docs)), planner_cls
    # And in the batches served.
    steps = planned_steps(loaders[64], steps=300)
    assert abs(place_vs_length([np.arange(64)] * len(steps), list(steps))) < 0.04


@pytest.mark.slow
def test_two_hosts_rows_have_the_same_length_distribution(loaders):
    # Host k of 2 takes rows [32k, 32k + 32) of each 64-row batch; where a batch lines up with a
    # window, that is the window's first or second half.
    before = served_windows(loaders[64], CreationOrder)
    assert halves_pvalue([d[: d.size // 2] for d in before], [d[d.size // 2 :] for d in before]) < 1e-6
    ours = served_windows(loaders[64])
    assert halves_pvalue([d[: d.size // 2] for d in ours], [d[d.size // 2 :] for d in ours]) > 0.01
    steps = planned_steps(loaders[64], steps=300)
    assert halves_pvalue([steps[:, :32].ravel()], [steps[:, 32:].ravel()]) > 0.01


@pytest.mark.parametrize("dist", sorted(DISTRIBUTIONS))
def test_order_is_a_keyed_permutation_of_the_packers_rows(dist):
    lengths = DISTRIBUTIONS[dist](5000, seed=1)
    planner = pl.DataLoader(Lengths(lengths), **KW).planner()
    orders = []
    for w in range(4):
        recs = planner._window_records(w)
        created = pack(recs, lengths[recs], 2048)
        served = planner.window_rows(w)
        # The same rows (so the same packing efficiency), in another order.
        assert sorted(served) == sorted(created) and served != created
        orders.append([created.index(r) for r in served])
    assert len({tuple(o) for o in orders}) == 4  # a fresh order per window
    # A pure function of (seed, window): another batch size or host count serves the same rows.
    other = pl.DataLoader(Lengths(lengths), **{**KW, "global_batch_size": 48}).with_shard(1, 3).planner()
    assert [other.window_rows(w) for w in range(4)] == [planner.window_rows(w) for w in range(4)]
    reseeded = pl.DataLoader(Lengths(lengths), **{**KW, "seed": 4}).planner()
    assert reseeded.window_rows(0) != planner.window_rows(0)


def test_unshuffled_loader_keeps_the_packers_order():
    lengths = narrow(3000)
    planner = pl.DataLoader(Lengths(lengths), **{**KW, "shuffle": False}).planner()
    recs = planner._window_records(1)
    assert planner.window_rows(1) == pack(recs, lengths[recs], 2048)
