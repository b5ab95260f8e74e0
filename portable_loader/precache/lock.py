"""Per-cache advisory locks that say who holds them and leave no file behind.

Concurrent runs building one cache wait for each other instead of tokenizing twice (correctness
rests on the atomic publish, not on the lock; the lock only saves the work). The lock is an
``flock`` on ``<out>/.<name>.lock``. Its holder unlinks the file *while still holding it*; a waiter
that then gets the lock checks that the file it locked is still the one at that path, and starts over
if not, so two runs never both believe they hold it, and no lock file outlives its last user.

Example:
    >>> with locked(".chat-0123.lock"):   # build or remove the cache here
    ...     os.path.exists(".chat-0123.lock")
    True
    >>> os.path.exists(".chat-0123.lock")   # no file left behind
    False
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import time

__all__ = ["locked", "sweep_locks"]


def _holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
    except OSError:
        return "another process"


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


@contextlib.contextmanager
def locked(path: str, what: str = "this cache"):
    """Hold the exclusive lock ``path`` for the block; say on stderr when it has to wait, and for whom.

    Example:
        >>> with locked("cache/.text-0123.lock", "text-0123"):
        ...     with open("cache/.text-0123.lock") as f:
        ...         print(f.read())                 # who holds it: what a waiting run shows
        pid ... on ... since ...
    """
    announced = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not announced:
                    print(
                        f"waiting for {what}: locked by {_holder(fd)} ({path}); "
                        "continuing when it is released",
                        file=sys.stderr, flush=True,
                    )
                    announced = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            if not _same_file(fd, path):
                continue  # the previous holder removed this file: lock the current one instead
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}".encode(), 0)
            try:
                yield
            finally:
                # Unlinked before unlocking: a waiter that wins the lock next sees a changed inode.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            return
        finally:
            os.close(fd)  # also releases the flock


def sweep_locks(out: str) -> list[str]:
    """Remove the lock files in ``out`` that nobody holds (left by versions that never removed them).

    Each is taken without waiting and unlinked while held, as :func:`locked` does, so a run that is
    waiting on it starts over on a fresh file; a held lock is left alone.

    Example:
        >>> os.makedirs("out", exist_ok=True)
        >>> open("out/.text-3973b7133c149c2dc0df.lock", "w").close()   # left by a run of an old version
        >>> sweep_locks("out")
        ['.text-3973b7133c149c2dc0df.lock']
        >>> with locked("out/.chat-0123.lock"):
        ...     sweep_locks("out")                # a held lock is left alone
        []
    """
    removed = []
    for entry in os.listdir(out):
        if not (entry.startswith(".") and entry.endswith(".lock")):
            continue
        path = os.path.join(out, entry)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(fd, path):
                os.unlink(path)
                removed.append(entry)
        except OSError:  # held by a run in progress
            pass
        finally:
            os.close(fd)
    return removed
