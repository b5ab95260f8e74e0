"""A user's mistake gets one line, not a stack dump: every command line (``python -m portable_loader``,
``python -m portable_loader.precache`` and its subcommands) answers it with one ``error:`` line on
stderr and exit code 2, run as a user runs it (a fresh interpreter); ``pl.precache`` raises
``BadRowError`` from the caller's line with the worker pool's ``RemoteTraceback`` dropped, and
``-v`` / ``PORTABLE_LOADER_DEBUG=1`` bring the whole traceback back."""

import json
import os
import subprocess
import sys
import traceback

import pytest

import portable_loader as pl
from portable_loader.errors import DEBUG_VARIABLE, BadRowError
from portable_loader.precache import sample_args

BAD_LINE = 1000


@pytest.fixture()
def bad_rows(tmp_path):
    """2,000 text rows whose line 1000 is malformed JSON: with 500 rows a task, a worker's task finds it."""
    p = tmp_path / "bad.jsonl"
    p.write_text("".join((json.dumps({"text": f"row {i}"}) if i != BAD_LINE else '{"text": broken') + "\n"
                         for i in range(1, 2001)))
    return p


def run(module, *args, cwd, env=None):
    env = {k: v for k, v in os.environ.items() if k != DEBUG_VARIABLE} | (env or {})
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=240)


def assert_one_line(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert all(w in lines[0] for w in words), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args,words", [
    (["--global-batch-size", "0"], ["--global-batch-size", "must be >= 1, got 0"]),
    (["--steps", "1"], ["--steps", "must be >= 2"]),
    (["--num-workers", "-1"], ["--num-workers", "must be >= 0, got -1"]),
    (["--seq-len", "long"], ["--seq-len", "expected an integer, got 'long'"]),
    (["--global-batch-size"], ["--global-batch-size", "expected one argument"]),
    (["--bogus"], ["unrecognized arguments: --bogus"]),
])
def test_demo_argument_mistakes_are_one_line(tmp_path, args, words):
    assert_one_line(run("portable_loader", *args, cwd=tmp_path), *words)
    assert os.listdir(tmp_path) == []  # refused before any cache was built


def test_demo_out_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "taken").write_text("not a folder")
    assert_one_line(run("portable_loader", "--out", tmp_path / "taken", cwd=tmp_path), "taken")


@pytest.mark.slow
@pytest.mark.parametrize("args,words", [
    (["--max-length", "0"], ["--max-length", "must be >= 2"]),
    (["--format", "poetry"], ["--format", "invalid choice"]),
    (["--input", "x.jsonl"], ["missing --format, --tokenizer"]),
    (["--input", "missing.jsonl", "--format", "text", "--tokenizer", sample_args()["tokenizer"]], ["missing.jsonl"]),
    (["--format", "text", "--tokenizer", "no-such-tokenizer", "--input", "{bad}"], ["no-such-tokenizer"]),
    (["info", "nowhere"], ["nowhere"]),
    (["info"], ["cache"]),
    (["ls", "nowhere"], ["no such folder"]),
    (["rm"], ["caches"]),
    (["rm", "."], ["not a portable_loader cache"]),
])
def test_precache_mistakes_are_one_line(tmp_path, bad_rows, args, words):
    args = [str(bad_rows) if a == "{bad}" else a for a in args]
    assert_one_line(run("portable_loader.precache", *args, cwd=tmp_path), *words)


def bad_row_args(bad_rows, tmp_path):
    return ["--input", bad_rows, "--format", "text", "--tokenizer", sample_args()["tokenizer"], "--out", tmp_path / "c",
            "--num-workers", "2", "--rows-per-task", "500"]


@pytest.mark.slow
def test_precache_bad_row_with_workers_is_one_line(tmp_path, bad_rows):
    r = run("portable_loader.precache", *bad_row_args(bad_rows, tmp_path), cwd=tmp_path)
    assert_one_line(r, f"bad.jsonl: line {BAD_LINE}: malformed JSON")
    assert not os.path.exists(tmp_path / "c") or os.listdir(tmp_path / "c") == []


@pytest.mark.slow  # a second pool's start-up, for what a debugging user sees
def test_precache_v_shows_the_workers_traceback(tmp_path, bad_rows):
    r = run("portable_loader.precache", *bad_row_args(bad_rows, tmp_path), "-v", cwd=tmp_path)
    assert r.returncode == 2 and "RemoteTraceback" in r.stderr and "tokenize_task" in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1].startswith(f"error: {bad_rows}: line {BAD_LINE}: malformed JSON"), r.stderr


def precache_bad(bad_rows, tmp_path):
    with pytest.raises(BadRowError) as caught:
        pl.precache(bad_rows, tokenizer=sample_args()["tokenizer"], format="text",
                    out=tmp_path / "c", num_workers=2, rows_per_task=500)
    e = caught.value
    assert (e.where, e.problem.split(":")[0]) == (f"line {BAD_LINE}", "malformed JSON")
    return e, "".join(traceback.format_exception(e))


@pytest.mark.slow
def test_precache_bad_row_is_raised_from_the_callers_line(tmp_path, bad_rows, monkeypatch):
    monkeypatch.delenv(DEBUG_VARIABLE, raising=False)
    e, text = precache_bad(bad_rows, tmp_path)
    assert "RemoteTraceback" not in text and e.__cause__ is None and e.__suppress_context__, text
    frames = traceback.extract_tb(e.__traceback__)
    # This test's call, then the public function that raised it: none of the library's inner frames.
    assert frames[0].filename == __file__ and len(frames) == 2, text
    assert text.splitlines()[-1] == f"portable_loader.errors.BadRowError: {e}"


@pytest.mark.slow  # a second pool's start-up, for what a debugging user sees
def test_debug_variable_keeps_the_workers_traceback(tmp_path, bad_rows, monkeypatch):
    monkeypatch.setenv(DEBUG_VARIABLE, "1")
    e, text = precache_bad(bad_rows, tmp_path)
    assert "RemoteTraceback" in text and "tokenize_task" in text, text
