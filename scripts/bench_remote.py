"""Benchmark: a cache in object storage (moto's S3 server on 127.0.0.1) against the same cache on local disk.

    python scripts/bench_remote.py                       # defaults: a few minutes on 2 shared cores
    python scripts/bench_remote.py --shards 24 --rows 120 --steps 300

Three measurements, each against its peer in the same run:

1. Warm speed: padded 8 x 2048 batches/s from ``open_cache(url)`` whose shards are all local already,
   against ``open_cache(local copy)``; interleaved rounds, the median of per-round ratios (target >= 0.8).
2. Cold epoch bytes: one epoch from an empty ``cache_dir`` with ``cache_limit`` = 3 shards, bytes
   downloaded as a multiple of the cache's shard bytes, for ``shuffle="shards"`` (K = 1, 2; K = 2
   packed, windows of 256) and the global shuffle.
3. Shuffle quality (from the orders alone, over 1,000 shards of 1,000 records): the probability that
   the next record in the stream comes from the same shard as the one before it (the global shuffle:
   about 1/shards; shards K: about 1/K), and the distinct shards in a batch of 64 records.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from benchlib import _figure, add_output_args, load, machine, write_svg, write_table  # noqa: E402

import portable_loader as pl  # noqa: E402
from portable_loader.cache import FORMAT_VERSION, ShardWriter, write_manifest  # noqa: E402
from portable_loader.cache.remote import upload_cache  # noqa: E402
from portable_loader.orders.shard_order import ShardShuffle  # noqa: E402
from portable_loader.orders.sampler import LCGSampler  # noqa: E402

B, S = 8, 2048
ROUNDS = 7


def build_cache(path: str, shards: int, rows: int, seed: int = 0) -> str:
    """``shards`` Arrow shards of ``rows`` synthetic records (64..3000 tokens), the project's own writer."""
    rng = np.random.default_rng(seed)
    os.makedirs(path)
    written, tokens = [], 0
    for s in range(shards):
        w = ShardWriter(os.path.join(path, f"data-{s:05d}-of-{shards:05d}.arrow"), "arrow")
        for k in rng.integers(64, 3000, rows).tolist():
            w.write(rng.integers(0, 32000, k, dtype=np.int32), np.ones(k, np.uint8))
            tokens += k
        written.append(w.close())
    n = shards * rows
    counts = {"rows_in": n, "rows_out": n, "dropped": {}, "truncated": 0, "tokens": tokens, "trainable_tokens": tokens}
    write_manifest(path, {"format_version": FORMAT_VERSION, "backend": "arrow", "key": f"{seed:064d}",
                          "counts": counts, "content_checksum": f"synthetic-{seed}", "shards": written})
    return path


def start_s3():
    """moto's S3 server on 127.0.0.1, fsspec pointed at it (as tests/test_s3.py does)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update({"FSSPEC_S3_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_EC2_METADATA_DISABLED": "true"})
    import fsspec.config
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    fsspec.config.set_conf_env(fsspec.config.conf)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir("bench")
    return server


def timed(src, steps: int, **kw) -> tuple[float, float]:
    """(seconds to the first batch: opening files, planning the first chunk; the steady batches/s after it)."""
    t = time.perf_counter()
    it = iter(pl.DataLoader(src, global_batch_size=B, seq_len=S, seed=0, prefetch=0, **kw))
    with it:
        next(it)
        first = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(steps):
            next(it)
        return first, steps / (time.perf_counter() - t)


def warm_speed(url: str, local: str, cache_dir: str, steps: int) -> dict:
    remote = pl.open_cache(url, cache_dir=cache_dir)
    remote.prefetch(np.arange(len(remote)))  # every shard local: what is left is the read path
    here = pl.open_cache(local)
    rounds, firsts = {"local": [], "remote": []}, {"local": [], "remote": []}
    for _ in range(ROUNDS):  # interleaved: a loaded machine slows both of one round alike
        for name, src in (("local", here), ("remote", remote)):
            first, rate = timed(src, steps)
            firsts[name].append(first)
            rounds[name].append(rate)
    ratio = float(np.median(np.array(rounds["remote"]) / np.array(rounds["local"])))
    return {"local": max(rounds["local"]), "remote": max(rounds["remote"]), "ratio": ratio,
            "first_local": float(np.median(firsts["local"])), "first_remote": float(np.median(firsts["remote"])),
            "load": load()}


def cold_bytes(url: str, limit: int, total: int, tmp: str) -> dict:
    out = {}
    for label, kw in (("shards K=1", dict(shuffle="shards", shuffle_shards=1)),
                      ("shards K=2", dict(shuffle="shards", shuffle_shards=2)),
                      ("shards K=2, packed", dict(shuffle="shards", shuffle_shards=2, packing=True, packing_window=256)),
                      ("global", {})):
        src = pl.open_cache(url, cache_dir=os.path.join(tmp, label.replace(" ", "_").replace("=", "")), cache_limit=limit)
        t = time.perf_counter()
        with iter(pl.DataLoader(src, global_batch_size=B, seq_len=S, seed=0, num_epochs=1, prefetch=0, **kw)) as it:
            next(it)  # start-up: the first shards downloaded, timed apart from the epoch's steady rate
            first, t = time.perf_counter() - t, time.perf_counter()
            steps = sum(1 for _ in it)
        out[label] = (src.remote["bytes_downloaded"] / total, src.remote["fetches"], steps / (time.perf_counter() - t),
                      first, load())
    return out


def quality(shards: int = 1000, rows: int = 1000, batch: int = 64) -> dict:
    """Same-shard neighbour probability and distinct shards per batch, over one epoch's order."""
    n = shards * rows
    orders = {"global": LCGSampler(n, seed=0).record_indices(np.arange(n))}
    for k in (1, 2, 4, 8, 16, 64):
        orders[f"shards K={k}"] = ShardShuffle([rows] * shards, k, seed=0).stream_indices(np.arange(n))
    out = {}
    for label, recs in orders.items():
        owner = recs // rows
        same = float(np.mean(owner[1:] == owner[:-1]))
        per_batch = owner[: n - n % batch].reshape(-1, batch)
        distinct = float(np.mean([len(np.unique(b)) for b in per_batch[:2000]]))
        out[label] = (same, distinct)
    return out


def main() -> None:
    p = add_output_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]), "remote")
    p.add_argument("--shards", type=int, default=24)
    p.add_argument("--rows", type=int, default=120, help="records per shard")
    p.add_argument("--steps", type=int, default=1000, help="steps per warm timing round")
    args = p.parse_args()
    print(machine())
    server = start_s3()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            local = build_cache(os.path.join(tmp, "synthetic"), args.shards, args.rows)
            url = "s3://bench/caches/synthetic"
            upload_cache(local, url)
            sizes = [s["bytes"] for s in pl.open_cache(local).manifest["shards"]]
            total, limit = sum(sizes), 3 * max(sizes)
            print(f"cache: {args.shards} shards x {args.rows} records, {total / 1e6:.1f} MB; cache_limit {limit / 1e6:.2f} MB")
            warm = warm_speed(url, local, os.path.join(tmp, "warm"), args.steps)
            print(f"warm: first batch remote {warm['first_remote']:.3f} s, local {warm['first_local']:.3f} s; steady remote "
                  f"{warm['remote']:.0f} batches/s, local {warm['local']:.0f}: ratio {warm['ratio']:.2f} (median of {ROUNDS} "
                  f"rounds; load {warm['load']:.1f})")
            rows += [["warm batches/s", "local cache", warm["local"]], ["warm batches/s", "remote cache, shards local", warm["remote"]],
                     ["warm ratio remote/local", "median of rounds", warm["ratio"]],
                     ["warm first batch s", "local cache", warm["first_local"]],
                     ["warm first batch s", "remote cache, shards local", warm["first_remote"]],
                     ["load average", "warm", warm["load"]]]
            cold = cold_bytes(url, limit, total, tmp)
            for label, (ratio, fetches, per_s, first, now) in cold.items():
                print(f"cold epoch, {label}: {ratio:.2f}x the cache's bytes ({fetches} shard fetches), first batch "
                      f"{first:.3f} s, then {per_s:.0f} batches/s (load {now:.1f})")
                rows += [["cold epoch bytes / cache bytes", label, ratio], ["cold epoch shard fetches", label, fetches],
                         ["cold epoch batches/s", label, per_s], ["cold epoch first batch s", label, first],
                         ["load average", f"cold, {label}", now]]
    finally:
        server.stop()
    qual = quality()
    for label, (same, distinct) in qual.items():
        print(f"order {label}: P(next record from the same shard) {same:.4f}, distinct shards per 64 records {distinct:.1f}")
        rows += [["P(same shard as previous record)", label, same], ["distinct shards per 64 records", label, distinct]]
    write_table(args, ["measure", "config", "value"], rows)
    if args.svg != "-":
        plot(args, warm, cold, qual)


def plot(args, warm: dict, cold: dict, qual: dict) -> None:
    plt, (fig, ax) = _figure(4.2)
    fig.clf()
    axes = fig.subplots(1, 3)
    ax0, ax1, ax2 = axes
    ax0.bar(["local", "remote\n(warm)"], [warm["local"], warm["remote"]], color=["tab:gray", "tab:blue"])
    ax0.set_ylabel("batches/s (8 x 2048, padded)")
    ax0.set_title(f"warm: ratio {warm['ratio']:.2f}", fontsize=9)
    labels = list(cold)
    ax1.bar([k.replace(", ", "\n") for k in labels], [cold[k][0] for k in labels],
            color=["tab:gray" if k == "global" else "tab:blue" for k in labels])
    ax1.axhline(1.5, color="tab:red", lw=0.8, ls="--")
    ax1.set_yscale("log")
    for x, k in enumerate(labels):
        ax1.text(x, cold[k][0], f"{cold[k][0]:.2f}x", ha="center", va="bottom", fontsize=8)
    ax1.set_ylabel("bytes downloaded / cache bytes (1.5x dashed)")
    ax1.set_title("one cold epoch, cache_limit = 3 shards", fontsize=9)
    labels = list(qual)
    ax2.barh(labels[::-1], [qual[k][0] for k in labels][::-1], color="tab:blue")
    ax2.set_xscale("log")
    ax2.set_xlabel("P(next record from the same shard)")
    ax2.set_title("order locality, 1000 shards", fontsize=9)
    for a in axes:
        a.tick_params(labelsize=7)
    fig.suptitle(f"Remote cache (moto S3 on 127.0.0.1) vs local\n{machine()}", fontsize=9)
    write_svg(args, plt, fig)


if __name__ == "__main__":
    main()
