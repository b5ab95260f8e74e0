"""Arrow cache reads: the few-records path (plain Python) against the vectorized one and the records."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_loader.cache import FORMAT_VERSION, ShardWriter, open_cache, write_manifest

SIZES = np.random.default_rng(0).integers(0, 30, 500)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # Five shards: records spread over several memory-mapped pieces, as in a real cache.
    path = str(tmp_path_factory.mktemp("arrow") / "c")
    os.makedirs(path)
    shards, per = [], 100
    for s in range(5):
        w = ShardWriter(os.path.join(path, f"data-{s:05d}-of-00005.arrow"), "arrow")
        for i in range(s * per, (s + 1) * per):
            w.write(np.arange(SIZES[i], dtype=np.int32) + 1000 * i, np.full(SIZES[i], i % 2, np.uint8))
        shards.append(w.close())
    counts = {"rows_in": 500, "rows_out": 500, "dropped": {}, "truncated": 0, "tokens": int(SIZES.sum()),
              "trainable_tokens": 0}
    write_manifest(path, {"format_version": FORMAT_VERSION, "backend": "arrow", "key": "t".ljust(64, "0"),
                          "counts": counts, "content_checksum": "", "shards": shards})
    return open_cache(path)


@settings(max_examples=100, deadline=None)
@given(idx=st.lists(st.integers(-500, 499), min_size=0, max_size=150), as_array=st.booleans())
def test_reads_and_lengths_match_the_records_on_both_paths(cache, idx, as_array):
    key = np.asarray(idx, dtype=np.int64) if as_array else idx
    want = [i % 500 for i in idx]  # negatives count from the end
    got = cache.__getitems__(key)
    assert [int(r["input_ids"][0]) // 1000 if r["input_ids"].size else None for r in got] == \
        [i if SIZES[i] else None for i in want]
    assert all(np.array_equal(r["input_ids"], np.arange(SIZES[i], dtype=np.int32) + 1000 * i) for r, i in zip(got, want))
    assert all((r["loss_mask"] == i % 2).all() for r, i in zip(got, want))
    assert cache.lengths(key).tolist() == SIZES[want].tolist()


@pytest.mark.parametrize("bad", [[500], [0, -501], np.array([3, 500]), np.array([-501])])
def test_out_of_range_is_an_index_error_naming_the_cache(cache, bad):
    for read in (cache.__getitems__, cache.lengths):
        with pytest.raises(IndexError, match="out of range") as e:
            read(bad)
        assert cache.path in str(e.value)
