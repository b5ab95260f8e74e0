"""parse_index against Python's own list indexing as the oracle."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from portable_loader.indexing import parse_index


@given(st.integers(1, 50), st.data())
def test_matches_python_list_indexing(n, data):
    ref = list(range(n))
    key = data.draw(st.one_of(
        st.integers(-n, n - 1),
        st.lists(st.integers(-n, n - 1), max_size=10),
        st.builds(slice, st.none() | st.integers(-2 * n, 2 * n), st.none() | st.integers(-2 * n, 2 * n),
                  st.none() | st.integers(1, 5) | st.integers(-5, -1)),
    ))
    got = parse_index(key, n)
    if isinstance(key, list):
        assert got.tolist() == [ref[i] for i in key]
        assert parse_index(np.asarray(key, dtype=np.int32), n).tolist() == got.tolist()
    elif isinstance(key, slice):
        assert got.tolist() == ref[key]
    else:
        assert got == ref[key]


@pytest.mark.parametrize("key", ["3", 1.0, True, np.bool_(True), [1, "2"], [1.0], np.array([True, False]),
                                 np.zeros((2, 2), dtype=int), None, {1}])
def test_refuses_everything_else(key):
    with pytest.raises(TypeError, match="dataset indices must be"):
        parse_index(key, 10)


@pytest.mark.parametrize("key", [10, -11, [0, 10], np.array([-11])])
def test_out_of_range(key):
    with pytest.raises(IndexError, match="out of range for a dataset of 10 records"):
        parse_index(key, 10)
