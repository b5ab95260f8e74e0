"""PyTorch Lightning: checkpoints hold the loader state of the batch ``training_step`` received.

Lightning stores and restores a ``TorchLoader``'s state by itself (it has ``state_dict`` and
``load_state_dict``), but its default fetcher pulls one batch ahead of ``training_step`` when the
loader has no length. The loader's own state ("after the last batch returned") is then one batch
ahead of what the model trained on, and a resumed run would skip a batch. Add ``ExactResume()`` to
the Trainer's callbacks: at the start of training it has each train loader count takes
(``Feed.count_takes``), and in every ``on_train_batch_start`` it has them take one, so
``state_dict()`` answers with the state after the batch ``training_step`` received. Look-ahead of
any depth is harmless, resuming stays O(1), and batches fetched ahead but not trained on are served
again when Lightning restarts its iterator (a new Lightning epoch) and when the fit ends, so none is
dropped.

A ``TorchLoader`` that a Lightning ``Trainer`` iterates for training without ``ExactResume`` stops
the run at fit start with an error that names the line to add (``check_fit``).

Example:
    >>> import lightning as L
    >>> import torch
    >>> import portable_loader as pl
    >>> from portable_loader.adapters.lightning import ExactResume
    >>> from portable_loader.adapters.torch import TorchLoader
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

import sys

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.combined_loader import CombinedLoader

from portable_loader.adapters.core import Feed

__all__ = ["ExactResume", "check_fit"]

WIRING = "Trainer(callbacks=[portable_loader.adapters.lightning.ExactResume(), ...])"


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
        >>> import torch
        >>> import portable_loader as pl
        >>> from portable_loader.adapters.torch import TorchLoader
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
        self._feeds: list[Feed] = []  # the train loaders counting takes for this Trainer

    def on_train_start(self, trainer, pl_module) -> None:
        self._count(trainer)  # Lightning has fetched ahead already: nothing handed out so far is taken

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._count(trainer)  # train loaders reloaded for this epoch (reload_dataloaders_every_n_epochs)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        for feed in self._feeds:
            feed.take()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.on_exception(trainer, pl_module, None)

    def on_exception(self, trainer, pl_module, exception) -> None:
        # Lightning never closes a loader it did not create: stop the workers here, at the batch
        # trained on last, so a later fit (or state_dict()) continues from it.
        feeds, self._feeds = self._feeds, []
        for feed in feeds:
            feed.stop_counting()
            feed.close()

    def _count(self, trainer) -> None:
        # trainer.train_dataloader is what train_dataloader() gave: one loader or a collection of them.
        for loader in CombinedLoader(trainer.train_dataloader).flattened:
            if isinstance(loader, Feed) and not any(loader is feed for feed in self._feeds):
                loader.count_takes()
                self._feeds.append(loader)


def check_fit(loader) -> None:
    """Refuse a Lightning fit that would checkpoint ``loader`` one batch late, or feed each rank all of it.

    ``TorchLoader.__iter__`` calls this while Lightning is imported. Lightning gives a loader no hook
    of its own, and without ``ExactResume`` no hook of ours runs, so the stack is what tells that a
    Trainer's ``fit`` is iterating the loader for training (validation, test and predict loaders are
    read start to end and never checkpointed: they pass). Raised from ``iter()``, the first thing
    Lightning does with a train loader, so nothing has been fetched.

    Example:
        >>> import numpy as np, portable_loader as pl
        >>> from portable_loader.adapters.torch import TorchLoader
        >>> with TorchLoader(pl.DataLoader([{"input_ids": np.arange(4)}] * 8, global_batch_size=2, seq_len=4)) as tl:
        ...     check_fit(tl)            # no Trainer is fitting here: nothing to refuse
    """
    trainer = _fitting_trainer()
    if trainer is None or not trainer.training:
        return
    if not isinstance(trainer, Trainer):
        raise RuntimeError("ExactResume is a `lightning` callback: import the Trainer from lightning.pytorch, "
                           "not pytorch_lightning")
    if not any(isinstance(callback, ExactResume) for callback in trainer.callbacks):
        raise RuntimeError(
            "a Lightning Trainer is fitting on a TorchLoader without portable_loader's ExactResume callback. "
            "Lightning fetches one batch ahead of training_step, so its checkpoints would resume one batch late "
            f"(a silently skipped batch). Add the callback: {WIRING}"
        )
    if trainer.world_size > 1 and loader.loader.shard_count != trainer.world_size and not loader.loader.shard_given:
        raise RuntimeError(
            f"this TorchLoader serves the whole global batch, but the run has {trainer.world_size} ranks: it was "
            "created before torch.distributed was initialized. Create it inside train_dataloader() "
            "(LightningModule or LightningDataModule), or pass shard_index/shard_count to the DataLoader"
        )


def _fitting_trainer():
    """The Trainer whose ``fit`` is on this thread's stack (the innermost), or None. Frames are matched
    by the code of the public ``Trainer.fit``: no name of Lightning's internals is relied on."""
    fits = {Trainer.fit.__code__}
    if "pytorch_lightning" in sys.modules:
        fits.add(sys.modules["pytorch_lightning"].Trainer.fit.__code__)
    frame = sys._getframe(1)
    while frame is not None and frame.f_code not in fits:
        frame = frame.f_back
    return None if frame is None else frame.f_locals["self"]
