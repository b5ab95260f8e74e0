"""``scripts/bench_cuda.py`` keeps working where it cannot measure: ``--help``, and a machine without a
GPU (CI, the development machine) gets one clear line, exit 0 and no files. With a GPU, a short real
run writes its table."""

import csv
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench_cuda.py"


def bench(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_help_names_its_options():
    r = bench("--help")
    assert r.returncode == 0, r.stderr
    for option in ("--csv", "--svg", "--step", "--steps", "--batch", "--peak-mib"):
        assert option in r.stdout


@pytest.mark.slow
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    # No device visible: what a machine without a GPU sees, on any machine.
    r = bench("--csv", tmp_path / "cuda.csv", "--svg", tmp_path / "cuda.svg", "--cache-dir", tmp_path / "cache",
              env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("bench_cuda: no CUDA GPU here") and "nothing measured" in r.stdout
    assert len(r.stdout.splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_a_short_run_on_a_gpu_writes_its_table(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "cuda.csv"
    r = bench("--steps", 3, "--batch", 8, "--seq-len", 256, "--reps", 3, "--peak-mib", 16, "--overlap-mib", 4,
              "--csv", out, "--svg", tmp_path / "cuda.svg", "--cache-dir", tmp_path / "cache", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(out) as f:
        parts = {row["part"] for row in csv.DictReader(f)}
    assert {"bandwidth", "copy under a step"} <= parts and any(p.startswith("TorchLoader, step") for p in parts)
    assert (tmp_path / "cuda.svg").stat().st_size > 0
