"""Benchmark: precache against the usual ways of tokenizing an SFT set, on the same input and tokenizer.

    python scripts/bench_precache.py                      # 30k alpaca rows, phi-3-mini (32k BPE)
    python scripts/bench_precache.py --rows 5000 --open-rows 200000
    python scripts/bench_precache.py --engines            # local engine vs Ray, into precache_ray.csv/svg

Contenders (every one does the same per-row work through ``Formatter``: render, tokenize, mask):
  (a) precache: slice workers, each reading its own row range and writing its own shard
  (b) datasets: ``load_dataset("json").map(batched=True, num_proc=W)`` + ``save_to_disk``
  (c) a plain single-process loop, one row at a time, then one Arrow write
  (d) a multiprocessing pool that sends rows to workers and results back (the hand-written way)
  (e) the ceiling: the tokenizer's own batch encoder over the already rendered texts, on all cores
Each runs in a fresh interpreter with its libraries imported and the tokenizer loaded once (which
warms transformers' lazy imports, ~3 s here): start-up is not throughput.
Then a cache hit: ``open_cache`` of an ``--open-rows`` cache against ``datasets.load_from_disk``
and ``load_from_disk(...).to_list()``, with the RSS each one costs.

``--engines``: ``engine="local"`` against ``engine="ray"`` with the same number of processes, 1 and
3: Ray on a ``ray.cluster_utils.Cluster`` of this machine (a head and worker nodes of 1 CPU each, on
127.0.0.1). Each driver is a fresh process and builds twice (cold: Ray's workers start and load the
tokenizer; warm: they are reused); local and Ray drivers alternate for ``--rounds`` rounds, best of
each: rows/s, Ray's time over local's, and the driver's peak RSS (the highest seen). ``--engines``'
cold and warm builds are start-up and steady state apart.

A build is one job with no first batch: its rows/s is over the whole job, start-up (a pool's
processes, the tokenizer) included, since that is what a user waits for. Every figure is printed
with the load average it was measured under.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from benchlib import add_output_args, bar_svg, grouped_svg, load, machine, write_table  # noqa: E402

import portable_loader as pl  # noqa: E402
from portable_loader.cache import ShardWriter, write_manifest, FORMAT_VERSION  # noqa: E402
from portable_loader.tokenize import Formatter, load_tokenizer  # noqa: E402

_fmt = None


def _formatter(tokenizer: str) -> Formatter:
    global _fmt
    if _fmt is None:
        _fmt = Formatter("alpaca", load_tokenizer(tokenizer), max_length=2048)
    return _fmt


def make_input(path: str, rows: int) -> None:
    source = json.load(open(os.path.join(DATA, "alpaca", "llamafactory_alpaca_en_demo.json")))
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps(source[i % len(source)]) + "\n")


def run_precache(inp, tok, out, workers):
    t = time.perf_counter()
    pl.precache(inp, tokenizer=tok, format="alpaca", out=out, max_length=2048, num_workers=workers, force=True)
    return time.perf_counter() - t


def _hf_map(batch, tokenizer):
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    out = [r for r in _formatter(tokenizer).encode(rows) if not isinstance(r, str)]
    return {"input_ids": [ids for ids, _ in out], "loss_mask": [m for _, m in out]}


def run_datasets(inp, tok, out, workers):
    import datasets

    datasets.disable_progress_bars()
    t = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=inp, split="train", cache_dir=os.path.join(out, "hf_cache"))
    ds = ds.map(
        _hf_map, batched=True, batch_size=256, num_proc=workers, remove_columns=ds.column_names,
        fn_kwargs={"tokenizer": tok}, load_from_cache_file=False,
    )
    ds.save_to_disk(os.path.join(out, "saved"))
    return time.perf_counter() - t


def _write(records, path):
    w = ShardWriter(path, "arrow")
    for ids, mask in records:
        w.write(ids, mask)
    w.close()


def run_loop(inp, tok, out, workers):
    t = time.perf_counter()
    fmt = _formatter(tok)
    records = []
    with open(inp) as f:
        for line in f:
            r = fmt.encode([json.loads(line)])[0]
            if not isinstance(r, str):
                records.append(r)
    _write(records, os.path.join(out, "loop.arrow"))
    return time.perf_counter() - t


def _encode_line(args):
    line, tok = args
    return _formatter(tok).encode([json.loads(line)])[0]


def run_pool(inp, tok, out, workers):
    t = time.perf_counter()
    with open(inp) as f, mp.get_context("fork").Pool(workers) as pool:
        results = pool.imap(_encode_line, ((line, tok) for line in f), chunksize=64)
        records = [r for r in results if not isinstance(r, str)]
    _write(records, os.path.join(out, "pool.arrow"))
    return time.perf_counter() - t


def run_ceiling(inp, tok, out, workers):
    fmt = _formatter(tok)
    texts = [fmt._render_alpaca(json.loads(line), lambda: "")[0] for line in open(inp)]
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    t = time.perf_counter()
    fmt.backend.encode_batch(texts, add_special_tokens=True)
    return time.perf_counter() - t


def _isolated(name, inp, tok, workers):
    """Run one contender in a fresh interpreter, so none inherits another's warm state."""
    out = tempfile.mkdtemp(prefix=f"bench-{name}-")
    code = (
        # Libraries are imported (and transformers warmed by one tokenizer load) before the clock
        # starts, as in a training script: start-up is not throughput, and would decide a 30k-row race.
        f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'scripts')!r}); import bench_precache as b; "
        "import transformers, datasets, pyarrow; from portable_loader.tokenize import load_tokenizer; "
        f"load_tokenizer({tok!r}); "
        f"print(b.run_{name}({inp!r}, {tok!r}, {out!r}, {workers}))"
    )
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        return float(r.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(out, ignore_errors=True)


def make_big_cache(out: str, rows: int) -> str:
    """A cache of ``rows`` short records, written directly (tokenizing them would only cost time)."""
    path = os.path.join(out, "big")
    os.makedirs(path)
    rng = np.random.default_rng(0)
    shards = []
    per = -(-rows // 4)
    for s in range(4):
        w = ShardWriter(os.path.join(path, f"data-{s:05d}-of-00004.arrow"), "arrow")
        for n in rng.integers(16, 96, size=min(per, rows - s * per)):
            w.write(np.arange(n, dtype=np.int32), np.ones(n, dtype=np.uint8))
        shards.append(w.close())
    counts = {"rows_in": rows, "rows_out": rows, "dropped": {}, "truncated": 0, "tokens": 0, "trainable_tokens": 0}
    write_manifest(path, {"format_version": FORMAT_VERSION, "backend": "arrow", "key": "0" * 64, "counts": counts,
                          "content_checksum": "", "shards": shards})
    return path


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def open_probe(path: str, how: str) -> str:
    import pyarrow  # noqa: F401  (loaded in any trainer; its import is not the open's cost)

    if how != "open_cache":
        import datasets
    before = _rss_mib()
    t = time.perf_counter()
    if how == "open_cache":
        src = pl.open_cache(path)
        n = len(src)
    elif how == "load_from_disk":
        n = len(datasets.load_from_disk(path))
    else:
        n = len(datasets.load_from_disk(path).to_list())
    seconds = time.perf_counter() - t
    opened = _rss_mib()
    grow = ""
    if how == "open_cache":
        for i in range(0, n, 4096):  # read every record once, batch by batch
            for r in src.__getitems__(range(i, min(n, i + 4096))):
                r["input_ids"].sum()
        grow = f" {_rss_mib() - opened:.1f}"
    return f"{seconds:.4f} {opened - before:.1f}{grow}"


def _probe(path, how):
    code = f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'scripts')!r}); import bench_precache as b; print(b.open_probe({path!r}, {how!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return [float(x) for x in out.split()]


def _kib(field: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))


def drive(inp: str, tok: str, out: str, engine: str, processes: int, address: str | None) -> str:
    """One driver: two builds of ``inp`` (cold, warm); seconds, and the driver's peak RSS in MiB."""
    from portable_loader.precache import build_cache

    if engine == "ray":
        import ray

        ray.init(address=address, _node_ip_address="127.0.0.1", log_to_driver=False, logging_level="ERROR")
    open("/proc/self/clear_refs", "w").write("5")  # from here on, VmHWM is this driver's build peak
    base = _kib("VmRSS")
    seconds = []
    for _ in range(2):
        t = time.perf_counter()
        _, s = build_cache(inp, tokenizer=tok, format="alpaca", out=out, max_length=2048, force=True,
                           engine=engine, num_workers=processes, ray_address=address)
        seconds.append(time.perf_counter() - t)
    return json.dumps({"cold": seconds[0], "warm": seconds[1], "tasks": s["tasks"],
                       "peak_mib": _kib("VmHWM") / 1024, "growth_mib": (_kib("VmHWM") - base) / 1024})


def _drive(inp, tok, engine, processes, address=None) -> dict:
    out = tempfile.mkdtemp(prefix="bench-engines-")
    code = (f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'scripts')!r}); import bench_precache as b; "
            f"print(b.drive({inp!r}, {tok!r}, {out!r}, {engine!r}, {processes}, {address!r}))")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
        return json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(out, ignore_errors=True)


def engines(args) -> None:
    """``--engines``: local vs Ray with 1 and 3 processes (see the module docstring)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every Ray process on 127.0.0.1
    from ray.cluster_utils import Cluster

    node = dict(num_cpus=1, node_ip_address="127.0.0.1", include_dashboard=False, object_store_memory=80 << 20)
    print(f"machine: {machine()}; {args.rows:,} alpaca rows; tokenizer {os.path.basename(args.tokenizer)}")
    work = tempfile.mkdtemp(prefix="bench-engines-")
    rows = []
    try:
        inp = os.path.join(work, "alpaca.jsonl")
        make_input(inp, args.rows)
        for processes in (1, 3):
            cluster = Cluster(initialize_head=True, head_node_args=node)
            try:
                for _ in range(processes - 1):
                    cluster.add_node(**node)
                cluster.wait_for_nodes()
                # Interleaved rounds, best of each: the machine is shared, and its load drifts.
                runs = {"local": [], "ray": []}
                for _ in range(args.rounds):
                    runs["local"].append(_drive(inp, args.tokenizer, "local", processes))
                    runs["ray"].append(_drive(inp, args.tokenizer, "ray", processes, cluster.address))
            finally:
                cluster.shutdown()
            best = {e: {k: (max if k.endswith("mib") else min)(r[k] for r in rs) for k in rs[0]} for e, rs in runs.items()}
            local = best["local"]
            for name, r in best.items():
                row = [name, processes, args.rows, r["tasks"], r["cold"], r["warm"], args.rows / r["warm"],
                       r["cold"] / local["cold"], r["warm"] / local["warm"], r["peak_mib"], r["growth_mib"]]
                rows.append(row)
                print(f"{name:5s} x{processes}: cold {r['cold']:6.2f} s, warm {r['warm']:6.2f} s = "
                      f"{row[6]:7,.0f} rows/s ({row[8]:.2f}x local's time); driver peak RSS {r['peak_mib']:.0f} MiB "
                      f"(+{r['growth_mib']:.0f} MiB in the builds) (load {load():.1f})", flush=True)
        write_table(args, ["engine", "processes", "rows", "tasks", "cold_seconds", "warm_seconds", "rows_per_s",
                           "cold_vs_local", "warm_vs_local", "driver_peak_rss_mib", "driver_build_growth_mib"], rows)
        grouped_svg(args, f"precache of {args.rows:,} alpaca rows: local engine vs Ray (1 CPU per node), warm",
                    [f"{p} process{'es' if p > 1 else ''}" for p in (1, 3)],
                    {e: [r[6] for r in rows if r[0] == e] for e in ("local", "ray")}, "rows/s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=None, help="default 30,000; with --engines 12,000")
    p.add_argument("--tokenizer", default=os.path.join(DATA, "tokenizers", "phi-3-mini"))
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--open-rows", type=int, default=1_000_000)
    p.add_argument("--skip-list", action="store_true", help="skip load_from_disk(...).to_list() (slow)")
    p.add_argument("--engines", action="store_true", help="only local vs Ray: precache_ray.csv/svg")
    p.add_argument("--rounds", type=int, default=2, help="--engines: interleaved rounds (best of)")
    engines_only = "--engines" in sys.argv[1:]
    args = add_output_args(p, "precache_ray" if engines_only else "precache").parse_args()
    if args.engines:
        args.rows = args.rows or 12_000
        return engines(args)
    args.rows = args.rows or 30_000
    print(f"machine: {machine()}; {args.workers} workers; {args.rows:,} alpaca rows; tokenizer {os.path.basename(args.tokenizer)}")
    work = tempfile.mkdtemp(prefix="bench-precache-")
    try:
        inp = os.path.join(work, "alpaca.jsonl")
        make_input(inp, args.rows)
        results, loads = {}, {}
        for name, label in [
            ("ceiling", "(e) ceiling: tokenizer batch encoder, all cores, pre-rendered"),
            ("precache", "(a) portable_loader precache"),
            ("datasets", "(b) datasets map(batched, num_proc) + save_to_disk"),
            ("loop", "(c) single-process loop"),
            ("pool", "(d) pool: rows to workers, results back"),
        ]:
            seconds = _isolated(name, inp, args.tokenizer, args.workers)
            results[name], loads[name] = args.rows / seconds, load()
            print(f"{label:62s} {results[name]:9,.0f} rows/s (load {loads[name]:.1f})", flush=True)
        print()
        print("| contender | rows/s | vs ceiling | precache vs it | load average |")
        print("|---|---|---|---|---|")
        labels = [("precache", "(a) precache"), ("datasets", "(b) `datasets` map + save_to_disk"),
                  ("loop", "(c) single-process loop"), ("pool", "(d) pool, rows out and results back"),
                  ("ceiling", "(e) ceiling: batch encoder, pre-rendered")]
        table = []
        for name, label in labels:
            r = results[name]
            print(f"| {label} | {r:,.0f} | {r / results['ceiling']:.0%} | {results['precache'] / r:.2f}x | {loads[name]:.1f} |")
            table.append(["tokenize", label, r, r / results["ceiling"], "", "", ""])

        big = make_big_cache(work, args.open_rows)
        print(f"\ncache hit on {args.open_rows:,} records (fresh process each; RSS growth in MiB):")
        rows = [("open_cache", _probe(big, "open_cache"))]
        rows.append(("load_from_disk", _probe(big, "load_from_disk")))
        if not args.skip_list:
            rows.append(("load_from_disk(...).to_list()", _probe(big, "to_list")))
        print("| open | seconds | RSS to open | RSS after reading every record |")
        print("|---|---|---|---|")
        for how, v in rows:
            print(f"| {how} | {v[0]:.3f} | {v[1]:.1f} MiB | {f'+{v[2]:.1f} MiB' if len(v) > 2 else '-'} |")
            table.append([f"open {args.open_rows} records", how, "", "", v[0], v[1], v[2] if len(v) > 2 else ""])
        write_table(args, ["kind", "contender", "rows_per_s", "vs_ceiling", "open_seconds", "rss_open_mib",
                           "rss_after_reading_mib"], table)
        bar_svg(args, f"Tokenizing {args.rows:,} alpaca rows ({args.workers} workers)", [lab for _, lab in labels],
                [results[name] for name, _ in labels], "rows/s", highlight=["(a) precache"])
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
