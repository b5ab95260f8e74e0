"""``scripts/bench_workers.py`` runs end to end on a small corpus: its table, its CSV, and the two
ratios the scale-out goals are read from (the trainer's CPU with workers over the inline engine's,
41 MB batches over 3.7 MB ones), with a trainer's step slept between batches."""

import csv
import pathlib
import re
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench_workers.py"


def test_a_short_run_writes_its_table_and_ratios(tmp_path):
    out = tmp_path / "workers.csv"
    r = subprocess.run([sys.executable, str(SCRIPT), "--kinds", "concat", "padded-long", "--workers", "0", "1",
                        "--rounds", "1", "--steps", "4", "--step-ms", "1", "--tokens", "2000000",
                        "--csv", str(out), "--svg", "-"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(out.open()))
    assert {(row["kind"], row["workers"]) for row in rows} == {(k, w) for k in ("concat", "padded-long") for w in "01"}
    assert all(float(row["batches_per_s"]) > 0 and float(row["main_cpu_ms_per_batch"]) > 0 for row in rows)
    inline = {row["kind"]: float(row["main_cpu_ms_per_batch"]) for row in rows if row["workers"] == "0"}
    share = re.search(r"concat, 1 workers: main CPU a batch [\d.]+ ms = ([\d.]+)% of the inline engine's ([\d.]+)", r.stdout)
    assert share and abs(float(share.group(2)) - inline["concat"]) < 0.01, r.stdout
    assert re.search(r"1 workers: main CPU a batch, 41 MB padded over 3.7 MB concat: [\d.]+x", r.stdout), r.stdout
