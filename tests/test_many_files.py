"""Inputs of many files: folders, globs, lists, a datasets.Dataset; order, errors, cache key, random access."""

import gzip
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portable_loader as pl
from portable_loader.errors import BadRowError, InputError
from portable_loader.io import open_input, open_inputs
from conftest import GPT2, need

ROWS = [{"text": f"row {i} " + "y" * (i % 5)} for i in range(60)]


def shards(folder, rows=ROWS, n=3):
    """Write ``rows`` as n Parquet shards (named so that sorted order is row order), 7-row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    cut = [len(rows) * i // n for i in range(n + 1)]
    for i in range(n):
        pq.write_table(pa.Table.from_pylist(rows[cut[i] : cut[i + 1]]), os.path.join(folder, f"part-{i:05d}.parquet"), row_group_size=7)
    return folder


def jsonl(path, rows):
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if str(path).endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def records(path):
    c = pl.open_cache(path)
    return [r["input_ids"].tolist() for r in c[0 : len(c)]]


def test_folder_glob_and_list_read_rows_in_order(tmp_path):
    folder = shards(tmp_path / "data" / "nested")
    (tmp_path / "data" / "_SUCCESS").write_text("")  # not a supported file: ignored in a folder
    expected = [r["text"] for r in ROWS]
    for spec in (tmp_path / "data", str(tmp_path / "data" / "**" / "part-*.parquet"),
                 sorted(str(folder / f) for f in os.listdir(folder))):
        t = open_inputs(spec)
        assert [row["text"] for _, row in t.read(0, len(t))] == expected
    assert open_inputs(tmp_path / "data", split="train[10:20]").read(0, 1).__next__()[1]["text"] == ROWS[10]["text"]


@pytest.mark.slow
def test_folder_precache_equals_the_single_file_cache_and_the_key_covers_every_file(tmp_path):
    tok = need(GPT2)
    shards(tmp_path / "shards")
    one = jsonl(tmp_path / "all.jsonl", ROWS)
    common = dict(tokenizer=tok, format="text", num_workers=2)
    many = pl.precache(tmp_path / "shards", out=tmp_path / "c", **common)
    assert records(many) == records(pl.precache(one, out=tmp_path / "c1", **common))
    # Changing the last shard changes the key (a new cache), and its content.
    shards(tmp_path / "shards", ROWS[:-1] + [{"text": "changed"}])
    again = pl.precache(tmp_path / "shards", out=tmp_path / "c", **common)
    assert again != many and records(again)[-1] != records(many)[-1]


def test_mixed_list_and_in_memory_dataset(tmp_path):
    import datasets

    tok = need(GPT2)
    a = jsonl(tmp_path / "a.jsonl", ROWS[:20])
    b = jsonl(tmp_path / "b.jsonl.gz", ROWS[20:30])
    (tmp_path / "c.txt").write_text("".join(r["text"] + "\n\n" for r in ROWS[30:40]))
    shards(tmp_path / "d", ROWS[40:], n=2)
    spec = [str(a), str(b), str(tmp_path / "c.txt"), str(tmp_path / "d")]
    common = dict(tokenizer=tok, format="text", num_workers=0)
    mixed = records(pl.precache(spec, out=tmp_path / "c", **common))
    assert mixed == records(pl.precache(jsonl(tmp_path / "all.jsonl", ROWS), out=tmp_path / "c1", **common))
    in_memory = datasets.Dataset.from_list(ROWS)
    assert records(pl.precache(in_memory, out=tmp_path / "c2", **common)) == mixed


def test_errors_name_the_culprit(tmp_path):
    with pytest.raises(InputError, match="nope.jsonl: no such file"):
        open_inputs([str(tmp_path / "nope.jsonl")])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("x")
    with pytest.raises(InputError, match="empty: empty folder"):
        open_inputs(tmp_path / "empty")
    with pytest.raises(InputError, match=r"part-\*.jsonl: the glob matches nothing"):
        open_inputs(str(tmp_path / "part-*.jsonl"))
    (tmp_path / "t.csv").write_text("a,b\n")
    with pytest.raises(InputError, match="t.csv: unsupported file type"):
        open_inputs(tmp_path / "t.csv")
    a = jsonl(tmp_path / "a.jsonl", [{"text": "x", "n": 1}])
    b = jsonl(tmp_path / "b.jsonl", [{"text": "x", "m": 1}])
    with pytest.raises(InputError, match=r"columns differ between .*a.jsonl and .*b.jsonl: only in the first: \['n'\]; only in the second: \['m'\]"):
        open_inputs([a, b])


@pytest.mark.slow
def test_a_bad_row_in_the_second_of_three_files_is_named_by_file_and_line(tmp_path):
    rows = [{"instruction": "q", "output": "a"}] * 4
    files = [jsonl(tmp_path / f"{i}.jsonl", rows) for i in range(3)]
    files[1].write_text(files[1].read_text() + json.dumps({"instruction": "q", "output": 7}) + "\n")
    with pytest.raises(BadRowError) as e:
        pl.precache(tmp_path, tokenizer=need(GPT2), format="alpaca", out=tmp_path / "c", num_workers=2)
    assert e.value.path == str(files[1]) and e.value.where == "line 5" and e.value.field == "output"


def inputs_of_every_kind(tmp_path):
    """One table per reader kind over the same rows, with blank lines where the format allows."""
    import datasets

    text = "".join(json.dumps(r) + "\n" + ("\n" if i % 4 == 0 else "") for i, r in enumerate(ROWS))
    (tmp_path / "x.jsonl").write_text(text)
    with gzip.open(tmp_path / "x.jsonl.gz", "wt") as f:
        f.write(text)
    (tmp_path / "x.txt").write_text("".join(r["text"] + ("\r\n\r\n" if i % 3 == 0 else "\n") for i, r in enumerate(ROWS)))
    (tmp_path / "x.json").write_text(json.dumps(ROWS))
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hf"))
    shards(tmp_path / "pq")
    return [open_input(tmp_path / n) for n in ("x.jsonl", "x.jsonl.gz", "x.txt", "x.json", "hf")] + [open_inputs(tmp_path / "pq")]


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return inputs_of_every_kind(tmp_path_factory.mktemp("kinds"))


@settings(max_examples=25, deadline=None)
@given(picks=st.lists(st.integers(0, 10**6), max_size=30), kind=st.integers(0, 5))
def test_random_access_agrees_with_sequential_reads(tables, picks, kind):
    t = tables[kind]
    present = t.present()
    sequential = dict(t.read(0, len(t)))
    assert present.tolist() == sorted(sequential)  # the row index knows which rows exist, ahead
    rows = [int(present[p % present.size]) for p in picks]
    assert t.get(rows) == [sequential[r] for r in rows]
    assert [row["text"] for row in t.get(present.tolist())] == [r["text"] for r in ROWS]


@pytest.mark.slow
def test_cli_takes_several_inputs(tmp_path, capsys):
    from portable_loader.precache.cli import main

    a, b = jsonl(tmp_path / "a.jsonl", ROWS[:30]), jsonl(tmp_path / "b.jsonl", ROWS[30:])
    common = ["--tokenizer", need(GPT2), "--format", "text", "--out", str(tmp_path / "c")]
    assert main(["--input", str(a), str(b), *common]) == 0
    built = capsys.readouterr().out.strip().splitlines()[-1]
    assert built == pl.precache([a, b], tokenizer=need(GPT2), format="text", out=tmp_path / "c")
    assert records(built) == records(pl.precache(jsonl(tmp_path / "all.jsonl", ROWS), tokenizer=need(GPT2), format="text", out=tmp_path / "c1"))
