"""Benchmark: ``pl.tokenized`` (tokenize on read) against the tokenizer's own rate and ``datasets`` streaming.

    python scripts/bench_tokenized.py                          # 10k c4 rows, phi-3-mini, workers 0 1 2, 3 rounds
    python scripts/bench_tokenized.py --rows 10000 --workers 0 2 4 --rounds 1
    python scripts/bench_tokenized.py --first-batch --rounds 5  # start-up only: seconds to the first batch
    python scripts/bench_tokenized.py --input wikitext          # short records: wikitext-2 lines, gpt2
    python scripts/bench_tokenized.py --input wikitext --workers 2 --only pl --rounds 3   # 2 workers, no extras

``--input c4`` (the default): the c4 demo rows (~540 phi-3-mini tokens each), 10k rows, phi-3-mini.
``--input wikitext``: the non-empty lines of wikitext-2's validation split (~100 GPT-2 tokens each,
short records: the loader's cost per record shows), 20k rows, the gpt2 tokenizer; tables go to
``docs/bench/tokenized_wikitext.csv`` and ``.svg``. ``--only pl`` skips the ``.jsonl.gz`` and
``datasets`` rows.

Each measurement runs in a fresh interpreter (so its RSS is its own): on one input of ``--rows``
text rows (the c4 demo rows repeated, each with its number appended),

* the tokenizer's own rate on the cores a contender uses: ``tokenizers.Tokenizer.encode_batch``
  over the same texts, one thread each (``TOKENIZERS_PARALLELISM=false``), in as many processes at
  once as the contender uses cores, their tokens/s summed; measured right before each contender;
  the same processes then time ``encode_batch_fast`` (no character offsets: what ``pl.tokenized``
  calls for the ``text`` format, whose loss mask needs none), a second, stricter reference;
* ``pl.tokenized`` + ``DataLoader(packing=True)``, 8x2048 batches, for each ``--workers``: start-up
  (seconds from ``pl.tokenized(...)`` to the first batch) and, apart, the steady rate: real tokens/s
  over the rest of the epoch (every later window's tokenization counts; the first batch's start-up
  does not, which on a 4 s epoch of short records would cost a fifth of the rate), and the main
  process's peak RSS;
* the same, padded (one record per row, cut to 2048);
* packed with the most workers over the same rows gzipped (``.jsonl.gz``: no seeking);
* ``datasets``: ``load_dataset("json", streaming=True).map(tokenize, batched=True)`` and a greedy
  packing collator making the same 8x2048 batches, one process.

``--first-batch`` times only the start: from ``pl.tokenized(...)`` to the first batch, packed and
padded, for each ``--workers``, each in a fresh interpreter (``portable_loader`` imported before the
clock starts, as above), rounds interleaved; with the tokenizer kept by an earlier run
(``load_tokenizer_cached``: the usual case) and without (a fresh ``PORTABLE_LOADER_TOKENIZER_CACHE``:
the first run with a tokenizer, which loads it through ``transformers``). Writes no table files.

The ratio compares a loader's tokens/s with that rate. Cores used: the worker count (1 for
``num_workers=0`` and for ``datasets``, whose one process may still use the Rust encoder's threads
on every CPU). The reference processes run side by side, so on a loaded machine they get the share
of the CPUs that as many workers get; the load still drifts between the two measurements, so every
contender runs ``--rounds`` times and each row is the round with the median ratio. The table also
compares CPU time, which the load barely changes: the loader's real tokens per CPU-second (main
process and workers) over the tokenizer's tokens per CPU-second. Writes ``docs/bench/tokenized.csv``
and ``.svg`` (``--csv``/``--svg``); prints a Markdown table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from benchlib import add_output_args, bar_svg, load, machine, timed_stream, with_load, write_table  # noqa: E402
DATA = os.environ.get("PORTABLE_LOADER_DATA", os.path.join(os.path.dirname(ROOT), "shared", "data"))
BATCH, SEQ = 8, 2048


INPUTS = {  # name: (default tokenizer, default rows)
    "c4": ("phi-3-mini", 10_000),
    "wikitext": ("gpt2", 20_000),
}


def input_texts(name: str) -> list[str]:
    """The texts the rows repeat: c4 demo rows, or wikitext-2 validation lines (non-empty, stripped)."""
    if name == "wikitext":
        with open(os.path.join(DATA, "text", "wikitext2_valid.txt"), encoding="utf-8") as f:
            return [line.strip() for line in f if line.strip()]
    with open(os.path.join(DATA, "text", "llamafactory_c4_demo.jsonl")) as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def make_input(path: str, rows: int, name: str = "c4") -> None:
    texts = input_texts(name)
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
    t, cpu = time.perf_counter(), cpu_seconds()
    tokens = sum(len(e.ids) for e in tok.encode_batch(texts))
    seconds, cpu = time.perf_counter() - t, cpu_seconds() - cpu
    t = time.perf_counter()
    fast = sum(len(e.ids) for e in tok.encode_batch_fast(texts))
    return {"name": "tokenizers encode_batch (1 thread)", "tokens_per_s": tokens / seconds,
            "tokens_per_cpu_s": tokens / cpu, "cpu_us_per_record": cpu / len(texts) * 1e6, "tokens": tokens,
            "fast_tokens_per_s": fast / (time.perf_counter() - t), "load": load()}


def cpu_seconds() -> float:
    """CPU time of this process and of its children that ended (a loader's workers, once closed)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def cores() -> int:
    """The CPUs this process may use: the main process's Rust encoder threads and the workers share them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def real_tokens(batch) -> int:
    import numpy as np

    return int(np.count_nonzero(np.asarray(batch["attention_mask" if "attention_mask" in batch else "segment_ids"])))


def one_loader(data: str, tokenizer: str, workers: int, packing: bool = True, first_only: bool = False) -> dict:
    import portable_loader as pl

    t0 = time.perf_counter()
    ds = pl.tokenized(data, tokenizer=tokenizer, format="text", max_length=SEQ, overlong="truncate")
    t_dataset = time.perf_counter() - t0
    loader = pl.DataLoader(ds, global_batch_size=BATCH, seq_len=SEQ, packing=packing, num_workers=workers, seed=0, num_epochs=1)
    with iter(loader) as it:
        cpu = cpu_seconds()
        if first_only:
            first = next(it)
            return {"first_batch_s": time.perf_counter() - t0, "dataset_s": t_dataset, "load": load(),
                    "transformers_imported": "transformers" in sys.modules}
        # The rest of the epoch (every packing window tokenized), timed from the first batch on: the
        # first carries the start-up (workers, the first window), which a short epoch's rate would mix in.
        run = timed_stream(it, real_tokens, start=t0)
    cpu = cpu_seconds() - cpu  # the workers' too, start-up included: they ended with the with block
    tokens = real_tokens(run["first"]) + run["steady_units"]
    assert run["first"]["input_ids"].shape == (BATCH, SEQ)
    return {
        "name": f"pl.tokenized, {'packed' if packing else 'padded'}, num_workers={workers}", "workers": workers,
        "first_batch_s": run["first_s"], "first_load": run["first_load"], "tokens_per_s": run["steady_per_s"],
        "load": run["steady_load"], "tokens_per_cpu_s": tokens / cpu, "cpu_us_per_record": cpu / len(ds) * 1e6,
        "main_rss_mib": peak_rss_mib(), "cores": max(workers, 1),
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

    cpu = cpu_seconds()
    run = timed_stream(batches(), real_tokens, start=t0)
    tokens = real_tokens(run["first"]) + run["steady_units"]
    return {"name": "datasets streaming .map + packing collator", "workers": 0, "first_batch_s": run["first_s"],
            "first_load": run["first_load"], "tokens_per_s": run["steady_per_s"], "load": run["steady_load"],
            "tokens_per_cpu_s": tokens / (cpu_seconds() - cpu), "cpu_us_per_record": float("nan"),
            "main_rss_mib": peak_rss_mib(), "cores": 1}


def run_one(args, *extra) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", *extra, "--data", args.data, "--tokenizer", args.tokenizer]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def tokenizer_rate(args, procs: int) -> dict:
    """The tokenizer's own rate on ``procs`` cores: that many one-thread processes at once, summed.

    Run side by side, they get the share of a loaded machine that as many loader workers get.
    """
    cmd = [sys.executable, os.path.abspath(__file__), "--one", "tokenizer", "--data", args.data, "--tokenizer", args.tokenizer]
    running = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in running]
    assert all(p.returncode == 0 for p in running)
    return {"tokens_per_s": sum(o["tokens_per_s"] for o in outs),
            "fast_tokens_per_s": sum(o["fast_tokens_per_s"] for o in outs),
            "tokens_per_cpu_s": sum(o["tokens_per_cpu_s"] for o in outs) / procs,
            "cpu_us_per_record": sum(o["cpu_us_per_record"] for o in outs) / procs,
            "load": max(o["load"] for o in outs)}


def first_batches(args) -> None:
    """``--first-batch``: median seconds to the first batch, with the tokenizer kept and without."""
    import statistics

    runs = [(mode, w, kept) for kept in (True, False) for mode in ("packed", "padded") for w in args.workers]
    got: dict = {run: [] for run in runs}
    with tempfile.TemporaryDirectory() as tmp:
        args.data = os.path.join(tmp, "rows.jsonl")
        make_input(args.data, args.rows, args.input)
        kept_dir = os.path.join(tmp, "kept")
        for r in range(args.rounds):
            for mode, w, kept in runs:
                cache = kept_dir if kept else os.path.join(tmp, f"fresh-{r}-{mode}-{w}")
                env = dict(os.environ, PORTABLE_LOADER_TOKENIZER_CACHE=cache)
                cmd = [sys.executable, os.path.abspath(__file__), "--one", "loader", str(w), mode, "first",
                       "--data", args.data, "--tokenizer", args.tokenizer]
                if kept and not os.path.isdir(kept_dir):  # an earlier run keeps the tokenizer
                    subprocess.run(cmd, env=env, check=True, capture_output=True)
                out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
                got[(mode, w, kept)].append(json.loads(out.strip().splitlines()[-1]))
    print(f"input: {args.input}; rows: {args.rows}; tokenizer: {os.path.basename(args.tokenizer)}; {BATCH}x{SEQ} batches; "
          f"cpus: {cores()}; median of {args.rounds} rounds; load average now: {os.getloadavg()[0]:.1f}\n")
    print("| loader | tokenizer | first batch (s) | of which pl.tokenized(...) (s) | rounds (s) | load average "
          "(rounds) | transformers imported |")
    print("|---|---|---:|---:|---|---|---|")
    for (mode, w, kept), rs in got.items():
        firsts, loads = [x["first_batch_s"] for x in rs], [x["load"] for x in rs]
        print(f"| pl.tokenized, {mode}, num_workers={w} | {'kept by an earlier run' if kept else 'first run'} | "
              f"{statistics.median(firsts):.2f} | {statistics.median(x['dataset_s'] for x in rs):.2f} | "
              f"{', '.join(f'{x:.2f}' for x in firsts)} | {', '.join(f'{x:.1f}' for x in loads)} | "
              f"{any(x['transformers_imported'] for x in rs)} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", choices=sorted(INPUTS), default="c4",
                   help="c4: c4 demo rows, phi-3-mini (~540 tokens a row); wikitext: wikitext-2 lines, gpt2 (~100)")
    p.add_argument("--rows", type=int, help="rows of the input (default: 10000 for c4, 20000 for wikitext)")
    p.add_argument("--tokenizer", help="tokenizer folder (default: phi-3-mini for c4, gpt2 for wikitext)")
    p.add_argument("--modes", nargs="+", choices=["packed", "padded"], default=["packed", "padded"])
    p.add_argument("--only", choices=["all", "pl"], default="all",
                   help="pl: only the pl.tokenized rows on the plain input (no .jsonl.gz, no datasets)")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=3, help="runs of every contender; each row is the median")
    p.add_argument("--first-batch", action="store_true",
                   help="time only the start (seconds to the first batch), with the tokenizer kept and without")
    p.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    known, _ = p.parse_known_args()
    add_output_args(p, "tokenized" if known.input == "c4" else f"tokenized_{known.input}")
    args = p.parse_args()
    tok_name, rows = INPUTS[args.input]
    args.rows = rows if args.rows is None else args.rows
    args.tokenizer = args.tokenizer or os.path.join(DATA, "tokenizers", tok_name)
    if args.one:
        kind = args.one[0]
        if kind == "tokenizer":
            result = one_tokenizer(args.data, args.tokenizer)
        elif kind == "datasets":
            result = one_datasets(args.data, args.tokenizer)
        else:
            result = one_loader(args.data, args.tokenizer, int(args.one[1]), args.one[2] == "packed",
                                first_only=args.one[3:] == ["first"])
        print(json.dumps(result))
        return
    if args.first_batch:
        first_batches(args)
        return
    print(machine())
    with tempfile.TemporaryDirectory() as tmp:
        plain = os.path.join(tmp, "rows.jsonl")
        make_input(plain, args.rows, args.input)
        with open(plain, "rb") as f, gzip.open(plain + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        runs = [(plain, ("loader", str(w), mode)) for mode in args.modes for w in args.workers]
        if args.only == "all":
            runs += [(plain + ".gz", ("loader", str(max(args.workers)), "packed")), (plain, ("datasets",))]
        rounds = [[] for _ in runs]
        # The one-thread rate is measured right before each run, and every contender runs once per
        # round: a shared machine's load drifts, so each row is the round with the median ratio.
        for _ in range(args.rounds):
            for k, (data, extra) in enumerate(runs):
                args.data = plain
                used = max(int(extra[1]), 1) if extra[0] == "loader" else 1
                own = tokenizer_rate(args, used)
                args.data = data
                r = run_one(args, *extra)
                if data.endswith(".gz"):
                    r["name"] += ", .jsonl.gz input"
                r.update(rate_cores=own["tokens_per_s"], rate_cpu=own["tokens_per_cpu_s"], rate_load=own["load"],
                         tokenizer_cpu_us_per_record=own["cpu_us_per_record"])
                r["ratio"] = r["tokens_per_s"] / r["rate_cores"]
                r["ratio_cpu"] = r["tokens_per_cpu_s"] / r["rate_cpu"]
                r["ratio_fast"] = r["tokens_per_s"] / own["fast_tokens_per_s"]
                rounds[k].append(r)
    results = [sorted(rs, key=lambda r: r["ratio"])[len(rs) // 2] for rs in rounds]
    peer = results[-1]["tokens_per_s"] if args.only == "all" else float("nan")
    print(f"input: {args.input}; rows: {args.rows}; tokenizer: {os.path.basename(args.tokenizer)}; {BATCH}x{SEQ} batches; cpus: {cores()}; "
          f"median of {args.rounds} rounds; load average now: {os.getloadavg()[0]:.1f}\n")
    print("| loader | first batch (s) | steady tokens/s | tokenizer tokens/s on the cores used | cores used | "
          "x (tokenizer x cores used) | x per CPU-second | x (encode_batch_fast x cores used) | / datasets | "
          "main RSS (MiB) | CPU us / record (loader, all processes) | CPU us / record (encode_batch) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        first = with_load(f"{r['first_batch_s']:.2f}", r["first_load"])
        steady = with_load(f"{r['tokens_per_s']:,.0f}", r["load"])
        own = with_load(f"{r['rate_cores']:,.0f}", r["rate_load"])
        print(f"| {r['name']} | {first} | {steady} | {own} | "
              f"{r['cores']} | {r['ratio']:.2f} | {r['ratio_cpu']:.2f} | {r['ratio_fast']:.2f} | "
              f"{r['tokens_per_s'] / peer:.2f} | {r['main_rss_mib']:.0f} | {r['cpu_us_per_record']:.1f} | "
              f"{r['tokenizer_cpu_us_per_record']:.1f} |")
    header = ["loader", "first_batch_s", "first_batch_load", "steady_tokens_per_s", "steady_load",
              "tokenizer_tokens_per_s_on_cores_used", "tokenizer_load", "cores_used",
              "x_tokenizer_cores_used", "x_per_cpu_second", "x_encode_batch_fast_cores_used", "x_datasets",
              "main_rss_mib", "cpu_us_per_record", "encode_batch_cpu_us_per_record"]
    write_table(args, header, [[r["name"], r["first_batch_s"], r["first_load"], r["tokens_per_s"], r["load"],
                                r["rate_cores"], r["rate_load"], r["cores"],
                                r["ratio"], r["ratio_cpu"], r["ratio_fast"], r["tokens_per_s"] / peer,
                                r["main_rss_mib"], r["cpu_us_per_record"], r["tokenizer_cpu_us_per_record"]]
                               for r in results])
    bar_svg(args, f"tokenize on read: {args.rows} {args.input} rows, {os.path.basename(args.tokenizer)}, {BATCH}x{SEQ} batches; "
            "value = loader tokens/s / (tokenizer's one-thread rate x cores used)",
            [r["name"] for r in results], [r["ratio"] for r in results], "x (tokenizer's own rate x cores used)",
            highlight=[r["name"] for r in results if r["name"].startswith("pl.")])


if __name__ == "__main__":
    main()
