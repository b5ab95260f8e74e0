"""Benchmark: our Grain-style datasets against real Grain, the same pipelines in one process.

    python scripts/bench_grain.py                # 5 interleaved rounds, default sizes (about 3 minutes on 2 cores)
    python scripts/bench_grain.py --quick        # 1 round, small counts: a smoke run (under a minute)
    python scripts/bench_grain.py --rows d --rounds 5 --pack-steps 100   # only first-fit packing (row d)
    # writes docs/bench/grain.csv and grain.svg (--csv/--svg), as every scripts/bench_*.py

Each pipeline is built twice from the same code, once with ``grain.MapDataset`` (Grain 0.2.18) and
once with ours (``portable_loader.grain``, or ``portable_loader.dataset.Dataset`` where that
namespace is not there yet), then turned into an ``IterDataset`` with ``to_iter_dataset()`` (each
library's default ``ReadOptions``: Grain's reads ahead with 16 threads, ours reads in the iterating
thread) and, for 2 workers, ``.mp_prefetch(MultiprocessingOptions(num_workers=2))`` (each library's
own options class and defaults):

  (a) ``range(N).map(f).batch(B)``: f makes a 16-int32 record of each integer;
  (b) ``source(...).shuffle(0).repeat().map(...).batch(B)`` over the same ArrayRecord shard files
      (``pl.precache(**sample_args(), backend="array_record")``, 2,000 chat records): Grain reads them
      through ``grain.sources.ArrayRecordDataSource(files)`` and its map decodes the raw bytes and
      pads; ours reads ``pl.open_cache(path)`` (records come decoded) and its map pads; both yield
      ``{"input_ids": int32[B, 128], "loss_mask": uint8[B, 128]}``. Row (b2): ours over the very
      same ``ArrayRecordDataSource`` object with Grain's own map (decode and pad);
  (c) ``mix([3 ranges], [0.5, 0.3, 0.2]).map(f).batch(B)``;
  (d) first-fit packing: ``grain.experimental.FirstFitPackIterDataset`` (Grain's, and ours from
      ``portable_loader.grain.experimental``) over the same input stream: the ArrayRecord records
      through Grain's ``ArrayRecordDataSource``, in order, repeated, decoded by the same map; 512
      tokens, 8 bins, ``shuffle_bins=False``. The unit is packed rows. Both yield the same rows.

Before timing, the script checks that both libraries yield the same elements: (a), (c) and (d)
element for element (Grain is deterministic there); (b) one epoch element for element (the shuffle
is Grain's order) and the same structure, dtypes and shapes; and that our
stream with 2 workers equals ours without. Rates are elements (records) per second at steady state:
the first element is timed apart (time to first batch, which includes starting the workers), a
warm-up follows (a tenth of the count, plus 256 batches with workers: what they computed while the
first element was awaited), then a fixed count of batches is timed (``--steps`` etc. for Grain, 4x
that for ours, ``--ours-factor``: ours is faster, and a chunk of 64 batches arrives at once from its
workers, so a longer window keeps that granularity out). Rounds are interleaved (every other round
runs the rows in reverse and Grain before ours); a row's ratio is the median over rounds of that
round's ours / Grain, and its rates the medians over rounds. At 0 workers Grain is also measured with
``ReadOptions(num_threads=0)`` (its defaults start 16 prefetch threads per process): the
``x_grain_threads0`` column. benchlib has no peak-RSS helper, so no RSS is reported.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import benchlib  # noqa: E402
from benchlib import load, machine  # noqa: E402

import portable_loader as pl  # noqa: E402
from portable_loader.precache import sample_args  # noqa: E402

from portable_loader.dataset import Dataset  # noqa: E402

OursMap, OURS_NAME, ours = Dataset, "portable_loader.dataset.Dataset", None
try:  # `from portable_loader import grain` where that namespace is built: the same class
    from portable_loader import grain as ours

    if hasattr(ours, "MapDataset"):
        OursMap, OURS_NAME = ours.MapDataset, "portable_loader.grain.MapDataset"  # noqa: N816
        if ours.MapDataset is Dataset:
            OURS_NAME += " (the class portable_loader.dataset.Dataset)"
    else:
        OURS_NAME += " (portable_loader.grain has no MapDataset yet)"
except Exception as e:  # noqa: BLE001 - a namespace still being written must not stop the bench
    OURS_NAME += f" (portable_loader.grain does not import: {type(e).__name__})"
    ours = None


def ours_packer():
    """(our FirstFitPackIterDataset or None, what the log says about it)."""
    try:
        return ours.experimental.FirstFitPackIterDataset, "portable_loader.grain.experimental.FirstFitPackIterDataset"
    except Exception as e:  # noqa: BLE001 - NotSupportedError while not built; AttributeError without the namespace
        return None, f"not built yet ({type(e).__name__}: {str(e).split(';')[0]})"


def options(lib: str, workers: int):
    """``MultiprocessingOptions(num_workers=workers)`` of the library that runs the pipeline."""
    import grain

    cls = getattr(ours, "MultiprocessingOptions", None) if lib == "ours" else None
    return (cls or grain.MultiprocessingOptions)(num_workers=workers)

B = 32  # records per batch
L = 128  # padded record length, row (b) (the sample's longest record has 100 tokens)
RANGE_N = 10**8  # row (a): never read to the end
MIX_PART, WEIGHTS = 10**6, [0.5, 0.3, 0.2]
PACK_LEN, PACK_BINS = 512, 8
# With workers, the elements computed while the first one was awaited come out of buffers at once:
# skipped before timing (ours keeps 2 workers x 2 chunks of 64 batches in flight; Grain gets the same).
WARM_WORKERS = 256


# --- the per-element work: module-level functions, so that Grain's spawned workers can unpickle them


def f(x):
    return np.full(16, x, np.int32)


def pad(r: dict) -> dict:
    n = min(L, len(r["input_ids"]))
    ids, mask = np.zeros(L, np.int32), np.zeros(L, np.uint8)
    ids[:n], mask[:n] = r["input_ids"][:n], r["loss_mask"][:n]
    return {"input_ids": ids, "loss_mask": mask}


def decode(raw: bytes) -> dict:
    """A record of our ArrayRecord cache: int32 token ids, then one uint8 loss-mask byte per token."""
    n = len(raw) // 5
    return {"input_ids": np.frombuffer(raw, np.int32, count=n),
            "loss_mask": np.frombuffer(raw, np.uint8, offset=4 * n)}


def decode_pad(raw: bytes) -> dict:
    return pad(decode(raw))


# --- the pipelines: each builder takes either library's MapDataset ---------------------------------


class Data:
    """The ArrayRecord cache both libraries read, built once per run."""

    def __init__(self, work: str):
        t = time.perf_counter()
        self.path = pl.precache(**sample_args(), out=os.path.join(work, "cache"), backend="array_record",
                                num_workers=0)
        self.files = sorted(os.path.join(self.path, x) for x in os.listdir(self.path) if x.endswith(".array_record"))
        self.precache_s = time.perf_counter() - t

    def grain_source(self):
        import grain

        return grain.sources.ArrayRecordDataSource(self.files)


def range_map_batch(M, data, same_source: bool):
    return M.range(RANGE_N).map(f).batch(B)


def arrayrecord(M, data, same_source: bool, repeat: bool = True):
    """Grain (and ours in row b2) over ``ArrayRecordDataSource``, decoding in the map; ours over ``pl.open_cache``."""
    if M is not OursMap or same_source:
        ds, fn = M.source(data.grain_source()).shuffle(seed=0), decode_pad
    else:
        ds, fn = M.source(pl.open_cache(data.path)).shuffle(seed=0), pad
    return (ds.repeat() if repeat else ds).map(fn).batch(B)


def mix3(M, data, same_source: bool):
    parts = [M.range(k * MIX_PART, (k + 1) * MIX_PART) for k in range(3)]
    return M.mix(parts, WEIGHTS).map(f).batch(B)


def packing(M, data, same_source: bool):
    import grain

    packer = grain.experimental.FirstFitPackIterDataset if M is grain.MapDataset else ours_packer()[0]
    # Unshuffled: this row measures packing; row (b) measures the shuffle.
    ds = M.source(data.grain_source()).repeat().map(decode).to_iter_dataset()
    return packer(ds, length_struct={"input_ids": PACK_LEN, "loss_mask": PACK_LEN}, num_packing_bins=PACK_BINS,
                  shuffle_bins=False)


# key: (label, builder, unit, elements per next(), contenders; "ours" absent where ours is not built)
ROWS = {
    "a": ("range->map->batch", range_map_batch, "records", B, ("ours", "grain", "grain_threads0")),
    "b": ("ArrayRecord: shuffle->map->batch", arrayrecord, "records", B, ("ours", "grain", "grain_threads0")),
    "b2": ("ArrayRecord, ours over Grain's ArrayRecordDataSource", arrayrecord, "records", B, ("ours",)),
    "c": ("3-source mix->map->batch", mix3, "records", B, ("ours", "grain", "grain_threads0")),
    "d": (f"first-fit packing ({PACK_LEN} tokens, {PACK_BINS} bins)", packing, "packed rows", 1,
          ("ours", "grain") if ours_packer()[0] is not None else ("grain",)),
}
GRAIN_OF = {"b2": "b"}  # row b2's Grain is row b's, measured in the same round


def build(row: str, lib: str, data, workers: int):
    """Row ``row`` built by ``lib`` ("ours", "grain" or "grain_threads0": ReadOptions(num_threads=0))."""
    import grain

    builder = ROWS[row][1]
    ds = builder(OursMap if lib == "ours" else grain.MapDataset, data, row == "b2")
    if row != "d":  # packing is an IterDataset already
        ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0)) if lib == "grain_threads0" else ds.to_iter_dataset()
    if workers:
        ds = ds.mp_prefetch(options(lib, workers))
    return ds


def measure(ds, steps: int, per: int, warm: int) -> tuple[float, float]:
    """(seconds from iter() to the first element, elements/s over ``steps`` after ``warm`` more)."""
    gc.collect()
    t = time.perf_counter()
    it = iter(ds)
    try:
        next(it)
        first = time.perf_counter() - t
        for _ in range(warm):
            next(it)
        t = time.perf_counter()
        for _ in range(steps):
            next(it)
        rate = steps * per / (time.perf_counter() - t)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    return first, rate


# --- the checks before timing ----------------------------------------------------------------------


def _take(ds, k: int) -> list:
    it = iter(ds)
    try:
        return [next(it) for _ in range(k)]
    finally:
        getattr(it, "close", lambda: None)()


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def _structure(x):
    if isinstance(x, dict):
        return {k: _structure(v) for k, v in sorted(x.items())}
    a = np.asarray(x)
    return (a.dtype.str, a.shape)


def checks(data, rows) -> list[str]:
    """What the script verified before timing, one line each; raises where the libraries differ."""
    import grain

    lines = []

    def require(ok: bool, line: str) -> None:
        lines.append(f"{line}: {ok}")
        if not ok:
            raise AssertionError(lines[-1])

    if "d" in rows and ours_packer()[0] is not None:
        g, o = _take(build("d", "grain", data, 0), 300), _take(build("d", "ours", data, 0), 300)
        require(len(g) == len(o) == 300 and all(_equal(x, y) for x, y in zip(g, o)),
                "(d) first 300 packed rows: ours == Grain, element for element")
        o2 = _take(build("d", "ours", data, 2), 300)
        require(all(_equal(x, y) for x, y in zip(o, o2)), "(d) ours with 2 workers == ours with none, first 300 rows")
    if not set(rows) & {"a", "b", "b2", "c"}:
        return lines
    for row in ("a", "c"):
        g, o = _take(build(row, "grain", data, 0), 40), _take(build(row, "ours", data, 0), 40)
        require(all(_equal(x, y) for x, y in zip(g, o)),
                f"({row}) first 40 batches of {B}: ours == Grain, element for element")
    epoch = {  # one epoch, no repeat
        "grain": list(arrayrecord(grain.MapDataset, data, False, repeat=False).to_iter_dataset()),
        "ours": list(arrayrecord(OursMap, data, False, repeat=False).to_iter_dataset()),
        "ours_same_source": list(arrayrecord(OursMap, data, True, repeat=False).to_iter_dataset()),
    }
    count = sum(len(b["input_ids"]) for b in epoch["grain"])
    require(len(epoch["grain"]) == len(epoch["ours"]) == len(epoch["ours_same_source"]) and
            all(_equal(g, o) and _equal(g, s) for g, o, s in zip(*epoch.values())),
            f"(b) one epoch, {count} records: ours == Grain, element for element (Grain's shuffled order), over "
            "pl.open_cache and over Grain's ArrayRecordDataSource")
    shapes = {lib: _structure(_take(build("b", lib, data, 0), 1)[0]) for lib in ("grain", "ours")}
    require(shapes["grain"] == shapes["ours"], f"(b) the same batch structure, {shapes['grain']}")
    for row in ("a", "b", "c"):
        o0, o2 = _take(build(row, "ours", data, 0), 30), _take(build(row, "ours", data, 2), 30)
        require(all(_equal(x, y) for x, y in zip(o0, o2)),
                f"({row}) ours with 2 workers == ours with none, first 30 batches")
    return lines


# --- the run --------------------------------------------------------------------------------------


def run_rounds(args, data) -> dict:
    """{(row, workers): {contender: [(elements/s, seconds to the first element, load average), one per round]}}."""
    counts = {"a": args.steps, "b": args.ar_steps, "b2": args.ar_steps, "c": args.steps, "d": args.pack_steps}
    cells = [(row, w) for w in (0, 2) for row in ROWS if row in args.rows]
    samples = {cell: {lib: [] for lib in ROWS[cell[0]][4]} for cell in cells}
    for rnd in range(args.rounds):
        # Every other round runs the rows in reverse and Grain before ours: nobody always goes first.
        for row, w in cells if rnd % 2 == 0 else cells[::-1]:
            per, libs = ROWS[row][3], ROWS[row][4]
            libs = [lib for lib in libs if w == 0 or lib != "grain_threads0"]
            for lib in libs if rnd % 2 == 0 else libs[::-1]:
                timed = counts[row] * (args.ours_factor if lib == "ours" else 1)
                warm = max(2, counts[row] // 10) + (WARM_WORKERS if w else 0)
                first, rate = measure(build(row, lib, data, w), timed, per, warm)
                samples[(row, w)][lib].append((rate, first, load()))
                print(f"round {rnd} ({row}) w={w} {lib:15s} {rate:12,.0f} /s, first element {first * 1e3:8.1f} ms "
                      f"(load {samples[(row, w)][lib][-1][2]:.1f})", flush=True)
    return samples


def summarize(samples: dict) -> list[dict]:
    def median(xs, k):
        return statistics.median(x[k] for x in xs) if xs else None

    def ratios(a, b):  # each round's ratio (its contenders ran seconds apart, under the same load)
        return [x[0] / y[0] for x, y in zip(a, b)] if a and b else []

    results = []
    for (row, w), s in samples.items():
        label, _, unit, _, _ = ROWS[row]
        mine, grain = s.get("ours", []), samples[(GRAIN_OF.get(row, row), w)]["grain"]
        x, x0 = ratios(mine, grain), ratios(mine, s.get("grain_threads0", []))
        results.append({
            "row": row, "pipeline": label, "workers": w, "unit": unit,
            "ours_per_s": round(median(mine, 0)) if mine else None,
            "grain_per_s": round(median(grain, 0)),
            "x_grain": round(statistics.median(x), 3) if x else None,
            "x_grain_min": round(min(x), 3) if x else None,
            "x_grain_max": round(max(x), 3) if x else None,
            "ours_first_ms": round(median(mine, 1) * 1e3, 1) if mine else None,
            "grain_first_ms": round(median(grain, 1) * 1e3, 1),
            "grain_threads0_per_s": round(median(s["grain_threads0"], 0)) if s.get("grain_threads0") else None,
            "x_grain_threads0": round(statistics.median(x0), 3) if x0 else None,
            "rounds": len(grain),
            "load_min": round(min(x[2] for x in grain + mine), 2),
            "load_max": round(max(x[2] for x in grain + mine), 2),
            "note": "" if mine else "ours: not built yet",
        })
    return results


def report(results: list[dict]) -> None:
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    print("\n| pipeline | workers | ours /s | Grain /s | ours / Grain, median (min-max) of rounds "
          "| first element, ours / Grain (ms) | Grain num_threads=0 /s | ours / that | load average (rounds) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ours = "not built yet" if r["ours_per_s"] is None else f"{r['ours_per_s']:,}"
        spread = "" if r["x_grain"] is None else f" ({r['x_grain_min']:.2f}-{r['x_grain_max']:.2f})"
        print(f"| ({r['row']}) {r['pipeline']} | {r['workers']} | {ours} | {r['grain_per_s']:,} | "
              f"{fmt(r['x_grain'], '.2f')}{spread} | {fmt(r['ours_first_ms'], '.1f')} / {r['grain_first_ms']:.1f} | "
              f"{fmt(r['grain_threads0_per_s'], ',')} | {fmt(r['x_grain_threads0'], '.2f')} | "
              f"{r['load_min']:.1f}-{r['load_max']:.1f} |")
    below = [f"({r['row']}) w={r['workers']}" for r in results if r["x_grain"] is not None and r["x_grain"] < 1]
    missing = [f"({r['row']}) w={r['workers']}" for r in results if r["ours_per_s"] is None]
    print(f"\nrows where ours is slower than Grain: {', '.join(below) or 'none'}; "
          f"ours not built yet: {', '.join(missing) or 'none'}")


def plot(args, results: list[dict]) -> None:
    if args.svg == "-":
        return
    # Packing's low bars at both ends, where the legend goes.
    results = sorted(results, key=lambda r: (r["workers"], (r["row"] != "d") == (r["workers"] == 0)))
    built = ours_packer()[0] is not None
    short = {"a": "range", "b": "ArrayRecord", "b2": "ArrayRecord,\nGrain's source", "c": "3-source mix",
             "d": "first-fit\npacking" if built else "packing\n(ours: none)"}
    groups = [f"{short[r['row']]}\nw={r['workers']}" for r in results]
    nan = float("nan")
    series = {
        "ours": [r["ours_per_s"] or nan for r in results],
        "Grain": [r["grain_per_s"] for r in results],
        "Grain, 0 threads": [r["grain_threads0_per_s"] or nan for r in results],
    }
    benchlib.grouped_svg(args, f"The same pipelines, ours against Grain {_version('grain')}, 0 and 2 workers "
                         f"(batch {B}{'' if built else '; first-fit packing: ours not built yet'})",
                         groups, series, "records/s (packing: packed rows/s)", log=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=1600, help="Grain's timed batches per measurement, rows (a), (c)")
    ap.add_argument("--ar-steps", type=int, default=400, help="Grain's timed batches per measurement, rows (b), (b2)")
    ap.add_argument("--pack-steps", type=int, default=200, help="Grain's timed packed rows per measurement, row (d)")
    ap.add_argument("--ours-factor", type=int, default=4, help="ours times this many times the batches")
    ap.add_argument("--quick", action="store_true", help="1 round, a quarter of the counts: a smoke run")
    ap.add_argument("--rows", default=",".join(ROWS), help="which rows to run, comma-separated (default: all)")
    ap.add_argument("--work", default=None, help="where to write the cache (default: a temporary folder)")
    benchlib.add_output_args(ap, "grain")
    args = ap.parse_args()
    args.rows = [r for r in args.rows.split(",") if r]
    unknown = set(args.rows) - set(ROWS)
    if unknown or ("b2" in args.rows and "b" not in args.rows):
        ap.error(f"--rows: choose from {', '.join(ROWS)} (b2 needs b, whose Grain it shares); got {args.rows}")
    if set(args.rows) != set(ROWS):  # a partial run must not overwrite the full run's table and plot
        args.csv = "-" if args.csv == ap.get_default("csv") else args.csv
        args.svg = "-" if args.svg == ap.get_default("svg") else args.svg
    if args.quick:
        args.rounds = 1
        args.steps, args.ar_steps, args.pack_steps = args.steps // 4, args.ar_steps // 4, args.pack_steps // 4
    started = time.perf_counter()
    work = args.work or tempfile.mkdtemp(prefix="bench_grain_")
    try:
        data = Data(work)
        print(f"machine: {machine()}", flush=True)
        print(f"ours: {OURS_NAME}; Grain {_version('grain')}; batch {B}; ArrayRecord cache of "
              f"{len(pl.open_cache(data.path))} records in {len(data.files)} shards "
              f"({data.precache_s:.1f} s to build); {args.rounds} rounds", flush=True)
        print(f"ours, first-fit packing: {ours_packer()[1]}", flush=True)
        t = time.perf_counter()
        for line in checks(data, args.rows):
            print("check: " + line, flush=True)
        print(f"checks: {time.perf_counter() - t:.1f} s", flush=True)
        results = summarize(run_rounds(args, data))
        report(results)
        header = list(results[0])
        benchlib.write_table(args, header, [["" if r[k] is None else r[k] for k in header] for r in results])
        plot(args, results)
        print(f"{machine()}; {args.rounds} rounds; {time.perf_counter() - started:.0f} s in all")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


def _version(name: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(name)


if __name__ == "__main__":
    from absl import flags  # Grain's worker processes read absl flags: mark them parsed, as a main() would

    flags.FLAGS.mark_as_parsed()
    main()
