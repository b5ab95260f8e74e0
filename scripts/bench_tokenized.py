"""Benchmark: ``pl.tokenized`` (tokenize on read) against the tokenizer's own rate and ``datasets`` streaming.

    python scripts/bench_tokenized.py                          # 10k c4 rows, phi-3-mini, workers 0 1 2
    python scripts/bench_tokenized.py --rows 10000 --workers 0 2 4

Each measurement runs in a fresh interpreter (so its RSS is its own): on one input of ``--rows``
text rows (the c4 demo rows repeated, each with its number appended),

* the tokenizer's own rate: ``tokenizers.Tokenizer.encode_batch`` over the same texts, one thread
  (``TOKENIZERS_PARALLELISM=false``), in tokens/s: the per-core ceiling, measured before each run;
* ``pl.tokenized`` + ``DataLoader(packing=True)``, 8x2048 batches, for each ``--workers``: seconds
  from ``pl.tokenized(...)`` to the first batch, real tokens/s over one epoch (from the first
  ``next``, so every window's tokenization counts), and the main process's peak RSS;
* the same, padded (one record per row, cut to 2048): no lengths are needed ahead, so the workers
  alone tokenize;
* ``datasets``: ``load_dataset("json", streaming=True).map(tokenize, batched=True)`` and a greedy
  packing collator making the same 8x2048 batches, one process.

The ratio compares a loader's tokens/s with the single-thread rate (measured just before it, in
its own interpreter) times the CPUs available: every contender may use them all (the main
process's Rust encoder threads, the loader's workers). Writes
``docs/bench_tokenized.json`` and ``docs/bench_tokenized.svg``; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(os.path.dirname(ROOT), "shared", "data")
BATCH, SEQ = 8, 2048


def make_input(path: str, rows: int) -> None:
    with open(os.path.join(DATA, "text", "llamafactory_c4_demo.jsonl")) as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"text": f"{texts[i % len(texts)]} ({i})"}) + "\n")


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def one_tokenizer(data: str, tokenizer: str) -> dict:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    with open(data) as f:
        texts = [json.loads(line)["text"] for line in f]
    tok = Tokenizer.from_file(os.path.join(tokenizer, "tokenizer.json"))
    tok.encode_batch(texts[:64])  # warm up
    t = time.perf_counter()
    tokens = sum(len(e.ids) for e in tok.encode_batch(texts))
    return {"name": "tokenizers encode_batch (1 thread)", "tokens_per_s": tokens / (time.perf_counter() - t), "tokens": tokens}


def cores() -> int:
    """The CPUs this process may use: the main process's Rust encoder threads and the workers share them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def real_tokens(batch) -> int:
    import numpy as np

    return int(np.count_nonzero(np.asarray(batch["segment_ids"])))


def one_loader(data: str, tokenizer: str, workers: int, packing: bool = True) -> dict:
    import portable_loader as pl

    t0 = time.perf_counter()
    ds = pl.tokenized(data, tokenizer=tokenizer, format="text", max_length=SEQ, overlong="truncate")
    loader = pl.DataLoader(ds, global_batch_size=BATCH, seq_len=SEQ, packing=packing, num_workers=workers, seed=0, num_epochs=1)
    with iter(loader) as it:
        t_ready = time.perf_counter()
        first = next(it)
        t_first = time.perf_counter() - t0
        tokens = real_tokens(first)
        for batch in it:  # the whole epoch: every packing window tokenized
            tokens += real_tokens(batch)
        seconds = time.perf_counter() - t_ready
    assert first["input_ids"].shape == (BATCH, SEQ)
    return {
        "name": f"pl.tokenized, {'packed' if packing else 'padded'}, num_workers={workers}", "workers": workers,
        "first_batch_s": t_first, "tokens_per_s": tokens / seconds, "main_rss_mib": peak_rss_mib(),
        "cores": cores(),
    }


def one_datasets(data: str, tokenizer: str) -> dict:
    import numpy as np
    from datasets import load_dataset
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(tokenizer, "tokenizer.json"))
    eos = tok.convert_tokens_to_ids("</s>") if tok.eos_token_id is None else tok.eos_token_id
    stream = load_dataset("json", data_files=data, split="train", streaming=True)
    stream = stream.shuffle(seed=0, buffer_size=1000).map(
        lambda b: {"input_ids": [ids + [eos] for ids in tok(b["text"])["input_ids"]]}, batched=True, remove_columns=["text"]
    )

    def batches():  # greedy packing collator: fill each row in turn, cut records at the row's end
        rows, row = [], []
        for rec in stream:
            ids = rec["input_ids"][:SEQ]
            if len(row) + len(ids) > SEQ:
                rows.append(row)
                row = []
                if len(rows) == BATCH:
                    out = np.zeros((BATCH, SEQ), np.int32)
                    seg = np.zeros((BATCH, SEQ), np.int32)
                    for r, x in enumerate(rows):
                        out[r, : len(x)], seg[r, : len(x)] = x, 1
                    yield {"input_ids": out, "segment_ids": seg}
                    rows = []
            row += ids

    t_ready = time.perf_counter()
    it = batches()
    tokens = real_tokens(next(it))
    t_first = time.perf_counter() - t0
    tokens += sum(real_tokens(b) for b in it)
    return {"name": "datasets streaming .map + packing collator", "workers": 0, "first_batch_s": t_first,
            "tokens_per_s": tokens / (time.perf_counter() - t_ready), "main_rss_mib": peak_rss_mib(), "cores": cores()}


def run_one(args, *extra) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", *extra, "--data", args.data, "--tokenizer", args.tokenizer]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--tokenizer", default=os.path.join(DATA, "tokenizers", "phi-3-mini"))
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "bench_tokenized"))
    p.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        kind = args.one[0]
        if kind == "tokenizer":
            result = one_tokenizer(args.data, args.tokenizer)
        elif kind == "datasets":
            result = one_datasets(args.data, args.tokenizer)
        else:
            result = one_loader(args.data, args.tokenizer, int(args.one[1]), args.one[2] == "packed")
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as tmp:
        args.data = os.path.join(tmp, "rows.jsonl")
        make_input(args.data, args.rows)
        results = []
        # The one-thread rate is measured right before each run (a shared machine's load drifts).
        for extra in [("loader", str(w), mode) for mode in ("packed", "padded") for w in args.workers] + [("datasets",)]:
            rate = run_one(args, "tokenizer")["tokens_per_s"]
            results.append(dict(run_one(args, *extra), rate_1_thread=rate))
    for r in results:
        r["ratio"] = r["tokens_per_s"] / (r["rate_1_thread"] * r["cores"])
    print(f"rows: {args.rows}; tokenizer: {os.path.basename(args.tokenizer)}; {BATCH}x{SEQ} batches; cpus: {cores()}\n")
    print("| loader | first batch (s) | tokens/s | 1-thread tokenizer tokens/s | cores | x (rate x cores) | main RSS (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['name']} | {r['first_batch_s']:.2f} | {r['tokens_per_s']:,.0f} | {r['rate_1_thread']:,.0f} | "
              f"{r['cores']} | {r['ratio']:.2f} | {r['main_rss_mib']:.0f} |")
    with open(args.out + ".json", "w") as f:
        json.dump({"rows": args.rows, "tokenizer": os.path.basename(args.tokenizer), "results": results}, f, indent=1)
    plot(results, args.out + ".svg")


def plot(results: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [r["name"] for r in results]
    ax.barh(names, [r["tokens_per_s"] for r in results], color="#4c78a8", label="loader tokens/s")
    ax.barh(names, [r["rate_1_thread"] * r["cores"] for r in results], fill=False, edgecolor="#e45756",
            label="tokenizer 1-thread rate x cores")
    ax.set_xlabel("real tokens per second (8x2048 packed)")
    ax.legend(loc="lower right", fontsize=8)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
