"""Benchmark: the DataLoader against Grain, torch+datasets and a raw memmap gather, on one cache.

    python scripts/bench_loader.py                  # 200k records (real alpaca tokens, repeated)
    python scripts/bench_loader.py --records 50000 --steps 500

Shuffled global batches of 8 x 2048 (padding mode, one record per row), in one process, no workers:
  (a) portable_loader on the ArrayRecord cache
  (b) Grain on the same ArrayRecord files: MapDataset.source().shuffle().map(pad).batch(), and
      grain.DataLoader with an IndexSampler
  (c) portable_loader on the Arrow cache (and packed, for reference)
  (d) torch DataLoader over datasets.load_from_disk (numpy format) with a RandomSampler
  (e) the ceiling: a raw numpy memmap gather of random records into a preallocated batch
Then: time to the first batch after set_state at step 0 and at step 10**6, and RSS over an epoch.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from bench_sampler import machine  # noqa: E402

import portable_loader as pl  # noqa: E402
from portable_loader.cache import FORMAT_VERSION, ShardWriter, write_manifest  # noqa: E402

B, S = 8, 2048


def build_caches(work: str, records: int, tokenizer: str) -> dict:
    """Tokenize the real alpaca demo once, then write ``records`` of its records to both backends."""
    base = pl.open_cache(pl.precache(os.path.join(DATA, "alpaca", "llamafactory_alpaca_en_demo.json"),
                                     tokenizer=tokenizer, format="alpaca", out=os.path.join(work, "base"),
                                     max_length=S))
    recs = base.__getitems__(range(len(base)))
    paths = {}
    for backend in ("arrow", "array_record"):
        path = os.path.join(work, backend)
        os.makedirs(path)
        shards, per = [], -(-records // 4)
        for s in range(4):
            ext = "arrow" if backend == "arrow" else "array_record"
            w = ShardWriter(os.path.join(path, f"data-{s:05d}-of-00004.{ext}"), backend)
            for i in range(s * per, min(records, (s + 1) * per)):
                r = recs[i % len(recs)]
                w.write(r["input_ids"], r["loss_mask"])
            shards.append(w.close())
        counts = {"rows_in": records, "rows_out": records, "dropped": {}, "truncated": 0, "tokens": 0, "trainable_tokens": 0}
        write_manifest(path, {"format_version": FORMAT_VERSION, "backend": backend, "key": backend.ljust(64, "0"),
                              "counts": counts, "content_checksum": "", "shards": shards})
        paths[backend] = path
    return paths


def timed(batches, steps: int) -> tuple[float, float]:
    """(batches/s, real tokens/s) over ``steps`` batches after one warm-up batch."""
    first = next(batches)
    del first
    tokens = 0
    t = time.perf_counter()
    for _ in range(steps):
        b = next(batches)
        real = b["attention_mask"] if "attention_mask" in b else b["segment_ids"]  # ours padded: no segment_ids
        tokens += int(np.count_nonzero(real))
    dt = time.perf_counter() - t
    return steps / dt, tokens / dt


def ours(path: str, packing: bool = False):
    loader = pl.DataLoader(pl.open_cache(path), global_batch_size=B, seq_len=S, seed=0, packing=packing, prefetch=0)
    return iter(loader)


def _parse_pad(raw: bytes) -> dict:
    n = len(raw) // 5
    ids = np.frombuffer(raw, np.int32, count=n)[:S]
    mask = np.frombuffer(raw, np.uint8, offset=4 * n)[:S]
    out_ids = np.zeros(S, np.int32)
    out_mask = np.zeros(S, np.uint8)
    seg = np.zeros(S, np.int32)
    out_ids[: ids.size] = ids
    out_mask[: ids.size] = mask
    seg[: ids.size] = 1
    return {"input_ids": out_ids, "loss_mask": out_mask, "segment_ids": seg}


def _ar_files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".array_record"))


def grain_mapdataset(path: str):
    import grain.python as grain

    source = grain.ArrayRecordDataSource(_ar_files(path))
    ds = grain.MapDataset.source(source).shuffle(seed=0).map(_parse_pad).batch(B)
    return (ds[i] for i in range(len(ds)))


def grain_dataloader(path: str):
    import grain.python as grain

    class ParsePad(grain.MapTransform):
        def map(self, raw):
            return _parse_pad(raw)

    source = grain.ArrayRecordDataSource(_ar_files(path))
    sampler = grain.IndexSampler(len(source), shard_options=grain.NoSharding(), shuffle=True, seed=0, num_epochs=1)
    loader = grain.DataLoader(data_source=source, sampler=sampler, operations=[ParsePad(), grain.Batch(B)], worker_count=0)
    return iter(loader)


def torch_datasets(path: str):
    import datasets
    import torch

    ds = datasets.load_from_disk(path).with_format("numpy")

    def collate(rows):
        ids = np.zeros((len(rows), S), np.int32)
        mask = np.zeros((len(rows), S), np.uint8)
        seg = np.zeros((len(rows), S), np.int32)
        for r, row in enumerate(rows):
            n = min(S, row["input_ids"].size)
            ids[r, :n] = row["input_ids"][:n]
            mask[r, :n] = row["loss_mask"][:n]
            seg[r, :n] = 1
        return {"input_ids": torch.from_numpy(ids), "loss_mask": torch.from_numpy(mask), "segment_ids": torch.from_numpy(seg)}

    g = torch.Generator().manual_seed(0)
    loader = torch.utils.data.DataLoader(ds, batch_size=B, sampler=torch.utils.data.RandomSampler(ds, generator=g),
                                         collate_fn=collate, num_workers=0)
    return ({k: v.numpy() for k, v in b.items()} for b in loader)


def memmap_ceiling(path: str, work: str):
    """All tokens in one flat memmap plus offsets: the least work a random-record batch can cost."""
    src = pl.open_cache(path)
    lengths = src.lengths(np.arange(len(src)))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat_ids = np.lib.format.open_memmap(os.path.join(work, "ids.npy"), "w+", np.int32, (int(offsets[-1]),))
    flat_mask = np.lib.format.open_memmap(os.path.join(work, "mask.npy"), "w+", np.uint8, (int(offsets[-1]),))
    for i, r in enumerate(src.__getitems__(range(len(src)))):
        flat_ids[offsets[i] : offsets[i + 1]] = r["input_ids"]
        flat_mask[offsets[i] : offsets[i + 1]] = r["loss_mask"]
    flat_ids.flush()
    flat_mask.flush()
    ids_mm = np.load(os.path.join(work, "ids.npy"), mmap_mode="r")
    mask_mm = np.load(os.path.join(work, "mask.npy"), mmap_mode="r")
    rng = np.random.default_rng(0)

    def gen():
        while True:
            ids = np.zeros((B, S), np.int32)
            mask = np.zeros((B, S), np.uint8)
            seg = np.zeros((B, S), np.int32)
            for r, i in enumerate(rng.integers(0, len(lengths), B).tolist()):
                a = offsets[i]
                n = min(S, int(lengths[i]))
                ids[r, :n] = ids_mm[a : a + n]
                mask[r, :n] = mask_mm[a : a + n]
                seg[r, :n] = 1
            yield {"input_ids": ids, "loss_mask": mask, "segment_ids": seg}

    return gen()


def time_to_first_batch(path: str, packing: bool) -> list[float]:
    loader = pl.DataLoader(pl.open_cache(path), global_batch_size=B, seq_len=S, seed=0, packing=packing, prefetch=0)
    state = iter(loader).get_state()
    out = []
    for step in (0, 10**6):
        # In packing mode a step-10**6 cursor sits in window ~10**6 * B / 1024 * (rows per record).
        s = dict(state, step=step, window=step * B // 200 if packing else 0, row=0)
        it = iter(loader)
        t = time.perf_counter()
        it.set_state(s)
        next(it)
        out.append(time.perf_counter() - t)
    return out


def rss_over_epoch(path: str, records: int) -> dict:
    """Anonymous and file-backed RSS (MiB) before and after one epoch: the memory map's pages are
    file-backed (shared with the page cache, dropped under pressure); a leak would be anonymous."""

    def rss():
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon", "RssFile")):
                    name, value = line.split(":")
                    fields[name] = int(value.split()[0]) / 1024
        return fields

    loader = pl.DataLoader(pl.open_cache(path), global_batch_size=B, seq_len=S, seed=0, num_epochs=1, prefetch=0)
    it = iter(loader)
    next(it)
    start = rss()
    for _ in it:
        pass
    end = rss()
    return {k: (start[k], end[k]) for k in start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--tokenizer", default=os.path.join(DATA, "tokenizers", "phi-3-mini"))
    args = p.parse_args()
    print(f"machine: {machine()}; {args.records:,} records (real alpaca tokens); batches of {B}x{S}; {args.steps} steps each")
    work = tempfile.mkdtemp(prefix="bench-loader-")
    try:
        paths = build_caches(work, args.records, args.tokenizer)
        contenders = [
            ("(a) portable_loader, ArrayRecord cache", lambda: ours(paths["array_record"])),
            ("(b) Grain MapDataset, same ArrayRecord", lambda: grain_mapdataset(paths["array_record"])),
            ("(b) grain.DataLoader + IndexSampler, same ArrayRecord", lambda: grain_dataloader(paths["array_record"])),
            ("(c) portable_loader, Arrow cache", lambda: ours(paths["arrow"])),
            ("(c) portable_loader, Arrow cache, packed", lambda: ours(paths["arrow"], packing=True)),
            ("(d) torch DataLoader + datasets.load_from_disk", lambda: torch_datasets(paths["arrow"])),
            ("(e) ceiling: numpy memmap gather", lambda: memmap_ceiling(paths["arrow"], work)),
        ]
        results = {}
        for label, make in contenders:
            results[label] = timed(make(), args.steps)
            print(f"{label:55s} {results[label][0]:9,.0f} batches/s {results[label][1] / 1e6:8.1f} M tokens/s", flush=True)
        ceiling = results["(e) ceiling: numpy memmap gather"][0]
        grain_best = max(results["(b) Grain MapDataset, same ArrayRecord"][0],
                         results["(b) grain.DataLoader + IndexSampler, same ArrayRecord"][0])
        print()
        print("| contender | batches/s | tokens/s | vs ceiling | portable_loader (same backend) vs it |")
        print("|---|---|---|---|---|")
        for label, (bps, tps) in results.items():
            mine = results["(a) portable_loader, ArrayRecord cache"][0] if "ArrayRecord" in label else results["(c) portable_loader, Arrow cache"][0]
            print(f"| {label} | {bps:,.0f} | {tps / 1e6:.1f} M | {bps / ceiling:.0%} | {mine / bps:.1f}x |")
        print(f"\nportable_loader ArrayRecord vs best Grain: {results['(a) portable_loader, ArrayRecord cache'][0] / grain_best:.1f}x;"
              f" Arrow vs memmap ceiling: {results['(c) portable_loader, Arrow cache'][0] / ceiling:.0%}")
        for packing in (False, True):
            t0, t1 = time_to_first_batch(paths["arrow"], packing)
            print(f"first batch after set_state ({'packed' if packing else 'padded'}): step 0 {t0 * 1e3:.2f} ms, step 10^6 {t1 * 1e3:.2f} ms")
        r = rss_over_epoch(paths["arrow"], args.records)
        print(f"RSS over one epoch ({args.records:,} records, Arrow): anonymous {r['RssAnon'][0]:.0f} -> "
              f"{r['RssAnon'][1]:.0f} MiB, file-backed (the memory map) {r['RssFile'][0]:.0f} -> {r['RssFile'][1]:.0f} MiB")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
