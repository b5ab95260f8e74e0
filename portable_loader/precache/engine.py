"""Running precache tasks: a local process pool of tokenizing workers, and the progress bar.

Each worker opens nothing new: it inherits (fork) the parent's input table and loaded tokenizer,
reads its own row range, tokenizes it and writes its own shard, and reports only counts and
checksums. One task runs inline, with no process to start.

Example:
    >>> results = run_tasks(tasks, show_progress=False, total=rows)  # doctest: +SKIP
    >>> sum(r["shard"]["rows"] for r in results)                      # doctest: +SKIP
    2000
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from collections import Counter

from portable_loader.cache.writer import ShardWriter, record_digest
from portable_loader.tokenize import Formatter, load_tokenizer

_ENCODE_ROWS = 256

_progress = None  # per-worker row counters in shared memory, inherited from the parent
_loaded: dict = {}  # tokenizers loaded by the parent: forked workers inherit them instead of reloading


def cached_tokenizer(path: str, chat_template: str | None, eos_token: str | None, files: str):
    """The tokenizer at ``path``, loaded once per process and inherited by forked workers.

    ``files`` (the digest of the tokenizer's files) is part of the cache key, so an edited
    tokenizer folder is loaded anew.

    Example:
        >>> tok = cached_tokenizer("tok/", None, None, key)  # doctest: +SKIP
    """
    key = (path, chat_template, eos_token, files)
    if key not in _loaded:
        _loaded.clear()
        _loaded[key] = load_tokenizer(path, chat_template, eos_token)
    return _loaded[key]


def _worker(task: dict, slot: int) -> dict:
    """Tokenize rows [lo, hi) of the input into one shard; return counts and checksums only."""
    cfg = task["config"]
    table = task["table"]  # the parent's: its line index is small, and a re-scan would read the whole input
    tok = cached_tokenizer(cfg["tokenizer"], cfg["chat_template"], cfg["eos_token"], task["tokenizer_files"])
    fmt = Formatter(
        cfg["format"], tok, fields=cfg["fields"], max_length=cfg["max_length"], overlong=cfg["overlong"],
        path=table.path, on_bad_row=cfg["on_bad_row"], transcript=cfg["transcript"],
    )
    writer = ShardWriter(task["shard_path"], cfg["backend"])
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
            content = (content + record_digest(number, ids, mask)) % (1 << 128)
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


def _raise_first_error(pending: list) -> None:
    """Raise the error of the earliest failed task once every task before it has finished.

    Tasks cover consecutive row ranges, so a later task failing first must not hide an earlier bad
    row: the message would then depend on timing, and users fix bad rows in file order.
    """
    for p in pending:
        if not p.ready():
            return
        if not p.successful():
            p.get()  # raises the worker's error; the caller's with block terminates the rest


def run_tasks(tasks: list[dict], show_progress: bool, total: int) -> list[dict]:
    """Run every task (one process each, or inline for one) and return their results in task order.

    The error of the first bad row in input order is raised here (whichever worker hits its bad row
    first), and the pool's other workers are terminated.
    """
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
                    _raise_first_error(pending)
                    bar.update(sum(progress) - bar.n)
                    time.sleep(0.1)
                _raise_first_error(pending)
                results = [p.get() for p in pending]
        bar.update(sum(progress) - bar.n)
    finally:
        bar.close()
    return results
