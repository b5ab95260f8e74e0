"""Golden files pin the state format and the streams: states and the sample cache's key saved by this
version (tests/golden/, written by scripts/make_golden.py) must restore to the very batches recorded
with them, a run from step 0 must save the very same state, and a state of another version is refused
naming both versions. A failure here means users' checkpoints or caches would change meaning."""

import importlib.util
import json
import pathlib

import pytest

import portable_loader as pl
from portable_loader.state import STATE_VERSION

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("make_golden", ROOT / "scripts" / "make_golden.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)

CASES = sorted(golden.CASES)


def load(name: str) -> dict:
    return json.loads((golden.GOLDEN / name).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def cache_path(tmp_path_factory):
    return golden.sample_cache(tmp_path_factory.mktemp("golden"))


@pytest.fixture(scope="module")
def src(cache_path):
    return pl.open_cache(cache_path)


def test_every_case_has_its_file_and_no_file_is_stale():
    files = sorted(p.name for p in golden.GOLDEN.glob("*.json"))
    assert files == sorted([f"{name}.json" for name in CASES] + [golden.CACHE_FILE]), golden.HOW_TO_REGENERATE


def test_golden_files_hold_nothing_of_the_machine_that_wrote_them():
    for path in golden.GOLDEN.glob("*.json"):
        text = path.read_text(encoding="utf-8")
        for machine in (str(ROOT), "tokenize_seconds", "created_unix", '"/'):
            assert machine not in text, f"{path.name} holds {machine!r}"


@pytest.mark.parametrize("name", CASES)
def test_a_golden_state_restores_to_the_recorded_batches(name, src):
    saved = load(f"{name}.json")
    with iter(golden.CASES[name].loader(src)) as it:
        try:
            it.set_state(saved["state"])
        except pl.StateError as e:
            pytest.fail(f"{name}: the golden state is refused ({e}); {golden.HOW_TO_REGENERATE}")
        got = golden.batches_digest(it)
    assert got == saved["next"], (f"{name}: the batches after the golden state changed (the stream moved); "
                                  f"{golden.HOW_TO_REGENERATE}")


@pytest.mark.parametrize("name", CASES)
def test_a_run_from_step_0_saves_the_golden_state(name, src):
    saved = load(f"{name}.json")
    got = golden.record(name, src)
    assert got["state"] == saved["state"], f"{name}: the saved state changed; {golden.HOW_TO_REGENERATE}"
    assert got == saved, f"{name}: {golden.HOW_TO_REGENERATE}"


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("shift", [-1, 1], ids=["older", "newer"])
def test_a_state_of_another_version_is_refused_naming_both(name, shift, src):
    version = STATE_VERSION + shift
    state = dict(load(f"{name}.json")["state"], version=version)
    it = iter(golden.CASES[name].loader(src))
    words = "an older portable_loader" if shift < 0 else "a newer portable_loader"
    with pytest.raises(pl.StateError, match=(f"^loader state: field 'version': {version} is not {STATE_VERSION} "
                                             fr"\(saved by state version {version} of {words}.*"
                                             f"this one reads state version {STATE_VERSION} only")):
        it.set_state(state)


def test_the_sample_cache_key_and_content_are_golden(cache_path):
    assert golden.cache_record(cache_path) == load(golden.CACHE_FILE), (
        f"the bundled sample's cache key, content or layout changed; {golden.HOW_TO_REGENERATE}")


@pytest.mark.parametrize("name", CASES)
def test_a_golden_state_with_a_field_renamed_is_refused_naming_it(name, src):
    # What a code change that renames a state field looks like to a saved checkpoint: refused, never
    # read as a state without that field.
    saved = load(f"{name}.json")["state"]
    for field in [k for k in saved if k not in ("version", "digest")]:
        state = {("renamed_" + k if k == field else k): v for k, v in saved.items()}
        with iter(golden.CASES[name].loader(src)) as it, pytest.raises(pl.StateError, match=field):
            it.set_state(state)
