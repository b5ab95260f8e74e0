"""Train a small causal LM in plain JAX on the bundled sample cache; checkpoint with Orbax; resume exactly.

    python scripts/train_jax.py --steps 40 --log full.jsonl
    python scripts/train_jax.py --steps 20 --ckpt /tmp/ck --log a.jsonl
    python scripts/train_jax.py --steps 40 --ckpt /tmp/ck --resume --log b.jsonl   # a + b == full

Batches come from a JaxLoader as global arrays sharded over all devices along the batch axis; the
Orbax checkpoint holds the parameters, the Adam state and the loader state (``LoaderSave``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

import portable_loader as pl
from portable_loader.adapters.jax import JaxLoader, LoaderRestore, LoaderSave
from portable_loader.precache import sample_args

VOCAB, DIM, HEADS = 1024, 64, 4


def init(key, seq_len: int) -> dict:
    k = jax.random.split(key, 6)
    n = lambda key, *shape: jax.random.normal(key, shape) * 0.02  # noqa: E731
    return {"tok": n(k[0], VOCAB, DIM), "pos": n(k[1], seq_len, DIM), "qkv": n(k[2], DIM, 3 * DIM),
            "out": n(k[3], DIM, DIM), "up": n(k[4], DIM, 4 * DIM), "down": n(k[5], 4 * DIM, DIM)}


def norm(x):
    return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)


def logits_fn(p, ids, positions, segments):
    b, s = ids.shape
    x = p["tok"][ids] + p["pos"][positions]
    q, k, v = jnp.split(norm(x) @ p["qkv"], 3, axis=-1)
    q, k, v = (t.reshape(b, s, HEADS, -1) for t in (q, k, v))
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(DIM // HEADS)
    mask = (segments[:, :, None] == segments[:, None, :]) & jnp.tril(jnp.ones((s, s), bool))
    att = jax.nn.softmax(jnp.where(mask[:, None], att, -1e9), axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, DIM) @ p["out"]
    x = x + jax.nn.gelu(norm(x) @ p["up"]) @ p["down"]
    return norm(x) @ p["tok"].T


def loss_fn(p, batch):
    logits = logits_fn(p, batch["input_ids"], batch["positions"], batch["segment_ids"])
    target = batch["input_ids"][:, 1:]
    keep = (batch["loss_mask"][:, 1:] > 0) & (batch["segment_ids"][:, 1:] == batch["segment_ids"][:, :-1])
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    return (nll * keep).sum() / jnp.maximum(keep.sum(), 1)


@jax.jit
def train_step(p, opt, batch):
    loss, g = jax.value_and_grad(loss_fn)(p, batch)
    t = opt["t"] + 1
    m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, opt["m"], g)
    v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, opt["v"], g)
    lr = 3e-3
    p = jax.tree.map(lambda p, m, v: p - lr * (m / (1 - 0.9**t)) / (jnp.sqrt(v / (1 - 0.999**t)) + 1e-8), p, m, v)
    return p, {"t": t, "m": m, "v": v}, loss


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--ckpt", help="Orbax checkpoint directory (saved every --ckpt-every steps and at the end)")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--log", help="append {step, loss} lines to this JSONL file")
    ap.add_argument("--cache-dir", default="portable_loader_cache")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args(argv)

    cache = pl.precache(**sample_args(), out=args.cache_dir)
    loader = pl.DataLoader(pl.open_cache(cache), global_batch_size=args.batch, seq_len=args.seq_len, seed=0, packing=True)
    params = init(jax.random.PRNGKey(0), args.seq_len)
    opt = {"t": jnp.zeros((), jnp.int32), "m": jax.tree.map(jnp.zeros_like, params), "v": jax.tree.map(jnp.zeros_like, params)}
    state = {"params": params, "opt": opt}
    step = 0
    mngr = ocp.CheckpointManager(os.path.abspath(args.ckpt)) if args.ckpt else None
    with JaxLoader(loader) as jl:
        # Parameters replicated on the loader's mesh (restores take their layout from this target).
        replicated = NamedSharding(jl.sharding.mesh, PartitionSpec())
        state = jax.device_put(state, replicated)
        if args.resume:
            step = mngr.latest_step()
            restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(state),
                                                                  data=LoaderRestore(jl)))
            state = restored["state"]
            print(f"resumed at step {step}", file=sys.stderr)
        log = open(args.log, "a") if args.log else None
        while step < args.steps:
            p, o, loss = train_step(state["params"], state["opt"], next(jl))
            state = {"params": p, "opt": o}
            step += 1
            line = json.dumps({"step": step, "loss": float(loss)})
            print(line)
            if log:
                log.write(line + "\n")
                log.flush()
            if mngr and (step % args.ckpt_every == 0 or step == args.steps):
                mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=LoaderSave(jl)))
        if mngr:
            mngr.wait_until_finished()
            mngr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
