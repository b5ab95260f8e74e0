"""Formats against independent oracles: the tokenizer's own output for the rendered text, and masks
that decode to exactly the target texts, on the real data in ../shared/data."""

import gzip
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DATA, GPT2, need
from portable_loader.errors import BadRowError, TokenizerError
from portable_loader.tokenize import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, Formatter, load_tokenizer


def mask_runs(ids, mask):
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [ids[a:b].tolist() for a, b in zip(edges[::2], edges[1::2])]


def rendered_alpaca(row, fields=None):
    f = fields or {}
    instruction, output = row[f.get("instruction", "instruction")], row[f.get("output", "output")]
    extra = row.get(f.get("input", "input")) or ""
    template = ALPACA_PROMPT if extra.strip() else ALPACA_PROMPT_NO_INPUT
    return template.format(instruction=instruction, input=extra), output


def test_alpaca_real_data_phi3(phi3):
    rows = json.load(open(need(DATA / "alpaca" / "llamafactory_alpaca_en_demo.json")))[:300]
    out = Formatter("alpaca", phi3).encode(rows)
    for row, (ids, mask) in zip(rows, out):
        prompt, output = rendered_alpaca(row)
        expected = phi3(prompt + output).input_ids + [phi3.eos_token_id]
        assert ids.tolist() == expected
        assert ids.dtype == np.int32 and mask.dtype == np.uint8 and mask.size == ids.size
        # Loss on the response and its EOS only, as one contiguous run at the end.
        assert len(mask_runs(ids, mask)) == 1 and mask[-1] == 1
        assert phi3.decode(ids[mask == 1]) == output + phi3.eos_token


def test_gsm8k_with_field_mapping_gpt2(gpt2):
    path = need(DATA / "alpaca" / "gsm8k_train.jsonl")
    rows = [json.loads(line) for line, _ in zip(open(path), range(300))]
    fields = {"instruction": "question", "output": "answer"}
    out = Formatter("alpaca", gpt2, fields=fields).encode(rows)
    for row, (ids, mask) in zip(rows, out):
        prompt, output = rendered_alpaca(row, fields)
        assert ids.tolist() == gpt2(prompt + output).input_ids + [gpt2.eos_token_id]
        assert gpt2.decode(ids[mask == 1]) == row["answer"] + "<|endoftext|>"


def test_sharegpt_real_data_phi3_masks_decode_to_assistant_turns(phi3):
    rows = json.load(open(need(DATA / "chat" / "fastchat_dummy_conversation.json")))
    out = Formatter("chat", phi3).encode(rows)
    role = {"human": "user", "gpt": "assistant"}
    for row, (ids, mask) in zip(rows, out):
        messages = [{"role": role[t["from"]], "content": t["value"]} for t in row["conversations"]]
        text = phi3.apply_chat_template(messages, tokenize=False)
        assert ids.tolist() == phi3(text, add_special_tokens=False).input_ids
        runs = [phi3.decode(r) for r in mask_runs(ids, mask)]
        assert runs == [m["content"] + "<|end|>" for m in messages if m["role"] == "assistant"]


def test_transformers_assistant_mask_is_empty_for_phi3_so_ours_is_computed(phi3):
    # The reason for computing masks ourselves: phi-3's template has no {% generation %} block.
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    theirs = phi3.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert not any(theirs["assistant_masks"])
    ids, mask = Formatter("chat", phi3).encode([{"messages": messages}])[0]
    assert phi3.decode(ids[mask == 1]) == "Hello there<|end|>"


def test_hh_rlhf_transcripts_as_messages_phi3(phi3):
    # hh-rlhf stores transcripts; split them into messages here (the oracle) and check the masks.
    path = need(DATA / "chat" / "hh_harmless_base_test.jsonl.gz")
    rows = []
    with gzip.open(path, "rt") as f:
        for line, _ in zip(f, range(200)):
            parts = json.loads(line)["chosen"].split("\n\nHuman: ")[1:]
            messages = []
            for part in parts:
                human, _, assistant = part.partition("\n\nAssistant: ")
                messages += [{"role": "user", "content": human}, {"role": "assistant", "content": assistant}]
            rows.append({"messages": messages})
    out = Formatter("chat", phi3).encode(rows)
    for row, result in zip(rows, out):
        if isinstance(result, str):
            assert result == "no_target"
            assert not any(m["content"] for m in row["messages"] if m["role"] == "assistant")
            continue
        ids, mask = result
        # Runs decode to the assistant texts; an empty assistant turn has nothing to train.
        runs = [phi3.decode(r) for r in mask_runs(ids, mask)]
        assert runs == [m["content"] + "<|end|>" for m in row["messages"] if m["role"] == "assistant" and m["content"]]


def test_text_format_real_data_gpt2(gpt2):
    path = need(DATA / "text" / "llamafactory_c4_demo.jsonl")
    rows = [json.loads(line) for line in open(path)][:100]
    out = Formatter("text", gpt2).encode(rows)
    for row, (ids, mask) in zip(rows, out):
        assert ids.tolist() == gpt2(row["text"]).input_ids + [gpt2.eos_token_id]
        assert mask.all()


def test_gpt2_has_no_chat_template_unless_default_requested(gpt2):
    with pytest.raises(TokenizerError, match="no chat template"):
        Formatter("chat", gpt2)
    tok = load_tokenizer(need(GPT2), chat_template="default")
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    ids, mask = Formatter("chat", tok).encode([{"messages": msgs}])[0]
    assert tok.decode(ids[mask == 1]) == "4<|endoftext|>"


def test_overlong_drop_and_truncate(gpt2):
    rows = [{"text": "word " * 50}, {"text": "short"}]
    drop = Formatter("text", gpt2, max_length=10)
    assert drop.encode(rows)[0] == "overlong"
    trunc = Formatter("text", gpt2, max_length=10, overlong="truncate")
    ids, mask = trunc.encode(rows)[0]
    assert ids.tolist() == gpt2(rows[0]["text"]).input_ids[:10] and trunc.truncated == 1
    # Truncating away the whole response leaves nothing to train: dropped, not kept.
    long_prompt = {"instruction": "x " * 200, "output": "y"}
    assert Formatter("alpaca", gpt2, max_length=20, overlong="truncate").encode([long_prompt]) == ["no_target"]


@pytest.mark.parametrize(
    "row,field,problem",
    [
        ({"instruction": "a"}, "output", "missing"),
        ({"instruction": 3, "output": "b"}, "instruction", "expected a string"),
        ({"instruction": "a", "output": None}, "output", "missing"),
    ],
)
def test_bad_alpaca_rows_name_row_and_field(gpt2, row, field, problem):
    fmt = Formatter("alpaca", gpt2, path="train.jsonl")
    with pytest.raises(BadRowError) as e:
        fmt.encode([{"instruction": "ok", "output": "ok"}, row], where=lambda i: f"line {i + 1}")
    assert str(e.value).startswith(f"train.jsonl: line 2: field {field}: {problem}")


def test_bad_chat_rows(phi3):
    fmt = Formatter("chat", phi3, path="c.json")
    with pytest.raises(BadRowError, match=r"c.json: row 0: field conversations\[1\].from: unknown chat role 'robot'"):
        fmt.encode([{"conversations": [{"from": "human", "value": "a"}, {"from": "robot", "value": "b"}]}])
    with pytest.raises(BadRowError, match=r"field messages\[0\].content: expected a string"):
        fmt.encode([{"messages": [{"role": "user", "content": ["x"]}]}])
    with pytest.raises(BadRowError, match="field messages: missing"):
        fmt.encode([{"text": "x"}])
    skip = Formatter("chat", phi3, on_bad_row="skip")
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    out = skip.encode([{"text": "x"}, good, {"messages": [{"role": "user", "content": "only a question"}]}])
    assert out[0] == "bad_row" and out[2] == "no_target" and isinstance(out[1], tuple)


@settings(max_examples=80, deadline=None)
@given(
    instruction=st.text(min_size=1, max_size=60),
    extra=st.text(max_size=30),
    output=st.text(min_size=1, max_size=60).filter(lambda s: s.strip()),
)
def test_alpaca_mask_decodes_to_output_for_any_text(gpt2, instruction, extra, output):
    # Byte-level BPE decodes exactly, so the mask must select exactly the response and EOS, except
    # leading whitespace of the response, which the pre-tokenizer joins to the prompt's final newline
    # (one token holds both: it stays with the prompt, as the prompt's tokens must not change).
    ids, mask = Formatter("alpaca", gpt2).encode([{"instruction": instruction, "input": extra, "output": output}])[0]
    prompt = (ALPACA_PROMPT if extra.strip() else ALPACA_PROMPT_NO_INPUT).format(instruction=instruction, input=extra)
    assert ids.tolist() == gpt2(prompt + output).input_ids + [gpt2.eos_token_id]
    trained, whole = gpt2.decode(ids[mask == 1]), output + "<|endoftext|>"
    assert whole.endswith(trained) and not whole[: len(whole) - len(trained)].strip()
    assert trained.lstrip() == whole.lstrip()


@pytest.mark.slow
@pytest.mark.parametrize("max_length,overlong", [(None, "drop"), (2048, "drop"), (64, "drop"), (64, "truncate"), (8, "truncate")])
def test_text_records_built_per_batch_equal_the_per_record_ones(gpt2, phi3, max_length, overlong):
    # The text format builds a batch's records at once (_finish_text); the per-record _finish is the
    # oracle: same ids, masks, dtypes, drops and truncation count, on real short and long rows, with
    # GPT-2 (EOS appended) and phi-3-mini (its own post-processor).
    texts = [line.strip() for line in open(need(DATA / "text" / "wikitext2_valid.txt")) if line.strip()][:400]
    texts += [json.loads(line)["text"] for line in open(need(DATA / "text" / "llamafactory_c4_demo.jsonl"))][:100]
    for tok in (gpt2, phi3):
        batch = Formatter("text", tok, max_length=max_length, overlong=overlong)
        one = Formatter("text", tok, max_length=max_length, overlong=overlong)
        got = batch.encode([{"text": t} for t in texts])
        oracle = [one._finish(enc, len(t), [(0, len(t))]) for t, enc in zip(texts, one._encode_batch(texts))]
        assert len(got) == len(oracle)
        for g, o in zip(got, oracle):
            if isinstance(o, str):
                assert g == o
            else:
                assert g[0].dtype == np.int32 and g[1].dtype == np.uint8
                assert g[0].tolist() == o[0].tolist() and g[1].tolist() == o[1].tolist()
        assert batch.truncated == one.truncated
        if max_length == 64:  # the case exercises what it claims: some rows cut or dropped, some kept
            assert 0 < sum(isinstance(o, str) or o[0].size == 64 for o in oracle) < len(oracle)


def test_text_rows_good_and_bad_on_the_fast_path(gpt2):
    # The text format takes plainly good rows without the general path's calls; every other row
    # must still be dropped or refused as the general path says, naming its row and field.
    rows = [{"text": "plain"}, {"text": "   \t "}, {"text": ""}, {"txt": "x"}, {"text": 5}, {"text": "a\ud800b"},
            ["not", "a", "dict"], {"text": None}, {"text": "déjà vu, 中文"}]
    out = Formatter("text", gpt2, on_bad_row="skip").encode(rows)
    kinds = [o if isinstance(o, str) else "record" for o in out]
    assert kinds == ["record", "empty", "empty", "bad_row", "bad_row", "bad_row", "bad_row", "bad_row", "record"]
    assert out[8][0].tolist() == gpt2("déjà vu, 中文").input_ids + [gpt2.eos_token_id]
    reasons = {3: "missing", 4: "expected a string", 5: "not valid Unicode", 6: "expected an object", 7: "missing"}
    for i, reason in reasons.items():
        with pytest.raises(BadRowError, match=f"row {i}") as e:
            Formatter("text", gpt2).encode(rows[: i + 1][-1:], where=lambda j, i=i: f"row {i}")
        assert reason in str(e.value) and ("text" in str(e.value) or i == 6)
