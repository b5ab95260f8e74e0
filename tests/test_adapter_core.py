"""The adapter core (adapters/core.py) without a framework: the batches and states of the bare iterator
whatever it prepares ahead, and a trainer that fetches ahead counting what it takes."""

import numpy as np
import pytest

import portable_loader as pl
from portable_loader.adapters.core import MAX_AHEAD, Feed


def loader(**kw):
    # 40 records whose first token is their index: a repeated or skipped batch shows in its first column.
    records = [{"input_ids": np.full(3 + n % 5, n)} for n in range(1, 41)]
    return pl.DataLoader(records, global_batch_size=4, seq_len=8, seed=2, packing=True, packing_window=8, **kw)


def first_tokens(batch):
    return batch["input_ids"][:, 0].tolist()


def bare(n, **kw):
    """The oracle: the bare iterator's first ``n`` batches and the state after each."""
    with iter(loader(**kw)) as it:
        return [(first_tokens(next(it)), it.get_state()) for _ in range(n)]


@pytest.mark.parametrize("depth", [0, 2])
def test_batches_and_states_are_the_bare_iterators(depth):
    want = bare(12)
    with Feed(loader(), first_tokens, depth) as feed:
        got = [(next(feed), feed._taken_state()) for _ in range(12)]
    assert got == want


@pytest.mark.parametrize("depth", [0, 2])
def test_a_trainer_that_fetches_ahead_counts_what_it_takes(depth):
    want = bare(6)
    with Feed(loader(), first_tokens, depth) as feed:
        it = iter(feed)
        got = [next(it)]  # Lightning's first look-ahead, before the trainer says that it counts
        feed.count_takes()
        assert feed._taken_state()["step"] == 0
        for step in range(1, 5):
            got.append(next(it))  # the next batch, fetched before training on this one
            feed.take()
            assert feed._taken_state() == want[step - 1][1]  # the batch trained on, not the one ahead
        assert next(iter(feed)) == want[4][0]  # a new pass (a new Lightning epoch) serves the one ahead again
        assert feed._taken_state() == want[3][1]
        feed.take()
        next(feed)
        feed.stop_counting()  # the fit ends: back to the batch taken last, the one ahead is served again
        assert feed._taken_state() == want[4][1]
        assert next(feed) == want[5][0] and feed._taken_state() == want[5][1]
    assert got == [b for b, _ in want[:5]]


def test_a_trainer_that_never_takes_is_refused_not_checkpointed_ahead():
    with Feed(loader(), first_tokens, 1) as feed:
        feed.count_takes()
        for _ in range(MAX_AHEAD):
            next(feed)
        with pytest.raises(RuntimeError, match="never taken"):
            next(feed)
        assert feed._taken_state()["step"] == 0
    with Feed(loader(), first_tokens, 0) as feed:
        for _ in range(MAX_AHEAD + 1):
            next(feed)
        with pytest.raises(RuntimeError, match="begin counting before"):
            feed.count_takes()  # the pass's start is no longer known


def test_a_restore_and_the_controls_apply_to_the_batch_taken():
    want = bare(6)
    with Feed(loader(), first_tokens, 2) as feed:
        feed.count_takes()
        next(feed), next(feed)
        feed.take()
        feed.skip(0)  # a control rewinds the prepared batches, never the ones handed out
        assert feed._taken_state() == want[0][1]
        feed._restore(want[2][1])  # a restore starts a pass at the state: nothing ahead, nothing taken past it
        assert feed._taken_state() == want[2][1] and next(feed) == want[3][0]
