"""Benchmark: TorchLoader's async CUDA path (pinned host memory, a side stream, copies under the step).

    python scripts/bench_cuda.py                    # on a machine with a CUDA GPU
    python scripts/bench_cuda.py --step matmul --steps 100
    # writes docs/bench/cuda.csv and cuda.svg (--csv/--svg), as every scripts/bench_*.py

Without a CUDA GPU (or torch) it prints one line saying so and exits 0, writing nothing.

Measured in one run, on one GPU:

1. Host-to-device bandwidth, GB/s: torch's peak (a pinned buffer of ``--peak-mib``, copied with
   ``non_blocking=True``, timed with CUDA events), the same for a pageable buffer and for one pinned
   buffer of a batch's size; and ours: what TorchLoader's collator does with a collated batch
   (``_ToCuda``: each field copied ``non_blocking`` on a side stream straight from the loader's block,
   registered once as page-locked memory), wall clock from
   the numpy batch to the copies done, over batches collated beforehand.
2. A copy under a step, no loader: a pinned copy of ``--overlap-mib`` on a side stream while the
   default stream runs a simulated step of about the copy's duration (``torch.cuda._sleep`` spins the
   SMs and leaves the copy engine free; ``--step matmul`` runs matmuls), one after the other and
   together: overlapped should cost max(copy, step), serial copy + step.
3. Training steps: TorchLoader with ``async_collation`` off (serial: plan, collate, pin, copy, then
   the step) and on (the next batch is collated, pinned and copied on the side stream during the
   step), under a step of 0.5x, 1x and 2x the serial cost of a batch; ms per step against the ideal
   max(step, batch). Each step reads the batch and ends in a synchronization (as a logged loss does).

The loader packs the bundled sample (``--batch`` x ``--seq-len``, all five fields) with ``prefetch=0``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import add_output_args, grouped_svg, machine, write_table  # noqa: E402

try:
    import torch
except ImportError:  # said in one line, as for a machine without a GPU
    torch = None

MIB = 1 << 20


def args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="a CUDA device (default: cuda, the current one)")
    p.add_argument("--step", choices=("sleep", "matmul"), default="sleep",
                   help="the simulated training step: torch.cuda._sleep (default) or a matmul loop")
    p.add_argument("--steps", type=int, default=60, help="training steps timed per contender")
    p.add_argument("--batch", type=int, default=64, help="global batch size (rows)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--reps", type=int, default=20, help="repetitions of each copy measurement")
    p.add_argument("--peak-mib", type=int, default=256, help="buffer size for torch's peak bandwidth")
    p.add_argument("--overlap-mib", type=int, default=64, help="copy size for the copy-under-a-step test")
    p.add_argument("--cache-dir", default="portable_loader_cache", help="where the bundled sample is cached")
    return add_output_args(p, "cuda")


def no_gpu() -> str | None:
    """Why there is nothing to measure here (no torch, no CUDA GPU), or None."""
    if torch is None:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA GPU here (torch {torch.__version__}: torch.cuda.is_available() is False)"
    return None


class Step:
    """A simulated training step of about ``ms`` on the current stream: ``torch.cuda._sleep`` (spins
    the SMs, leaves the copy engine free) or a loop of 2048 x 2048 matmuls (none for ``ms=0``);
    ``self.ms`` is what it measured. Called with a batch, it reads the batch first (so that it waits
    for its copy) and ends in a synchronization (as a logged loss does)."""

    def __init__(self, kind: str, ms: float, device):
        self.kind, self.device = kind, device
        if kind == "sleep":
            self.cycles = int(ms * sleep_cycles_per_ms(device)) if ms > 0 else 0
        else:
            self.a = torch.randn(2048, 2048, device=device)
            self.reps = round(ms / gpu_ms(lambda: self.a @ self.a, device)) if ms > 0 else 0
        self.ms = gpu_ms(self.issue, device)

    def issue(self) -> None:
        if self.kind == "sleep":
            if self.cycles:
                torch.cuda._sleep(self.cycles)
        else:
            for _ in range(self.reps):
                self.a @ self.a

    def __call__(self, batch) -> None:
        batch["input_ids"].sum()
        self.issue()
        torch.cuda.synchronize(self.device)


def gpu_ms(issue, device, reps: int = 5) -> float:
    """Median time of ``issue()``'s work on the current stream, by CUDA events (after a warm-up)."""
    issue()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        issue()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sleep_cycles_per_ms(device) -> float:
    cycles = 10_000_000
    return cycles / gpu_ms(lambda: torch.cuda._sleep(cycles), device)


def copy_gbps(nbytes: int, pinned: bool, reps: int, device) -> float:
    """torch's host-to-device bandwidth for one buffer of ``nbytes``, by CUDA events."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ms = gpu_ms(lambda: [dev.copy_(host, non_blocking=True) for _ in range(reps)], device)
    return reps * nbytes / (ms / 1e3) / 1e9


def ours_gbps(batches: list, device, stream) -> tuple[float, float]:
    """(GB/s, ms per batch) of TorchLoader's conversion of collated ``batches`` on ``stream``: each
    field copied ``non_blocking`` from its block of the loader, registered as page-locked memory;
    wall clock from the first numpy batch to the last copy done."""
    from portable_loader.adapters.torch import _ToCuda

    to_cuda = _ToCuda(device, hf_labels=False)

    def convert():
        with torch.cuda.stream(stream):
            for b in batches:
                to_cuda(b)
        stream.synchronize()

    convert()  # warm-up: each block registered once (the loader reuses its blocks), the device's memory
    t = time.perf_counter()
    convert()
    seconds = time.perf_counter() - t
    nbytes = sum(v.nbytes for b in batches for v in b.values())
    return nbytes / seconds / 1e9, seconds / len(batches) * 1e3


def copy_under_step(nbytes: int, step: "Step", reps: int, device) -> tuple[float, float, float]:
    """(copy alone, serial, overlapped) ms per repetition: a pinned copy of ``nbytes`` after the step
    on one stream, or on a side stream beside it."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device=device)
    main = torch.cuda.current_stream(device)

    def run(with_step: bool, on_side: bool) -> float:
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(reps):
            if with_step:
                step.issue()
            with torch.cuda.stream(side if on_side else main):
                dev.copy_(host, non_blocking=True)
            main.wait_stream(side)  # the next repetition's step waits for this copy
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t) / reps * 1e3

    run(True, True)  # warm-up
    return run(False, False), run(True, False), run(True, True)


def per_step(loader, device, async_collation: bool, step, steps: int) -> float:
    """ms per training step through TorchLoader (a few warm-up steps first)."""
    from portable_loader.adapters.torch import TorchLoader

    with TorchLoader(loader, device=device, async_collation=async_collation) as tl:
        for _ in range(3):
            step(next(tl))
        t = time.perf_counter()
        for _ in range(steps):
            step(next(tl))
        return (time.perf_counter() - t) / steps * 1e3


def main() -> None:
    args = args_parser().parse_args()
    why = no_gpu()
    if why is not None:
        print(f"bench_cuda: {why}; nothing measured, nothing written (run it on a machine with a CUDA GPU)")
        return
    import portable_loader as pl
    from portable_loader.precache import sample_args

    device = torch.device(args.device)
    if device.index is None:  # set_device and friends want the index
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    print(f"machine: {machine()}; GPU {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}; batches {args.batch}x{args.seq_len} packed; step = {args.step}")
    loader = pl.DataLoader(pl.open_cache(pl.precache(**sample_args(), out=args.cache_dir)), global_batch_size=args.batch,
                           seq_len=args.seq_len, seed=0, packing=True, prefetch=0)
    with iter(loader) as it:
        batches = [next(it) for _ in range(args.reps)]
    batch_bytes = sum(v.nbytes for v in batches[0].values())
    rows = []

    peak = copy_gbps(args.peak_mib * MIB, True, args.reps, device)
    bandwidth = [
        (f"torch, pinned, {args.peak_mib} MiB buffer (peak)", peak),
        (f"torch, pageable, {args.peak_mib} MiB buffer", copy_gbps(args.peak_mib * MIB, False, args.reps, device)),
        (f"torch, pinned, one buffer of a batch's {batch_bytes / MIB:.2f} MiB", copy_gbps(batch_bytes, True, args.reps, device)),
    ]
    ours, ours_ms = ours_gbps(batches, device, torch.cuda.Stream(device=device))
    bandwidth.append((f"ours: TorchLoader's conversion of a batch ({len(batches[0])} fields copied from their "
                      "registered block on a side stream), wall clock", ours))
    print("\n| host-to-device copy | GB/s | of torch's pinned peak |\n|---|---|---|")
    for what, gbps in bandwidth:
        print(f"| {what} | {gbps:.1f} | {gbps / peak:.0%} |")
        rows.append(["bandwidth", what, gbps, "GB/s"])
    print(f"(ours: {ours_ms:.3f} ms per batch)")

    nbytes = args.overlap_mib * MIB
    step = Step(args.step, nbytes / (copy_gbps(nbytes, True, args.reps, device) * 1e9) * 1e3, device)  # as long as the copy
    alone, serial, overlapped = copy_under_step(nbytes, step, args.reps, device)
    print(f"\ncopy of {args.overlap_mib} MiB under a step, no loader: copy {alone:.2f} ms, step {step.ms:.2f} ms; "
          f"serial {serial:.2f} ms, overlapped {overlapped:.2f} ms (ideal {max(alone, step.ms):.2f}): "
          f"{serial / overlapped:.2f}x")
    groups = [f"{args.overlap_mib} MiB copy + {step.ms:.1f} ms step, no loader"]
    series = {"serial": [serial], "overlapped (async)": [overlapped], "ideal: max(step, copy or batch)": [max(alone, step.ms)]}
    rows += [["copy under a step", "copy alone", alone, "ms"], ["copy under a step", "step alone", step.ms, "ms"],
             ["copy under a step", "serial", serial, "ms"], ["copy under a step", "overlapped", overlapped, "ms"]]

    batch_ms = per_step(loader, device, False, Step(args.step, 0, device), args.steps)
    print(f"\nserial cost of a batch (plan, collate, pin, copy; no step): {batch_ms:.2f} ms\n")
    print("| step | serial ms/step | async ms/step | ideal max(step, batch) | async vs serial |\n|---|---|---|---|---|")
    for factor in (0.5, 1.0, 2.0):
        step = Step(args.step, factor * batch_ms, device)
        s = per_step(loader, device, False, step, args.steps)
        a = per_step(loader, device, True, step, args.steps)
        ideal = max(step.ms, batch_ms)
        print(f"| {step.ms:.2f} ms | {s:.2f} | {a:.2f} | {ideal:.2f} | {s / a:.2f}x |", flush=True)
        groups.append(f"TorchLoader, step {step.ms:.1f} ms")
        for name, v in zip(series, (s, a, ideal)):
            series[name].append(v)
        rows += [[f"TorchLoader, step {step.ms:.2f} ms", name, v, "ms/step"]
                 for name, v in (("serial", s), ("async", a), ("ideal", ideal))]
    write_table(args, ["part", "what", "value", "unit"], rows)
    grouped_svg(args, f"TorchLoader's CUDA path: ms per step, {args.batch}x{args.seq_len} packed, "
                f"step = {args.step} ({torch.cuda.get_device_name(device)})", groups, series, "ms (lower is better)")


if __name__ == "__main__":
    main()
