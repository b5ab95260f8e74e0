"""Fuzzed and hostile inputs: every case ends in a correct cache or a clear error naming the file,
never an internal traceback, a hang, or a cache with altered text."""

import gzip
import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import portable_loader as pl
from conftest import GPT2, need
from portable_loader.errors import PortableLoaderError
from portable_loader.precache import build_cache
from portable_loader.tokenize import load_tokenizer

# Text with lone surrogates (written as JSON \udXXX escapes), NULs, controls, emoji and huge runs.
TEXT = st.one_of(
    st.text(st.characters(categories=("Cs", "Cc", "Lu", "Ll", "Nd", "Zs", "So", "Po")), max_size=40),
    st.just(""),
    st.just("x" * 5000),
)
JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["text", "role", "content", "a"]), inner, max_size=3),
    max_leaves=8,
)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "robot", 3]), "content": TEXT | JSON_VALUE})
ROW = st.one_of(
    st.fixed_dictionaries({"text": TEXT | JSON_VALUE}),
    st.fixed_dictionaries({"instruction": TEXT, "output": TEXT | JSON_VALUE}, optional={"input": TEXT | JSON_VALUE}),
    st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=4) | JSON_VALUE}),
    st.fixed_dictionaries({"conversations": st.lists(st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt", "x"]), "value": TEXT}), max_size=3)}),
    JSON_VALUE,
)
LINE = st.one_of(
    ROW.map(lambda r: json.dumps(r).encode()),  # ensure_ascii: lone surrogates become \\udXXX escapes
    st.binary(max_size=30).filter(lambda b: b"\n" not in b),  # invalid UTF-8, truncated JSON, garbage
    st.just(b'{"text": "first", "text": "second"}'),  # duplicate keys: JSON says the last wins
    st.just(b"[" * 5000 + b"]" * 5000),  # nested past the parser's recursion limit
)


def expected_texts(lines):
    """The oracle for the text format: what a correct cache holds, parsed here independently."""
    out = []
    for line in lines:
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            continue
        text = row.get("text") if isinstance(row, dict) else None
        if not isinstance(text, str) or not text.strip():
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            continue
        out.append(text)
    return out


@pytest.fixture(scope="module")
def gpt2_tok():
    return load_tokenizer(need(GPT2), chat_template="default")


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(lines=st.lists(LINE, max_size=8), fmt=st.sampled_from(["text", "alpaca", "chat"]), skip=st.booleans(),
       gz=st.booleans())
def test_any_input_gives_a_correct_cache_or_a_clear_error(tmp_path_factory, gpt2_tok, lines, fmt, skip, gz):
    work = tmp_path_factory.mktemp("fuzz")
    path = work / ("in.jsonl.gz" if gz else "in.jsonl")
    data = b"\n".join(lines) + (b"\n" if lines else b"")
    path.write_bytes(gzip.compress(data) if gz else data)
    try:
        cache, summary = build_cache(path, tokenizer=need(GPT2), format=fmt, out=work / "c", num_workers=1,
                                     max_length=4096, on_bad_row="skip" if skip else "error",
                                     chat_template="default" if fmt == "chat" else None)
    except PortableLoaderError as e:
        event(f"{fmt}: clear error")
        assert str(path) in str(e) or path.name in str(e), e  # names the file
        assert not (work / "c").exists() or all(p.name.startswith(".") for p in (work / "c").iterdir())
        return
    src = pl.open_cache(cache, verify=True)
    event(f"{fmt}: cache")
    if fmt == "text":
        decoded = [gpt2_tok.decode(r["input_ids"]) for r in src.__getitems__(range(len(src)))]
        want = [t + "<|endoftext|>" for t in expected_texts(lines)]
        want = [w for w in want if len(gpt2_tok(w[: -len("<|endoftext|>")]).input_ids) + 1 <= 4096]
        assert decoded == want  # nothing altered, nothing lost, nothing invented
    else:
        assert len(src) == summary["rows_out"] >= 1


def test_zero_byte_and_cut_gzip_files_are_clear_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(b'{"text": "a"}\n' * 2000)[:-40])
    for p in (empty, cut):
        with pytest.raises(PortableLoaderError, match=p.name):
            pl.precache(p, tokenizer=need(GPT2), format="text", out=tmp_path / "c")


def test_chat_without_assistant_turn_and_roles_out_of_order(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"messages": [{"role": "assistant", "content": "answer first"}, {"role": "user", "content": "then a question"}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]},
    ]
    p = tmp_path / "chat.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path, s = build_cache(p, tokenizer=need(GPT2), format="chat", out=tmp_path / "c", chat_template="default")
    assert s["rows_out"] == 2 and s["dropped"] == {"no_target": 1}
    tok = load_tokenizer(need(GPT2), chat_template="default")
    src = pl.open_cache(path)
    assert [tok.decode(r["input_ids"][r["loss_mask"] == 1]) for r in src.__getitems__([0, 1])] == [
        "answer first<|endoftext|>", "c<|endoftext|>"]
