"""One prepared check for a GPU host (issue 49): the CUDA tests, the CUDA path's copies and overlap, a
training step fed by the loaders, the workers and tokenize on read, with the machine's facts, each
figure against its goal. On the GPU host it finishes in under 8 minutes:

    PYTHONPATH=. python scripts/gpu_check.py OUT             # the full run (docs/performance.md)
    PYTHONPATH=. python scripts/gpu_check.py --dry-run OUT   # anywhere, tiny sizes; the suite runs it

Writes ``OUT/summary.md`` and ``OUT/summary.json`` (rewritten after every part, so a run cut short
still leaves what it measured), ``OUT/log.txt`` (every part's output) and the benchmarks' tables
(``OUT/cuda.csv``, ``gpu_train.csv``, ``workers.csv``, ``tokenized.csv``): at most 7 files, which the
device tool brings back.

Parts (``scripts/gpu_parts.py``), in this order unless ``--parts`` says otherwise: ``facts``, ``tests``,
``cuda``, ``train``, ``workers``, ``tokenize``. Each runs in its own process group with its own share
of time (``--share PART=SECONDS``) inside the whole run's ``--budget``; one that fails is reported with
its error's last lines, one that outlives its share is interrupted (SIGINT, as Ctrl-C: the loaders
clean up), then killed, and reported; the rest still runs. Without a CUDA GPU the CUDA parts
(``tests``, ``cuda``, ``train``) say so and are reported as skipped. Nothing is installed: optional
peers (Grain) are compared only where importable; tokenize on read needs the phi-3-mini tokenizer and
the c4 demo rows from ``--data`` (default: ``$PORTABLE_LOADER_DATA``, else ``../shared/data``, else
``.gpu_data`` in the checkout). On a busy machine the dry run's default shares and budget (115 s)
grow with the load average over the cores, up to 5x; the full run's never do.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_parts import PARTS, ROOT, Context  # noqa: E402

SHARES = {"facts": 30, "tests": 80, "cuda": 60, "train": 130, "workers": 110, "tokenize": 55}
DRY_SHARES = {"facts": 30, "tests": 40, "cuda": 30, "train": 30, "workers": 90, "tokenize": 60}
BUDGET, DRY_BUDGET = 465, 115  # under 8 minutes on the GPU host, under 2 in the suite
WHAT = {"facts": "the machine", "tests": "CUDA tests", "cuda": "copies and overlap (bench_cuda)",
        "train": "bf16 training step fed by the loaders (bench_gpu_train)",
        "workers": "workers against torch and Grain (bench_workers)", "tokenize": "tokenize on read (bench_tokenized)"}
GRACE_S = 5  # after SIGINT, before SIGKILL
MAX_STRETCH = 5


def default_data() -> str:
    for path in (os.environ.get("PORTABLE_LOADER_DATA"), os.path.join(os.path.dirname(ROOT), "shared", "data")):
        if path and os.path.isdir(path):
            return path
    return os.path.join(ROOT, ".gpu_data")


def stretch(dry_run: bool) -> float:
    """How much longer the dry run's default shares and budget are here: the load average over the cores,
    between 1 and 5. The same work takes that much longer on a machine whose runnable processes outnumber
    its cores; the full run's 8 minutes are the device's lease, never stretched."""
    if not dry_run:
        return 1.0
    return min(MAX_STRETCH, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", help="output folder (created)")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes: checks that every part still runs")
    p.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS), help="parts to run, in this order")
    p.add_argument("--share", action="append", default=[], metavar="PART=SECONDS", help="a part's share of time")
    p.add_argument("--budget", type=float, help=f"seconds for the whole run (default {BUDGET}; dry run {DRY_BUDGET})")
    p.add_argument("--data", default=default_data(), help="folder with tokenizers/phi-3-mini and text/llamafactory_c4_demo.jsonl")
    p.add_argument("--fail", choices=list(PARTS), help="make this part raise at its start (checks that a failure is reported)")
    p.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)  # run one part: what the parent starts
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.out is None:
        p.error("the output folder is required")
    if len(set(args.parts)) < len(args.parts):
        p.error(f"--parts {' '.join(args.parts)}: a part named twice")
    args.stretch = stretch(args.dry_run)
    shares = {name: seconds * args.stretch for name, seconds in (DRY_SHARES if args.dry_run else SHARES).items()}
    for item in args.share:
        name, _, seconds = item.partition("=")
        if name not in PARTS:
            p.error(f"--share {item}: no part named {name!r} (parts: {', '.join(PARTS)})")
        try:
            shares[name] = float(seconds)
        except ValueError:
            p.error(f"--share {item}: {seconds!r} is not a number of seconds")
    args.shares = shares
    args.budget = args.budget or (DRY_BUDGET * args.stretch if args.dry_run else BUDGET)
    return args


def one_part(args) -> None:
    """In the part's own process: run it and leave its result as JSON in the scratch folder."""
    if args.fail == args.part:
        raise RuntimeError(f"failure injected by --fail {args.part}")
    ctx = Context(dry_run=args.dry_run, out=args.out, scratch=args.scratch, data=args.data)
    result = PARTS[args.part](ctx)
    with open(os.path.join(args.scratch, f"{args.part}.json"), "w") as f:
        json.dump(result, f)


def run_part(name: str, args, scratch: str, seconds: float, log) -> dict:
    """Start one part in its own process group; wait for it at most ``seconds``; what became of it."""
    folder = os.path.join(scratch, name)
    os.makedirs(folder)
    cmd = [sys.executable, os.path.abspath(__file__), args.out, "--part", name, "--scratch", folder, "--data", args.data]
    cmd += (["--dry-run"] if args.dry_run else []) + (["--fail", args.fail] if args.fail else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", PORTABLE_LOADER_DATA=args.data,
               XLA_PYTHON_CLIENT_PREALLOCATE="false")  # JAX beside torch on one GPU: take memory as needed
    log.write(f"\n===== {name} (share {seconds:.0f} s) {time.strftime('%H:%M:%S')} =====\n")
    log.flush()
    start = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        p.wait(timeout=seconds)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        _signal_group(p.pid, signal.SIGINT)
        try:
            p.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(p.pid, signal.SIGKILL)  # whatever the part left behind (a benchmark's workers)
    p.wait()
    result = {"part": name, "what": WHAT[name], "wall_s": round(time.perf_counter() - start, 1), "share_s": seconds,
              "pid": p.pid}
    path = os.path.join(folder, f"{name}.json")
    if timed_out:
        result.update(status="timeout", reason=f"ran past its share of {seconds:.0f} s; stopped")
    elif p.returncode != 0 or not os.path.exists(path):
        result.update(status="error", reason=f"exited {p.returncode}: {_last_error(log.name, name)}")
    else:
        with open(path) as f:
            result.update(json.load(f))
    return result


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _last_error(log_path: str, name: str) -> str:
    """The last lines of part ``name``'s output: its traceback's end, as a reason."""
    with open(log_path) as f:
        text = f.read()
    own = text.rsplit(f"===== {name} ", 1)[-1].strip().splitlines()[1:]
    return " | ".join(line.strip() for line in own[-3:]) or "no output"


def goals_met(part: dict) -> str:
    goals = part.get("goals", [])
    return f"{sum(g['passed'] for g in goals)}/{len(goals)}" if goals else "-"


def markdown(summary: dict) -> str:
    mode = "dry run (tiny sizes: the figures say only that each part runs)" if summary["dry_run"] else "full run"
    lines = [f"# GPU check, {summary['date']}: {mode}", "",
             f"Total {summary['wall_s']:.0f} s of a {summary['budget_s']:.0f} s budget (load average "
             f"{summary['load_average']} at the start; shares stretched {summary['stretch']}x); "
             f"goals met: {summary['goals_met']}.", "", "## Machine", "", "| fact | value |", "|---|---|"]
    lines += [f"| {k} | {_cell(v)} |" for k, v in summary["machine"].items()]
    lines += ["", "## Parts", "", "| part | what | status | goals met | wall (s) | share (s) | note |", "|---|---|---|---|---|---|---|"]
    for p in summary["parts"]:
        lines.append(f"| {p['part']} | {p['what']} | {p['status']} | {goals_met(p)} | {p['wall_s']} | {p['share_s']:.0f} | "
                     f"{_cell(p.get('reason', '; '.join(p.get('notes', [])[:1])))} |")
    lines += ["", "## Goals", "", "| part | goal | figure | target | result |", "|---|---|---|---|---|"]
    for p in summary["parts"]:
        for g in p.get("goals", []):
            lines.append(f"| {p['part']} | {_cell(g['goal'])} | {g['value']:.4g} | {g['target']} | {'pass' if g['passed'] else 'FAIL'} |")
    for p in summary["parts"]:
        fig = p.get("figures")
        if fig and fig["rows"]:
            lines += ["", f"## {p['part']}: {p['what']}", ""] + [f"- {_cell(n)}" for n in p.get("notes", [])] + [""]
            lines += ["| " + " | ".join(fig["header"]) + " |", "|" + "---|" * len(fig["header"])]
            lines += ["| " + " | ".join(_cell(x) for x in row) + " |" for row in fig["rows"]]
    return "\n".join(lines) + "\n"


def _cell(x) -> str:
    if isinstance(x, float):
        return f"{x:,.0f}" if abs(x) >= 1e4 else f"{x:.4g}"
    return str(x).replace("|", "/").replace("\n", " ")


def write_summary(out: str, summary: dict) -> None:
    parts = summary["parts"]
    summary["goals_met"] = f"{sum(g['passed'] for p in parts for g in p.get('goals', []))}/" \
                           f"{sum(len(p.get('goals', [])) for p in parts)}"
    for name, text in (("summary.json", json.dumps(summary, indent=1)), ("summary.md", markdown(summary))):
        with open(os.path.join(out, name + ".tmp"), "w") as f:
            f.write(text)
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.part:
        one_part(args)
        return 0
    os.makedirs(args.out, exist_ok=True)
    args.out = os.path.abspath(args.out)
    args.data = os.path.abspath(args.data)
    start = time.perf_counter()
    summary = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "dry_run": args.dry_run,
               "budget_s": round(args.budget, 1), "stretch": round(args.stretch, 4),
               "load_average": round(os.getloadavg()[0], 2), "wall_s": 0.0, "machine": {}, "parts": []}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch, open(os.path.join(args.out, "log.txt"), "w") as log:
        for name in args.parts:
            left = args.budget - (time.perf_counter() - start)
            if left < 1:
                result = {"part": name, "what": WHAT[name], "status": "timeout", "wall_s": 0.0, "share_s": 0.0,
                          "reason": "not started: the run's budget was spent"}
            else:
                result = run_part(name, args, scratch, min(args.shares[name], left), log)
            summary["machine"].update(result.pop("facts", {}))
            summary["parts"].append(result)
            summary["wall_s"] = round(time.perf_counter() - start, 1)
            write_summary(args.out, summary)
            print(f"{name}: {result['status']}, goals met {goals_met(result)}, {result['wall_s']} s"
                  + (f" ({result['reason']})" if result.get("reason") else ""), flush=True)
    print(f"wrote {os.path.join(args.out, 'summary.md')}, summary.json and log.txt; goals met: {summary['goals_met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
