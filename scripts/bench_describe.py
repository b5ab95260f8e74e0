"""``DataLoader.describe(step)`` steps per second: which records (source, record, start, end) made a step.

    python scripts/bench_describe.py              # 4,000 steps per case, best of 5 rounds

A three-source mixture like scripts/bench_mix.py's (60,000 / 30,000 / 10,000 records of 64-3,000
tokens, weights 0.55 / 0.3 / 0.15, padded 8 x 2048), over in-memory sources whose lengths come from
an array (as a cache's do), so only describe's own work is timed. Cases: sequential steps, random
steps below 10^9 (each needs fresh keyed permutations: its block's and each source's epoch), random
steps within 1,000 of one step (a loss spike's neighbourhood: the permutations are kept), packed
sequential steps, and padded sequential steps through a filter (which reads each record it passes).
Rates are steps per CPU second of this process (describe is single-threaded; on a loaded machine
wall time varies twice as much). No peer can answer the question, so there is no peer column.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import add_output_args, bar_svg, load, machine, write_table  # noqa: E402

import portable_loader as pl  # noqa: E402

SIZES = {"web": 60_000, "code": 30_000, "math": 10_000}
WEIGHTS = {"web": 0.55, "code": 0.3, "math": 0.15}


class Lengths(pl.Dataset):
    """Records of the given lengths whose ``lengths`` answers from an array, as a cache does."""

    cheap_lengths = True

    def __init__(self, lengths: np.ndarray, name: str):
        self.l, self.name = lengths, name

    def __len__(self):
        return self.l.size

    def __getitems__(self, indices):
        return [{"input_ids": np.full(int(self.l[i]), i, np.int32)} for i in np.asarray(indices).tolist()]

    def lengths(self, indices):
        return self.l[np.asarray(indices, dtype=np.int64)]

    def _identity(self):
        return (self.name, self.l)


def rate(loader, steps: list[int], rounds: int) -> float:
    best = 0.0
    for _ in range(rounds):
        loader._describer = None  # every round starts cold, as a fresh loader would
        t = time.process_time()  # CPU time: the shared machine's load moves wall time by 2x
        for s in steps:
            loader.describe(s)
        best = max(best, len(steps) / (time.process_time() - t))
    return best


def main() -> None:
    p = add_output_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), "describe")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print(machine())
    rng = np.random.default_rng(0)
    sources = {n: Lengths(rng.integers(64, 3000, k), n) for n, k in SIZES.items()}
    mix = pl.mix(sources, WEIGHTS)
    kw = dict(global_batch_size=8, seq_len=2048, seed=0)
    padded, packed = pl.DataLoader(mix, **kw), pl.DataLoader(mix, packing=True, **kw)
    filtered = pl.DataLoader(mix.filter(lambda r: r["input_ids"].size % 4 != 0, name="bench"), **kw)
    n = args.steps
    spike = 10**8
    cases = [
        ("padded, sequential steps", padded, list(range(n))),
        ("padded, random steps below 10^9", padded, rng.integers(0, 10**9, n).tolist()),
        ("padded, random steps within 1,000 of one step", padded, (spike + rng.integers(-1000, 1000, n)).tolist()),
        ("packed, sequential steps", packed, list(range(n // 4))),
        ("padded through a filter, sequential steps", filtered, list(range(n // 4))),
    ]
    print("| case | steps per CPU second (each round from a cold describer) | load average |\n|---|---|---|")
    rows = []
    for label, loader, steps in cases:
        r = rate(loader, steps, args.rounds)
        rows.append([label, r, load()])
        print(f"| {label} | {r:,.0f} | {rows[-1][2]:.1f} |")
    write_table(args, ["case", "steps_per_s", "load_average"], rows)
    bar_svg(args, "DataLoader.describe", [r[0] for r in rows], [r[1] for r in rows], "steps/s")


if __name__ == "__main__":
    main()
