"""Records longer than seq_len follow an explicit policy (split, truncate, drop), counted in stats; the
default never serves a response piece cut off from its prompt in alpaca and chat caches."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portable_loader as pl
from portable_loader.collate import FIELDS, pack
from portable_loader.precache import sample_args

from test_loader import make_source

SEQ = 48


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """The bundled chat sample: 2000 records of 17 to 100 tokens, a fifth of them longer than 48."""
    return pl.open_cache(pl.precache(**sample_args(), out=tmp_path_factory.mktemp("c"), num_workers=1))


class TextLike:
    """A list source that says, like a cache's manifest, that it holds pretraining text."""

    manifest = {"config": {"format": "text"}}

    def __init__(self, records):
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        return self.records[i]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 100), min_size=1, max_size=60), seq_len=st.integers(1, 40),
       policy=st.sampled_from(["split", "truncate", "drop"]))
def test_pack_applies_the_policy_to_each_overlong_record(lengths, seq_len, policy):
    idx = np.arange(len(lengths)) * 3  # record indices that are not positions
    rows = pack(idx, np.array(lengths), seq_len, policy)
    pieces = sorted(p for row in rows for p in row)
    assert all(sum(e - s for _, s, e in row) <= seq_len for row in rows)
    want = []
    for i, n in zip(idx.tolist(), lengths):
        if n <= seq_len:
            want += [(i, 0, n)] if n else []
        elif policy == "split":
            want += [(i, s, min(n, s + seq_len)) for s in range(0, n, seq_len)]
        elif policy == "truncate":
            want.append((i, 0, seq_len))
    assert pieces == sorted(want)


def test_auto_resolves_by_the_cache_format():
    records = make_source(10)
    assert pl.DataLoader(TextLike(records), global_batch_size=2, seq_len=8, packing=True).overlong == "split"
    assert pl.DataLoader(TextLike(records), global_batch_size=2, seq_len=8).overlong == "truncate"
    assert pl.DataLoader(records, global_batch_size=2, seq_len=8, packing=True).overlong == "truncate"
    with pytest.raises(ValueError, match="needs packing"):
        pl.DataLoader(records, global_batch_size=2, seq_len=8, overlong="split")
    with pytest.raises(ValueError, match="overlong must be"):
        pl.DataLoader(records, global_batch_size=2, seq_len=8, overlong="chop")


@pytest.mark.slow
@pytest.mark.parametrize("packing", [True, False])
def test_chat_default_keeps_each_records_head_and_counts_truncations(chat, packing):
    loader = pl.DataLoader(chat, global_batch_size=16, seq_len=SEQ, seed=1, packing=packing, num_epochs=1,
                           fields=FIELDS)  # segment_ids in padded batches too
    assert loader.overlong == "truncate"
    lengths = chat.lengths(np.arange(len(chat)))
    with iter(loader) as it:
        batches = list(it)
        stats = it.stats
    assert stats["truncated"] == np.count_nonzero(lengths > SEQ) > 0
    assert stats["split"] == stats["dropped"] == 0
    # Every segment is the head of a record: its tokens are that record's first tokens.
    heads = {tuple(chat[i]["input_ids"][:8].tolist()) for i in range(len(chat))}
    segments = 0
    for b in batches:
        for r in range(b["input_ids"].shape[0]):
            seg = b["segment_ids"][r]
            for s in np.unique(seg[seg > 0]):
                toks = b["input_ids"][r, seg == s]
                assert tuple(toks[:8].tolist()) in heads
                segments += 1
    assert segments == len(chat)
    assert stats["tokens"] == np.minimum(lengths, SEQ).sum()


@pytest.mark.parametrize("packing", [True, False])
def test_drop_leaves_overlong_records_out_and_counts_them(chat, packing):
    loader = pl.DataLoader(chat, global_batch_size=16, seq_len=SEQ, seed=1, packing=packing, num_epochs=1,
                           overlong="drop")
    lengths = chat.lengths(np.arange(len(chat)))
    with iter(loader) as it:
        list(it)
        assert it.stats["dropped"] == np.count_nonzero(lengths > SEQ)
        assert it.stats["tokens"] == lengths[lengths <= SEQ].sum()


def test_explicit_split_serves_every_token_and_counts_the_split_records(chat):
    loader = pl.DataLoader(chat, global_batch_size=16, seq_len=SEQ, seed=1, packing=True, num_epochs=1,
                           overlong="split")
    lengths = chat.lengths(np.arange(len(chat)))
    with iter(loader) as it:
        list(it)
        assert it.stats["split"] == np.count_nonzero(lengths > SEQ)
        assert it.stats["tokens"] == lengths.sum()


def test_the_policy_is_part_of_the_config(chat):
    kw = dict(global_batch_size=16, seq_len=SEQ, seed=1, packing=True)
    state = iter(pl.DataLoader(chat, **kw)).get_state()
    with pytest.raises(pl.StateError, match="overlong: state 'truncate', loader 'drop'"):
        iter(pl.DataLoader(chat, overlong="drop", **kw)).set_state(state)


def test_padded_truncations_are_not_counted_where_lengths_are_not_cheap():
    """A source without lengths() would be read twice to count: the stat says None, not 0."""
    with iter(pl.DataLoader(make_source(20, max_len=40), global_batch_size=4, seq_len=8)) as it:
        next(it)
        assert it.stats["truncated"] is None
    with iter(pl.DataLoader(make_source(20, max_len=40), global_batch_size=4, seq_len=8, overlong="drop")) as it:
        batch = next(it)
        assert it.stats["dropped"] == np.count_nonzero(batch["attention_mask"].sum(axis=1) == 0) > 0
