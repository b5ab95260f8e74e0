"""Tokenized records handed between processes through immutable files.

The loader's worker processes tokenize packing windows ahead, each a part of a window (see
:mod:`portable_loader.engine.ahead`); the batch that needs a record is often built by another
worker. The writer of a part publishes its records as one file (written under a temporary name,
then renamed: a reader sees a whole file or none) in the dataset's private folder in ``/dev/shm``
where there is one; a worker maps the files it has not seen on a miss and reads records from them.
The main process owns the folder: it removes the files of windows already served, and the whole
folder when the loader closes, when the dataset is collected, or at exit; a folder left by a main
process that was killed is removed by the next one that makes a spill. A record whose file is gone
is simply tokenized again, so the hand-over can never change a record, only save work.

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

import numpy as np

from portable_loader import lifecycle

__all__ = ["Spill"]

KEEP = 8  # files the main process's own writes keep (windows it tokenized for their lengths)
_PREFIX = "portable_loader-tokenized-"


def _base() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def sweep_stale() -> list[str]:
    """Remove spill folders of this user whose main process is gone (see :func:`portable_loader.lifecycle.sweep_stale`)."""
    return lifecycle.sweep_stale(_base(), _PREFIX)


class Spill:
    """The owner (``Spill()``, in the main process) or a reader (``Spill(folder)``) of handed-over records.

    The folder's name is fixed when the owner is made, so workers forked (or pickled) before the
    first write know where to look. Any process may :meth:`write`; the owner removes.
    """

    def __init__(self, folder: str | None = None):
        self.dir = folder or lifecycle.private_path(_base(), _PREFIX, owner=self)
        self.count = 0
        self._seen: set[str] = set()
        self._files: dict[str, dict] = {}  # reader: {name: {record: (ids, mask)}} of files still published

    def write(self, records: dict, name: str | None = None) -> None:
        """Publish ``{index: (ids int32, mask uint8)}`` as one file called ``name``.

        Without a name (the owner's own windows) the file is numbered, and only the newest ``KEEP``
        of those are kept.
        """
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        idx = np.array(sorted(records), dtype=np.int64)
        lens = np.array([records[i][0].size for i in idx.tolist()], dtype=np.int64)
        numbered = name is None
        name = f"m{self.count:010d}" if numbered else name
        tmp = os.path.join(self.dir, f".{name}.{os.getpid()}.tmp")
        order = idx.tolist()
        # One buffer and one write: a write per record cost more than the records' bytes.
        ids = np.concatenate([np.zeros(0, np.int32)] + [records[i][0] for i in order]).astype(np.int32, copy=False)
        mask = np.concatenate([np.zeros(0, np.uint8)] + [records[i][1] for i in order]).astype(np.uint8, copy=False)
        with open(tmp, "wb") as f:
            f.write(b"".join((np.array([idx.size], dtype=np.int64).tobytes(), idx.tobytes(), lens.tobytes(),
                              ids.tobytes(), mask.tobytes())))
        os.rename(tmp, os.path.join(self.dir, name))
        if numbered:
            if self.count >= KEEP:
                self.drop(f"m{self.count - KEEP:010d}")
            self.count += 1

    def drop(self, name: str) -> None:
        """Remove file ``name`` if it is there (readers that mapped it keep their copy)."""
        try:
            os.unlink(os.path.join(self.dir, name))
        except FileNotFoundError:
            pass

    def read(self, indices) -> dict:
        """``{index: (ids, mask)}`` for those of ``indices`` that a published file holds."""
        found = self._lookup(indices)
        if len(found) < len(indices) and self._load_new():
            found = self._lookup(indices)
        return found

    def _lookup(self, indices) -> dict:
        found = {}
        for table in reversed(self._files.values()):
            for i in indices:
                if i not in found and i in table:
                    found[i] = table[i]
        return found

    def _load_new(self) -> bool:
        try:
            listed = {n for n in os.listdir(self.dir) if not n.startswith(".")}
        except FileNotFoundError:  # nothing written yet, or the loader closed
            listed = set()
        # Files the owner removed are served: forget them, so a worker holds a few windows at most.
        self._files = {n: t for n, t in self._files.items() if n in listed}
        new = sorted(listed - self._seen)
        for name in new:
            self._seen.add(name)
            try:
                raw = np.fromfile(os.path.join(self.dir, name), dtype=np.uint8)
            except FileNotFoundError:  # dropped by the owner meanwhile
                continue
            n = int(raw[:8].view(np.int64)[0])
            idx = raw[8 : 8 + 8 * n].view(np.int64)
            lens = raw[8 + 8 * n : 8 + 16 * n].view(np.int64)
            total = int(lens.sum())
            ids = raw[8 + 16 * n : 8 + 16 * n + 4 * total].view(np.int32)
            mask = raw[8 + 16 * n + 4 * total :]
            ends = np.cumsum(lens).tolist()
            starts = [0] + ends[:-1]
            self._files[name] = {i: (ids[a:b], mask[a:b]) for i, a, b in zip(idx.tolist(), starts, ends)}
        return bool(new)

    def clear(self) -> None:
        """Remove every file (the owner, when a loader closes); later writes start a new folder."""
        shutil.rmtree(self.dir, ignore_errors=True)

    def close(self) -> None:
        """Remove the owner's folder (also done when the owner is garbage-collected or at exit)."""
        self.clear()

    def __getstate__(self):  # to a spawned worker: a reader of the same folder
        return {"dir": self.dir, "count": 0, "_seen": set(), "_files": {}}
