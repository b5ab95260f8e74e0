"""``RecordOptions``: the record options as one frozen, checked value, with its own part of the cache key;
what precache, build, the command line and tokenized make of it (the same keys, the same records)."""

import ast
import dataclasses
import json
import pathlib
import pickle

import pytest

import portable_loader as pl
from conftest import ROOT
from portable_loader.cache.manifest import cache_key
from portable_loader.errors import PortableLoaderError
from portable_loader.precache import build, build_cache, sample_args
from portable_loader.precache.cli import main
from portable_loader.record_options import RecordOptions

TOK = sample_args()["tokenizer"]
GOLDEN = json.loads((ROOT / "tests" / "golden" / "sample_cache.json").read_text())


def test_the_value_is_frozen_normalized_hashable_and_picklable():
    opts = RecordOptions(TOK, "chat", fields={"messages": "chosen"}, transcript="hh", max_length=64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.max_length = 128
    assert opts.fields == (("messages", "chosen"),)
    assert opts.transcript == (("\n\nHuman:", "user"), ("\n\nAssistant:", "assistant"))
    assert opts == RecordOptions(TOK, "chat", fields=(("messages", "chosen"),), max_length=64,
                                 transcript={"\n\nHuman:": "user", "\n\nAssistant:": "assistant"})
    assert hash(opts) == hash(pickle.loads(pickle.dumps(opts))) and pickle.loads(pickle.dumps(opts)) == opts
    assert RecordOptions(**opts.kwargs()) == opts == RecordOptions(**opts.config())


@pytest.mark.parametrize("given, error, message", [
    (dict(format="csv"), ValueError, "format must be one of"),
    (dict(overlong="cut"), ValueError, "overlong must be 'drop' or 'truncate'"),
    (dict(on_bad_row="ignore"), ValueError, "on_bad_row must be 'error' or 'skip'"),
    (dict(max_length=1), ValueError, r"max_length must be an integer >= 2"),
    (dict(max_length=True), ValueError, r"max_length must be an integer >= 2"),
    (dict(fields={"instrucion": "q"}), PortableLoaderError, "unknown field 'instrucion' for the text format"),
    (dict(transcript="hh"), ValueError, "transcript applies to the chat format only"),
    (dict(format="chat", transcript="nope"), PortableLoaderError, "unknown transcript preset 'nope'"),
    (dict(tokenizer="s3://bucket/tok"), ValueError, "tokenizer must be a local folder"),
])
def test_bad_options_are_refused_when_the_value_is_made_and_by_every_face(tmp_path, given, error, message):
    options = {"tokenizer": TOK, "format": "text", **given}
    with pytest.raises(error, match=message):
        RecordOptions(**options)
    data = tmp_path / "x.jsonl"
    data.write_text('{"text": "hi"}\n')
    with pytest.raises(error, match=message):
        pl.precache(str(data), out=str(tmp_path / "c"), **options)
    with pytest.raises(error, match=message):
        pl.tokenized(str(data), **options)


def test_its_key_part_is_the_pinned_one():
    # The sample cache's key parts are pinned in tests/golden: the value's own part is that part.
    parts = RecordOptions(TOK, "chat").key_parts()
    assert parts == {k: v for k, v in GOLDEN["key_parts"].items() if k in parts}
    assert set(GOLDEN["key_parts"]) - set(parts) == {"format_version", "input", "backend", "plan"}


def test_every_face_gives_one_key_for_one_value(tmp_path):
    args = sample_args()
    record = RecordOptions(args["tokenizer"], "chat", max_length=128, overlong="truncate")
    by_value, summary = build(args["input"], record, out=tmp_path, split="train[:100]")
    by_keywords = pl.precache(args["input"], out=tmp_path, split="train[:100]", **record.kwargs())
    assert by_keywords == by_value and not summary["hit"]
    manifest = json.loads((pathlib.Path(by_value) / "manifest.json").read_text())
    assert manifest["config"] == {"input": args["input"], "split": "train[:100]", **record.config(), "backend": "arrow"}
    # Tokenized on read: the cache's key parts less how the cache is stored.
    ds = pl.tokenized(args["input"], split="train[:100]", **record.kwargs())
    assert ds.record == record
    assert ds.key == cache_key({k: v for k, v in manifest["key_parts"].items() if k not in ("backend", "plan")})


def test_the_command_line_builds_the_same_value(tmp_path, capsys):
    args = sample_args()
    assert main(["--input", args["input"], "--format", "chat", "--tokenizer", args["tokenizer"], "--out", str(tmp_path),
                 "--split", "train[:50]", "--max-length", "64", "--overlong", "truncate", "--num-workers", "0"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    record = RecordOptions(args["tokenizer"], "chat", max_length=64, overlong="truncate")
    assert printed == build(args["input"], record, out=tmp_path, split="train[:50]")[0]


def test_build_cache_refuses_an_unknown_option(tmp_path):
    with pytest.raises(TypeError, match="max_lenght"):
        build_cache(sample_args()["input"], tokenizer=TOK, format="chat", out=tmp_path, max_lenght=64)


def test_the_dataset_layer_imports_no_precache_module():
    # pl.tokenized takes the value from portable_loader.record_options, not from precache's engines.
    tree = ast.parse((ROOT / "portable_loader" / "corpora" / "tokenized.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "portable_loader.record_options" in imported
    assert not [m for m in imported if m and m.startswith("portable_loader.precache")]
