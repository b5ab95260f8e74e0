"""One process of a MaxText-style checkpoint save, started by tests/test_exit.py.

    python tests/elastic_job.py HANDLER DIR STEPS PROCESS NPROC PORT

The process takes STEPS batches from a JaxLoader, then saves it with an Orbax CheckpointManager set
up as MaxText does (``item_names=("items", "iter")``, ``item_handlers={"iter": <handler>}``).
HANDLER: ``grain`` (``grain.checkpoint.CheckpointHandler``, what MaxText registers) or ``elastic``
(``portable_loader.adapters.jax.LoaderCheckpointHandler``).
"""

import os
import sys

# setdefault: when a test imports this module, the suite's own device count (tests/conftest.py) stands.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from exit_job import source  # noqa: E402


def manager(directory, handler):
    """A CheckpointManager built the way MaxText builds its own (model state under "items")."""
    import grain.checkpoint as gc
    import orbax.checkpoint as ocp

    from portable_loader.adapters.jax import LoaderCheckpointHandler, LoaderRestore, LoaderSave

    iter_handler, save, restore = {
        "grain": (gc.CheckpointHandler(), gc.CheckpointSave, gc.CheckpointRestore),
        "elastic": (LoaderCheckpointHandler(), LoaderSave, LoaderRestore),
    }[handler]
    mngr = ocp.CheckpointManager(directory, item_names=("items", "iter"),
                                 item_handlers={"items": ocp.PyTreeCheckpointHandler(), "iter": iter_handler})
    return mngr, save, restore


def main() -> None:
    handler, directory, steps, pid, nproc, port = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    import orbax.checkpoint as ocp

    import portable_loader as pl
    from portable_loader.adapters.jax import JaxLoader

    jl = JaxLoader(pl.DataLoader(source(), global_batch_size=8, seq_len=32, packing=True, seed=1))
    for _ in range(steps):
        next(jl)
    mngr, save, _ = manager(directory, handler)
    params = {"w": np.arange(4.0)}
    mngr.save(steps, args=ocp.args.Composite(items=ocp.args.PyTreeSave(params), iter=save(jl)))
    mngr.wait_until_finished()
    mngr.close()


if __name__ == "__main__":
    main()
