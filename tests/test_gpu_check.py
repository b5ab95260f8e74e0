"""``scripts/gpu_check.py`` cannot rot between GPU loans: its dry run runs every part at tiny sizes here,
reports the CUDA parts as skipped with the reason, and writes both summaries whose goals agree with
the benchmarks' own tables; a part that fails or outlives its share is reported and the rest still runs."""

import csv
import importlib.metadata
import json
import os
import pathlib
import platform
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"
PARTS = ["facts", "tests", "cuda", "train", "workers", "tokenize"]
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # what a machine without a GPU sees, on any machine


def check(out, *args, timeout=115 * 5 + 60):  # the dry run's budget, stretched by the load at most 5x
    r = subprocess.run([sys.executable, str(SCRIPT), str(out), *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **NO_GPU})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "summary.json").read_text()), (out / "summary.md").read_text()


def rows_of(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_the_dry_run_runs_every_part_and_writes_both_summaries(tmp_path):
    out = tmp_path / "out"
    summary, md = check(out, "--dry-run")
    parts = {p["part"]: p for p in summary["parts"]}
    took = {name: (p["status"], p["wall_s"]) for name, p in parts.items()}  # what a failure below shows first
    assert [p["part"] for p in summary["parts"]] == PARTS
    # Under 2 minutes where the machine has a core for each runnable process; the budget grows with the
    # load beyond that (the same work takes longer), and the run keeps to it.
    assert summary["dry_run"] and summary["budget_s"] == pytest.approx(115 * summary["stretch"], abs=0.1)
    assert summary["wall_s"] < summary["budget_s"] + 5 and (summary["stretch"] > 1 or summary["wall_s"] < 120)
    for name in ("tests", "cuda", "train"):
        assert parts[name]["status"] == "skipped" and "no CUDA GPU here" in parts[name]["reason"], parts[name]
    assert parts["tests"]["counts"]["skipped"] > 0 and parts["tests"]["counts"]["failure"] == 0
    for name in ("facts", "workers", "tokenize"):
        assert parts[name]["status"] == "ok", (took, parts[name])

    machine = summary["machine"]
    assert machine["cores"] == os.cpu_count() and machine["python"] == platform.python_version()
    assert machine["torch"] == importlib.metadata.version("torch") and "available: False" in machine["torch CUDA"]
    assert machine["import portable_loader"] == "ok" and "gpu (nvidia-smi)" in machine

    # Each goal is recomputed from the table the benchmark wrote, read here on its own.
    workers = {(r["kind"], int(r["workers"])): float(r["batches_per_s"]) for r in rows_of(out / "workers.csv")}
    assert {k for k, _ in workers} == {"concat", "packed", "tokenized", "torch", "grain"}
    goals = parts["workers"]["goals"]
    assert len(goals) == 2  # torch and grain, inline (0 workers)
    for g in goals:
        w = int(g["goal"].split(", ")[1].split()[0])
        peer = "grain" if "over grain's" in g["goal"] else "torch"
        ratio = workers[("concat", w)] / workers[(peer, w)]
        assert g["value"] == pytest.approx(ratio, rel=1e-3) and g["passed"] == (ratio > 1), g
    (tokenized,) = rows_of(out / "tokenized.csv")
    (g,) = parts["tokenize"]["goals"]
    x = float(tokenized["x_tokenizer_cores_used"])
    assert g["value"] == pytest.approx(x, rel=1e-3) and g["passed"] == (x >= 0.85)

    assert md.startswith("# GPU check, ") and "dry run" in md.splitlines()[0]
    assert "| part | what | status | goals met | wall (s) | share (s) | note |" in md
    for p in summary["parts"]:
        assert any(line.startswith(f"| {p['part']} | {p['what']} | {p['status']} |") for line in md.splitlines()), p["part"]
    results = [line.rsplit("|", 2)[1].strip() for line in md.splitlines() if line.endswith(("| pass |", "| FAIL |"))]
    assert results == ["pass" if g["passed"] else "FAIL" for p in summary["parts"] for g in p.get("goals", [])]
    # What the device tool brings back: at most 8 files, none in a folder.
    assert sorted(os.listdir(out)) == ["log.txt", "summary.json", "summary.md", "tokenized.csv", "workers.csv"]


@pytest.mark.slow
def test_a_part_that_fails_or_runs_out_of_time_is_reported_and_the_rest_runs(tmp_path):
    summary, md = check(tmp_path, "--dry-run", "--parts", "cuda", "workers", "facts", "--fail", "cuda",
                        "--share", "workers=1")
    cuda, workers, facts = summary["parts"]
    assert cuda["status"] == "error" and "failure injected by --fail cuda" in cuda["reason"], cuda
    assert workers["status"] == "timeout" and "past its share of 1 s" in workers["reason"], workers
    assert workers["wall_s"] < 1 + 5 + 5  # its share, the grace after SIGINT, start-up
    with pytest.raises(ProcessLookupError):  # nothing of the stopped part's process group is left
        os.killpg(workers["pid"], 0)
    assert facts["status"] == "ok" and summary["machine"]["cores"] == os.cpu_count()
    assert "| cuda | " in md and "| error |" in md and "| timeout |" in md


def test_bad_options_are_refused_by_name(tmp_path):
    for args, says in ((["--share", "gpu=5"], "--share gpu=5: no part named 'gpu'"),
                       (["--share", "cuda=soon"], "'soon' is not a number of seconds"),
                       (["--parts", "cuda", "facts", "cuda"], "--parts cuda facts cuda: a part named twice")):
        r = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "out"), *args], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and says in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_the_cuda_goals_are_read_from_bench_cuda_s_and_bench_gpu_train_s_tables(tmp_path, monkeypatch):
    # Their tables come only from a GPU: written here as the two scripts write them (benchlib.write_table).
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import benchlib
    import gpu_parts

    tables = {
        "bench_cuda.py": (["part", "what", "value", "unit"], [
            ["bandwidth", "torch, pinned, 256 MiB buffer (peak)", 50.0, "GB/s"],
            ["bandwidth", "torch, pageable, 256 MiB buffer", 20.0, "GB/s"],
            ["bandwidth", "ours: TorchLoader's conversion of a batch (5 fields ...), wall clock", 24.0, "GB/s"],
            ["copy under a step", "serial", 3.0, "ms"],
            *[[f"TorchLoader, step {ms:.2f} ms", name, v, "ms/step"]
              for ms, (s, a, ideal) in ((1.5, (4.5, 3.1, 3.0)), (3.0, (6.0, 3.2, 3.0)), (6.0, (9.0, 6.9, 6.0)))
              for name, v in (("serial", s), ("async", a), ("ideal", ideal))]]),
        "bench_gpu_train.py": (["size", "feed", "workers", "steps_per_s", "of_staged"], [
            [size, feed, 4, rate, round(rate / 10.0, 4)] for size, feeds in (
                ("small", {"staged": 10.0, "serial": 9.0, "async": 9.95, "torch": 9.5}),
                ("large", {"staged": 10.0, "serial": 9.0, "async": 9.8, "torch": 9.9}),
                ("jax-medium", {"jax-staged": 10.0, "jax": 9.95})) for feed, rate in feeds.items()]),
    }

    def bench(script, *args):
        path = args[args.index("--csv") + 1]
        benchlib.write_table(type("Args", (), {"csv": path}), *tables[script])
        return "measured\n"

    monkeypatch.setattr(gpu_parts, "bench", bench)
    ctx = gpu_parts.Context(dry_run=False, out=str(tmp_path), scratch=str(tmp_path), data=str(tmp_path))
    cuda = {g["goal"]: (g["value"], g["passed"]) for g in gpu_parts.cuda(ctx)["goals"]}
    assert list(cuda.values()) == [(0.48, False), (0.9677, True), (0.9375, True), (0.8696, False)]
    assert "overlap, max(step, batch) / async ms a step, step 3.00 ms" in cuda
    train = [(g["goal"].split(":")[0], g["value"], g["passed"]) for g in gpu_parts.train(ctx)["goals"]]
    assert train == [("small", 0.995, True), ("small", pytest.approx(9.95 / 9.5, rel=1e-3), True),
                     ("large", 0.98, False), ("large", pytest.approx(9.8 / 9.9, rel=1e-3), False),
                     ("jax-medium", 0.995, True)]


@pytest.mark.slow
def test_the_tests_part_counts_outcomes_and_keeps_each_failure_s_first_line(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_parts

    (tmp_path / "test_some.py").write_text(
        "import pytest\n"
        "def test_passes():\n    pass\n"
        "def test_fails():\n    assert 1 + 1 == 3, 'arithmetic is off\\nsecond line'\n"
        "@pytest.mark.skipif(True, reason='needs a CUDA GPU')\ndef test_on_a_gpu():\n    pass\n")
    monkeypatch.setattr(gpu_parts, "DRY_TESTS", (str(tmp_path / "test_some.py"),))
    ctx = gpu_parts.Context(dry_run=True, out=str(tmp_path), scratch=str(tmp_path), data=str(tmp_path))
    result = gpu_parts.tests(ctx)
    assert result["counts"] == {"passed": 1, "failure": 1, "error": 0, "skipped": 1}
    ((name, outcome, first),) = result["figures"]["rows"]
    assert name.endswith("test_fails") and outcome == "failure" and first.startswith("AssertionError: arithmetic is off")
    assert "second line" not in first
    assert result["goals"][0]["passed"] is False and result["status"] == "skipped" and "needs a CUDA GPU" in result["reason"]
