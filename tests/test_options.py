"""``LoaderOptions``: a loader's constructor options as one frozen value, and ``with_shard`` built from it."""

import dataclasses

import numpy as np
import pytest

import portable_loader as pl
from portable_loader.loader import LoaderOptions

SRC = [{"input_ids": np.arange(1 + i % 9, dtype=np.int32)} for i in range(40)]


def test_options_are_frozen_and_hold_what_was_given():
    loader = pl.DataLoader(SRC, global_batch_size=[(0, 4), (3, 8)], seq_len=16, seed=7, packing=True,
                           num_epochs=2, prefetch=1, packing_window=32, pad_id=3, fields=["input_ids", "segment_ids"])
    opts = loader.options
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.seed = 1
    assert (opts.seed, opts.packing, opts.num_epochs, opts.packing_window, opts.pad_id, opts.overlong) == \
        (7, True, 2, 32, 3, "auto")
    assert opts.global_batch_size == loader.batch_schedule and opts.fields == ("input_ids", "segment_ids")
    assert opts.shard_index is None and opts.shard_count is None  # unset: adapters fill them in


def test_with_shard_changes_the_shard_and_nothing_else():
    kw = dict(global_batch_size=6, seq_len=16, seed=2, shuffle=False, num_epochs=1, num_workers=0, prefetch=0,
              overlong="drop", fields=("input_ids", "attention_mask"), drop_remainder=True)
    loader = pl.DataLoader(SRC, **kw)
    host = loader.with_shard(2, 3)
    assert dataclasses.replace(host.options, shard_index=None, shard_count=None) == loader.options
    assert (host.shard_index, host.shard_count, host.shard_given) == (2, 3, True)
    assert host.fingerprint == loader.fingerprint
    whole = [b["input_ids"] for b in loader]
    assert all(np.array_equal(a["input_ids"], w[4:6]) for a, w in zip(host, whole))
    again = pl.DataLoader(SRC, **LoaderOptions(**kw).kwargs())
    assert again.options == loader.options and again.fingerprint == loader.fingerprint
