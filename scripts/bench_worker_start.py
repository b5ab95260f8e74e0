"""What the forkserver's preload saves each loader that starts workers (docs/workers.md, "Start-up"):
10 loaders of 2 workers over the bundled sample cache, each to its first batch, in a process whose
forkserver preloads the package (``PRELOAD``: what the loader and precache set up) against one whose
forkserver preloads nothing (as a pool that another library started first would leave it). Then
what precache's workers spend in a JAX process (forkserver): a 2-worker build of the bundled sample,
the tokenizer's class preloaded by the server precache starts against a server started before it
with the package only (its preload is then not precache's to set); each worker's CPU seconds, seen
by polling the process tree. Each case runs in a fresh process (a process has one forkserver), in
interleaved rounds; medians and their ratio.

    .venv/bin/python scripts/bench_worker_start.py [--rounds 3]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ONE = """
import multiprocessing, multiprocessing.forkserver, os, sys, time
if sys.argv[1] == "bare":
    multiprocessing.set_forkserver_preload([])
    multiprocessing.forkserver.ensure_running()
os.environ["PORTABLE_LOADER_START_METHOD"] = "forkserver"
import portable_loader as pl
src = pl.open_cache(sys.argv[2])
t = time.perf_counter()
for _ in range(10):
    with iter(pl.DataLoader(src, global_batch_size=8, seq_len=256, num_workers=2, prefetch=2)) as it:
        next(it)
print(time.perf_counter() - t)
"""


PRECACHE = """
import json, multiprocessing, multiprocessing.forkserver, os, sys, threading, time
import jax.numpy as jnp, psutil
import portable_loader as pl
from portable_loader.engine.workers import PRELOAD
from portable_loader.precache import sample_args
jnp.arange(4.0).sum()                        # JAX's threads run: precache's workers start by forkserver
if sys.argv[1] == "bare":
    multiprocessing.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()
seen, done = {}, threading.Event()
def watch():
    while not done.is_set():
        for p in psutil.Process().children(recursive=True):
            try:
                if p.ppid() != os.getpid():  # the server's children: the workers
                    t = p.cpu_times()
                    seen[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        time.sleep(0.02)
threading.Thread(target=watch, daemon=True).start()
pl.precache(**sample_args(), out=sys.argv[2], num_workers=2, rows_per_task=500, force=True)
done.set()
print(json.dumps(list(seen.values())))
"""


def precache_workers(rounds: int, work: str) -> None:
    """Precache's worker CPU in a JAX process, the tokenizer's class preloaded or not."""
    from benchlib import load, with_load

    cpu = {"preloaded": [], "bare": []}
    for _ in range(rounds):
        for case in cpu:
            out = subprocess.run([sys.executable, "-c", PRECACHE, case, os.path.join(work, case)], capture_output=True,
                                 text=True, check=True)
            cpu[case] += json.loads(out.stdout.splitlines()[-1])
    at = load()
    med = {case: statistics.median(v) for case, v in cpu.items()}
    for case, v in cpu.items():
        print(f"precache in a JAX process, {case}: {med[case]:.2f} s of CPU a worker (median of {len(v)})")
    print(with_load(f"bare - preloaded: {med['bare'] - med['preloaded']:.2f} s of CPU a worker", at))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchlib import load, machine, with_load

    import portable_loader as pl
    from portable_loader.precache import sample_args

    print(machine())
    with tempfile.TemporaryDirectory() as work:
        cache = pl.precache(**sample_args(), out=work)
        seconds = {"preloaded": [], "bare": []}
        for _ in range(args.rounds):
            for case in seconds:
                out = subprocess.run([sys.executable, "-c", ONE, case, cache], capture_output=True, text=True, check=True)
                seconds[case].append(float(out.stdout.split()[-1]))
        at = load()
    med = {case: statistics.median(v) for case, v in seconds.items()}
    for case, v in seconds.items():
        print(f"{case}: 10 loaders of 2 workers to their first batch in {med[case]:.2f} s (median of {len(v)})")
    print(with_load(f"bare / preloaded: {med['bare'] / med['preloaded']:.1f}x", at))
    with tempfile.TemporaryDirectory() as work:
        precache_workers(args.rounds, work)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s in all)")
