"""Starting, talking to and ending worker processes: the part every engine with workers shares.

**How a worker starts.** ``fork`` copies the parent as it is, which is fast (nothing to pickle, no
interpreter to start) and safe only in a process that runs no other thread: a thread holding a
lock at the moment of the fork leaves that lock held forever in the child. So a worker is forked
only when this process runs no thread but the main one and no native thread either (JAX's backend,
an initialized CUDA, any thread a library started since the loader was imported; a source can
say it is unsafe too). Otherwise workers start by ``forkserver`` (``spawn`` where there is none):
a clean server process, started once, forks them. They receive the dataset pickled with
cloudpickle, so maps and filters defined in the training script travel by value and the script
itself is never imported in a worker (an unguarded script does not run again). A dataset that
cannot be pickled is named in the error. ``PORTABLE_LOADER_START_METHOD`` overrides the choice.

**How a worker is heard.** Each worker has its own :class:`~portable_loader.engine.channel.Channel`,
whose worker end only the worker holds: a worker that dies is noticed at the next read or write
(end-of-file, a broken pipe), never waited for. A worker notices its parent's death through
multiprocessing's parent sentinel, and by its parent pid while it waits for work.

Example:
    >>> ctx, method = context([])
    >>> method in ("fork", "forkserver", "spawn")
    True
    >>> proc, chan = launch(ctx, method, _echo, (), "portable_loader-doc")
    >>> chan.send(("hi",)); chan.recv()[0]
    ('hi',)
    >>> end([proc], [chan])
    >>> proc.exitcode
    0
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import multiprocessing.spawn
import os
import select
import signal
import sys
import threading
import time
import weakref

from portable_loader.engine.channel import Channel, pair
from portable_loader.errors import UnpicklableError, WorkerError

__all__ = ["context", "end", "fork_hazard", "launch", "load", "receive", "start_method", "take_environment", "without_main",
           "worker_setup", "worker_tasks"]

_POLL_S = 0.2
_JOIN_S = 2.0  # per stage of a worker's end: after its channel closes, then after SIGTERM
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# Signals a scheduler or a parent sends to end a process. A forked worker inherits the parent's
# handlers for them, Python's and C's alike: jax.distributed installs a C++ SIGTERM handler (its
# preemption notice) that swallows the signal, so a terminate() would not end the worker.
_RESET_SIGNALS = [getattr(signal, n) for n in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
                  if hasattr(signal, n)]
_launching = threading.Lock()


_FORK_SAFE_THREADS = ("jemalloc_bg_thd",)  # Arrow's allocator: it re-creates its thread after a fork


def _native_threads() -> int:
    """Threads of this process that Python's ``threading`` does not know of, less those of libraries
    known to survive a fork (-1: cannot tell)."""
    try:
        names = []
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
    except OSError:
        return -1
    return sum(name not in _FORK_SAFE_THREADS for name in names) - threading.active_count()


_NATIVE_AT_IMPORT = _native_threads()  # numpy's BLAS pool: started at its import, fork-safe


def fork_hazard(sources=()) -> str | None:
    """Why forking this process now would be unsafe, or None.

    Example:
        >>> import threading
        >>> stop = threading.Event(); t = threading.Thread(target=stop.wait, name="doc-thread"); t.start()
        >>> print(fork_hazard())
        threads are running (...doc-thread...): a fork copies their locks in whatever state they are
        >>> stop.set(); t.join()
    """
    for source in sources:
        hazard = getattr(source, "fork_hazard", None)
        if hazard:
            return hazard
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread() and t.is_alive()]
    if threading.current_thread() is not threading.main_thread():
        others.insert(0, f"this loader runs in thread {threading.current_thread().name!r}")
    if others:
        return f"threads are running ({', '.join(others)}): a fork copies their locks in whatever state they are"
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is not None and getattr(bridge, "_backends", None):  # (an import alone starts no thread)
        return "JAX's backend is running, and with it JAX's threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialized in this process"
    native = _native_threads()
    if native > max(_NATIVE_AT_IMPORT, 0):
        return f"{native - max(_NATIVE_AT_IMPORT, 0)} native threads started since portable_loader was imported"
    return None


def start_method(sources=(), unsafe: str | None = None) -> str:
    """How to start worker processes reading ``sources`` from this thread, now:
    ``PORTABLE_LOADER_START_METHOD`` if set, else fork where nothing makes it unsafe (``fork_hazard``,
    or the caller's own reason ``unsafe``), else forkserver (spawn where there is none).

    Example:
        >>> start_method(unsafe="a Ray connection is open") in ("forkserver", "spawn")
        True
    """
    methods = mp.get_all_start_methods()
    forced = os.environ.get("PORTABLE_LOADER_START_METHOD")
    if forced:
        if forced not in methods:
            raise ValueError(f"PORTABLE_LOADER_START_METHOD={forced!r}: this platform offers {methods}")
        return forced
    if "fork" in methods and unsafe is None and fork_hazard(sources) is None:
        return "fork"
    return "forkserver" if "forkserver" in methods else "spawn"


# What the forkserver imports once, so that each worker it forks starts with the package already
# imported (a third of a second a worker on 2 cores). A process has one forkserver, set up by
# whichever pool starts it first: the loader's and precache's pools both name the same modules.
PRELOAD = ["portable_loader.engine.workers", "portable_loader.engine.processes", "portable_loader.precache.engine"]


def get_context(method: str, preload: tuple[str, ...] | list[str] = ()):
    """The multiprocessing context for ``method``, its forkserver (where that starts it) preloading
    ``PRELOAD`` and the caller's ``preload`` (what each of its workers would import otherwise).

    Example:
        >>> get_context("spawn").get_start_method()
        'spawn'
        >>> get_context("forkserver", ["json"]).get_start_method()
        'forkserver'
    """
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([*PRELOAD, *preload])
    return ctx


def context(sources):
    """``(multiprocessing context, start method)`` for workers reading ``sources`` from this thread, now."""
    method = start_method(sources)
    return get_context(method), method


def pickled(what: str, obj) -> bytes:
    """``obj`` as cloudpickle bytes for a worker; the error names ``what`` and the innermost part that fails."""
    import cloudpickle  # (grain's dependency) only where workers start without fork

    try:
        return cloudpickle.dumps(obj)
    except Exception as e:  # noqa: BLE001 - any pickling failure: say which object
        culprit = _unpicklable_part(obj)
        where = f" (the part that fails: {culprit!r:.300})" if culprit is not None and culprit is not obj else ""
        raise UnpicklableError(
            f"{what} cannot be sent to the loader's worker processes{where}: {type(e).__name__}: {e}. Workers start by "
            "forkserver here (forking this process is unsafe; see docs/performance.md): make it picklable, or set "
            "PORTABLE_LOADER_START_METHOD=fork if you know the fork is safe"
        ) from e


def _unpicklable_part(obj, depth: int = 0):
    """The deepest attribute (or item) of ``obj`` that cloudpickle refuses, else None."""
    import cloudpickle

    try:
        cloudpickle.dumps(obj)
        return None
    except Exception:  # noqa: BLE001
        pass
    if depth < 8:
        parts = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
        if isinstance(obj, (list, tuple)):
            parts = list(obj)
        elif isinstance(obj, dict):
            parts = list(obj.values())
        for part in parts:
            found = _unpicklable_part(part, depth + 1)
            if found is not None:
                return found
    return obj


def load(value):
    """What :func:`launch` gave a worker: bytes from :func:`pickled` (forkserver, spawn), else the object."""
    if isinstance(value, bytes):
        import cloudpickle

        return cloudpickle.loads(value)
    return value


@contextlib.contextmanager
def without_main():
    """Start a forkserver/spawn child without importing the training script in it.

    multiprocessing re-imports ``__main__`` in such a child so that objects pickled by reference
    from it resolve; ours travel by value (cloudpickle), and a re-import would run an unguarded
    script's training loop again.

    Example:
        >>> with without_main():     # what a child started now is told to import first
        ...     sorted(k for k in multiprocessing.spawn.get_preparation_data("child") if "main" in k)
        []
    """
    spawn = multiprocessing.spawn
    original = spawn.get_preparation_data

    def prepare(name):
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    spawn.get_preparation_data = prepare
    try:
        yield
    finally:
        spawn.get_preparation_data = original


def launch(ctx, method: str, target, args: tuple, name: str):
    """Start ``target(chan, parent_pid, forked_from_main, *args)`` in a new process; ``(process, our channel)``.

    The worker's end of the channel is closed here once the worker has it, so only the worker holds
    it; a forked worker closes the parent's ends it inherited (its own one's included), so that each
    parent end too lives in the parent alone, and a worker reads end-of-file when its parent closes it.
    """
    ours, theirs = pair()
    from_main = threading.current_thread() is threading.main_thread()
    # A forkserver child inherits the server's environment, as it was when the server started: give it
    # ours as it is now (credentials, tokenizer settings set since).
    env = None if method == "fork" else dict(os.environ)
    proc = ctx.Process(target=_bootstrap, args=(target, theirs, os.getpid(), method == "fork" and from_main, env, *args),
                       name=name, daemon=True)
    try:
        with _launching, (without_main() if method != "fork" else contextlib.nullcontext()):
            _parent_ends.add(ours)
            proc.start()
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, ours


_parent_ends: "weakref.WeakSet[Channel]" = weakref.WeakSet()  # this process's ends of its workers' channels


def take_environment(env: dict | None) -> None:
    """In a worker: make ``env``, the parent's environment when it started the worker, this process's.

    A forkserver child inherits the server's environment as it was when the server started
    (credentials, tokenizer settings set since are missing); None: a forked child, which has it already.

    Example:
        >>> saved = dict(os.environ)
        >>> take_environment({**saved, "DOC_EXAMPLE": "1"}); os.environ["DOC_EXAMPLE"]
        '1'
        >>> take_environment(saved); "DOC_EXAMPLE" in os.environ
        False
    """
    if env is not None:
        os.environ.clear()
        os.environ.update(env)


def _bootstrap(target, chan: Channel, parent: int, forked_from_main: bool, env, *args) -> None:
    take_environment(env)
    if os.getppid() == parent:  # forked: the parent's ends came along
        for end in list(_parent_ends):
            end.close()
    target(chan, parent, forked_from_main, *args)


def _die_with_forking_thread() -> bool:
    """Linux: have the kernel SIGKILL this process when the thread that forked it ends."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def worker_setup(forked_from_main: bool) -> None:
    """A worker's signals: Ctrl-C is the parent's, the rest default, and die with the parent.

    A parent killed by SIGKILL runs no hook: the worker must notice by itself. PDEATHSIG is
    immediate but fires when the *thread* that forked us ends, so it is set only for a fork from
    the main thread; :func:`worker_tasks` watches the parent otherwise.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it closes the workers
    for sig in _RESET_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    if forked_from_main:
        _die_with_forking_thread()


def worker_tasks(chan: Channel, parent: int):
    """The messages ``(task, fds)`` on a worker's channel, until it closes or ``parent`` is gone."""
    forked = os.getppid() == parent
    watch = [chan.sock]
    parent_proc = mp.parent_process()
    if parent_proc is not None and parent_proc.sentinel is not None:
        watch.append(parent_proc.sentinel)
    while True:
        readable, _, _ = select.select(watch, [], [], _POLL_S)
        if chan.sock in readable:
            try:
                task, fds = chan.recv()
            except (EOFError, OSError):  # the parent closed us, or is gone
                return
            if task is None:
                return
            yield task, fds
        elif readable or (forked and os.getppid() != parent):
            return


def receive(chan: Channel, proc, what: str):
    """The next message from worker ``proc`` (``what`` names it); ``WorkerError`` if it died."""
    try:
        return chan.recv()[0]
    except (EOFError, OSError):
        pass
    _reap([proc])
    code = proc.exitcode
    why = f" (signal {signal.Signals(-code).name})" if code is not None and code < 0 and -code in signal.valid_signals() else ""
    raise WorkerError(f"{what} (pid {proc.pid}) was terminated unexpectedly with exit code {code}{why}") from None


def end(procs: list, chans: list) -> None:
    """Close every channel (a worker reads end-of-file and stops), then join, SIGTERM and SIGKILL what is left."""
    for chan in chans:
        try:
            chan.send(None)  # stop: a worker forked by another loader may hold this end open too
        except OSError:  # it is gone already
            pass
        chan.close()
    _reap(procs)
    for stop in ("terminate", "kill"):
        alive = [p for p in procs if p.exitcode is None]
        for p in alive:
            getattr(p, stop)()
        _reap(alive)


def _reap(procs) -> None:
    """Wait up to ``_JOIN_S`` for ``procs`` to end, reaping each as soon as it has.

    Not ``Process.join``: under fork a worker's sentinel is a pipe that the workers forked after it
    hold open too, so a join would wait out its timeout for a worker long dead.
    """
    deadline = time.monotonic() + _JOIN_S
    while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.005)


def _echo(chan: Channel, parent: int, forked_from_main: bool) -> None:
    worker_setup(forked_from_main)
    for msg, _ in worker_tasks(chan, parent):
        chan.send(msg)
