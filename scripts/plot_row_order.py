"""Documents per packed row, step by step, with rows in the packer's order (before) and in the keyed
order (now): writes docs/row_order.svg and prints the lag-1 autocorrelations and packing efficiencies.

Uses gsm8k with the phi-3-mini tokenizer when ../shared/data has them, else the bundled chat sample.

    .venv/bin/python scripts/plot_row_order.py [--out docs/row_order.svg]
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import numpy as np

import portable_loader as pl
from portable_loader.plan import Cursor, Planner
from portable_loader.precache import sample_args

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"


class CreationOrder(Planner):
    """The stream before: each window's rows in the order the packer created them."""

    def row_key(self, w):
        return None


def source(out: str):
    gsm8k, phi3 = DATA / "alpaca" / "gsm8k_train.jsonl", DATA / "tokenizers" / "phi-3-mini"
    if gsm8k.exists() and phi3.exists():
        path = pl.precache(str(gsm8k), tokenizer=str(phi3), format="alpaca", out=out,
                           fields={"instruction": "question", "output": "answer"})
        return pl.open_cache(path), "gsm8k, phi-3-mini tokens, seq_len 2048"
    return pl.open_cache(pl.precache(**sample_args(), out=out)), "bundled chat sample, seq_len 2048"


def docs_per_row(loader, planner_cls, steps):
    """Mean documents per row of each step, and the share of slots holding tokens."""
    p = loader.planner()
    planner = planner_cls(p.sampler, p.n, global_batch_size=p.batch, seq_len=p.seq_len, packing=True,
                          window=p.window, lengths=p._lengths, overlong=p.overlong)
    means, tokens, cur = [], 0, Cursor(0, 0, 0)
    for _ in range(steps):
        rows, cur = planner.step(cur)
        means.append(np.mean([len(r) for r in rows]))
        tokens += sum(e - s for row in rows for _, s, e in row)
    return np.array(means), tokens / (steps * p.batch * p.seq_len)


def lag1(x):
    x = x - x.mean()
    return float((x[:-1] * x[1:]).sum() / (x * x).sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "row_order.svg"))
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with tempfile.TemporaryDirectory() as tmp:
        src, label = source(tmp)
        fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        for ax, batch in zip(axes, (8, 64)):
            loader = pl.DataLoader(src, global_batch_size=batch, seq_len=2048, seed=0, packing=True)
            for name, cls, style in (("before: packer's order", CreationOrder, "-o"), ("now: keyed order", Planner, "-s")):
                means, eff = docs_per_row(loader, cls, args.steps)
                print(f"{batch:>3} rows/step  {name:<24} lag-1 autocorrelation {lag1(means):+.2f}  "
                      f"mean docs/row {means.mean():.2f}  packing efficiency {eff:.4f}")
                ax.plot(means, style, markersize=3, label=f"{name} (lag-1 {lag1(means):+.2f})")
            ax.set_ylabel("documents per row")
            ax.set_title(f"{batch} rows per step", fontsize=10)
            ax.legend(fontsize=8)
        axes[-1].set_xlabel("step")
        fig.suptitle(f"Packed rows, mean documents per row at each step ({label})", fontsize=10)
        fig.tight_layout()
        fig.savefig(args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
