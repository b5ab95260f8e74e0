"""Benchmark: JaxLoader with and without device prefetch, against a training step of fixed cost.

    python scripts/bench_jax.py                 # CPU devices here; the same on TPU/GPU

Packed global batches of 64 x 2048 from the bundled sample go into global jax.Arrays sharded over
all devices. The "step" is a fixed cost: ``--step sleep`` (stands for an accelerator step, which
leaves the host free) or ``--step matmul`` (a jitted matmul loop, blocked on). Without prefetch a
step costs load + step; with ``prefetch=2`` it should cost max(load, step). Start-up (seconds to the
first batch) and the steady cost per step are reported apart, with the load average beside them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import add_output_args, grouped_svg, load as load_average, machine, with_load, write_table  # noqa: E402

import portable_loader as pl  # noqa: E402
from portable_loader.adapters.jax import JaxLoader  # noqa: E402
from portable_loader.precache import sample_args  # noqa: E402


def make_step(kind: str, ms: float):
    if kind == "sleep":
        return lambda batch: time.sleep(ms / 1000)
    a = jnp.ones((256, 256))

    @jax.jit
    def mm(x, n):
        return jax.lax.fori_loop(0, n, lambda i, y: jnp.tanh(y @ x), x)

    mm(a, 10).block_until_ready()  # compile (the trip count is traced, not baked in)
    t = time.perf_counter()
    mm(a, 10).block_until_ready()
    reps = max(1, int(10 * ms / 1000 / (time.perf_counter() - t)))
    return lambda batch: mm(a, reps).block_until_ready()


def per_step(loader, prefetch: int, step, steps: int) -> tuple[float, float]:
    """(seconds to the first batch, steady seconds per step after 3 warm-up steps)."""
    t = time.perf_counter()
    with JaxLoader(loader, prefetch=prefetch) as jl:
        next(jl)["input_ids"].block_until_ready()
        first = time.perf_counter() - t
        for _ in range(2):
            step(next(jl))
        t = time.perf_counter()
        for _ in range(steps):
            batch = next(jl)
            batch["input_ids"].block_until_ready()
            step(batch)
        return first, (time.perf_counter() - t) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step", choices=("sleep", "matmul"), default="sleep")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--cache-dir", default="portable_loader_cache")
    args = add_output_args(p, "jax").parse_args()
    cache = pl.precache(**sample_args(), out=args.cache_dir)
    loader = pl.DataLoader(pl.open_cache(cache), global_batch_size=args.batch, seq_len=args.seq_len, seed=0,
                           packing=True, prefetch=0)
    first, load = per_step(loader, 0, lambda b: None, args.steps)
    print(f"machine: {machine()}; {len(jax.devices())} {jax.devices()[0].platform} devices; batches "
          f"{args.batch}x{args.seq_len} packed; step = {args.step}")
    print(with_load(f"start-up: first batch after {first:.3f} s", load_average()))
    print(with_load(f"steady: load into device arrays alone: {load * 1e3:.1f} ms per batch ({1 / load:,.0f} batches/s)",
                    load_average()) + "\n")
    print("| step cost | no prefetch: first batch s, steady ms/step | prefetch=2: first batch s, steady ms/step | "
          "ideal max(step, load) | prefetch vs none | load average |")
    print("|---|---|---|---|---|---|")
    rows = []
    for ms in (0.5 * load * 1e3, load * 1e3, 2 * load * 1e3):
        step = make_step(args.step, ms)
        t = time.perf_counter()
        for _ in range(5):
            step(None)
        step_ms = (time.perf_counter() - t) / 5 * 1e3
        first_none, none = per_step(loader, 0, step, args.steps)
        first_ahead, ahead = per_step(loader, 2, step, args.steps)
        none, ahead, now = none * 1e3, ahead * 1e3, load_average()
        print(f"| {step_ms:.1f} ms | {first_none:.3f}, {none:.1f} | {first_ahead:.3f}, {ahead:.1f} | "
              f"{max(step_ms, load * 1e3):.1f} | {none / ahead:.2f}x | {now:.1f} |", flush=True)
        rows.append([jax.devices()[0].platform, args.step, step_ms, load * 1e3, first_none, none, first_ahead, ahead,
                     max(step_ms, load * 1e3), none / ahead, now])
    write_table(args, ["platform", "step_kind", "step_ms", "load_ms", "no_prefetch_first_batch_s", "no_prefetch_ms_per_step",
                       "prefetch2_first_batch_s", "prefetch2_ms_per_step", "ideal_ms_per_step", "speedup", "load_average"],
                rows)
    grouped_svg(args, f"JaxLoader ms per step, {args.batch}x{args.seq_len} packed, step = {args.step}",
                [f"step {r[2]:.0f} ms" for r in rows],
                {"no prefetch": [r[5] for r in rows], "prefetch=2": [r[7] for r in rows], "ideal max(step, load)": [r[8] for r in rows]},
                "ms per step (lower is better)")


if __name__ == "__main__":
    main()
