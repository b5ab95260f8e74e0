"""``grain.checkpoint``: an Orbax handler for iterator states that restores on any number of processes.

``CheckpointHandler`` writes what Grain's writes (``process_<i>-of-<n>.json``, one per process) for
our ``DataLoaderIterator`` and ``DatasetIterator``, portable_loader's ``LoaderIterator`` and
``JaxLoader``, and Grain's own iterators. Grain's restore opens only the file of the same index
*and count*. Ours opens its own file when the count matches, and otherwise reads them all: where
every process saved the same state (a global position: what our iterators save when the shards are
at the same point), it restores it, so a checkpoint saved by 2 processes resumes on 1 or 3; where
they differ, it refuses with a ``StateError`` instead of guessing. It reads Grain's files too.

``CheckpointSave(item)`` / ``CheckpointRestore(item)`` are its Orbax ``CheckpointArgs`` (Orbax is
imported when they are first used). JAX is imported only to ask the process index.

Example:
    >>> import os
    >>> import orbax.checkpoint as ocp
    >>> from portable_loader import grain
    >>> loader = grain.DataLoader(data_source=list(range(50)), sampler=grain.samplers.IndexSampler(50, num_epochs=1),
    ...                           operations=[grain.transforms.Batch(5)])
    >>> mngr = ocp.CheckpointManager(os.path.abspath("ckpt"))
    >>> it = iter(loader)
    >>> _ = next(it)
    >>> saved = mngr.save(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    >>> mngr.wait_until_finished()
    >>> expected = next(it)
    >>> restored = mngr.restore(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(iter(loader))))
    >>> next(restored["data"]).tolist() == expected.tolist()
    True
    >>> mngr.close()
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from typing import Any

from portable_loader.errors import StateError
from portable_loader.state import parse_state
from portable_loader.grain.sharding import process_index_and_count

__all__ = ["CheckpointHandler", "CheckpointRestore", "CheckpointSave"]


def _state_text(item) -> str:
    state = item.get_state()
    if isinstance(state, (bytes, bytearray)):
        return bytes(state).decode()
    if isinstance(state, str):
        return state
    return json.dumps(state, indent=4)


def _read(path) -> tuple[str, Any]:
    """(the file's text, the state in it); ``StateError`` naming the file where it is not a state."""
    raw = path.read_bytes()
    try:
        state = parse_state(raw)  # checks the bytes are UTF-8 JSON first
    except StateError as e:
        raise StateError(e.field, f"{path}: {e.problem}") from None
    return raw.decode(), state


def _hand_over(item, text: str, state):
    """What ``item.set_state`` takes: Grain's ``DataLoaderIterator`` bytes, everything else the dict."""
    grain_loader = sys.modules.get("grain._src.python.data_loader")
    if grain_loader is not None and isinstance(item, grain_loader.DataLoaderIterator):
        return text.encode()
    return state


class CheckpointHandler:
    """Orbax ``CheckpointHandler`` for iterators, elastic: ``save``/``restore`` of ``process_<i>-of-<n>.json``.

    Example:
        >>> import pathlib
        >>> from portable_loader.grain import DataLoader, samplers, sharding
        >>> src, folder = list(range(20)), pathlib.Path("two_shards"); folder.mkdir()
        >>> def shard(k, n):
        ...     return iter(DataLoader(data_source=src, sampler=samplers.IndexSampler(20, num_epochs=1),
        ...                            shard_options=sharding.ShardOptions(k, n)))
        >>> saved = [shard(0, 2), shard(1, 2)]
        >>> [[next(s) for _ in range(3)] for s in saved]        # two processes, 3 elements each
        [[0, 2, 4], [1, 3, 5]]
        >>> for k, s in enumerate(saved):                       # what each of them writes
        ...     _ = (folder / f"process_{k}-of-2.json").write_bytes(s.get_state())
        >>> one = CheckpointHandler().restore(folder, shard(0, 1))   # restored by one process
        >>> [next(one) for _ in range(3)]
        [6, 7, 8]
    """

    def save(self, directory, item=None, args=None) -> None:
        """Write ``item.get_state()`` to ``directory/process_<i>-of-<n>.json`` (``i`` of ``n`` JAX processes).

        Example:
            >>> import pathlib
            >>> from portable_loader.grain import DataLoader, samplers
            >>> folder = pathlib.Path("saved"); folder.mkdir()
            >>> CheckpointHandler().save(folder, iter(DataLoader(data_source=[1], sampler=samplers.IndexSampler(1))))
            >>> sorted(p.name for p in folder.iterdir())
            ['process_0-of-1.json']
        """
        item = item if item is not None else args.item
        index, count = process_index_and_count()
        (directory / f"process_{index}-of-{count}.json").write_text(_state_text(item))

    def restore(self, directory, item=None, args=None):
        """Set ``item``'s state from this process's file, or from the one state all processes saved; return ``item``."""
        item = item if item is not None else args.item
        index, count = process_index_and_count()
        mine = directory / f"process_{index}-of-{count}.json"
        files = [mine] if mine.exists() else sorted(directory.glob("process_*-of-*.json"), key=str)
        if not files:
            raise StateError(None, f"{directory}: no iterator state files (process_*-of-*.json)")
        read = [(f, *_read(f)) for f in files]
        distinct = {json.dumps(state, sort_keys=True) for _, _, state in read}
        if len(distinct) != 1:
            raise StateError(None, f"{directory}: the {len(files)} processes that saved this checkpoint saved "
                                   f"{len(distinct)} different states, so it restores only on {len(files)} "
                                   "processes (shards drift apart when filters keep different numbers of their "
                                   "elements, and a per-process iterator's state is its own)")
        _, text, state = read[0]
        item.set_state(_hand_over(item, text, state))
        if callable(getattr(item, "start_prefetch", None)):
            item.start_prefetch()
        return item

    def structure(self, directory) -> None:
        """Required by Orbax's interface; nothing to describe."""
        return None

    def metadata(self, directory) -> None:
        """Required by Orbax's interface; no metadata."""
        return None

    def finalize(self, directory) -> None:
        """Required by Orbax's interface; nothing to finish."""

    def close(self) -> None:
        """Required by Orbax's interface; nothing to close."""

    @classmethod
    def typestr(cls) -> str:
        """The name Orbax records for this handler."""
        return f"{cls.__module__}.{cls.__qualname__}"


@functools.lru_cache(maxsize=None)
def _orbax_args() -> dict:
    import orbax.checkpoint as ocp

    @ocp.args.register_with_handler(CheckpointHandler, for_save=True)
    @dataclasses.dataclass
    class CheckpointSave(ocp.args.CheckpointArgs):
        """Orbax args: save an iterator's state (``ocp.args.Composite(data=CheckpointSave(it))``)."""

        item: Any

    @ocp.args.register_with_handler(CheckpointHandler, for_restore=True)
    @dataclasses.dataclass
    class CheckpointRestore(ocp.args.CheckpointArgs):
        """Orbax args: restore an iterator in place (``ocp.args.Composite(data=CheckpointRestore(it))``)."""

        item: Any

    for cls in (CheckpointSave, CheckpointRestore):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return {"CheckpointSave": CheckpointSave, "CheckpointRestore": CheckpointRestore}


def __getattr__(name: str):
    # Orbax imports JAX: the args exist once asked for, never at ``import portable_loader.grain``.
    if name in ("CheckpointSave", "CheckpointRestore"):
        return _orbax_args()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
