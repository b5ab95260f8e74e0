"""One cache build in three steps: plan, run, publish.

:func:`plan_build` fixes what the build makes before any row is tokenized: the open input, the
:class:`~portable_loader.record_options.RecordOptions`, the cache key and the cache's place.
:func:`run_build` has an engine (local processes or Ray) run the plan's tasks into a temporary
folder and sums their counts into the manifest. :func:`publish_build` writes the manifest and makes
the cache visible at once (one rename; in a bucket, the manifest uploaded last).
:func:`portable_loader.precache.build` takes the build's lock between plan and run, and returns a
cache already published instead of running.

Example:
    >>> from portable_loader.cache.publish import temp_dir
    >>> from portable_loader.precache import sample_args
    >>> args = sample_args()
    >>> plan = plan_build(args["input"], RecordOptions(args["tokenizer"], "chat"), out="mine", split="train[:300]")
    >>> plan.name, plan.key_parts["plan"]
    ('chat-...', {'rows_per_task': 'auto'})
    >>> os.makedirs("mine")
    >>> tmp = temp_dir("mine", plan.name)
    >>> manifest, run = run_build(plan, tmp, num_workers=1)
    >>> publish_build(plan, tmp, manifest)
    >>> manifest["counts"]["rows_out"], run, os.listdir("mine") == [plan.name]
    (300, {'engine': 'local', 'num_workers': 1}, True)
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections import Counter
from typing import Any

from portable_loader.cache.manifest import (
    FORMAT_VERSION,
    cache_key,
    cache_key_parts,
    check_shards,
    read_manifest,
    write_manifest,
)
from portable_loader.cache.publish import publish, staging_dir
from portable_loader.cache.remote import check_remote_shards, remote_manifest, upload_cache
from portable_loader.cache.writer import ARRAY_RECORD_OPTIONS
from portable_loader.errors import CacheError, PortableLoaderError
from portable_loader.io import describe, open_inputs
from portable_loader.io.remote import is_url, join
from portable_loader.precache.engine import run_tasks
from portable_loader.precache.plan import default_rows_per_task, plan_tasks
from portable_loader.record_options import RecordOptions

__all__ = ["Build", "plan_build", "run_build", "publish_build", "published", "format_dropped"]


@dataclasses.dataclass(frozen=True)
class Build:
    """What one build makes, fixed by :func:`plan_build` before any row is tokenized.

    ``table``: the open input, read by the run only. ``rows_per_task``: None for the default, which
    the run computes from the row count (a cache hit never counts the rows). ``key_parts``: what the
    key hashes; ``config``: the build's options as the manifest records them.
    """

    table: Any
    record: RecordOptions
    backend: str
    rows_per_task: int | None
    key_parts: dict
    config: dict
    key: str
    out: str
    storage_options: dict | None

    @property
    def name(self) -> str:
        return f"{self.record.format}-{self.key[:20]}"

    @property
    def final(self) -> str:
        """Where the cache is published: a folder, or a URL."""
        return join(self.out, self.name)

    @property
    def remote(self) -> bool:
        return is_url(self.out)

    @property
    def staging(self) -> str:
        """Where the build is locked and written: ``out`` itself, or for a bucket a local folder (a
        bucket has no rename and no lock; two machines may both build one key, harmlessly)."""
        return staging_dir(self.out) if self.remote else self.out


def plan_build(input, record: RecordOptions, *, out: str, split: str | None = None, backend: str = "arrow",
               rows_per_task: int | None = None, storage_options: dict | None = None) -> Build:
    """Open ``input`` and fix the build: its key and its place under ``out`` (options checked by
    :func:`portable_loader.precache.build`)."""
    table = open_inputs(input, split, storage_options)
    storage = {
        "backend": backend,
        **({"array_record_options": ARRAY_RECORD_OPTIONS} if backend == "array_record" else {}),  # see cache/writer.py
        # The plan decides the shard files (the engine and worker count do not): a cache of the earlier
        # layout, one shard per worker, has another key, so it is never mistaken for this one.
        # The default follows the row count, itself a function of the input already in the key: the key
        # says "auto" so that a cache hit never counts (for a remote input: downloads) the rows.
        "plan": {"rows_per_task": "auto" if rows_per_task is None else rows_per_task},
    }
    parts = cache_key_parts(table.identity(), record.key_parts(), **storage)
    config = {"input": describe(input), "split": split, **record.config(), "backend": backend}
    return Build(table, record, backend, rows_per_task, parts, config, cache_key(parts), os.fspath(out), storage_options)


def published(build: Build) -> dict | None:
    """The manifest of a valid cache already at ``build.final``, None if none is published."""
    final, storage_options = build.final, build.storage_options
    try:
        if is_url(final):
            manifest = remote_manifest(final, storage_options)
            if manifest is not None:
                check_remote_shards(final, manifest, storage_options)
            return manifest
        if not os.path.exists(final):
            return None
        manifest = read_manifest(final)
        check_shards(final, manifest)
        return manifest
    except CacheError as e:
        raise CacheError(f"{e}\n(the existing cache at {final} is invalid: rerun with --force to rebuild it)") from None


def run_build(build: Build, tmp: str, *, engine: str = "local", num_workers: int | None = None,
              ray_address: str | None = None, show_progress: bool = False,
              shards_to: str | None = None) -> tuple[dict, dict]:
    """Run the build's tasks, shards into ``shards_to`` (default ``tmp``; for Ray, a bucket prefix):
    the manifest (less key, key parts and config) and how it ran."""
    table, record = build.table, build.record
    rows = len(table)
    tasks = plan_tasks(table, build.rows_per_task or default_rows_per_task(rows))
    t = time.perf_counter()
    if engine == "ray":
        from portable_loader.precache.ray_engine import run_ray_tasks

        results, run = run_ray_tasks(tasks, record, build.backend, build.key, shards_to or tmp, ray_address,
                                     show_progress, rows, build.storage_options)
    else:
        common = {"record": record, "backend": build.backend, "table": table, "tokenizer_files": build.key,
                  "tmp": tmp}
        results, workers = run_tasks(tasks, common, num_workers, show_progress, rows)
        run = {"num_workers": workers}
    seconds = time.perf_counter() - t
    dropped: Counter = Counter()
    for r in results:
        dropped.update(r["dropped"])
    counts = {
        "rows_in": sum(r["rows_in"] for r in results),
        "rows_out": sum(r["shard"]["rows"] for r in results),
        "dropped": dict(sorted(dropped.items())),
        "truncated": sum(r["truncated"] for r in results),
        "tokens": sum(r["tokens"] for r in results),
        "trainable_tokens": sum(r["trainable_tokens"] for r in results),
        "tokenize_seconds": round(seconds, 3),
        "tasks": len(tasks),
    }
    if counts["rows_out"] == 0:
        raise PortableLoaderError(
            f"{table.path}: all {counts['rows_in']} rows were dropped ({format_dropped(counts['dropped'])}): "
            "nothing to cache"
        )
    content = sum(r["content"] for r in results) % (1 << 128)
    return {
        "format_version": FORMAT_VERSION,
        "backend": build.backend,
        **({"array_record_options": ARRAY_RECORD_OPTIONS} if build.backend == "array_record" else {}),
        "counts": counts,
        "content_checksum": f"{content:032x}",
        "shards": [r["shard"] for r in results],
        "created_unix": int(time.time()),
    }, {"engine": engine, **run}


def publish_build(build: Build, tmp: str, manifest: dict, *, replace: bool = False,
                  tasks_uploaded: bool = False) -> None:
    """Write the manifest into ``tmp`` and publish it at ``build.final``: one rename, or an upload with
    the manifest last (of the manifest alone where the Ray tasks uploaded their shards)."""
    write_manifest(tmp, {**manifest, "key": build.key, "key_parts": build.key_parts, "config": build.config})
    if build.remote:
        upload_cache(tmp, build.final, build.storage_options, replace=replace and not tasks_uploaded)
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        publish(tmp, build.final, replace=replace)


def format_dropped(dropped: dict) -> str:
    """The dropped counts as one line.

    Example:
        >>> format_dropped({"overlong": 3, "bad_row": 1}), format_dropped({})
        ('overlong: 3, bad_row: 1', 'none')
    """
    return ", ".join(f"{k}: {v}" for k, v in dropped.items()) or "none"
