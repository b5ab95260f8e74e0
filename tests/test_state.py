"""Loader states are checked field by field: malformed, edited, foreign or out-of-range states raise
StateError naming the field, in the loader and in the torch, JAX and Grain-protocol adapter paths."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import portable_loader as pl
from portable_loader.plan import Cursor
from portable_loader.state import STATE_VERSION, make_state

from test_loader import _limited, make_source, reference_padded_batch, same, take

SRC = make_source(40, seed=1, max_len=30)
PADDED = dict(global_batch_size=4, seq_len=16, seed=2, num_epochs=1)
PACKED = dict(global_batch_size=4, seq_len=16, seed=2, num_epochs=1, packing=True, packing_window=8)


def state_after(kw, steps):
    with iter(pl.DataLoader(SRC, **kw)) as it:
        list(_limited(it, steps))  # stops early at the end of the stream
        return it.get_state()


def refused(kw, state, field, words=""):
    it = iter(pl.DataLoader(SRC, **kw))
    with pytest.raises(pl.StateError, match=f"^loader state: field '{field}': .*{words}"):
        it.set_state(state)


# --- the cases of the issue -------------------------------------------------------------------


def test_hand_edited_packed_step_is_refused():
    refused(PACKED, dict(state_after(PACKED, 2), step=10**9), "digest", "edited by hand")


@pytest.mark.parametrize("kw", [PADDED, PACKED], ids=["padded", "packed"])
def test_positions_past_the_end_of_a_finite_stream_are_refused(kw):
    loader = pl.DataLoader(SRC, **kw)
    if kw is PACKED:
        refused(kw, make_state(loader, Cursor(0, 10**6, 0)), "window", "past the end")
        nwin = -(-40 // 8)
        refused(kw, make_state(loader, Cursor(0, nwin, 1)), "row", "past the end")
    else:
        refused(kw, make_state(loader, Cursor(11, 0, 0)), "samples", r"past the end of the stream \(40 records\)")
        refused(kw, make_state(loader, Cursor(1, 1, 0)), "window", "must be 0 without packing")


def test_a_row_past_its_window_is_refused_not_moved():
    loader = pl.DataLoader(SRC, **PACKED)
    size = len(loader.planner().window_rows(2))
    refused(PACKED, make_state(loader, Cursor(3, 2, size)), "row", f"past the end of window 2 \\({size} rows\\)")
    it = iter(loader)
    it.set_state(make_state(loader, Cursor(3, 2, size - 1)))  # the last row is a place to resume at
    next(it)


@pytest.mark.parametrize("value", ["5", 5.5, True, None, [5], -1, 2**63])
def test_step_of_the_wrong_type_or_range_is_refused(value):
    refused(PADDED, dict(state_after(PADDED, 1), step=value), "step")


def test_missing_and_unknown_fields_are_refused():
    state = state_after(PADDED, 1)
    refused(PADDED, {k: v for k, v in state.items() if k != "row"}, "row", "missing")
    refused(PADDED, dict(state, epoch=0), "epoch", "not a loader state field")


@pytest.mark.parametrize("raw,words", [
    (b"\xff\xfe\x00garbage", "not UTF-8"), ("{not json", "not JSON"), ("[1, 2]", "JSON object"), (7, "JSON object"),
])
def test_raw_input_that_is_not_a_state_is_refused(raw, words):
    it = iter(pl.DataLoader(SRC, **PADDED))
    with pytest.raises(pl.StateError, match=f"^loader state: .*{words}"):
        it.set_state(raw)


def test_old_version_states_are_refused_as_another_stream():
    state = dict(state_after(PACKED, 1), version=1)
    refused(PACKED, state, "version", "older portable_loader")


def test_states_as_json_text_and_bytes_resume_and_the_end_state_stops():
    for kw in (PADDED, PACKED):
        loader = pl.DataLoader(SRC, **kw)
        full = list(iter(loader))
        for k in (0, 3, len(full)):
            state = state_after(kw, k)
            for form in (state, json.dumps(state), json.dumps(state).encode()):
                it = iter(loader)
                it.set_state(form)
                assert same(list(it), full[k:])


def test_a_refused_state_leaves_the_iterator_where_it_was():
    loader = pl.DataLoader(SRC, prefetch=2, **{**PADDED, "num_epochs": None})
    with iter(loader) as it:
        take(it, 3)
        with pytest.raises(pl.StateError):
            it.set_state(dict(it.get_state(), row=1))
        assert same(take(it, 2), [reference_padded_batch(SRC, s, 4, 16, seed=2) for s in (3, 4)])


# --- properties over generated states ---------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
FIELDS = ["version", "fingerprint", "config", "step", "window", "row", "samples", "batch_size", "batch_schedule",
          "digest"]


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packing=st.booleans(), steps=st.integers(0, 12), field=st.sampled_from(FIELDS + ["extra"]),
       action=st.sampled_from(["set", "delete"]), value=JSON)
def test_any_edit_of_a_state_is_refused_or_changes_nothing(packing, steps, field, action, value):
    kw = PACKED if packing else PADDED
    state = state_after(kw, steps)
    edited = dict(state)
    if action == "delete":
        edited.pop(field, None)
    else:
        edited[field] = value
    it = iter(pl.DataLoader(SRC, **kw))
    if json.dumps(edited, sort_keys=True) == json.dumps(state, sort_keys=True):
        it.set_state(edited)
        assert it.get_state() == state
    else:
        with pytest.raises(pl.StateError, match="^loader state: "):
            it.set_state(edited)


@settings(max_examples=150, deadline=None)
@given(raw=st.binary(max_size=64) | st.text(max_size=64) | JSON)
def test_arbitrary_input_raises_only_state_error(raw):
    with pytest.raises(pl.StateError, match="^loader state: "):
        iter(pl.DataLoader(SRC, **PADDED)).set_state(raw)


@settings(max_examples=60, deadline=None)
@given(packing=st.booleans(), step=st.integers(0, 2**60), window=st.integers(0, 2**62), row=st.integers(0, 2**62))
def test_well_formed_positions_are_accepted_only_inside_the_stream(packing, step, window, row):
    """A state made by the loader itself (valid digest) is still refused past the stream's end."""
    kw = PACKED if packing else PADDED
    loader = pl.DataLoader(SRC, **kw)
    planner = loader.planner()
    if packing:
        window %= planner.num_windows + 2
        rows = len(planner.window_rows(window) or [])
        row %= rows + 2
        inside = (window < planner.num_windows and row < rows) or (window == planner.num_windows and row == 0)
        cursor = Cursor(step, window, row)
    else:
        step %= planner.num_steps() + 3
        inside = step <= planner.num_steps()
        cursor = Cursor(step, 0, 0)
    it = iter(loader)
    if inside:
        it.set_state(make_state(loader, cursor))
        assert it.get_state() == make_state(loader, cursor)
    else:
        with pytest.raises(pl.StateError, match="past the end"):
            it.set_state(make_state(loader, cursor))


# --- adapters ---------------------------------------------------------------------------------


def test_torch_adapter_refuses_bad_states_and_keeps_going():
    pytest.importorskip("torch")
    from portable_loader.adapters.torch import TorchLoader

    loader = pl.DataLoader(SRC, **{**PADDED, "num_epochs": None})
    with TorchLoader(loader, async_collation=True) as tl:
        take(tl, 2)
        good = tl.state_dict()
        for bad in ("{oops", b"\xff", json.dumps(dict(json.loads(good["portable_loader"]), step="3"))):
            with pytest.raises(pl.StateError, match="^loader state: "):
                tl.load_state_dict({"portable_loader": bad})
        assert tl.state_dict() == good
        want = reference_padded_batch(SRC, 2, 4, 16, seed=2)
        assert np.array_equal(next(tl)["input_ids"].numpy(), want["input_ids"])


def test_jax_adapter_and_its_checkpoint_files_refuse_bad_states(tmp_path):
    pytest.importorskip("jax")
    from portable_loader.adapters.jax import JaxLoader, LoaderCheckpointHandler

    loader = pl.DataLoader(SRC, **{**PACKED, "num_epochs": None, "global_batch_size": 8})  # 8 CPU devices
    with JaxLoader(loader) as jl:
        take(jl, 2)
        good = jl.get_state()
        for bad in (b"\xff\x00", b"not json", json.dumps(dict(json.loads(good), row=10**9)).encode()):
            with pytest.raises(pl.StateError, match="^loader state: "):
                jl.set_state(bad)
        assert jl.get_state() == good
        (tmp_path / "process_0-of-1.json").write_bytes(b"\x00\xff damaged")
        with pytest.raises(pl.StateError, match="process_0-of-1.json: is not UTF-8"):
            LoaderCheckpointHandler().restore(tmp_path, jl)
        assert json.loads(jl.get_state())["version"] == STATE_VERSION


def test_grains_own_orbax_handler_saves_and_restores_a_bare_iterator(tmp_path):
    # Grain's CheckpointHandler treats any iterator but its own as bytes-stated (get_state().decode()).
    grain = pytest.importorskip("grain")
    ocp = pytest.importorskip("orbax.checkpoint")
    records = [{"input_ids": np.arange(1 + i % 9, dtype=np.int32)} for i in range(40)]
    loader = pl.DataLoader(records, global_batch_size=4, seq_len=16, seed=0, packing=True)
    mngr = ocp.CheckpointManager(tmp_path / "ckpt", item_names=("iter",),
                                 item_handlers={"iter": grain.checkpoint.CheckpointHandler()})
    with iter(loader) as it:
        next(it)
        mngr.save(1, args=ocp.args.Composite(iter=grain.checkpoint.CheckpointSave(it)))
        mngr.wait_until_finished()
        following = [next(it) for _ in range(3)]
    with iter(loader) as fresh:
        mngr.restore(1, args=ocp.args.Composite(iter=grain.checkpoint.CheckpointRestore(fresh)))
        again = [next(fresh) for _ in range(3)]
    mngr.close()
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(following, again) for k in a)
