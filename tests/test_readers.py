"""Cache readers under any mix of lengths / prefetch / batched reads: every record equals the one the
formatter produced (the oracle), whatever the memo holds, evicts or serves; both backends."""

import json
import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portable_loader as pl
from conftest import GPT2, need, spans_records
from portable_loader.cache.readers import ArrayRecordCacheSource
from portable_loader.tokenize import Formatter, load_tokenizer

N_ROWS = 150


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """The same rows cached in 3 shards with each backend, plus the formatter's records."""
    base = tmp_path_factory.mktemp("readers")
    data = base / "rows.jsonl"
    rows = [{"text": f"record {i} " + "word " * (i % 13)} for i in range(N_ROWS)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = [(ids.tolist(), mask.tolist()) for ids, mask in Formatter("text", load_tokenizer(need(GPT2))).encode(rows)]
    paths = {b: pl.precache(data, tokenizer=GPT2, format="text", out=base, num_workers=3, backend=b,
                             rows_per_task=-(-N_ROWS // 3))
             for b in ("arrow", "array_record")}
    return paths, expected


def as_tuple(record):
    return record["input_ids"].tolist(), record["loss_mask"].tolist()


# Short and long lists, runs across shard borders and repeats all occur.
indices = st.one_of(
    st.lists(st.integers(0, N_ROWS - 1), max_size=20),
    st.builds(lambda a, n: list(range(a, min(N_ROWS, a + n))), st.integers(0, N_ROWS - 1), st.integers(1, 60)),
    st.lists(st.integers(0, N_ROWS - 1), min_size=64, max_size=200),
)
ops = st.lists(st.tuples(st.sampled_from(["read", "lengths", "prefetch", "spans"]), indices), min_size=1, max_size=12)



@pytest.mark.slow
@pytest.mark.parametrize("backend", ["arrow", "array_record"])
@settings(max_examples=60, deadline=None)
@given(ops=ops, memo_bytes=st.sampled_from([0, 300, 3000, 1 << 20]), bulk_min=st.sampled_from([1, 64, 10**9]))
def test_reads_match_the_oracle_whatever_the_memo_holds(caches, backend, ops, memo_bytes, bulk_min):
    paths, expected = caches
    src = pl.open_cache(paths[backend])
    if backend == "array_record":
        src = ArrayRecordCacheSource(src.path, src.manifest, memo_bytes=memo_bytes, mapped=False)  # the library path
        src.bulk_min = bulk_min  # list reads (per shard) from this many records, single reads below
    for op, idx in ops:
        if op == "read":
            assert [as_tuple(r) for r in src.__getitems__(idx)] == [expected[i] for i in idx]
        elif op == "lengths":
            assert src.lengths(idx).tolist() == [len(expected[i][0]) for i in idx]
        elif op == "spans":
            assert spans_records(src.spans(idx)) == [expected[i] for i in idx]
        else:
            assert src.prefetch(idx) is None
        if backend == "array_record":
            assert src._memo_size <= max(memo_bytes, 0)
            assert src._memo_size == sum(len(r) for block in src._memo for r in block.values())
    assert [as_tuple(r) for r in src[0:N_ROWS]] == expected


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["arrow", "array_record"])
def test_prefetch_checks_its_indices(caches, backend):
    src = pl.open_cache(caches[0][backend])
    with pytest.raises(IndexError, match=f"out of range for a dataset of {N_ROWS} records"):
        src.prefetch([0, N_ROWS])
    with pytest.raises(TypeError, match="dataset indices must be integers"):
        src.prefetch([1.0])


@pytest.mark.slow
def test_a_reopened_source_starts_with_an_empty_memo_and_the_same_budget(caches):
    opened = pl.open_cache(caches[0]["array_record"])
    src = ArrayRecordCacheSource(opened.path, opened.manifest, memo_bytes=5000, mapped=False)
    src.prefetch(range(40))
    fresh = src.reopen()
    assert src._memo and not fresh._memo and fresh.memo_bytes == 5000
    assert [as_tuple(r) for r in fresh[0:40]] == caches[1][:40]


def test_what_lengths_or_prefetch_read_is_served_without_touching_the_shards(caches):
    opened = pl.open_cache(caches[0]["array_record"])
    src = ArrayRecordCacheSource(opened.path, opened.manifest, mapped=False)
    src.prefetch([3, 77, 149])
    assert src.lengths([5, 3]).tolist() == [len(caches[1][5][0]), len(caches[1][3][0])]
    src._readers = []  # any read from a shard now fails
    assert [as_tuple(r) for r in src[[149, 5, 3, 77]]] == [caches[1][i] for i in (149, 5, 3, 77)]
    with pytest.raises(IndexError):
        src[[4]]


@pytest.mark.slow
def test_array_record_shards_are_uncompressed_and_old_compressed_ones_get_safely_started_workers(tmp_path, monkeypatch):
    """A compressed shard's reader crashes in a worker forked after the parent read from it (the
    decompressor's thread does not survive fork): new caches are written uncompressed, and a cache
    written compressed (as older versions did) gets workers started by the forkserver, never forked."""
    import portable_loader as pl
    from portable_loader.cache import writer
    from portable_loader.precache import build_cache, sample_args

    path, _ = build_cache(**sample_args(), out=str(tmp_path / "new"), backend="array_record", num_workers=1)
    src = pl.open_cache(path)
    assert src.manifest["array_record_options"] == "group_size:1,uncompressed" and src.fork_hazard is None
    loader = pl.DataLoader(pl.source(src).map(dict), global_batch_size=4, seq_len=64, packing=True, num_workers=2)
    with iter(loader) as it:
        assert [next(it)["input_ids"].shape for _ in range(3)] == [(4, 64)] * 3

    monkeypatch.setattr(writer, "ARRAY_RECORD_OPTIONS", "group_size:1")  # what older versions wrote
    monkeypatch.setattr(sys.modules["portable_loader.precache.steps"], "ARRAY_RECORD_OPTIONS", "group_size:1")
    old, _ = build_cache(**sample_args(), out=str(tmp_path / "old"), backend="array_record", num_workers=1)
    assert os.path.basename(old) != os.path.basename(path)  # the options are part of the key
    old_src = pl.open_cache(old)
    assert "written compressed" in old_src.fork_hazard
    old_src[[0, 1]]  # the parent has read from it: its reader's thread runs here now
    with iter(pl.DataLoader(old_src, global_batch_size=4, seq_len=64, num_workers=2)) as it:
        got = [next(it) for _ in range(3)]
        assert it._engine.start_method in ("forkserver", "spawn")
    with iter(pl.DataLoader(old_src, global_batch_size=4, seq_len=64)) as it:
        want = [next(it) for _ in range(3)]   # in this process it reads fine
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(got, want) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["arrow", "array_record"])
def test_a_cache_pickles_as_what_reopens_it_and_grains_workers_read_it(tmp_path, backend):
    # Grain's DataLoader pickles its data source into each worker process.
    import pickle

    import grain

    import portable_loader as pl
    from portable_loader.precache import sample_args

    src = pl.open_cache(pl.precache(**sample_args(), out=str(tmp_path), backend=backend, split="train[:64]"))
    src[0]  # maps, readers and locks now exist in this process
    data = pickle.dumps(src)
    assert len(data) < 16_000  # the path and manifest, not the records
    copy = pickle.loads(data)
    assert all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(copy[:], src[:]))
    from absl import flags

    flags.FLAGS.mark_as_parsed()  # Grain's workers read its absl flags, which only an absl app parses
    sampler = grain.samplers.IndexSampler(len(src), shard_options=grain.sharding.NoSharding(), shuffle=False, num_epochs=1)
    loader = grain.DataLoader(data_source=src, sampler=sampler, worker_count=2)
    got = [r["input_ids"].tolist() for r in loader]
    assert got == [r["input_ids"].tolist() for r in src[:]]
