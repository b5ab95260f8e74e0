"""Input tables: every reader against the json/pyarrow/datasets oracle, row ranges, splits, errors."""

import gzip
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_loader.errors import BadRowError, InputError
from portable_loader.io import open_input

ROWS = [{"text": f"row {i} " + "x" * (i % 7), "n": i} for i in range(10_000)]


def write_all(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {}
    paths["jsonl"] = tmp_path / "d.jsonl"
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    paths["gz"] = tmp_path / "d.jsonl.gz"
    with gzip.open(paths["gz"], "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in ROWS))
    paths["json"] = tmp_path / "d.json"
    paths["json"].write_text(json.dumps(ROWS))
    paths["parquet"] = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), paths["parquet"], row_group_size=777)
    paths["hf"] = tmp_path / "hf"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(paths["hf"]))
    return paths


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return write_all(tmp_path_factory.mktemp("inputs"))


@pytest.mark.parametrize("kind", ["jsonl", "gz", "json", "parquet", "hf"])
def test_every_reader_returns_the_rows(inputs, kind):
    table = open_input(str(inputs[kind]))
    assert len(table) == len(ROWS)
    got = [row for _, row in table.read(0, len(table))]
    assert got == ROWS


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(cuts=st.lists(st.integers(0, len(ROWS)), max_size=6), kind=st.sampled_from(["jsonl", "gz", "parquet", "hf"]))
def test_row_ranges_partition_the_input(inputs, cuts, kind):
    table = open_input(str(inputs[kind]))
    bounds = sorted({0, len(table), *cuts})
    got = []
    for lo, hi in zip(bounds, bounds[1:]):
        part = list(table.read(lo, hi))
        assert [n for n, _ in part] == list(range(lo, hi))
        got += [row for _, row in part]
    assert got == ROWS


@pytest.mark.parametrize(
    "split,lo,hi", [("train[:1000]", 0, 1000), ("train[10%:20%]", 1000, 2000), ("train[-5:]", 9995, 10000)]
)
def test_hf_split_slicing(inputs, split, lo, hi):
    for kind in ("jsonl", "hf"):
        table = open_input(str(inputs[kind]), split=split)
        assert [row for _, row in table.read(0, len(table))] == ROWS[lo:hi]
    assert open_input(str(inputs["jsonl"]), split=split).where(0) == f"line {lo + 1}"


def test_datasetdict_split_by_name(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:10]), "test": datasets.Dataset.from_list(ROWS[10:13])})
    dd.save_to_disk(str(tmp_path / "dd"))
    table = open_input(str(tmp_path / "dd"), split="test[1:]")
    assert [r for _, r in table.read(0, len(table))] == ROWS[11:13]
    with pytest.raises(InputError, match="no split 'validation'"):
        open_input(str(tmp_path / "dd"), split="validation")


def test_text_file_rows(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("first line\n\n  \nsecond line\nlast")
    table = open_input(str(p))
    assert [(n, r["text"]) for n, r in table.read(0, len(table))] == [(0, "first line"), (3, "second line"), (4, "last")]


def test_malformed_jsonl_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "a"}\n{"text": "b"\n[1, 2]\n')
    rows = list(open_input(str(p)).read(0, 3))
    assert rows[0] == (0, {"text": "a"})
    assert isinstance(rows[1][1], BadRowError) and str(rows[1][1]).startswith(f"{p}: line 2: malformed JSON")
    assert "line 3: expected a JSON object, got list" in str(rows[2][1])


def test_malformed_json_list_names_line(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('[\n{"a": 1},\n{"a": 2,,}\n]')
    with pytest.raises(BadRowError, match=r"bad.json: line 3: malformed JSON"):
        open_input(str(p))


@pytest.mark.parametrize("content", [b"", b"\n\n", b"[]"])
def test_empty_inputs_are_refused(tmp_path, content):
    p = tmp_path / ("e.json" if content == b"[]" else "e.jsonl")
    p.write_bytes(content)
    if content == b"\n\n":  # two blank lines: rows exist but none holds data
        assert list(open_input(str(p)).read(0, 2)) == []
        return
    with pytest.raises(InputError, match="no rows"):
        open_input(str(p))


def test_missing_and_truncated_inputs(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        open_input(str(tmp_path / "nope.jsonl"))
    p = tmp_path / "cut.jsonl.gz"
    p.write_bytes(gzip.compress(b'{"text": "a"}\n' * 1000)[:-30])
    with pytest.raises(InputError, match="cannot read"):
        open_input(str(p))


def test_random_reads_of_jsonl_parse_as_json_loads(tmp_path):
    # Random access parses lines without json.loads's per-call work, falling back to it for what it
    # would read otherwise: every row (or its error) must equal a sequential read's and json.loads'.
    lines = ['{"text": "a"}', '  {"text": "b", "n": [1, 2]}  ', '\ufeff{"text": "bom"}', '{"text": "\\ud800 lone"}',
             '{"text": "c"', '[1, 2]', '"just a string"', '{"a": 1} {"b": 2}', '{"text": "x"}\r', '{"t": "é ü 中"}']
    p = tmp_path / "rows.jsonl"
    p.write_bytes("\n".join(lines).encode("utf-8") + b"\n")
    table = open_input(str(p))
    sequential = dict(table.read(0, len(table)))
    randomly = table.get([9, 3, 0, 7, 5, 1, 8, 2, 6, 4])
    for k, row in zip([9, 3, 0, 7, 5, 1, 8, 2, 6, 4], randomly):
        if isinstance(row, BadRowError):
            assert str(row) == str(sequential[k])
            with pytest.raises(Exception):
                assert isinstance(json.loads(lines[k]), dict)
        else:
            assert row == sequential[k] == json.loads(lines[k].encode("utf-8"))
    assert sum(isinstance(r, BadRowError) for r in randomly) == 4  # the malformed, list, string, two-object lines
