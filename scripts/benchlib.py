"""What every ``scripts/bench_*.py`` shares: the machine description, and its table as CSV + SVG.

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


def best_of(fn, repeat: int) -> float:
    """The shortest of ``repeat`` timed calls of ``fn``, in seconds (the least disturbed run)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
