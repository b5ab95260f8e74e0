"""The workers' CPU per record of a ``pl.tokenized`` loader, split into the encoder and the rest.

    python scripts/tokenized_cpu_split.py DATA.jsonl TOKENIZER_DIR packed|padded [--workers 2]

One epoch, ``--workers`` worker processes, 8x2048 batches, ``format="text"``. The CPU time spent
inside the tokenizer's batch encoder is timed around each call (``time.thread_time``; the wrapper
is set before the workers fork, so they carry it), the workers' whole CPU by ``getrusage`` of the
children; "rest" is the loader's own per-record work (reading rows, building records, hand-over,
collate, transport). CPU time, unlike wall-clock rates, barely moves with the machine's load, so
run it on two trees side by side (``PYTHONPATH=<tree> python ...``) to compare them. Prints one
JSON line.

Example (the input of ``bench_tokenized.py --input wikitext``)::

    python -c "import sys; sys.path.insert(0, 'scripts'); import bench_tokenized as b; b.make_input('/tmp/wiki.jsonl', 20000, 'wikitext')"
    python scripts/tokenized_cpu_split.py /tmp/wiki.jsonl ../shared/data/tokenizers/gpt2 packed
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data")
    p.add_argument("tokenizer")
    p.add_argument("mode", choices=["packed", "padded"])
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    import portable_loader as pl

    ds = pl.tokenized(args.data, tokenizer=args.tokenizer, format="text", max_length=2048, overlong="truncate")
    fmt = ds._formatter()
    inner = fmt._encode_batch
    out = tempfile.mkdtemp(prefix="tokenized-cpu-split-")

    def timed(texts, **kw):  # appends "seconds records" to a file of the calling process
        t = time.thread_time()
        result = inner(texts, **kw)
        with open(os.path.join(out, str(os.getpid())), "a") as f:
            f.write(f"{time.thread_time() - t} {len(texts)}\n")
        return result

    fmt._encode_batch = timed
    loader = pl.DataLoader(ds, global_batch_size=8, seq_len=2048, packing=args.mode == "packed",
                           num_workers=args.workers, seed=0, num_epochs=1)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    main_before = resource.getrusage(resource.RUSAGE_SELF)
    with iter(loader) as it:
        for _ in it:
            pass
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    main_after = resource.getrusage(resource.RUSAGE_SELF)
    encoder = records = 0
    for path in glob.glob(os.path.join(out, "*")):
        with open(path) as f:
            for line in f:
                seconds, n = line.split()
                encoder, records = encoder + float(seconds), records + int(n)
        os.unlink(path)
    os.rmdir(out)
    workers = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    main_cpu = (main_after.ru_utime + main_after.ru_stime) - (main_before.ru_utime + main_before.ru_stime)
    n = len(ds)
    print(json.dumps({"mode": args.mode, "workers": args.workers, "records": n, "encoded": records,
                      "workers_us_per_record": round(workers / n * 1e6, 1),
                      "encoder_us_per_record": round(encoder / n * 1e6, 1),
                      "rest_us_per_record": round((workers - encoder) / n * 1e6, 1),
                      "main_us_per_record": round(main_cpu / n * 1e6, 1)}))


if __name__ == "__main__":
    main()
