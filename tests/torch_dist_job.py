"""One rank of a real torch.distributed (gloo) job, started by tests/test_torch.py.

    python tests/torch_dist_job.py CACHE OUT RANK WORLD PORT STEPS [save DIR | load DIR]

Each rank loads STEPS batches through a TorchLoader whose shard comes from the process group, and
writes them to OUT/rank{RANK}.npz; ``save DIR`` then writes a DCP checkpoint of the loader, ``load DIR``
restores one before loading.
"""

import sys

import numpy as np
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import portable_loader as pl
from portable_loader.adapters.torch import TorchLoader


def main() -> None:
    cache, out, rank, world, port, steps = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
    action, ckpt = (sys.argv[7], sys.argv[8]) if len(sys.argv) > 8 else (None, None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        loader = pl.DataLoader(pl.open_cache(cache), global_batch_size=8, seq_len=64, seed=3, packing=True)
        tl = TorchLoader(loader)
        assert (tl.loader.shard_index, tl.loader.shard_count) == (rank, world)
        if action == "load":
            dcp.load({"data": tl}, checkpoint_id=ckpt)
        batches = [next(tl) for _ in range(steps)]
        if action == "save":
            dcp.save({"data": tl}, checkpoint_id=ckpt)
        tl.close()
        np.savez(f"{out}/rank{rank}.npz", **{f"{k}_{i}": b[k].numpy() for i, b in enumerate(batches) for k in b})
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
