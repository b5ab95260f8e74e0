"""Tokenized caches: the on-disk format that ``precache`` writes and ``open_cache`` reads.

A cache is a directory ``<out>/<format>-<key>`` holding ``data-XXXXX-of-YYYYY.{arrow,array_record}``
shards and ``manifest.json`` (format version, key, counts, per-shard sizes and sha256, and a checksum
of the manifest itself). Each record is ``input_ids`` (int32) and ``loss_mask`` (uint8) of one length.

One concept per module:

- :mod:`~portable_loader.cache.manifest`: the key, and writing, reading and checking the manifest
- :mod:`~portable_loader.cache.writer`: ``ShardWriter``, shard names, per-record content digests
- :mod:`~portable_loader.cache.opening`: ``open_cache``, local or remote
- :mod:`~portable_loader.cache.readers`: the Arrow / ArrayRecord sources and ``Spans``
- :mod:`~portable_loader.cache.publish`: temp directories, stale cleanup, the atomic rename
  (``pid_alive``, also exported here, lives in :mod:`portable_loader.lifecycle`)

Example:
    >>> import os, portable_loader as pl
    >>> from portable_loader.cache import open_cache, read_manifest
    >>> from portable_loader.precache import sample_args
    >>> path = pl.precache(**sample_args(), out="cache")
    >>> sorted(os.listdir(path))
    ['data-00000-of-00002.arrow', 'data-00001-of-00002.arrow', 'dataset_info.json', 'manifest.json', 'state.json']
    >>> src = open_cache(path)
    >>> len(src), src[0]["input_ids"].dtype, read_manifest(path)["counts"]["rows_out"]
    (2000, dtype('int32'), 2000)
"""

from portable_loader.cache.manifest import FORMAT_VERSION, read_manifest, write_manifest
from portable_loader.cache.opening import open_cache
from portable_loader.cache.writer import ShardWriter, record_digest, shard_name
from portable_loader.lifecycle import pid_alive

__all__ = [
    "FORMAT_VERSION", "ShardWriter", "open_cache", "pid_alive", "read_manifest", "record_digest", "shard_name",
    "write_manifest",
]
