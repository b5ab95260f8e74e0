"""Exit stress: a JAX job that ends with and without ``close()``, run many times; every run must exit 0
with nothing on stderr.

    python scripts/exit_stress.py                       # 30 runs of each case: 1 and 2 processes, close or not
    python scripts/exit_stress.py --runs 5 --cases 2:open

Each job (one process, or two under ``jax.distributed`` on 127.0.0.1, with 2 CPU devices each) builds
``JaxLoader(DataLoader(..., prefetch=2), sharding=..., prefetch=2)`` inside a function, takes 3 batches
and returns: the loader is dropped while its background thread may be building the next batch in
JAX's native code. A thread still there when the interpreter finalizes is unwound by the C++ runtime
and the process aborts (``terminate called ... FATAL: exception not rethrown``, exit -6).
Prints each case's count of clean runs; exits 1 unless every run was clean.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

CASES = ("1:open", "1:close", "2:open", "2:close")


def job(rank: int, world: int, port: int, close: bool) -> None:
    """One process of the job."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax

    if world > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=world, process_id=rank)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import portable_loader as pl
    from portable_loader.adapters.jax import JaxLoader

    rng = np.random.default_rng(0)
    records = [{"input_ids": np.arange(int(rng.integers(1, 40)), dtype=np.int32) + 100 * r} for r in range(256)]
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
    loader = JaxLoader(pl.DataLoader(records, global_batch_size=8, seq_len=32, packing=True, prefetch=2),
                       sharding=sharding, prefetch=2)
    for _ in range(3):
        time.sleep(0.01)  # a training step: the next next() wakes the background thread to build ahead
        batch = next(loader)
    print(int(np.asarray(batch["input_ids"].addressable_shards[0].data).sum()), flush=True)  # its results
    if close:
        loader.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(world: int, close: bool, timeout: float) -> tuple[bool, str]:
    """One job; (clean, what went wrong)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, __file__, "--job", str(r), str(world), str(port), str(int(close))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    problems = []
    for r, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            problems.append(f"rank {r}: no exit within {timeout:.0f} s")
        if p.returncode != 0 or err:
            problems.append(f"rank {r}: exit {p.returncode}: {err.strip()[-300:]}")
    return not problems, "; ".join(problems)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=30, help="runs of each case")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES),
                   help="PROCESSES:open (no close()) or PROCESSES:close")
    p.add_argument("--timeout", type=float, default=120, help="seconds a job may take")
    args = p.parse_args(argv)
    failed = 0
    for case in args.cases:
        world, how = case.split(":")
        clean, t0 = 0, time.perf_counter()
        for i in range(args.runs):
            ok, why = run_once(int(world), how == "close", args.timeout)
            clean += ok
            if not ok:
                print(f"  {case} run {i + 1}: {why}", flush=True)
        failed += args.runs - clean
        print(f"{case}: {clean}/{args.runs} clean  ({time.perf_counter() - t0:.0f} s, "
              f"load average {os.getloadavg()[0]:.1f})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--job"]:
        rank, world, port, close = map(int, sys.argv[2:6])
        job(rank, world, port, bool(close))
    else:
        sys.exit(main())
