"""The precache command line and the cache-management API: argument errors as one line, help text,
--num-workers 0, --field typos, locks that leave no file and say whom they wait for (real processes),
open_cache on a folder of caches, and info / ls / rm with their library functions."""

import json
import os
import select
import statistics
import subprocess
import sys
import time

import pytest

import portable_loader as pl
from conftest import GPT2, need
from portable_loader.errors import CacheError
from portable_loader.precache import build_cache
from portable_loader.precache.cli import _build_parser, main
from portable_loader.precache.lock import locked


@pytest.fixture()
def qa(tmp_path):
    """A small question/answer JSONL file (alpaca with renamed fields)."""
    p = tmp_path / "qa.jsonl"
    p.write_text("".join(json.dumps({"question": f"what is {i}?", "answer": "it is " + "x " * (i % 13)}) + "\n"
                         for i in range(40)))
    return p


def cli(capsys, *args):
    """Run the CLI in this process; (exit code, stdout, stderr). argparse's exits count as return codes."""
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def qa_args(qa, out, *extra):
    return ["--input", qa, "--tokenizer", need(GPT2), "--format", "alpaca", "--out", out,
            "--field", "instruction=question", "--field", "output=answer", *extra]


@pytest.mark.parametrize("flag,value,message", [
    ("--max-length", "0", "argument --max-length: must be >= 2, got 0"),
    ("--max-length", "-5", "argument --max-length: must be >= 2, got -5"),
    ("--max-length", "1", "argument --max-length: must be >= 2, got 1"),
    ("--max-length", "ten", "argument --max-length: expected an integer, got 'ten'"),
    ("--num-workers", "-1", "argument --num-workers: must be >= 0, got -1"),
])
def test_bad_numbers_are_one_line_errors(qa, tmp_path, capsys, flag, value, message):
    rc, out, err = cli(capsys, *qa_args(qa, tmp_path / "c"), flag, value)
    assert rc == 2 and out == ""
    assert err.startswith(f"error: {message}") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "c").exists()


def test_api_refuses_the_same_numbers(qa, tmp_path):
    for kwargs in ({"max_length": 0}, {"max_length": 1}, {"max_length": True}, {"num_workers": -2}, {"num_workers": 1.5},
                   {"rows_per_task": 0}, {"rows_per_task": 2.5}):
        with pytest.raises(ValueError, match="must be an integer >="):
            pl.precache(qa, tokenizer=need(GPT2), format="text", out=tmp_path, fields={"text": "question"}, **kwargs)


def test_num_workers_0_tokenizes_in_process_with_the_same_output(qa, tmp_path):
    one, s0 = build_cache(qa, tokenizer=need(GPT2), format="text", out=tmp_path / "a", fields={"text": "answer"}, num_workers=0)
    two, s2 = build_cache(qa, tokenizer=GPT2, format="text", out=tmp_path / "b", fields={"text": "answer"}, num_workers=2)
    assert (s0["num_workers"], s2["num_workers"]) == (1, 1)  # one task (< rows_per_task rows): one process
    m0, m2 = pl.open_cache(one).manifest, pl.open_cache(two).manifest
    assert m0["content_checksum"] == m2["content_checksum"] and len(m0["shards"]) == 1


def test_help_shows_defaults_and_every_option_is_explained(capsys):
    parser = _build_parser()
    unexplained = [a.option_strings for a in parser._actions if not a.help]
    assert unexplained == []
    rc, out, _ = cli(capsys, "--help")
    assert rc == 0
    flat = " ".join(out.split())
    for default in ("(default: drop)", "(default: arrow)", "(default: portable_loader_cache)", "(default: error)"):
        assert default in flat
    assert "0 or 1: tokenize in this process" in flat and "info CACHE" in flat


def test_chat_without_template_names_the_tokenizer(qa, tmp_path, capsys):
    rc, _, err = cli(capsys, "--input", qa, "--tokenizer", need(GPT2), "--format", "chat", "--out", tmp_path)
    assert rc == 2 and err.startswith(f"error: tokenizer {str(GPT2)!r} has no chat template"), err


def test_field_typos(qa, tmp_path, capsys):
    rc, _, err = cli(capsys, "--input", qa, "--tokenizer", need(GPT2), "--format", "alpaca", "--out", tmp_path,
                     "--field", "instrucion=question", "--field", "output=answer")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "unknown field 'instrucion' for the alpaca format: it reads instruction, input, output" in err
    rc, _, err = cli(capsys, "--input", qa, "--tokenizer", GPT2, "--format", "alpaca", "--out", tmp_path,
                     "--field", "instruction=questoin", "--field", "output=answer")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "qa.jsonl: line 1: field questoin: missing (the alpaca field 'instruction', renamed by fields/--field); " \
           "the row has: answer, question" in err


# --- locks --------------------------------------------------------------------------------------

LOCK_WORKER = """
import sys, time
from portable_loader.precache.lock import locked
path, counter, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
for _ in range(rounds):
    with locked(path):
        n = int(open(counter).read())
        time.sleep(0.002)  # widen the read-modify-write window: a second holder would lose updates
        open(counter, "w").write(str(n + 1))
"""


@pytest.mark.slow
def test_lock_excludes_concurrent_processes_and_leaves_no_file(tmp_path):
    lock, counter = tmp_path / ".x.lock", tmp_path / "count"
    counter.write_text("0")
    procs = [subprocess.Popen([sys.executable, "-c", LOCK_WORKER, str(lock), str(counter), "60"], stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, errs
    assert counter.read_text() == "240"  # no update lost: never two holders at once, unlink included
    assert not lock.exists()


@pytest.mark.slow
def test_concurrent_builds_leave_no_lock_files(qa, tmp_path):
    args = [sys.executable, "-m", "portable_loader.precache", *map(str, qa_args(qa, tmp_path / "c", "--num-workers", "1"))]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [o[1] for o in outs]
    assert len({o[0].strip().splitlines()[-1] for o in outs}) == 1
    assert len(os.listdir(tmp_path / "c")) == 1  # the cache, and no .lock, .tmp- or .trash- entry


@pytest.mark.slow
def test_a_waiting_run_says_whom_it_waits_for(qa, tmp_path):
    path = pl.precache(qa, tokenizer=need(GPT2), format="text", out=tmp_path, fields={"text": "question"})
    name = os.path.basename(path)
    args = [sys.executable, "-m", "portable_loader.precache", "--input", qa, "--tokenizer", GPT2, "--format", "text",
            "--out", tmp_path, "--field", "text=question"]
    with locked(str(tmp_path / f".{name}.lock")):
        p = subprocess.Popen(list(map(str, args)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready, _, _ = select.select([p.stderr], [], [], 120)
        assert ready, "no message within 120 s while waiting for the lock"
        line = p.stderr.readline()
        assert line.startswith(f"waiting for {path}") and f"pid {os.getpid()} on " in line and f".{name}.lock" in line
        time.sleep(0.5)
        assert p.poll() is None  # still waiting
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "cache hit" in out and out.strip().splitlines()[-1] == path
    assert sorted(os.listdir(tmp_path)) == ["qa.jsonl", name]  # the lock file is gone too


def test_unheld_lock_files_of_older_runs_are_swept(qa, tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    for name in ("text-aaaa", "alpaca-bbbb", "chat-cccc"):
        (out / f".{name}.lock").write_text("")
    (out / ".not-a-lock").write_text("")
    with locked(str(out / ".chat-cccc.lock")):  # a run in progress: its lock stays
        pl.precache(qa, tokenizer=need(GPT2), format="text", out=out, fields={"text": "question"})
        assert sorted(e for e in os.listdir(out) if e.startswith(".")) == [".chat-cccc.lock", ".not-a-lock"]
    assert sorted(e for e in os.listdir(out) if e.startswith(".")) == [".not-a-lock"]


# --- a folder of caches: open_cache, info, ls, rm -----------------------------------------------


@pytest.fixture()
def two_caches(qa, tmp_path):
    out = tmp_path / "out"
    a = pl.precache(qa, tokenizer=need(GPT2), format="text", out=out, fields={"text": "answer"}, num_workers=2)
    b = pl.precache(qa, tokenizer=GPT2, format="alpaca", out=out, fields={"instruction": "question", "output": "answer"},
                    backend="array_record", max_length=64)
    return out, a, b


def test_open_cache_on_the_out_folder_lists_its_caches(two_caches):
    out, a, b = two_caches
    with pytest.raises(CacheError, match="is a folder of caches, not a cache; open one of: ") as e:
        pl.open_cache(out)
    assert os.path.basename(a) in str(e.value) and os.path.basename(b) in str(e.value)


@pytest.mark.parametrize("which", [1, 2])
def test_info_against_the_records(two_caches, capsys, which):
    path = two_caches[which]
    src = pl.open_cache(path)
    lengths = [r["input_ids"].size for r in src.__getitems__(range(len(src)))]
    info = pl.cache_info(path)
    assert info["rows"] == len(lengths) and info["tokens"] == sum(lengths)
    assert info["trainable_tokens"] == sum(int(r["loss_mask"].sum()) for r in src.__getitems__(range(len(src))))
    s = info["lengths"]
    assert (s["min"], s["max"], s["p50"]) == (min(lengths), max(lengths), statistics.median(lengths))
    for lo, hi, n in s["histogram"]:
        assert n == sum(lo <= x < hi for x in lengths)
    assert sum(n for _, _, n in s["histogram"]) == len(lengths)
    assert info["options"] == src.manifest["config"] and info["backend"] == src.manifest["backend"]
    rc, out, _ = cli(capsys, "info", path, "--json")
    assert rc == 0 and json.loads(out) == json.loads(json.dumps(info))
    rc, out, _ = cli(capsys, "info", path)
    assert rc == 0 and f"rows:     {len(lengths):,}" in out and "#" in out and "options:" in out


def test_info_on_a_manifest_without_optional_counts(two_caches, capsys):
    from portable_loader import cache

    path = two_caches[1]
    manifest = cache.read_manifest(path)
    manifest["counts"] = {"rows_out": manifest["counts"]["rows_out"]}  # as a hand-made manifest may be
    cache.write_manifest(path, manifest)
    rc, out, err = cli(capsys, "info", path)
    assert rc == 0, err
    assert "(of ? input rows" in out and "(? trained)" in out


def test_ls_lists_sound_and_broken_caches(two_caches, capsys):
    out, a, b = two_caches
    os.remove(os.path.join(b, sorted(f for f in os.listdir(b) if f.startswith("data-"))[0]))
    (out / "notes").mkdir()  # not a cache: not listed
    caches = {c["name"]: c for c in pl.list_caches(out)}
    assert sorted(caches) == sorted(map(os.path.basename, (a, b)))
    good = caches[os.path.basename(a)]
    assert (good["rows"], good["format"], good["error"]) == (len(pl.open_cache(a)), "text", None)
    assert "shard missing" in caches[os.path.basename(b)]["error"]
    rc, text, _ = cli(capsys, "ls", out)
    assert rc == 0 and "INVALID: " in text and f"{good['rows']:,} rows" in text
    rc, text, _ = cli(capsys, "ls", out, "--json")
    assert rc == 0 and json.loads(text) == json.loads(json.dumps(pl.list_caches(out)))


def test_rm_removes_caches_and_nothing_else(two_caches, tmp_path, capsys):
    out, a, b = two_caches
    stray = out / "notes"
    stray.mkdir()
    (stray / "keep.txt").write_text("mine")
    rc, _, err = cli(capsys, "rm", stray)
    assert rc == 2 and "not a portable_loader cache" in err and (stray / "keep.txt").exists()
    (stray / "manifest.json").write_text("{}")  # looks like a cache, yet holds a foreign file
    rc, _, err = cli(capsys, "rm", stray)
    assert rc == 2 and "keep.txt" in err and (stray / "keep.txt").exists()
    rc, text, _ = cli(capsys, "rm", a)
    assert rc == 0 and not os.path.exists(a) and text.strip() == f"removed {a}"
    pl.remove_cache(b)
    assert sorted(os.listdir(out)) == ["notes"]
    with pytest.raises(CacheError, match="no such cache directory"):
        pl.remove_cache(a)
    rc, _, err = cli(capsys, "ls", tmp_path / "missing")
    assert rc == 2 and err.startswith("error: ") and "no such folder" in err


def test_subcommand_argument_errors_are_one_line(capsys):
    rc, _, err = cli(capsys, "rm")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: ")
