"""``python -m portable_loader.precache``: tokenize a dataset once, in parallel, into a cache.

Each of ``num_workers`` processes opens the input itself, reads its own contiguous row range,
tokenizes it and writes its own shard: no row is pickled between processes and no token goes back
through a pipe (workers report only counts and checksums). The records, in order, and the content
checksum are the same for any worker count. A second run with the same inputs is a cache hit that
tokenizes nothing.

Run with no arguments it caches the sample dataset bundled with the package, with the bundled
tokenizer, into ``./portable_loader_cache``.

Example:
    >>> import portable_loader as pl
    >>> path = pl.precache("train.jsonl", tokenizer="tok/", format="alpaca", out="cache/")  # doctest: +SKIP
    >>> len(pl.open_cache(path))                                                             # doctest: +SKIP
    999
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import multiprocessing as mp
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
    Formatter,
    config_digest,
    load_tokenizer,
    read_template,
    tokenizer_identity,
)

__all__ = ["precache", "build_cache", "main", "sample_args"]

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
        path=cfg["input"], on_bad_row=cfg["on_bad_row"],
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
    }
    key = config_digest(key_parts)
    name = f"{format}-{key[:20]}"
    final = os.path.join(out, name)
    os.makedirs(out, exist_ok=True)

    with _locked(os.path.join(out, f".{name}.lock")):
        cache_mod.clean_stale(out, name)
        if os.path.exists(final) and not force:
            try:
                manifest = cache_mod.read_manifest(final)
                cache_mod.check_shards(final, manifest)
            except CacheError as e:
                raise CacheError(f"{e}\n(the existing cache at {final} is invalid: rerun with --force to rebuild it)") from None
            return final, {**manifest["counts"], "hit": True, "seconds": time.perf_counter() - t0, "path": final}

        tok = _tokenizer(config["tokenizer"], chat_template, eos_token, key)
        # Validates the format against the tokenizer (EOS, chat template) before any work.
        Formatter(format, tok, fields=fields, max_length=max_length, overlong=overlong, path=input)
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


def _tokenize_into(tmp: str, table, config: dict, num_workers: int | None, show_progress: bool, key: str) -> dict:
    rows = len(table)
    workers = max(1, min(num_workers or _cpu_count(), rows))
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


@contextlib.contextmanager
def _locked(path: str):
    """An advisory lock so concurrent runs for one key wait instead of tokenizing twice.

    Correctness does not rest on it (publishing is an atomic rename); it only saves the work.
    """
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def precache(input: str, *, tokenizer: str, format: str, out: str, **options) -> str:
    """Tokenize ``input`` into a cache under ``out`` (or find it there) and return the cache's path.

    Options: ``max_length``, ``overlong="drop"|"truncate"``, ``num_workers`` (default: all cores),
    ``backend="arrow"|"array_record"``, ``fields={"instruction": "question", ...}``, ``split``
    (e.g. ``"train[:1000]"``), ``chat_template`` (file, text or ``"default"``), ``eos_token``,
    ``on_bad_row="error"|"skip"``, ``force``.

    Example:
        >>> path = precache("gsm8k.jsonl", tokenizer="phi-3-mini/", format="alpaca", out="cache/",
        ...                 fields={"instruction": "question", "output": "answer"})  # doctest: +SKIP
    """
    return build_cache(input, tokenizer=tokenizer, format=format, out=out, **options)[0]


def _fmt_dropped(dropped: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in dropped.items()) or "none"


def _parse_fields(pairs: list[str]) -> dict[str, str]:
    fields = {}
    for pair in pairs:
        name, sep, column = pair.partition("=")
        if not sep or not name or not column:
            raise PortableLoaderError(f"--field expects NAME=COLUMN, got {pair!r}")
        fields[name] = column
    return fields


def main(argv: list[str] | None = None) -> int:
    """The command line; see ``python -m portable_loader.precache --help``."""
    p = argparse.ArgumentParser(
        prog="python -m portable_loader.precache",
        description="Tokenize a dataset into a portable_loader cache and print the cache directory. "
        "With no arguments: the bundled sample chat dataset and tokenizer.",
    )
    p.add_argument("--input", help="JSONL(.gz), JSON list, Parquet, .txt, or a datasets.save_to_disk folder")
    p.add_argument("--format", choices=FORMATS)
    p.add_argument("--tokenizer", help="local tokenizer folder (tokenizer.json [+ tokenizer_config.json])")
    p.add_argument("--out", default="portable_loader_cache", help="parent directory of caches")
    p.add_argument("--max-length", type=int)
    p.add_argument("--overlong", choices=("drop", "truncate"), default="drop")
    p.add_argument("--num-workers", type=int, help="default: all cores")
    p.add_argument("--backend", choices=cache_mod.BACKENDS, default="arrow")
    p.add_argument("--field", action="append", default=[], metavar="NAME=COLUMN", help="rename an input field")
    p.add_argument("--split", help="Hugging Face split slice, e.g. 'train[:1000]'")
    p.add_argument("--chat-template", help="template file, or 'default' for a simple built-in one")
    p.add_argument("--eos-token", help="EOS token, for tokenizers that do not declare one")
    p.add_argument("--on-bad-row", choices=("error", "skip"), default="error")
    p.add_argument("--force", action="store_true", help="rebuild even if the cache exists")
    p.add_argument("--verify", action="store_true", help="check every shard's checksum of the resulting cache")
    args = p.parse_args(argv)

    if args.input is None and args.format is None and args.tokenizer is None:
        sample = sample_args()
        args.input, args.format, args.tokenizer = sample["input"], sample["format"], sample["tokenizer"]
    missing = [f"--{n}" for n in ("input", "format", "tokenizer") if getattr(args, n) is None]
    if missing:
        p.error(f"missing {', '.join(missing)} (or give none of them to use the bundled sample)")
    try:
        path, s = build_cache(
            args.input, tokenizer=args.tokenizer, format=args.format, out=args.out, max_length=args.max_length,
            overlong=args.overlong, num_workers=args.num_workers, backend=args.backend,
            fields=_parse_fields(args.field), split=args.split, chat_template=args.chat_template,
            eos_token=args.eos_token, on_bad_row=args.on_bad_row, force=args.force,
            show_progress=sys.stderr.isatty(),
        )
        if args.verify:
            cache_mod.open_cache(path, verify=True)
    except PortableLoaderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: no cache was published", file=sys.stderr)
        return 130
    if s["hit"]:
        print(f"cache hit: {s['rows_out']} records, {s['tokens']} tokens (nothing tokenized, {s['seconds']:.2f} s)")
    else:
        rate = s["rows_in"] / max(s["tokenize_seconds"], 1e-9)
        print(
            f"rows in: {s['rows_in']}  rows out: {s['rows_out']}  dropped: {_fmt_dropped(s['dropped'])}  "
            f"truncated: {s['truncated']}\ntokens: {s['tokens']} ({s['trainable_tokens']} trained)  "
            f"seconds: {s['seconds']:.2f}  rows/s: {rate:,.0f}  workers: {s['num_workers']}"
        )
    if args.verify:
        print("verified: every shard checksum matches")
    print(path)
    return 0

