"""Per-source shares of a mixture, step by step, through two online re-weightings (``it.set_weights``):
writes docs/online_mix.svg and prints each source's share over each phase, counted from the tokens
of the batches themselves.

    .venv/bin/python scripts/plot_online_mix.py [--out docs/online_mix.svg] [--steps 300]
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

import portable_loader as pl

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAMES = ("web", "code", "math")
PHASES = ((0, {"web": 6, "code": 3, "math": 1}), (100, {"web": 2, "code": 2, "math": 6}), (200, {"code": 1}))


def run(steps: int) -> np.ndarray:
    """Records per source in each step (the record's first token names its source)."""
    sources = {n: [{"input_ids": np.full(5, 1000 * (s + 1) + r % 1000, dtype=np.int32)} for r in range(5000)]
               for s, n in enumerate(NAMES)}
    loader = pl.DataLoader(pl.mix(sources, PHASES[0][1]), global_batch_size=32, seq_len=8, seed=0)
    counts = np.zeros((steps, len(NAMES)), dtype=np.int64)
    changes = dict(PHASES[1:])
    with iter(loader) as it:
        for step in range(steps):
            if step in changes:
                it.set_weights(changes[step])
            first = next(it)["input_ids"][:, 0]
            counts[step] = np.bincount(first // 1000 - 1, minlength=len(NAMES))
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "online_mix.svg"))
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    counts = run(args.steps)
    bounds = [p[0] for p in PHASES] + [args.steps]
    for (start, weights), end in zip(PHASES, bounds[1:]):
        got = counts[start:end].sum(axis=0)
        total = sum(weights.values())
        print(f"steps {start}-{end - 1}: " + ", ".join(
            f"{n} {got[i] / got.sum():.3f} (weight {weights.get(n, 0) / total:.3f})" for i, n in enumerate(NAMES)))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = 10  # steps per point: a running share over the last 10 steps (320 records)
    kernel = np.ones(window)
    smooth = np.stack([np.convolve(counts[:, i], kernel, "valid") for i in range(len(NAMES))], axis=1)
    share = smooth / smooth.sum(axis=1, keepdims=True)
    x = np.arange(window - 1, args.steps)
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for i, n in enumerate(NAMES):
        ax.plot(x, share[:, i], label=n)
    for start, weights in PHASES[1:]:
        ax.axvline(start, color="grey", lw=0.8, ls="--")
        ax.text(start + 2, 0.95, "set_weights(" + ", ".join(f"{k}={v}" for k, v in weights.items()) + ")",
                fontsize=7, va="top")
    ax.set_xlabel("step (32 records a step)")
    ax.set_ylabel("share over the last 10 steps")
    ax.set_ylim(0, 1)
    ax.legend(loc="center left", fontsize=8)
    ax.set_title("pl.mix re-weighted while running: shares follow from the next batch")
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
