"""num_steps / steps_per_epoch: the number of batches a finite stream yields, for a Trainer's max_steps."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portable_loader as pl

from test_loader import make_source
from test_row_order import Lengths, long_tailed, narrow


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 90), batch=st.sampled_from([1, 3, 8]), epochs=st.integers(1, 3), packing=st.booleans(),
       window=st.sampled_from([1, 7, 32]))
def test_num_steps_counts_the_batches_a_finite_stream_yields(n, batch, epochs, packing, window):
    src = make_source(n, seed=n)
    kw = dict(global_batch_size=batch, seq_len=24, seed=1, packing=packing, packing_window=window)
    served = len(list(iter(pl.DataLoader(src, num_epochs=epochs, prefetch=0, **kw))))
    endless = pl.DataLoader(src, **kw)
    assert endless.num_steps(epochs) == served
    assert pl.DataLoader(src, num_epochs=epochs, **kw).num_steps() == served
    if epochs == 1:
        assert endless.steps_per_epoch() == served


@pytest.mark.slow
@pytest.mark.parametrize("dist", [long_tailed, narrow])
def test_packed_estimate_is_within_one_percent(dist):
    loader = pl.DataLoader(Lengths(dist(200_000, seed=2)), global_batch_size=64, seq_len=2048, seed=0,
                           packing=True, overlong="split")
    exact = loader.steps_per_epoch()
    assert abs(loader.steps_per_epoch(estimate=True) - exact) <= 0.01 * exact


def test_endless_stream_needs_a_number_of_epochs():
    with pytest.raises(ValueError, match="needs num_epochs"):
        pl.DataLoader(make_source(5), global_batch_size=2, seq_len=8).num_steps()
