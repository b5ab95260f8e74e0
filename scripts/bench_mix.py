"""Benchmark and comparison: pl.mix against Grain's MapDataset.mix, Megatron-style blending and multinomial draws.

    python scripts/bench_mix.py                 # synthetic caches, 400 batches per contender and round
    python scripts/bench_mix.py --steps 300 --rounds 5 --positions 200000
    # writes docs/bench/mix.csv and mix.svg (--csv/--svg), as every scripts/bench_*.py

Speed (8 x 2048 batches, one process, no workers, 15 interleaved rounds; ratios are medians of
per-round ratios), padded and packed:
  (a) portable_loader over one cache, (b) pl.mix over three caches, (c) pl.mix over 60 caches of
  1,000 records each (weights 1..5), and, padded only, (d) Grain's MapDataset.mix over
  MapDataset.source() of the three caches (each shuffled and repeated), then map(pad).batch(8);
  and DataLoader.describe() steps per second (each round on fresh loaders; the best round).
Mixing methods, measured over the same weights: the largest |count_i - w_i * n| over the first n
records (at every record, and at block boundaries for pl.mix), index memory, what a weight change
costs, what resuming needs, and whether the stream depends on the number of workers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from benchlib import add_output_args, bar_svg, load, machine, write_table  # noqa: E402

import portable_loader as pl  # noqa: E402
from portable_loader.cache import FORMAT_VERSION, ShardWriter, write_manifest  # noqa: E402

B, S = 8, 2048
SIZES = {"web": 60_000, "code": 30_000, "math": 10_000}
WEIGHTS = {"web": 0.55, "code": 0.3, "math": 0.15}
MANY, MANY_ROWS = 60, 1_000  # the many-source mixture: 60 caches of 1,000 records
MANY_WEIGHTS = {f"s{i:02d}": 1 + i % 5 for i in range(MANY)}  # integers: float weights would need a huge block


def build_cache(path: str, n: int, seed: int) -> str:
    """``n`` synthetic records of 64..3000 tokens written with the project's own cache writer (Arrow)."""
    rng = np.random.default_rng(seed)
    os.makedirs(path)
    w = ShardWriter(os.path.join(path, "data-00000-of-00001.arrow"), "arrow")
    tokens = 0
    for k in rng.integers(64, 3000, n).tolist():
        ids = rng.integers(0, 32000, k, dtype=np.int32)
        w.write(ids, np.ones(k, np.uint8))
        tokens += k
    shard = w.close()
    counts = {"rows_in": n, "rows_out": n, "dropped": {}, "truncated": 0, "tokens": tokens, "trainable_tokens": tokens}
    write_manifest(path, {"format_version": FORMAT_VERSION, "backend": "arrow", "key": f"{seed:064d}",
                          "counts": counts, "content_checksum": f"synthetic-{seed}", "shards": [shard]})
    return path


def timed(batches, steps: int) -> tuple[float, float]:
    """(seconds to the first batch: opening files, planning the first chunk; the steady batches/s after it)."""
    t = time.perf_counter()
    next(batches)
    first = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(steps):
        next(batches)
    return first, steps / (time.perf_counter() - t)


def ours(src, packing: bool = False):
    return iter(pl.DataLoader(src, global_batch_size=B, seq_len=S, seed=0, prefetch=0, packing=packing))


def _pad(r: dict) -> dict:
    n = min(S, len(r["input_ids"]))
    ids, mask, seg = np.zeros(S, np.int32), np.zeros(S, np.uint8), np.zeros(S, np.int32)
    ids[:n], mask[:n], seg[:n] = r["input_ids"][:n], r["loss_mask"][:n], 1
    return {"input_ids": ids, "loss_mask": mask, "segment_ids": seg}


def grain_mix(caches: dict):
    import grain

    parts = [grain.MapDataset.source(c).shuffle(seed=i).repeat() for i, c in enumerate(caches.values())]
    ds = grain.MapDataset.mix(parts, [WEIGHTS[n] for n in caches]).map(_pad).batch(B)
    return (ds[i] for i in range(sys.maxsize))


def speed(paths: dict, many: dict, steps: int, rounds: int) -> dict:
    caches = {n: pl.open_cache(p) for n, p in paths.items()}
    mixture = pl.mix(caches, WEIGHTS)
    mixture_many = pl.mix({n: pl.open_cache(p) for n, p in many.items()}, MANY_WEIGHTS)
    contenders = {}  # (what, padded or packed) -> (label, a fresh iterator)
    for kind, packing in (("padded", False), ("packed", True)):
        contenders["one", kind] = (f"(a) portable_loader, one cache, {kind}", lambda p=packing: ours(caches["web"], p))
        contenders["mix", kind] = (f"(b) pl.mix, three caches, {kind}", lambda p=packing: ours(mixture, p))
        contenders["many", kind] = (f"(c) pl.mix, {MANY} caches, {kind}", lambda p=packing: ours(mixture_many, p))
    contenders["grain", "padded"] = ("(d) Grain MapDataset.mix, same three caches, padded", lambda: grain_mix(caches))
    per_round = {key: [] for key in contenders}
    firsts = {key: [] for key in contenders}
    loads = []
    for _ in range(rounds):  # interleaved rounds: a loaded machine slows the contenders of one round alike
        for key, (_, make) in contenders.items():
            first, rate = timed(make(), steps)
            firsts[key].append(first)
            per_round[key].append(rate)
        loads.append(load())
    best = {label: max(per_round[key]) for key, (label, _) in contenders.items()}
    best["first"] = {label: float(np.median(firsts[key])) for key, (label, _) in contenders.items()}
    best["loads"] = (min(loads), max(loads))

    def ratio(x, y, kind):  # per round, then the median
        return float(np.median(np.array(per_round[x, kind]) / np.array(per_round[y, kind])))

    best["ratios"] = {f"{what} vs one source, {kind}": ratio(x, "one", kind)
                      for x, what in (("mix", "3-source mix"), ("many", f"{MANY}-source mix"))
                      for kind in ("padded", "packed")}
    best["ratios"]["3-source mix vs Grain's mix, padded"] = ratio("mix", "grain", "padded")
    described = {k: [] for k in ("padded, sequential steps", "padded, random steps < 10^9", "packed, sequential steps")}
    n = 5 * steps
    rng = np.random.default_rng(0)
    for _ in range(rounds):  # a single timing of each swung 2-3x on this machine: the best of the rounds
        for (name, packing), picks in zip(((k, k.startswith("packed")) for k in described),
                                          (range(n), rng.integers(0, 10**9, n).tolist(), range(steps))):
            loader = pl.DataLoader(mixture, global_batch_size=B, seq_len=S, seed=0, packing=packing)
            t = time.perf_counter()
            for s in picks:
                loader.describe(s)
            described[name].append(len(picks) / (time.perf_counter() - t))
    best.update({f"describe, {name}": max(rates) for name, rates in described.items()})
    return best


# --- mixing methods -------------------------------------------------------------------------------


def drift(sources: np.ndarray, weights: list[float], marks: np.ndarray | None = None) -> float:
    """Largest |count_i(n) - w_i n| over every prefix n (or the prefixes ending at ``marks``)."""
    worst = 0.0
    n = np.arange(1, len(sources) + 1)
    for i, w in enumerate(weights):
        dev = np.abs(np.cumsum(sources == i) - w * n)
        worst = max(worst, float(dev.max() if marks is None else dev[marks - 1].max()))
    return worst


def ours_stream(n: int, seed: int = 0, block: int | None = None) -> tuple[np.ndarray, int]:
    recs = {k: [{"input_ids": [0]}] * v for k, v in SIZES.items()}
    m = pl.mix(recs, WEIGHTS, block=block)
    src, _ = m.stream_order(seed).sources_at(np.arange(n))
    return src, m.stages[0].block


def grain_stream(n: int) -> np.ndarray:
    import grain

    parts = [grain.MapDataset.source([i] * 7).repeat() for i in range(len(SIZES))]
    ds = grain.MapDataset.mix(parts, list(WEIGHTS.values()))
    return np.array([ds[i] for i in range(n)])


def grain_length() -> int:
    import grain

    parts = [grain.MapDataset.source([i] * n) for i, n in enumerate(SIZES.values())]
    return len(grain.MapDataset.mix(parts, list(WEIGHTS.values())))


def megatron_indices(weights: list[float], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron-LM's BlendedDataset index build (helpers.cpp ``build_blending_indices``): sample i goes
    to the dataset with the largest error ``w_d * max(i, 1) - count_d``; O(n) arrays, built up front."""
    dataset_index = np.empty(n, np.int16)
    sample_index = np.empty(n, np.int64)
    counts = np.zeros(len(weights), np.int64)
    w = np.asarray(weights)
    for i in range(n):
        d = int(np.argmax(w * max(i, 1) - counts))
        dataset_index[i], sample_index[i] = d, counts[d]
        counts[d] += 1
    return dataset_index, sample_index


def multinomial_stream(n: int, workers: int, seed: int = 0) -> np.ndarray:
    """Per-worker RNGs (seed + worker id), workers' samples interleaved round-robin: the usual
    IterableDataset pattern."""
    rngs = [np.random.default_rng(seed + k) for k in range(workers)]
    per = -(-n // workers)
    draws = [r.choice(len(WEIGHTS), size=per, p=list(WEIGHTS.values())) for r in rngs]
    return np.stack(draws, axis=1).reshape(-1)[:n]


def loader_worker_independence() -> bool:
    recs = {k: [{"input_ids": np.full(1 + i % 7, i, np.int32)} for i in range(v // 1000)] for k, v in SIZES.items()}
    mixture = pl.mix(recs, WEIGHTS)
    out = []
    for workers in (0, 2):
        with iter(pl.DataLoader(mixture, global_batch_size=B, seq_len=16, seed=0, num_workers=workers)) as it:
            out.append([next(it)["input_ids"] for _ in range(50)])
    return all(np.array_equal(a, b) for a, b in zip(*out))


def resume_cost(paths: dict) -> tuple[int, float]:
    mixture = pl.mix({n: pl.open_cache(p) for n, p in paths.items()}, WEIGHTS)
    loader = pl.DataLoader(mixture, global_batch_size=B, seq_len=S, seed=0, prefetch=0)
    it = iter(loader)
    next(it)
    state = dict(it.get_state())
    state.update(step=10**6, schedule=mixture.schedule_digests(10**6 * B))
    state.pop("digest")
    from portable_loader.state import _digest

    state["digest"] = _digest(state)
    it = iter(loader)
    t = time.perf_counter()
    it.set_state(state)
    next(it)
    return len(json.dumps(state)), time.perf_counter() - t


def methods(n: int, paths: dict) -> list[tuple]:
    w = list(WEIGHTS.values())
    rows = []
    src, block = ours_stream(n)
    marks = np.arange(block, n + 1, block)
    t = time.perf_counter()
    ours_stream(n, seed=1)
    ours_t = time.perf_counter() - t
    state_bytes, resume_s = resume_cost(paths)
    rows.append(("pl.mix (default block %d)" % block, drift(src, w), drift(src, w, marks),
                 "none (O(#sources) per block)", f"none: next stage starts at any block boundary ({ours_t:.2f} s per {n:,} positions computed)",
                 f"JSON state {state_bytes} B, first batch at step 10^6 after {resume_s * 1e3:.1f} ms",
                 "same stream for 0 and 2 workers: %s" % loader_worker_independence()))
    g = grain_stream(n)
    from grain._src.python.dataset.transformations.mix import _float_to_int_proportions

    share = np.bincount(g, minlength=len(w)) / n
    period = sum(_float_to_int_proportions(w))
    rows.append((f"Grain MapDataset.mix (inputs repeated; weights become {_float_to_int_proportions(w)}, "
                 f"shares {np.round(share, 5).tolist()})", drift(g, w), None, "none",
                 f"a new MapDataset; without .repeat() it has {grain_length()} elements, from {sum(SIZES.values())} records",
                 "random access by index (exact)",
                 f"source pattern repeats every {period} records: {np.array_equal(g[:-period], g[period:])}"))
    t = time.perf_counter()
    ds_index, _ = megatron_indices(w, n)
    build = time.perf_counter() - t
    rows.append(("Megatron-style blending (greedy index arrays)", drift(ds_index.astype(np.int64), w), None,
                 f"{(ds_index.nbytes + 8 * n) / n:.0f} B per sample ({(ds_index.nbytes + 8 * n) / 1e6:.0f} MB here)",
                 f"rebuild the arrays: {build:.1f} s per {n:,} samples in Python (C++ in Megatron)",
                 "exact by sample index, arrays kept", "independent (arrays are global)"))
    m1, m2 = multinomial_stream(n, 1), multinomial_stream(n, 2)
    rows.append(("multinomial draws (numpy Generator per worker)", drift(m1, w), None, "none", "none",
                 "needs each worker's RNG state; another worker count gives another stream",
                 f"1 vs 2 workers: {np.mean(m1 != m2):.0%} of positions draw another source"))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400, help="batches per contender and round")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (ratios: medians over them)")
    p.add_argument("--positions", type=int, default=1_000_000)
    add_output_args(p, "mix")
    args = p.parse_args()
    print(f"machine: {machine()}; caches {SIZES} and {MANY} of {MANY_ROWS:,} records (64..3000 tokens per record); "
          f"weights {WEIGHTS} and 1..5; batches {B}x{S}")
    work = tempfile.mkdtemp(prefix="bench-mix-")
    try:
        paths = {n: build_cache(os.path.join(work, n), k, seed) for seed, (n, k) in enumerate(SIZES.items())}
        many = {n: build_cache(os.path.join(work, n), MANY_ROWS, 100 + k) for k, n in enumerate(MANY_WEIGHTS)}
        res = speed(paths, many, args.steps, args.rounds)
        ratios, first, (low, high) = res.pop("ratios"), res.pop("first"), res.pop("loads")
        print(f"\nload average over the rounds: {low:.1f}-{high:.1f}")
        print(f"| contender | first batch (s), median | steady batches/s, best of {args.rounds} rounds (describe: steps/s) |"
              "\n|---|---|---|")
        for label, v in res.items():
            print(f"| {label} | {f'{first[label]:.3f}' if label in first else '-'} | {v:,.0f} |")
        write_table(args, ["contender", "first_batch_s", "per_s", "load_min", "load_max"],
                    [[label, first.get(label, ""), float(v), low, high] for label, v in res.items()])
        bar_svg(args, "pl.mix against one source and Grain's MapDataset.mix (8 x 2048, padded and packed)", list(res),
                [float(v) for v in res.values()], f"batches/s, best of {args.rounds} rounds (describe: steps/s)",
                highlight=[label for label in res if "Grain" not in label])
        print(f"\nmedians over rounds of per-round ratios (targets: 0.9x one source, 0.8x with {MANY} sources, "
              "5x Grain):")
        for what, v in ratios.items():
            print(f"  {what}: {v:.2f}x")
        print(f"\nmixing methods over {args.positions:,} records, weights {list(WEIGHTS.values())}:\n")
        print("| method | max drift, any prefix (records) | at block boundaries | index memory | weight change | resume | workers |")
        print("|---|---|---|---|---|---|---|")
        for name, d, db, mem, change, resume, workers in methods(args.positions, paths):
            print(f"| {name} | {d:.2f} | {'-' if db is None else f'{db:.2f}'} | {mem} | {change} | {resume} | {workers} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
