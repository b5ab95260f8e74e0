"""Benchmark: TorchLoader with async collation on and off, against a training step of fixed cost.

    python scripts/bench_torch.py                 # CPU here; on a CUDA machine add --device cuda

The loader packs the bundled sample into global batches of 64 x 2048 (tens of milliseconds of
planning, fetching and collating per batch on these cores). The "training step" is a fixed cost
that releases the GIL, as real steps do: ``--step sleep`` waits, ``--step matmul`` runs torch matmuls
(on the device). Serial, a step costs step + collate; with async collation it should cost
max(step, collate). On CUDA the async path also moves the host-to-device copy (pinned memory, side
stream) under the step. Start-up (seconds to the first batch) and the steady cost per step are
reported apart, with the load average beside them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import add_output_args, grouped_svg, load, machine, with_load, write_table  # noqa: E402

import portable_loader as pl  # noqa: E402
from portable_loader.adapters.torch import TorchLoader  # noqa: E402
from portable_loader.precache import sample_args  # noqa: E402


def make_step(kind: str, ms: float, device: torch.device):
    if kind == "sleep":
        return lambda: time.sleep(ms / 1000)
    a = torch.randn(512, 512, device=device)
    t = time.perf_counter()
    for _ in range(5):
        a @ a
    if device.type == "cuda":
        torch.cuda.synchronize()
    reps = max(1, int(ms / 1000 / ((time.perf_counter() - t) / 5)))

    def step():
        x = a
        for _ in range(reps):
            x = a @ a
        if device.type == "cuda":
            torch.cuda.synchronize()
        return x

    return step


def per_step(loader, device, async_collation, step, steps) -> tuple[float, float]:
    """(seconds to the first batch, steady seconds per step after 3 warm-up steps)."""
    t = time.perf_counter()
    with TorchLoader(loader, device=device, async_collation=async_collation) as tl:
        next(tl)
        first = time.perf_counter() - t
        step()
        for _ in range(2):  # warm-up: first window planned, thread started
            next(tl)
            step()
        t = time.perf_counter()
        for _ in range(steps):
            batch = next(tl)
            if device.type == "cuda":
                batch["input_ids"].sum().item()  # the step really uses the batch
            step()
        return first, (time.perf_counter() - t) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--step", choices=("sleep", "matmul"), default="sleep")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--cache-dir", default="portable_loader_cache")
    args = add_output_args(p, "torch").parse_args()
    device = torch.device(args.device)
    if args.step == "matmul" and device.type == "cpu":
        # A CPU step on all cores leaves none for collation to overlap with (on 2 cores, async then
        # loses ~10%); give the step one core, as a GPU step leaves the host's cores to the loader.
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    cache = pl.precache(**sample_args(), out=args.cache_dir)
    loader = pl.DataLoader(pl.open_cache(cache), global_batch_size=args.batch, seq_len=args.seq_len, seed=0,
                           packing=True, prefetch=0)
    first, collate = per_step(loader, device, False, lambda: None, args.steps)
    print(f"machine: {machine()}; device {device}; batches {args.batch}x{args.seq_len} packed; step = {args.step}")
    print(with_load(f"start-up: first batch after {first:.3f} s", load()))
    print(with_load(f"steady: collate alone (serial, no step): {collate * 1e3:.1f} ms per batch", load()) + "\n")
    print("| step cost | serial: first batch s, steady ms/step | async: first batch s, steady ms/step | "
          "ideal max(step, collate) | async vs serial | load average |")
    print("|---|---|---|---|---|---|")
    rows = []
    for ms in (0.5 * collate * 1e3, collate * 1e3, 2 * collate * 1e3):
        step = make_step(args.step, ms, device)
        t0 = time.perf_counter()
        for _ in range(5):
            step()
        step_ms = (time.perf_counter() - t0) / 5 * 1e3
        first_serial, serial = per_step(loader, device, False, step, args.steps)
        first_async, overlapped = per_step(loader, device, True, step, args.steps)
        serial, overlapped, ideal, now = serial * 1e3, overlapped * 1e3, max(step_ms, collate * 1e3), load()
        print(f"| {step_ms:.1f} ms | {first_serial:.3f}, {serial:.1f} | {first_async:.3f}, {overlapped:.1f} | {ideal:.1f} | "
              f"{serial / overlapped:.2f}x faster | {now:.1f} |", flush=True)
        rows.append([device.type, args.step, step_ms, collate * 1e3, first_serial, serial, first_async, overlapped, ideal,
                     serial / overlapped, now])
    write_table(args, ["device", "step_kind", "step_ms", "collate_ms", "serial_first_batch_s", "serial_ms_per_step",
                       "async_first_batch_s", "async_ms_per_step", "ideal_ms_per_step", "speedup", "load_average"], rows)
    grouped_svg(args, f"TorchLoader ms per step, {args.batch}x{args.seq_len} packed, step = {args.step} ({device.type})",
                [f"step {r[2]:.0f} ms" for r in rows],
                {"serial": [r[5] for r in rows], "async collation": [r[7] for r in rows], "ideal max(step, collate)": [r[8] for r in rows]},
                "ms per step (lower is better)")


if __name__ == "__main__":
    main()
