"""Record orders: keyed pseudo-random permutations computed position by position.

``keyed`` holds the stream arithmetic (splitmix64, subkeys, keyed permutations, epoch layout),
``sampler`` the LCG index sampler (``pl.LCGSampler``), ``index_shuffle`` Grain's index shuffle bit
for bit, ``shard_order`` the shard-local order of ``shuffle="shards"``. Orders are pure arithmetic
over positions: they import numpy and ``errors`` only, never a dataset.

Example:
    >>> from portable_loader.orders.sampler import LCGSampler
    >>> order = LCGSampler(num_records=10, seed=0)
    >>> sorted(order.record_indices(range(10), epoch=0).tolist()) == list(range(10))
    True
"""
