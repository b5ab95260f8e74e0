"""Atomic publishing: shards go into a uniquely named temp directory beside the target, then one rename.

Readers see either no cache or a complete one, also after ``kill -9``. Temp (``.tmp-*``) and trash
(``.trash-*``) directories carry the host and pid of their run, so that a later run on the same host
removes those whose process is gone.

Example:
    >>> os.makedirs("out")
    >>> tmp = temp_dir("out", "chat-0123")
    >>> with open(os.path.join(tmp, "manifest.json"), "w") as f:   # ... the shards and the manifest ...
    ...     _ = f.write("{}")
    >>> publish(tmp, "out/chat-0123"), os.listdir("out")
    (True, ['chat-0123'])
    >>> publish(temp_dir("out", "chat-0123"), "out/chat-0123"), os.listdir("out")   # another run was first
    (False, ['chat-0123'])
"""

from __future__ import annotations

import os
import shutil
import socket
import uuid

from portable_loader.lifecycle import pid_alive

_HOST = socket.gethostname().replace("-", "_")


def fsync_path(path: str) -> None:
    """fsync a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_dir(out: str, name: str) -> str:
    """A fresh, uniquely named directory beside the target: ``.tmp-<name>-<host>-<pid>-<uuid>``."""
    path = os.path.join(out, f".tmp-{name}-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(path)
    return path


def staging_dir(url: str) -> str:
    """The local folder where caches bound for ``url`` (a bucket prefix) are built and locked.

    Example:
        >>> staging_dir("s3://b/caches") == staging_dir("s3://b/caches/")
        True
    """
    import hashlib
    import tempfile

    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"portable_loader-staging-{os.getuid()}", digest)


def clean_stale(out: str, name: str) -> list[str]:
    """Remove temp and trash directories that runs killed on this host left behind."""
    removed = []
    for entry in os.listdir(out):
        for prefix in (f".tmp-{name}-{_HOST}-", f".trash-{name}-{_HOST}-"):
            if entry.startswith(prefix):
                pid = entry[len(prefix) :].split("-", 1)[0]
                if pid.isdigit() and not pid_alive(int(pid)):
                    shutil.rmtree(os.path.join(out, entry), ignore_errors=True)
                    removed.append(entry)
    return removed


def publish(tmp: str, final: str, replace: bool = False) -> bool:
    """Rename ``tmp`` to ``final`` atomically. False (and ``tmp`` removed) if another run won."""
    fsync_path(tmp)
    if replace and os.path.exists(final):
        out, name = os.path.split(final)
        trash = os.path.join(out, f".trash-{name}-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.rename(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:
        if not os.path.isdir(final):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    fsync_path(os.path.dirname(final) or ".")
    return True
