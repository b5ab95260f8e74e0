"""Benchmark: how the loader scales with worker processes, against torch's DataLoader and real Grain.

    python scripts/bench_workers.py                              # workers 0 1 2, 3 rounds
    python scripts/bench_workers.py --workers 0 1 2 4 8 14 --rounds 3 --tokens 300000000   # a 16-core host

One flat uint16 corpus (EOS between documents of ~800 tokens), and for each worker count, rounds
interleaved (the median round is reported):

* ``concat``: ``pl.pretokenized`` + ``packing="concat"``, 64 x 4096 (5 fields, 3.7 MB a batch);
* ``packed``: the same documents packed best-fit (``packing=True``), 64 x 4096;
* ``padded-long``: padded rows of 106,496 tokens, 64 a batch (3 fields, 41 MB a batch): the main
  process's cost a batch must not grow with the batch's bytes;
* ``tokenized``: ``pl.tokenized`` over 20,000 c4 demo rows (the shared data), phi-3-mini, packed 8 x 2048;
* ``map``: ``from portable_loader import grain``: a Python map of ~200 us a record, batched by 64,
  through ``grain.DataLoader`` (work per record that is real: it must scale with the workers);
* peers on the same windows: ``torch``: ``torch.utils.data.DataLoader`` over a map-style dataset of
  the same fixed 4096-token windows (``input_ids`` int64, 64 a batch); ``grain``: real Grain's
  ``MapDataset.source(windows).shuffle().batch(64).to_iter_dataset().mp_prefetch(...)``; and real
  Grain over the same map.

Each row: batches/s and tokens/s, the main process's CPU seconds a batch (what decides how many
workers one trainer process can feed), the workers' CPU seconds together. Then, per worker count,
the main process's CPU a batch for ``concat`` over the inline engine's (0 workers) on the same
batch, and for 41 MB padded batches over 3.7 MB concat ones. Writes ``docs/bench/workers.csv`` and
``.svg`` (``--csv``/``--svg``) and prints a Markdown table.

``--step-ms S`` sleeps S ms before each batch, as a trainer's step leaves the loader: the main
process's CPU a batch is then what a training loop pays (its caches cold from whatever ran in the
step: the workers streaming 41 MB batches through them cost the tight loop's next batch more than
the batch's own size does). Batches/s then only says that the loader kept up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import add_output_args, load, machine, write_table  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data")
DATA = os.environ.get("PORTABLE_LOADER_DATA", DATA)
SEQ = 4096
BATCH = 64
MAP_US = 200


def make_corpus(path: str, tokens: int) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 50_000, tokens).astype(np.uint16)
    ids[rng.choice(tokens, tokens // 800, replace=False)] = 0
    ids.tofile(path)


def busy(x, us=MAP_US):
    """A map of ~``us`` microseconds of Python a record."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass
    return x


class Windows:
    """Fixed ``SEQ``-token windows of the corpus, as a map-style dataset (torch's and Grain's input)."""

    def __init__(self, path):
        self.path, self.ids = path, None

    def __len__(self):
        return os.path.getsize(self.path) // 2 // SEQ

    def __getitem__(self, i):
        if self.ids is None:
            self.ids = np.memmap(self.path, dtype=np.uint16, mode="r")
        return self.ids[i * SEQ:(i + 1) * SEQ].astype(np.int64)

    def __getstate__(self):
        return {"path": self.path, "ids": None}


def cpu_of(pids) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def map_loader(grain, workers):
    """The same code for both Grain modules: a ~200 us Python map a record, batched, through ``grain.DataLoader``."""

    class Busy(grain.transforms.Map):
        def map(self, x):
            return busy(x)

    n = 10**6
    sampler = grain.samplers.IndexSampler(num_records=n, shard_options=grain.sharding.NoSharding(), shuffle=False,
                                          num_epochs=1, seed=0)
    return grain.DataLoader(data_source=np.arange(n), sampler=sampler, operations=[Busy(), grain.transforms.Batch(BATCH)],
                            worker_count=workers)


def run_ours(kind, path, workers, steps, step_s=0.0):
    import portable_loader as pl
    from portable_loader import grain

    if kind == "map":
        it = iter(map_loader(grain, workers))
        return _timed(it, steps, BATCH, lambda: _worker_pids(it), step_s)
    if kind == "tokenized":  # c4 rows, phi-3-mini, packed 8 x 2048
        ds = pl.tokenized(path + ".jsonl", tokenizer=os.path.join(DATA, "tokenizers", "phi-3-mini"), format="text",
                          max_length=2048, overlong="truncate")
        it = iter(pl.DataLoader(ds, global_batch_size=8, seq_len=2048, packing=True, num_workers=workers, seed=0))
        return _timed(it, steps, None, lambda: _worker_pids(it), step_s)
    docs = pl.pretokenized(path, eos_token_id=0)
    if kind == "padded-long":
        opts = dict(global_batch_size=BATCH, seq_len=106_496, packing=False)
    else:
        opts = dict(global_batch_size=BATCH, seq_len=SEQ, packing="concat" if kind == "concat" else True)
    it = iter(pl.DataLoader(docs, num_workers=workers, seed=0, **opts))
    return _timed(it, steps, None, lambda: _worker_pids(it), step_s)


def _worker_pids(it):
    """The worker processes of one of our iterators (forked or started by the forkserver)."""
    import psutil

    me = psutil.Process()
    server = [p.pid for p in me.children() if "forkserver import main" in " ".join(p.cmdline())]
    return [p.pid for p in me.children(recursive=True) if p.pid not in server and "resource_tracker" not in " ".join(p.cmdline())]


def _timed(it, steps, tokens_per, pids, step_s=0.0):
    t = time.perf_counter()
    first = next(it)  # start-up (workers starting, the first window): reported apart, not in the rates
    first_s = time.perf_counter() - t
    workers = pids()
    # Our loaders count real tokens where the batch is built (it.stats): counting them here would
    # add the benchmark's own per-byte work to the main process's CPU.
    stats = (lambda: it.stats["tokens"]) if tokens_per is None else (lambda: 0)
    s0, w0, c0, t0 = stats(), cpu_of(workers), time.process_time(), time.perf_counter()
    for _ in range(steps):
        if step_s:
            time.sleep(step_s)  # the trainer's step: no CPU of this process
        next(it)
    wall, cpu, wcpu = time.perf_counter() - t0, time.process_time() - c0, cpu_of(workers) - w0
    tokens = stats() - s0 if tokens_per is None else tokens_per * steps
    close = getattr(it, "close", None)
    if close:
        close()
    del first
    return {"per_s": steps / wall, "tokens_per_s": tokens / wall, "main_cpu_ms": 1e3 * cpu / steps,
            "workers_cpu_ms": 1e3 * wcpu / steps, "first_s": first_s, "load": load()}


def run_torch(path, workers, steps, step_s=0.0):
    import torch

    loader = torch.utils.data.DataLoader(Windows(path), batch_size=BATCH, shuffle=True, num_workers=workers,
                                         persistent_workers=False, prefetch_factor=2 if workers else None)
    it = iter(loader)
    res = _timed(it, steps, BATCH * SEQ, lambda: [w.pid for w in getattr(it, "_workers", [])], step_s)
    del it
    return res


def run_grain(kind, path, workers, steps, step_s=0.0):
    import grain
    import psutil
    from absl import flags

    if not flags.FLAGS.is_parsed():  # real Grain's workers read absl flags (a script under absl.app has them)
        flags.FLAGS.mark_as_parsed()

    if kind == "map":
        it = iter(map_loader(grain, workers))
        per = BATCH
    else:
        ds = grain.MapDataset.source(Windows(path)).shuffle(seed=0).batch(BATCH).to_iter_dataset()
        if workers:
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
        it = iter(ds)
        per = BATCH * SEQ
    res = _timed(it, steps, per, lambda: [p.pid for p in psutil.Process().children(recursive=True)], step_s)
    close = getattr(it, "close", None)
    if close:
        close()
    return res


def main():
    parser = add_output_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), "workers")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=30_000_000)
    parser.add_argument("--steps", type=int, default=60, help="batches timed per measurement (map: a quarter)")
    parser.add_argument("--step-ms", type=float, default=0.0, help="a trainer's step, slept before each batch")
    parser.add_argument("--kinds", nargs="+",
                        default=["concat", "packed", "padded-long", "tokenized", "map", "torch", "grain", "grain-map"])
    args = parser.parse_args()
    epoch = args.tokens // SEQ // BATCH  # batches in one epoch of the peers' windows (they stop there)
    if {"torch", "grain"} & set(args.kinds) and args.steps + 1 > epoch:
        parser.error(f"--tokens {args.tokens:,} holds {epoch} batches of windows: the peers' epoch ends before "
                     f"--steps {args.steps}; raise --tokens to {(args.steps + 1) * SEQ * BATCH:,} or more")
    print(f"machine: {machine()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "corpus.bin")
        make_corpus(path, args.tokens)
        if "tokenized" in args.kinds:
            with open(os.path.join(DATA, "text", "llamafactory_c4_demo.jsonl")) as f, open(path + ".jsonl", "w") as out:
                texts = [json.loads(line)["text"] for line in f if line.strip()]
                for i in range(20_000):  # the c4 demo rows repeated, each made distinct by its number
                    out.write(json.dumps({"text": f"{texts[i % len(texts)]} ({i})"}) + "\n")
        runs = {(k, w): [] for k in args.kinds for w in args.workers}
        for r in range(args.rounds):
            for kind in args.kinds:
                for w in args.workers:
                    # tokenized: many packing windows (~35 steps each), so that tokenizing, not serving, is timed
                    steps = 4 * args.steps if kind == "tokenized" else max(4, args.steps // 4) if "map" in kind else args.steps
                    step_s = args.step_ms / 1e3
                    if kind == "torch":
                        res = run_torch(path, w, steps, step_s)
                    elif kind.startswith("grain"):
                        res = run_grain("map" if kind == "grain-map" else "windows", path, w, steps, step_s)
                    else:
                        res = run_ours(kind, path, w, steps, step_s)
                    runs[(kind, w)].append(res)
                    print(f"round {r} {kind} {w} workers: first batch {res['first_s']:.3f} s, then {res['per_s']:.1f} "
                          f"batches/s, main {res['main_cpu_ms']:.2f} ms CPU a batch, workers {res['workers_cpu_ms']:.2f} "
                          f"(load {res['load']:.1f})", flush=True)
    rows = []
    for (kind, w), results in runs.items():
        med = sorted(results, key=lambda x: x["per_s"])[len(results) // 2]
        rows.append([kind, w, round(med["per_s"], 1), round(med["tokens_per_s"]), round(med["main_cpu_ms"], 3),
                     round(med["workers_cpu_ms"], 3), round(statistics.median(x["per_s"] for x in results), 1),
                     round(statistics.median(x["first_s"] for x in results), 3), round(med["load"], 2)])
    header = ["kind", "workers", "batches_per_s", "tokens_per_s", "main_cpu_ms_per_batch", "workers_cpu_ms_per_batch",
              "median_batches_per_s", "median_first_batch_s", "load_average"]
    write_table(args, header, rows)
    print("| kind | workers | first batch (s) | steady batches/s | main CPU ms/batch | workers CPU ms/batch | load average |\n"
          "|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row[0]} | {row[1]} | {row[7]} | {row[2]} | {row[4]} | {row[5]} | {row[8]} |")
    # Ratios of medians over the rounds (each round's CPU is noisy on a shared machine).
    main_cpu = {key: statistics.median(x["main_cpu_ms"] for x in results) for key, results in runs.items()}
    for w in args.workers:
        if w and ("concat", 0) in main_cpu and ("concat", w) in main_cpu:
            print(f"concat, {w} workers: main CPU a batch {main_cpu[('concat', w)]:.3f} ms = "
                  f"{main_cpu[('concat', w)] / main_cpu[('concat', 0)]:.1%} of the inline engine's {main_cpu[('concat', 0)]:.3f}")
        if w and ("concat", w) in main_cpu and ("padded-long", w) in main_cpu:
            print(f"{w} workers: main CPU a batch, 41 MB padded over 3.7 MB concat: "
                  f"{main_cpu[('padded-long', w)] / main_cpu[('concat', w)]:.2f}x")
    if args.svg != "-":
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for kind in args.kinds:
            ax.plot(args.workers, [next(r[2] for r in rows if r[0] == kind and r[1] == w) for w in args.workers],
                    marker="o", label=kind)
        ax.set_xlabel("worker processes")
        ax.set_ylabel("batches/s")
        ax.set_yscale("log")
        ax.set_title(machine(), fontsize=7)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.svg)


if __name__ == "__main__":
    main()
