"""JAX adapter: global ``jax.Array`` batches laid out by a sharding, device prefetch, Orbax checkpoints.

``JaxLoader`` is the adapter core's ``Feed`` (``adapters/core.py``) with a JAX conversion. Each
process loads only the rows its addressable devices hold (the rows follow from ``sharding``; without
one, the batch axis is split over all devices) and builds the global array with
``jax.make_array_from_process_local_data``. A background thread keeps ``prefetch`` batches already on
device; the state it reports is that of the batches returned.

Checkpointing: ``LoaderSave(jl)`` / ``LoaderRestore(jl)`` are Orbax ``CheckpointArgs`` for
``LoaderCheckpointHandler`` (one small JSON file per process; restore accepts a checkpoint written by
any number of processes, since the state is global: this is the elastic handler). Grain's
``grain.checkpoint.CheckpointSave/CheckpointRestore`` also work on a JaxLoader, but only for the same
process count; ``LoaderCheckpointHandler`` restores Grain's files from any count (docs/exit.md).

Example:
    >>> import os
    >>> import portable_loader as pl
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> from portable_loader.precache import sample_args
    >>> loader = pl.DataLoader(pl.open_cache(pl.precache(**sample_args(), out="cache")), global_batch_size=8, seq_len=128)
    >>> mesh = Mesh(np.array(jax.devices()), ("data",))
    >>> mngr = ocp.CheckpointManager(os.path.abspath("ckpt"))   # Orbax takes absolute paths
    >>> with JaxLoader(loader, sharding=NamedSharding(mesh, P("data"))) as jl:
    ...     batch = next(jl)
    ...     saved = mngr.save(1, args=ocp.args.Composite(data=LoaderSave(jl)))
    ...     mngr.wait_until_finished()
    ...     following = next(jl)
    >>> batch["input_ids"].shape, batch["input_ids"].sharding.spec == P("data")
    ((8, 128), True)
    >>> with JaxLoader(loader, sharding=NamedSharding(mesh, P("data"))) as resumed:   # e.g. after a restart
    ...     restored = mngr.restore(1, args=ocp.args.Composite(data=LoaderRestore(resumed)))
    ...     bool((next(resumed)["input_ids"] == following["input_ids"]).all())
    True
    >>> mngr.close()
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from portable_loader.adapters.core import Feed
from portable_loader.grain.checkpoint import CheckpointHandler
from portable_loader.loader import DataLoader

__all__ = ["JaxLoader", "LoaderSave", "LoaderRestore", "LoaderCheckpointHandler"]


def _rows_of_this_process(sharding, global_shape) -> tuple[int, int]:
    """The contiguous block of batch rows this process's devices hold, as (shard_index, shard_count)."""
    rows = set()
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        r = index[0] if index else slice(None)
        rows.update(range(*r.indices(global_shape[0])))
    lo, hi = min(rows), max(rows) + 1
    size = hi - lo
    if len(rows) != size or global_shape[0] % size or lo % size:
        raise ValueError(
            f"this process's devices hold batch rows {sorted(rows)[:8]}...: not one aligned contiguous block; "
            "lay the batch axis out so that each process holds rows [k*B/K, (k+1)*B/K)"
        )
    return lo // size, global_shape[0] // size


def _global_batch(sharding, shard_count: int, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    # The global shape follows this step's batch size (a schedule changes it): every host holds
    # 1/shard_count of the rows, so the local rows tell it.
    rows, seq_len = next(iter(batch.values())).shape
    shape = (rows * shard_count, seq_len)
    return {k: jax.make_array_from_process_local_data(sharding, v, shape) for k, v in batch.items()}


class JaxLoader(Feed):
    """Iterate a ``DataLoader`` as dicts of global ``jax.Array`` s; resumable, Orbax- and Grain-checkpointable.

    Args:
        loader: the framework-neutral ``DataLoader``; its shard is derived from ``sharding`` and the
            process index unless it was given explicitly (then they must agree).
        sharding: layout of every ``[global_batch, seq_len]`` field; default: batch axis over all devices.
            With a batch-size schedule, each step's arrays have that step's global shape (a new shape
            when the size changes, so a jitted step compiles once per size); every size of the
            schedule is checked up front to give this process the same rows of the batch.
        prefetch: batches kept ready on device by a background thread (0: none).

    Example:
        >>> import portable_loader as pl
        >>> from portable_loader.precache import sample_args
        >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache"))
        >>> with JaxLoader(DataLoader(src, global_batch_size=8, seq_len=128)) as jl:
        ...     batch = next(jl)
        ...     state = jl.get_state()          # JSON bytes: Grain's iterator protocol
        >>> type(batch["input_ids"]).__name__, batch["input_ids"].sharding.spec == PartitionSpec("data")
        ('ArrayImpl', True)
        >>> json.loads(state)["step"]
        1
    """

    def __init__(self, loader: DataLoader, sharding=None, *, prefetch: int = 2):
        if sharding is None:
            sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
        self.sharding = sharding
        sizes = loader.batch_schedule.sizes
        self.global_shape = (sizes[0], loader.seq_len)  # of step 0; later steps follow the schedule
        index, count = _rows_of_this_process(sharding, self.global_shape)
        for size in sizes[1:]:  # every size of a schedule, up front: not at the step where it begins
            try:
                rows = _rows_of_this_process(sharding, (size, loader.seq_len))
            except Exception as e:  # noqa: BLE001 - jax's IndivisibleError and the like, reworded
                raise ValueError(f"global batch size {size} of the schedule {loader.batch_schedule!r} cannot be "
                                 f"laid out by {sharding}: {e}") from None
            if rows != (index, count):
                raise ValueError(f"global batch size {size} of the schedule gives this process other rows of the "
                                 f"batch under {sharding} than size {sizes[0]} does: pick sizes the batch axis "
                                 "splits the same way")
        if loader.shard_given and (loader.shard_index, loader.shard_count) != (index, count):
            raise ValueError(
                f"the DataLoader was given shard {loader.shard_index}/{loader.shard_count}, but this process's "
                f"devices hold shard {index}/{count} of the batch under {sharding}"
            )
        self.prefetch = int(prefetch)
        loader = loader if loader.shard_given else loader.with_shard(index, count)
        super().__init__(loader, functools.partial(_global_batch, sharding, loader.shard_count), self.prefetch,
                         name="portable_loader-jax-prefetch")

    # --- state: Grain's protocol (bytes, as grain.DataLoader's iterator) and torch-style dicts -------

    def get_state(self) -> bytes:
        """The position after the last batch returned, as JSON bytes."""
        return json.dumps(self._taken_state(), sort_keys=True).encode()

    def set_state(self, state: bytes | str | dict) -> None:
        """Continue right after the saved batch; refuses a state of another source or config."""
        self._restore(state)

    def start_prefetch(self) -> None:
        """Grain's checkpoint handler calls this after a restore; prefetch starts at the next batch."""

    def state_dict(self) -> dict[str, Any]:
        return self._taken_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.set_state(state)


class LoaderCheckpointHandler(CheckpointHandler):
    """Orbax handler for loader state that restores from any process count: the elastic one.

    It writes what Grain's ``grain.checkpoint.CheckpointHandler`` writes (``process_<i>-of-<n>.json``,
    one per process, holding the iterator's state), but Grain's restore opens only the file of the
    same index *and count*, so a checkpoint saved by 2 processes cannot be restored by 1. A loader's
    state is global (every process saves the same one), so this handler's restore takes its own
    file when the count matches and otherwise any of them, after checking that they agree. It reads
    checkpoints written by Grain's handler too. Its save and restore are those of
    ``portable_loader.grain.checkpoint.CheckpointHandler``; this name carries its own Orbax args
    (``LoaderSave``/``LoaderRestore``). Register it where MaxText registers Grain's:

    Example:
        >>> import os
        >>> import portable_loader as pl
        >>> from portable_loader.precache import sample_args
        >>> loader = DataLoader(pl.open_cache(pl.precache(**sample_args(), out="cache")), global_batch_size=8, seq_len=128)
        >>> params = {"w": np.zeros(4)}
        >>> mngr = ocp.CheckpointManager(os.path.abspath("run"), item_names=("items", "iter"),
        ...     item_handlers={"items": ocp.PyTreeCheckpointHandler(), "iter": LoaderCheckpointHandler()})
        >>> with JaxLoader(loader) as jl:
        ...     batch = next(jl)
        ...     saved = mngr.save(1, args=ocp.args.Composite(items=ocp.args.PyTreeSave(params),
        ...                                                  iter=LoaderSave(jl)))
        ...     mngr.wait_until_finished()
        >>> [f for f in os.listdir("run/1/iter") if f.startswith("process_")]   # one file per process
        ['process_0-of-1.json']
        >>> with JaxLoader(loader) as jl:
        ...     restored = mngr.restore(1, args=ocp.args.Composite(items=ocp.args.PyTreeRestore(),
        ...                                                        iter=LoaderRestore(jl)))
        ...     json.loads(jl.get_state())["step"]          # the loader continues after its batch 1
        1
        >>> restored["items"]["w"].tolist()
        [0.0, 0.0, 0.0, 0.0]
        >>> mngr.close()
    """


try:
    import orbax.checkpoint as ocp

    @ocp.args.register_with_handler(LoaderCheckpointHandler, for_save=True)
    @dataclasses.dataclass
    class LoaderSave(ocp.args.CheckpointArgs):
        """Orbax args: save a ``JaxLoader``'s state (``args=ocp.args.Composite(data=LoaderSave(jl))``)."""

        item: Any

    @ocp.args.register_with_handler(LoaderCheckpointHandler, for_restore=True)
    @dataclasses.dataclass
    class LoaderRestore(ocp.args.CheckpointArgs):
        """Orbax args: restore a ``JaxLoader`` in place (``args=ocp.args.Composite(data=LoaderRestore(jl))``)."""

        item: Any

except ImportError:  # orbax is optional: JaxLoader works without it
    pass
