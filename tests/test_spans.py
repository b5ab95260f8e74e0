"""The cache fast path: ``spans`` (where records' tokens lie), ``collate_spans`` and the engine's
read-ahead give exactly what the record-dict path gives.

Oracles: the records ``__getitems__`` returns (for ``spans``), ``collate`` over those records (for
``collate_spans``), and a loader over the same cache seen through ``.map`` (no ``spans``: the
record-dict path, one read per step) for whole streams: padded, packed, dropped records, two
hosts, a batch-size schedule, epochs and chunk boundaries, resumes, a prefetch thread, workers.
"""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portable_loader as pl
from portable_loader.cache import FORMAT_VERSION, ShardWriter, write_manifest
from portable_loader.cache import writer as writer_module
from portable_loader.collate import _RUN_MAX, FIELDS, collate, collate_spans

N = 300


def write_cache(path, backend: str, n: int, seed: int, key: str | None = None) -> str:
    """``n`` random records (lengths 0-150) in 3 shards; Arrow shards in batches of 7 records, so
    that a read meets many shard batches (what the vectorized locate groups by)."""
    rng = np.random.default_rng(seed)
    os.makedirs(path)
    shards, per = [], -(-n // 3)
    for s in range(3):
        w = ShardWriter(os.path.join(path, f"data-{s:05d}-of-00003.{backend}"), backend)
        for _ in range(s * per, min(n, (s + 1) * per)):
            k = int(rng.integers(0, 151))
            w.write(rng.integers(0, 2**31 - 1, k, dtype=np.int32), rng.integers(0, 2, k, dtype=np.uint8))
        shards.append(w.close())
    counts = {"rows_in": n, "rows_out": n, "dropped": {}, "truncated": 0, "tokens": 0, "trainable_tokens": 0}
    extra = {"array_record_options": writer_module.ARRAY_RECORD_OPTIONS} if backend == "array_record" else {}
    write_manifest(path, {"format_version": FORMAT_VERSION, "backend": backend, "key": key or backend.ljust(64, "0"),
                          "counts": counts, "content_checksum": "", "shards": shards, **extra})
    return str(path)


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    base = tmp_path_factory.mktemp("spans")
    old = writer_module._BATCH_ROWS
    writer_module._BATCH_ROWS = 7
    try:
        for backend in ("arrow", "array_record"):
            write_cache(str(base / backend), backend, N, seed=3)
    finally:
        writer_module._BATCH_ROWS = old
    return {b: str(base / b) for b in ("arrow", "array_record")}


def span_record(spans, k):
    ids = bytes(spans.ids[spans.buf[k]][spans.ids_at[k] : spans.ids_at[k] + 4 * spans.length[k]])
    mask = bytes(spans.masks[spans.buf[k]][spans.mask_at[k] : spans.mask_at[k] + spans.length[k]])
    return np.frombuffer(ids, np.int32).tolist(), list(mask)


# Few indices, many among many shard batches (both Python loops), and many more than shard
# batches (vectorized, grouped by shard batch); repeats and negatives.
indices = st.one_of(st.lists(st.integers(-N, N - 1), max_size=20),
                    st.lists(st.integers(-N, N - 1), min_size=65, max_size=400),
                    st.builds(lambda seed, n: np.random.default_rng(seed).integers(-N, N, n).tolist(),
                              st.integers(0, 2**32 - 1), st.integers(800, 3000)))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["arrow", "array_record"])
@settings(max_examples=40, deadline=None)
@given(idx=indices, as_array=st.booleans())
def test_spans_hold_the_records_getitems_returns(caches, backend, idx, as_array):
    src = pl.open_cache(caches[backend])
    key = np.asarray(idx, dtype=np.int64) if as_array else idx
    spans, records = src.spans(key), src.__getitems__(idx)
    assert len(spans.length) == len(records)
    for k, r in enumerate(records):
        assert span_record(spans, k) == (r["input_ids"].tolist(), r["loss_mask"].tolist())


@pytest.mark.parametrize("backend", ["arrow", "array_record"])
def test_spans_refuse_an_index_out_of_range(caches, backend):
    with pytest.raises(IndexError, match=f"record index {N}"):
        pl.open_cache(caches[backend]).spans([0, N])


def fields_strategy():
    extra = st.lists(st.sampled_from(["loss_mask", "segment_ids", "positions"]), unique=True)
    return st.builds(lambda e: ("input_ids", "attention_mask", *e), extra) | st.just(("input_ids", "segment_ids"))


@st.composite
def row_plans(draw):
    """Rows of pieces (record, start, end): ends past the record, empty pieces and rows, repeats,
    and rows of more pieces than collate's ready segment runs cover (``_RUN_MAX``)."""
    rows = []
    for _ in range(draw(st.integers(0, 6))):
        row = []
        for _ in range(draw(st.integers(0, 5) | st.integers(_RUN_MAX - 3, _RUN_MAX + 5))):
            i = draw(st.integers(0, N - 1))
            start = draw(st.integers(0, 160))
            row.append((i, start, start + draw(st.integers(0, 160))))
        rows.append(row)
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["arrow", "array_record"])
@settings(max_examples=60, deadline=None)
@given(rows=row_plans(), fields=fields_strategy(), pad_id=st.sampled_from([0, 7]))
def test_collate_spans_equals_collate_over_the_records(caches, backend, rows, fields, pad_id):
    src = pl.open_cache(caches[backend])
    seq_len = max([sum(max(0, min(e, 150) - s) for _, s, e in row) for row in rows] + [1])
    wanted = sorted({p[0] for row in rows for p in row})
    records = dict(zip(wanted, src.__getitems__(wanted)))
    # Pieces never start past their record's end in a plan; collate and collate_spans agree on that.
    rows = [[(i, min(s, records[i]["input_ids"].size), e) for i, s, e in row] for row in rows]
    want = collate(rows, records, seq_len, pad_id, fields)
    got = collate_spans(rows, src.spans(wanted), dict(zip(wanted, range(len(wanted)))), seq_len, pad_id, fields)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name


def generic(src):
    """The same records through ``.map``: no ``spans``, so the loader takes the record-dict path."""
    return pl.source(src).map(lambda r: r, name="identity", keeps_lengths=True)


def same(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b))


def take(it, k):
    return [next(it) for _ in range(k)]


CONFIGS = {
    # 600 steps of 8 cross the planner's chunk of 4,096 positions and several epochs of 300 records.
    "padded": (dict(global_batch_size=8, seq_len=96), 600),
    "padded, overlong dropped": (dict(global_batch_size=8, seq_len=96, overlong="drop"), 300),
    "padded, host 1 of 2": (dict(global_batch_size=8, seq_len=96, shard_index=1, shard_count=2), 600),
    "padded, batch-size schedule, host 2 of 3": (
        dict(global_batch_size=[(0, 6), (100, 12)], seq_len=64, shard_index=2, shard_count=3), 300),
    "packed": (dict(global_batch_size=4, seq_len=256, packing=True, packing_window=64), 300),
    "packed, records split": (dict(global_batch_size=4, seq_len=64, packing=True, packing_window=64,
                                   overlong="split"), 200),
    "packed, host 0 of 2": (dict(global_batch_size=4, seq_len=256, packing=True, packing_window=64,
                                 shard_index=0, shard_count=2), 200),
    "padded, prefetch thread": (dict(global_batch_size=8, seq_len=96, prefetch=2), 600),
    "padded, all fields, pad_id 5": (dict(global_batch_size=8, seq_len=96, fields=FIELDS, pad_id=5), 200),
}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["arrow", "array_record"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_loader_over_a_cache_equals_the_record_path(caches, backend, name):
    kw, steps = CONFIGS[name]
    kw = dict(dict(seed=11, prefetch=0), **kw)
    src = pl.open_cache(caches[backend])
    with iter(pl.DataLoader(src, **kw)) as fast, iter(pl.DataLoader(generic(src), **kw)) as slow:
        assert same(take(fast, steps), take(slow, steps))


@pytest.mark.parametrize("backend", ["arrow", "array_record"])
@pytest.mark.parametrize("packing", [False, True])
def test_resume_mid_chunk_and_across_its_end_is_exact(caches, backend, packing):
    """A state taken 10 steps before the end of a chunk (or inside a window) resumes on a fresh
    iterator (its read-ahead starts where the state points) with the uninterrupted batches."""
    kw = dict(global_batch_size=8, seq_len=256 if packing else 96, seed=2, packing=packing, prefetch=0,
              packing_window=64)
    loader = pl.DataLoader(pl.open_cache(caches[backend]), **kw)
    at = 30 if packing else 4096 // 8 - 10
    it = iter(loader)
    take(it, at)
    state = it.get_state()
    want = take(it, 25)
    resumed = iter(loader)
    resumed.set_state(state)
    assert same(take(resumed, 25), want)


@pytest.mark.parametrize("backend", ["arrow", "array_record"])
def test_worker_processes_give_the_same_batches(caches, backend):
    kw = dict(global_batch_size=4, seq_len=256, seed=4, packing=True, packing_window=64)
    src = pl.open_cache(caches[backend])
    with iter(pl.DataLoader(src, num_workers=2, **kw)) as workers:
        got = take(workers, 40)
    with iter(pl.DataLoader(generic(src), prefetch=0, **kw)) as slow:
        assert same(got, take(slow, 40))


@pytest.mark.parametrize("backend", ["arrow", "array_record"])
def test_a_row_longer_than_seq_len_is_refused(caches, backend):
    """A plan whose row holds more tokens than ``seq_len`` is an error (``collate`` raises one too),
    never a silent spill into the next row of the flat output."""
    src = pl.open_cache(caches[backend])
    lengths = src.lengths(np.arange(N))
    i, j = (int(k) for k in np.flatnonzero(lengths >= 20)[:2])
    rows = [[(i, 0, 20), (j, 0, 20)], []]
    with pytest.raises(ValueError):
        collate(rows, dict(zip([i, j], src.__getitems__([i, j]))), 30, 0, FIELDS)
    with pytest.raises(ValueError, match="does not fit seq_len 30"):
        collate_spans(rows, src.spans([i, j]), {i: 0, j: 1}, 30, 0, FIELDS)


@pytest.fixture(scope="module")
def compressed(caches, tmp_path_factory):
    """The Arrow cache with every shard rewritten LZ4-compressed: its buffers are decompressed into
    memory at open, outside the file's mapping, so its records are located per shard batch, not
    from the file's mapped words."""
    import json

    import pyarrow as pa

    from portable_loader.io.tables import file_digest

    path, out = caches["arrow"], str(tmp_path_factory.mktemp("lz4") / "cache")
    os.makedirs(out)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    for shard in manifest["shards"]:
        table = pa.ipc.open_stream(pa.memory_map(os.path.join(path, shard["file"]))).read_all()
        target = os.path.join(out, shard["file"])
        with pa.OSFile(target, "wb") as sink, pa.ipc.new_stream(
                sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="lz4")) as w:
            for batch in table.to_batches():
                w.write_batch(batch)
        shard.update(bytes=os.path.getsize(target), sha256=file_digest(target))
    write_manifest(out, manifest)
    return out


@settings(max_examples=25, deadline=None)
@given(idx=st.builds(lambda seed, n: np.random.default_rng(seed).integers(0, N, n), st.integers(0, 2**32 - 1),
                     st.integers(65, 3000)))
def test_a_compressed_cache_locates_the_same_spans_and_lengths(caches, compressed, idx):
    plain, packed = pl.open_cache(caches["arrow"]), pl.open_cache(compressed)
    assert plain._word_base is not None and packed._word_base is None  # the two ways of locating
    want = [len(r["input_ids"]) for r in plain.__getitems__(idx)]
    assert plain.lengths(idx).tolist() == packed.lengths(idx).tolist() == want
    a, b = plain.spans(idx), packed.spans(idx)
    for k in range(0, idx.size, 7):
        assert span_record(a, k) == span_record(b, k)


@pytest.mark.parametrize("size", [65, 300, 3000])
def test_a_large_lengths_call_gathers_without_keeping_spans(caches, compressed, monkeypatch, size):
    # Past KEEP_SPANS_MAX a lengths() call (a whole cache's) is one gather per shard file, or per
    # batch where a file's words are not at hand, or a loop over records of many batches: no spans kept
    from portable_loader.cache import readers

    monkeypatch.setattr(readers, "KEEP_SPANS_MAX", 64)
    plain, packed = pl.open_cache(caches["arrow"]), pl.open_cache(compressed)
    idx = np.random.default_rng(size).integers(0, N, size)
    want = [len(r["input_ids"]) for r in plain.__getitems__(idx)]
    for src in (plain, packed):
        assert src.lengths(idx).tolist() == want and src._sized is None
        assert src.lengths((idx - N).tolist()).tolist() == want  # negatives count from the end
