"""Benchmark: pretraining token files served as concatenate-and-chunk windows (issue 30), against the peers.

    scripts/test.sh --co -q >/dev/null                # installs the peers (see scripts/test.sh), or by hand
    python scripts/bench_pretrain.py                  # 5*10^7 tokens, 5 interleaved rounds, scale probes
    python scripts/bench_pretrain.py --tokens 10000000 --rounds 3 --steps 300 --index-tokens 1e8   # a quick look

**Speed.** One token stream (GPT-2 ids, lognormal document lengths, each document ending in EOS) is
written once with megatron-core's own ``IndexedDatasetBuilder`` (uint16 ``.bin``/``.idx``); the
``.bin`` *is* the flat token stream, so OLMo's raw ``.npy`` and nanoGPT's ``train.bin`` are hard links
to it (same bytes, same page cache); LitData gets the same tokens through its own ``optimize``.
Batches of B = 8 rows x L = 2048 tokens, 0 workers, random order, every loader in its usual form:

* ours: ``pl.DataLoader(pl.pretokenized(...), packing="concat")`` over the Megatron prefix and over
  the flat file with ``eos_token_id`` (input_ids, loss_mask, attention_mask, segment_ids, positions;
  numpy), with the default prefetch thread, and ``flat, inline``: the same with ``prefetch=0``;
* megatron-core ``GPTDataset`` (document shuffle, L+1-token samples, shuffled sample index) through a
  torch ``DataLoader`` (tokens, labels, loss_mask, position_ids; no [L, L] attention mask, as with
  flash attention; megatron's own ``NullTokenizer``: no tokenizer files);
* OLMo-core ``NumpyFSLDataset`` through OLMo-core's own ``NumpyFSLDataLoader`` (a torch DataLoader
  over its shuffled global index; input_ids);
* LitData ``StreamingDataset`` + ``TokensLoader(block_size=L + 1)`` (litgpt's setting) through its
  ``StreamingDataLoader``;
* nanoGPT's ``get_batch`` (a fresh ``np.memmap`` per batch, random offsets, ``torch.from_numpy``): the
  floor, with no epochs, no documents and no state.

Rounds are interleaved (every other round in reverse order); figures are medians over rounds and
``x_ours`` is the median over rounds of (ours, same file kind) / (this loader) in batches/s.

**Scale.** In fresh processes: a sparse flat file of ``--scale-tokens`` uint16 tokens (``truncate``:
no disk used; deleted after) opened by ours: seconds from open to the first batch, RSS growth, state
bytes. And at each ``--index-tokens`` size a sparse ``.bin`` with a real ``.idx`` (megatron-core's own
index writer, ``--doc-mean`` tokens per document): megatron-core's ``GPTDataset`` index build (seconds,
RSS growth, bytes of the cached index files) beside ours opening the same prefix. Each probe starts
with the files' pages evicted (``posix_fadvise DONTNEED``); RSS is split into heap (anonymous) and
mapped file pages, from open to the first batch and after 100 batches, in a process that has already
run the same code once on a tiny corpus (so imports are not counted; ``cold_rss_mb`` counts them).
Batches/s over the next 99 batches is reported too, but on a sparse file page faults bound it.

Writes docs/bench/pretrain.csv and .svg (``--csv``/``--svg``, as every ``scripts/bench_*.py``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import benchlib  # noqa: E402
import pretrain_peers as peers  # noqa: E402

B, L = 8, 2048
EOS, VOCAB = 50_256, 50_304  # GPT-2's EOS; vocab padded as nanoGPT pads it


# --- the corpus, written once ----------------------------------------------------------------------


def doc_lengths(total: int, mean_hint: float, rng: np.random.Generator) -> np.ndarray:
    """Lognormal document lengths (>= 1) summing to exactly ``total`` tokens."""
    sigma = 1.0
    mu = np.log(mean_hint) - sigma**2 / 2
    n = int(total / mean_hint * 1.2) + 16
    lengths = np.maximum(1, np.round(rng.lognormal(mu, sigma, n))).astype(np.int64)
    cut = int(np.searchsorted(np.cumsum(lengths), total))
    lengths = lengths[: cut + 1]
    lengths[-1] -= int(lengths.sum()) - total
    if lengths[-1] <= 0:
        lengths = lengths[:-1]
        lengths[-1] += total - int(lengths.sum())
    assert lengths.sum() == total and (lengths > 0).all()
    return lengths


def write_corpus(work: str, tokens: int, mean: float) -> dict:
    """The Megatron pair (by megatron-core's builder), hard links for OLMo and nanoGPT, LitData chunks."""
    mc = peers.load_megatron()
    os.makedirs(work, exist_ok=True)
    paths = {"megatron": os.path.join(work, "corpus_text_document"), "olmo": os.path.join(work, "part-00000.npy"),
             "flat": os.path.join(work, "train.bin"), "litdata": os.path.join(work, "litdata")}
    if os.path.exists(paths["megatron"] + ".idx"):
        return paths
    rng = np.random.default_rng(0)
    lengths = doc_lengths(tokens, mean, rng)
    t = time.perf_counter()
    builder = mc.IndexedDatasetBuilder(paths["megatron"] + ".bin", dtype=np.uint16)
    for n in lengths:
        doc = rng.integers(0, EOS, int(n), dtype=np.uint16)
        doc[-1] = EOS
        builder.add_document(doc, [int(n)])
    builder.finalize(paths["megatron"] + ".idx")
    os.link(paths["megatron"] + ".bin", paths["olmo"])
    os.link(paths["megatron"] + ".bin", paths["flat"])
    print(f"corpus: {tokens:,} tokens in {len(lengths):,} documents (mean {tokens / len(lengths):.0f}), "
          f"megatron-core builder {time.perf_counter() - t:.1f} s", flush=True)
    t = time.perf_counter()
    lit = peers.load_litdata()
    spans = [(paths["flat"], lo, min(tokens, lo + 4_000_000)) for lo in range(0, tokens, 4_000_000)]
    lit.optimize(fn=_litdata_tokens, inputs=spans, output_dir=paths["litdata"], chunk_size=(L + 1) * 1024,
                 item_loader=lit.TokensLoader(), num_workers=1, verbose=False)
    print(f"litdata optimize: {time.perf_counter() - t:.1f} s", flush=True)
    return paths


def _litdata_tokens(span):
    import torch

    path, lo, hi = span
    data = np.memmap(path, dtype=np.uint16, mode="r")
    yield torch.from_numpy(np.array(data[lo:hi]).astype(np.int32))  # litgpt's tokens are int tensors


def warm(path: str) -> None:
    """Read a file once so every loader starts from the page cache."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


# --- the loaders: each make() gives an endless iterator of batches ---------------------------------


def _cycle(make_epoch):
    epoch = 0
    while True:
        it = make_epoch(epoch)
        n = 0
        try:
            for batch in it:
                n += 1
                yield batch
        finally:
            getattr(it, "close", lambda: None)()  # ours: stop its prefetch thread
        if n == 0:
            raise RuntimeError("an epoch without batches")
        epoch += 1


class Ours:
    def __init__(self, path: str, fmt: str, prefetch: int = 2):
        self.path, self.fmt, self.prefetch = path, fmt, prefetch

    def dataset(self):
        import portable_loader as pl

        if self.fmt == "megatron":
            return pl.pretokenized(self.path, format="megatron")
        return pl.pretokenized(self.path, format="flat", dtype=np.uint16, eos_token_id=EOS)

    def make(self):
        import portable_loader as pl

        ds = self.dataset()

        def epoch(e):
            loader = pl.DataLoader(ds, global_batch_size=B, seq_len=L, seed=e, packing="concat", num_epochs=1,
                                   prefetch=self.prefetch)
            return iter(loader)

        return _cycle(epoch)


class Megatron:
    def __init__(self, prefix: str, cache: str):
        self.prefix, self.cache = prefix, cache

    def make(self):
        import torch

        mc = peers.load_megatron()
        ds, _ = peers.megatron_gpt_dataset(mc, self.prefix, L, seed=0, cache_dir=self.cache)
        return _cycle(lambda e: iter(torch.utils.data.DataLoader(ds, batch_size=B, shuffle=False, num_workers=0)))


class Olmo:
    def __init__(self, path: str, work: str):
        self.path, self.work = path, work

    def make(self):
        from olmo_core.data.collator import DataCollator
        from olmo_core.data.data_loader import NumpyDataLoaderBase

        olmo = peers.load_olmo()
        ds = olmo.NumpyFSLDataset(self.path, sequence_length=L, pad_token_id=EOS, eos_token_id=EOS,
                                  vocab_size=VOCAB, dtype=np.uint16)
        ds.work_dir = self.work
        ds.prepare()
        dl = NumpyDataLoaderBase.wrap_numpy_dataset(ds, global_batch_size=B * L, collator=DataCollator(pad_token_id=EOS),
                                                    work_dir=self.work, seed=0, num_workers=0)

        def epoch(e):
            dl.reset()
            dl.reshuffle(epoch=e + 1)
            return iter(dl)

        return _cycle(epoch)


class LitData:
    def __init__(self, path: str):
        self.path = path

    def make(self):
        lit = peers.load_litdata()
        from litdata import StreamingDataLoader

        ds = lit.StreamingDataset(self.path, item_loader=lit.TokensLoader(block_size=L + 1), shuffle=True,
                                  drop_last=True, seed=0)
        return _cycle(lambda e: iter(StreamingDataLoader(ds, batch_size=B, num_workers=0)))


class NanoGPT:
    """nanoGPT's train.py get_batch on the CPU (device_type != 'cuda': no pin_memory)."""

    def __init__(self, path: str):
        self.path = path

    def make(self):
        import torch

        def get_batch():
            data = np.memmap(self.path, dtype=np.uint16, mode="r")  # recreated every batch, as nanoGPT does
            ix = torch.randint(len(data) - L, (B,))
            x = torch.stack([torch.from_numpy((data[i:i + L]).astype(np.int64)) for i in ix])
            y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + L]).astype(np.int64)) for i in ix])
            return {"x": x, "y": y}

        while True:
            yield get_batch()


def throughput(lib, steps: int, warmup: int = 20) -> tuple[float, float]:
    """(seconds from making the loader to its first batch, steady batches/s after ``warmup`` batches)."""
    t = time.perf_counter()
    it = lib.make()
    next(it)
    first = time.perf_counter() - t
    for _ in range(warmup - 1):
        next(it)
    gc.collect()
    t = time.perf_counter()
    for _ in range(steps):
        next(it)
    bps = steps / (time.perf_counter() - t)
    it.close()
    return first, bps


# --- scale probes, each in a fresh process ----------------------------------------------------------


def rss(kind: str = "") -> int:
    """Resident bytes: all (``VmRSS``), or ``"Anon"`` (heap: what the process allocated) or ``"File"``
    (mapped file pages: the token files' pages it has touched, which the kernel may drop)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"Rss{kind}:" if kind else "VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no /proc/self/status")


def growth(r0: tuple) -> dict:
    """RSS growth in MB since ``r0 = snapshot()``: total, heap (anonymous) and mapped file pages."""
    return {k: round((v - v0) / 2**20, 2) for (k, v0), v in zip(r0, snapshot()[1])}


def snapshot() -> tuple:
    keys = ("rss_mb", "anon_mb", "file_mb")
    vals = (rss(), rss("Anon"), rss("File"))
    return tuple(zip(keys, vals)), vals


def probe(kind: str, path: str, cache: str, warm_path: str) -> dict:
    """Run in a subprocess: open ``path`` and take one batch; time, RSS growth, state/index bytes.

    The same steps run first on ``warm_path`` (a tiny corpus of the same kind), so that what the
    RSS growth counts is the corpus, not the first use of the code (imports, thread start)."""
    cold = rss()
    if kind == "megatron":
        import torch

        mc = peers.load_megatron()
        ds, _ = peers.megatron_gpt_dataset(mc, warm_path, L, seed=0, cache_dir=cache + "_warm")
        next(iter(torch.utils.data.DataLoader(ds, batch_size=B, shuffle=False, num_workers=0)))
        del ds
        gc.collect()
        r0, t0 = snapshot()[0], time.perf_counter()
        ds, build = peers.megatron_gpt_dataset(mc, path, L, seed=0, cache_dir=cache)
        it = iter(torch.utils.data.DataLoader(ds, batch_size=B, shuffle=False, num_workers=0))
        batch = next(it)
        first = time.perf_counter() - t0
        at_first = growth(r0)
        assert tuple(batch["tokens"].shape) == (B, L)
        t1 = time.perf_counter()
        for _ in range(99):
            next(it)
        then = 99 / (time.perf_counter() - t1)
        index_bytes = sum(os.path.getsize(os.path.join(cache, f)) for f in os.listdir(cache) if f.endswith(".npy"))
        return {"first_batch_s": first, "next99_batches_per_s": round(then, 1), "index_build_s": build, **{f"first_{k}": v for k, v in at_first.items()},
                **{f"step100_{k}": v for k, v in growth(r0).items()}, "cold_rss_mb": round((rss() - cold) / 2**20, 1),
                "index_bytes": index_bytes, "samples": len(ds)}
    import portable_loader as pl

    kw = {"format": "megatron"} if kind == "ours_megatron" else {"format": "flat", "dtype": np.uint16}
    if kind == "ours_flat_eos":
        kw["eos_token_id"] = EOS

    def first_batch(p):
        ds = pl.pretokenized(p, **kw)
        it = iter(pl.DataLoader(ds, global_batch_size=B, seq_len=L, seed=0, packing="concat"))
        return it, next(it)

    it, _ = first_batch(warm_path)
    it.close()
    del it
    gc.collect()
    r0, t0 = snapshot()[0], time.perf_counter()
    it, batch = first_batch(path)
    first = time.perf_counter() - t0
    at_first = growth(r0)
    assert np.asarray(batch["input_ids"]).shape == (B, L)
    state = json.dumps(it.get_state())
    t1 = time.perf_counter()
    for _ in range(99):
        next(it)
    then = 99 / (time.perf_counter() - t1)
    out = {"first_batch_s": first, "next99_batches_per_s": round(then, 1), **{f"first_{k}": v for k, v in at_first.items()},
           **{f"step100_{k}": v for k, v in growth(r0).items()}, "cold_rss_mb": round((rss() - cold) / 2**20, 1),
           "state_bytes": len(state), "state_bytes_step100": len(json.dumps(it.get_state())), "index_bytes": 0}
    it.close()
    return out


def drop_cache(*paths: str) -> None:
    """Evict these files' pages from the page cache (theirs only: ``POSIX_FADV_DONTNEED``), so that every
    probe starts cold on them, whichever probe ran before."""
    for p in paths:
        if os.path.exists(p):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_probe(kind: str, path: str, cache: str, warm_path: str) -> dict:
    drop_cache(path, path + ".bin", path + ".idx")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe", kind, path, cache, warm_path],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"probe {kind} {path} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def sparse_megatron(prefix: str, tokens: int, mean: float) -> int:
    """A sparse .bin of ``tokens`` uint16 zeros and a real .idx by megatron-core's own index writer."""
    import importlib

    peers.load_megatron()
    idx = importlib.import_module("megatron.core.datasets.indexed_dataset")
    lengths = doc_lengths(tokens, mean, np.random.default_rng(1)).astype(np.int32)
    with open(prefix + ".bin", "wb") as f:
        f.truncate(tokens * 2)
    with idx._IndexWriter(prefix + ".idx", np.uint16) as w:
        w.write(lengths, None, np.arange(len(lengths) + 1, dtype=np.int64))
    return len(lengths)


def scale(args) -> list[dict]:
    rows = []
    base = tempfile.mkdtemp(prefix="pl_bench_scale_", dir="/tmp")
    try:
        warm_flat, warm_prefix = os.path.join(base, "warm.bin"), os.path.join(base, "warm")
        np.random.default_rng(0).integers(0, EOS + 1, 64 * L, dtype=np.uint16).tofile(warm_flat)
        sparse_megatron(warm_prefix, 10**6, args.doc_mean)
        flat = os.path.join(base, "flat.bin")
        with open(flat, "wb") as f:
            f.truncate(int(args.scale_tokens) * 2)  # apparent size only: no blocks written
        for kind in ("ours_flat", "ours_flat_eos"):
            r = run_probe(kind, flat, "-", warm_flat)
            rows.append({"part": "scale", "loader": "portable_loader", "config": kind.replace("ours_", ""),
                         "tokens": int(args.scale_tokens), **r})
            print(f"scale {kind} {args.scale_tokens:.0e} tokens: {r}", flush=True)
        os.remove(flat)
        for n in args.index_tokens:
            n = int(n)
            prefix = os.path.join(base, f"m{n}")
            t = time.perf_counter()
            docs = sparse_megatron(prefix, n, args.doc_mean)
            print(f"sparse megatron prefix: {n:.0e} tokens, {docs:,} documents, .idx {os.path.getsize(prefix + '.idx'):,} "
                  f"bytes ({time.perf_counter() - t:.1f} s to write)", flush=True)
            cache = os.path.join(base, f"cache{n}")
            for kind, loader in (("megatron", "megatron-core GPTDataset"), ("ours_megatron", "portable_loader")):
                r = run_probe(kind, prefix, cache, warm_prefix)
                rows.append({"part": "scale", "loader": loader, "config": "megatron prefix", "tokens": n,
                             "documents": docs, **r})
                print(f"scale {kind} {n:.0e} tokens: {r}", flush=True)
            for f in os.listdir(base):
                if f.startswith(f"m{n}."):
                    os.remove(os.path.join(base, f))
            shutil.rmtree(cache, ignore_errors=True)
            shutil.rmtree(cache + "_warm", ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return rows


# --- main ---------------------------------------------------------------------------------------------


def plot(args, speed: list[dict], scale_rows: list[dict]) -> None:
    if args.svg == "-":
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "portable_loader"
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    labels = [f"{r['loader']} ({r['config']})" for r in speed]
    vals = [r["batches_per_s"] for r in speed]
    y = list(range(len(labels)))[::-1]
    a.barh(y, vals, color=["tab:blue" if r["loader"] == "portable_loader" else "tab:gray" for r in speed])
    a.set_yticks(y, labels, fontsize=8)
    for yi, v in zip(y, vals):
        a.text(v, yi, f" {v:,.0f}", va="center", fontsize=8)
    a.set_xlim(right=max(vals) * 1.2)
    a.set_xlabel(f"batches/s ({B} x {L}, 0 workers, median of rounds)")
    for loader, color in (("megatron-core GPTDataset", "tab:orange"), ("portable_loader", "tab:blue")):
        pts = sorted((r["tokens"], r["first_batch_s"], r["first_rss_mb"]) for r in scale_rows
                     if r["loader"] == loader and r["config"] == "megatron prefix")
        if pts:
            b.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=f"{loader}: s to first batch")
            b.plot([p[0] for p in pts], [p[2] for p in pts], "s--", color=color, label=f"{loader}: RSS growth to first batch, MB")
    flat = [r for r in scale_rows if r["config"] == "flat"]
    if flat:
        b.plot([flat[0]["tokens"]], [flat[0]["first_batch_s"]], "*", color="tab:green", markersize=12,
               label="portable_loader flat file: s to first batch")
    b.set_xscale("log")
    b.set_yscale("log")
    b.set_xlabel("tokens in the corpus")
    b.legend(fontsize=7)
    b.set_title("open to first batch (megatron prefix, sparse .bin)", fontsize=9)
    fig.suptitle(f"Pretraining token files: concat windows vs peers\n{benchlib.machine()}", fontsize=9)
    benchlib.write_svg(args, plt, fig)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--probe":
        print(json.dumps(probe(*sys.argv[2:6])))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=50_000_000, help="tokens in the speed corpus")
    ap.add_argument("--doc-mean", type=float, default=800, help="mean document length (tokens)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=1000, help="timed batches per loader per round")
    ap.add_argument("--scale-tokens", type=float, default=1e10, help="tokens in the sparse flat file (ours)")
    ap.add_argument("--index-tokens", type=float, nargs="*", default=[1e8, 1e9, 1e10],
                    help="corpus sizes for the index build race (megatron-core vs ours, sparse .bin)")
    ap.add_argument("--only", default="", help="comma-separated substrings: race only the loaders matching one")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--work", default=None, help="where to write the corpus (default: a temporary folder)")
    benchlib.add_output_args(ap, "pretrain")
    args = ap.parse_args()
    print(benchlib.machine(), flush=True)
    shown = {k: (os.path.relpath(v, ROOT) if k in ("csv", "svg") and v not in (None, "-") else v)
             for k, v in vars(args).items()}
    print(f"args: {shown}", flush=True)  # paths relative to the repository: logs are committed
    speed = []
    if not args.skip_speed:
        work = args.work or tempfile.mkdtemp(prefix="pl_bench_pretrain_")
        paths = write_corpus(work, args.tokens, args.doc_mean)
        warm(paths["flat"])
        for f in os.listdir(paths["litdata"]):
            warm(os.path.join(paths["litdata"], f))
        configs = [
            ("portable_loader", "megatron prefix", Ours(paths["megatron"], "megatron")),
            ("portable_loader", "flat file + eos", Ours(paths["flat"], "flat")),
            ("portable_loader", "flat, inline", Ours(paths["flat"], "flat", prefetch=0)),
            ("megatron-core GPTDataset", "megatron prefix", Megatron(paths["megatron"], os.path.join(work, "mcache"))),
            ("OLMo-core NumpyFSLDataset", "raw .npy", Olmo(paths["olmo"], os.path.join(work, "olmo"))),
            ("LitData StreamingDataset", "TokensLoader", LitData(paths["litdata"])),
            ("nanoGPT get_batch", "flat file (floor)", NanoGPT(paths["flat"])),
        ]
        if args.only:
            keep = [w.strip().lower() for w in args.only.split(",")]
            configs = [c for c in configs if any(k in f"{c[0]} {c[1]}".lower() for k in keep)]
        samples = {i: [] for i in range(len(configs))}
        firsts = {i: [] for i in range(len(configs))}
        loads = []
        for rnd in range(args.rounds):
            order = list(enumerate(configs)) if rnd % 2 == 0 else list(enumerate(configs))[::-1]
            for i, (name, config, lib) in order:
                first, bps = throughput(lib, args.steps)
                samples[i].append(bps)
                firsts[i].append(first)
                loads.append(benchlib.load())
                print(f"round {rnd} {name:28s} {config:20s} first batch {first:7.3f} s, then {bps:9.0f} batches/s "
                      f"(load {loads[-1]:.1f})", flush=True)
        # Peers on the Megatron pair compare with ours on it; the others with ours on the flat file.
        ours = {c[1]: i for i, c in enumerate(configs) if c[0] == "portable_loader"}
        for i, (name, config, lib) in enumerate(configs):
            ref = ours.get("megatron prefix" if config == "megatron prefix" else "flat file + eos")
            ratio = "" if name == "portable_loader" or ref is None else round(
                statistics.median(a / b for a, b in zip(samples[ref], samples[i])), 3)
            speed.append({"part": "speed", "loader": name, "config": config, "tokens": args.tokens,
                          "batches_per_s": round(statistics.median(samples[i])),
                          "tokens_per_s": round(statistics.median(samples[i]) * B * L), "x_ours": ratio,
                          "first_batch_s": round(statistics.median(firsts[i]), 4),
                          "load_min": round(min(loads), 2), "load_max": round(max(loads), 2)})
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
        print(f"\nsteady batches/s after 20 warm-up batches, first batch apart; load average {min(loads):.1f}-{max(loads):.1f}")
        print(f"{'loader':28s} {'config':20s} {'first s':>8s} {'batches/s':>10s} {'ours/x':>7s}")
        for r in speed:
            print(f"{r['loader']:28s} {r['config']:20s} {r['first_batch_s']:8.3f} {r['batches_per_s']:10,d} "
                  f"{r['x_ours']!s:>7s}")
    scale_rows = [] if args.skip_scale else scale(args)
    if scale_rows:
        print("\nRSS growth in MB from open to the first batch (heap = anonymous, file = mapped token/index pages),"
              " and after 100 batches; a warmed process (the code already used once on a tiny corpus)")
        print("then batches/s over the next 99 batches (a sparse file: page faults bound every loader there); "
              f"load average now {benchlib.load():.1f}")
        print(f"{'loader':26s} {'config':16s} {'tokens':>8s} {'first s':>8s} {'build s':>8s} {'RSS@1':>7s} "
              f"{'heap@1':>7s} {'RSS@100':>8s} {'heap@100':>8s} {'index B':>12s} {'state B':>8s} {'then b/s':>9s}")
        for r in scale_rows:
            print(f"{r['loader']:26s} {r['config']:16s} {r['tokens']:8.0e} {r['first_batch_s']:8.3f} "
                  f"{r.get('index_build_s', 0):8.3f} {r['first_rss_mb']:7.1f} {r['first_anon_mb']:7.1f} "
                  f"{r['step100_rss_mb']:8.1f} {r['step100_anon_mb']:8.1f} {r.get('index_bytes', 0):12,d} "
                  f"{r.get('state_bytes', '')!s:>8s} {r['next99_batches_per_s']:9.1f}")
    rows = speed + scale_rows
    header = ["part", "loader", "config", "tokens", "documents", "batches_per_s", "tokens_per_s", "x_ours",
              "first_batch_s", "next99_batches_per_s", "index_build_s", "first_rss_mb", "first_anon_mb", "first_file_mb", "step100_rss_mb",
              "step100_anon_mb", "step100_file_mb", "cold_rss_mb", "index_bytes", "state_bytes", "state_bytes_step100",
              "samples", "load_min", "load_max"]
    benchlib.write_table(args, header, [[r.get(k, "") for k in header] for r in rows])
    plot(args, speed, scale_rows)


if __name__ == "__main__":
    main()
