"""PyTorch Lightning: checkpoints hold the loader state of the batch ``training_step`` received.

Lightning stores and restores a ``TorchLoader``'s state by itself (it has ``state_dict`` and
``load_state_dict``), but its default fetcher pulls one batch ahead of ``training_step`` when the
loader has no length. The loader's own state ("after the last batch returned") is then one batch
ahead of what the model trained on, and a resumed run would skip a batch. Add ``ExactResume()`` to
the Trainer's callbacks: each train ``TorchLoader`` then records the state after every batch it
hands out, the callback marks which of them ``training_step`` received, and ``state_dict()``
answers with that one. Look-ahead of any depth is harmless, resuming stays O(1), and batches
fetched ahead but not trained on are served again when Lightning restarts its iterator (a new
Lightning epoch), so none is dropped.

A ``TorchLoader`` that a Lightning ``Trainer`` iterates for training without ``ExactResume`` stops
the run at fit start with an error that names the line to add.

Example:
    >>> import lightning as L
    >>> import portable_loader as pl
    >>> from portable_loader.adapters.lightning import ExactResume
    >>> from portable_loader.precache import sample_args
    >>> class TinyLM(L.LightningModule):   # a bigram model; yours: any LightningModule
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.bigram = torch.nn.Embedding(1024, 1024)
    ...     def training_step(self, batch, batch_idx):
    ...         ids = batch["input_ids"].long()
    ...         return torch.nn.functional.cross_entropy(self.bigram(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    ...     def configure_optimizers(self):
    ...         return torch.optim.SGD(self.parameters(), lr=0.1)
    >>> loader = pl.DataLoader(pl.open_cache(pl.precache(**sample_args(), out="cache")), global_batch_size=4, seq_len=64)
    >>> def trainer(max_steps):
    ...     return L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
    ...                      enable_model_summary=False,
    ...                      callbacks=[ExactResume(), L.pytorch.callbacks.ModelCheckpoint(
    ...                          "ckpts", every_n_train_steps=1, save_top_k=-1, save_last=True)])
    >>> with TorchLoader(loader) as tl:
    ...     trainer(2).fit(TinyLM(), train_dataloaders=tl, ckpt_path="last")   # no checkpoint yet: from the start
    >>> resumed = trainer(3)
    >>> with TorchLoader(loader) as tl:
    ...     resumed.fit(TinyLM(), train_dataloaders=tl, ckpt_path="last")      # at the loader's batch 3, in O(1)
    >>> resumed.global_step
    3
"""

from __future__ import annotations

import collections
import functools
import types
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from portable_loader.adapters.torch import TorchLoader

__all__ = ["ExactResume"]

# Lightning fetches one batch ahead; more than this many batches handed out and never received by
# training_step means nothing marks them (e.g. training_step(dataloader_iter)), so refuse.
MAX_AHEAD = 64

WIRING = "Trainer(callbacks=[portable_loader.adapters.lightning.ExactResume(), ...])"

_active: list["ExactResume"] = []  # callbacks of the Trainers fitting in this process now


class _Tracking:
    """Mixed into a train loader's class: ``state_dict()`` is the state after the batch received."""

    def _start_tracking(self) -> None:
        self._received = TorchLoader.state_dict(self)
        self._ahead: collections.deque = collections.deque()
        self._exhausted = False

    def __next__(self):
        try:
            batch = super().__next__()
        except StopIteration:
            self._exhausted = True
            raise
        if len(self._ahead) >= MAX_AHEAD:
            raise RuntimeError(
                f"{MAX_AHEAD} batches were handed out that training_step never received; ExactResume marks a "
                "batch as received in on_train_batch_start, which training_step(dataloader_iter) bypasses"
            )
        self._ahead.append(TorchLoader.state_dict(self))
        return batch

    def _mark_received(self) -> None:
        # A loader that is exhausted inside a CombinedLoader contributes no batch: nothing to mark.
        if self._ahead:
            self._received = self._ahead.popleft()

    def _drop_look_ahead(self) -> None:
        """Rewind to the batch last received (O(1)), so batches fetched ahead are served again."""
        if self._ahead and not self._exhausted:
            TorchLoader.load_state_dict(self, self._received)
        self._ahead.clear()

    def state_dict(self) -> dict[str, Any]:
        return dict(self._received)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._start_tracking()


class _Refusing:
    """Mixed into a mis-wired train loader's class: its next ``next`` raises ``self._refusal``.

    Raised from ``next`` rather than ``iter``: after an error inside ``iter``, Lightning's teardown
    raises one of its own ("Please call `iter(combined_loader)` first") that buries ours.
    """

    def __next__(self):
        self.__class__ = self._plain_class  # usable again once the wiring is fixed
        raise RuntimeError(self._refusal)


def _refuse(loader: TorchLoader, message: str) -> None:
    loader._refusal = message
    loader.__class__ = _mixed_class(_Refusing, getattr(loader, "_plain_class", type(loader)))


@functools.lru_cache(maxsize=None)
def _mixed_class(mixin: type, cls: type) -> type:
    return types.new_class(f"{mixin.__name__.strip('_')}{cls.__name__}", (mixin, cls),
                           exec_body=lambda ns: ns.update(_plain_class=cls))


class ExactResume(Callback):
    """Lightning callback: checkpoints resume a ``TorchLoader`` at the batch after the last one trained on.

    Add it once to the ``Trainer``; train loaders need no other change, whether they come from
    ``train_dataloader()``, a ``LightningDataModule`` or ``trainer.fit(train_dataloaders=...)``.
    Lightning's epochs, ``max_steps``, validation intervals and gradient accumulation are untouched.
    Under DDP, create the ``TorchLoader`` inside ``train_dataloader()`` (or the DataModule's), where
    the process group exists, so that each rank takes its own slice of the global batch.

    Example:
        >>> import json
        >>> import lightning as L
        >>> import portable_loader as pl
        >>> from portable_loader.precache import sample_args
        >>> class TinyLM(L.LightningModule):   # a bigram model; yours: any LightningModule
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.bigram = torch.nn.Embedding(1024, 1024)
        ...     def training_step(self, batch, batch_idx):
        ...         ids = batch["input_ids"].long()
        ...         return torch.nn.functional.cross_entropy(self.bigram(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        >>> loader = pl.DataLoader(pl.open_cache(pl.precache(**sample_args(), out="cache")), global_batch_size=4, seq_len=64)
        >>> options = dict(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
        ...                enable_progress_bar=False, enable_model_summary=False)
        >>> with TorchLoader(loader) as tl:
        ...     L.Trainer(**options, callbacks=[ExactResume()]).fit(TinyLM(), train_dataloaders=tl)
        ...     json.loads(tl.state_dict()["portable_loader"])["step"]   # after batch 2, trained on last
        2
        >>> with TorchLoader(loader) as tl:   # without the callback: refused at fit start
        ...     L.Trainer(**options).fit(TinyLM(), train_dataloaders=tl)
        Traceback (most recent call last):
        ...
        RuntimeError: a Lightning Trainer is fitting on a TorchLoader without portable_loader's ExactResume callback. ...
    """

    def __init__(self) -> None:
        self._loaders: list = []  # the train loaders being tracked

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            _active.append(self)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.on_exception(trainer, pl_module, None)

    def on_exception(self, trainer, pl_module, exception) -> None:
        # Lightning never closes a loader it did not create: stop the workers here, at the batch
        # trained on last, so a later fit (or state_dict()) continues from it.
        loaders, self._loaders = self._loaders, []
        for loader in loaders:
            loader._drop_look_ahead()
            loader.close()
            loader.__class__ = loader._plain_class
        if self in _active:
            _active.remove(self)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        for loader in self._loaders:
            loader._mark_received()

    def _track(self, loader: TorchLoader) -> None:
        if isinstance(loader, _Tracking):
            loader._drop_look_ahead()  # Lightning restarts its iterator: a new Lightning epoch
        else:
            loader.__class__ = _mixed_class(_Tracking, getattr(loader, "_plain_class", type(loader)))
            loader._start_tracking()
            self._loaders.append(loader)


def _wiring_error(loader: TorchLoader, caller) -> str | None:
    if caller.f_globals["__name__"].startswith("pytorch_lightning"):
        return "ExactResume is a `lightning` callback: import the Trainer from lightning.pytorch, not pytorch_lightning"
    if not _active:
        return (
            "a Lightning Trainer is fitting on a TorchLoader without portable_loader's ExactResume callback. "
            "Lightning fetches one batch ahead of training_step, so its checkpoints would resume one batch late "
            f"(a silently skipped batch). Add the callback: {WIRING}"
        )
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1 and loader.loader.shard_count != world and not loader.loader.shard_given:
        return (
            f"this TorchLoader serves the whole global batch, but the run has {world} ranks: it was created "
            "before torch.distributed was initialized. Create it inside train_dataloader() "
            "(LightningModule or LightningDataModule), or pass shard_index/shard_count to the DataLoader"
        )
    return None


def lightning_iter(loader: TorchLoader, caller) -> None:
    """Called by ``TorchLoader.__iter__`` when Lightning's ``CombinedLoader`` (frame ``caller``) iterates it."""
    if type(caller.f_locals.get("self")).__name__ == "_Sequential":
        return  # validation/test/predict loaders: read start to end, never checkpointed by Lightning
    error = _wiring_error(loader, caller)
    if error is not None:
        _refuse(loader, error)
    else:
        _active[-1]._track(loader)
