"""``python -m portable_loader``: the whole job on the bundled sample, with no network and no arguments.

1. precache the bundled chat sample with the bundled tokenizer (a cache hit after the first run);
2. load packed, shuffled batches with worker processes;
3. save the loader state half-way (as JSON), restore it into a new iterator, and check that the
   resumed batches equal the uninterrupted ones bit for bit;
4. print batches/s, tokens/s, packing efficiency and the state's size.

Example:
    $ python -m portable_loader --steps 400 --num-workers 2
"""

from __future__ import annotations

import argparse
import json
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
    t = time.perf_counter()
    with iter(loader) as it:
        for _ in range(half):
            next(it)
        state = json.dumps(it.get_state())
        tail = [next(it) for _ in range(args.steps - half)]
        seconds = time.perf_counter() - t
        stats = it.stats
    with iter(loader) as resumed:
        resumed.set_state(json.loads(state))
        again = [next(resumed) for _ in range(args.steps - half)]
    exact = all(np.array_equal(a[k], b[k]) for a, b in zip(tail, again) for k in a)
    print(
        f"loaded {args.steps} batches of {args.global_batch_size}x{args.seq_len} with {args.num_workers} workers: "
        f"{args.steps / seconds:,.0f} batches/s, {stats['tokens'] / seconds:,.0f} tokens/s, "
        f"packing efficiency {stats['packing_efficiency']:.1%}"
    )
    print(f"state: {len(state)} bytes of JSON: {state}")
    print(f"resume from step {half}: {'bit-exact' if exact else 'MISMATCH'} over {len(again)} batches")
    return 0 if exact else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the with blocks above have already stopped every worker
        print("interrupted", file=sys.stderr)
        sys.exit(130)
