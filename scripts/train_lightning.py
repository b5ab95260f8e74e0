"""Train a tiny language model with a stock Lightning Trainer fed by portable_loader; resume in O(1).

    python scripts/train_lightning.py --out ref --max-steps 30                    # uninterrupted
    python scripts/train_lightning.py --out run --max-steps 30 --stop-after 20    # "preempted" after step 20
    python scripts/train_lightning.py --out run --max-steps 30 --resume           # continues from step=20.ckpt
    python scripts/train_lightning.py --out ddp --devices 2                        # DDP on CPU (gloo)

The loader is wired the plain Lightning way (returned from ``train_dataloader()``, checkpointed by
``ModelCheckpoint(every_n_train_steps=...)``, restored by ``fit(ckpt_path=...)``) plus the one line
that makes the resume exact: ``ExactResume()`` in the callbacks. Each run prints a digest of every
batch trained on and of the final weights: a resumed run ends with the same weights as ``ref``.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import re

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import portable_loader as pl
from portable_loader.adapters.lightning import ExactResume
from portable_loader.adapters.torch import TorchLoader
from portable_loader.precache import sample_args

VOCAB = 1024  # above the sample tokenizer's ids


class TinyLM(L.LightningModule):
    def __init__(self, cache: str, num_workers: int):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 64)
        self.mix = torch.nn.GRU(64, 64, batch_first=True)
        self.head = torch.nn.Linear(64, VOCAB)
        self.cache, self.num_workers = cache, num_workers

    def train_dataloader(self):
        # Built here, where torch.distributed is set up under DDP: each rank then serves its slice.
        loader = pl.DataLoader(pl.open_cache(self.cache), global_batch_size=8 * self.trainer.world_size, seq_len=128,
                               seed=0, packing=True, num_workers=self.num_workers)
        return TorchLoader(loader)

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"].long()
        hidden, _ = self.mix(self.embed(ids[:, :-1]))
        nll = torch.nn.functional.cross_entropy(self.head(hidden).transpose(1, 2), ids[:, 1:], reduction="none")
        mask = batch["loss_mask"][:, 1:].float()
        loss = (nll * mask).sum() / mask.sum().clamp(min=1)
        digest = hashlib.sha256(b"".join(batch[k].cpu().numpy().tobytes() for k in sorted(batch))).hexdigest()[:12]
        print(f"rank {self.global_rank} step {self.global_step} batch {digest} loss {loss.item():.6f}", flush=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class _StopAfter(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def _latest(folder: str) -> str | None:
    found = glob.glob(os.path.join(folder, "step=*.ckpt"))
    return max(found, key=lambda p: int(re.search(r"step=(\d+)", p).group(1))) if found else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="lightning_run")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=0, help="loader worker processes")
    p.add_argument("--devices", type=int, default=1, help="CPU processes; 2 or more run DDP over gloo")
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --out")
    p.add_argument("--stop-after", type=int, help="stop after this step, as a preemption would")
    p.add_argument("--cache-dir", default="portable_loader_cache")
    args = p.parse_args(argv)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    cache = pl.precache(**sample_args(), out=args.cache_dir)
    ckpt = _latest(args.out) if args.resume else None
    if args.resume and ckpt is None:
        p.error(f"no step=*.ckpt in {args.out!r} to resume from")
    callbacks = [ExactResume(), ModelCheckpoint(dirpath=args.out, every_n_train_steps=args.save_steps, save_top_k=-1,
                                                filename="{step}")]
    if args.stop_after:
        callbacks.append(_StopAfter(args.stop_after))
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.max_steps, accumulate_grad_batches=args.grad_accum, callbacks=callbacks, deterministic=True,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )
    model = TinyLM(cache, args.num_workers)
    trainer.fit(model, ckpt_path=ckpt)
    if trainer.global_rank == 0:
        weights = hashlib.sha256(b"".join(v.numpy().tobytes() for v in model.state_dict().values())).hexdigest()
        print(f"done at step {trainer.global_step}; weights {weights[:16]}" + (f" (resumed from {ckpt})" if ckpt else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
