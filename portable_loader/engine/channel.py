"""A worker's line to its parent: one Unix socket pair, framed messages, file descriptors on the side.

Each worker has its own socket pair, made just before the worker starts and closed in the parent
right after, so the worker's end lives in the worker alone. That makes a dead worker visible the
moment it dies: a read on the parent's end returns end-of-file (even in the middle of a message:
a pipe shared with ``multiprocessing.Queue`` blocked forever on the rest of a half-written batch)
and a write fails with ``BrokenPipeError``. Nothing here runs a thread: ``multiprocessing.Queue``'s
feeder thread could still hold a message when its process ended.

A message is a 12-byte header (payload length, number of descriptors) and a pickled payload; the
descriptors (shared-memory blocks, see :mod:`portable_loader.engine.blocks`) travel with the
header as ``SCM_RIGHTS`` ancillary data, so a block never needs a name anyone could leave behind.

Example:
    >>> import os
    >>> parent, child = pair()
    >>> r, w = os.pipe()
    >>> child.send(("hello", 42), fds=[r])
    >>> msg, fds = parent.recv()
    >>> msg, len(fds)
    (('hello', 42), 1)
    >>> child.close()
    >>> parent.recv()
    Traceback (most recent call last):
    ...
    EOFError: the other end closed
    >>> for fd in (r, w, *fds):
    ...     os.close(fd)
    >>> parent.close()
"""

from __future__ import annotations

import array
import os
import pickle
import select
import socket
import struct

__all__ = ["Channel", "pair"]

_HEADER = struct.Struct("<QI")
_MAX_FDS = 16
_SPACE = socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize)


def pair() -> tuple["Channel", "Channel"]:
    """Two connected channels: the parent's end and the worker's."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Channel(a), Channel(b)


class Channel:
    """One end of a socket pair: ``send(obj, fds)``, ``recv() -> (obj, fds)``, ``poll(timeout)``.

    Picklable for ``spawn`` and ``forkserver`` workers (the socket travels as a duplicated
    descriptor); under ``fork`` the child inherits it.
    """

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, obj, fds=()) -> None:
        """Send ``obj`` pickled, with ``fds`` (each stays open here: the receiver gets its own copies)."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.send_bytes(payload, fds)

    def send_bytes(self, payload: bytes, fds=()) -> None:
        head = _HEADER.pack(len(payload), len(fds))
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        data = memoryview(head + payload) if len(payload) < 65536 else None
        if data is None:  # large: the header with the descriptors first, then the payload as it is
            self._sendall(memoryview(head), ancillary)
            self._sendall(memoryview(payload), [])
        else:
            self._sendall(data, ancillary)

    def _sendall(self, data: memoryview, ancillary: list) -> None:
        sent = self.sock.sendmsg([data], ancillary)
        while sent < len(data):  # the descriptors went with the first bytes
            sent += self.sock.send(data[sent:])

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether a message (or end-of-file) can be read within ``timeout`` seconds."""
        readable, _, _ = select.select([self.sock], [], [], timeout)
        return bool(readable)

    def recv(self):
        """The next message ``(obj, fds)``; ``EOFError`` once the other end is gone."""
        payload, fds = self.recv_bytes()
        return pickle.loads(payload), fds

    def recv_bytes(self) -> tuple[bytearray, list]:
        head = bytearray()
        fds: list = []
        while len(head) < _HEADER.size:
            data, ancillary, _, _ = self.sock.recvmsg(_HEADER.size - len(head), _SPACE)
            if not data:
                _close_all(fds)
                raise EOFError("the other end closed")
            head += data
            for level, kind, raw in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(raw[: len(raw) - len(raw) % got.itemsize])
                    fds.extend(got)
        size, _ = _HEADER.unpack(head)
        payload = bytearray(size)
        view, at = memoryview(payload), 0
        while at < size:
            n = self.sock.recv_into(view[at:])
            if not n:
                _close_all(fds)
                raise EOFError("the other end closed in the middle of a message")
            at += n
        return payload, fds

    def close(self) -> None:
        self.sock.close()

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _rebuild, (DupFd(self.sock.fileno()),)


def _rebuild(dup) -> Channel:
    return Channel(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=dup.detach()))


def _close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
