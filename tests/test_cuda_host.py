"""TorchLoader's CUDA copies read the loader's blocks directly (registered page-locked memory).

What needs no GPU is tested here too: every batch the loader hands out, with workers or without,
lies in a block that can be registered; the CUDA tests skip cleanly where there is no GPU.
"""

import gc

import numpy as np
import pytest
import torch

import portable_loader as pl
from portable_loader.adapters.cuda_host import block_of
from portable_loader.precache import sample_args

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return pl.open_cache(pl.precache(**sample_args(), out=str(tmp_path_factory.mktemp("cuda") / "cache")))


@pytest.mark.slow
@pytest.mark.parametrize("workers, prefetch, rows", [(0, 0, 64), (0, 2, 64), (2, 2, 64), (2, 2, 8)])
def test_every_field_of_a_batch_lies_in_a_block_of_the_loader(cache, workers, prefetch, rows):
    # Without workers, batches under 1 MiB come from the heap (a block is a mapping of its own): 8 x 2048 here.
    loader = pl.DataLoader(cache, global_batch_size=rows, seq_len=2048, packing=True, num_workers=workers,
                           prefetch=prefetch)
    with iter(loader) as it:
        for _ in range(5):
            batch = next(it)
            blocks = {id(block_of(v)) for v in batch.values()}
            assert None not in [block_of(v) for v in batch.values()]
            assert len(blocks) == 1  # one registration covers the batch
            assert all(v.flags.c_contiguous for v in batch.values())
    with iter(pl.DataLoader(cache, global_batch_size=8, seq_len=2048, packing=True, prefetch=prefetch)) as it:
        assert all(block_of(v) is None for v in next(it).values())  # 229 KB: the heap's
    assert block_of(np.zeros(4)) is None and block_of(np.zeros(4)[1:]) is None


@CUDA
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("async_collation", [False, True])
def test_cuda_batches_equal_the_numpy_loaders_and_come_from_registered_blocks(cache, workers, async_collation):
    from portable_loader.adapters.torch import TorchLoader

    opts = dict(global_batch_size=8, seq_len=128, packing=True, seed=5)
    with iter(pl.DataLoader(cache, **opts)) as it:
        want = [{k: v.copy() for k, v in next(it).items()} for _ in range(30)]
    tl = TorchLoader(pl.DataLoader(cache, **opts, num_workers=workers), device="cuda", async_collation=async_collation)
    with tl:
        got = [next(tl) for _ in range(30)]  # every GPU batch held while later ones are copied
        torch.cuda.synchronize()
        registered = tl._convert.blocks._registered
        assert registered and all(registered.values())  # no block fell back to a pinned copy
    for w, g in zip(want, got):
        assert w.keys() == g.keys()
        for k in w:
            assert g[k].is_cuda and np.array_equal(g[k].cpu().numpy(), w[k]), k
    del tl
    gc.collect()
