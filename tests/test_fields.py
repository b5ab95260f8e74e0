"""Fields a batch carries: the adapters derive the same Hugging Face inputs from any of them."""

from __future__ import annotations

import numpy as np
import pytest

import portable_loader as pl
from portable_loader.collate import FIELDS

torch = pytest.importorskip("torch")
from portable_loader.adapters.torch import TorchLoader, hf_fields  # noqa: E402


def _records(n=30, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        size = int(rng.integers(1, 50))
        out.append({"input_ids": rng.integers(1, 500, size).astype(np.int32),
                    "loss_mask": (rng.random(size) < 0.6).astype(np.uint8)})
    return out


@pytest.mark.parametrize("packing", [False, True])
def test_hf_fields_are_the_same_from_the_default_fields_and_from_all(packing):
    src = _records()
    kw = dict(global_batch_size=4, seq_len=32, seed=2, packing=packing, prefetch=0)
    default = iter(pl.DataLoader(src, **kw))
    full = iter(pl.DataLoader(src, fields=FIELDS, **kw))
    for _ in range(8):
        a, b = hf_fields(next(default)), hf_fields(next(full))
        assert a.keys() == b.keys()
        assert all(np.array_equal(a[k], b[k]) for k in a)


def test_torch_loader_carries_the_loaders_fields():
    src = _records()
    loader = pl.DataLoader(src, global_batch_size=4, seq_len=32, seed=2, fields=["input_ids", "attention_mask"])
    with TorchLoader(loader) as tl:
        batch = next(iter(tl))
    assert set(batch) == {"input_ids", "attention_mask"}
    want = next(iter(pl.DataLoader(src, global_batch_size=4, seq_len=32, seed=2, prefetch=0)))
    assert np.array_equal(batch["input_ids"].numpy(), want["input_ids"])
