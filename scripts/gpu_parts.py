"""The parts of ``scripts/gpu_check.py``: what each one runs, at which sizes, and how its figures meet
the goals of issue 49 (docs/performance.md, "One check for a GPU host").

Each part is a function of a ``Context`` that runs in its own process (``gpu_check.py --part NAME``),
runs its test file or benchmark script as a child, reads the table that script wrote and returns a
dict: ``status`` ("ok", or "skipped" where what it is for cannot run here, with the ``reason``),
``figures`` (the table: ``header`` and ``rows``), ``goals`` (each a figure against its target) and
``notes``. A part that raises, or outlives its share of time, is reported by ``gpu_check.py``.

Example:
    >>> goal("conversion, of torch's pinned peak", 0.62, 0.5)
    {'goal': "conversion, of torch's pinned peak", 'value': 0.62, 'target': '>= 0.5', 'passed': True}
"""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import importlib.util
import os
import platform
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
sys.path.insert(0, SCRIPTS)
from benchlib import cpu_model  # noqa: E402

VERSIONS = ("numpy", "pyarrow", "torch", "jax", "jaxlib", "flax", "orbax-checkpoint", "tokenizers", "transformers",
            "psutil", "grain", "array-record")
# The CUDA tests: two files whole and test_torch.py's tests on a "cuda" device (its others run on the CPU,
# two of them minutes long); the dry run takes one CUDA test, which skips at once without a GPU.
CUDA_TESTS = ("tests/test_cuda_host.py", "tests/test_bench_cuda.py", "tests/test_torch.py", "-k", "cuda or bad_device")
DRY_TESTS = ("tests/test_cuda_host.py::test_cuda_batches_equal_the_numpy_loaders_and_come_from_registered_blocks",)
TOKENIZER = os.path.join("tokenizers", "phi-3-mini")
TEXTS = os.path.join("text", "llamafactory_c4_demo.jsonl")
WORKERS = (0, 1, 2, 4, 8, 14)


@dataclass
class Context:
    """What a part needs: the sizes (``dry_run``), where tables go (``out``), its scratch folder and the data folder."""

    dry_run: bool
    out: str
    scratch: str
    data: str

    def has_data(self) -> bool:
        return os.path.isdir(os.path.join(self.data, TOKENIZER)) and os.path.isfile(os.path.join(self.data, TEXTS))

    def no_data(self) -> str:
        return (f"no tokenizer data at {self.data} (needs {TOKENIZER}/ and {TEXTS}): copy them into .gpu_data/ "
                "and carry it, as docs/performance.md says")


OPS = {">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b}


def goal(what: str, value: float, target: float, op: str = ">=") -> dict:
    """One figure against its goal: passed when ``value OP target``."""
    return {"goal": what, "value": float(f"{value:.4g}"), "target": f"{op} {target:g}", "passed": bool(OPS[op](value, target))}


def run(cmd: list[str]) -> tuple[int, str]:
    """Run ``cmd`` from the repository root, its output streamed into this part's log as it comes and returned."""
    lines = []
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line)
    return p.returncode, "".join(lines)


def bench(script: str, *args: str) -> str:
    """Run ``scripts/SCRIPT`` with ``args``; its output, or an error naming the script and its last lines."""
    rc, text = run([sys.executable, os.path.join(SCRIPTS, script), *args])
    if rc != 0:
        raise RuntimeError(f"{script} exited {rc}: " + " | ".join(text.strip().splitlines()[-5:]))
    return text


def not_measured(text: str, name: str) -> str | None:
    """The line in which a CUDA benchmark says it measured nothing here (no torch, no GPU), or None."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first if first.startswith(f"{name}: ") and "nothing measured" in first else None


def n_workers(n: int) -> str:
    return f"{n} worker{'' if n == 1 else 's'}"


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # what an import hook that refuses the name raises
        return False


def table(path: str) -> dict:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return {"header": rows[0], "rows": [[_number(x) for x in row] for row in rows[1:]]}


def _number(text: str):
    try:
        return float(text) if any(c in text for c in ".en") else int(text)
    except ValueError:
        return text


def records(figures: dict) -> list[dict]:
    return [dict(zip(figures["header"], row)) for row in figures["rows"]]


def facts(ctx: Context) -> dict:
    """The machine: GPU, driver, CUDA, CPU, cores, memory, Python, library versions, and what imports."""
    f = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_model(),
         "cores": os.cpu_count(), "cores usable": len(os.sched_getaffinity(0)), "memory": _meminfo(),
         "os": platform.platform(), "python": platform.python_version()}
    f["gpu (nvidia-smi)"] = _nvidia_smi()
    for name in VERSIONS:
        try:
            f[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            f[name] = "not installed"
    try:
        import torch

        f["torch CUDA"] = f"{torch.version.cuda}, available: {torch.cuda.is_available()}"
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            f["torch device"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs"
    except ImportError as e:
        f["torch CUDA"] = f"torch not importable: {e}"
    try:
        import jax

        f["jax devices"] = ", ".join(sorted({f"{d.platform}:{d.device_kind}" for d in jax.devices()}))
    except Exception as e:  # a jax without a working backend says why here, and the rest still reports
        f["jax devices"] = f"jax not usable: {type(e).__name__}: {e}"
    f["import portable_loader"] = _imports("portable_loader")
    f["checkout"] = _commit()
    return {"status": "ok", "facts": f}


def _meminfo() -> str:
    try:
        with open("/proc/meminfo") as f:
            return f"{int(f.readline().split()[1]) / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        return "unknown"


def _nvidia_smi() -> str:
    if shutil.which("nvidia-smi") is None:
        return "none: no nvidia-smi here"
    rc, text = run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    return text.strip().replace("\n", "; ") if rc == 0 else f"nvidia-smi exited {rc}: {text.strip()[-200:]}"


def _imports(module: str) -> str:
    try:
        __import__(module)
        return "ok"
    except Exception as e:
        return f"fails: {type(e).__name__}: {e}"


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", ROOT, "log", "-1", "--format=%h %cs %s"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no git)"
    return out.stdout.strip()[:100] if out.returncode == 0 else "unknown (no .git in the copy)"


def tests(ctx: Context) -> dict:
    """The CUDA test files under pytest: counts, and each failure's first line."""
    junit = os.path.join(ctx.scratch, "junit.xml")
    files = DRY_TESTS if ctx.dry_run else CUDA_TESTS
    run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *files])
    if not os.path.exists(junit):
        raise RuntimeError("pytest wrote no report (see the log)")
    counts = {"passed": 0, "failure": 0, "error": 0, "skipped": 0}
    rows, skips = [], set()
    for case in ET.parse(junit).iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        counts[kind] += 1
        message = (case.find(kind).get("message") or "").strip() if kind != "passed" else ""
        if kind in ("failure", "error"):
            rows.append([f"{case.get('classname')}::{case.get('name')}", kind, message.splitlines()[0][:300] if message else ""])
        elif kind == "skipped":
            skips.add(message)
    failed = counts["failure"] + counts["error"]
    result = {"status": "ok", "figures": {"header": ["test", "outcome", "first line"], "rows": rows}, "counts": counts,
              "goals": [goal(f"tests failed or in error, of {sum(counts.values())}", failed, 0, "<=")],
              "notes": [f"pytest {shlex.join(files)}: " + ", ".join(f"{v} {k}" for k, v in counts.items())]
              + [f"skipped: {s}" for s in sorted(skips)]}
    no_gpu = sorted(s for s in skips if "needs a CUDA GPU" in s)
    if no_gpu:
        result.update(status="skipped", reason=f"no CUDA GPU here: {counts['skipped']} tests skipped "
                                               f"({'; '.join(no_gpu)}), {counts['passed']} passed without it")
    return result


def cuda(ctx: Context) -> dict:
    """bench_cuda.py: TorchLoader's conversion against torch's pinned peak; the async collator's overlap."""
    path = os.path.join(ctx.out, "cuda.csv")
    sizes = (["--steps", "3", "--batch", "8", "--seq-len", "256", "--reps", "3", "--peak-mib", "16", "--overlap-mib", "4"]
             if ctx.dry_run else ["--steps", "40"])
    text = bench("bench_cuda.py", *sizes, "--csv", path, "--svg", "-", "--cache-dir", os.path.join(ctx.scratch, "cache"))
    why = not_measured(text, "bench_cuda")
    if why:
        return {"status": "skipped", "reason": why}
    figures = table(path)
    rows = records(figures)
    peak = next(r["value"] for r in rows if r["part"] == "bandwidth" and "(peak)" in r["what"])
    ours = next(r["value"] for r in rows if r["part"] == "bandwidth" and r["what"].startswith("ours"))
    goals = [goal("conversion of a batch (TorchLoader, GB/s), of torch's pinned peak", ours / peak, 0.5)]
    steps = {}
    for r in rows:
        if r["part"].startswith("TorchLoader, step"):
            steps.setdefault(r["part"], {})[r["what"]] = r["value"]
    for part, ms in steps.items():
        goals.append(goal(f"overlap, max(step, batch) / async ms a step, {part.removeprefix('TorchLoader, ')}",
                          ms["ideal"] / ms["async"], 0.9))
    return {"status": "ok", "figures": figures, "goals": goals,
            "notes": [f"peak {peak:.1f} GB/s, ours {ours:.1f} GB/s; the steps are 0.5x, 1x and 2x a batch's serial cost"]}


def train(ctx: Context) -> dict:
    """bench_gpu_train.py: a bf16 transformer step at three sizes, each feed as a fraction of the staged batch."""
    path = os.path.join(ctx.out, "gpu_train.csv")
    sizes = (["--sizes", "small", "--steps", "3", "--rounds", "1", "--batch", "2", "--seq-len", "256",
              "--tokens", "200000", "--workers", "1"] if ctx.dry_run else ["--steps", "20", "--rounds", "2"])
    text = bench("bench_gpu_train.py", *sizes, "--csv", path, "--svg", "-")
    why = not_measured(text, "bench_gpu_train")
    if why:
        return {"status": "skipped", "reason": why}
    figures = table(path)
    rate = {(r["size"], r["feed"]): r for r in records(figures)}
    goals = []
    for size in dict.fromkeys(s for s, _ in rate):
        if (size, "async") in rate:
            goals.append(goal(f"{size}: TorchLoader (async), of the staged step", rate[(size, "async")]["of_staged"], 0.99))
            goals.append(goal(f"{size}: TorchLoader (async) over torch's DataLoader(pin_memory=True), steps/s",
                              rate[(size, "async")]["steps_per_s"] / rate[(size, "torch")]["steps_per_s"], 1, ">"))
        if (size, "jax") in rate:
            goals.append(goal(f"{size}: JaxLoader, of the staged jax step", rate[(size, "jax")]["of_staged"], 0.99))
    notes = [] if any(f == "jax" for _, f in rate) else ["no JaxLoader rows: JAX saw no GPU (see the log)"]
    return {"status": "ok", "figures": figures, "goals": goals, "notes": notes}


def workers(ctx: Context) -> dict:
    """bench_workers.py: concat windows, best-fit packing and tokenize on read by worker count, beside torch and Grain."""
    path = os.path.join(ctx.out, "workers.csv")
    # The goals' kinds first: a run cut short by its share has printed those lines in the log.
    kinds, notes = ["concat", "torch", "grain", "packed", "tokenized"], []
    if not importable("grain"):
        kinds.remove("grain")
        notes.append("grain is not installed here: not compared")
    if not ctx.has_data():
        kinds.remove("tokenized")
        notes.append(f"tokenized left out: {ctx.no_data()}")
    counts = (0,) if ctx.dry_run else WORKERS  # the dry run starts no worker process: the suite tests them
    sizes = ["--rounds", "1", "--steps", "1", "--tokens", "2000000"] if ctx.dry_run else \
        ["--rounds", "1", "--steps", "40", "--tokens", "60000000"]
    bench("bench_workers.py", "--workers", *map(str, counts), "--kinds", *kinds, *sizes, "--csv", path, "--svg", "-")
    figures = table(path)
    rate = {(r["kind"], r["workers"]): r["batches_per_s"] for r in records(figures)}
    goals = []
    for peer in ("torch", "grain"):
        for w in counts:
            if (peer, w) in rate:
                goals.append(goal(f"concat 64x4096, {n_workers(w)}, over {peer}'s batches/s",
                                  rate[("concat", w)] / rate[(peer, w)], 1, ">"))
    return {"status": "ok", "figures": figures, "goals": goals,
            "notes": notes + ["main_cpu_ms_per_batch: the trainer's process CPU a batch"]}


def tokenize(ctx: Context) -> dict:
    """bench_tokenized.py: tokenize on read with the most workers against as many tokenizer processes."""
    if not ctx.has_data():
        return {"status": "skipped", "reason": ctx.no_data()}
    path = os.path.join(ctx.out, "tokenized.csv")
    most = 0 if ctx.dry_run else max(WORKERS)
    rows = "300" if ctx.dry_run else "10000"
    bench("bench_tokenized.py", "--only", "pl", "--modes", "packed", "--workers", str(most), "--rounds", "1",
          "--rows", rows, "--tokenizer", os.path.join(ctx.data, TOKENIZER), "--csv", path, "--svg", "-")
    figures = table(path)
    row = next(r for r in records(figures) if r["loader"].endswith(f"num_workers={most}"))
    return {"status": "ok", "figures": figures,
            "goals": [goal(f"pl.tokenized packed, {n_workers(most)}, of {row['cores_used']} one-thread tokenizer processes' tokens/s",
                           row["x_tokenizer_cores_used"], 0.85)]}


PARTS = {"facts": facts, "tests": tests, "cuda": cuda, "train": train, "workers": workers, "tokenize": tokenize}
