"""``engine="ray"``: the precache plan's tasks run as Ray tasks, one CPU each, anywhere on a cluster.

The driver plans, shows progress and collects counts; it never reads the rows. Each task opens its
own file from storage (a shared filesystem, at the same path on every node, or a bucket), at the
byte where the driver's listing found its first rows, reads its row range and tokenizes it. Its
shard goes to ``dest``: into the run's temporary folder (shared filesystem) under a temporary name,
then renamed; or, for a bucket prefix, into a local temporary file on the node, then uploaded by
the task itself (the driver uploads only the manifest, last). A task whose node is lost is rerun
elsewhere (``max_retries``) and overwrites its shard with the same bytes, so the cache is the one the
local engine builds. Tasks are submitted in input order, two per CPU in flight. On the first error
in input order no further task starts and those in flight are waited for; on Ctrl-C they are
cancelled; then the caller removes the temporary files.

Each task attempt reports its start to the run's ledger (a small named actor,
``portable_loader-precache-<random>``, on the driver's node) and returns its node's id, so
the progress bar and the summary say which node ran what and how many tasks were rerun.

Ray is imported only here, and only when a run needs it (a cache hit never connects).

Example:
    >>> import portable_loader as pl
    >>> from portable_loader.precache import sample_args
    >>> pl.precache(**sample_args(), out="cache", engine="ray", ray_address="head:6379")   # a hit: no connection
    'cache/chat-...'
    >>> pl.precache(**sample_args(), out="/shared/cache", engine="ray", ray_address="head:6379")   # needs a Ray cluster  # doctest: +SKIP
    '/shared/cache/chat-...'
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
import warnings
from collections import Counter

from portable_loader.errors import PortableLoaderError
from portable_loader.io.remote import filesystem, is_url, join
from portable_loader.io.tables import open_input
from portable_loader.precache.engine import tokenize_task

# A lost node's tasks are rerun; a task that fails by itself (a bad row) raises at once, not retried.
_MAX_RETRIES = 3
_CONNECT_SECONDS = 5.0
_tables: dict = {}  # per worker process: the last whole-file input opened (a JSON list is parsed once)


def _ray_task(task, record, backend: str, tokenizer_files: str, dest: str, storage_options: dict | None, ledger) -> dict:
    """What runs on a node: open the task's file, tokenize its rows into its shard at ``dest``."""
    import ray

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one task per CPU
    node = ray.get_runtime_context().get_node_id()
    # Not waited for: a task blocked in ray.get lends its CPU out, and Ray would start another worker.
    ledger.started.remote(task.index, node)
    table, offset = _open(task, storage_options), task.lo - task.file_lo
    if not is_url(dest):
        return {**tokenize_task(task, table, offset, record, backend, tokenizer_files, dest), "node": node}
    local = tempfile.mkdtemp(prefix="portable_loader-task-")
    try:
        result = tokenize_task(task, table, offset, record, backend, tokenizer_files, local)
        name = result["shard"]["file"]
        fs, path = filesystem(dest, storage_options)
        fs.put_file(os.path.join(local, name), join(path, name))  # one PUT: whole, or absent
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return {**result, "node": node}


def _open(task, storage_options: dict | None):
    """The task's file as a table. A JSONL or text file opens at the task's seek point (from the
    driver's listing), never scanned again; other kinds open whole, and a local one is kept for the
    worker's next task."""
    so = storage_options if is_url(task.file) else None
    if task.seek is not None or is_url(task.file):
        return open_input(task.file, storage_options=so, seek=task.seek)
    stat = os.stat(task.file)
    key = (task.file, stat.st_size, stat.st_mtime_ns)
    if key not in _tables:
        _tables.clear()
        _tables[key] = open_input(task.file)
    return _tables[key]


class _Ledger:
    """The run's record of task attempts: ``(task index, node id)`` for each start, in arrival order."""

    def __init__(self):
        self.starts: list = []

    def started(self, index: int, node: str) -> None:
        self.starts.append((index, node))

    def read(self, since: int) -> list:
        return self.starts[since:]


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


def run_ray_tasks(tasks: list, record, backend: str, tokenizer_files: str, dest: str, address: str | None,
                  show_progress: bool, total: int, storage_options: dict | None = None) -> tuple[list[dict], dict]:
    """Run every task on the Ray cluster at ``address``: rows tokenized by ``record`` (a
    :class:`~portable_loader.record_options.RecordOptions`) into ``backend`` shards at ``dest`` (a
    folder or a bucket prefix).

    Returns the results in task order and how it ran: ``num_workers`` (the cluster's CPUs),
    ``retried`` (task attempts started beyond the first of each task) and ``nodes`` (per node id, the
    attempts ``started`` there and the tasks ``finished`` there). ``retried`` and ``started`` are None
    (unknown) if the ledger was lost with the driver's node.

    Example:
        >>> from portable_loader.io import open_inputs
        >>> from portable_loader.precache import sample_args
        >>> from portable_loader.precache.plan import plan_tasks
        >>> from portable_loader.record_options import RecordOptions
        >>> args = sample_args()
        >>> table, record = open_inputs(args["input"]), RecordOptions(args["tokenizer"], args["format"])
        >>> plan = plan_tasks(table, rows_per_task=1000)
        >>> [(t.lo, t.hi) for t in plan]
        [(0, 1000), (1000, 2000)]
        >>> results, run = run_ray_tasks(plan, record, "arrow", "digest", "/shared/tmp", "auto", False, len(table))   # needs a Ray cluster  # doctest: +SKIP
        >>> run["retried"], sum(n["finished"] for n in run["nodes"].values()) == len(plan)   # needs a Ray cluster  # doctest: +SKIP
        (0, True)
    """
    from tqdm import tqdm

    if any(t.file is None for t in tasks):
        raise PortableLoaderError(
            "engine='ray' reads the input from storage on every node, and an in-memory datasets.Dataset "
            "has no file: save it with save_to_disk() and pass that folder"
        )
    ray = _connect(address)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # The ledger on the driver's node, the one node whose loss ends the build anyway; soft affinity
    # let Ray place it on another node, whose loss then lost every count.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    name = f"portable_loader-precache-{uuid.uuid4().hex[:12]}"  # ray.util.list_named_actors() lists it
    ledger = ray.remote(num_cpus=0, max_restarts=0)(_Ledger).options(name=name, scheduling_strategy=here).remote()
    remote = ray.remote(num_cpus=1, max_retries=_MAX_RETRIES, retry_exceptions=False)(_ray_task)
    record_ref = ray.put(record)
    # Tasks go out in input order, a window of two per CPU at a time: every CPU has its next task queued,
    # the driver holds few references, and a failed run has only the window's tasks left to end.
    window = 2 * max(1, int(ray.cluster_resources().get("CPU", 1)))
    refs: list = []  # submitted so far; refs[i] runs tasks[i]
    index: dict = {}
    results: list = [None] * len(tasks)
    starts: list = []
    waiting: list = []
    bar = tqdm(total=total, unit="rows", disable=not show_progress, file=sys.stderr, smoothing=0.1)
    try:
        first, polled = 0, 0.0
        while first < len(tasks):
            while len(refs) < len(tasks) and len(waiting) < window:
                ref = remote.remote(tasks[len(refs)], record_ref, backend, tokenizer_files, dest, storage_options, ledger)
                index[ref] = len(refs)
                refs.append(ref)
                waiting.append(ref)
            done, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=0.2)
            for ref in done:
                results[index[ref]] = ref
                bar.update(tasks[index[ref]].hi - tasks[index[ref]].lo)
            # The earliest failed task in input order is the one reported, whichever failed first.
            while first < len(refs) and results[first] is not None:
                results[first] = _get(ray, refs[first])
                first += 1
            if show_progress and time.monotonic() - polled > 1.0:
                polled = time.monotonic()
                starts += _read(ray, ledger, len(starts)) or []
                bar.set_postfix_str(f"tasks {len(refs) - len(waiting)}/{len(tasks)}, "
                                    f"retried {len(starts) - len({i for i, _ in starts})}", refresh=False)
        # A start is reported as the task begins, without waiting; one may still be on its way (as when
        # the ledger came up after the tasks did): wait a little for every finished task's start.
        deadline = time.monotonic() + 5
        while True:
            new = _read(ray, ledger, len(starts), patience=60)
            if new is None:  # the ledger is gone: what it recorded is unknown, not zero
                starts = None
                break
            starts += new
            if len({i for i, _ in starts}) == len(tasks) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        _cancel(ray, waiting)
        raise
    except BaseException:
        # A failed run lets the window's tasks end by themselves (each is one task's work): Ray can
        # crash the driver when a cancel races a task's completion (ray-project/ray#54798's kind).
        _settle(ray, waiting)
        raise
    finally:
        bar.close()
        ray.kill(ledger)
    if not is_url(dest):  # a task attempt killed with its node leaves its partial shard under a temporary name
        for entry in os.listdir(dest):
            if entry.endswith(".part"):
                os.remove(os.path.join(dest, entry))
    nodes = {n: {"started": k, "finished": 0} for n, k in Counter(n for _, n in starts or ()).items()}
    for r in results:
        nodes.setdefault(r["node"], {"started": 0 if starts is not None else None, "finished": 0})["finished"] += 1
    retried = None if starts is None else len(starts) - len({i for i, _ in starts})
    return results, {"num_workers": int(ray.cluster_resources().get("CPU", 0)), "retried": retried, "nodes": nodes}


def _read(ray, ledger, since: int, patience: float = 0.0) -> list | None:
    """Starts recorded since the ``since``-th; None if the ledger is unreachable (it only informs).
    A read that fails otherwise than by the ledger's death (a loaded cluster answers late, or has the
    actor briefly unavailable) is asked again for ``patience`` seconds."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return ray.get(ledger.read.remote(since), timeout=10)
        except ray.exceptions.ActorDiedError:  # the driver's node lost: the counts are informational
            return None
        except Exception as e:  # noqa: BLE001 - any other failure may pass: ask again while patient
            if time.monotonic() > deadline:
                if patience:
                    warnings.warn(f"precache on Ray: the tasks' start counts are unknown ({type(e).__name__}: {e})",
                                  RuntimeWarning, stacklevel=2)
                return None
            time.sleep(0.1)


def _get(ray, ref):
    """The task's result, or the task's own exception (a BadRowError names its file and line)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise


def _settle(ray, refs: list, seconds: float = 600) -> None:
    """Wait for the tasks to end by themselves (cancelled after ``seconds``), so none writes into a
    removed folder."""
    try:
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=seconds) if refs else ([], [])
    except Exception:  # the cluster itself failing: cancel what may still run
        pending = refs
    if pending:
        _cancel(ray, pending)


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
