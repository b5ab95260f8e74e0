"""Tokenize on read: records and loader batches equal a cache's (real data, two tokenizers), resume,
many-file inputs, lazy bad rows and drops, validate(), the fingerprint."""

import json
import os

import numpy as np
import pytest

import portable_loader as pl
from portable_loader.errors import BadRowError
from portable_loader.precache import build_cache
from conftest import DATA, GPT2, NO_FORK, PHI3, need
from test_many_files import ROWS, jsonl, shards

pytestmark = NO_FORK  # its worker start after the suite's JAX tests once forked a JAX-running process

GSM = dict(fields={"instruction": "question", "output": "answer"})
CASES = {
    "alpaca-gsm8k": ("alpaca/gsm8k_train.jsonl", "alpaca", dict(GSM, split="train[:200]")),
    "alpaca-list": ("alpaca/llamafactory_alpaca_en_demo.json", "alpaca", dict(split="train[:200]")),
    "chat-sharegpt": ("chat/fastchat_dummy_conversation.json", "chat", dict(split="train[:150]")),
    "chat-hh-gz": ("chat/hh_harmless_base_test.jsonl.gz", "chat",
                   dict(fields={"messages": "chosen"}, transcript="hh", split="train[:150]")),
    "text-c4": ("text/llamafactory_c4_demo.jsonl", "text", dict(split="train[:150]")),
    "text-wikitext": ("text/wikitext2_valid.txt", "text", dict(split="train[:400]")),
}


def cache_records(path):
    c = pl.open_cache(path)
    return c[0 : len(c)]


def assert_same_records(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x["input_ids"].dtype == y["input_ids"].dtype and x["loss_mask"].dtype == y["loss_mask"].dtype
        assert np.array_equal(x["input_ids"], y["input_ids"]) and np.array_equal(x["loss_mask"], y["loss_mask"])


def take(loader, k):
    with iter(loader) as it:
        return [next(it) for _ in range(k)]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert np.array_equal(np.asarray(x[key]), np.asarray(y[key])), key


@pytest.mark.slow
@pytest.mark.parametrize("tok", ["gpt2", "phi3"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_records_equal_the_cache(tmp_path, case, tok):
    rel, fmt, options = CASES[case]
    tokenizer = need(GPT2 if tok == "gpt2" else PHI3)
    if fmt == "chat" and tok == "gpt2":
        options = dict(options, chat_template="default")  # GPT-2 has no chat template
    path, summary = build_cache(
        need(DATA / rel), tokenizer=tokenizer, format=fmt, out=tmp_path / "c", num_workers=0, **options
    )
    ds = pl.tokenized(DATA / rel, tokenizer=tokenizer, format=fmt, **options)
    assert summary["dropped"] == {}  # nothing dropped: records correspond one to one
    assert_same_records(ds[0 : len(ds)], cache_records(path))
    # validate() reports what precache reported.
    counts = ds.validate()
    assert {k: counts[k] for k in ("rows_in", "rows_out", "tokens", "trainable_tokens")} == {
        k: summary[k] for k in ("rows_in", "rows_out", "tokens", "trainable_tokens")
    }


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True])
def test_batches_equal_the_cache_for_any_workers_and_resume(tmp_path, packing):
    data, tokenizer = need(DATA / "text" / "llamafactory_c4_demo.jsonl"), need(GPT2)
    options = dict(tokenizer=tokenizer, format="text", split="train[:120]")
    cache = pl.source(pl.open_cache(pl.precache(data, out=tmp_path / "c", num_workers=0, **options)))
    kw = dict(global_batch_size=4, seq_len=256, seed=3, packing=packing, packing_window=32)
    want = take(pl.DataLoader(cache, **kw), 12)
    for workers in (0, 2):
        assert_same_batches(take(pl.DataLoader(pl.tokenized(data, **options), num_workers=workers, **kw), 12), want)
    # Resume: a state taken after 5 steps continues with the cache's steps 5..11.
    with iter(pl.DataLoader(pl.tokenized(data, **options), num_workers=2, **kw)) as it:
        [next(it) for _ in range(5)]
        state = json.loads(json.dumps(it.get_state()))
    with iter(pl.DataLoader(pl.tokenized(data, **options), num_workers=2, **kw)) as it2:
        it2.set_state(state)
        assert_same_batches([next(it2) for _ in range(7)], want[5:])


@pytest.mark.slow
def test_many_file_inputs_equal_their_cache(tmp_path):
    tokenizer = need(GPT2)
    shards(tmp_path / "shards")
    a = jsonl(tmp_path / "a.jsonl.gz", ROWS[:25])
    (tmp_path / "b.txt").write_text("".join(r["text"] + "\n" for r in ROWS[25:]))
    for spec in (tmp_path / "shards", [str(a), str(tmp_path / "b.txt"), str(tmp_path / "shards")]):
        common = dict(tokenizer=tokenizer, format="text")
        ds = pl.tokenized(spec, **common)
        assert_same_records(ds[0 : len(ds)], cache_records(pl.precache(spec, out=tmp_path / "c", num_workers=2, **common)))


def test_a_bad_row_fails_when_read_naming_file_and_line(tmp_path):
    tokenizer = need(GPT2)
    rows = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(4)]
    files = [jsonl(tmp_path / f"{i}.jsonl", rows) for i in range(3)]
    files[1].write_text(files[1].read_text().replace('"a2"', "7"))
    ds = pl.tokenized(tmp_path, tokenizer=tokenizer, format="alpaca")
    assert len(ds[0:6]) == 6 and len(ds[7:]) == 5  # the other rows read fine: nothing is scanned ahead
    for read in (lambda: ds[6], ds.validate):
        with pytest.raises(BadRowError) as e:
            read()
        assert (e.value.path, e.value.where, e.value.field) == (str(files[1]), "line 3", "output")
    skipping = pl.tokenized(tmp_path, tokenizer=tokenizer, format="alpaca", on_bad_row="skip")
    assert skipping[6]["input_ids"].size == 0 and skipping.validate()["dropped"] == {"bad_row": 1}


@pytest.mark.slow
def test_dropped_rows_read_empty_and_packing_serves_every_kept_record(tmp_path):
    data, tokenizer = need(DATA / "text" / "llamafactory_c4_demo.jsonl"), need(GPT2)
    options = dict(tokenizer=tokenizer, format="text", split="train[:100]", max_length=200)
    path, summary = build_cache(data, out=tmp_path / "c", num_workers=0, **options)
    assert summary["dropped"].get("overlong", 0) > 0
    ds = pl.tokenized(data, **options)
    kept = [r for r in ds[0 : len(ds)] if r["input_ids"].size]
    assert_same_records(kept, cache_records(path))
    assert ds.dropped["overlong"] == summary["dropped"]["overlong"]
    # One packed epoch holds each kept record's tokens exactly once.
    batches = list(pl.DataLoader(pl.tokenized(data, **options), global_batch_size=4, seq_len=256, packing=True, num_epochs=1))
    served = sorted(int(t) for b in batches for t in np.asarray(b["input_ids"])[np.asarray(b["segment_ids"]) > 0])
    assert served == sorted(int(t) for r in kept for t in r["input_ids"])


@pytest.mark.slow
def test_fingerprint_follows_every_option_and_the_content(tmp_path):
    tokenizer = need(GPT2)
    data = jsonl(tmp_path / "d.jsonl", ROWS)
    base = pl.tokenized(data, tokenizer=tokenizer, format="text").fingerprint()
    assert pl.tokenized(str(data), tokenizer=tokenizer, format="text").fingerprint() == base
    others = [
        pl.tokenized(data, tokenizer=tokenizer, format="text", max_length=64),
        pl.tokenized(data, tokenizer=need(PHI3), format="text"),
        pl.tokenized(data, tokenizer=tokenizer, format="text", split="train[1:]"),
        pl.tokenized(data, tokenizer=tokenizer, format="text", on_bad_row="skip"),
    ]
    data.write_text(data.read_text().replace("row 7 ", "row 7!"))
    others.append(pl.tokenized(data, tokenizer=tokenizer, format="text"))
    prints = [d.fingerprint() for d in others]
    assert base not in prints and len(set(prints)) == len(prints)
    with pytest.raises(TypeError, match="backend"):
        pl.tokenized(data, tokenizer=tokenizer, format="text", backend="arrow")


@pytest.mark.slow
def test_precache_check_scans_ahead_and_writes_nothing(tmp_path, capsys):
    from portable_loader.precache.cli import main

    tokenizer = need(GPT2)
    rows = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(4)]
    files = [jsonl(tmp_path / f"{i}.jsonl", rows) for i in range(3)]
    args = ["--input", str(tmp_path / "*.jsonl"), "--tokenizer", tokenizer, "--format", "alpaca", "--out", str(tmp_path / "c"), "--check"]
    assert main(args) == 0
    out = capsys.readouterr().out
    summary = build_cache(str(tmp_path / "*.jsonl"), tokenizer=tokenizer, format="alpaca", out=tmp_path / "c2", num_workers=0)[1]
    assert f"rows out: {summary['rows_out']}" in out and f"tokens: {summary['tokens']} " in out
    files[1].write_text(files[1].read_text().replace('"a2"', "7"))
    assert main(args) == 2  # a bad row is a user mistake: exit 2, one error line
    assert f"error: {files[1]}: line 3: field output: expected a string" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_load_tokenizer_matches_autotokenizer_without_importing_torch():
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from portable_loader.tokenize import load_tokenizer

    path = need(PHI3)
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
    texts = ["Hello <|end|> world </s>", "  spaces\n\nand\ttabs", "ünïcödé 漢字 🤗"]
    assert type(ours) is type(auto) and ours.eos_token_id == auto.eos_token_id and ours.chat_template == auto.chat_template
    assert [ours(t)["input_ids"] for t in texts] == [auto(t)["input_ids"] for t in texts]
    code = f"import sys; from portable_loader.tokenize import load_tokenizer; load_tokenizer({path!r}); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


@pytest.mark.slow
def test_windows_the_main_process_tokenizes_reach_workers_without_a_second_tokenization(tmp_path):
    """The main process tokenizes a window for its lengths where no worker does it ahead (a source
    wrapped in a map or a mixture, a state's window checked at set_state)."""
    import multiprocessing
    import pickle
    import time

    from portable_loader.corpora import spill

    ds = pl.tokenized(jsonl(tmp_path / "d.jsonl", ROWS), tokenizer=need(GPT2), format="text")
    fresh = pl.tokenized(tmp_path / "d.jsonl", tokenizer=need(GPT2), format="text")
    ds.lengths(range(5))
    assert not os.path.exists(ds._spill.dir)  # no child process to read it: nothing handed over
    # A worker, idle; started as the loader starts its own where this process may run JAX (a fork
    # here, after the suite's JAX tests, is the deadlock-prone fork JAX warns of).
    child = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(60,))
    child.start()
    for w in range(1, spill.KEEP + 2):  # more windows than the hand-over keeps
        ds.lengths(range(5 * w, 5 * w + 5))
    child.kill()
    child.join()
    worker = pickle.loads(pickle.dumps(ds))  # what a spawned worker gets: a reader, no tokenizer
    kept = range(10, 5 * (spill.KEEP + 2))
    assert_same_records(worker[list(kept)], fresh[list(kept)])
    assert worker._fmt is None  # every record came from the hand-over
    assert_same_records(list(worker[0:10]) + list(worker[50:]), list(fresh[0:10]) + list(fresh[50:]))  # dropped and unseen: tokenized
    ds._spill.close()
    assert not os.path.exists(ds._spill.dir)


@pytest.mark.slow
@pytest.mark.parametrize("tok", ["gpt2", "phi3"])
def test_a_kept_tokenizer_gives_the_records_of_transformers_without_importing_it(tmp_path, monkeypatch, tok):
    """The text and alpaca formats load a tokenizer kept by an earlier load (no transformers import):
    its records equal transformers' on real rows. phi-3-mini's raw tokenizer.json would not:
    transformers rebuilds its backend."""
    import subprocess
    import sys

    from portable_loader.tokenize import BackendTokenizer, Formatter, load_tokenizer, load_tokenizer_cached

    monkeypatch.setenv("PORTABLE_LOADER_TOKENIZER_CACHE", str(tmp_path / "kept"))
    path = need(GPT2 if tok == "gpt2" else PHI3)
    assert not isinstance(load_tokenizer_cached(path), BackendTokenizer)  # the first load: transformers, kept
    kept, ref = load_tokenizer_cached(path), load_tokenizer(path)
    assert isinstance(kept, BackendTokenizer) and (kept.eos_token, kept.eos_token_id) == (ref.eos_token, ref.eos_token_id)
    for fmt, rel, fields in [("text", "text/llamafactory_c4_demo.jsonl", None), ("text", "text/wikitext2_valid.txt", None),
                             ("alpaca", "alpaca/gsm8k_train.jsonl", GSM["fields"]),
                             ("alpaca", "alpaca/llamafactory_alpaca_en_demo.json", None)]:
        from portable_loader.io import open_inputs

        table = open_inputs(need(DATA / rel), "train[:300]")
        rows = table.get(table.present().tolist())
        for max_length in (None, 48):
            want = Formatter(fmt, ref, fields=fields, max_length=max_length).encode(rows)
            got = Formatter(fmt, kept, fields=fields, max_length=max_length).encode(rows)
            assert [r if isinstance(r, str) else (r[0].tolist(), r[1].tolist()) for r in got] == \
                   [r if isinstance(r, str) else (r[0].tolist(), r[1].tolist()) for r in want], rel
    code = ("import sys, portable_loader as pl; "
            f"ds = pl.tokenized({need(DATA / 'text' / 'llamafactory_c4_demo.jsonl')!r}, tokenizer={path!r}, format='text'); "
            "print(type(ds._formatter().tok).__name__, 'transformers' in sys.modules, ds.lengths([0]).tolist())")
    env = dict(os.environ, PORTABLE_LOADER_TOKENIZER_CACHE=str(tmp_path / "kept"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout.split()
    assert out[:2] == ["BackendTokenizer", "False"]


@pytest.mark.slow
def test_a_kept_tokenizer_is_keyed_by_its_files_and_a_damaged_one_is_loaded_again(tmp_path, monkeypatch):
    import shutil

    from portable_loader.tokenize import BackendTokenizer, load_tokenizer_cached

    monkeypatch.setenv("PORTABLE_LOADER_TOKENIZER_CACHE", str(tmp_path / "kept"))
    own = tmp_path / "tok"
    shutil.copytree(need(GPT2), own)
    load_tokenizer_cached(str(own))
    (entry,) = (tmp_path / "kept").iterdir()
    assert isinstance(load_tokenizer_cached(str(own)), BackendTokenizer)
    assert not isinstance(load_tokenizer_cached(str(own), eos_token="!"), BackendTokenizer)  # another EOS: another key
    entry.write_text(entry.read_text()[:1000])  # cut short
    assert not isinstance(load_tokenizer_cached(str(own)), BackendTokenizer)  # loaded again, and kept again
    assert isinstance(load_tokenizer_cached(str(own)), BackendTokenizer)
    before = set((tmp_path / "kept").iterdir())
    (own / "tokenizer.json").write_text((own / "tokenizer.json").read_text().replace('"<|endoftext|>"', '"<|end|>"'))
    assert not isinstance(load_tokenizer_cached(str(own)), BackendTokenizer)  # an edited file: a new key
    assert len(set((tmp_path / "kept").iterdir()) - before) == 1
    monkeypatch.setenv("PORTABLE_LOADER_TOKENIZER_CACHE", "off")
    assert not isinstance(load_tokenizer_cached(str(own)), BackendTokenizer)
