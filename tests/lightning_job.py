"""A tiny Lightning run on CPU that records what training_step received; shared by test_lightning.py
and test_lightning_hooks.py (which import it inside their tests: Lightning takes seconds to import),
and run as a script for the DDP case:

    python lightning_job.py CACHE OUT_DIR RESULT_PREFIX [CKPT]

(Lightning's DDP launcher starts rank 1 by running this same command again.)"""

import hashlib
import json
import os
import random
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import portable_loader as pl
from portable_loader.adapters.lightning import ExactResume
from portable_loader.adapters.torch import TorchLoader
from portable_loader.precache import build_cache, sample_args

VOCAB = 1024  # above the sample tokenizer's 911 ids

# Loader settings per case: serial, async collation with prefetch 2, and 2 worker processes.
MODES = {
    "serial": dict(loader=dict(packing=False), torch=dict(async_collation=False)),
    "async": dict(loader=dict(packing=True, prefetch=2), torch=dict(async_collation=True)),
    "workers": dict(loader=dict(packing=True, num_workers=2), torch=dict(async_collation=True)),
}


def make_cache(folder: str) -> str:
    """24 distinct text records of 8 to 60 words through the sample tokenizer: no two batches alike,
    so a skipped or repeated batch always shows (the bundled chat sample repeats two templates)."""
    rng = random.Random(0)
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november".split()
    path = os.path.join(folder, "records.jsonl")
    with open(path, "w") as f:
        for i in range(24):
            f.write(json.dumps({"text": f"record {i}: " + " ".join(rng.choices(words, k=rng.randint(8, 60)))}) + "\n")
    return build_cache(path, tokenizer=sample_args()["tokenizer"], format="text", out=os.path.join(folder, "cache"))[0]


def digest(batch: dict) -> str:
    return hashlib.sha256(b"".join(batch[k].cpu().numpy().tobytes() for k in sorted(batch))).hexdigest()[:16]


def make_loader(cache: str, mode: str, global_batch_size: int = 4) -> pl.DataLoader:
    # 24 records and 4 per step: the loader's own epochs end every 6 batches (fewer when packing).
    return pl.DataLoader(pl.open_cache(cache), global_batch_size=global_batch_size, seq_len=64, seed=3,
                         **MODES[mode]["loader"])


class TinyLM(L.LightningModule):
    """An embedding and a linear head (33K parameters), trained on next-token loss; records each batch."""

    def __init__(self, cache: str | None = None, mode: str = "serial", loader_cls=TorchLoader):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)
        self.cache, self.mode, self.loader_cls = cache, mode, loader_cls
        self.seen, self.losses = [], []

    def train_dataloader(self):
        # Built here, after Lightning has set up torch.distributed, so each DDP rank gets its own slice.
        return self.loader_cls(make_loader(self.cache, self.mode, global_batch_size=4 * self.trainer.world_size),
                               **MODES[self.mode]["torch"])

    def training_step(self, batch, batch_idx):
        self.seen.append(digest(batch))
        ids = batch["input_ids"].long()
        logits = self.head(self.embed(ids[:, :-1]))
        mask = batch["loss_mask"][:, 1:].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none")
        loss = (nll * mask.reshape(-1)).sum() / mask.sum().clamp(min=1)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Module(TinyLM):
    """Without train_dataloader(): the loader comes from fit(train_dataloaders=...) or a DataModule."""

    train_dataloader = L.LightningModule.train_dataloader


class DataModule(L.LightningDataModule):
    def __init__(self, cache):
        super().__init__()
        self.cache = cache

    def train_dataloader(self):
        return TorchLoader(make_loader(self.cache, "serial"), async_collation=False)


# The hooks' cases (test_lightning_hooks.py).


class Watch(L.Callback):
    """What a checkpoint taken at the end of each batch would store, and the loader's class then."""

    def __init__(self):
        self.states, self.classes = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.states.append(trainer.train_dataloader.state_dict())
        self.classes.append(type(trainer.train_dataloader))


class WithValidation(TinyLM):
    def validation_step(self, batch, batch_idx):
        self.validated = getattr(self, "validated", 0) + 1

    def val_dataloader(self):
        return TorchLoader(make_loader(self.cache, "serial", global_batch_size=4), async_collation=False)


class OneEpochLoaders(TinyLM):
    """A finite train loader (one loader epoch: 6 batches), made anew for every Lightning epoch."""

    def train_dataloader(self):
        return TorchLoader(finite(self.cache), async_collation=False)


def finite(cache):
    return pl.DataLoader(pl.open_cache(cache), global_batch_size=4, seq_len=64, seed=3, num_epochs=1)


def trainer(out: str, *, max_steps: int, every: int, accum: int = 2, resume: bool = True, **kw) -> L.Trainer:
    callbacks = [ModelCheckpoint(dirpath=out, every_n_train_steps=every, save_top_k=-1, filename="{step}")]
    return L.Trainer(
        accelerator="cpu", max_steps=max_steps, accumulate_grad_batches=accum, deterministic=True, logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=([ExactResume()] if resume else []) + callbacks, **kw,
    )


def weights(model: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(v.numpy().tobytes() for v in model.state_dict().values())).hexdigest()


def main(cache: str, out: str, result: str, ckpt: str | None = None) -> None:
    torch.use_deterministic_algorithms(True)
    # The resumed run also tries a mis-wired loader, built here, before the process group exists (it
    # serves the whole batch), once its own fit is done: fit must refuse it. (Its own run would cost two
    # more Lightning starts.)
    early = TorchLoader(make_loader(cache, "async", global_batch_size=8)) if ckpt else None
    model = TinyLM(cache, "async")
    t = trainer(out, max_steps=4, every=2, devices=2, strategy="ddp")
    t.fit(model, ckpt_path=ckpt)
    with open(f"{result}-rank{t.global_rank}.json", "w") as f:
        json.dump({"seen": model.seen, "losses": model.losses, "weights": weights(model)}, f)
    if early is not None:
        try:
            trainer(f"{out}-early", max_steps=4, every=2, devices=2, strategy="ddp").fit(
                TinyLM(cache, "async"), train_dataloaders=early)
            refused = "fit took it"
        except RuntimeError as e:
            refused = str(e)
        with open(f"{result}-rank{t.global_rank}-early.txt", "w") as f:
            f.write(refused)


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    main(*sys.argv[1:])
