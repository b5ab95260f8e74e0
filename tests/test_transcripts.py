"""Role-marked transcripts (hh-rlhf's '\\n\\nHuman:' / '\\n\\nAssistant:') read into chat turns: the
splitter against joined turns, the real hh-rlhf file through precache with phi-3-mini (the trained
tokens decode to the assistant turns, found here by plain str.split), the cache key, and the errors."""

import gzip
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portable_loader as pl
from conftest import DATA, PHI3, need
from portable_loader.errors import BadRowError, PortableLoaderError
from portable_loader.precache import build_cache
from portable_loader.precache.cli import main
from portable_loader.tokenize import split_transcript, transcript_markers

HH = DATA / "chat" / "hh_harmless_base_test.jsonl.gz"
HH_ROWS = 300

MARKERS = st.sampled_from([
    {"\n\nHuman:": "user", "\n\nAssistant:": "assistant"},
    {"USER>>": "user", "BOT>>": "assistant", "SYS>>": "system"},
    {"<u>": "user", "<a>": "assistant"},
])
# Contents that cannot contain a marker: no '>', ':' or '<'.
CONTENT = st.text(st.characters(blacklist_characters=":<>", blacklist_categories=("Cs",)), max_size=30).map(str.strip)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(MARKERS, st.data())
def test_split_recovers_the_joined_turns(markers, data):
    turns = data.draw(st.lists(st.tuples(st.sampled_from(list(markers)), CONTENT), min_size=1, max_size=8))
    text = "".join(f"{marker} {content}" for marker, content in turns)
    got = split_transcript(text, markers)
    assert got == [{"role": markers[m], "content": c} for m, c in turns]


def test_split_errors_and_presets():
    hh = transcript_markers("hh")
    with pytest.raises(ValueError, match="no transcript marker in the text"):
        split_transcript("just some text", hh)
    with pytest.raises(ValueError, match="text before the first transcript marker: 'preamble'"):
        split_transcript("preamble\n\nHuman: hi", hh)
    with pytest.raises(PortableLoaderError, match="unknown transcript preset 'hhh'"):
        transcript_markers("hhh")
    with pytest.raises(PortableLoaderError, match="role must be one of"):
        transcript_markers({"Bot:": "robot"})
    with pytest.raises(PortableLoaderError, match="must be a non-blank string"):
        transcript_markers({" ": "user"})


def hh_rows(n=HH_ROWS):
    with gzip.open(need(HH), "rt") as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def assistant_turns(transcript):
    """The oracle: assistant contents by plain splitting, independent of split_transcript's regex."""
    pieces = transcript.split("\n\nAssistant:")[1:]
    return [p.split("\n\nHuman:")[0].strip() for p in pieces]


@pytest.fixture(scope="module")
def hh_cache(tmp_path_factory):
    out = tmp_path_factory.mktemp("hh")
    return build_cache(need(HH), tokenizer=need(PHI3), format="chat", out=out, split=f"train[:{HH_ROWS}]",
                       fields={"messages": "chosen"}, transcript="hh", num_workers=2)


def test_hh_rlhf_trains_on_the_assistant_turns_only(hh_cache, phi3):
    path, summary = hh_cache
    src = pl.open_cache(path)
    expected = [a for a in (assistant_turns(r["chosen"]) for r in hh_rows()) if any(a)]
    assert summary["rows_in"] == HH_ROWS and len(src) == len(expected) > 0.9 * HH_ROWS
    assert summary["rows_out"] + summary["dropped"].get("no_target", 0) == HH_ROWS
    for record, answers in zip(src[:], expected):
        ids, mask = record["input_ids"], record["loss_mask"]
        assert phi3.decode(ids[mask == 1]) == "".join(a + "<|end|>" for a in answers if a)
        # Every marker became a template turn (contents may quote "Human:" themselves, as hh-rlhf's do).
        assert phi3.decode(ids).count("<|assistant|>") == len(answers)


def test_transcript_enters_the_key_and_equivalent_markers_share_a_cache(hh_cache, tmp_path):
    path, _ = hh_cache
    out = path.rsplit("/", 1)[0]
    common = dict(tokenizer=PHI3, format="chat", out=out, split=f"train[:{HH_ROWS}]", fields={"messages": "chosen"})
    same, s = build_cache(HH, transcript={"\n\nHuman:": "user", "\n\nAssistant:": "assistant"}, **common)
    assert (same, s["hit"]) == (path, True)
    other = pl.precache(HH, transcript={"\n\nHuman:": "user", "\n\nAssistant:": "assistant", "\n\nSystem:": "system"},
                        **common)
    assert other != path


def test_cli_transcript_preset_and_markers(hh_cache, capsys):
    path, _ = hh_cache
    args = ["--input", str(HH), "--tokenizer", str(PHI3), "--format", "chat", "--out", path.rsplit("/", 1)[0],
            "--split", f"train[:{HH_ROWS}]", "--field", "messages=chosen"]
    assert main([*args, "--transcript", "hh"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == path
    assert main([*args, "--transcript", r"\n\nHuman:=user", "--transcript", r"\n\nAssistant:=assistant"]) == 0
    out = capsys.readouterr().out
    assert "cache hit" in out and out.strip().splitlines()[-1] == path


def test_transcript_errors_name_the_file_row_and_field(tmp_path, capsys):
    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps({"chosen": "\n\nHuman: hi\n\nAssistant: yo"}) + "\n" + json.dumps({"chosen": "no markers here"}) + "\n")
    common = dict(tokenizer=need(PHI3), format="chat", out=tmp_path / "c", transcript="hh")
    with pytest.raises(BadRowError, match=r"t.jsonl: line 2: field chosen: no transcript marker in the text"):
        pl.precache(data, fields={"messages": "chosen"}, **common)
    with pytest.raises(BadRowError, match=r"t.jsonl: line 1: field messages: missing; the row has: chosen"):
        pl.precache(data, **common)
    skipped, s = build_cache(data, fields={"messages": "chosen"}, on_bad_row="skip", **common)
    assert s["rows_out"] == 1 and s["dropped"] == {"bad_row": 1}
    with pytest.raises(ValueError, match="transcript applies to the chat format only"):
        pl.precache(data, **dict(common, format="text"))
    rc = main(["--input", str(data), "--tokenizer", str(PHI3), "--format", "chat", "--out", str(tmp_path / "c"),
               "--field", "messages=chosen", "--transcript", "nope"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: unknown transcript preset 'nope'") and len(err.strip().splitlines()) == 1
