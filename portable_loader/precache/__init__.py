"""``python -m portable_loader.precache``: tokenize a dataset once, in parallel, into a cache.

Each of ``num_workers`` processes opens the input itself, reads its own contiguous row range,
tokenizes it and writes its own shard: no row is pickled between processes and no token goes back
through a pipe (workers report only counts and checksums). The records, in order, and the content
checksum are the same for any worker count. A second run with the same inputs is a cache hit that
tokenizes nothing.

Run with no arguments it caches the sample dataset bundled with the package, with the bundled
tokenizer, into ``./portable_loader_cache``. ``info``, ``ls`` and ``rm`` subcommands inspect and remove
caches (see :mod:`portable_loader.precache.cli` and :mod:`portable_loader.precache.manage`).

Example:
    >>> import portable_loader as pl
    >>> path = pl.precache("train.jsonl", tokenizer="tok/", format="alpaca", out="cache/")  # doctest: +SKIP
    >>> len(pl.open_cache(path))                                                             # doctest: +SKIP
    999
"""

from __future__ import annotations

import multiprocessing as mp
import numbers
import os
import shutil
import signal
import sys
import time
from collections import Counter
from importlib import resources

from portable_loader import cache as cache_mod
from portable_loader.errors import CacheError, PortableLoaderError
from portable_loader.inputs import open_input
from portable_loader.tokenize import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_NO_INPUT,
    FORMATS,
    MIN_MAX_LENGTH,
    Formatter,
    check_fields,
    config_digest,
    load_tokenizer,
    read_template,
    tokenizer_identity,
    transcript_markers,
)
from portable_loader.precache.lock import locked, sweep_locks
from portable_loader.precache.manage import cache_info, list_caches, remove_cache

__all__ = ["precache", "build_cache", "sample_args", "cache_info", "list_caches", "remove_cache"]

_ENCODE_ROWS = 256


def sample_args() -> dict[str, str]:
    """``input``, ``tokenizer`` and ``format`` of the chat sample bundled in the package.

    Example:
        >>> path = precache(**sample_args(), out="portable_loader_cache")  # doctest: +SKIP
    """
    folder = resources.files("portable_loader") / "sample"
    return {"input": str(folder / "sample_chat.jsonl"), "tokenizer": str(folder / "tokenizer"), "format": "chat"}


_progress = None  # per-worker row counters in shared memory, inherited from the parent
_loaded: dict = {}  # tokenizers loaded by the parent: forked workers inherit them instead of reloading


def _tokenizer(path: str, chat_template: str | None, eos_token: str | None, files: str):
    key = (path, chat_template, eos_token, files)  # files: the digest of the tokenizer's files
    if key not in _loaded:
        _loaded.clear()
        _loaded[key] = load_tokenizer(path, chat_template, eos_token)
    return _loaded[key]


def _worker(task: dict, slot: int) -> dict:
    """Tokenize rows [lo, hi) of the input into one shard; return counts and checksums only."""
    cfg = task["config"]
    table = task["table"]  # the parent's: its line index is small, and a re-scan would read the whole input
    tok = _tokenizer(cfg["tokenizer"], cfg["chat_template"], cfg["eos_token"], task["tokenizer_files"])
    fmt = Formatter(
        cfg["format"], tok, fields=cfg["fields"], max_length=cfg["max_length"], overlong=cfg["overlong"],
        path=cfg["input"], on_bad_row=cfg["on_bad_row"], transcript=cfg["transcript"],
    )
    writer = cache_mod.ShardWriter(task["shard_path"], cfg["backend"])
    dropped: Counter = Counter()
    rows_in = tokens = trainable = 0
    content = 0
    pending_rows, pending_numbers = [], []

    def flush():
        nonlocal tokens, trainable, content
        results = fmt.encode(pending_rows, lambda i: table.where(pending_numbers[i]))
        for number, result in zip(pending_numbers, results):
            if isinstance(result, str):
                dropped[result] += 1
                continue
            ids, mask = result
            writer.write(ids, mask)
            tokens += ids.size
            trainable += int(mask.sum())
            content = (content + cache_mod.record_digest(number, ids, mask)) % (1 << 128)
        _progress[slot] += len(pending_rows)
        pending_rows.clear()
        pending_numbers.clear()

    for number, row in table.read(task["lo"], task["hi"]):
        rows_in += 1
        pending_rows.append(row)
        pending_numbers.append(number)
        if len(pending_rows) >= _ENCODE_ROWS:
            flush()
    if pending_rows:
        flush()
    shard = writer.close()
    return {
        "shard": shard,
        "rows_in": rows_in,
        "dropped": dict(dropped),
        "truncated": fmt.truncated,
        "tokens": tokens,
        "trainable_tokens": trainable,
        "content": content,
    }


def _init_worker(progress) -> None:
    global _progress
    _progress = progress
    # Ctrl-C is the parent's to handle: it stops the workers and removes the temp directory.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One worker per core: the tokenizer's own thread pool would only oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _run_workers(tasks: list[dict], show_progress: bool, total: int) -> list[dict]:
    from tqdm import tqdm

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    global _progress
    progress = _progress = ctx.Array("q", len(tasks), lock=False)
    bar = tqdm(total=total, unit="rows", disable=not show_progress, file=sys.stderr, smoothing=0.1)
    try:
        if len(tasks) == 1:
            # One worker: run inline, no process to start.
            results = [_worker(tasks[0], 0)]
        else:
            with ctx.Pool(len(tasks), initializer=_init_worker, initargs=(progress,)) as pool:
                pending = [pool.apply_async(_worker, (t, i)) for i, t in enumerate(tasks)]
                while not all(p.ready() for p in pending):
                    for p in pending:
                        if p.ready() and not p.successful():
                            p.get()  # raises the worker's error; the with block terminates the rest
                    bar.update(sum(progress) - bar.n)
                    time.sleep(0.1)
                results = [p.get() for p in pending]
        bar.update(sum(progress) - bar.n)
    finally:
        bar.close()
    return results


def build_cache(
    input: str,
    *,
    tokenizer: str,
    format: str,
    out: str,
    max_length: int | None = None,
    overlong: str = "drop",
    num_workers: int | None = None,
    backend: str = "arrow",
    fields: dict[str, str] | None = None,
    split: str | None = None,
    chat_template: str | None = None,
    eos_token: str | None = None,
    on_bad_row: str = "error",
    transcript: str | dict[str, str] | None = None,
    force: bool = False,
    show_progress: bool = False,
) -> tuple[str, dict]:
    """Like :func:`precache`, and also returns the run's summary (counts, seconds, cache hit or not).

    Example:
        >>> path, summary = build_cache("x.jsonl", tokenizer="tok/", format="text", out="c/")  # doctest: +SKIP
        >>> summary["hit"], summary["rows_out"]                                                 # doctest: +SKIP
        (False, 300)
    """
    t0 = time.perf_counter()
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if backend not in cache_mod.BACKENDS:
        raise ValueError(f"backend must be one of {cache_mod.BACKENDS}, got {backend!r}")
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if max_length is not None and (not _is_int(max_length) or max_length < MIN_MAX_LENGTH):
        raise ValueError(f"max_length must be an integer >= {MIN_MAX_LENGTH} (or None for no limit), got {max_length!r}")
    if num_workers is not None and (not _is_int(num_workers) or num_workers < 0):
        raise ValueError(f"num_workers must be an integer >= 0 (0: in this process; None: all cores), got {num_workers!r}")
    fields = check_fields(format, fields)
    if transcript is not None:
        if format != "chat":
            raise ValueError(f"transcript applies to the chat format only, not {format!r}")
        transcript = transcript_markers(transcript)
    input, tokenizer, out = os.fspath(input), os.fspath(tokenizer), os.fspath(out)
    table = open_input(input, split)
    config = {
        "input": os.path.abspath(input),
        "split": split,
        "tokenizer": os.path.abspath(tokenizer),
        "chat_template": chat_template,
        "eos_token": eos_token,
        "format": format,
        "fields": dict(sorted((fields or {}).items())),
        "max_length": max_length,
        "overlong": overlong,
        "on_bad_row": on_bad_row,
        "backend": backend,
        "transcript": transcript,
    }
    key_parts = {
        "format_version": cache_mod.FORMAT_VERSION,
        "input": table.identity(),
        # The files decide the tokenizer's EOS and chat template; overrides are hashed as text.
        "tokenizer_files": tokenizer_identity(tokenizer),
        "chat_template": read_template(chat_template) if chat_template is not None and format == "chat" else None,
        "eos_token": eos_token,
        "alpaca_template": [ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT] if format == "alpaca" else None,
        **{k: config[k] for k in ("format", "fields", "max_length", "overlong", "on_bad_row", "backend")},
        # Absent when unset, so that caches built before the option existed keep their keys.
        **({"transcript": transcript} if transcript is not None else {}),
    }
    key = config_digest(key_parts)
    name = f"{format}-{key[:20]}"
    final = os.path.join(out, name)
    os.makedirs(out, exist_ok=True)

    with locked(os.path.join(out, f".{name}.lock"), final):
        cache_mod.clean_stale(out, name)
        sweep_locks(out)
        if os.path.exists(final) and not force:
            try:
                manifest = cache_mod.read_manifest(final)
                cache_mod.check_shards(final, manifest)
            except CacheError as e:
                raise CacheError(f"{e}\n(the existing cache at {final} is invalid: rerun with --force to rebuild it)") from None
            return final, {**manifest["counts"], "hit": True, "seconds": time.perf_counter() - t0, "path": final}

        tok = _tokenizer(config["tokenizer"], chat_template, eos_token, key)
        # Validates the format against the tokenizer (EOS, chat template) before any work.
        Formatter(format, tok, fields=fields, max_length=max_length, overlong=overlong, path=input, transcript=transcript)
        tmp = None
        try:
            tmp = cache_mod.temp_dir(out, name)
            manifest = _tokenize_into(tmp, table, config, num_workers, show_progress, key)
            manifest.update(key=key, key_parts=key_parts, config=config)
            cache_mod.write_manifest(tmp, manifest)
            cache_mod.publish(tmp, final, replace=force)
        except BaseException as e:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):  # ENOSPC, EFBIG, EACCES, EIO while writing: not a bug of ours
                raise CacheError(f"{out}: cannot write the cache: {e.strerror or e} (nothing was published)") from e
            raise
    seconds = time.perf_counter() - t0
    return final, {**manifest["counts"], "hit": False, "seconds": seconds, "path": final}


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _tokenize_into(tmp: str, table, config: dict, num_workers: int | None, show_progress: bool, key: str) -> dict:
    rows = len(table)
    # 0 means this process, as for DataLoader; 1 worker runs inline too (no process to start).
    workers = max(1, min(_cpu_count() if num_workers is None else int(num_workers), rows))
    bounds = [rows * i // workers for i in range(workers + 1)]
    tasks = [
        {
            "config": config,
            "lo": bounds[i],
            "hi": bounds[i + 1],
            "shard_path": os.path.join(tmp, cache_mod.shard_name(config["backend"], i, workers)),
            "tokenizer_files": key,
            "table": table,
        }
        for i in range(workers)
    ]
    t = time.perf_counter()
    results = _run_workers(tasks, show_progress, rows)
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
        "num_workers": workers,
    }
    if counts["rows_out"] == 0:
        raise PortableLoaderError(
            f"{config['input']}: all {counts['rows_in']} rows were dropped ({_fmt_dropped(counts['dropped'])}): "
            "nothing to cache"
        )
    content = sum(r["content"] for r in results) % (1 << 128)
    return {
        "format_version": cache_mod.FORMAT_VERSION,
        "backend": config["backend"],
        "counts": counts,
        "content_checksum": f"{content:032x}",
        "shards": [r["shard"] for r in results],
        "created_unix": int(time.time()),
    }


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def precache(input: str, *, tokenizer: str, format: str, out: str, **options) -> str:
    """Tokenize ``input`` into a cache under ``out`` (or find it there) and return the cache's path.

    Options: ``max_length`` (>= 2), ``overlong="drop"|"truncate"``, ``num_workers`` (default: all
    cores; 0 or 1: in this process), ``backend="arrow"|"array_record"``,
    ``fields={"instruction": "question", ...}``, ``split`` (e.g. ``"train[:1000]"``), ``chat_template``
    (file, text or ``"default"``), ``eos_token``, ``on_bad_row="error"|"skip"``, ``transcript``
    (chat: ``"hh"`` or ``{marker: role}``, the ``messages`` field is one role-marked string), ``force``.

    Example:
        >>> path = precache("gsm8k.jsonl", tokenizer="phi-3-mini/", format="alpaca", out="cache/",
        ...                 fields={"instruction": "question", "output": "answer"})  # doctest: +SKIP
    """
    return build_cache(input, tokenizer=tokenizer, format=format, out=out, **options)[0]


def _fmt_dropped(dropped: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in dropped.items()) or "none"
