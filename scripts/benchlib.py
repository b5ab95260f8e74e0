"""What every ``scripts/bench_*.py`` shares: the machine description, start-up and steady rate timed
apart with the load average beside each (``timed_stream``, ``with_load``), and its table as CSV + SVG.

Each benchmark takes ``--csv PATH`` and ``--svg PATH`` (defaults ``docs/bench/NAME.csv`` and
``.svg``, ``-`` for none) and writes its table there; ``scripts/bench_all.sh`` runs them all.

Example:
    >>> args = add_output_args(argparse.ArgumentParser(), "demo").parse_args([])   # doctest: +SKIP
    >>> write_table(args, ["what", "per_s"], [["a", 1.0], ["b", 2.5]])              # doctest: +SKIP
    >>> bar_svg(args, "demo", ["a", "b"], [1.0, 2.5], "things/s")                   # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import os
import platform
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(ROOT, "docs", "bench")
PACKAGES = ("numpy", "pyarrow", "array-record", "grain", "datasets", "torch", "jax", "transformers", "tokenizers", "matplotlib")


def machine() -> str:
    """One line: CPU model, cores, Python and numpy versions (printed atop every benchmark)."""
    import numpy as np

    return f"{cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, numpy {np.__version__}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def machine_report() -> str:
    """Several lines for docs/bench/machine.txt: CPU, cores, memory, load, OS and package versions."""
    lines = [f"cpu: {cpu_model()}", f"cores: {os.cpu_count()}"]
    try:
        with open("/proc/meminfo") as f:
            lines.append("memory: " + f.readline().split(":", 1)[1].strip())
        lines.append("load average at start (1, 5, 15 min): " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    except OSError:
        pass
    lines += [f"os: {platform.platform()}", f"python: {platform.python_version()}"]
    for name in PACKAGES:
        try:
            lines.append(f"{name}: {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"{name}: not installed")
    return "\n".join(lines) + "\n"


def add_output_args(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    parser.add_argument("--csv", default=os.path.join(BENCH_DIR, f"{name}.csv"), help="table as CSV ('-': none)")
    parser.add_argument("--svg", default=os.path.join(BENCH_DIR, f"{name}.svg"), help="plot as SVG ('-': none)")
    return parser


def _shown(path: str) -> str:
    """``path`` relative to the repository when inside it: logs are committed beside the tables."""
    rel = os.path.relpath(os.path.abspath(path), ROOT)
    return path if rel.startswith("..") else rel


def write_table(args, header: list[str], rows: list[list]) -> None:
    if args.csv == "-":
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for row in rows:
            w.writerow([f"{x:.6g}" if isinstance(x, float) else x for x in row])
    print(f"wrote {_shown(args.csv)}")


def _figure(height: float):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "portable_loader"  # same data, same file: diffs show real changes
    return plt, plt.subplots(figsize=(10, height))


def _save(args, plt, fig, ax, title: str) -> None:
    ax.set_title(f"{title}\n{machine()}", fontsize=9)
    write_svg(args, plt, fig)


def write_svg(args, plt, fig) -> None:
    """Lay out ``fig``, write it to ``args.svg`` (no date: same data, same file) and close it."""
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.svg)), exist_ok=True)
    fig.savefig(args.svg, format="svg", metadata={"Date": None})
    plt.close(fig)
    print(f"wrote {_shown(args.svg)}")


def bar_svg(args, title: str, labels: list[str], values: list[float], xlabel: str, highlight=(), log=False) -> None:
    """Horizontal bars, one per label, the value written at each bar's end; ``highlight`` labels in blue."""
    if args.svg == "-":
        return
    plt, (fig, ax) = _figure(1.2 + 0.38 * len(labels))
    colors = ["tab:blue" if lab in highlight else "tab:gray" for lab in labels]
    y = list(range(len(labels)))[::-1]
    ax.barh(y, values, color=colors)
    ax.set_yticks(y, labels, fontsize=8)
    for yi, v in zip(y, values):
        ax.text(v, yi, f" {v:,.3g}" if v < 100 else f" {v:,.0f}", va="center", fontsize=8)
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_xlim(right=max(values) * (3 if log else 1.18))
    _save(args, plt, fig, ax, title)


def grouped_svg(args, title: str, groups: list[str], series: dict[str, list[float]], ylabel: str, log=False) -> None:
    """Vertical bars: one group per entry of ``groups``, one bar per series in each."""
    if args.svg == "-":
        return
    plt, (fig, ax) = _figure(4)
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        xs = [g + (k - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    _save(args, plt, fig, ax, title)


def load() -> float:
    """The 1-minute load average now: printed beside every figure, since a shared machine's load moves it."""
    return os.getloadavg()[0]


def with_load(text: str, load_average: float) -> str:
    """``"1,234 batches/s (load 3.1)"``: a figure and the load average it was measured under.

    >>> with_load("1,234 batches/s", 3.14)
    '1,234 batches/s (load 3.1)'
    """
    return f"{text} (load {load_average:.1f})"


def timed_stream(it, count=lambda item: 1, limit: int | None = None, start: float | None = None) -> dict:
    """Consume iterator ``it``: the time to its first item (start-up) and the steady rate after it, apart.

    A stream's first item carries its start-up (workers starting, a tokenizer loading, the first
    window planned); a rate over a short run that includes it mixes the two. ``count(item)``: the
    units an item is worth (1: items/s; real tokens: tokens/s); ``limit``: items after the first;
    ``start``: a ``perf_counter()`` taken earlier (building the loader) from which start-up counts.
    Returns ``first_s``, ``first_load``, ``steady_per_s``, ``steady_s``, ``steady_units``,
    ``steady_items``, ``steady_load`` (the load averages when each was measured) and ``first`` (the item).

    >>> r = timed_stream(iter(range(100)), limit=50)
    >>> r["first"], r["steady_items"], r["first_s"] >= 0 and r["steady_per_s"] > 0
    (0, 50, True)
    """
    t0 = time.perf_counter() if start is None else start
    first = next(it)
    first_s, first_load = time.perf_counter() - t0, load()
    units = items = 0
    t1 = time.perf_counter()
    for item in it:
        units += count(item)
        items += 1
        if limit is not None and items >= limit:
            break
    steady_s = time.perf_counter() - t1
    return {"first": first, "first_s": first_s, "first_load": first_load, "steady_s": steady_s, "steady_units": units,
            "steady_items": items, "steady_per_s": units / steady_s if steady_s > 0 else float("nan"),
            "steady_load": load()}


def best_of(fn, repeat: int) -> float:
    """The shortest of ``repeat`` timed calls of ``fn``, in seconds (the least disturbed run)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
