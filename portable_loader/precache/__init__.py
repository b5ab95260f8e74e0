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

This module orchestrates a build (check the options, compute the key, lock, return a hit or tokenize
into a temp directory and publish it); :mod:`~portable_loader.precache.plan` fixes the tasks (row
ranges per shard) and :mod:`~portable_loader.precache.engine` runs them in a process pool.

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
from collections import Counter
from importlib import resources

from portable_loader.cache.manifest import (
    BACKENDS,
    FORMAT_VERSION,
    cache_key,
    check_shards,
    read_manifest,
    write_manifest,
)
from portable_loader.cache.publish import clean_stale, publish, staging_dir, temp_dir
from portable_loader.cache.remote import (
    check_remote_shards,
    discard_unpublished,
    remote_manifest,
    unpublish,
    upload_cache,
)
from portable_loader.cache.writer import ARRAY_RECORD_OPTIONS
from portable_loader.errors import CacheError, PortableLoaderError
from portable_loader.io import describe, open_inputs
from portable_loader.io.remote import is_url, join
from portable_loader.precache.engine import cached_tokenizer, run_tasks
from portable_loader.precache.lock import locked, sweep_locks
from portable_loader.precache.manage import cache_info, list_caches, remove_cache
from portable_loader.precache.plan import default_rows_per_task, plan_tasks
from portable_loader.tokenize import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_NO_INPUT,
    FORMATS,
    MIN_MAX_LENGTH,
    Formatter,
    check_fields,
    read_template,
    tokenizer_identity,
    transcript_markers,
)

ENGINES = ("local", "ray")

__all__ = ["precache", "build_cache", "prepare", "sample_args", "cache_info", "list_caches", "remove_cache"]


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


def build_cache(
    input,
    *,
    tokenizer: str,
    format: str,
    out: str,
    max_length: int | None = None,
    overlong: str = "drop",
    num_workers: int | None = None,
    engine: str = "local",
    ray_address: str | None = None,
    rows_per_task: int | None = None,
    backend: str = "arrow",
    fields: dict[str, str] | None = None,
    split: str | None = None,
    chat_template: str | None = None,
    eos_token: str | None = None,
    on_bad_row: str = "error",
    transcript: str | dict[str, str] | None = None,
    force: bool = False,
    show_progress: bool = False,
    storage_options: dict | None = None,
) -> tuple[str, dict]:
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
    t0 = time.perf_counter()
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if num_workers is not None and (not _is_int(num_workers) or num_workers < 0):
        raise ValueError(f"num_workers must be an integer >= 0 (0: in this process; None: all cores), got {num_workers!r}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if rows_per_task is not None and (not _is_int(rows_per_task) or rows_per_task < 1):
        raise ValueError(f"rows_per_task must be an integer >= 1, got {rows_per_task!r}")
    table, config, key_parts = prepare(
        input, tokenizer=tokenizer, format=format, max_length=max_length, overlong=overlong, fields=fields,
        split=split, chat_template=chat_template, eos_token=eos_token, on_bad_row=on_bad_row, transcript=transcript,
        storage_options=storage_options,
    )
    config["backend"] = key_parts["backend"] = backend
    if backend == "array_record":  # see cache/writer.py
        key_parts["array_record_options"] = ARRAY_RECORD_OPTIONS
    # The plan decides the shard files (the engine and worker count do not): a cache of the earlier
    # layout, one shard per worker, has another key, so it is never mistaken for this one.
    # The default follows the row count, itself a function of the input already in the key: the key
    # says "auto" so that a cache hit never counts (for a remote input: downloads) the rows.
    key_parts["plan"] = {"rows_per_task": "auto" if rows_per_task is None else rows_per_task}
    fields, transcript = config["fields"], config["transcript"]
    tokenizer, out = config["tokenizer"], os.fspath(out)
    key = cache_key(key_parts)
    name = f"{format}-{key[:20]}"
    remote = is_url(out)
    final = join(out, name)
    # A bucket has no rename and no lock: build in a local staging folder, lock there (two machines
    # may both build one key, harmlessly), and upload with the manifest last.
    staging = staging_dir(out) if remote else out
    os.makedirs(staging, exist_ok=True)

    with locked(os.path.join(staging, f".{name}.lock"), final):
        clean_stale(staging, name)
        sweep_locks(staging)
        if not force:
            manifest = _existing(final, storage_options)
            if manifest is not None:
                return final, {**manifest["counts"], "hit": True, "seconds": time.perf_counter() - t0, "path": final}

        tok = cached_tokenizer(config["tokenizer"], chat_template, eos_token, key)
        # Validates the format against the tokenizer (EOS, chat template) before any work.
        Formatter(format, tok, fields=fields, max_length=max_length, overlong=overlong, path=table.path, transcript=transcript)
        tmp = None
        # Ray tasks upload their own shards beside where the manifest will be; the driver, the manifest.
        tasks_upload = remote and engine == "ray"
        try:
            tmp = temp_dir(staging, name)
            if rows_per_task is None:
                rows_per_task = default_rows_per_task(len(table))
            if tasks_upload and force:
                unpublish(final, storage_options)  # never a manifest over shards being replaced
            manifest, run = _tokenize_into(tmp, table, config, key, rows_per_task, show_progress,
                                           num_workers=num_workers, engine=engine, ray_address=ray_address,
                                           shards_to=final if tasks_upload else tmp, storage_options=storage_options)
            manifest.update(key=key, key_parts=key_parts, config=config)
            write_manifest(tmp, manifest)
            if remote:
                upload_cache(tmp, final, storage_options, replace=force and not tasks_upload)
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                publish(tmp, final, replace=force)
        except BaseException as e:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if tasks_upload:
                discard_unpublished(final, storage_options)
            if isinstance(e, OSError):  # ENOSPC, EFBIG, EACCES, EIO while writing: not a bug of ours
                raise CacheError(f"{out}: cannot write the cache: {e.strerror or e} (nothing was published)") from e
            raise
    seconds = time.perf_counter() - t0
    return final, {**manifest["counts"], **run, "hit": False, "seconds": seconds, "path": final}


def prepare(
    input,
    *,
    tokenizer: str,
    format: str,
    max_length: int | None = None,
    overlong: str = "drop",
    fields: dict[str, str] | None = None,
    split: str | None = None,
    chat_template: str | None = None,
    eos_token: str | None = None,
    on_bad_row: str = "error",
    transcript: str | dict[str, str] | None = None,
    storage_options: dict | None = None,
) -> tuple:
    """Check the options that decide the records, open the input: ``(table, config, key_parts)``.

    What ``build_cache`` and :func:`portable_loader.tokenized` share; ``key_parts`` (less the backend,
    which the caller adds) are what the cache key hashes.

    Example:
        >>> table, config, parts = prepare(**sample_args(), max_length=512)
        >>> len(table), config["format"], parts["max_length"]
        (2000, 'chat', 512)
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if overlong not in ("drop", "truncate"):
        raise ValueError(f"overlong must be 'drop' or 'truncate', got {overlong!r}")
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if max_length is not None and (not _is_int(max_length) or max_length < MIN_MAX_LENGTH):
        raise ValueError(f"max_length must be an integer >= {MIN_MAX_LENGTH} (or None for no limit), got {max_length!r}")
    fields = check_fields(format, fields)
    if transcript is not None:
        if format != "chat":
            raise ValueError(f"transcript applies to the chat format only, not {format!r}")
        transcript = transcript_markers(transcript)
    tokenizer = os.fspath(tokenizer)
    if is_url(tokenizer):
        raise ValueError(f"tokenizer must be a local folder, got the URL {tokenizer!r}")
    table = open_inputs(input, split, storage_options)
    config = {
        "input": describe(input),
        "split": split,
        "tokenizer": os.path.abspath(tokenizer),
        "chat_template": chat_template,
        "eos_token": eos_token,
        "format": format,
        "fields": dict(sorted((fields or {}).items())),
        "max_length": max_length,
        "overlong": overlong,
        "on_bad_row": on_bad_row,
        "transcript": transcript,
    }
    key_parts = {
        "format_version": FORMAT_VERSION,
        "input": table.identity(),
        # The files decide the tokenizer's EOS and chat template; overrides are hashed as text.
        "tokenizer_files": tokenizer_identity(tokenizer),
        "chat_template": read_template(chat_template) if chat_template is not None and format == "chat" else None,
        "eos_token": eos_token,
        "alpaca_template": [ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT] if format == "alpaca" else None,
        **{k: config[k] for k in ("format", "fields", "max_length", "overlong", "on_bad_row")},
        # Absent when unset, so that caches built before the option existed keep their keys.
        **({"transcript": transcript} if transcript is not None else {}),
    }
    return table, config, key_parts


def _existing(final: str, storage_options: dict | None) -> dict | None:
    """The manifest of a valid cache already at ``final`` (a path or URL), None if none is published."""
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


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _tokenize_into(tmp: str, table, config: dict, key: str, rows_per_task: int, show_progress: bool, *,
                   num_workers: int | None, engine: str, ray_address: str | None, shards_to: str,
                   storage_options: dict | None) -> tuple[dict, dict]:
    """Run the plan's tasks, shards into ``shards_to`` (``tmp``, or for Ray a bucket prefix): the
    manifest (less key and config) and how it ran."""
    rows = len(table)
    plan = plan_tasks(table, rows_per_task)
    t = time.perf_counter()
    if engine == "ray":
        from portable_loader.precache.ray_engine import run_ray_tasks

        results, run = run_ray_tasks(plan, config, key, shards_to, ray_address, show_progress, rows, storage_options)
    else:
        common = {"config": config, "table": table, "tokenizer_files": key, "tmp": tmp}
        results, workers = run_tasks(plan, common, num_workers, show_progress, rows)
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
        "tasks": len(plan),
    }
    if counts["rows_out"] == 0:
        raise PortableLoaderError(
            f"{table.path}: all {counts['rows_in']} rows were dropped ({_fmt_dropped(counts['dropped'])}): "
            "nothing to cache"
        )
    content = sum(r["content"] for r in results) % (1 << 128)
    return {
        "format_version": FORMAT_VERSION,
        "backend": config["backend"],
        **({"array_record_options": ARRAY_RECORD_OPTIONS} if config["backend"] == "array_record" else {}),
        "counts": counts,
        "content_checksum": f"{content:032x}",
        "shards": [r["shard"] for r in results],
        "created_unix": int(time.time()),
    }, {"engine": engine, **run}


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


def _fmt_dropped(dropped: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in dropped.items()) or "none"
