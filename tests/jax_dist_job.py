"""One process of a real multi-process JAX job on CPU, started by tests/test_jax.py.

    python tests/jax_dist_job.py CACHE OUT PROCESS NPROC PORT STEPS [save DIR | load DIR]

Each process has 4 virtual CPU devices; the global mesh spans all processes' devices. The process
loads STEPS global batches through a JaxLoader and writes every addressable shard (with its index) to
OUT/process{i}.npz; ``save DIR`` then saves the loader with an Orbax CheckpointManager at step STEPS,
``load DIR`` restores the latest checkpoint before loading.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402


def main() -> None:
    cache, out, pid, nproc, port, steps = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
    action, ckpt = (sys.argv[7], sys.argv[8]) if len(sys.argv) > 8 else (None, None)
    if nproc > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import portable_loader as pl
    from portable_loader.adapters.jax import JaxLoader, LoaderRestore, LoaderSave

    mesh = Mesh(np.array(jax.devices()).reshape(-1), ("data",))
    loader = pl.DataLoader(pl.open_cache(cache), global_batch_size=8, seq_len=64, seed=3, packing=True)
    jl = JaxLoader(loader, sharding=NamedSharding(mesh, P("data")))
    assert jl.loader.shard_count == nproc and jl.loader.shard_index == jax.process_index()
    mngr = ocp.CheckpointManager(ckpt) if ckpt else None
    if action == "load":
        mngr.restore(mngr.latest_step(), args=ocp.args.Composite(data=LoaderRestore(jl)))
    shards = {}
    for i in range(steps):
        batch = next(jl)
        for k, arr in batch.items():
            for j, s in enumerate(arr.addressable_shards):
                rows = s.index[0]
                shards[f"{k}_{i}_{j}"] = np.asarray(s.data)
                shards[f"{k}_{i}_{j}_rows"] = np.array([rows.start or 0, rows.stop or 8])
    if action == "save":
        mngr.save(steps, args=ocp.args.Composite(data=LoaderSave(jl)))
        mngr.wait_until_finished()
    jl.close()
    np.savez(os.path.join(out, f"process{jax.process_index()}.npz"), **shards)
    if nproc > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
