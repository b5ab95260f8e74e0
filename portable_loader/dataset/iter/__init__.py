"""The ``IterDataset`` layer: Grain's iterators over the random-access layer.

``to_iter_dataset()`` turns a :class:`~portable_loader.dataset.Dataset` into an ``IterDataset``; its
steps (map, filter, batch, mix, packing, concat-then-split, flat map, repeat, window shuffle,
``mp_prefetch``) are planned by position wherever they can be, so an iterator's state is a stream
position and does not depend on the number of workers. Modules here may import the random-access
layer (``portable_loader.dataset``), ``orders``, ``engine`` and the top-level helpers; nothing below
``dataset/`` imports this package at module level (``Dataset.to_iter_dataset`` imports it lazily).

Example:
    >>> from portable_loader.dataset.iter.dataset import IterDataset
    >>> from portable_loader.dataset import source
    >>> ds = source(list(range(6))).to_iter_dataset().batch(4)
    >>> isinstance(ds, IterDataset), [b.tolist() for b in ds]
    (True, [[0, 1, 2, 3], [4, 5]])
"""
