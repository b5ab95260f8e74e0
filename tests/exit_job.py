"""A training script that ends without closing its loader, started by tests/test_exit.py.

    python tests/exit_job.py ADAPTER PREFETCH WORKERS HOW [DIST RANK WORLD PORT]

ADAPTER: ``loader`` (the bare DataLoader), ``torch`` (TorchLoader, async collation), ``torch-sync``
(TorchLoader without it) or ``jax`` (JaxLoader). HOW the script ends once it has taken 3 batches and
printed ``ready``: ``normal`` (falls off the end), ``exit3`` (``sys.exit(3)``), ``raise`` (an uncaught
exception) once the test writes a line to its stdin (it lists the workers meanwhile), ``loop``
(keeps training until a signal from the test ends it), or ``preempt`` (under jax.distributed: trains
until JAX's preemption service, told by a SIGTERM, reports the sync point, then returns). DIST: ``jax`` or
``torch`` for one rank of a 2-process job on 127.0.0.1; omitted for a single process.
"""

import os
import sys
import time

# setdefault: when a test imports this module, the suite's own device count (tests/conftest.py) stands.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import numpy as np  # noqa: E402


def source(n=64):
    rng = np.random.default_rng(0)
    return [{"input_ids": np.arange(int(rng.integers(1, 40)), dtype=np.int32) + 100 * r} for r in range(n)]


def main() -> None:
    adapter, prefetch, workers, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist, rank, world, port = (sys.argv[5], *map(int, sys.argv[6:9])) if len(sys.argv) > 5 else ("none", 0, 1, 0)
    if dist == "jax":
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=world, process_id=rank)
    elif dist == "torch":
        import torch.distributed

        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    import portable_loader as pl

    loader = pl.DataLoader(source(), global_batch_size=8, seq_len=32, packing=True, num_workers=workers,
                           prefetch=prefetch)
    if adapter == "loader":
        it = iter(loader.with_shard(rank, world))
    elif adapter.startswith("torch"):
        from portable_loader.adapters.torch import TorchLoader

        it = TorchLoader(loader, async_collation=adapter == "torch")
    else:
        from portable_loader.adapters.jax import JaxLoader

        it = JaxLoader(loader, prefetch=prefetch)
    for _ in range(3):
        next(it)
    print("ready", flush=True)
    if how not in ("loop", "preempt"):
        sys.stdin.readline()
    if how == "exit3":
        sys.exit(3)
    if how == "raise":
        raise RuntimeError("the training step failed")
    step = 3
    while how in ("loop", "preempt"):  # a training loop: the test's signal ends it
        next(it)
        time.sleep(0.01)
        step += 1
        if how == "preempt":
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                return  # where a real loop saves its checkpoint and leaves


if __name__ == "__main__":
    main()
