"""Pretraining token files against the peers' own writers and readers (issue 30).

* Megatron: corpora written by megatron-core's ``IndexedDatasetBuilder`` (uint16 and int32, random
  document lengths with many length-1 documents, documents of several items, several prefixes);
  every record of ``pl.pretokenized`` equals what megatron-core's ``IndexedDataset`` returns.
* The concat loader (``packing="concat"``): one epoch's rows are exactly the windows of the first
  (T // L) * L tokens of the concatenated corpus, once each; ``segment_ids`` change exactly at the
  record boundaries and ``positions`` restart there and at the row start.
* OLMo: token files written by OLMo-core's ``write_array_to_disk`` (raw, no .npy header, whatever
  the suffix); documents equal OLMo-core's ``iter_document_indices``; one file's windows equal
  OLMo-core's ``NumpyFSLDataset`` instances.
* nanoGPT: a flat uint16 ``train.bin`` (``ndarray.tofile``, read back by ``np.memmap`` as nanoGPT does),
  with and without an EOS.

The peers install as scripts/test.sh installs them; each test skips with the install line if its peer
is missing (tests/pretrain_peers.py).
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pretrain_peers import need_megatron, need_olmo

pl = pytest.importorskip("portable_loader")
if not hasattr(pl, "pretokenized"):
    pytest.skip("portable_loader.pretokenized not there yet (issue 30)", allow_module_level=True)

SETTINGS = settings(max_examples=6, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


# --- corpora ----------------------------------------------------------------------------------------


def random_lengths(rng: np.random.Generator, n: int, long: int = 300) -> np.ndarray:
    """Document lengths: a quarter are 1 token, the rest 1..long (some longer than a window)."""
    lengths = rng.integers(1, long + 1, n)
    lengths[rng.random(n) < 0.25] = 1
    return lengths


def random_tokens(rng: np.random.Generator, n: int, dtype) -> np.ndarray:
    high = 65_536 if np.dtype(dtype) == np.uint16 else 2**31 - 1  # int32: ids above 65535 too
    return rng.integers(0, high, n).astype(dtype)


def write_megatron(mc, prefix: str, rng: np.random.Generator, n_docs: int, dtype) -> list[np.ndarray]:
    """A .bin/.idx pair by megatron-core's own builder; some documents hold several items (the
    sentence-split layout). Returns the items in file order (what IndexedDataset[i] should give)."""
    import torch

    builder = mc.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    items = []
    for _ in range(n_docs):
        k = 1 if rng.random() < 0.7 else int(rng.integers(2, 4))
        parts = [random_tokens(rng, int(n), dtype) for n in random_lengths(rng, k)]
        if k == 1:
            builder.add_document(parts[0].astype(np.int64), [len(parts[0])])  # it takes any array-like
        else:
            for p in parts:
                builder.add_item(torch.from_numpy(p.astype(np.int64)))
            builder.end_document()
        items += parts
    builder.finalize(prefix + ".idx")
    return items


def megatron_records(mc, prefixes: list[str]) -> list[np.ndarray]:
    """Every record of the prefixes, in order, as megatron-core's reader returns them (copied: its
    arrays view an mmap that its ``__del__`` closes, so they dangle once the reader is gone)."""
    out = []
    for p in prefixes:
        ds = mc.IndexedDataset(p, multimodal=False, mmap=True)
        out += [np.array(ds[i]) for i in range(len(ds))]
        del ds
    return out


# --- the concat stream's oracle --------------------------------------------------------------------


def epoch_rows(loader) -> dict[str, np.ndarray]:
    fields = collections.defaultdict(list)
    for batch in loader:
        for k, v in batch.items():
            fields[k].append(np.asarray(v))
    return {k: np.concatenate(v) for k, v in fields.items()}


def expected_segments(doc_lengths: np.ndarray, start: int, L: int) -> tuple[np.ndarray, np.ndarray]:
    """segment_ids and positions of the window of tokens [start, start + L) of the stream whose
    documents have ``doc_lengths``: segments 1, 2, ... change at each document start inside the
    window; positions count from 0 at the window start and at each document start."""
    starts = np.concatenate([[0], np.cumsum(doc_lengths)[:-1]])
    doc = np.searchsorted(np.cumsum(doc_lengths), np.arange(start, start + L), side="right")
    seg = 1 + np.concatenate([[0], np.cumsum(doc[1:] != doc[:-1])])
    seg_start = np.maximum(starts[doc], start)
    return seg.astype(np.int32), (np.arange(start, start + L) - seg_start).astype(np.int32)


def check_epoch(loader, records: list[np.ndarray], L: int, B: int) -> None:
    """One epoch of ``loader`` against the concatenation of ``records``: every window of L tokens
    exactly once (the tail shorter than L dropped; the last batch filled up with padding rows), in a
    non-storage order when there are enough, with segment_ids / positions at the record boundaries,
    masks all ones, [B, L] int32 (masks uint8)."""
    stream = np.concatenate(records).astype(np.int64)
    lengths = np.array([len(r) for r in records])
    W = len(stream) // L
    rows = epoch_rows(loader)
    for k in ("input_ids", "loss_mask", "attention_mask", "segment_ids", "positions"):
        assert k in rows, f"missing field {k}: {sorted(rows)}"
        want = np.uint8 if k.endswith("mask") else np.int32  # the packed batches' dtypes (portable_loader.collate)
        assert rows[k].dtype == want and rows[k].shape[1:] == (L,), (k, rows[k].dtype, rows[k].shape)
    real = rows["attention_mask"].any(axis=1)
    total = len(real)
    assert total % B == 0 and total == -(-W // B) * B, f"{total} rows for {W} windows (B={B})"
    # the last batch is filled with padding rows (ids 0, masks 0, segment 0) where W % B != 0
    assert real[:W].all() and not real[W:].any(), "padding rows other than at the epoch's end"
    for k in ("input_ids", "loss_mask", "segment_ids", "positions"):
        assert (rows[k][W:] == 0).all(), f"padding rows hold {k} != 0"
    rows = {k: v[:W] for k, v in rows.items()}
    where = collections.defaultdict(list)
    for k in range(W):
        where[stream[k * L:(k + 1) * L].tobytes()].append(k)
    order = []
    for r in range(W):
        ids = rows["input_ids"][r].astype(np.int64)
        cands = where.get(ids.tobytes())
        assert cands, f"row {r} is not a window of the corpus stream (W={W}, L={L})"
        # identical windows (possible with tiny windows) are told apart by their segments
        for j, k in enumerate(cands):
            seg, pos = expected_segments(lengths, k * L, L)
            if np.array_equal(rows["segment_ids"][r], seg) and np.array_equal(rows["positions"][r], pos):
                order.append(cands.pop(j))
                break
        else:
            seg, pos = expected_segments(lengths, cands[0] * L, L)
            raise AssertionError(f"row {r} = window {cands[0]}: segment_ids {rows['segment_ids'][r].tolist()[:40]} "
                                 f"expected {seg.tolist()[:40]}; positions {rows['positions'][r].tolist()[:40]} "
                                 f"expected {pos.tolist()[:40]}")
    assert sorted(order) == list(range(W))  # every window exactly once
    assert (rows["attention_mask"] == 1).all() and (rows["loss_mask"] == 1).all()
    if W >= 20:
        assert order != sorted(order), "windows served in storage order"


# --- Megatron ----------------------------------------------------------------------------------------


corpus_spec = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1),
    "dtype": st.sampled_from([np.uint16, np.int32]),
    "files": st.lists(st.integers(1, 40), min_size=1, max_size=3),  # documents per prefix
})


def write_corpus(mc, folder: str, spec: dict, rng, stem: str) -> list[str]:
    """One Megatron prefix per entry of ``spec["files"]`` (that many documents), written by megatron-core."""
    prefixes = [os.path.join(folder, stem.format(i)) for i in range(len(spec["files"]))]
    for p, n in zip(prefixes, spec["files"]):
        write_megatron(mc, p, rng, n, spec["dtype"])
    return prefixes


@pytest.mark.slow
@SETTINGS
@given(spec=corpus_spec)
def test_megatron_records_equal_indexed_dataset(spec):
    mc = need_megatron()
    rng = np.random.default_rng(spec["seed"])
    with tempfile.TemporaryDirectory() as d:
        prefixes = write_corpus(mc, d, spec, rng, "part{}_text_document")
        for paths in ([prefixes[0]], prefixes):
            want = megatron_records(mc, paths)
            for kw in ({}, {"format": "megatron"}):
                ds = pl.pretokenized(paths if len(paths) > 1 else paths[0], **kw)
                assert len(ds) == len(want)
                assert ds.num_tokens == sum(len(w) for w in want)
                for i, w in enumerate(want):
                    got = ds[i]["input_ids"]
                    assert got.dtype == w.dtype == np.dtype(spec["dtype"]), (got.dtype, w.dtype)
                    assert np.array_equal(got, w), f"record {i} of {paths}"
                pick = rng.integers(0, len(want), 17).tolist()
                recs = ds.__getitems__(pick)
                del ds  # our records stay readable without their dataset (megatron's do not: see above)
                for i, rec in zip(pick, recs):
                    assert np.array_equal(rec["input_ids"], want[i])


@pytest.mark.slow
@SETTINGS
@given(spec=corpus_spec, L=st.sampled_from([1, 5, 64, 257]), B=st.sampled_from([1, 3, 8]), seed=st.integers(0, 99))
def test_concat_epoch_is_the_corpus_windows(spec, L, B, seed):
    mc = need_megatron()
    rng = np.random.default_rng(spec["seed"])
    with tempfile.TemporaryDirectory() as d:
        prefixes = write_corpus(mc, d, spec, rng, "p{}")
        records = megatron_records(mc, prefixes)
        if sum(map(len, records)) < L * B:
            event("fewer tokens than one batch: not checked")
            return  # fewer windows than one batch: the loader refuses it (a bad-input test, not this one)
        event("checked")
        loader = pl.DataLoader(pl.pretokenized(prefixes), global_batch_size=B, seq_len=L, seed=seed,
                               packing="concat", num_epochs=1)
        check_epoch(loader, records, L, B)


@pytest.mark.slow
def test_concat_order_is_keyed_and_resumes(tmp_path):
    mc = need_megatron()
    prefix = str(tmp_path / "c")
    records = write_megatron(mc, prefix, np.random.default_rng(5), 400, np.uint16)
    L, B = 16, 4

    def batches(seed, state=None, k=6):
        loader = pl.DataLoader(pl.pretokenized(prefix), global_batch_size=B, seq_len=L, seed=seed, packing="concat")
        it = iter(loader)
        if state is not None:
            it.set_state(state)
        return [next(it)["input_ids"].copy() for _ in range(k)], it

    a, _ = batches(0)
    b, _ = batches(0)
    c, _ = batches(1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c)), "seed does not change the window order"
    head, it = batches(0, k=3)
    state = it.get_state()
    size = len(json.dumps(state))
    assert size < 1024, size
    tail, _ = batches(0, state=json.loads(json.dumps(state)), k=3)
    assert all(np.array_equal(x, y) for x, y in zip(head + tail, a))
    assert sum(map(len, records)) // L > 6 * B


# --- OLMo -------------------------------------------------------------------------------------------


def olmo_docs(rng: np.random.Generator, n: int, dtype, eos: int) -> np.ndarray:
    """n EOS-terminated documents as Dolma writes them: bodies without EOS, one EOS each."""
    body = random_lengths(rng, n, 200) - 1  # length-1 documents are a bare EOS
    toks = [np.append(rng.integers(0, eos, m), eos) for m in body]
    return np.concatenate(toks).astype(dtype)


@pytest.mark.slow
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([np.uint16, np.uint32]),
       files=st.lists(st.integers(1, 50), min_size=1, max_size=3), tail=st.integers(0, 3))
def test_olmo_numpy_documents_equal_olmo_core(seed, dtype, files, tail):
    olmo = need_olmo()
    rng = np.random.default_rng(seed)
    eos = 50_279 if dtype == np.uint16 else 100_257
    with tempfile.TemporaryDirectory() as d:
        paths, want = [], []
        for i, n in enumerate(files):
            arr = olmo_docs(rng, n, dtype, eos)
            if i == len(files) - 1 and tail:  # a last document without its EOS (truncated upstream)
                arr = np.concatenate([arr, rng.integers(0, eos, tail).astype(dtype)])
            path = pathlib.Path(d) / f"part-{i:05d}.npy"
            olmo.write_array_to_disk(arr, path)
            assert os.path.getsize(path) == arr.nbytes  # OLMo's .npy is raw: no header
            spans = list(olmo.iter_document_indices(path, eos_token_id=eos, dtype=dtype))
            docs = [arr[s:e] for s, e in spans]
            assert sum(map(len, docs)) == len(arr) - (tail if i == len(files) - 1 else 0)
            want += docs
            paths.append(str(path))
        ds = pl.pretokenized(paths, format="numpy", dtype=dtype, eos_token_id=eos)
        flat = np.concatenate([np.memmap(p, dtype=dtype, mode="r") for p in paths])
        # OLMo-core's documents first; a trailing run without EOS is one more document, no token lost
        n_olmo = len(want)
        assert len(ds) == n_olmo + (1 if tail else 0), (len(ds), n_olmo, tail)
        got = ds.__getitems__(list(range(len(ds))))
        for i in range(n_olmo):
            assert got[i]["input_ids"].dtype == np.dtype(dtype)
            assert np.array_equal(got[i]["input_ids"], want[i]), f"document {i}"
        assert np.array_equal(np.concatenate([g["input_ids"] for g in got]), flat)
        assert ds.num_tokens == len(flat)


@pytest.mark.slow
def test_olmo_fsl_instances_equal_one_epoch(tmp_path):
    """One file: our windows are OLMo-core's NumpyFSLDataset instances (as a multiset)."""
    olmo = need_olmo()
    dtype, eos, L = np.uint32, 100_257, 128
    arr = olmo_docs(np.random.default_rng(3), 300, dtype, eos)
    path = tmp_path / "part-00000.npy"
    olmo.write_array_to_disk(arr, path)
    fsl = olmo.NumpyFSLDataset(path, sequence_length=L, pad_token_id=1, eos_token_id=eos, vocab_size=eos + 1,
                               dtype=dtype)
    fsl.work_dir = tmp_path / "work"
    theirs = collections.Counter(fsl[i]["input_ids"].numpy().astype(np.int64).tobytes() for i in range(len(fsl)))
    loader = pl.DataLoader(pl.pretokenized(str(path), format="numpy", dtype=dtype, eos_token_id=eos),
                           global_batch_size=1, seq_len=L, seed=7, packing="concat", num_epochs=1)
    rows = epoch_rows(loader)["input_ids"].astype(np.int64)
    assert len(rows) == len(fsl) == len(arr) // L
    assert collections.Counter(r.tobytes() for r in rows) == theirs


def test_olmo_several_files_windows_cross_files(tmp_path):
    """Several files: our stream concatenates them (windows cross file ends; only the corpus tail is
    dropped); OLMo-core's NumpyFSLDataset chunks each file on its own and drops each file's tail."""
    olmo = need_olmo()
    dtype, eos, L = np.uint16, 50_279, 64
    rng = np.random.default_rng(11)
    paths, arrays = [], []
    for i in range(3):
        arr = olmo_docs(rng, 40 + 7 * i, dtype, eos)
        paths.append(tmp_path / f"part-{i}.npy")
        olmo.write_array_to_disk(arr, paths[-1])
        arrays.append(arr)
    ds = pl.pretokenized([str(p) for p in paths], format="numpy", dtype=dtype, eos_token_id=eos)
    records = [r["input_ids"] for r in ds.__getitems__(list(range(len(ds))))]
    loader = pl.DataLoader(ds, global_batch_size=1, seq_len=L, seed=0, packing="concat", num_epochs=1)
    check_epoch(loader, records, L, 1)
    fsl = olmo.NumpyFSLDataset(*paths, sequence_length=L, pad_token_id=1, eos_token_id=eos, vocab_size=eos + 1,
                               dtype=dtype)
    fsl.work_dir = tmp_path / "work"
    assert len(fsl) == sum(len(a) // L for a in arrays)  # the peer: per-file windows
    assert sum(map(len, arrays)) // L >= len(fsl)


def test_npy_with_header(tmp_path):
    """A real .npy (np.save, with its header) reads as its array, documents split at the EOS."""
    eos = 7
    arr = np.array([1, 2, eos, eos, 3, eos, 4, 5, 6, eos], np.uint16)
    np.save(tmp_path / "a.npy", arr)
    ds = pl.pretokenized(str(tmp_path / "a.npy"), format="numpy", eos_token_id=eos)
    assert [ds[i]["input_ids"].tolist() for i in range(len(ds))] == [[1, 2, eos], [eos], [3, eos], [4, 5, 6, eos]]


# --- nanoGPT --------------------------------------------------------------------------------------------


@pytest.mark.slow
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(300, 5000), L=st.sampled_from([1, 7, 128]),
       eos=st.sampled_from([None, 50_256]))
def test_nanogpt_flat_bin(seed, n, L, eos):
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 50_257, n).astype(np.uint16)  # GPT-2 ids as nanoGPT's prepare.py writes them
    if eos is not None:
        toks[rng.random(n) < 0.05] = eos
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "train.bin")
        toks.tofile(path)
        data = np.memmap(path, dtype=np.uint16, mode="r")  # nanoGPT's get_batch reads it so
        ds = pl.pretokenized(path, format="flat", eos_token_id=eos)
        if eos is None:
            docs = [np.asarray(data)]
        else:
            cut = np.flatnonzero(data == eos) + 1
            docs = [x for x in np.split(np.asarray(data), cut) if len(x)]
        assert len(ds) == len(docs) and ds.num_tokens == n
        got = ds.__getitems__(list(range(len(ds))))
        for g, w in zip(got, docs):
            assert g["input_ids"].dtype == np.uint16 and np.array_equal(g["input_ids"], w)
        B = 2
        if n // L < B:
            event("fewer tokens than one batch: not checked")
            return
        event("checked")
        loader = pl.DataLoader(ds, global_batch_size=B, seq_len=L, seed=seed % 100, packing="concat", num_epochs=1)
        check_epoch(loader, docs, L, B)
