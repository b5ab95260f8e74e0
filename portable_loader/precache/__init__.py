"""``python -m portable_loader.precache``: tokenize a dataset once, in parallel, into a cache.

The input is cut into numbered tasks of at most ``rows_per_task`` rows (never spanning two files);
task k writes shard k. ``num_workers`` processes (or, with ``engine="ray"``, a Ray cluster) run the
tasks: each reads its own row range, tokenizes it and writes its own shard, so no row is pickled
between processes and no token goes back through a pipe (tasks report only counts and checksums).
The shard files are byte-identical for any worker count and either engine, and the engine is not
part of the cache key. A second run with the same inputs is a cache hit that
tokenizes nothing.

Run with no arguments it caches the sample dataset bundled with the package, with the bundled
tokenizer, into ``./portable_loader_cache``. ``info``, ``ls`` and ``rm`` subcommands inspect and remove
caches (see :mod:`portable_loader.precache.cli` and :mod:`portable_loader.precache.manage`).

The record options (tokenizer, format, fields, max_length, ...) travel as one
:class:`~portable_loader.record_options.RecordOptions`: :func:`precache` and :func:`build_cache`
take them as keyword options and make it, :func:`build` takes it. A build runs the three steps of
:mod:`~portable_loader.precache.steps` (plan, run, publish) under the cache's lock;
:mod:`~portable_loader.precache.plan` fixes the tasks (row ranges per shard) and
:mod:`~portable_loader.precache.engine` runs them in a process pool.

Example:
    >>> import portable_loader as pl
    >>> from portable_loader.precache import sample_args
    >>> path = pl.precache(**sample_args(), out="cache")   # the bundled chat sample (a hit once built)
    >>> path
    'cache/chat-...'
    >>> len(pl.open_cache(path))
    2000
"""

from __future__ import annotations

import numbers
import os
import shutil
import time
from importlib import resources

from portable_loader.cache.manifest import BACKENDS
from portable_loader.cache.publish import clean_stale, temp_dir
from portable_loader.cache.remote import discard_unpublished, unpublish
from portable_loader.errors import CacheError, raised_here
from portable_loader.precache.engine import cached_tokenizer
from portable_loader.precache.lock import locked, sweep_locks
from portable_loader.precache.manage import cache_info, list_caches, remove_cache
from portable_loader.precache.steps import plan_build, publish_build, published, run_build
from portable_loader.record_options import RecordOptions

ENGINES = ("local", "ray")

__all__ = ["precache", "build_cache", "build", "sample_args", "cache_info", "list_caches", "remove_cache"]


def sample_args() -> dict[str, str]:
    """``input``, ``tokenizer`` and ``format`` of the chat sample bundled in the package.

    Example:
        >>> args = sample_args()
        >>> args["format"], os.path.basename(args["input"]), os.path.isdir(args["tokenizer"])
        ('chat', 'sample_chat.jsonl', True)
        >>> precache(**args, out="cache")
        'cache/chat-...'
    """
    folder = resources.files("portable_loader") / "sample"
    return {"input": str(folder / "sample_chat.jsonl"), "tokenizer": str(folder / "tokenizer"), "format": "chat"}


@raised_here
def precache(input, *, tokenizer: str, format: str, out: str, **options) -> str:
    """Tokenize ``input`` into a cache under ``out`` (or find it there) and return the cache's path.

    ``input``: a file, a folder of files, a glob, a list of these, or a ``datasets.Dataset`` (see
    :mod:`portable_loader.io.files` for the row order).

    Options: ``max_length`` (>= 2), ``overlong="drop"|"truncate"``, ``num_workers`` (default: all
    cores; 0 or 1: in this process), ``engine="local"|"ray"`` and ``ray_address`` (None: a Ray
    started here, or ``RAY_ADDRESS``; ``"auto"``; ``"host:port"``: see docs/distributed.md),
    ``rows_per_task`` (rows per shard at most; default: the row count / 64, within [1000, 50000]), ``backend="arrow"|"array_record"``,
    ``fields={"instruction": "question", ...}``, ``split`` (e.g. ``"train[:1000]"``), ``chat_template``
    (file, text or ``"default"``), ``eos_token``, ``on_bad_row="error"|"skip"``, ``transcript``
    (chat: ``"hh"`` or ``{marker: role}``, the ``messages`` field is one role-marked string), ``force``,
    ``storage_options`` (fsspec's, for URL inputs and ``out``; never recorded in the cache).
    ``tokenizer``, ``format`` and the options that decide the records make one
    :class:`~portable_loader.record_options.RecordOptions`; one already made is passed as
    ``**record.kwargs()``.

    ``input`` and ``out`` may be URLs (``s3://bucket/data/*.jsonl``, ``s3://bucket/caches``): see
    ``docs/object-storage.md``. The returned path is then a URL for :func:`portable_loader.open_cache`.

    Example:
        >>> import json
        >>> with open("qa.jsonl", "w") as f:   # gsm8k-like rows: question and answer fields
        ...     print(json.dumps({"question": "What is 2 + 2?", "answer": "4"}), file=f)
        ...     print(json.dumps({"question": "Name a colour.", "answer": "Blue"}), file=f)
        >>> path = precache("qa.jsonl", tokenizer=sample_args()["tokenizer"], format="alpaca", out="cache",
        ...                 fields={"instruction": "question", "output": "answer"})
        >>> path
        'cache/alpaca-...'
        >>> cache_info(path)["rows"]
        2
    """
    return build_cache(input, tokenizer=tokenizer, format=format, out=out, **options)[0]


@raised_here
def build_cache(input, *, tokenizer: str, format: str, out: str, **options) -> tuple[str, dict]:
    """Like :func:`precache`, and also returns the run's summary (counts, seconds, cache hit or not).

    Example:
        >>> import json
        >>> with open("x.jsonl", "w") as f:
        ...     for text in ["hello world", "a second line", "the third"]:
        ...         print(json.dumps({"text": text}), file=f)
        >>> tok = sample_args()["tokenizer"]
        >>> path, summary = build_cache("x.jsonl", tokenizer=tok, format="text", out="c")
        >>> summary["hit"], summary["rows_out"], summary["tasks"]
        (False, 3, 1)
        >>> build_cache("x.jsonl", tokenizer=tok, format="text", out="c")[1]["hit"]   # the same inputs again
        True
    """
    record, options = RecordOptions.take(dict(options, tokenizer=tokenizer, format=format))
    return build(input, record, out=out, **options)


@raised_here
def build(
    input,
    record: RecordOptions,
    *,
    out: str,
    split: str | None = None,
    num_workers: int | None = None,
    engine: str = "local",
    ray_address: str | None = None,
    rows_per_task: int | None = None,
    backend: str = "arrow",
    force: bool = False,
    show_progress: bool = False,
    storage_options: dict | None = None,
) -> tuple[str, dict]:
    """:func:`build_cache` with the record options as one value: plan, then under the cache's lock,
    the cache already published, or run and publish.

    Example:
        >>> args = sample_args()
        >>> record = RecordOptions(args["tokenizer"], args["format"])
        >>> path, summary = build(args["input"], record, out="cache")
        >>> path == precache(**args, out="cache"), summary["hit"]
        (True, True)
    """
    t0 = time.perf_counter()
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if num_workers is not None and (not _is_int(num_workers) or num_workers < 0):
        raise ValueError(f"num_workers must be an integer >= 0 (0: in this process; None: all cores), got {num_workers!r}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if rows_per_task is not None and (not _is_int(rows_per_task) or rows_per_task < 1):
        raise ValueError(f"rows_per_task must be an integer >= 1, got {rows_per_task!r}")
    plan = plan_build(input, record, out=out, split=split, backend=backend, rows_per_task=rows_per_task,
                      storage_options=storage_options)
    final, staging = plan.final, plan.staging
    os.makedirs(staging, exist_ok=True)

    with locked(os.path.join(staging, f".{plan.name}.lock"), final):
        clean_stale(staging, plan.name)
        sweep_locks(staging)
        if not force:
            manifest = published(plan)
            if manifest is not None:
                return final, {**manifest["counts"], "hit": True, "seconds": time.perf_counter() - t0, "path": final}

        # Checks the format against the tokenizer (EOS, chat template) before any work.
        record.formatter(plan.table.path, cached_tokenizer(record, plan.key))
        tmp = None
        # Ray tasks upload their own shards beside where the manifest will be; the driver, the manifest.
        tasks_upload = plan.remote and engine == "ray"
        try:
            tmp = temp_dir(staging, plan.name)
            if tasks_upload and force:
                unpublish(final, storage_options)  # never a manifest over shards being replaced
            manifest, run = run_build(plan, tmp, engine=engine, num_workers=num_workers, ray_address=ray_address,
                                      show_progress=show_progress, shards_to=final if tasks_upload else tmp)
            publish_build(plan, tmp, manifest, replace=force, tasks_uploaded=tasks_upload)
        except BaseException as e:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if tasks_upload:
                discard_unpublished(final, storage_options)
            if isinstance(e, OSError):  # ENOSPC, EFBIG, EACCES, EIO while writing: not a bug of ours
                raise CacheError(f"{out}: cannot write the cache: {e.strerror or e} (nothing was published)") from e
            raise
    return final, {**manifest["counts"], **run, "hit": False, "seconds": time.perf_counter() - t0, "path": final}


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
