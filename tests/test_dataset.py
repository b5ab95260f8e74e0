"""The dataset layer against independent oracles: every kind of source reads what the object itself
holds, one indexing rule, lazy maps, fingerprints that change with content, maps and names, and the
DataLoader over datasets (same batches as over the bare object, refusal of another pipeline's state,
exact resume with workers)."""

import copy
import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portable_loader as pl
from portable_loader.dataset import Dataset, base
from portable_loader.precache import build_cache, sample_args
from test_loader import make_source, same, take

# The package's ``source`` attribute is the function; the module of the same name is reached by path.
from portable_loader.dataset import sources as source_module


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    out = tmp_path_factory.mktemp("caches")
    return {b: pl.open_cache(build_cache(**sample_args(), out=str(out), backend=b)[0]) for b in ("arrow", "array_record")}


def kinds(caches):
    """Each kind of source, with the records it holds read back through the object's own API."""
    import datasets
    import grain

    recs = make_source(40, seed=3)
    hf = datasets.Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in recs],
                                     "loss_mask": [r["loss_mask"].tolist() for r in recs],
                                     "text": [str(i) for i in range(len(recs))]})
    out = {
        "list": (recs, recs),
        "grain": (grain.MapDataset.source(recs), recs),
        "hf": (hf, [{"input_ids": np.asarray(row["input_ids"]), "loss_mask": np.asarray(row["loss_mask"])} for row in hf]),
    }
    for backend, cache in caches.items():
        out[backend] = (cache, [cache[i] for i in range(len(cache))])
    return out


def equal_records(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(np.asarray(x[k]), np.asarray(y[k])) for k in x) for x, y in zip(a, b)
    )


# --- protocol conformance ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["list", "grain", "hf", "arrow", "array_record"])
def test_every_kind_of_source_reads_what_the_object_holds(caches, kind):
    obj, truth = kinds(caches)[kind]
    ds = pl.source(obj)
    assert isinstance(ds, Dataset) and pl.source(ds) is ds
    assert len(ds) == len(truth)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(ds), size=50)
    assert equal_records(ds.__getitems__(idx.tolist()), [truth[i] for i in idx])
    assert equal_records(ds.__getitems__(idx), [truth[i] for i in idx])  # a 1-D int array too
    lengths = ds.lengths(idx)
    assert lengths.dtype == np.int64 and lengths.tolist() == [len(truth[i]["input_ids"]) for i in idx]
    fp = ds.fingerprint()
    assert len(fp) == 16 and int(fp, 16) >= 0 and pl.source(obj).fingerprint() == fp
    again = ds.reopen()
    assert isinstance(again, Dataset) and again.fingerprint() == fp
    assert equal_records(again.__getitems__(idx[:5]), [truth[i] for i in idx[:5]])


@pytest.mark.slow
def test_cache_fingerprint_is_its_manifest_and_survives_reopening(caches):
    for cache in caches.values():
        reopened = pl.open_cache(cache.path)
        assert pl.source(reopened).fingerprint() == pl.source(cache).fingerprint()
    assert pl.source(caches["arrow"]).fingerprint() != pl.source(caches["array_record"]).fingerprint()


@pytest.mark.slow
def test_mapped_array_record_cache_reopens_its_leaf(caches):
    ds = pl.source(caches["array_record"]).map(lambda r: r, keeps_lengths=True)
    again = ds.reopen()
    assert again is not ds and again.parent.cache is not ds.parent.cache
    assert again.fingerprint() == ds.fingerprint()
    arrow = pl.source(caches["arrow"]).map(lambda r: r)
    assert arrow.reopen() is arrow  # memory maps survive fork: nothing to reopen


def test_bad_sources_are_refused_with_what_is_accepted():
    import datasets

    with pytest.raises(TypeError, match="got int"):
        pl.source(42)
    with pytest.raises(TypeError, match="got dict"):
        pl.source({"input_ids": [1]})
    with pytest.raises(ValueError, match=r"no 'input_ids' column \(columns: \['text'\]\)"):
        pl.source(datasets.Dataset.from_dict({"text": ["a"]}))
    with pytest.raises(ValueError, match="'input_ids' must be a list of integers"):
        pl.source(datasets.Dataset.from_dict({"input_ids": ["a b"]}))
    with pytest.raises(TypeError, match="callable"):
        pl.source([{"input_ids": [1]}]).map(3)


# --- one indexing rule ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["list", "grain", "hf", "arrow", "array_record"])
def test_every_dataset_follows_the_indexing_rule(caches, kind):
    obj, truth = kinds(caches)[kind]
    for ds in (pl.source(obj), pl.source(obj).map(lambda r: r)):
        n = len(truth)
        assert equal_records([ds[3]], [truth[3]]) and equal_records([ds[np.int64(-1)]], [truth[-1]])
        for key in ([5, 1, 5], (0, -2), np.array([2, 0], np.int32), slice(1, 9, 3), slice(None, None, -7), []):
            expect = [truth[i] for i in range(n)][key] if isinstance(key, slice) else [truth[i] for i in key]
            got = ds[key]
            if isinstance(key, slice):  # a slice is a view (Grain's MapDataset.slice), read by iterating
                assert isinstance(got, pl.Dataset) and len(got) == len(expect), key
                got = list(got)
            assert isinstance(got, list) and equal_records(got, expect), key
        for bad in ("3", 1.0, True, [1.5], np.array([[1]]), np.array([True, False]), None):
            with pytest.raises(TypeError, match="dataset indices must be"):
                ds[bad]
        for out in (-n - 1, [0, n]):
            with pytest.raises(IndexError, match="out of range"):
                ds[out]
        if n:  # an integer past the end reads the next epoch, as Grain's MapDataset does
            assert equal_records([ds[n]], [ds[0]])


# --- map: lazy, lengths after the map ---------------------------------------------------------


def test_map_runs_only_on_the_records_read(caches):
    calls = []

    def tag(r):
        calls.append(1)
        return {**r, "input_ids": r["input_ids"][:3]}

    for obj in (make_source(30), caches["arrow"]):
        calls.clear()
        ds = pl.source(obj).map(tag)
        ds.fingerprint()
        assert len(ds) == len(obj) and calls == []
        ds.__getitems__([4, 2, 4])
        assert len(calls) == 3
        assert ds.lengths(np.array([0, 1])).tolist() == [min(3, len(obj[i]["input_ids"])) for i in (0, 1)]
        assert len(calls) == 5  # lengths are those of the mapped records
        calls.clear()
        kept = pl.source(obj).map(lambda r: tag({**r, "input_ids": r["input_ids"] + 1}), keeps_lengths=True)
        assert kept.lengths(np.arange(10)).tolist() == [len(obj[i]["input_ids"]) for i in range(10)]
        assert calls == []  # the parent's lengths: a cache answers from its offsets, nothing is mapped


def test_keeps_lengths_is_checked_on_read():
    ds = pl.source(make_source(10)).map(lambda r: {**r, "input_ids": r["input_ids"][:1]}, keeps_lengths=True)
    with pytest.raises(ValueError, match=r"promised keeps_lengths but changed record \d+ from \d+ to 1 tokens"):
        ds.__getitems__(list(range(10)))


def test_mapped_packed_batches_equal_batches_over_the_mapped_records():
    recs = make_source(50, seed=1)
    crop = lambda r: {"input_ids": r["input_ids"][::2] + 7, "loss_mask": r["loss_mask"][::2]}  # noqa: E731
    kw = dict(global_batch_size=4, seq_len=16, seed=2, packing=True, packing_window=12, num_epochs=2)
    assert same(list(iter(pl.DataLoader(pl.source(recs).map(crop), **kw))),
                list(iter(pl.DataLoader([crop(r) for r in recs], **kw))))


# --- fingerprints -----------------------------------------------------------------------------

records = st.lists(
    st.tuples(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=12), st.integers(0, 2**12)),
    min_size=1, max_size=25,
).map(lambda rows: [{"input_ids": np.asarray(ids, np.int32), "loss_mask": np.asarray(
    [(seed >> (k % 12)) & 1 for k in range(len(ids))], np.uint8)} for ids, seed in rows])


@settings(max_examples=60, deadline=None)
@given(recs=records, data=st.data())
def test_fingerprint_follows_content(recs, data):
    fp = pl.source(recs).fingerprint()
    assert pl.source(copy.deepcopy(recs)).fingerprint() == fp
    assert pl.source(tuple(copy.deepcopy(recs))).fingerprint() == fp
    changed = copy.deepcopy(recs)
    i = data.draw(st.integers(0, len(recs) - 1))
    how = data.draw(st.sampled_from(["token", "mask", "drop", "append", "dtype", "extend"]))
    if how == "token":
        j = data.draw(st.integers(0, len(changed[i]["input_ids"]) - 1))
        changed[i]["input_ids"][j] ^= 1
    elif how == "mask":
        changed[i]["loss_mask"][0] ^= 1
    elif how == "drop":
        del changed[i]
    elif how == "append":
        changed.append(copy.deepcopy(recs[i]))
    elif how == "dtype":
        changed[i]["input_ids"] = changed[i]["input_ids"].astype(np.int64)
    elif how == "extend":
        changed[i]["input_ids"] = np.concatenate([changed[i]["input_ids"], [0]]).astype(np.int32)
    assert pl.source(changed).fingerprint() != fp, how


def _scale(k):
    return lambda r: {"input_ids": r["input_ids"] * k}


def shift(r):
    return {"input_ids": r["input_ids"] + 1}


def negate(r):
    return {"input_ids": -r["input_ids"]}


def test_fingerprint_follows_maps_and_names():
    recs = make_source(20)
    base_ds = pl.source(recs)
    fps = {
        "bare": base_ds.fingerprint(),
        "shift": base_ds.map(shift).fingerprint(),
        "negate": base_ds.map(negate).fingerprint(),
        "shift.negate": base_ds.map(shift).map(negate).fingerprint(),
        "negate.shift": base_ds.map(negate).map(shift).fingerprint(),
        "lambda+1": base_ds.map(lambda r: {"input_ids": r["input_ids"] + 1}).fingerprint(),
        "lambda+2": base_ds.map(lambda r: {"input_ids": r["input_ids"] + 2}).fingerprint(),
        "closure2": base_ds.map(_scale(2)).fingerprint(),
        "closure3": base_ds.map(_scale(3)).fingerprint(),
        "partial": base_ds.map(functools.partial(np.add, 1)).fingerprint(),
        "named-a": base_ds.map(shift, name="a").fingerprint(),
        "named-b": base_ds.map(shift, name="b").fingerprint(),
        "other source": pl.source(make_source(20, seed=9)).map(shift).fingerprint(),
    }
    assert len(set(fps.values())) == len(fps), fps
    # Equal pipelines agree: by qualified name, by code for a lambda, by the name the user gives.
    assert pl.source(copy.deepcopy(recs)).map(shift).fingerprint() == fps["shift"]
    assert base_ds.map(_scale(2)).fingerprint() == fps["closure2"]
    assert base_ds.map(negate, name="a").fingerprint() == fps["named-a"]
    assert base_ds.map(shift, keeps_lengths=True).fingerprint() == fps["shift"]


PIPELINE = """
import grain, numpy as np, portable_loader as pl
recs = [{"input_ids": np.arange(i % 7 + 1, dtype=np.int32), "tags": {"a", "b", str(i)}} for i in range(50)]
k = 3
tree = grain.MapDataset.source(recs).shuffle(seed=1).map(lambda r: {"input_ids": r["input_ids"] * k})
fp = pl.source(tree).map(lambda r: r, name="id").fingerprint() + pl.source(recs).map(lambda r: r).fingerprint()
"""


@pytest.mark.slow
def test_fingerprints_are_the_same_in_another_process():
    import os
    import subprocess
    import sys

    mine = {"__name__": "__main__"}  # as in the child, whose functions live in __main__
    exec(PIPELINE, mine)
    env = dict(os.environ, PYTHONHASHSEED="12345")
    theirs = subprocess.run([sys.executable, "-c", PIPELINE + "print(fp)"], env=env, capture_output=True, text=True,
                            check=True).stdout.strip()
    assert theirs == mine["fp"]


def test_grain_fingerprint_walks_the_tree(caches):
    import grain

    recs = make_source(30)

    def tree(leaf=recs, seed=0, k=2, stop=20):
        return grain.MapDataset.source(leaf).shuffle(seed=seed).slice(slice(0, stop)).map(_scale(k))

    fp = pl.source(tree()).fingerprint()
    assert pl.source(tree(leaf=copy.deepcopy(recs))).fingerprint() == fp
    others = [tree(seed=1), tree(k=3), tree(stop=21), tree(leaf=make_source(30, seed=5)),
              grain.MapDataset.source(recs).shuffle(seed=0).slice(slice(0, 20)).map(shift),
              grain.MapDataset.source(recs).slice(slice(0, 20)).map(_scale(2))]
    fps = {pl.source(t).fingerprint() for t in others} | {fp}
    assert len(fps) == len(others) + 1
    # A leaf that is ours is named by our fingerprint: a cache's manifest, never a sample.
    over_cache = [pl.source(grain.MapDataset.source(c)).fingerprint() for c in caches.values()]
    assert over_cache[0] != over_cache[1]
    node = source_module._with_leaf_fingerprints(source_module._node_identity(grain.MapDataset.source(caches["arrow"])))
    assert node[3] == pl.source(caches["arrow"]).fingerprint()


def test_large_sequences_are_fingerprinted_by_a_fixed_sample():
    n = base.SMALL * 5
    recs = [{"input_ids": np.array([i], np.int32)} for i in range(n)]
    reads = []

    class Counting:
        def __len__(self):
            return n

        def __getitem__(self, i):
            reads.append(i)
            return recs[i]

    fp = pl.source(Counting()).fingerprint()
    assert len(reads) == base.SAMPLE and reads[0] == 0 and reads[-1] == n - 1
    assert fp == pl.source(recs).fingerprint()
    assert pl.source(recs[::-1]).fingerprint() != fp  # a reordering moves the sampled records


def test_hf_fingerprint_follows_its_content():
    import datasets

    a = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]})
    b = datasets.Dataset.from_dict({"input_ids": [[1, 2], [4]]})
    assert pl.source(a).fingerprint() != pl.source(b).fingerprint()
    assert pl.source(a).fingerprint() != pl.source(a.select([1, 0])).fingerprint()


# --- the DataLoader over datasets -------------------------------------------------------------


def test_a_state_is_refused_by_another_map_and_kept_by_the_same_one():
    recs = make_source(40)
    kw = dict(global_batch_size=4, seq_len=16, seed=0)
    it = iter(pl.DataLoader(pl.source(recs).map(shift), **kw))
    take(it, 3)
    state = it.get_state()
    with pytest.raises(ValueError, match="source differs"):
        iter(pl.DataLoader(pl.source(recs).map(negate), **kw)).set_state(state)
    with pytest.raises(ValueError, match="source differs"):
        iter(pl.DataLoader(pl.source(recs).map(shift, name="shift v2"), **kw)).set_state(state)
    with pytest.raises(ValueError, match="source differs"):
        iter(pl.DataLoader(recs, **kw)).set_state(state)
    resumed = iter(pl.DataLoader(pl.source(copy.deepcopy(recs)).map(shift), **kw))
    resumed.set_state(state)
    assert same(take(resumed, 2), take(it, 2))


@pytest.mark.parametrize("backend", ["arrow", "array_record"])
@pytest.mark.parametrize("packing", [False, True])
def test_loader_over_a_source_equals_the_loader_over_the_bare_object(caches, backend, packing):
    import grain

    cache = caches[backend]
    kw = dict(global_batch_size=8, seq_len=64, seed=3, packing=packing, packing_window=64)
    bare = pl.DataLoader(cache, **kw)
    wrapped = pl.DataLoader(pl.source(cache), **kw)
    assert wrapped.fingerprint == bare.fingerprint
    want = take(iter(bare), 4)
    assert same(take(iter(wrapped), 4), want)
    assert same(take(iter(pl.DataLoader(grain.MapDataset.source(cache), **kw)), 4), want)
    assert same(take(iter(pl.DataLoader([cache[i] for i in range(len(cache))], **kw)), 4), want)


def test_loader_over_hf_equals_the_loader_over_its_records(caches):
    obj, truth = kinds(caches)["hf"]
    kw = dict(global_batch_size=4, seq_len=24, seed=1, packing=True, packing_window=16, num_epochs=1)
    assert same(list(iter(pl.DataLoader(obj, **kw))), list(iter(pl.DataLoader(truth, **kw))))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("packing", [False, True])
def test_resume_over_a_mapped_cache_is_exact(caches, workers, packing):
    ds = pl.source(caches["array_record"]).map(lambda r: {**r, "input_ids": r["input_ids"][::-1]})
    kw = dict(global_batch_size=8, seq_len=64, seed=5, packing=packing, packing_window=32,
              num_workers=workers, prefetch=1)
    with iter(pl.DataLoader(ds, **kw)) as it:
        whole = take(it, 9)
    with iter(pl.DataLoader(ds, **kw)) as it:
        take(it, 4)
        state = it.get_state()
    with iter(pl.DataLoader(pl.source(pl.open_cache(caches["array_record"].path)).map(
            lambda r: {**r, "input_ids": r["input_ids"][::-1]}), **kw)) as it:
        it.set_state(state)
        assert same(take(it, 5), whole[4:])



def test_a_grain_pipelines_fingerprint_does_not_change_when_it_is_read():
    # Grain sets attributes on the first read; a state saved by a run that had read its pipeline must
    # restore in a fresh run of the same pipeline.
    import grain

    def pipeline():
        records = [{"input_ids": np.arange(i % 7 + 1, dtype=np.int32)} for i in range(50)]
        return grain.MapDataset.source(records).shuffle(seed=1).map(lambda r: r).filter(lambda r: len(r["input_ids"]) > 1)

    read = pipeline()
    before = pl.source(read).fingerprint()
    assert sum(1 for _ in read) > 0
    assert pl.source(read).fingerprint() == before == pl.source(pipeline()).fingerprint()
    with iter(pl.DataLoader(read, global_batch_size=4, seq_len=16, seed=0)) as it:
        next(it)
        state, following = it.get_state(), next(it)
    with iter(pl.DataLoader(pipeline(), global_batch_size=4, seq_len=16, seed=0)) as fresh:
        fresh.set_state(state)
        assert all(np.array_equal(following[k], v) for k, v in next(fresh).items())


@pytest.mark.parametrize("packing", [False, True])
def test_raw_records_are_refused_naming_the_record_and_the_fix(tmp_path, packing):
    # Grain's ArrayRecordDataSource gives raw bytes; the token loader says what to add instead of
    # failing on "byte indices must be integers".
    import grain
    from array_record.python.array_record_module import ArrayRecordWriter

    path = str(tmp_path / "raw.array_record")
    writer = ArrayRecordWriter(path, "group_size:1")
    for i in range(8):
        writer.write(np.arange(i + 1, dtype=np.int32).tobytes())
    writer.close()
    raw = grain.sources.ArrayRecordDataSource([path])
    with pytest.raises(TypeError, match=r"record \d+ is bytes, not a dict with 'input_ids'.*decode"):
        with iter(pl.DataLoader(pl.source(raw), global_batch_size=2, seq_len=8, packing=packing)) as it:
            next(it)
    decoded = pl.source(raw).map(lambda b: {"input_ids": np.frombuffer(b, np.int32)})
    with iter(pl.DataLoader(decoded, global_batch_size=2, seq_len=8, packing=packing)) as it:
        assert next(it)["input_ids"].shape == (2, 8)
