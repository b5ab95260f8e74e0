"""Digests pinned to the values the code computed before the sha256-of-JSON helper
(portable_loader.digests) existed: cache keys, manifest checksums, loader fingerprints and state digests
of existing caches and states must not move."""

import pytest
import hashlib
import json
import os

from hypothesis import given, settings
from hypothesis import strategies as st

import portable_loader as pl
from portable_loader import state
from portable_loader.cache.manifest import _manifest_checksum, cache_key
from portable_loader.digests import json_sha256
from portable_loader.precache import build_cache, sample_args

# Computed with the code of commit 6158644 (before the split), not by the helper under test.
BODY = {
    "format_version": 1, "backend": "arrow", "key": "k" * 64, "note": "héllo ✓", "x": 0.5, "checksum": "ignored",
    "counts": {"rows_in": 3, "rows_out": 2, "dropped": {"empty": 1}},
    "shards": [{"file": "data-00000-of-00001.arrow", "rows": 2, "bytes": 123, "sha256": "ab" * 32}],
}
STATE = {"version": 2, "fingerprint": "f" * 32, "config": {"seed": 3, "seq_len": 64}, "step": 7, "window": 1, "row": 5,
         "digest": "x"}


def test_manifest_checksum_pinned():
    assert _manifest_checksum(BODY) == "00dc668928790e4bba2328cdd6175807609ab7355d5c8fad9f9f99560e277c68"
    # The checksum never covers itself.
    assert _manifest_checksum({**BODY, "checksum": "other"}) == _manifest_checksum(BODY)


def test_cache_key_pinned():
    parts = {"b": [1, 2, None], "a": "ünï", "c": {"z": 1, "y": True}}
    assert cache_key(parts) == json_sha256(parts) == "157d2019ce343c346e48521e1483c35d260f3227fb25aed43bef48bc08300388"


def test_state_digest_pinned():
    assert state._digest(STATE) == "b836e512e0181348"


@pytest.mark.slow
def test_sample_cache_key_content_fingerprint_and_state_pinned(tmp_path):
    path, _ = build_cache(**sample_args(), out=tmp_path, max_length=256, num_workers=1)
    # Moved from chat-3d0e5cd442b8a16f68f7 when shards came to follow the task plan (key part "plan":
    # rows_per_task) instead of the worker count, and again when the default rows_per_task came to
    # follow the row count (key part "auto"); the records, so the content checksum, did not move.
    assert os.path.basename(path) == "chat-4531b578c18d96455b2a"
    src = pl.open_cache(path)
    assert src.manifest["content_checksum"] == "0d4cbacfb094fee9bed77bd6b8f91fef"
    body = {k: v for k, v in src.manifest.items() if k != "checksum"}
    # An independent oracle for the checksum format: hashlib on the canonical, compact JSON dump.
    oracle = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert src.manifest["checksum"] == oracle
    loader = pl.DataLoader(src, global_batch_size=4, seq_len=128, seed=1)
    # Fingerprint and state digest against hashlib on json.dumps with default separators (what
    # they were before the helper). Since state v3 the batch size is not part of the fingerprint.
    config = {k: v for k, v in loader.config.items() if k != "global_batch_size"}
    assert loader.fingerprint == hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:32]
    it = iter(loader)
    next(it)
    got = it.get_state()
    assert got["fingerprint"] == loader.fingerprint
    body = {k: v for k, v in got.items() if k != "digest"}
    assert got["digest"] == hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(_json, st.booleans())
def test_json_sha256_matches_hashlib_on_the_canonical_dump(value, compact):
    separators = (",", ":") if compact else (", ", ": ")
    oracle = hashlib.sha256(json.dumps(value, sort_keys=True, separators=separators).encode()).hexdigest()
    assert json_sha256(value, compact=compact) == oracle
