"""The Grain-style views keep the loader's contract: lengths, accepts, reopen, fingerprints, stream order.

Records carry their identity in their tokens (``tag * 1000 + record``), so what a ``DataLoader``
serves from a view is checked against the view's own records, read by index.
"""

import pickle
from collections import Counter

import numpy as np
import pytest

import portable_loader as pl
from portable_loader.dataset import Dataset
from portable_loader.precache import build_cache, sample_args


def recs(n, tag=1):
    lens = np.random.default_rng(tag).integers(1, 12, n)
    return [{"input_ids": np.full(int(k), tag * 1000 + r, np.int32)} for r, k in enumerate(lens)]


def ident(r):
    return int(r["input_ids"][0])


def odd(r):
    return ident(r) % 2 == 1


def plus_one(r):
    return {"input_ids": r["input_ids"] + 1}


def bos(r):
    return {"input_ids": np.concatenate([[1], r["input_ids"]]).astype(np.int32)}


def jitter(x, rng):
    return x + int(rng.integers(10))


def noise(r, rng):
    return {"input_ids": r["input_ids"][: 1 + int(rng.integers(len(r["input_ids"])))]}


def served(ds, **kw):
    """Every record a one-epoch padded loader serves, by its first token."""
    options = dict(global_batch_size=4, seq_len=16, num_epochs=1, seed=3, prefetch=0)
    out = []
    with iter(pl.DataLoader(ds, **{**options, **kw})) as it:
        for batch in it:
            out += [int(row[0]) for row, mask in zip(batch["input_ids"], batch["attention_mask"]) if mask[0]]
    return out


def records_of(ds):
    return [r for r in ds.__getitems__(list(range(len(ds)))) if r is not None]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # ArrayRecord: its readers are reopened in each worker, which is what reopen() must reach.
    out = str(tmp_path_factory.mktemp("cache"))
    return pl.open_cache(build_cache(**sample_args(), out=out, backend="array_record")[0])


# --- the loader over the views --------------------------------------------------------------------

PIPELINES = {
    "shuffle, slice, map": lambda: pl.source(recs(40)).shuffle(0).slice(slice(3, 35, 2)).map(plus_one),
    "filter below a shuffle and a slice": lambda: pl.source(recs(40)).filter(odd).shuffle(1)[::-3],
    "filter above a shuffle": lambda: pl.source(recs(40)).shuffle(2).filter(odd),
    "repeat": lambda: pl.source(recs(10)).repeat(3),
    "seeded random map": lambda: pl.source(recs(20)).seed(4).shuffle().random_map(noise),
    "mix of a filter": lambda: Dataset.mix([pl.source(recs(30, 1)).filter(odd), pl.source(recs(12, 2))], [2, 1]),
    "concatenate": lambda: Dataset.concatenate([pl.source(recs(5, 1)), pl.source(recs(7, 2)).filter(odd)]),
    "select": lambda: Dataset.select_from_datasets([pl.source(recs(5, 1)), pl.source(recs(5, 2))],
                                                   [(1, 4), (0, 0), (1, 4), (0, 3)]),
}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_loader_serves_the_views_records(name):
    ds = PIPELINES[name]()
    want = Counter(ident(r) for r in records_of(ds))
    assert Counter(served(ds)) == want and want


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_lengths_and_accepts_follow_the_index_arithmetic(name):
    ds = PIPELINES[name]()
    everything = ds.__getitems__(list(range(len(ds))))
    idx = np.arange(len(ds))[::-1]
    assert ds.accepts(idx).tolist() == [everything[i] is not None for i in idx]
    kept = [i for i in idx.tolist() if everything[i] is not None]
    assert ds.lengths(kept).tolist() == [len(everything[i]["input_ids"]) for i in kept]
    assert bool(ds.filters) == (None in everything or "filter" in name)


@pytest.mark.slow
def test_loader_over_a_cache_with_workers(cache):
    ds = pl.source(cache).shuffle(0).slice(slice(100, 1500, 7)).map(bos)
    assert ds.reopen().fingerprint() == ds.fingerprint() and ds.format == pl.source(cache).format
    want = Counter(tuple(np.asarray(r["input_ids"])[:8].tolist()) for r in records_of(ds))
    got = Counter()
    options = dict(global_batch_size=8, seq_len=64, num_epochs=1, seed=1, num_workers=2)
    with iter(pl.DataLoader(ds, **options)) as it:
        for batch in it:
            got.update(tuple(row[mask > 0][:8].tolist()) for row, mask in zip(batch["input_ids"], batch["attention_mask"]))
    assert got == want and sum(want.values()) == 200


@pytest.mark.slow
def test_remaps_keep_lengths_free_on_a_cache(cache):
    ds = pl.source(cache).shuffle(5)[10:900:3].repeat(2)
    assert ds.cheap_lengths
    idx = np.array([0, 5, len(ds) - 1])
    assert ds.lengths(idx).tolist() == [len(r["input_ids"]) for r in ds[idx]]


def test_lengths_of_a_view_read_no_records_when_the_source_answers():
    reads = []

    class Counted(pl.Dataset):
        cheap_lengths = True

        def __len__(self):
            return 30

        def __getitems__(self, indices):
            reads.extend(np.asarray(indices).tolist())
            return [{"input_ids": np.zeros(i % 5)} for i in np.asarray(indices).tolist()]

        def lengths(self, indices):
            return np.asarray(indices) % 5

        def _identity(self):
            return ("counted",)

    ds = Dataset.concatenate([Counted().shuffle(1)[::2], Counted().repeat(2)])
    got = ds.lengths(range(len(ds)))
    assert not reads and got.tolist() == [len(r["input_ids"]) for r in ds[list(range(len(ds)))]]


def test_reopen_reaches_every_leaf(cache):
    ds = Dataset.mix([pl.source(cache).shuffle(0)[::2].seed(1).random_map(noise), pl.source(cache).batch(3, batch_fn=list)])
    again = ds.reopen()
    assert again is not ds and again.fingerprint() == ds.fingerprint()
    leaves = lambda d: [d] if not d.parents else [x for p in d.parents for x in leaves(p)]  # noqa: E731
    assert all(a.cache is not b.cache for a, b in zip(leaves(again), leaves(ds)))
    assert same_records(again[[0, 7, 100]], ds[[0, 7, 100]])
    plain = Dataset.range(5).shuffle(0)[1:]
    assert plain.reopen() is plain


def same_records(xs, ys):
    flat = lambda rs: [r for x in rs for r in (x if isinstance(x, list) else [x])]  # noqa: E731
    return all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(flat(xs), flat(ys)))


def keep_record(i, r):
    return r


def test_views_pickle_for_spawned_workers():
    ds = Dataset.concatenate([pl.source(recs(9)).shuffle(3)[::2].repeat(2).random_map(noise, seed=1),
                              pl.source(recs(4, 2)).filter(odd).map_with_index(keep_record)])
    list(ds)  # a shuffle's sampler and a filter's memo are built by now; neither travels
    again = pickle.loads(pickle.dumps(ds))
    assert again.fingerprint() == ds.fingerprint()
    assert [ident(r) if r else None for r in again[list(range(len(ds)))]] == \
        [ident(r) if r else None for r in ds[list(range(len(ds)))]]


def test_stream_order():
    ds = pl.source(recs(10)).shuffle(0)[2:9]
    order = ds.stream_order(4).stream_indices(np.arange(len(ds)))
    assert sorted(order.tolist()) == list(range(7))  # a remap is served in the LCG order of its own length
    m = pl.mix({"a": recs(6, 1), "b": recs(6, 2)}, {"a": 1, "b": 1}, block=4)
    seeded = m.seed(3)
    assert np.array_equal(seeded.stream_order(1).stream_indices(np.arange(12)), m.stream_order(1).stream_indices(np.arange(12)))
    assert seeded.locate([0, 7]) == m.locate([0, 7]) == [("a", 0), ("b", 1)]
    assert Dataset.range(4).map(str).seed(1).parents[0].parents[0].parents == ()


# --- fingerprints ---------------------------------------------------------------------------------

BUILDS = {
    "range": lambda k: Dataset.range(3, 30 + k, 2),
    "shuffle seed": lambda k: Dataset.range(20).shuffle(seed=k),
    "pipeline seed": lambda k: Dataset.range(20).seed(k).shuffle(),
    "slice": lambda k: Dataset.range(20)[k::3],
    "slice step": lambda k: Dataset.range(20)[:: k + 2],
    "repeat": lambda k: Dataset.range(5).repeat(k + 1),
    "reseed": lambda k: Dataset.range(5).repeat(2, reseed_each_epoch=bool(k)),
    "batch size": lambda k: Dataset.range(10).batch(k + 2),
    "drop remainder": lambda k: Dataset.range(10).batch(3, drop_remainder=bool(k)),
    "mix weights": lambda k: Dataset.mix([Dataset.range(10), Dataset.range(5)], [1, k + 2]),
    "mix order": lambda k: Dataset.mix([Dataset.range(10 + 5 * k), Dataset.range(15 - 5 * k)]),
    "concatenate": lambda k: Dataset.concatenate([Dataset.range(3 + k), Dataset.range(4)]),
    "selection map": lambda k: Dataset.select_from_datasets([Dataset.range(5)], [(0, k), (0, 1)]),
    "random map seed": lambda k: Dataset.range(5).random_map(jitter, seed=k),
    "map with index": lambda k: Dataset.range(5).map_with_index(lambda i, x: i + x + k),
    "batch fn": lambda k: Dataset.range(6).batch(2, batch_fn=[sum, max][k]),
}


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_fingerprint_is_fixed_at_construction_and_names_the_parameters(name):
    build = BUILDS[name]
    ds = build(0)
    before = ds.fingerprint()
    ds.__dict__.pop("_fingerprint", None)  # recomputed after reading: the same
    list(ds)
    ds.__getitems__(list(range(len(ds))))
    ds.__dict__.pop("_fingerprint", None)
    assert ds.fingerprint() == before == build(0).fingerprint()
    assert build(1).fingerprint() != before


def test_fingerprint_of_a_grain_selection_map_covers_its_entries():
    grain = pytest.importorskip("grain")

    class Every(grain.transforms.DatasetSelectionMap):
        def __init__(self, k):
            self.k = k

        def __len__(self):
            return 3000

        def __getitem__(self, i):
            return 0, (i * self.k) % 7

    fp = lambda k: Dataset.select_from_datasets([Dataset.range(7)], Every(k)).fingerprint()  # noqa: E731
    assert fp(2) == fp(2) != fp(3)
