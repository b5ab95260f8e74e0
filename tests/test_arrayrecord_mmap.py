"""ArrayRecord shards read from a memory map (cache/armap.py) give what the library's reader gives.

Oracles: ``ArrayRecordReader.read`` on the same files (and the records written), the same source
with the library path forced (``mapped=False``) for whole loader streams, random index batches
(hypothesis). Records above 64 KiB, empty ones and chunk headers split by a block header are all met.
"""

import os

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter
from hypothesis import given, settings
from hypothesis import strategies as st

import portable_loader as pl
from conftest import spans_records
from portable_loader.cache import FORMAT_VERSION, ShardWriter, write_manifest
from portable_loader.cache import writer as writer_module
from portable_loader.cache.armap import BLOCK, USABLE, index_shard, read_record
from portable_loader.cache.readers import ArrayRecordCacheSource
from portable_loader.errors import CacheError

SHARDS = 5


def write_cache(path, lengths: list[list[int]], seed: int, options: str = writer_module.ARRAY_RECORD_OPTIONS):
    """Shards of random records with these token counts; returns the records as (ids, mask) lists."""
    rng = np.random.default_rng(seed)
    os.makedirs(path)
    shards, records = [], []
    old, writer_module.ARRAY_RECORD_OPTIONS = writer_module.ARRAY_RECORD_OPTIONS, options
    try:
        for s, counts in enumerate(lengths):
            w = ShardWriter(os.path.join(path, f"data-{s:05d}-of-{len(lengths):05d}.array_record"), "array_record")
            for k in counts:
                ids, mask = rng.integers(0, 2**31 - 1, k, dtype=np.int32), rng.integers(0, 2, k, dtype=np.uint8)
                w.write(ids, mask)
                records.append((ids.tolist(), mask.tolist()))
            shards.append(w.close())
    finally:
        writer_module.ARRAY_RECORD_OPTIONS = old
    n = len(records)
    counts = {"rows_in": n, "rows_out": n, "dropped": {}, "truncated": 0, "tokens": 0, "trainable_tokens": 0}
    write_manifest(path, {"format_version": FORMAT_VERSION, "backend": "array_record", "key": "a" * 64,
                          "counts": counts, "content_checksum": "", "shards": shards,
                          "array_record_options": options})
    return records


def random_lengths(rng, n: int) -> list[int]:
    """Mostly short records, some empty, some of 14k-40k tokens (70-200 KB: across block headers)."""
    kind = rng.choice(4, size=n, p=[0.08, 0.6, 0.27, 0.05])
    return [0 if k == 0 else int(rng.integers(1, 300)) if k == 1 else int(rng.integers(300, 4000)) if k == 2
            else int(rng.integers(14000, 40000)) for k in kind]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    rng = np.random.default_rng(7)
    path = str(tmp_path_factory.mktemp("armap") / "cache")
    lengths = [random_lengths(rng, n) for n in (260, 1, 0, 180, 310)]
    assert len(lengths) == SHARDS
    return path, write_cache(path, lengths, seed=8)


def as_tuple(record):
    return record["input_ids"].tolist(), record["loss_mask"].tolist()



@pytest.mark.slow
def test_every_record_is_the_librarys(cache):
    path, expected = cache
    src, lib = pl.open_cache(path), ArrayRecordCacheSource(path, pl.open_cache(path).manifest, mapped=False)
    assert src.mapped and not lib.mapped and len(src) == len(expected)
    assert [as_tuple(r) for r in src[0 : len(src)]] == expected == [as_tuple(r) for r in lib[0 : len(lib)]]
    everything = np.arange(len(src), dtype=np.int64)
    assert spans_records(src.spans(everything)) == expected
    assert src.lengths(everything).tolist() == [len(ids) for ids, _ in expected]
    crossing = sum(int(src._shard(s)[5].sum()) for s in range(SHARDS))
    big = sum(len(ids) * 5 > BLOCK for ids, _ in expected)
    assert big >= 10 and crossing > big  # long records, and short ones split by a block header


@pytest.mark.slow
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_random_batches_match_the_library(cache, data):
    path, expected = cache
    n = len(expected)
    src = pl.open_cache(path)
    lib = ArrayRecordCacheSource(path, src.manifest, mapped=False)
    idx = data.draw(st.lists(st.integers(-n, n - 1), max_size=data.draw(st.sampled_from([8, 64, 300]))))
    want = [as_tuple(r) for r in lib.__getitems__(idx)]
    assert want == [expected[i] for i in idx]
    as_array = np.asarray([i % n for i in idx], dtype=np.int64)
    assert [as_tuple(r) for r in src.__getitems__(idx)] == want
    assert spans_records(src.spans(as_array)) == want == spans_records(src.spans(idx))
    assert src.lengths(idx).tolist() == lib.lengths(idx).tolist()


@pytest.mark.parametrize("packing", [False, True])
def test_loader_streams_equal_the_library_path(cache, packing):
    path, _ = cache
    opened = pl.open_cache(path)
    streams = []
    for source in (opened, ArrayRecordCacheSource(path, opened.manifest, mapped=False)):
        loader = pl.DataLoader(source, global_batch_size=8, seq_len=512, packing=packing, seed=3)
        with iter(loader) as it:
            streams.append([next(it) for _ in range(12)])
    for a, b in zip(*streams):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_workers_read_their_own_maps(cache):
    path, _ = cache
    opened = pl.open_cache(path)
    batches = []
    for source, workers in ((opened, 2), (ArrayRecordCacheSource(path, opened.manifest, mapped=False), 0)):
        with iter(pl.DataLoader(source, global_batch_size=4, seq_len=256, num_workers=workers, seed=1)) as it:
            batches.append([next(it)["input_ids"] for _ in range(6)])
    assert all(np.array_equal(a, b) for a, b in zip(*batches))


def test_a_compressed_shard_reads_through_the_library(tmp_path):
    rng = np.random.default_rng(1)
    path = str(tmp_path / "old")
    expected = write_cache(path, [random_lengths(rng, 40), random_lengths(rng, 30)], seed=2, options="group_size:1")
    src = pl.open_cache(path)
    assert not src.mapped and src.fork_hazard
    assert [as_tuple(r) for r in src[0 : len(src)]] == expected


@pytest.mark.parametrize("options, problem", [("group_size:1", "footer is compressed"),
                                              ("group_size:2,uncompressed", "footer lists 10 chunks of 20 records")])
def test_a_shard_not_as_its_manifest_says_is_refused(tmp_path, options, problem):
    rng = np.random.default_rng(4)
    path = str(tmp_path / "liar")
    write_cache(path, [random_lengths(rng, 20)], seed=5, options=options)
    manifest = pl.open_cache(path).manifest
    manifest["array_record_options"] = writer_module.ARRAY_RECORD_OPTIONS  # the manifest now claims the mapped format
    src = ArrayRecordCacheSource(path, manifest)
    with pytest.raises(CacheError, match=f"data-00000-of-00001.array_record: .*{problem}"):
        src[[3]]


def test_a_shard_shorter_than_its_manifest_is_refused(cache):
    path, _ = cache
    manifest = pl.open_cache(path).manifest
    manifest["shards"][0] = dict(manifest["shards"][0], rows=manifest["shards"][0]["rows"] + 1)
    with pytest.raises(CacheError, match="data-00000-of-00005.array_record: .*of 261 records: its footer lists 260 chunks"):
        ArrayRecordCacheSource(path, manifest)[[0]]


def test_block_headers_anywhere_in_a_chunk(tmp_path):
    """A first record of each size around a block's usable bytes puts the next chunk's header, its
    payload's start or its end at every offset around the block boundary."""
    seen_split_header = False
    for filler in range(USABLE - 260, USABLE - 120):
        file = str(tmp_path / f"f{filler}.array_record")
        w = ArrayRecordWriter(file, writer_module.ARRAY_RECORD_OPTIONS)
        records = [bytes([filler % 251]) * filler, b"", b"abcdefg", bytes(range(100)), b"z" * 70000]
        for r in records:
            w.write(r)
        w.close()
        ix = index_shard(file, len(records))
        reader = ArrayRecordReader(file)
        want = reader.read(list(range(len(records))))
        reader.close()
        got = [read_record(ix.view, p, n) for p, n in zip(ix.pos.tolist(), ix.size.tolist())]
        direct = [bytes(ix.view[p : p + n]) for p, n, c in zip(ix.pos.tolist(), ix.size.tolist(), ix.cross) if not c]
        assert got == want == records and direct == [r for r, c in zip(records, ix.cross) if not c]
        p = int(ix.pos[0])
        second = (p // BLOCK) * USABLE + p % BLOCK - 24 + filler  # the second chunk's header, in block payload bytes
        seen_split_header |= second % USABLE + 40 > USABLE
    assert seen_split_header


@pytest.mark.parametrize("at, value, problem", [(40, 1, "a compressed chunk"), (24, ord("t"), "chunk type 't'"),
                                                (8, 99, "data size does not match")])
def test_a_damaged_chunk_header_is_refused(tmp_path, at, value, problem):
    """One byte of one record chunk changed (its compression, type or data size byte): refused,
    naming the file and the chunk, never served."""
    from portable_loader.cache.armap import _chunk_offsets, _physical, _usable

    rng = np.random.default_rng(6)
    path = str(tmp_path / "damaged")
    write_cache(path, [random_lengths(rng, 30)], seed=7)
    manifest = pl.open_cache(path).manifest
    file = os.path.join(path, "data-00000-of-00001.array_record")
    data = bytearray(open(file, "rb").read())
    begin = int(_chunk_offsets(np.frombuffer(bytes(data), np.uint8), file, 30)[17])
    data[_physical(_usable(begin) + at)] = value
    open(file, "wb").write(bytes(data))
    src = ArrayRecordCacheSource(path, manifest)
    with pytest.raises(CacheError, match=f"data-00000-of-00001.array_record: .*{problem}.*chunk at byte {begin}"):
        src.spans([0])

