"""``python -m portable_loader``: the whole job on the bundled sample, with no network and no arguments.

1. precache the bundled chat sample with the bundled tokenizer (a cache hit after the first run);
2. load packed, shuffled batches with worker processes;
3. save the loader state half-way (as JSON), restore it into a new iterator, and check that the
   resumed batches equal the uninterrupted ones bit for bit;
4. print the time to the first batch and, apart, the steady batches/s and tokens/s after it (with the
   load average), the packing efficiency and the state's size.

Example:
    $ python -m portable_loader --steps 400 --num-workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from portable_loader.cache import open_cache
from portable_loader.command_line import Parser, add_verbose, int_at_least, user_error
from portable_loader.errors import PortableLoaderError
from portable_loader.loader import DataLoader
from portable_loader.precache import build_cache, sample_args


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m portable_loader", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="portable_loader_cache", help="parent directory of caches")
    p.add_argument("--steps", type=int_at_least(2, " (half of them are resumed)"), default=400)
    p.add_argument("--num-workers", type=int_at_least(0), default=2)
    p.add_argument("--global-batch-size", type=int_at_least(1), default=8)
    p.add_argument("--seq-len", type=int_at_least(1), default=256)
    add_verbose(p)
    args = p.parse_args(argv)
    try:
        return _run(args)
    except (PortableLoaderError, OSError) as e:  # an --out that cannot be written is the user's to fix too
        return user_error(e, args.verbose)


def _run(args: argparse.Namespace) -> int:

    path, s = build_cache(**sample_args(), out=args.out)
    print(f"cache: {path} ({s['rows_out']} records, {s['tokens']} tokens, {'hit' if s['hit'] else 'built'})")
    loader = DataLoader(
        open_cache(path), global_batch_size=args.global_batch_size, seq_len=args.seq_len, seed=0, packing=True,
        num_workers=args.num_workers,
    )
    half = args.steps // 2
    # Start-up (worker processes starting, the first packing window planned) and the steady rate
    # are timed apart: over a few hundred batches, a rate with the start inside says little of either.
    t = time.perf_counter()
    with iter(loader) as it:
        next(it)
        first_s = time.perf_counter() - t
        first_tokens, t = it.stats["tokens"], time.perf_counter()
        for _ in range(half - 1):
            next(it)
        state = json.dumps(it.get_state())
        tail = [next(it) for _ in range(args.steps - half)]
        steady_s = time.perf_counter() - t
        stats = it.stats
    load = os.getloadavg()[0]
    with iter(loader) as resumed:
        resumed.set_state(json.loads(state))
        again = [next(resumed) for _ in range(args.steps - half)]
    exact = all(np.array_equal(a[k], b[k]) for a, b in zip(tail, again) for k in a)
    print(f"loaded {args.steps} batches of {args.global_batch_size}x{args.seq_len} with {args.num_workers} workers, "
          f"packing efficiency {stats['packing_efficiency']:.1%}")
    print(f"first batch: {first_s:.2f} s after the loader started (its workers starting, the first window packed)")
    print(f"steady: {(args.steps - 1) / steady_s:,.0f} batches/s, {(stats['tokens'] - first_tokens) / steady_s:,.0f} "
          f"tokens/s over the next {args.steps - 1} batches (load average {load:.1f})")
    print(f"state: {len(state)} bytes of JSON: {state}")
    print(f"resume from step {half}: {'bit-exact' if exact else 'MISMATCH'} over {len(again)} batches")
    return 0 if exact else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the with blocks above have already stopped every worker
        print("interrupted", file=sys.stderr)
        sys.exit(130)
