"""Running precache tasks: the local engine (a process pool of tokenizing workers) and the task itself.

The tasks come from :mod:`portable_loader.precache.plan`, however many processes run them. Each
worker opens nothing new: it inherits (fork) the parent's input table and loaded tokenizer, and for
each task reads the task's row range, tokenizes it, writes the task's shard and reports only counts
and checksums. With one worker the tasks run inline, with no process to start.
:mod:`portable_loader.precache.ray_engine` runs the same :func:`tokenize_task` on a Ray cluster.

Example:
    >>> from portable_loader.io import open_inputs
    >>> from portable_loader.precache import sample_args
    >>> from portable_loader.precache.plan import plan_tasks
    >>> from portable_loader.record_options import RecordOptions
    >>> args = sample_args()
    >>> table = open_inputs(args["input"], "train[:200]")   # the sample's first 200 rows
    >>> record = RecordOptions(args["tokenizer"], args["format"])
    >>> os.mkdir("tmp")
    >>> tasks = plan_tasks(table, rows_per_task=100)
    >>> common = {"record": record, "backend": "arrow", "table": table, "tokenizer_files": "digest", "tmp": "tmp"}
    >>> results, workers = run_tasks(tasks, common, 2, show_progress=False, total=len(table))   # as a build does
    >>> workers, sum(r["shard"]["rows"] for r in results), sorted(os.listdir("tmp"))
    (2, 200, ['data-00000-of-00002.arrow', 'data-00001-of-00002.arrow'])
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import uuid
from collections import Counter

from portable_loader.cache.writer import ShardWriter, record_digest
from portable_loader.engine.workers import get_context, start_method, take_environment, without_main
from portable_loader.precache.plan import cpu_count
from portable_loader.record_options import RecordOptions

_ENCODE_ROWS = 256

_progress = None  # per-worker row counters in shared memory, inherited from the parent
_common = None  # what every task shares (record options, input table, temp dir): given once per process
_loaded: dict = {}  # tokenizers loaded by the parent: forked workers inherit them instead of reloading


def cached_tokenizer(record: RecordOptions, files: str):
    """``record``'s tokenizer, loaded once per process and inherited by forked workers.

    ``files`` (the digest of the tokenizer's files) is part of the cache key, so an edited
    tokenizer folder is loaded anew.

    Example:
        >>> from portable_loader.precache import sample_args
        >>> record = RecordOptions(sample_args()["tokenizer"], "chat")
        >>> tok = cached_tokenizer(record, "digest-1")
        >>> tok is cached_tokenizer(record, "digest-1"), tok.eos_token
        (True, '<|endoftext|>')
        >>> tok is cached_tokenizer(record, "digest-2")   # the files changed: loaded anew
        False
    """
    # The record's other options load no other tokenizer.
    key = (record.tokenizer, record.chat_template, record.eos_token, files)
    if key not in _loaded:
        _loaded.clear()
        _loaded[key] = record.load_tokenizer()
    return _loaded[key]


def tokenize_task(task, table, offset: int, record: RecordOptions, backend: str, tokenizer_files: str, tmp: str,
                  progress=None) -> dict:
    """Tokenize ``task``'s rows by ``record`` into its ``backend`` shard under ``tmp``; return counts and
    checksums only.

    ``table`` numbers the task's rows from ``offset`` below the input window's numbering (0 for the
    whole input table; the task's file read alone otherwise). The shard is written under a temporary
    name and renamed, so a task rerun after a lost node overwrites it whole, with the same bytes.
    ``progress(n)``, if given, is told of every ``n`` rows read.

    Example:
        >>> import tempfile
        >>> from portable_loader.io import open_inputs
        >>> from portable_loader.precache import sample_args
        >>> from portable_loader.precache.plan import plan_tasks
        >>> args = sample_args()
        >>> table, record = open_inputs(args["input"], "train[:30]"), RecordOptions(args["tokenizer"], "chat")
        >>> plan = plan_tasks(table, rows_per_task=10)
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     result = tokenize_task(plan[0], table, 0, record, "arrow", "digest", tmp)
        ...     files = os.listdir(tmp)
        >>> result["shard"]["file"], result["shard"]["rows"], result["rows_in"], files
        ('data-00000-of-00003.arrow', 10, 10, ['data-00000-of-00003.arrow'])
    """
    fmt = record.formatter(table.path, cached_tokenizer(record, tokenizer_files))
    final = os.path.join(tmp, task.shard(backend))
    part = f"{final}.{uuid.uuid4().hex}.part"
    dropped: Counter = Counter()
    rows_in = tokens = trainable = 0
    content = 0
    pending_rows, pending_numbers = [], []

    def flush():
        nonlocal tokens, trainable, content
        results = fmt.encode(pending_rows, lambda i: table.where(pending_numbers[i] - offset))
        for number, result in zip(pending_numbers, results):
            if isinstance(result, str):
                dropped[result] += 1
                continue
            ids, mask = result
            writer.write(ids, mask)
            tokens += ids.size
            trainable += int(mask.sum())
            content = (content + record_digest(number, ids, mask)) % (1 << 128)
        if progress is not None:
            progress(len(pending_rows))
        pending_rows.clear()
        pending_numbers.clear()

    writer = ShardWriter(part, backend)
    try:
        for number, row in table.read(task.lo - offset, task.hi - offset):
            rows_in += 1
            pending_rows.append(row)
            pending_numbers.append(number + offset)
            if len(pending_rows) >= _ENCODE_ROWS:
                flush()
        if pending_rows:
            flush()
        shard = writer.close()
        os.replace(part, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(part)
        raise
    return {
        "shard": {**shard, "file": os.path.basename(final)},
        "rows_in": rows_in,
        "dropped": dict(dropped),
        "truncated": fmt.truncated,
        "tokens": tokens,
        "trainable_tokens": trainable,
        "content": content,
    }


def _worker(task, slot: int) -> dict:
    """One task in a pool process (or inline), on the parent's table: its line index is small, and a
    re-scan would read the whole input."""
    c = _common

    def progress(n):
        _progress[slot] += n

    return tokenize_task(task, c["table"], 0, c["record"], c["backend"], c["tokenizer_files"], c["tmp"], progress)


def _init_worker(progress, common, env) -> None:
    global _progress, _common
    _progress, _common = progress, common
    take_environment(env)
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


def _start_method() -> str:
    """The loader's rule (``engine/workers.py``: fork only where that is safe), and no fork while this
    process holds a Ray connection (its gRPC threads' locks, copied mid-use into a forked child, hang
    it). The tokenizer's own threads count too: a tokenizer that already ran here makes forkserver."""
    ray = sys.modules.get("ray")
    ray_on = ray is not None and getattr(ray, "is_initialized", lambda: False)()
    return start_method(unsafe="a Ray connection is open" if ray_on else None)


def run_tasks(tasks: list, common: dict, num_workers: int | None, show_progress: bool, total: int) -> tuple[list[dict], int]:
    """Run every task on a pool of ``num_workers`` processes (inline for 0 or 1, or one task).

    ``common``: ``record``, ``backend``, ``table``, ``tokenizer_files`` and ``tmp``, given once to each process.
    Returns the results in task order and the number of processes used. The error of the first bad
    row in input order is raised here (whichever worker hits its bad row first), and the pool's other
    workers are terminated.
    """
    from tqdm import tqdm

    method = _start_method()
    # Every worker loads the tokenizer: its class's module (transformers', over a second of import) is
    # imported once by the forkserver where this pool starts it, not once a worker.
    tok = cached_tokenizer(common["record"], common["tokenizer_files"])
    ctx = get_context(method, [type(tok).__module__])
    global _progress, _common
    workers = max(1, min(cpu_count() if num_workers is None else num_workers, len(tasks)))
    progress = _progress = ctx.Array("q", len(tasks), lock=False)
    _common = common
    bar = tqdm(total=total, unit="rows", disable=not show_progress, file=sys.stderr, smoothing=0.1)
    try:
        if workers == 1:
            results = []
            for i, t in enumerate(tasks):
                results.append(_worker(t, i))
                bar.update(sum(progress) - bar.n)
        else:
            # (A pool starts workers for as long as it runs: none of them may import the calling script.)
            with without_main() if method != "fork" else contextlib.nullcontext(), \
                    ctx.Pool(workers, initializer=_init_worker,
                             initargs=(progress, common, None if method == "fork" else dict(os.environ))) as pool:
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
        _common = None
    return results, workers
