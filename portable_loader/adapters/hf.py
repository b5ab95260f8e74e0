"""Hugging Face: the fields a causal LM expects (``hf_fields``), and a ``Trainer`` that resumes in O(1).

``hf_fields`` turns a loader batch into ``input_ids``, ``labels``, ``attention_mask`` and
``position_ids`` (numpy only, defined in ``adapters/fields.py``; ``TorchLoader(hf_labels=True)``
applies it).

A stock ``Trainer`` resumes by replaying its data loader past the batches already seen
(``skip_first_batches``), which costs O(steps) and assumes the loader's order is reproducible.
``PortableTrainer`` trains from a ``TorchLoader`` instead: the loader's state is written into every
checkpoint folder (``portable_loader-rank<r>.json``, one small file per rank) on save, restored on
``train(resume_from_checkpoint=...)``, and the Trainer's own batch skipping is turned off
(``ignore_data_skip``). The state saved is that of the batches the optimizer has consumed, also with
gradient accumulation and with the async collator preparing the next batch. ``transformers`` and
``torch`` are imported when ``PortableTrainer`` is first used, so ``hf_fields`` needs neither.

Example:
    >>> import transformers
    >>> import portable_loader as pl
    >>> from portable_loader.adapters.hf import PortableTrainer
    >>> from portable_loader.adapters.torch import TorchLoader
    >>> from portable_loader.precache import sample_args
    >>> src = pl.open_cache(pl.precache(**sample_args(), out="cache"))
    >>> tl = TorchLoader(pl.DataLoader(src, global_batch_size=4, seq_len=64), hf_labels=True)
    >>> model = transformers.LlamaForCausalLM(transformers.LlamaConfig(   # a tiny model, for the example
    ...     vocab_size=1024, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    >>> args = transformers.TrainingArguments("out", max_steps=2, save_steps=1, use_cpu=True, report_to=[],
    ...                                       disable_tqdm=True)
    >>> trainer = PortableTrainer(model=model, args=args, train_loader=tl)
    >>> trainer.remove_callback(transformers.PrinterCallback)   # quiet: this example prints no losses
    >>> trainer.train().global_step
    2
    >>> sorted(f for f in os.listdir("out/checkpoint-1") if f.startswith("portable_loader"))
    ['portable_loader-rank0.json']
    >>> trainer.train(resume_from_checkpoint="out/checkpoint-1").global_step   # the loader resumes in O(1)
    2
    >>> tl.close()
"""

from __future__ import annotations

import json
import os

from portable_loader.adapters.fields import IGNORE_INDEX, hf_fields
from portable_loader.errors import StateError

__all__ = ["IGNORE_INDEX", "PortableTrainer", "hf_fields", "state_file"]

def _rank() -> int:
    import torch

    return torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0


def state_file(checkpoint_dir: str, rank: int | None = None) -> str:
    """Where a rank's loader state lives inside a Trainer checkpoint folder."""
    return os.path.join(checkpoint_dir, f"portable_loader-rank{_rank() if rank is None else rank}.json")


PortableTrainer: type  # a transformers.Trainer subclass, built by __getattr__ on first use


def __getattr__(name: str):
    # PortableTrainer subclasses transformers' Trainer: built on first use, so that importing this
    # module (for hf_fields) never imports transformers.
    if name == "PortableTrainer":
        cls = globals()["PortableTrainer"] = _portable_trainer()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _portable_trainer() -> type:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

    from portable_loader.adapters.torch import TorchLoader

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

    PortableTrainer.__module__, PortableTrainer.__qualname__ = __name__, "PortableTrainer"
    return PortableTrainer
