"""Benchmark: the DataLoader against Grain, torch+datasets and a raw memmap gather, on one cache.

    python scripts/bench_loader.py                  # 200k records (real alpaca tokens, repeated)
    python scripts/bench_loader.py --records 20000 --steps 300 --rounds 3

Shuffled global batches of 8 x 2048, in one process, no workers. Padded (one record per row):
  (a) portable_loader on the ArrayRecord cache
  (b) Grain on the same ArrayRecord files: MapDataset.source().shuffle().map(pad).batch(), and
      grain.DataLoader with an IndexSampler
  (c) portable_loader on the Arrow cache
  (d) torch DataLoader over datasets.load_from_disk (numpy format) with a RandomSampler
  (e) the ceiling: a raw numpy memmap gather of random records into a preallocated batch
(a) also runs over a copy of the ArrayRecord files rewritten by the library's writer with
``group_size:1,uncompressed`` (what the cache writer writes too: a check that nothing differs).
The loader reads ahead by itself (one ``spans`` call per 4,096 positions or packing window).
Packed (records first-fit into rows of 2048): portable_loader on both backends against Grain's
FirstFitPackIterDataset (8 bins) over MapDataset.source().shuffle() of the same ArrayRecord files.
Every contender runs ``--steps`` batches in each of ``--rounds`` interleaved rounds (the machine may
be shared); the table holds medians, so ratios compare runs of the same moment. Start-up (a
contender's first batch, once) is timed apart from those steady rates, and each round prints the
load average. Then: time to the
first batch after set_state at step 0 and at step 10**6, and RSS over an epoch. The built caches are
kept under ``--work`` (keyed by ``--records``) and reused by the next run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from benchlib import add_output_args, bar_svg, load, machine, write_table  # noqa: E402

import portable_loader as pl  # noqa: E402
from portable_loader.cache import FORMAT_VERSION, ShardWriter, write_manifest  # noqa: E402
from portable_loader.cache.writer import ARRAY_RECORD_OPTIONS  # noqa: E402
from portable_loader.plan import Cursor  # noqa: E402
from portable_loader.state import make_state  # noqa: E402

B, S = 8, 2048


def build_caches(work: str, records: int, tokenizer: str) -> dict:
    """Tokenize the real alpaca demo once, then write ``records`` of its records to both backends.

    Kept in ``work``: a later run with the same ``records`` reuses what a finished build left.
    """
    paths = {b: os.path.join(work, b) for b in ("arrow", "array_record")}
    paths["array_record_uncompressed"] = os.path.join(work, "array_record_uncompressed")
    if all(os.path.exists(os.path.join(p, "manifest.json")) for p in paths.values()):
        return paths
    if all(os.path.exists(os.path.join(paths[b], "manifest.json")) for b in ("arrow", "array_record")):
        uncompressed_copy(paths["array_record"], paths["array_record_uncompressed"])
        return paths
    base = pl.open_cache(pl.precache(os.path.join(DATA, "alpaca", "llamafactory_alpaca_en_demo.json"),
                                     tokenizer=tokenizer, format="alpaca", out=os.path.join(work, "base"),
                                     max_length=S))
    recs = base.__getitems__(range(len(base)))
    for backend in ("arrow", "array_record"):
        path = os.path.join(work, backend)
        os.makedirs(path, exist_ok=True)
        shards, per = [], -(-records // 4)
        for s in range(4):
            ext = "arrow" if backend == "arrow" else "array_record"
            w = ShardWriter(os.path.join(path, f"data-{s:05d}-of-00004.{ext}"), backend)
            for i in range(s * per, min(records, (s + 1) * per)):
                r = recs[i % len(recs)]
                w.write(r["input_ids"], r["loss_mask"])
            shards.append(w.close())
        counts = {"rows_in": records, "rows_out": records, "dropped": {}, "truncated": 0, "tokens": 0, "trainable_tokens": 0}
        # The options as precache records them: the reader picks its path (memory map or library) by them.
        extra = {"array_record_options": ARRAY_RECORD_OPTIONS} if backend == "array_record" else {}
        write_manifest(path, {"format_version": FORMAT_VERSION, "backend": backend, "key": backend.ljust(64, "0"),
                              "counts": counts, "content_checksum": "", "shards": shards, **extra})
    uncompressed_copy(paths["array_record"], paths["array_record_uncompressed"])
    return paths


def uncompressed_copy(src: str, dst: str) -> None:
    """The same records rewritten by the library's own writer, one uncompressed record per chunk."""
    import hashlib
    import json

    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    os.makedirs(dst, exist_ok=True)
    manifest = json.load(open(os.path.join(src, "manifest.json")))
    manifest.pop("checksum")
    for shard in manifest["shards"]:
        reader = ArrayRecordReader(os.path.join(src, shard["file"]), "readahead_buffer_size:0")
        writer = ArrayRecordWriter(os.path.join(dst, shard["file"]), "group_size:1,uncompressed")
        for raw in reader.read(0, shard["rows"]):
            writer.write(raw)
        writer.close()
        reader.close()
        with open(os.path.join(dst, shard["file"]), "rb") as f:
            data = f.read()
        shard.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    write_manifest(dst, manifest)


def forever(make):
    """Batches from ``make()``, started again whenever one pass ends, after one warm-up batch; and the
    seconds that first batch took (start-up: opening, planning, a pipeline's threads), kept out of the rates."""

    def gen():
        while True:
            yield from make()

    t = time.perf_counter()
    batches = gen()
    next(batches)
    return batches, time.perf_counter() - t


def timed(batches, steps: int, seconds: float) -> tuple[float, float]:
    """(batches/s, real tokens/s) over the next ``steps`` batches, or fewer (5 at least) once
    ``seconds`` have passed: slow contenders do not stretch a round."""
    tokens, done = 0, 0
    t = time.perf_counter()
    while done < steps and (done < 5 or time.perf_counter() - t < seconds):
        b = next(batches)
        if "attention_mask" in b:  # ours, padded: no segment_ids
            real = b["attention_mask"]
        else:
            real = b["segment_ids"] if "segment_ids" in b else b["input_ids_segment_ids"]
        tokens += int(np.count_nonzero(real))
        done += 1
    dt = time.perf_counter() - t
    return done / dt, tokens / dt


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


def _parse_cut(raw: bytes) -> dict:
    n = len(raw) // 5
    return {"input_ids": np.frombuffer(raw, np.int32, count=n)[:S], "loss_mask": np.frombuffer(raw, np.uint8, offset=4 * n)[:S]}


def grain_first_fit(path: str):
    """Grain's own packer: FirstFitPackIterDataset with one bin per row of the batch."""
    import grain
    from grain import experimental

    source = grain.python.ArrayRecordDataSource(_ar_files(path))
    ds = grain.MapDataset.source(source).shuffle(seed=0).map(_parse_cut).to_iter_dataset()
    ds = experimental.FirstFitPackIterDataset(ds, length_struct={"input_ids": S, "loss_mask": S}, num_packing_bins=B, seed=0)
    return iter(ds.batch(B))


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
    if not os.path.exists(os.path.join(work, "mask.npy")):
        flat_ids = np.lib.format.open_memmap(os.path.join(work, "ids.tmp.npy"), "w+", np.int32, (int(offsets[-1]),))
        flat_mask = np.lib.format.open_memmap(os.path.join(work, "mask.tmp.npy"), "w+", np.uint8, (int(offsets[-1]),))
        for i, r in enumerate(src.__getitems__(range(len(src)))):
            flat_ids[offsets[i] : offsets[i + 1]] = r["input_ids"]
            flat_mask[offsets[i] : offsets[i + 1]] = r["loss_mask"]
        flat_ids.flush()
        flat_mask.flush()
        del flat_ids, flat_mask
        os.replace(os.path.join(work, "ids.tmp.npy"), os.path.join(work, "ids.npy"))
        os.replace(os.path.join(work, "mask.tmp.npy"), os.path.join(work, "mask.npy"))
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
    out = []
    for step in (0, 10**6):
        # In packing mode a step-10**6 cursor sits in window ~10**6 * B / 1024 * (rows per record).
        state = make_state(loader, Cursor(step=step, window=step * B // 200 if packing else 0, row=0))
        it = iter(loader)
        t = time.perf_counter()
        it.set_state(state)
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


def memory_with_workers(path: str, packing: bool, workers: int = 2, steps: int = 300) -> list[dict]:
    """Per process of a loader with ``workers`` workers after ``steps`` batches: peak RSS (VmHWM), RSS,
    USS (pages only it holds) and PSS (shared pages split among their holders), MiB.

    A worker that copied what it could share (the dataset's arrays, the shards' pages) would show a
    USS near its RSS; mapped shards and pages inherited from the parent stay shared."""
    import psutil

    def usage(proc: psutil.Process, role: str) -> dict:
        full = proc.memory_full_info()
        with open(f"/proc/{proc.pid}/status") as f:
            peak = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM"))
        return {"process": role, "peak_rss": peak, "rss": full.rss / 2**20, "uss": full.uss / 2**20,
                "pss": full.pss / 2**20}

    loader = pl.DataLoader(pl.open_cache(path), global_batch_size=B, seq_len=S, seed=0, packing=packing,
                           num_workers=workers)
    with iter(loader) as it:
        for _ in range(steps):
            next(it)
        me = psutil.Process()
        kids = [c for c in me.children(recursive=True) if c.is_running()]
        return [usage(me, "main")] + [usage(c, f"worker {k}") for k, c in enumerate(kids)]


PADDED = {
    "(a) portable_loader, ArrayRecord": lambda p, w: ours(p["array_record"]),
    "(a) portable_loader, ArrayRecord written uncompressed": lambda p, w: ours(p["array_record_uncompressed"]),
    "(b) Grain MapDataset, same ArrayRecord": lambda p, w: grain_mapdataset(p["array_record"]),
    "(b) grain.DataLoader + IndexSampler, same ArrayRecord": lambda p, w: grain_dataloader(p["array_record"]),
    "(c) portable_loader, Arrow": lambda p, w: ours(p["arrow"]),
    "(d) torch DataLoader + datasets.load_from_disk": lambda p, w: torch_datasets(p["arrow"]),
    "(e) ceiling: numpy memmap gather": lambda p, w: memmap_ceiling(p["arrow"], w),
}
PACKED = {
    "portable_loader packed, Arrow": lambda p, w: ours(p["arrow"], packing=True),
    "portable_loader packed, ArrayRecord": lambda p, w: ours(p["array_record"], packing=True),
    "portable_loader packed, ArrayRecord written uncompressed": lambda p, w: ours(p["array_record_uncompressed"], packing=True),
    "Grain FirstFitPackIterDataset, same ArrayRecord": lambda p, w: grain_first_fit(p["array_record"]),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--steps", type=int, default=500, help="batches per contender per round")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--seconds", type=float, default=1.0, help="at most this long per contender per round")
    p.add_argument("--work", default="/tmp/portable_loader_bench", help="where built caches are kept between runs")
    p.add_argument("--tokenizer", default=os.path.join(DATA, "tokenizers", "phi-3-mini"))
    args = add_output_args(p, "loader").parse_args()
    print(f"machine: {machine()}; {args.records:,} records (real alpaca tokens); batches of {B}x{S}; "
          f"{args.rounds} interleaved rounds of {args.steps} steps (or {args.seconds:g} s) each, medians")
    work = os.path.join(args.work, f"records-{args.records}")
    os.makedirs(work, exist_ok=True)
    paths = build_caches(work, args.records, args.tokenizer)
    contenders = {**{(k, "padded"): v for k, v in PADDED.items()}, **{(k, "packed"): v for k, v in PACKED.items()}}
    started = {key: forever(lambda make=make: make(paths, work)) for key, make in contenders.items()}
    iters, first = {k: v[0] for k, v in started.items()}, {k: v[1] for k, v in started.items()}
    runs: dict = {key: [] for key in contenders}
    loads = []
    for r in range(args.rounds):
        for key, batches in iters.items():
            runs[key].append(timed(batches, args.steps, args.seconds))
        loads.append(load())
        print(f"round {r + 1}: " + ", ".join(f"{k[0].split(',')[0]} {runs[k][-1][0]:,.0f}" for k in runs)
              + f" (load {loads[-1]:.1f})", flush=True)
    med = {key: (float(np.median([x[0] for x in v])), float(np.median([x[1] for x in v]))) for key, v in runs.items()}
    ceiling = med[("(e) ceiling: numpy memmap gather", "padded")][0]
    print(f"\nfirst batch: seconds from making the contender to its first batch, once; the steady rates after "
          f"it, medians of the rounds, under a load average of {min(loads):.1f}-{max(loads):.1f}")
    print("| mode | contender | first batch (s) | steady batches/s | steady tokens/s | vs memmap ceiling |")
    print("|---|---|---|---|---|---|")
    for (label, mode), (b, t) in med.items():
        print(f"| {mode} | {label} | {first[(label, mode)]:.3f} | {b:,.0f} | {t / 1e6:.1f} M | {b / ceiling:.0%} |")
    def ratio(a: str, b: str) -> float:
        """Median over rounds of a/b in the same round: the load on a shared machine changes slowly."""
        (ka,), (kb,) = [[k for k in runs if k[0] == x] for x in (a, b)]
        return float(np.median([x[0] / y[0] for x, y in zip(runs[ka], runs[kb])]))

    ratios = {
        "padded ArrayRecord / Arrow": ratio("(a) portable_loader, ArrayRecord", "(c) portable_loader, Arrow"),
        "padded ArrayRecord / Grain MapDataset": ratio("(a) portable_loader, ArrayRecord", "(b) Grain MapDataset, same ArrayRecord"),
        "padded ArrayRecord / grain.DataLoader": ratio("(a) portable_loader, ArrayRecord", "(b) grain.DataLoader + IndexSampler, same ArrayRecord"),
        "padded Arrow / memmap ceiling": ratio("(c) portable_loader, Arrow", "(e) ceiling: numpy memmap gather"),
        "padded ArrayRecord uncompressed / Arrow": ratio("(a) portable_loader, ArrayRecord written uncompressed", "(c) portable_loader, Arrow"),
        "packed ArrayRecord / packed Arrow": ratio("portable_loader packed, ArrayRecord", "portable_loader packed, Arrow"),
        "packed ArrayRecord uncompressed / packed Arrow": ratio("portable_loader packed, ArrayRecord written uncompressed", "portable_loader packed, Arrow"),
        "packed Arrow / Grain FirstFitPack": ratio("portable_loader packed, Arrow", "Grain FirstFitPackIterDataset, same ArrayRecord"),
        "packed ArrayRecord / Grain FirstFitPack": ratio("portable_loader packed, ArrayRecord", "Grain FirstFitPackIterDataset, same ArrayRecord"),
    }
    print()
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    rows = [[mode, label, first[(label, mode)], b, t, min(x[0] for x in runs[(label, mode)]),
             max(x[0] for x in runs[(label, mode)]), args.records, args.rounds, args.steps, min(loads), max(loads)]
            for (label, mode), (b, t) in med.items()]
    rows += [["ratio", name, "", value, "", "", "", args.records, args.rounds, args.steps, min(loads), max(loads)]
             for name, value in ratios.items()]
    write_table(args, ["mode", "contender", "first_batch_s", "batches_per_s_median", "tokens_per_s_median",
                       "batches_per_s_min", "batches_per_s_max", "records", "rounds", "steps_per_round", "load_min",
                       "load_max"], rows)
    labels = [f"{label} [{mode}]" for label, mode in med]
    bar_svg(args, f"Shuffled {B}x{S} batches from {args.records:,} records, one process (median of {args.rounds} rounds)",
            labels, [m[0] for m in med.values()], "batches/s (log scale)",
            highlight=[lab for lab in labels if "portable_loader" in lab], log=True)
    for packing in (False, True):
        t0, t1 = time_to_first_batch(paths["arrow"], packing)
        print(f"first batch after set_state ({'packed' if packing else 'padded'}): step 0 {t0 * 1e3:.2f} ms, step 10^6 {t1 * 1e3:.2f} ms")
    for packing in (False, True):
        print(f"\nmemory with 2 workers, {'packed' if packing else 'padded'}, Arrow, after 300 batches, in a fresh "
              "process (MiB):")
        print("| process | peak RSS | RSS | USS (its own) | PSS (shared split) |")
        print("|---|---|---|---|---|")
        # A fresh process: this one has imported Grain, torch and datasets and run every contender.
        out = subprocess.run([sys.executable, __file__, "--memory", paths["arrow"], str(int(packing))],
                             capture_output=True, text=True, check=True).stdout
        for m in json.loads(out.strip().splitlines()[-1]):
            print(f"| {m['process']} | {m['peak_rss']:.0f} | {m['rss']:.0f} | {m['uss']:.0f} | {m['pss']:.0f} |")
    r = rss_over_epoch(paths["arrow"], args.records)
    print(f"RSS over one epoch ({args.records:,} records, Arrow): anonymous {r['RssAnon'][0]:.0f} -> "
          f"{r['RssAnon'][1]:.0f} MiB, file-backed (the memory map) {r['RssFile'][0]:.0f} -> {r['RssFile'][1]:.0f} MiB")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--memory"]:  # the fresh process of memory_with_workers
        print(json.dumps(memory_with_workers(sys.argv[2], bool(int(sys.argv[3])))))
    else:
        main()
