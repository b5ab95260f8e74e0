"""Benchmark: what a shuffled index costs in ``MapDataset.shuffle`` and ``IndexSampler``, ours against Grain.

    python scripts/bench_grain_shuffle.py                  # N = 1e3, 1e5, 1e9
    python scripts/bench_grain_shuffle.py --sizes 2000 --repeat 5

Three ways to read a shuffled ``range(N)`` (both libraries: ``MapDataset.range(N).shuffle(seed=0)``,
over 3 epochs, so per-epoch keys are part of the cost):

- ``getitem``: ``ds[i]`` one index at a time, random indices (a ``random access`` reader);
- ``iterate``: ``ds.to_iter_dataset()`` read from a random start (each library's default
  ``ReadOptions`` except Grain's prefetch threads, off here: the shuffle's cost, not the threads');
- ``sampler``: ``IndexSampler(N, shuffle=True, seed=0)[i].record_key``, one position at a time
  (ours also reads positions in bulk, ``record_keys``: the ``sampler_bulk`` line, which
  ``DataLoader`` uses).

Figures are microseconds per element (the best of ``--repeat`` runs); the ``sampler_bulk`` line's
Grain figure is its one-at-a-time ``sampler`` (Grain has no bulk lookup). The script takes whichever
``portable_loader`` is on ``PYTHONPATH``, so running it on an older checkout measures that release.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import add_output_args, best_of, grouped_svg, load, machine, write_table  # noqa: E402


def measure(lib, name: str, n: int, count: int, repeat: int) -> dict[str, float]:
    """Microseconds per element of each access pattern, for one library."""
    import grain

    rng = np.random.default_rng(0)
    idx = rng.integers(0, 3 * n, count).tolist()
    ds = lib.MapDataset.range(n).shuffle(seed=0).repeat(3)
    opts = grain.ReadOptions(num_threads=0) if name == "grain" else None
    start = int(rng.integers(0, 2 * n))

    def iterate():
        it = iter(ds[start:].to_iter_dataset(opts) if opts else ds[start:].to_iter_dataset())
        for _ in itertools.islice(it, count):
            pass

    sampler = lib.samplers.IndexSampler(n, shuffle=True, seed=0)
    out = {"getitem": best_of(lambda: [ds[i] for i in idx], repeat),
           "iterate": best_of(iterate, repeat),
           "sampler": best_of(lambda: [sampler[i].record_key for i in idx], repeat)}
    if hasattr(sampler, "record_keys"):
        pos = np.sort(np.array(idx))
        out["sampler_bulk"] = best_of(lambda: sampler.record_keys(pos), repeat)
    return {k: v / count * 1e6 for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 100_000, 10**9])
    ap.add_argument("--count", type=int, default=2000, help="elements read per measurement")
    ap.add_argument("--repeat", type=int, default=3)
    add_output_args(ap, "grain_shuffle")
    args = ap.parse_args()
    import grain

    from portable_loader import grain as ours

    print(f"machine: {machine()}", flush=True)
    rows = []
    for n in args.sizes:
        # Grain's cycle walk costs 2**16 / N ciphers per index below 2**14 records: fewer elements there.
        count = min(args.count, max(50, n // 4))
        got = {name: measure(lib, name, n, count, args.repeat) for name, lib in (("ours", ours), ("grain", grain))}
        for what in got["ours"]:
            g = got["grain"].get(what, got["grain"]["sampler"])
            rows.append([n, what, f"{got['ours'][what]:.2f}", f"{g:.2f}", f"{g / got['ours'][what]:.1f}", f"{load():.1f}"])
            print(" | ".join(map(str, rows[-1])), flush=True)
    write_table(args, ["N", "access", "ours us/element", "Grain us/element", "Grain / ours", "load average"], rows)
    grouped_svg(args, "a shuffled index: microseconds per element (lower is better)",
                [f"N={r[0]:,}\n{r[1]}" for r in rows],
                {"ours": [float(r[2]) for r in rows], "Grain 0.2.18": [float(r[3]) for r in rows]},
                "us per element", log=True)


if __name__ == "__main__":
    main()
