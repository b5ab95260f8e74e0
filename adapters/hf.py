"""Hugging Face ``Trainer`` integration: resume mid-epoch in O(1), without skipping batches.

A stock ``Trainer`` resumes by replaying its data loader past the batches already seen
(``skip_first_batches``), which costs O(steps) and assumes the loader's order is reproducible.
``PortableTrainer`` trains from a ``TorchLoader`` instead: the loader's state is written into every
checkpoint folder (``portable_loader-rank<r>.json``, one small file per rank) on save, restored on
``train(resume_from_checkpoint=...)``, and the Trainer's own batch skipping is turned off
(``ignore_data_skip``). The state saved is that of the batches the optimizer has consumed, also with
gradient accumulation and with the async collator preparing the next batch.

Example:
    >>> from portable_loader.adapters.hf import PortableTrainer
    >>> tl = TorchLoader(DataLoader(src, global_batch_size=8, seq_len=512), hf_labels=True)   # doctest: +SKIP
    >>> trainer = PortableTrainer(model=model, args=TrainingArguments("out", max_steps=1000,
    ...                           save_steps=100), train_loader=tl)                         # doctest: +SKIP
    >>> trainer.train(resume_from_checkpoint=True)                                        # doctest: +SKIP
"""

from __future__ import annotations

import json
import os

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from portable_loader.adapters.torch import TorchLoader
from portable_loader.errors import StateError

__all__ = ["PortableTrainer", "state_file"]


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0


def state_file(checkpoint_dir: str, rank: int | None = None) -> str:
    """Where a rank's loader state lives inside a Trainer checkpoint folder."""
    return os.path.join(checkpoint_dir, f"portable_loader-rank{_rank() if rank is None else rank}.json")


class _SaveLoaderState(TrainerCallback):
    def __init__(self, loader: TorchLoader):
        self.loader = loader

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if os.path.isdir(folder):
            path = state_file(folder)
            with open(path + ".tmp", "w") as f:
                json.dump(self.loader.state_dict(), f)
            os.replace(path + ".tmp", path)
        return control


class PortableTrainer(Trainer):
    """A ``Trainer`` fed by a ``TorchLoader`` (use ``hf_labels=True``), with O(1) exact resume.

    The loader has no length, so set ``TrainingArguments.max_steps``. Everything else (logging,
    evaluation, ``save_steps``, gradient accumulation) is the stock Trainer's.
    """

    def __init__(self, *args, train_loader: TorchLoader, **kwargs):
        if not isinstance(train_loader, TorchLoader):
            raise TypeError(f"train_loader must be a TorchLoader, got {type(train_loader).__name__}")
        super().__init__(*args, **kwargs)
        if self.args.max_steps <= 0:
            raise ValueError("PortableTrainer needs TrainingArguments(max_steps=...): the loader has no length")
        self.train_loader = train_loader
        self.args.ignore_data_skip = True  # the loader resumes itself; never replay batches
        self.add_callback(_SaveLoaderState(train_loader))

    def get_train_dataloader(self):
        return self.train_loader

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"no checkpoint found in output_dir {self.args.output_dir!r} to resume from")
        if resume_from_checkpoint:
            path = state_file(resume_from_checkpoint)
            if not os.path.isfile(path):
                raise ValueError(f"{path}: no loader state in this checkpoint (was it written by PortableTrainer?)")
            with open(path, "rb") as f:
                try:
                    saved = json.loads(f.read())
                except ValueError as e:  # also UnicodeDecodeError
                    raise StateError(None, f"{path}: is not JSON ({e}): refused") from None
            self.train_loader.load_state_dict(saved)
        return super().train(resume_from_checkpoint=resume_from_checkpoint or None, **kwargs)
