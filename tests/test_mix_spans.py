"""A mixture of caches takes the cache fast path: ``Mix.spans`` asks each source once for its records
and joins the answers in the order asked, and batches equal the record-dict path's bit for bit.

Oracles: the records ``Mix.__getitems__`` returns (for ``spans``); a loader over the same mixture
seen through ``.map`` (which has no ``spans``: the record-dict path, one read per step) for whole
streams, padded and packed, over weights, seeds, schedules and nested mixes of Arrow and ArrayRecord
caches, with workers and resumes; each source's own ``read_ahead`` for the mixture's.
"""


import pickle

import fsspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_loader as pl
from portable_loader.cache import writer as writer_module
from portable_loader.cache.remote import upload_cache
from test_remote_spans import decoded
from test_spans import write_cache as _write_cache

SIZES = {"web": ("arrow", 300), "code": ("array_record", 200), "math": ("arrow", 40)}  # math: many epochs a chunk


def write_cache(path, backend: str, n: int, seed: int) -> str:
    """``n`` random records (0-150 tokens) in 3 shards, keyed by ``seed`` (the caches of a mixture differ)."""
    return _write_cache(path, backend, n, seed, key=f"{seed:064d}")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    base = tmp_path_factory.mktemp("mix-spans")
    old = writer_module._BATCH_ROWS
    writer_module._BATCH_ROWS = 7  # Arrow shards in batches of 7 records: a read meets many of them
    try:
        return {name: write_cache(base / name, backend, n, seed)
                for seed, (name, (backend, n)) in enumerate(SIZES.items())}
    finally:
        writer_module._BATCH_ROWS = old


@pytest.fixture(scope="module")
def caches(paths):
    return {name: pl.open_cache(p) for name, p in paths.items()}


def mixture(caches, weights, nested: bool, schedule: bool):
    """Three caches mixed by ``weights`` (two of them as a nested mix when ``nested``), with a
    second stage of reversed weights from record 700 when ``schedule``."""
    if nested:
        sources = {"web": caches["web"], "rest": pl.mix({"code": caches["code"], "math": caches["math"]}, {"code": 2, "math": 1})}
        weights = {"web": weights[0], "rest": weights[1] + weights[2]}
    else:
        sources = dict(caches)
        weights = dict(zip(sources, weights))
    if schedule:
        weights = [(0, weights), (700, dict(zip(weights, reversed(weights.values()))))]
    return pl.mix(sources, weights)


def hidden(ds):
    """The same records and order without ``spans``: the loader collates record dicts."""
    return ds.map(dict, keeps_lengths=True)


def batches(ds, steps: int, state=None, **kw) -> tuple[list, dict]:
    it = iter(pl.DataLoader(ds, **kw))
    if state is not None:
        it.set_state(state)
    with it:
        out = [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(steps)]
        return out, it.get_state()


def same(a, b) -> None:
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k]), (step, k)


weights = st.lists(st.integers(0, 5), min_size=3, max_size=3).filter(lambda w: w[0] and any(w[1:]))


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(w=weights, nested=st.booleans(), schedule=st.booleans(),
       idx=st.one_of(st.lists(st.integers(0, 539), max_size=20),           # a step's few: grouped in Python
                     st.lists(st.integers(0, 539), min_size=65, max_size=600)))  # a chunk's many: numpy
def test_spans_hold_the_records_getitems_returns(caches, w, nested, schedule, idx):
    m = mixture(caches, w, nested, schedule)
    want = [(r["input_ids"].tolist(), r["loss_mask"].tolist()) for r in m.__getitems__(idx)]
    assert decoded(m.spans(idx)) == want
    assert decoded(m.spans(np.asarray(idx, dtype=np.int64))) == want


def test_spans_are_offered_only_when_every_source_has_them(caches):
    records = [{"input_ids": np.arange(3, dtype=np.int32)}]
    assert callable(pl.mix(dict(caches), {"web": 1, "code": 1}).spans)
    for m in (pl.mix({"web": caches["web"], "list": records}, {"web": 1, "list": 1}),
              pl.mix({"web": caches["web"], "mapped": pl.source(caches["code"]).map(dict)}, {"web": 1, "mapped": 1}),
              pl.mix({"web": caches["web"], "inner": pl.mix({"list": records}, {"list": 1})}, {"web": 1, "inner": 1})):
        assert getattr(m, "spans", None) is None and getattr(m, "read_ahead", None) is None
    with pytest.raises(IndexError, match="out of range"):
        pl.mix(dict(caches), {"web": 1}).spans([540])


def local_mixture(caches, w):
    """Local Arrow caches only (a nested mix of them too): ``Mix.lengths`` answers from spans."""
    inner = pl.mix({"a": caches["web"], "b": caches["math"]}, {"a": 1, "b": 2})
    return pl.mix({"web": caches["web"], "math": caches["math"], "inner": inner}, dict(zip(("web", "math", "inner"), w)))


@pytest.mark.slow
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(w=weights, idx=st.one_of(st.lists(st.integers(0, 679), max_size=20),
                                st.lists(st.integers(0, 679), min_size=65, max_size=600)))
def test_local_caches_size_from_spans_and_keep_them_for_the_read(caches, w, idx):
    m = local_mixture(caches, w)
    assert m._span_readers()[1] and not mixture(caches, w, False, False)._span_readers()[1]  # code: ArrayRecord
    want = [(r["input_ids"].tolist(), r["loss_mask"].tolist()) for r in m.__getitems__(idx)]
    arr = np.asarray(idx, dtype=np.int64)
    assert m.lengths(arr).tolist() == [len(ids) for ids, _ in want]
    got = m.spans(arr.copy())
    assert decoded(got) == want
    if arr.size > 64:  # a window's many records: located once, for lengths and for the read
        assert got is m.spans(arr)
    assert decoded(m.spans(arr[::-1].copy())) == want[::-1]  # other records: located afresh
    assert decoded(m.reopen().spans(arr)) == want
    assert decoded(pickle.loads(pickle.dumps(m)).spans(arr)) == want  # a spawned worker's copy: no memoryviews


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(w=weights, seed=st.integers(0, 2**32 - 1))
def test_batches_over_local_caches_equal_the_record_path(caches, packing, w, seed):
    m = local_mixture(caches, w)
    config = dict(global_batch_size=8, seq_len=96, seed=seed, prefetch=0, packing=packing, packing_window=100,
                  overlong="split" if packing else "truncate")
    got, _ = batches(m, 90, **config)
    want, _ = batches(hidden(m), 90, **config)
    same(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(w=weights, seed=st.integers(0, 2**32 - 1), nested=st.booleans(), schedule=st.booleans(),
       batch=st.sampled_from([8, 64]))
def test_batches_through_spans_equal_the_record_path(caches, packing, w, seed, nested, schedule, batch):
    m = mixture(caches, w, nested, schedule)
    assert callable(m.spans) and getattr(hidden(m), "spans", None) is None
    # 64 x 70 padded steps cross the first chunk of 4,096 positions; packed windows of 64 records
    # are read ahead one at a time.
    config = dict(global_batch_size=batch, seq_len=96, seed=seed, prefetch=0, packing=packing,
                  packing_window=64, overlong="split" if packing else "truncate")
    got, _ = batches(m, 70, **config)
    want, _ = batches(hidden(m), 70, **config)
    same(got, want)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_workers_prefetch_and_resume_through_spans_equal_the_record_path(caches, packing):
    m = mixture(caches, [3, 2, 1], nested=True, schedule=True)
    config = dict(global_batch_size=16, seq_len=128, seed=5, packing=packing, packing_window=48)
    want, _ = batches(hidden(m), 60, prefetch=0, **config)
    for kw in (dict(num_workers=2, prefetch=2), dict(prefetch=2)):
        got, _ = batches(m, 60, **kw, **config)
        same(got, want)
    first, state = batches(m, 23, prefetch=0, **config)
    rest, _ = batches(m, 37, state=state, prefetch=0, **config)
    same(first + rest, want)


@pytest.fixture(scope="module")
def remote(paths, tmp_path_factory):
    """The three caches in an in-memory bucket (standing in for s3://), 3 shards each."""
    urls = {}
    for name, p in paths.items():
        urls[name] = f"memory://mix-spans/{name}"
        upload_cache(p, urls[name])
    yield urls
    fsspec.filesystem("memory").rm("memory://mix-spans", recursive=True)


def largest_shard(path) -> int:
    return max(s["bytes"] for s in pl.open_cache(path).manifest["shards"])


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(now=st.lists(st.integers(0, 539), max_size=8), ahead=st.lists(st.integers(0, 539), max_size=300))
def test_read_ahead_is_each_sources_own_over_its_records(remote, paths, tmp_path_factory, now, ahead):
    srcs = {n: pl.open_cache(u, cache_dir=tmp_path_factory.mktemp("ra"), cache_limit=2 * largest_shard(paths[n]))
            for n, u in remote.items()}
    m = pl.mix(srcs, {"web": 1, "code": 1, "math": 1})
    now, ahead = np.asarray(now, dtype=np.int64), np.asarray(ahead, dtype=np.int64)
    kept = m.read_ahead(now, ahead).tolist()
    lo, hi = m.offsets[:-1], m.offsets[1:]
    want = []
    for i in ahead.tolist():
        s = int(np.searchsorted(m.offsets, i, side="right") - 1)
        mine = lambda x: x[(x >= lo[s]) & (x < hi[s])] - lo[s]  # noqa: E731
        own = srcs[m.names[s]].read_ahead(mine(now), mine(ahead)).tolist()
        if i - lo[s] in own:
            want.append(i)
    assert kept == want
    for s in srcs.values():
        s.close()


@pytest.mark.slow
def test_a_mixture_of_remote_caches_under_a_limit_equals_local_copies(remote, paths, tmp_path):
    config = dict(global_batch_size=8, seq_len=96, seed=1, prefetch=0)
    weights = {"web": 3, "code": 2, "math": 1}
    srcs = {n: pl.open_cache(u, cache_dir=tmp_path / n, cache_limit=2 * largest_shard(paths[n])) for n, u in remote.items()}
    got, _ = batches(pl.mix(srcs, weights), 120, **config)
    want, _ = batches(pl.mix({n: pl.open_cache(p) for n, p in paths.items()}, weights), 120, **config)
    same(got, want)
    for s in srcs.values():
        s.close()


@pytest.fixture(scope="module")
def one_batch_caches(tmp_path_factory):
    """Twelve small Arrow caches, each one shard of one record batch (what a mixture locates with a
    numpy gather per source), with random tokens and masks."""
    from portable_loader.cache import FORMAT_VERSION, ShardWriter, write_manifest

    base, out = tmp_path_factory.mktemp("one-batch"), {}
    for s in range(12):
        rng, path, n = np.random.default_rng(100 + s), base / f"s{s:02d}", 20 + 5 * s
        path.mkdir()
        w = ShardWriter(str(path / "data-00000-of-00001.arrow"), "arrow")
        for _ in range(n):
            k = int(rng.integers(0, 90))
            w.write(rng.integers(0, 2**31 - 1, k, dtype=np.int32), rng.integers(0, 2, k, dtype=np.uint8))
        counts = {"rows_in": n, "rows_out": n, "dropped": {}, "truncated": 0, "tokens": 0, "trainable_tokens": 0}
        write_manifest(str(path), {"format_version": FORMAT_VERSION, "backend": "arrow", "key": f"{s:064d}",
                                   "counts": counts, "content_checksum": "", "shards": [w.close()]})
        out[f"s{s:02d}"] = pl.open_cache(str(path))
    return out


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_many_one_batch_sources_locate_each_record_where_it_lies(one_batch_caches, data):
    m = pl.mix(one_batch_caches, {name: 1 + k % 3 for k, name in enumerate(one_batch_caches)})
    n = len(m)
    idx = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=65, max_size=700)), dtype=np.int64)
    sp = m.spans(idx)
    assert sp.length == m.lengths(idx).tolist()
    for k, i in enumerate(idx.tolist()):
        ids = np.frombuffer(sp.ids[sp.buf[k]][sp.ids_at[k]:][: 4 * sp.length[k]], np.int32)
        mask = np.frombuffer(sp.masks[sp.buf[k]][sp.mask_at[k]:][: sp.length[k]], np.uint8)
        record = m[i]
        assert np.array_equal(ids, record["input_ids"]) and np.array_equal(mask, record["loss_mask"])
