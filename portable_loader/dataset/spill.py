"""Records tokenized in the main process, handed to loader workers through immutable files.

The loader plans packing windows in the main process, so a tokenized dataset tokenizes each window
there for its lengths; without a hand-over every worker would tokenize the same records again.
The main process writes each window's records to one file (written under a temporary name, then
renamed: a reader sees a whole file or none) in a private folder in ``/dev/shm`` where there is one;
a worker maps the files it has not seen on a miss and reads records from them. Only the newest
``KEEP`` files are kept; a record whose file is gone is simply tokenized again, so the hand-over can
never change a record, only save work.

Example:
    >>> import numpy as np
    >>> s = Spill()
    >>> s.write({3: (np.array([5, 6], np.int32), np.array([0, 1], np.uint8))})
    >>> reader = Spill(s.dir)
    >>> [a.tolist() for a in reader.read([3, 4])[3]]
    [[5, 6], [0, 1]]
    >>> s.close()
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
import weakref

import numpy as np

__all__ = ["Spill"]

KEEP = 8  # files kept (windows): the loader plans at most a few steps ahead of its workers


def _base() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _remove(folder: str, owner: int) -> None:
    if os.getpid() == owner:  # a forked worker inherits the finalizer: only the writer removes the folder
        shutil.rmtree(folder, ignore_errors=True)


class Spill:
    """The writer (``Spill()``, in the main process) or a reader (``Spill(folder)``) of handed-over records.

    The folder's name is fixed when the writer is made, so workers forked (or pickled) before the
    first write know where to look; it is created at the first write.
    """

    def __init__(self, folder: str | None = None):
        self.dir = folder or os.path.join(_base(), f"portable_loader-tokenized-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self.count = 0
        self._seen: set[str] = set()
        self._files: list[tuple[str, dict]] = []  # reader: (name, {record: (ids, mask)}) of the newest files
        self._cleanup = None

    def write(self, records: dict) -> None:
        """Publish ``{index: (ids int32, mask uint8)}`` as one file; drop files older than ``KEEP``."""
        if self._cleanup is None:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            self._cleanup = weakref.finalize(self, _remove, self.dir, os.getpid())
        idx = np.array(sorted(records), dtype=np.int64)
        lens = np.array([records[i][0].size for i in idx.tolist()], dtype=np.int64)
        name = f"{self.count:010d}"
        tmp = os.path.join(self.dir, f".{name}.tmp")
        with open(tmp, "wb") as f:
            np.array([idx.size], dtype=np.int64).tofile(f)
            idx.tofile(f)
            lens.tofile(f)
            for i in idx.tolist():
                np.ascontiguousarray(records[i][0], dtype=np.int32).tofile(f)
            for i in idx.tolist():
                np.ascontiguousarray(records[i][1], dtype=np.uint8).tofile(f)
        os.rename(tmp, os.path.join(self.dir, name))
        old = self.count - KEEP
        if old >= 0:
            try:
                os.unlink(os.path.join(self.dir, f"{old:010d}"))
            except FileNotFoundError:
                pass
        self.count += 1

    def read(self, indices) -> dict:
        """``{index: (ids, mask)}`` for those of ``indices`` that a published file holds."""
        found = self._lookup(indices)
        if len(found) < len(indices) and self._load_new():
            found = self._lookup(indices)
        return found

    def _lookup(self, indices) -> dict:
        found = {}
        for _, table in reversed(self._files):
            for i in indices:
                if i not in found and i in table:
                    found[i] = table[i]
        return found

    def _load_new(self) -> bool:
        try:
            names = sorted(n for n in os.listdir(self.dir) if not n.startswith(".") and n not in self._seen)
        except FileNotFoundError:  # the writer is gone
            return False
        for name in names:
            self._seen.add(name)
            try:
                raw = np.fromfile(os.path.join(self.dir, name), dtype=np.uint8)
            except FileNotFoundError:  # dropped by the writer meanwhile
                continue
            n = int(raw[:8].view(np.int64)[0])
            idx = raw[8 : 8 + 8 * n].view(np.int64)
            lens = raw[8 + 8 * n : 8 + 16 * n].view(np.int64)
            total = int(lens.sum())
            ids = raw[8 + 16 * n : 8 + 16 * n + 4 * total].view(np.int32)
            mask = raw[8 + 16 * n + 4 * total :]
            ends = np.cumsum(lens).tolist()
            starts = [0] + ends[:-1]
            table = {i: (ids[a:b], mask[a:b]) for i, a, b in zip(idx.tolist(), starts, ends)}
            self._files = (self._files + [(name, table)])[-KEEP:]
        return bool(names)

    def close(self) -> None:
        """Remove the writer's folder (also done when the writer is garbage-collected or at exit)."""
        if self._cleanup is not None:
            self._cleanup()

    def __getstate__(self):  # to a spawned worker: a reader of the same folder
        return {"dir": self.dir, "count": 0, "_seen": set(), "_files": [], "_cleanup": None}
