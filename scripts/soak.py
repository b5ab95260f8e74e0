"""Soak: a long loader stream with workers, saving and restoring state every N steps.

    python scripts/soak.py                                   # 10**6 batches, restore every 10**4
    python scripts/soak.py --batches 200000 --csv soak.csv --svg docs/soak.svg

Packed batches of 8 x 256 from the bundled sample, 2 worker processes. Every ``--restore-every``
steps the state is taken, the iterator closed (workers stopped), and a new iterator restored from the
state, as a restarted job would; the batch the old iterator would have returned next must equal the
restored one's first. Reports batches/s and RSS (anonymous memory of the process and its workers) over
time, as a table, a CSV and an SVG plot; exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import portable_loader as pl
from portable_loader.precache import sample_args


def anon_rss_mib() -> float:
    """RssAnon of this process and its children (the loader's workers), in MiB."""
    total = 0
    pids = [os.getpid()]
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
            pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("RssAnon"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def svg(rows: list[dict], path: str) -> None:
    """Two small line charts (batches/s and RSS against batches), hand-written SVG."""
    w, h, pad = 640, 200, 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{2 * h + 20}" font-family="sans-serif" font-size="11">']
    xmax = max(r["batches"] for r in rows) or 1
    for panel, (key, label) in enumerate([("batches_per_s", "batches/s"), ("rss_mib", "anonymous RSS, MiB")]):
        top = panel * (h + 20)
        ymax = max(r[key] for r in rows) * 1.15 or 1
        pts = " ".join(f"{pad + (w - 2 * pad) * r['batches'] / xmax:.1f},{top + h - pad / 2 - (h - pad) * r[key] / ymax:.1f}" for r in rows)
        parts += [
            f'<rect x="{pad}" y="{top + pad / 2}" width="{w - 2 * pad}" height="{h - pad}" fill="none" stroke="#ccc"/>',
            f'<polyline points="{pts}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>',
            f'<text x="{pad}" y="{top + 14}">{label} (0 to {ymax:,.0f}) over {xmax:,} batches</text>',
        ]
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=10**6)
    p.add_argument("--restore-every", type=int, default=10**4)
    p.add_argument("--report-every", type=int, default=20_000)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--cache-dir", default="portable_loader_cache")
    p.add_argument("--csv")
    p.add_argument("--svg")
    args = p.parse_args()
    cache = pl.precache(**sample_args(), out=args.cache_dir)
    loader = pl.DataLoader(pl.open_cache(cache), global_batch_size=8, seq_len=256, seed=0, packing=True,
                           num_workers=args.num_workers)
    it = iter(loader)
    rows, done, restores = [], 0, 0
    t0 = t_last = time.perf_counter()
    last_done = 0
    next_restore, next_report = args.restore_every, args.report_every
    print("| batches | elapsed s | batches/s (interval) | anonymous RSS MiB (process + workers) |")
    print("|---|---|---|---|")
    try:
        while done < args.batches:
            next(it)
            done += 1
            if done >= next_restore:
                next_restore += args.restore_every
                state = json.loads(json.dumps(it.get_state()))
                expected = next(it)
                it.close()
                it = iter(loader)
                it.set_state(state)
                got = next(it)
                done += 1
                restores += 1
                if not all(np.array_equal(expected[k], got[k]) for k in expected):
                    print(f"MISMATCH after restoring at batch {done}", file=sys.stderr)
                    return 1
            if done >= next_report or done >= args.batches:
                next_report += args.report_every
                now = time.perf_counter()
                row = {"batches": done, "elapsed_s": round(now - t0, 1),
                       "batches_per_s": round((done - last_done) / (now - t_last), 1), "rss_mib": round(anon_rss_mib(), 1)}
                rows.append(row)
                print(f"| {done:,} | {row['elapsed_s']} | {row['batches_per_s']:,} | {row['rss_mib']} |", flush=True)
                t_last, last_done = now, done
    finally:
        it.close()
    print(f"\n{done:,} batches, {restores} save/restore cycles, all exact; "
          f"{done / (time.perf_counter() - t0):,.0f} batches/s overall")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("batches,elapsed_s,batches_per_s,rss_mib\n")
            f.writelines(f"{r['batches']},{r['elapsed_s']},{r['batches_per_s']},{r['rss_mib']}\n" for r in rows)
    if args.svg:
        os.makedirs(os.path.dirname(os.path.abspath(args.svg)), exist_ok=True)
        svg(rows, args.svg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
