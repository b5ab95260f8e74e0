"""Benchmark: a real bf16 training step fed by the loader, against the same batch staged on the GPU.

    python scripts/bench_gpu_train.py                 # on a machine with a CUDA GPU
    python scripts/bench_gpu_train.py --sizes small --steps 50 --workers 4
    # writes docs/bench/gpu_train.csv and .svg (--csv/--svg), as every scripts/bench_*.py

Without a CUDA GPU (or torch) it prints one line saying so and exits 0, writing nothing.

One flat uint16 corpus of ``--tokens`` tokens (EOS between documents of ~800 tokens), concat windows
of ``--batch`` x ``--seq-len``. A small decoder-only transformer (``torch.nn.TransformerEncoder``
with a causal mask, bf16 autocast, AdamW) at three sizes; each step reads the batch, runs forward and
backward, steps the optimizer and logs the loss (``loss.item()``: a synchronization, as a real loop
has). For each size, in interleaved rounds (the median is reported), steps/s of:

* ``staged``: the same batch kept on the GPU: the rate no loader can beat;
* ``serial``: ``TorchLoader(async_collation=False)``, ``--workers`` worker processes;
* ``async``: ``TorchLoader`` (the default: the next batch collated and copied on a side stream
  during the step), ``--workers`` workers;
* ``torch``: ``torch.utils.data.DataLoader(pin_memory=True, num_workers=--workers)`` over a map-style
  dataset of the same windows (``input_ids`` int64), copied with ``non_blocking=True``;
* ``jax``: ``JaxLoader`` (prefetch 2, ``--workers`` workers) feeding a jitted step (an embedding, a
  matmul and a softmax cross-entropy, bf16, the medium width), against the same batch staged as a
  ``jax.Array`` (``jax-staged``); where JAX sees no GPU these rows are left out.

Each row is the fraction of the staged rate (the goal: >= 0.99 at every size, ahead of torch's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cuda import no_gpu  # noqa: E402
from benchlib import add_output_args, machine, write_table  # noqa: E402

try:
    import torch
except ImportError:
    torch = None

SIZES = {"small": (256, 4, 4), "medium": (512, 8, 8), "large": (1024, 16, 8)}  # width, heads, layers


def make_corpus(path: str, tokens: int, vocab: int) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocab, tokens).astype(np.uint16)
    ids[rng.choice(tokens, tokens // 800, replace=False)] = 0
    ids.tofile(path)


class Windows:
    def __init__(self, path, seq):
        self.path, self.seq, self.ids = path, seq, None

    def __len__(self):
        return os.path.getsize(self.path) // 2 // self.seq

    def __getitem__(self, i):
        if self.ids is None:
            self.ids = np.memmap(self.path, dtype=np.uint16, mode="r")
        return self.ids[i * self.seq:(i + 1) * self.seq].astype(np.int64)

    def __getstate__(self):
        return {"path": self.path, "seq": self.seq, "ids": None}


def model_of(size: str, vocab: int, seq: int, device):
    width, heads, layers = SIZES[size]
    layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, batch_first=True, norm_first=True)
    net = torch.nn.ModuleDict({"emb": torch.nn.Embedding(vocab, width), "body": torch.nn.TransformerEncoder(layer, layers),
                               "head": torch.nn.Linear(width, vocab)}).to(device)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(seq, device=device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)

    def step(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = net["body"](net["emb"](ids[:, :-1]), mask=mask[:-1, :-1], is_causal=True)
            loss = torch.nn.functional.cross_entropy(net["head"](h).float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def steps_per_s(step, batches, n: int) -> float:
    for _ in range(3):  # warm-up: kernels, allocator, the loader's workers
        step(next(batches))
    t = time.perf_counter()
    for _ in range(n):
        step(next(batches))
    return n / (time.perf_counter() - t)


def contenders(path, args, device):
    import portable_loader as pl
    from portable_loader.adapters.torch import TorchLoader

    docs = pl.pretokenized(path, eos_token_id=0)
    kw = dict(global_batch_size=args.batch, seq_len=args.seq_len, packing="concat", num_workers=args.workers,
              fields=("input_ids", "attention_mask"))

    def ours(async_collation):
        def batches():
            with TorchLoader(pl.DataLoader(docs, **kw), device=device, async_collation=async_collation) as tl:
                for b in tl:
                    yield b["input_ids"].long()
        return batches

    def torch_loader():
        dl = torch.utils.data.DataLoader(Windows(path, args.seq_len), batch_size=args.batch, shuffle=True,
                                         num_workers=args.workers, pin_memory=True, drop_last=True)
        while True:
            for b in dl:
                yield b.to(device, non_blocking=True)

    return {"serial": ours(False), "async": ours(True), "torch": torch_loader}


def jax_rows(path, args) -> list:
    """``JaxLoader`` feeding a jitted step (embedding, one matmul, cross-entropy, bf16) against the batch staged."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return []
    if not any(d.platform == "gpu" for d in jax.devices()):
        print("jax: no GPU visible to JAX; its rows are left out", flush=True)
        return []
    import portable_loader as pl
    from portable_loader.adapters.jax import JaxLoader

    width = SIZES["medium"][0]
    key = jax.random.PRNGKey(0)
    params = {"emb": jax.random.normal(key, (args.vocab, width), jnp.bfloat16) * 0.02,
              "w": jax.random.normal(key, (width, width), jnp.bfloat16) * 0.02}

    @jax.jit
    def train(params, ids):
        def loss_fn(p):
            h = jnp.tanh(p["emb"][ids[:, :-1]] @ p["w"])
            logits = (h @ p["emb"].T).astype(jnp.float32)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1))
        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda a, g: a - 1e-4 * g, params, grads), loss

    state = {"p": params}

    def step(ids):
        state["p"], loss = train(state["p"], ids)
        return float(loss)

    staged = jnp.asarray(Windows(path, args.seq_len)[0][None].repeat(args.batch, 0).astype(np.int32))
    kw = dict(global_batch_size=args.batch, seq_len=args.seq_len, packing="concat", num_workers=args.workers,
              fields=("input_ids", "attention_mask"))

    def fed():
        with JaxLoader(pl.DataLoader(pl.pretokenized(path, eos_token_id=0), **kw), prefetch=2) as jl:
            for b in jl:
                yield b["input_ids"]

    rates = {"jax-staged": [], "jax": []}
    for _ in range(args.rounds):
        rates["jax-staged"].append(steps_per_s(step, iter(lambda: staged, None), args.steps))
        gen = fed()
        rates["jax"].append(steps_per_s(step, gen, args.steps))
        gen.close()
    base = statistics.median(rates["jax-staged"])
    out = []
    for name, got in rates.items():
        rate = statistics.median(got)
        out.append(["jax-medium", name, args.workers, round(rate, 2), round(rate / base, 4)])
        print(f"jax {name}: {rate:.2f} steps/s, {rate / base:.3f} of staged", flush=True)
    return out


def main() -> int:
    p = add_output_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), "gpu_train")
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=20_000_000)
    p.add_argument("--vocab", type=int, default=32_000)
    args = p.parse_args()
    why = no_gpu()
    if why:
        print(f"bench_gpu_train: {why}; nothing measured")
        return 0
    device = torch.device("cuda")
    print(f"machine: {machine()}, {torch.cuda.get_device_name(device)}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "corpus.bin")
        make_corpus(path, args.tokens, args.vocab)
        staged_batch = torch.from_numpy(Windows(path, args.seq_len)[0][None].repeat(args.batch, 0)).to(device)
        for size in args.sizes:
            step = model_of(size, args.vocab, args.seq_len, device)
            rates = {name: [] for name in ("staged", "serial", "async", "torch")}
            feeds = contenders(path, args, device)
            for _ in range(args.rounds):
                rates["staged"].append(steps_per_s(step, iter(lambda: staged_batch, None), args.steps))
                for name, make in feeds.items():
                    gen = make()
                    rates[name].append(steps_per_s(step, gen, args.steps))
                    gen.close()
            staged = statistics.median(rates["staged"])
            for name, got in rates.items():
                rate = statistics.median(got)
                rows.append([size, name, args.workers, round(rate, 2), round(rate / staged, 4)])
                print(f"{size} {name}: {rate:.2f} steps/s, {rate / staged:.3f} of staged", flush=True)
        rows += jax_rows(path, args)
    write_table(args, ["size", "feed", "workers", "steps_per_s", "of_staged"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
