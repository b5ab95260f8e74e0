"""dataset[key] on caches of both backends: ints, lists, integer arrays and slices return the records
the formatter produced for those rows (the oracle), in order; every other key is a TypeError."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portable_loader as pl
from conftest import GPT2, need
from portable_loader.tokenize import Formatter, load_tokenizer

N_ROWS = 57


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """The same rows cached by 3 workers (3 shards) with each backend, plus the formatter's records."""
    base = tmp_path_factory.mktemp("index")
    data = base / "rows.jsonl"
    rows = [{"text": f"record {i} " + "word " * (i % 11)} for i in range(N_ROWS)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = load_tokenizer(need(GPT2))
    expected = [(ids.tolist(), mask.tolist()) for ids, mask in Formatter("text", tok).encode(rows)]
    srcs = {b: pl.open_cache(pl.precache(data, tokenizer=GPT2, format="text", out=base, num_workers=3, backend=b,
                                        rows_per_task=-(-N_ROWS // 3)))
            for b in ("arrow", "array_record")}
    return srcs, expected


def as_tuple(record):
    return record["input_ids"].tolist(), record["loss_mask"].tolist()


BACKENDS = ["arrow", "array_record"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_reported_keys(caches, backend):
    src, expected = caches[0][backend], caches[1]
    assert len(src.manifest["shards"]) == 3
    assert [as_tuple(r) for r in src[[5, 6, 7]]] == expected[5:8]
    assert [as_tuple(r) for r in src[np.array([5, 6])]] == expected[5:7]
    assert [as_tuple(r) for r in src[0:3]] == expected[0:3]
    assert as_tuple(src[-1]) == expected[-1] and as_tuple(src[np.int32(4)]) == expected[4]
    for key in ("3", 1.0, True, np.bool_(False), [1.0], ["3"], np.array([True, False]), np.zeros((2, 2), int), None):
        with pytest.raises(TypeError, match="dataset indices must be integers, slices, or lists/1-D arrays"):
            src[key]
    with pytest.raises(IndexError, match=f"out of range for a dataset of {N_ROWS} records"):
        src[[0, N_ROWS]]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_key_matches_list_indexing_of_the_oracle(caches, backend, data):
    src, expected = caches[0][backend], caches[1]
    n = len(expected)
    assert len(src) == n
    ints = st.integers(-n, n - 1)
    key = data.draw(st.one_of(
        ints,
        st.lists(ints, max_size=12),
        st.lists(ints, max_size=12).map(tuple),
        st.tuples(st.lists(ints, max_size=12), st.sampled_from([np.int8, np.int16, np.int32, np.int64, np.uint8]))
        .filter(lambda t: t[1] != np.uint8 or all(0 <= i < 256 for i in t[0]))
        .filter(lambda t: t[1] != np.int8 or all(-128 <= i < 128 for i in t[0]))
        .map(lambda t: np.asarray(t[0], dtype=t[1])),
        st.builds(slice, st.none() | st.integers(-2 * n, 2 * n), st.none() | st.integers(-2 * n, 2 * n),
                  st.none() | st.integers(1, 7) | st.integers(-7, -1)),
    ))
    got = src[key]
    if isinstance(key, (int, np.integer)):
        assert as_tuple(got) == expected[key]
    else:
        positions = list(range(n))[key] if isinstance(key, slice) else [int(i) for i in key]
        assert isinstance(got, list)
        assert [as_tuple(r) for r in got] == [expected[i] for i in positions]
        # __getitems__ (the loader's batched read) agrees with indexing.
        assert [as_tuple(r) for r in src.__getitems__(positions)] == [as_tuple(r) for r in got]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_reads_refuse_non_integers_too(caches, backend):
    src, expected = caches[0][backend], caches[1]
    assert [as_tuple(r) for r in src.__getitems__(range(3, 9, 2))] == [expected[i] for i in range(3, 9, 2)]
    assert src.lengths(np.arange(4)).tolist() == [len(e[0]) for e in expected[:4]]
    for key in ([1.0], ["3"], [True]):
        with pytest.raises(TypeError, match="dataset indices must be"):
            src.__getitems__(key)
