"""Train a small causal LM on the bundled sample cache with TorchLoader; resume exactly.

    python scripts/train_torch.py --steps 60 --log run.jsonl                       # uninterrupted
    python scripts/train_torch.py --steps 30 --ckpt ckpt.pt --log a.jsonl          # stop at step 30
    python scripts/train_torch.py --steps 60 --ckpt ckpt.pt --resume --log b.jsonl # continue

The resumed run's losses equal the uninterrupted run's, bit for bit: the checkpoint holds the model,
the optimizer and the loader state (``TorchLoader.state_dict()``), and the loader resumes at the next
batch without replaying any. The model attends only within each packed document (segment ids).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import portable_loader as pl
from portable_loader.adapters.torch import TorchLoader
from portable_loader.precache import sample_args


class TinyLM(nn.Module):
    """A two-block transformer; attention is causal and stays inside each packed document."""

    def __init__(self, vocab: int, dim: int = 64, heads: int = 4, blocks: int = 2, max_len: int = 512):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"ln1": nn.LayerNorm(dim), "qkv": nn.Linear(dim, 3 * dim), "out": nn.Linear(dim, dim),
                           "ln2": nn.LayerNorm(dim), "mlp": nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))})
            for _ in range(blocks)
        )
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, positions, segment_ids):
        b, s = input_ids.shape
        x = self.tok(input_ids) + self.pos(positions)
        same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        mask = (same_doc & causal)[:, None]  # [b, 1, s, s]
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + blk["out"](att.transpose(1, 2).reshape(b, s, -1))
            x = x + blk["mlp"](blk["ln2"](x))
        return self.head(self.ln(x))


def loss_fn(model, batch):
    logits = model(batch["input_ids"].long(), batch["positions"].long(), batch["segment_ids"].long())
    # Token t+1 is a target of position t when it is trained and belongs to the same document.
    target = batch["input_ids"][:, 1:].long()
    keep = (batch["loss_mask"][:, 1:] > 0) & (batch["segment_ids"][:, 1:] == batch["segment_ids"][:, :-1])
    per_token = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), target.reshape(-1), reduction="none")
    return (per_token * keep.reshape(-1)).sum() / keep.sum().clamp(min=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="train until this global step")
    p.add_argument("--ckpt", help="checkpoint file, written every --ckpt-every steps and at the end")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--log", help="append {step, loss} lines to this JSONL file")
    p.add_argument("--cache-dir", default="portable_loader_cache")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--num-workers", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    cache = pl.precache(**sample_args(), out=args.cache_dir)
    loader = pl.DataLoader(pl.open_cache(cache), global_batch_size=args.batch, seq_len=args.seq_len, seed=0,
                           packing=True, num_workers=args.num_workers)
    model = TinyLM(vocab=1024, max_len=args.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = 0
    with TorchLoader(loader, device="cpu") as tl:
        if args.resume:
            ckpt = torch.load(args.ckpt, weights_only=False)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optim"])
            tl.load_state_dict(ckpt["data"])
            step = ckpt["step"]
            print(f"resumed at step {step}", file=sys.stderr)
        log = open(args.log, "a") if args.log else None
        while step < args.steps:
            batch = next(tl)
            loss = loss_fn(model, batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            digest = hashlib.sha256(batch["input_ids"].numpy().tobytes()).hexdigest()[:16]
            line = {"step": step, "loss": loss.item(), "batch": digest}
            print(json.dumps(line))
            if log:
                log.write(json.dumps(line) + "\n")
                log.flush()
            if args.ckpt and (step % args.ckpt_every == 0 or step == args.steps):
                tmp = args.ckpt + ".tmp"
                torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "data": tl.state_dict(), "step": step}, tmp)
                os.replace(tmp, args.ckpt)  # a kill mid-save leaves the previous checkpoint intact
    return 0


if __name__ == "__main__":
    sys.exit(main())
