"""PyTorch adapter: batches as torch tensors on a device, through an async collator.

``TorchLoader`` wraps a ``DataLoader``. With ``async_collation`` a background thread plans, fetches
and collates step N+1 while the trainer runs step N, copies it into pinned host memory and issues the
host-to-device copy on a side CUDA stream; the trainer's stream waits on an event before it uses the
batch, and each tensor is recorded on the consumer stream so the caching allocator never reuses it
early. Batches are byte-identical with ``async_collation`` on and off, and ``state_dict()`` always
describes the batches the trainer has received, never the one being prepared.

It is a ``torch.distributed.checkpoint`` ``Stateful``; with ``torch.distributed`` initialized, the
shard index and count come from the process group unless the ``DataLoader`` was given them.

Example:
    >>> import portable_loader as pl
    >>> from portable_loader.adapters.torch import TorchLoader
    >>> from portable_loader.precache import sample_args
    >>> loader = pl.DataLoader(pl.open_cache(pl.precache(**sample_args(), out="cache")), global_batch_size=8, seq_len=128)
    >>> with TorchLoader(loader, device="cpu") as tl:
    ...     for step, batch in zip(range(3), tl):
    ...         pass                                                  # loss = model(**batch).loss; ...
    ...     torch.save({"data": tl.state_dict()}, "ckpt.pt")
    ...     following = next(tl)
    >>> with TorchLoader(loader, device="cpu") as resumed:              # e.g. after a restart
    ...     resumed.load_state_dict(torch.load("ckpt.pt")["data"])
    ...     torch.equal(next(resumed)["input_ids"], following["input_ids"])
    True
    >>> tl = TorchLoader(loader, device="cuda")   # needs a GPU  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

import numpy as np
import torch

from portable_loader.adapters.hf import hf_fields  # noqa: F401 - importable from here too, as before
from portable_loader.adapters.steering import Steering
from portable_loader.errors import StateError
from portable_loader.lifecycle import Closing, close_at_exit
from portable_loader.loader import DataLoader, LoaderIterator
from portable_loader.engine import Producer

__all__ = ["TorchLoader", "hf_fields"]

_LIGHTNING_ITERATORS = ("lightning.pytorch.utilities.combined_loader", "pytorch_lightning.utilities.combined_loader")


def _distributed_shard(loader: DataLoader) -> DataLoader:
    if loader.shard_given or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return loader
    return loader.with_shard(torch.distributed.get_rank(), torch.distributed.get_world_size())


class TorchLoader(Steering, Closing):
    """Iterate a ``DataLoader`` as dicts of torch tensors on ``device``; resumable and ``Stateful``.

    Args:
        loader: the framework-neutral ``DataLoader``.
        device: where batches go (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``).
        async_collation: prepare and copy the next batch in a background thread (double buffering).
        pin_memory: stage through pinned host memory; ``None`` means "when the device is CUDA".
        hf_labels: return ``input_ids``, ``labels``, ``attention_mask``, ``position_ids`` (int64)
            for Hugging Face models instead of the loader's fields.

    Example:
        >>> import portable_loader as pl
        >>> from portable_loader.precache import sample_args
        >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache"))
        >>> with TorchLoader(DataLoader(src, global_batch_size=8, seq_len=128), device="cpu", hf_labels=True) as tl:
        ...     batch = next(iter(tl)); state = tl.state_dict()
        >>> sorted(batch), batch["labels"].shape, batch["labels"].dtype
        (['attention_mask', 'input_ids', 'labels', 'position_ids'], torch.Size([8, 128]), torch.int64)
        >>> list(state)
        ['portable_loader']
    """

    def __init__(
        self,
        loader: DataLoader,
        device: str | torch.device = "cpu",
        *,
        async_collation: bool = True,
        pin_memory: bool | None = None,
        hf_labels: bool = False,
    ):
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} was asked for, but CUDA is not available on this machine")
        self.loader = _distributed_shard(loader)
        self.async_collation = bool(async_collation)
        self.pin_memory = self.device.type == "cuda" if pin_memory is None else bool(pin_memory)
        self.hf_labels = bool(hf_labels)
        # With async collation its thread builds the batches: no second thread under it.
        self._it = LoaderIterator(self.loader, thread=not self.async_collation)
        # The state of the batches handed to the trainer, computed when asked for (state_later).
        self._state = self._it.state_later()
        self._worker: _AsyncCollator | None = None
        # Holds no reference to self, so that the collator thread does not keep self alive either.
        self._convert = functools.partial(_to_torch, device=self.device, pin_memory=self.pin_memory,
                                          hf_labels=self.hf_labels)
        close_at_exit(self)  # its thread and the loader's workers stop before torch's exit handlers

    # --- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> "TorchLoader":
        caller = sys._getframe(1)
        if caller.f_globals.get("__name__") in _LIGHTNING_ITERATORS:
            # A Lightning Trainer fetches ahead of training_step: adapters.lightning keeps state_dict() on
            # the batch trained on, or refuses the run (it would resume a batch late).
            from portable_loader.adapters.lightning import lightning_iter

            lightning_iter(self, caller)
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if not self.async_collation:
            batch = self._convert(next(self._it))
            self._state = self._it.state_later()
            return batch
        if self._worker is None:
            self._worker = _AsyncCollator(self._it, self._convert, self.device)
        batch, state = self._worker.next()
        self._state = state
        return batch

    def close(self) -> None:
        """Stop the background thread and the loader's workers; free staging buffers.

        Batches prepared but not returned are dropped and the loader is rewound to the last batch
        returned (O(1)), so iterating again after ``close`` loses nothing.
        """
        self._rewind()
        self._it.close()

    def _rewind(self) -> None:
        """Drop the batch prepared ahead, back to the last one returned."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()
            self._it.set_state(self._state())

    # --- state (torch Stateful) ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch returned, as ``{"portable_loader": <JSON text>}``.

        One string leaf: ``torch.save`` and ``torch.distributed.checkpoint`` store it as is, on any
        world size (the state is global: every rank holds the same one).
        """
        return {"portable_loader": json.dumps(self._state(), sort_keys=True)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue right after the saved batch; refuses a state of another source or config."""
        if not isinstance(state_dict, dict) or "portable_loader" not in state_dict:
            raise StateError(None, f"not a TorchLoader state: expected a dict with 'portable_loader', got {state_dict!r:.100}")
        # Checked before the running collator is stopped, so a refused state changes nothing.
        state = self._it.loader.check_state(state_dict["portable_loader"])
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()
        self._it.set_state(state)
        self._state = self._it.state_later()


def _to_torch(batch: dict[str, np.ndarray], *, device: torch.device, pin_memory: bool,
              hf_labels: bool) -> dict[str, torch.Tensor]:
    if hf_labels:
        batch = hf_fields(batch)
    out = {}
    for k, v in batch.items():
        t = torch.from_numpy(np.ascontiguousarray(v))
        if pin_memory:
            t = t.pin_memory()
        if device.type != "cpu":
            t = t.to(device, non_blocking=pin_memory)
        out[k] = t
    return out


class _AsyncCollator:
    """One background thread keeps the next batch ready (converted, pinned, copy issued).

    It is given the iterator and the conversion, never the ``TorchLoader``: a thread holding the
    loader would keep it alive, and a loader dropped without ``close()`` would never be collected.
    """

    def __init__(self, it, convert, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

        def produce():
            raw = next(it)
            state = it.state_later()
            if self.stream is None:
                return convert(raw), None, state
            with torch.cuda.stream(self.stream):
                batch = convert(raw)
                event = torch.cuda.Event()
                event.record(self.stream)
            return batch, event, state

        # Depth 1 plus the batch in the trainer's hands: double buffering.
        self.producer = Producer(produce, depth=1, name="portable_loader-torch-collator")

    def next(self):
        batch, event, state = self.producer.next()
        if event is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(event)
            for t in batch.values():
                t.record_stream(consumer)
        return batch, state

    def close(self) -> None:
        self.producer.close()  # drops prepared batches and their pinned buffers now
        if self.stream is not None:
            self.stream.synchronize()
