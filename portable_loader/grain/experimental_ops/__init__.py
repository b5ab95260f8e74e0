"""The ``grain.experimental`` steps that are iterators by nature, written as a Grain user writes them.

Each is a subclass of our ``IterDataset`` whose ``__iter__`` returns a subclass of our
``DatasetIterator`` (:class:`~portable_loader.grain.experimental_ops.parts.GrainStyleIterator`)
with Grain's ``__next__``, ``get_state`` and ``set_state``, so a bare ``iter(ds)`` has Grain's
elements and Grain's state. Where its state is a few integers (a file offset, a count), it also
offers ``_make_part``: inside one of our pipelines it then runs as a built-in step, its integers
part of the pipeline's position state. Where they are not integers there (an interleave over
``MapDataset``s), ``_make_part`` hands back an opaque part instead (:func:`.parts.iterator_part`,
:func:`.interleave.interleave_part`): the iterator runs as written, its state under ``steps``.
``portable_loader.grain.experimental`` exports them.
"""
