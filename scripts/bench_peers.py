"""Benchmark: portable_loader against torchdata's StatefulDataLoader and LitData, on the same sequences.

    pip install -e '.[bench]'                     # the peers (see docs/performance.md for their quirks)
    python scripts/bench_peers.py                 # 300,000 sequences, 3 interleaved rounds
    python scripts/bench_peers.py --records 20000 --rounds 1 --steps 300 --resume-step 2000   # a quick look

One run writes the same token sequences (lognormal lengths, median 300, capped at 2048) for each
library: our Arrow cache, which torchdata's ``StatefulDataLoader`` also reads (a map-style dataset
over the memory-mapped Arrow shards), and LitData's own optimized chunks. Every loader serves
shuffled 8 x 2048 batches holding the same fields: padded (``input_ids``, ``loss_mask``,
``attention_mask``) and packed (plus ``segment_ids`` and ``positions``; the peers pack each batch's
records greedily in their ``collate_fn``, the way their users do). Rounds are interleaved and the
figures are medians over rounds, and ratios the median of each round's ratio (every other round
runs the loaders in reverse order):

* batches/s with no training step, with 0 and 2 workers, and main-thread CPU time per batch
  (``time.thread_time``: what the trainer's thread pays);
* batches/s under a simulated training step (``--step-ms``, padded and packed, a sleep: the host waits on the GPU
  and holds neither the GIL nor a core), as a fraction of the bound 1 / max(step, collate) with
  the step as measured (a loaded machine oversleeps) and collate = 1 / (batches/s with no step);
* resume: the time from a fresh loader plus its saved state at step ``--resume-step`` to the next
  batch, whether the next batches equal the uninterrupted run's, and whether the order of batches
  changes between 0 and 2 workers.

Also each configuration's ratio to our inline loop in the same mode (``x_inline``: what the
default's prefetch thread costs, or gains, in the same loop). Writes docs/bench/peers.csv and
docs/bench/peers.svg (``--csv``/``--svg``, as every ``scripts/bench_*.py``).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np

# torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13: a warning per iterator, with a path
# of this machine, in every log.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import benchlib  # noqa: E402
from benchlib import machine  # noqa: E402

import portable_loader as pl  # noqa: E402
from portable_loader.cache import FORMAT_VERSION, ShardWriter, write_manifest  # noqa: E402
from portable_loader.collate import FIELDS  # noqa: E402

B, S = 8, 2048
VOCAB = 32_000
PACK_RECORDS = 48  # records a peer's packed batch draws (8 x 2048 slots / ~400 mean tokens, with slack)


# --- the sequences, written once per library -----------------------------------------------------


def sequence_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(300), 0.8, n)), 1, S).astype(np.int64)


def write_arrow_cache(path: str, n: int) -> None:
    lengths = sequence_lengths(n)
    rng = np.random.default_rng(1)
    os.makedirs(path)
    shards, per = [], -(-n // 4)
    for s in range(4):
        w = ShardWriter(os.path.join(path, f"data-{s:05d}-of-00004.arrow"), "arrow")
        for i in range(s * per, min(n, (s + 1) * per)):
            ids = rng.integers(1, VOCAB, lengths[i], dtype=np.int32)
            mask = np.ones(lengths[i], np.uint8)
            mask[: lengths[i] // 4] = 0  # a prompt that is not trained on
            w.write(ids, mask)
        shards.append(w.close())
    counts = {"rows_in": n, "rows_out": n, "dropped": {}, "truncated": 0, "tokens": int(lengths.sum()),
              "trainable_tokens": 0}
    write_manifest(path, {"format_version": FORMAT_VERSION, "backend": "arrow", "key": "bench".ljust(64, "0"),
                          "counts": counts, "content_checksum": "", "shards": shards})


class ArrowRecords:
    """The torchdata peer's map-style dataset: zero-copy views into our memory-mapped Arrow shards."""

    def __init__(self, path: str):
        import pyarrow as pa

        ids, mask = [], []
        for name in sorted(os.listdir(path)):
            if name.endswith(".arrow"):
                table = pa.ipc.open_stream(pa.memory_map(os.path.join(path, name))).read_all()
                ids.append(table.column("input_ids").combine_chunks())
                mask.append(table.column("loss_mask").combine_chunks())
        ids, mask = pa.concat_arrays(ids), pa.concat_arrays(mask)
        self.offsets = ids.offsets.to_numpy()
        self.ids, self.mask = ids.values.to_numpy(), mask.values.to_numpy()

    def __len__(self) -> int:
        return self.offsets.size - 1

    def __getitem__(self, i: int) -> dict:
        a, b = self.offsets[i], self.offsets[i + 1]
        return {"input_ids": self.ids[a:b], "loss_mask": self.mask[a:b]}


def _litdata_items(span):
    lo, hi, path = span
    src = ArrowRecords(path)
    for i in range(lo, hi):
        r = src[i]
        yield {"input_ids": np.array(r["input_ids"]), "loss_mask": np.array(r["loss_mask"])}


def write_litdata(arrow_path: str, out: str, n: int) -> None:
    import litdata

    spans = [(lo, min(n, lo + 20_000), arrow_path) for lo in range(0, n, 20_000)]
    litdata.optimize(fn=_litdata_items, inputs=spans, output_dir=out, chunk_bytes="64MB", num_workers=2,
                     verbose=False)


# --- the peers' collate functions: the same fields as ours -----------------------------------------


def pad_collate(records: list) -> dict:
    ids = np.zeros((B, S), np.int32)
    mask = np.zeros((B, S), np.uint8)
    att = np.zeros((B, S), np.uint8)
    for r, rec in enumerate(records):
        n = min(S, rec["input_ids"].size)
        ids[r, :n] = rec["input_ids"][:n]
        mask[r, :n] = rec["loss_mask"][:n]
        att[r, :n] = 1
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": att}


def pack_collate(records: list) -> dict:
    """Greedy in arrival order: each record goes to the current row if it fits, else opens the next."""
    out = {k: np.zeros((B, S), np.uint8 if k in ("loss_mask", "attention_mask") else np.int32) for k in FIELDS}
    row, at, seg = 0, 0, 0
    for rec in records:
        n = min(S, rec["input_ids"].size)
        if at + n > S:
            row, at, seg = row + 1, 0, 0
            if row == B:
                break
        seg += 1
        out["input_ids"][row, at:at + n] = rec["input_ids"][:n]
        out["loss_mask"][row, at:at + n] = rec["loss_mask"][:n]
        out["attention_mask"][row, at:at + n] = 1
        out["segment_ids"][row, at:at + n] = seg
        out["positions"][row, at:at + n] = np.arange(n)
        at += n
    return out


# --- loaders: each returns an iterator factory, a state getter and a state loader ------------------


class Ours:
    name = "portable_loader"

    def __init__(self, cache: str, packed: bool, workers: int, prefetch: int, torch_loader: bool = False):
        self.src = pl.open_cache(cache)
        self.kw = dict(global_batch_size=B, seq_len=S, seed=0, packing=packed, num_workers=workers, prefetch=prefetch)
        self.torch_loader = torch_loader

    def make(self, state=None):
        loader = pl.DataLoader(self.src, **self.kw)
        if self.torch_loader:
            from portable_loader.adapters.torch import TorchLoader

            it = TorchLoader(loader, device="cpu")
            if state is not None:
                it.load_state_dict(state)
            return it
        it = iter(loader)
        if state is not None:
            it.set_state(state)
        return it

    @staticmethod
    def state(it):
        return it.state_dict()

    @staticmethod
    def close(it):
        it.close()


class _Iter:
    """A peer's iterator together with its loader (whose ``state_dict`` describes the batches taken)."""

    def __init__(self, owner):
        self.owner, self.it = owner, iter(owner)

    def __next__(self):
        return next(self.it)


class _TorchStyle:
    """What the torch-style peers share: a ``state_dict()`` on the loader, nothing to stop."""

    @staticmethod
    def state(it):
        return it.owner.state_dict()

    @staticmethod
    def close(it):
        it.it = it.owner = None


class TorchData(_TorchStyle):
    name = "torchdata"

    def __init__(self, cache: str, packed: bool, workers: int, prefetch: int):
        self.ds = ArrowRecords(cache)
        self.packed, self.workers, self.prefetch = packed, workers, prefetch

    def make(self, state=None):
        import torch
        from torchdata.stateful_dataloader import StatefulDataLoader

        g = torch.Generator()
        g.manual_seed(0)
        kw = dict(prefetch_factor=max(1, self.prefetch)) if self.workers else {}
        dl = StatefulDataLoader(self.ds, batch_size=PACK_RECORDS if self.packed else B, shuffle=True, generator=g,
                                collate_fn=pack_collate if self.packed else pad_collate,
                                num_workers=self.workers, drop_last=True, **kw)
        if state is not None:
            dl.load_state_dict(state)
        return _Iter(dl)



class LitData(_TorchStyle):
    name = "litdata"

    def __init__(self, optimized: str, packed: bool, workers: int, prefetch: int):
        self.dir, self.packed, self.workers, self.prefetch = optimized, packed, workers, prefetch

    def make(self, state=None):
        import litdata

        ds = litdata.StreamingDataset(self.dir, shuffle=True, seed=0, drop_last=True)
        kw = dict(prefetch_factor=max(1, self.prefetch)) if self.workers else {}
        dl = litdata.StreamingDataLoader(ds, batch_size=PACK_RECORDS if self.packed else B, num_workers=self.workers,
                                         collate_fn=pack_collate if self.packed else pad_collate, **kw)
        if state is not None:
            dl.load_state_dict(state)
        return _Iter(dl)



# --- measurements ---------------------------------------------------------------------------------


def throughput(lib, steps: int, step_s: float = 0.0) -> tuple[float, float, float, float, float, float]:
    """(steady batches/s, main-thread CPU µs per batch, mean measured step in s, real tokens per batch,
    seconds from making the loader to its first batch, the load average): start-up and 49 more
    warm-up batches are kept out of the rate."""
    t = time.perf_counter()
    it = lib.make()
    slept = 0.0
    try:
        first = next(it)
        first_s = time.perf_counter() - t
        tokens = np.mean([int(np.count_nonzero(np.asarray(b["attention_mask"])))
                          for b in [first] + [next(it) for _ in range(49)]])
        gc.collect()
        t, c = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            next(it)
            if step_s:  # measured: a loaded machine oversleeps, and the bound is the real step
                s = time.perf_counter()
                time.sleep(step_s)
                slept += time.perf_counter() - s
        wall, cpu = time.perf_counter() - t, time.thread_time() - c
    finally:
        lib.close(it)
    return steps / wall, cpu / steps * 1e6, slept / steps, tokens, first_s, benchlib.load()


def as_numpy(batch) -> dict:
    return {k: np.asarray(v) for k, v in batch.items()}


def same(a, b) -> bool:
    return all(a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a) for a, b in zip(a, b))


def resume(lib, at: int, check: int = 3) -> tuple[float, bool]:
    """(seconds from a fresh loader with the state at step ``at`` to its next batch, exact?)."""
    it = lib.make()
    for _ in range(at):
        next(it)
    state = lib.state(it)
    want = [as_numpy(next(it)) for _ in range(check)]
    lib.close(it)
    t = time.perf_counter()
    it2 = lib.make(state)
    first = as_numpy(next(it2))
    seconds = time.perf_counter() - t
    got = [first] + [as_numpy(next(it2)) for _ in range(check - 1)]
    lib.close(it2)
    return seconds, same(got, want)


def order_depends_on_workers(make0, make2, steps: int = 20) -> bool:
    a, b = make0.make(), make2.make()
    try:
        return not same([as_numpy(next(a)) for _ in range(steps)], [as_numpy(next(b)) for _ in range(steps)])
    finally:
        make0.close(a)
        make2.close(b)


def plot(args, rows: list[dict]) -> None:
    """Bars of batches/s with no step, coloured by library."""
    if args.svg == "-":
        return
    shown = [r for r in rows if r["batches_per_s"]]
    labels = [f"{r['loader']} ({r['config']}, {r['mode']}, w={r['workers']})" for r in shown]
    colors = {"portable_loader": "tab:blue", "torchdata": "tab:orange", "litdata": "tab:green"}
    plt, (fig, ax) = benchlib._figure(0.32 * len(shown) + 1.2)
    ax.barh(range(len(shown)), [r["batches_per_s"] for r in shown], color=[colors[r["loader"]] for r in shown])
    ax.set_yticks(range(len(shown)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"batches/s ({B} x {S}, median of rounds, no training step)")
    ax.set_title(f"Single process and 2 workers, same sequences, same fields\n{machine()}", fontsize=9)
    benchlib.write_svg(args, plt, fig)


def _median_ratio(a: list, b: list) -> float:
    """The median over rounds of each round's ratio of batches/s (a round's loaders ran under the
    same load, seconds apart; the load between rounds drifts more)."""
    return round(statistics.median(x[0] / y[0] for x, y in zip(a, b)), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=300_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2000, help="timed batches per measurement (no workers)")
    ap.add_argument("--worker-steps", type=int, default=1000, help="timed batches per measurement (2 workers)")
    ap.add_argument("--step-ms", type=float, default=2.0, help="simulated training step")
    ap.add_argument("--resume-step", type=int, default=20_000)
    ap.add_argument("--work", default=None, help="where to write the caches (default: a temporary folder)")
    benchlib.add_output_args(ap, "peers")
    args = ap.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="bench_peers_")
    cache, lit = os.path.join(work, "arrow"), os.path.join(work, "litdata")
    if not os.path.exists(cache):
        t = time.perf_counter()
        write_arrow_cache(cache, args.records)
        print(f"arrow cache: {time.perf_counter() - t:.1f} s", flush=True)
    if not os.path.exists(lit):
        t = time.perf_counter()
        write_litdata(cache, lit, args.records)
        print(f"litdata optimize: {time.perf_counter() - t:.1f} s", flush=True)
    print(machine(), flush=True)

    configs = []  # (loader name, config, mode, workers, factory)
    for mode, packed in (("padded", False), ("packed", True)):
        configs += [
            ("portable_loader", "inline", mode, 0, Ours(cache, packed, 0, 0)),
            ("portable_loader", "default", mode, 0, Ours(cache, packed, 0, 2)),
            ("portable_loader", "TorchLoader", mode, 0, Ours(cache, packed, 0, 2, torch_loader=True)),
            ("torchdata", "StatefulDataLoader", mode, 0, TorchData(cache, packed, 0, 2)),
            ("litdata", "StreamingDataLoader", mode, 0, LitData(lit, packed, 0, 2)),
        ]
    configs += [
        ("portable_loader", "default", "padded", 2, Ours(cache, False, 2, 2)),
        ("torchdata", "StatefulDataLoader", "padded", 2, TorchData(cache, False, 2, 2)),
        ("litdata", "StreamingDataLoader", "padded", 2, LitData(lit, False, 2, 2)),
    ]
    samples: dict[int, list] = {i: [] for i in range(len(configs))}
    stepped: dict[int, list] = {i: [] for i in range(len(configs))}
    for rnd in range(args.rounds):
        # Every other round runs the loaders in reverse, so no loader always runs first (or last).
        order = list(enumerate(configs)) if rnd % 2 == 0 else list(enumerate(configs))[::-1]
        for i, (name, config, mode, workers, lib) in order:
            steps = args.worker_steps if workers else args.steps
            bps, cpu, _, tokens, first, now = throughput(lib, steps)
            samples[i].append((bps, cpu, tokens, first, now))
            print(f"round {rnd} {name:16s} {config:19s} {mode} w={workers}: first batch {first:6.3f} s, then "
                  f"{bps:8.0f} batches/s, main thread {cpu:6.1f} µs/batch, {tokens:6.0f} tokens/batch (load {now:.1f})",
                  flush=True)
            if workers == 0:
                sbps, scpu, step, *_ = throughput(lib, max(100, steps // 10), args.step_ms / 1000)
                # Within 5% of 1 / max(step, collate) means collation is hidden under the step.
                stepped[i].append((sbps, sbps * max(step, 1 / bps), scpu))
    rows = []
    for i, (name, config, mode, workers, lib) in enumerate(configs):
        st = stepped[i]
        rows.append({"loader": name, "config": config, "mode": mode, "workers": workers,
                     "batches_per_s": round(statistics.median(s[0] for s in samples[i])),
                     "main_cpu_us_per_batch": round(statistics.median(s[1] for s in samples[i]), 1),
                     "tokens_per_batch": round(statistics.median(s[2] for s in samples[i])),
                     "first_batch_s": round(statistics.median(s[3] for s in samples[i]), 4),
                     "load_min": round(min(s[4] for s in samples[i]), 2),
                     "load_max": round(max(s[4] for s in samples[i]), 2),
                     "with_step_batches_per_s": round(statistics.median(x[0] for x in st), 1) if st else "",
                     "with_step_fraction_of_bound": round(statistics.median(x[1] for x in st), 3) if st else "",
                     "with_step_main_cpu_us_per_batch": round(statistics.median(x[2] for x in st), 1) if st else ""})
    for i, r in enumerate(rows):
        for peer, config in (("portable_loader", "inline"), ("torchdata", None), ("litdata", None)):
            j = [k for k, (n, c, m, w, _) in enumerate(configs)
                 if n == peer and (config is None or c == config) and m == r["mode"] and w == r["workers"]]
            key = "x_inline" if peer == "portable_loader" else f"x_{peer}"
            r[key] = _median_ratio(samples[i], samples[j[0]]) if j else ""
        # Packed batches differ in how full they are (the peers pack greedily and drop what does not fit).
        r["tokens_per_s"] = round(r["batches_per_s"] * r["tokens_per_batch"])
    # Resume and worker-order checks, padded, once per library.
    for name, lib, lib2 in (
        ("portable_loader", Ours(cache, False, 0, 2), Ours(cache, False, 2, 2)),
        ("torchdata", TorchData(cache, False, 0, 2), TorchData(cache, False, 2, 2)),
        ("litdata", LitData(lit, False, 0, 2), LitData(lit, False, 2, 2)),
    ):
        seconds, exact = resume(lib, args.resume_step)
        depends = order_depends_on_workers(lib, lib2)
        print(f"{name}: resume at step {args.resume_step}: {seconds * 1000:.1f} ms, exact={exact}, "
              f"order depends on workers={depends}", flush=True)
        for r in rows:
            if r["loader"] == name:
                r.update(resume_ms=round(seconds * 1000, 1), resume_exact=exact, order_depends_on_workers=depends)
    header = list(rows[0])
    benchlib.write_table(args, header, [[r.get(k, "") for k in header] for r in rows])
    plot(args, rows)
    print(f"{machine()}, {args.records} records, {args.rounds} rounds")


if __name__ == "__main__":
    main()
