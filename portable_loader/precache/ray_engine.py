"""``engine="ray"``: the precache plan's tasks run as Ray tasks, one CPU each, anywhere on a cluster.

The driver plans, shows progress and collects counts; it never reads the rows. Each task opens its
own file from storage (so the input, the tokenizer and ``out`` must be at the same paths on every
node: a shared filesystem), reads its row range, tokenizes it and writes its shard into the run's
temporary folder under a temporary name, then renames it. A task whose node is lost is rerun
elsewhere (``max_retries``) and overwrites its shard with the same bytes, so the cache is the one the
local engine builds. On the first error in input order, or Ctrl-C, every task is cancelled and
waited for before the caller removes the temporary folder.

Ray is imported only here, and only when a run needs it (a cache hit never connects).

Example:
    >>> import portable_loader as pl
    >>> pl.precache("data/", tokenizer="tok/", format="text", out="/shared/cache",
    ...             engine="ray", ray_address="head:6379")  # doctest: +SKIP
"""

from __future__ import annotations

import os
import socket
import sys
import time

from portable_loader.errors import PortableLoaderError
from portable_loader.io.tables import open_input
from portable_loader.precache.engine import tokenize_task

# A lost node's tasks are rerun; a task that fails by itself (a bad row) raises at once, not retried.
_MAX_RETRIES = 3
_CONNECT_SECONDS = 5.0
_tables: dict = {}  # per worker process: the last whole-file input opened (a JSON list is parsed once)


def _ray_task(task, config: dict, tokenizer_files: str, tmp: str) -> dict:
    """What runs on a node: open the task's file, tokenize its rows into its shard."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one task per CPU
    return tokenize_task(task, _open(task), task.lo - task.file_lo, config, tokenizer_files, tmp)


def _open(task):
    """The task's file as a table. A JSONL or text file opens at the task's seek point (from the
    driver's listing), never scanned again; other kinds open whole, and are kept for the next task."""
    if task.seek is not None:
        return open_input(task.file, seek=task.seek)
    stat = os.stat(task.file)
    key = (task.file, stat.st_size, stat.st_mtime_ns)
    if key not in _tables:
        _tables.clear()
        _tables[key] = open_input(task.file)
    return _tables[key]


def _connect(address: str | None):
    """Import Ray and connect (or reuse this process's connection); a clear error within seconds."""
    try:
        import ray
    except ImportError:
        raise PortableLoaderError(
            "engine='ray' needs Ray: pip install 'portable-loader[ray]' (or 'ray>=2.9')"
        ) from None
    if ray.is_initialized():
        return ray
    if address not in (None, "auto") and "://" not in address:
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=_CONNECT_SECONDS).close()
        except (OSError, ValueError) as e:
            raise PortableLoaderError(f"cannot reach the Ray cluster at {address!r}: {e}") from None
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise PortableLoaderError(f"cannot connect to the Ray cluster at {address!r}: {e}") from None
    return ray


def run_ray_tasks(tasks: list, config: dict, tokenizer_files: str, tmp: str, address: str | None,
                  show_progress: bool, total: int) -> tuple[list[dict], int]:
    """Run every task on the Ray cluster at ``address``: results in task order, and the cluster's CPUs.

    Example:
        >>> results, cpus = run_ray_tasks(plan, config, key, tmp, "auto", False, rows)  # doctest: +SKIP
    """
    from tqdm import tqdm

    if any(t.file is None for t in tasks):
        raise PortableLoaderError(
            "engine='ray' reads the input from storage on every node, and an in-memory datasets.Dataset "
            "has no file: save it with save_to_disk() and pass that folder"
        )
    ray = _connect(address)
    remote = ray.remote(num_cpus=1, max_retries=_MAX_RETRIES, retry_exceptions=False)(_ray_task)
    config_ref = ray.put(config)
    refs = [remote.remote(t, config_ref, tokenizer_files, tmp) for t in tasks]
    index = {r: i for i, r in enumerate(refs)}
    results: list = [None] * len(refs)
    bar = tqdm(total=total, unit="rows", disable=not show_progress, file=sys.stderr, smoothing=0.1)
    try:
        waiting, first = list(refs), 0
        while first < len(refs):
            done, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=0.2)
            for ref in done:
                results[index[ref]] = ref
                bar.update(tasks[index[ref]].hi - tasks[index[ref]].lo)
            # The earliest failed task in input order is the one reported, whichever failed first.
            while first < len(refs) and results[first] is not None:
                results[first] = _get(ray, refs[first])
                first += 1
    except BaseException:
        _cancel(ray, refs)
        raise
    finally:
        bar.close()
    # A task attempt killed with its node leaves its partial shard under a temporary name.
    for name in os.listdir(tmp):
        if name.endswith(".part"):
            os.remove(os.path.join(tmp, name))
    return results, int(ray.cluster_resources().get("CPU", 0))


def _get(ray, ref):
    """The task's result, or the task's own exception (a BadRowError names its file and line)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise


def _cancel(ray, refs: list) -> None:
    """Cancel every task and wait (briefly) for them to end, so none writes into a removed folder."""
    for ref in refs:
        try:
            ray.cancel(ref, force=True)
        except Exception:  # already finished, or its worker already gone
            pass
    deadline = time.monotonic() + 30
    pending = list(refs)
    while pending and time.monotonic() < deadline:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
