"""How loaders end: ``with`` blocks, ``close()``, garbage collection, and an exit hook for the rest.

A training script with a step limit usually just ends without closing its loader. Left alone, its
prefetch thread would still be building device arrays while JAX's own exit handler tears down the
backend and the distributed client (the process aborts), and its worker processes would be left to
``multiprocessing``'s exit handler. So every loader object that owns a thread or workers is
registered here, through a weak reference (registration never keeps a loader alive), and one exit
hook closes whatever is still open before the frameworks' hooks run.

Example:
    >>> class Thing(Closing):
    ...     def __init__(self):
    ...         self.closed = False
    ...         close_at_exit(self)
    ...     def close(self):
    ...         self.closed = True
    >>> with Thing() as t:
    ...     pass
    >>> t.closed
    True
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import threading
import uuid
import weakref

__all__ = ["Closing", "close_at_exit", "close_all", "hook_last", "in_finalizer", "join_thread", "pid_alive", "private_path",
           "sweep_stale"]

# Live closables and the order they were registered in: the exit hook closes the newest first, so an
# adapter (registered after the iterator it creates) stops its thread before the iterator's workers.
_live: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
_order = itertools.count()
_lock = threading.Lock()
_finalizing = threading.local()  # depth of close() calls from __del__ on this thread (in_finalizer)
# Threads told to stop by a close() that could not wait for them (in_finalizer): the exit hook joins them.
_unjoined: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_EXIT_JOIN_S = 5.0  # a thread finishing the batch in hand


class Closing:
    """``with`` support and a last-resort ``close()`` at garbage collection.

    ``close()`` must be safe to call twice: ``with`` closes, then garbage collection calls it again.

    Example:
        >>> class Res(Closing):
        ...     closed = False
        ...     def close(self):
        ...         if not self.closed:
        ...             self.closed = True
        ...             print("closed")
        >>> with Res() as r:
        ...     pass
        closed
        >>> del r   # collected: close() runs again and does nothing
    """

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # The thread-local is bound at definition: an object collected at interpreter shutdown runs this
    # after the module's globals have been set to None.
    def __del__(self, _finalizing=_finalizing):
        _finalizing.depth = getattr(_finalizing, "depth", 0) + 1
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass
        finally:
            _finalizing.depth -= 1


def in_finalizer() -> bool:
    """Whether this thread is running a ``close()`` from garbage collection.

    Such a ``close()`` must not wait for other threads: a collection can run inside ``threading``'s
    own bookkeeping (a new thread starting), where joining a finished thread takes a lock that is
    already held, and the process hangs. Closers signal their threads to stop and return.

    Example:
        >>> in_finalizer()
        False
    """
    return getattr(_finalizing, "depth", 0) > 0


def join_thread(thread: threading.Thread, timeout: float) -> None:
    """Wait up to ``timeout`` s for ``thread``, already told to stop; from a finalizer, leave that to
    the exit hook instead (see :func:`in_finalizer`).

    A loader dropped without ``close()`` (a training function that returns) is closed by garbage
    collection, which must not wait: its thread may then be finishing a batch inside native code (an
    XLA transfer). Were it still there when the interpreter finalizes, the C++ runtime would unwind it
    and abort the process (``terminate called ... FATAL: exception not rethrown``) after the script's
    work is done. The exit hook joins it before JAX's exit handler and finalization.

    Example:
        >>> stop = threading.Event(); t = threading.Thread(target=stop.wait); t.start()
        >>> stop.set(); join_thread(t, timeout=5); t.is_alive()
        False
    """
    if in_finalizer():
        with _lock:
            _unjoined.add(thread)
    else:
        thread.join(timeout=timeout)


def close_at_exit(obj) -> None:
    """Have ``obj.close()`` called at interpreter exit if ``obj`` is still alive then (weakly held).

    Example:
        >>> import weakref
        >>> class Res:
        ...     def close(self):
        ...         print("closed")
        >>> r = Res()
        >>> close_at_exit(r)
        >>> close_all()           # what the exit hook runs: r is still alive, so it is closed
        closed
        >>> ref = weakref.ref(r); del r
        >>> ref() is None         # the registration did not keep it alive
        True
    """
    with _lock:
        _live[obj] = next(_order)
    hook_last()


def hook_last() -> None:
    """(Re-)register the exit hook so that it is the last one registered, hence the first to run.

    ``atexit`` runs hooks last-in first-out. JAX registers its own at import (``clean_up``: it clears
    the backends and shuts down the distributed client) and when its backend starts; torch and
    multiprocessing register theirs at import (``multiprocessing``'s terminates daemonic workers and
    joins them with no timeout). Registering again whenever a loader is created or starts a thread
    or workers keeps ours ahead of every hook installed before that moment, which includes the
    frameworks a loader needs. ``threading._register_atexit`` would run even earlier, but it runs
    before non-daemon threads are joined: a user thread still iterating a loader would see it closed
    under its feet. Plain ``atexit`` runs after those threads have finished.
    """
    atexit.unregister(close_all)
    atexit.register(close_all)


def close_all() -> None:
    """Close every registered object still alive, newest first, then wait for the threads that closes
    from garbage collection could not wait for (:func:`join_thread`); errors are ignored (we are exiting).

    Example:
        >>> close_all()   # what the exit hook does
    """
    with _lock:
        live = sorted(_live.items(), key=lambda kv: -kv[1])
    for obj, _ in live:
        try:
            obj.close()
        except Exception:  # noqa: BLE001 - one loader failing to close must not keep the others open
            pass
    with _lock:
        threads, _ = list(_unjoined), _unjoined.clear()
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(timeout=_EXIT_JOIN_S)


# --- scratch files of one process -----------------------------------------------------------------


def _remove_path(path: str, owner: int) -> None:
    if os.getpid() != owner:  # a forked child inherits the finalizer: only the owner removes
        return
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def private_path(base: str, prefix: str, owner=None) -> str:
    """A new path ``base/prefix{pid}-{random}`` that this process owns: removed (file or folder) when
    ``owner`` is garbage-collected, or at exit; one left by a killed process is removed by the next
    call with the same ``base`` and ``prefix`` (:func:`sweep_stale`).

    Example:
        >>> import tempfile
        >>> path = private_path(tempfile.gettempdir(), "portable_loader-doc-")
        >>> os.path.basename(path).startswith(f"portable_loader-doc-{os.getpid()}-")
        True
    """
    if (base, prefix) not in _swept:
        _swept.add((base, prefix))
        sweep_stale(base, prefix)
    path = os.path.join(base, f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:12]}")
    if owner is None:
        atexit.register(_remove_path, path, os.getpid())
    else:
        weakref.finalize(owner, _remove_path, path, os.getpid())  # also runs at exit
    return path


_swept: set = set()


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (zombies included); used for stale temp dirs and workers.

    Example:
        >>> pid_alive(os.getpid())
        True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(base: str, prefix: str) -> list[str]:
    """Remove ``base/prefix{pid}-*`` of this user whose process is gone (a ``kill -9`` runs no cleanup).

    Example:
        >>> os.makedirs("shm/portable_loader-tokenized-99999999-0123456789ab")   # no process has that pid
        >>> os.makedirs(f"shm/portable_loader-tokenized-{os.getpid()}-0123456789ab")   # this process's: kept
        >>> sweep_stale("shm", "portable_loader-tokenized-")
        ['shm/portable_loader-tokenized-99999999-0123456789ab']
        >>> os.listdir("shm") == [f"portable_loader-tokenized-{os.getpid()}-0123456789ab"]
        True
    """
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        pid = name[len(prefix) :].split("-", 1)[0] if name.startswith(prefix) else ""
        path = os.path.join(base, name)
        try:
            mine = os.lstat(path).st_uid == os.geteuid()
        except OSError:
            continue
        if pid.isdigit() and mine and not pid_alive(int(pid)):
            _remove_path(path, os.getpid())
            removed.append(path)
    return removed
