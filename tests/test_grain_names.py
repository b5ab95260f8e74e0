"""grain.experimental's smaller names against real Grain 0.2.18 (RngPool's numbers,
ShapeDtypeStructProtocol), and issue 48's must-show (d): none of Grain's experimental names is
refused any more."""

import pickle

import grain
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_loader import grain as pg
from portable_loader.grain._unsupported import NotSupportedError

ISSUE_48 = ["TFRecordIterDataset", "ParquetIterDataset", "InterleaveIterDataset", "ZipMapDataset", "ZipIterDataset",
            "LimitIterDataset", "RebatchIterDataset", "ThreadPrefetchDatasetIterator", "CacheIterDataset", "RngPool",
            "PackAndBatchOperation", "ShapeDtypeStructProtocol", "device_put"]


def test_no_experimental_name_of_grain_is_refused():
    from portable_loader.grain import experimental

    refused = []
    for name in sorted(set(dir(grain.experimental)) | set(ISSUE_48)):
        if name.startswith("_"):
            continue
        try:
            getattr(experimental, name)
        except NotSupportedError:
            refused.append(name)
    assert not refused


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), index=st.integers(0, 2**63 - 1), op_seed=st.integers(0, 2**32))
def test_rng_pool_draws_grains_numbers_reused_released_and_pickled(seed, index, op_seed):
    ours, real = pg.experimental.RngPool(seed), grain.experimental.RngPool(seed)
    for _ in range(2):  # the second time round, from generators that were released and are reused
        a, b = ours.acquire_rng(index, op_seed=op_seed), real.acquire_rng(index, op_seed=op_seed)
        assert a.integers(2**62, size=4).tolist() == b.integers(2**62, size=4).tolist()
        assert a.random() == b.random()
        ours.release_rng(a)
        real.release_rng(b)
    again = pickle.loads(pickle.dumps(ours))
    assert again.acquire_rng(index).normal() == grain.experimental.RngPool(seed).acquire_rng(index).normal()


def test_shape_dtype_struct_protocol_is_a_protocol_that_the_struct_follows():
    import typing

    assert typing.Protocol in pg.experimental.ShapeDtypeStructProtocol.__mro__
    for g in (pg, grain):
        assert g.experimental.ShapeDtypeStructProtocol in g.experimental.ShapeDtypeStruct.__mro__
    ours = pg.experimental.ShapeDtypeStruct(shape=(2, None), dtype=np.int32)
    real = grain.experimental.ShapeDtypeStruct(shape=(2, None), dtype=np.int32)
    assert (ours.shape, ours.dtype, repr(ours)) == (real.shape, real.dtype, repr(real))
    with pytest.raises(TypeError):
        pg.experimental.ShapeDtypeStruct(shape=(2,))   # Grain's takes the protocol's property as the dtype
