"""The cost of skipping 10^5 batches (docs/loader.md, "Skipping batches"): padded and packed, over the
bundled sample cache, 8 x 256; a range in ``skip_batches`` and ``it.skip`` on a live iterator. Each
figure is a latency after the loader has started (its start-up is not in it), with the load average.

    .venv/bin/python scripts/bench_skip.py
"""

import os
import tempfile
import time

import portable_loader as pl
from portable_loader.precache import sample_args

work = tempfile.TemporaryDirectory()  # not the working folder: bench_all.sh runs from the checkout
src = pl.open_cache(pl.precache(**sample_args(), out=work.name))
for packing in (False, True):
    kw = dict(global_batch_size=8, seq_len=256, packing=packing, seed=0)
    with iter(pl.DataLoader(src, skip_batches=[(10, 10 + 10**5)], **kw)) as it:
        for _ in range(10):
            next(it)
        t = time.perf_counter()
        next(it)
        ranged = time.perf_counter() - t
    with iter(pl.DataLoader(src, **kw)) as it:
        next(it)
        t = time.perf_counter()
        it.skip(10**5)
        next(it)
        live = time.perf_counter() - t
    print(f"{'packed' if packing else 'padded'}: first batch after a 10^5-batch skip: "
          f"skip_batches {ranged * 1e3:.1f} ms, it.skip {live * 1e3:.1f} ms (load {os.getloadavg()[0]:.1f})")
