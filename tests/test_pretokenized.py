"""pl.pretokenized (Megatron .bin/.idx, numpy, flat token files) and DataLoader(packing="concat").

References here are computed another way: documents by splitting Python lists at EOS, windows by
slicing the concatenated corpus, segment numbers and positions by walking the document boundaries
in plain Python, and the concat stream of a pretokenized corpus against the same documents given as
a list of records (which takes the cumulative-lengths path instead of the token-file path).
megatron-core's own builder and reader are the oracle in tests/test_pretokenized_peers.py.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portable_loader as pl
from portable_loader.batch_size import rampup

EOS = 0


def write_megatron(prefix, docs, dtype=np.uint16, version=1, code=None):
    """A .bin/.idx pair in megatron-core's layout (the peers test checks it against megatron-core's builder)."""
    codes = {np.uint16: 8, np.int32: 4, np.uint8: 1, np.int64: 5}
    lengths = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * np.dtype(dtype).itemsize
    with open(f"{prefix}.bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d, dtype=dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", version, code or codes[dtype], len(docs), len(docs) + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(docs) + 1, dtype=np.int64).tobytes())
    return str(prefix)


def split_at_eos(tokens: list[int], eos: int) -> list[list[int]]:
    docs, cur = [], []
    for t in tokens:
        cur.append(t)
        if t == eos:
            docs.append(cur)
            cur = []
    return docs + ([cur] if cur else [])


def reference_row(doc_starts: set[int], lo: int, L: int) -> tuple[list[int], list[int]]:
    """Segment numbers and positions of the window at token ``lo``, walking token by token."""
    seg, pos, number, p = [], [], 0, 0
    for j in range(L):
        if j == 0 or lo + j in doc_starts:
            number, p = number + 1, 0
        seg.append(number)
        pos.append(p)
        p += 1
    return seg, pos


def epoch_rows(loader) -> list[dict]:
    rows = []
    with iter(loader) as it:
        for batch in it:
            for r in range(batch["input_ids"].shape[0]):
                if batch["attention_mask"][r].any():
                    rows.append({k: v[r] for k, v in batch.items()})
    return rows


corpora = st.lists(st.lists(st.integers(1, 300), min_size=0, max_size=40), min_size=1, max_size=30)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(docs=corpora, dtype=st.sampled_from(["uint16", "uint32", "npy"]), trailing=st.booleans())
def test_eos_files_split_into_the_documents_a_python_split_finds(tmp_path_factory, docs, dtype, trailing):
    tokens = [t for d in docs for t in d + [EOS]]
    if not trailing and tokens:
        tokens = tokens[:-1]
    d = tmp_path_factory.mktemp("eos")
    if dtype == "npy":
        path = str(d / "t.npy")
        np.save(path, np.array(tokens, dtype=np.uint32))
        ds = pl.pretokenized(path, eos_token_id=EOS)
    else:
        path = str(d / "t.bin")
        np.array(tokens, dtype=dtype).tofile(path)
        ds = pl.pretokenized(path, format="numpy", dtype=dtype, eos_token_id=EOS)
    want = split_at_eos(tokens, EOS)
    assert len(ds) == len(want) and ds.num_tokens == len(tokens)
    assert [r["input_ids"].tolist() for r in ds] == want
    if want:
        assert ds.lengths(np.arange(len(want))).tolist() == [len(w) for w in want]


def test_flat_without_eos_is_one_document_per_file_and_records_are_views_of_the_map(tmp_path):
    np.arange(1, 11, dtype=np.uint16).tofile(tmp_path / "a.bin")
    np.arange(20, 25, dtype=np.uint16).tofile(tmp_path / "b.bin")
    ds = pl.pretokenized([str(tmp_path / "a.bin"), str(tmp_path / "b.bin")], format="flat")
    assert len(ds) == 2 and ds.num_tokens == 15
    first = ds[0]["input_ids"]
    assert first.tolist() == list(range(1, 11)) and not first.flags.owndata  # mapped, not copied


def test_megatron_documents_and_auto_detection(tmp_path):
    docs = [[5, 6, 7], [8], [9, 10, 11, 12], [13, 14]]
    prefix = write_megatron(tmp_path / "corpus_text_document", docs, np.int32)
    for path in (prefix, prefix + ".bin", prefix + ".idx"):
        ds = pl.pretokenized(path)
        assert [r["input_ids"].tolist() for r in ds] == docs
        assert ds[1]["input_ids"].dtype == np.int32
    assert pl.pretokenized(prefix, format="megatron").lengths([2, 0]).tolist() == [4, 3]


@pytest.mark.parametrize("damage, message", [
    ("short_bin", "does not match"),
    ("long_bin", "does not match"),
    ("version", "index version 2"),
    ("code", "unknown dtype code 99"),
    ("magic", "not a Megatron index"),
    ("short_idx", "truncated"),
])
def test_a_broken_megatron_pair_is_refused_naming_the_file(tmp_path, damage, message):
    prefix = str(tmp_path / "c")
    docs = [[1, 2, 3], [4, 5]]
    write_megatron(prefix, docs, np.uint16, version=2 if damage == "version" else 1,
                   code=99 if damage == "code" else None)
    if damage == "short_bin":
        with open(prefix + ".bin", "r+b") as f:
            f.truncate(6)
    elif damage == "long_bin":
        with open(prefix + ".bin", "ab") as f:
            f.write(b"\x00\x00")
    elif damage == "magic":
        with open(prefix + ".idx", "r+b") as f:
            f.write(b"NOTANIDX")
    elif damage == "short_idx":
        with open(prefix + ".idx", "r+b") as f:
            f.truncate(os.path.getsize(prefix + ".idx") - 8)
    with pytest.raises(ValueError, match=message) as err:
        pl.pretokenized(prefix, format="megatron")
    assert "c.idx" in str(err.value) or "c.bin" in str(err.value)


def test_bad_arguments_say_what_is_wrong(tmp_path):
    path = str(tmp_path / "t.bin")
    np.arange(1, 100, dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match="unknown dtype"):
        pl.pretokenized(path, dtype="uint17")
    with pytest.raises(ValueError, match="not a token type"):
        pl.pretokenized(path, dtype="float32")
    with pytest.raises(ValueError, match="format"):
        pl.pretokenized(path, format="parquet")
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        pl.pretokenized(str(tmp_path / "nope.bin"))
    ds = pl.pretokenized(path, eos_token_id=50)
    with pytest.raises(IndexError, match=r"document 7 is out of range: .*t\.bin holds 2 documents"):
        ds.__getitems__([0, 7])
    with pytest.raises(ValueError, match="seq_len 1000 is larger than the whole corpus"):
        pl.DataLoader(ds, global_batch_size=2, seq_len=1000, packing="concat")
    with pytest.raises(ValueError, match="does not apply to packing='concat'"):
        pl.DataLoader(ds, global_batch_size=2, seq_len=8, packing="concat", overlong="split")
    with pytest.raises(ValueError, match="packing must be"):
        pl.DataLoader(ds, global_batch_size=2, seq_len=8, packing="best")


@settings(max_examples=25, deadline=None, derandomize=True)
@given(docs=st.lists(st.lists(st.integers(1, 300), min_size=0, max_size=30), min_size=1, max_size=40),
       L=st.integers(1, 24), B=st.integers(1, 5), seed=st.integers(0, 2**32), megatron=st.booleans())
def test_one_concat_epoch_is_every_window_once_with_segments_at_document_starts(tmp_path_factory, docs, L, B, seed,
                                                                                megatron):
    d = tmp_path_factory.mktemp("concat")
    if megatron:
        docs = [x for x in docs if x] or [[1]]
        ds = pl.pretokenized(write_megatron(d / "m", docs))
        flat = [t for x in docs for t in x]
        starts, at = set(), 0
        for x in docs:
            starts.add(at)
            at += len(x)
    else:
        flat = [t for x in docs for t in x + [EOS]]
        np.array(flat, dtype=np.uint16).tofile(d / "f.bin")
        ds = pl.pretokenized(str(d / "f.bin"), eos_token_id=EOS)
        starts = {j + 1 for j, t in enumerate(flat) if t == EOS}
    n = len(flat) // L
    if n < 1:
        with pytest.raises(ValueError, match="larger than the whole corpus"):
            pl.DataLoader(ds, global_batch_size=B, seq_len=L, packing="concat")
        return
    rows = epoch_rows(pl.DataLoader(ds, global_batch_size=B, seq_len=L, seed=seed, packing="concat", num_epochs=1))
    assert len(rows) == n
    seen = set()
    for row in rows:
        ids = row["input_ids"].tolist()
        # which window: the row's tokens and its segments must match that slice of the corpus
        k = next(k for k in range(n) if k not in seen and flat[k * L : (k + 1) * L] == ids
                 and reference_row(starts, k * L, L) == (row["segment_ids"].tolist(), row["positions"].tolist()))
        seen.add(k)
        assert row["attention_mask"].all() and row["loss_mask"].all()
    assert seen == set(range(n))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(7)
    docs = [rng.integers(1, 5000, rng.integers(1, 300)).tolist() for _ in range(800)]
    path = tmp_path_factory.mktemp("corpus") / "c.bin"
    np.array([t for d in docs for t in d + [EOS]], dtype=np.uint16).tofile(path)
    return str(path), docs


def test_the_token_file_path_equals_the_records_path_bit_for_bit(corpus):
    path, docs = corpus
    ds = pl.pretokenized(path, eos_token_id=EOS)
    records = [{"input_ids": np.array(d + [EOS], dtype=np.int32)} for d in docs]
    a = pl.DataLoader(ds, global_batch_size=4, seq_len=128, seed=3, packing="concat", num_epochs=1)
    b = pl.DataLoader(records, global_batch_size=4, seq_len=128, seed=3, packing="concat", num_epochs=1)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


def flat_stream(loader, steps):
    with iter(loader) as it:
        return np.concatenate([next(it)["input_ids"] for _ in range(steps)])


def test_the_stream_is_the_same_for_any_worker_and_host_count(corpus):
    path, _ = corpus
    ds = pl.pretokenized(path, eos_token_id=EOS)
    base = pl.DataLoader(ds, global_batch_size=8, seq_len=64, seed=1, packing="concat")
    want = flat_stream(base, 12)
    two = pl.DataLoader(ds, global_batch_size=8, seq_len=64, seed=1, packing="concat", num_workers=2)
    assert np.array_equal(flat_stream(two, 12), want)
    hosts = [flat_stream(base.with_shard(k, 4), 12).reshape(12, 2, 64) for k in range(4)]
    assert np.array_equal(np.concatenate(hosts, axis=1).reshape(-1, 64), want)


def test_resume_at_another_batch_size_and_worker_count_continues_the_window_stream(corpus):
    path, _ = corpus
    ds = pl.pretokenized(path, eos_token_id=EOS)
    want = flat_stream(pl.DataLoader(ds, global_batch_size=8, seq_len=64, seed=5, packing="concat"), 20)
    with iter(pl.DataLoader(ds, global_batch_size=8, seq_len=64, seed=5, packing="concat")) as it:
        head = np.concatenate([next(it)["input_ids"] for _ in range(7)])
        state = json.loads(json.dumps(it.get_state()))
    resumed = pl.DataLoader(ds, global_batch_size=4, seq_len=64, seed=5, packing="concat", num_workers=2)
    with iter(resumed) as it:
        it.set_state(state)
        tail = np.concatenate([next(it)["input_ids"] for _ in range(10)])
    assert np.array_equal(np.concatenate([head, tail]), want[: 56 + 40])


def test_a_batch_size_rampup_cuts_the_same_window_stream(corpus):
    path, _ = corpus
    ds = pl.pretokenized(path, eos_token_id=EOS)
    fixed = flat_stream(pl.DataLoader(ds, global_batch_size=2, seq_len=32, seed=2, packing="concat"), 60)
    ramp = rampup(2, 2, 16, 8)
    with iter(pl.DataLoader(ds, global_batch_size=ramp, seq_len=32, seed=2, packing="concat")) as it:
        got = []
        while sum(len(g) for g in got) < 120:
            got.append(next(it)["input_ids"])
    sizes = [len(g) for g in got]
    assert sizes[0] == 2 and max(sizes) == 8 and sorted(sizes) == sizes
    assert np.array_equal(np.concatenate(got)[:120], fixed[:120])


@pytest.mark.slow
def test_the_state_is_small_and_does_not_grow(corpus):
    path, _ = corpus
    ds = pl.pretokenized(path, eos_token_id=EOS)
    states = {}
    with iter(pl.DataLoader(ds, global_batch_size=2, seq_len=8, seed=0, packing="concat", prefetch=0)) as it:
        for step in range(1, 10_001):
            next(it)
            if step in (10, 10_000):
                states[step] = json.dumps(it.get_state())
    # the same fields; only the counters' digits differ (the counters: step, samples, epoch-free position)
    blank = {k: "".join("9" if c.isdigit() else c for c in s) for k, s in states.items()}
    assert len(states[10_000]) < 1024 and json.loads(blank[10]).keys() == json.loads(blank[10_000]).keys()
    assert len(states[10_000]) - len(states[10]) <= 3 * 4  # three counters, three more digits each at most


def test_a_second_epoch_reorders_the_same_windows(corpus):
    path, _ = corpus
    ds = pl.pretokenized(path, eos_token_id=EOS)
    n = ds.num_tokens // 256
    rows = flat_stream(pl.DataLoader(ds, global_batch_size=n, seq_len=256, seed=4, packing="concat"), 2)
    first, second = rows[:n], rows[n:]
    assert sorted(map(bytes, first)) == sorted(map(bytes, second)) and not np.array_equal(first, second)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_token_share_mixture_of_corpora_holds_its_shares(tmp_path, workers):
    rng = np.random.default_rng(0)
    for name, lo, mean in (("a", 1, 40), ("b", 1000, 400)):  # very different document lengths
        docs = [rng.integers(lo, lo + 900, rng.integers(1, 2 * mean)).tolist() + [EOS] for _ in range(3000 * 40 // mean)]
        np.array([t for d in docs for t in d], dtype=np.uint16).tofile(tmp_path / f"{name}.bin")
    a = pl.pretokenized(str(tmp_path / "a.bin"), eos_token_id=EOS)
    b = pl.pretokenized(str(tmp_path / "b.bin"), eos_token_id=EOS)
    m = pl.mix({"a": a, "b": b}, {"a": 0.3, "b": 0.7}, unit="tokens")
    counts = {"a": 0, "b": 0}
    with iter(pl.DataLoader(m, global_batch_size=8, seq_len=128, seed=0, packing="concat", num_workers=workers)) as it:
        for _ in range(200):
            batch = next(it)
            ids = batch["input_ids"]
            after_eos = np.concatenate([np.ones((8, 1), bool), ids[:, :-1] == EOS], axis=1)
            assert np.array_equal(batch["positions"] == 0, after_eos)  # each source's own document starts
            assert np.array_equal(np.cumsum(after_eos, axis=1), batch["segment_ids"])
            counts["a"] += int(((ids >= 1) & (ids < 1000)).sum())
            counts["b"] += int((ids >= 1000).sum())
        sources = it.stats["sources"]
    share = counts["a"] / (counts["a"] + counts["b"])
    assert abs(share - 0.3) < 0.01
    assert sources["a"]["tokens"] + sources["b"]["tokens"] == 200 * 8 * 128


def test_a_mapped_pretokenized_dataset_concats_too(corpus):
    path, _ = corpus
    ds = pl.pretokenized(path, eos_token_id=EOS)
    shifted = ds.map(lambda r: {"input_ids": r["input_ids"].astype(np.int32) + 1}, keeps_lengths=True)
    a = flat_stream(pl.DataLoader(ds, global_batch_size=4, seq_len=64, seed=9, packing="concat"), 5)
    b = flat_stream(pl.DataLoader(shifted, global_batch_size=4, seq_len=64, seed=9, packing="concat"), 5)
    assert np.array_equal(a + 1, b)


def test_a_sparse_ten_billion_token_file_opens_without_reading_it(tmp_path):
    path = tmp_path / "huge.bin"
    with open(path, "wb") as f:
        f.truncate(2 * 10**10)  # 10^10 uint16 tokens, 20 GB apparent, no disk used
    proc = psutil.Process()
    before = proc.memory_info().rss
    ds = pl.pretokenized(str(path), format="flat")
    loader = pl.DataLoader(ds, global_batch_size=8, seq_len=2048, seed=0, packing="concat", prefetch=0)
    with iter(loader) as it:
        batch = next(it)
        state = json.dumps(it.get_state())
    grown = proc.memory_info().rss - before
    assert batch["input_ids"].shape == (8, 2048) and len(loader.source) == 10**10 // 2048
    assert grown < 200 * 2**20, f"the process grew by {grown / 2**20:.0f} MiB"
    assert len(state) < 1024
