"""Benchmark: LCGSampler lookups against Grain's index_shuffle and numpy.random.permutation.

Run:  python scripts/bench_sampler.py            (N = 1e6, 1e8, 1e9)
      python scripts/bench_sampler.py --sizes 1000000 --markdown

Grain is timed the way Grain calls it (one Python call per index, 4 rounds, as in
``grain.MapDataset.shuffle``). ``numpy.random.permutation`` materializes the whole order, so it is
timed only where it fits (``--perm-max``); its cost is the build, its memory 8 bytes per record.
Peak memory is measured with tracemalloc around the lookup itself (numpy reports its buffers there).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import add_output_args, best_of, grouped_svg, load, machine, write_table  # noqa: E402

from portable_loader import LCGSampler  # noqa: E402


def peak_bytes(fn) -> int:
    tracemalloc.start()
    tracemalloc.reset_peak()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def bench_ours(n: int, batch: int, repeat: int) -> tuple[float, int]:
    sampler = LCGSampler(n, seed=1)
    positions = np.random.default_rng(0).integers(0, n, size=batch, dtype=np.int64)
    sampler.record_indices(positions[:10])  # build the epoch's constants outside the timing
    seconds = best_of(lambda: sampler.record_indices(positions), repeat)
    # Memory beyond the input and output arrays (2 x 8 bytes x batch) is what would grow with N.
    peak = peak_bytes(lambda: sampler.record_indices(positions)) - 8 * batch
    return batch / seconds, peak


def bench_grain(n: int, calls: int) -> float:
    from grain._src.python.experimental.index_shuffle.python import index_shuffle_module

    shuffle = index_shuffle_module.index_shuffle
    positions = np.random.default_rng(0).integers(0, n, size=calls).tolist()
    max_index = n - 1

    def run():
        for p in positions:
            shuffle(p, max_index=max_index, seed=1, rounds=4)

    return calls / best_of(run, 2)


def bench_permutation(n: int) -> tuple[float, int]:
    rng = np.random.default_rng(1)
    t = time.perf_counter()
    perm = rng.permutation(n)
    build = time.perf_counter() - t
    return build, perm.nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10**6, 10**8, 10**9])
    parser.add_argument("--batch", type=int, default=1 << 20, help="positions per vectorized call")
    parser.add_argument("--grain-calls", type=int, default=200_000)
    parser.add_argument("--perm-max", type=int, default=10**8, help="largest N for numpy.permutation")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--markdown", action="store_true", help="print a README table")
    args = add_output_args(parser, "sampler").parse_args()

    print(f"machine: {machine()}")
    rows = []
    for n in args.sizes:
        ours, ours_mem = bench_ours(n, args.batch, args.repeat)
        grain = bench_grain(n, args.grain_calls)
        perm = bench_permutation(n) if n <= args.perm_max else None
        now = load()
        rows.append((n, ours, ours_mem, grain, perm, now))
        perm_txt = f"build {perm[0]:.2f} s, {perm[1] / 2**20:.0f} MiB" if perm else "skipped (too big)"
        print(
            f"N={n:>13,}  LCGSampler {ours / 1e6:8.1f} M lookups/s (extra peak {ours_mem / 2**20:.1f} MiB)"
            f"  grain index_shuffle {grain / 1e6:6.3f} M/s  ratio {ours / grain:6.0f}x"
            f"  numpy.permutation {perm_txt}  (load {now:.1f})",
            flush=True,
        )
    write_table(args, ["n", "lcg_lookups_per_s", "lcg_extra_peak_bytes", "grain_index_shuffle_lookups_per_s", "ratio",
                       "numpy_permutation_build_s", "numpy_permutation_bytes", "load_average"],
                [[n, ours, ours_mem, grain, ours / grain, perm[0] if perm else "", perm[1] if perm else "", now]
                 for n, ours, ours_mem, grain, perm, now in rows])
    grouped_svg(args, "Shuffled-index lookups per second", [f"N = {n:.0e}" for n, *_ in rows],
                {"LCGSampler (vectorized)": [r[1] for r in rows], "Grain index_shuffle (per call)": [r[3] for r in rows]},
                "lookups/s (log scale)", log=True)
    if args.markdown:
        print()
        print("| N | LCGSampler lookups/s | extra memory | Grain index_shuffle lookups/s | ratio | numpy.permutation |")
        print("|---|---|---|---|---|---|")
        for n, ours, ours_mem, grain, perm, _ in rows:
            perm_txt = f"{perm[0]:.2f} s build, {perm[1] / 2**20:,.0f} MiB" if perm else f"skipped ({8 * n / 2**30:.1f} GiB)"
            print(
                f"| {n:.0e} | {ours / 1e6:.1f} M | {ours_mem / 2**20:.1f} MiB | {grain / 1e6:.2f} M "
                f"| **{ours / grain:.0f}x** | {perm_txt} |"
            )


if __name__ == "__main__":
    main()
