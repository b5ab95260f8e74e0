"""``Dataset.filter``: full batches of accepted records, exact resume, counts, reject-all, fingerprints.

Records carry their identity in their tokens (``tag * 1000 + record``), and predicates are functions
of that identity, so a batch is checked against an oracle computed by brute force: the stream of an
unfiltered loader with the rejected records taken out (padding), or a loader over the same source
whose rejected records are mapped to empty ones, which packing leaves out (packing).
"""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import portable_loader as pl
from conftest import steps
from portable_loader.errors import FilterError, StateError


def recs(n, tag, seed=0):
    lens = np.random.default_rng(seed * 31 + tag).integers(1, 12, n)
    return [{"input_ids": np.full(int(k), tag * 1000 + r, np.int32)} for r, k in enumerate(lens)]


def ident(r):
    return int(r["input_ids"][0])


def keep(mod, allowed):
    """A predicate on a record's identity: pure, and fingerprinted by the values it closes over."""
    return lambda r: int(r["input_ids"][0]) % mod in allowed


def same(xs, ys):
    return len(xs) == len(ys) and all(all(np.array_equal(a[k], b[k]) for k in a) for a, b in zip(xs, ys))


def first_tokens(batch):
    return [int(row[0]) if mask[0] else None for row, mask in zip(batch["input_ids"], batch["attention_mask"])]


def build(shape, srcs, preds):
    """(filtered dataset, unfiltered dataset, test of an identity) for one pipeline shape."""
    a, b = (pl.source(s) for s in srcs)
    pa, pb = preds
    both = lambda t: pa(t) if t // 1000 == 1 else pb(t)  # noqa: E731
    if shape == "plain":
        return a.filter(lambda r: pa(ident(r))), a, pa
    if shape == "after_map":  # the predicate sees the mapped record
        plus = a.map(lambda r: {"input_ids": r["input_ids"] + 1})
        return plus.filter(lambda r: pa(ident(r))), plus, pa
    if shape == "over_mix":
        m = pl.mix({"a": a, "b": b}, {"a": 2, "b": 1}, block=6)
        return m.filter(lambda r: both(ident(r))), m, both
    if shape == "mix_of_filters":
        fa, fb = a.filter(lambda r: pa(ident(r))), b.filter(lambda r: pb(ident(r)))
        weights = {"a": 2, "b": 1}
        return pl.mix({"a": fa, "b": fb}, weights, block=6), pl.mix({"a": a, "b": b}, weights, block=6), both
    raise AssertionError(shape)


SHAPES = ["plain", "after_map", "over_mix", "mix_of_filters"]
KW = dict(seq_len=16, seed=5, prefetch=0)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(SHAPES),
    st.integers(1, 40), st.integers(1, 30),
    st.integers(2, 5), st.integers(0, 2**16),
    st.integers(1, 6), st.sampled_from([None, 1, 2]),
)
def test_padded_stream_is_the_unfiltered_stream_without_rejected_records(shape, n_a, n_b, mod, bits, batch, epochs):
    allowed = {k for k in range(mod) if bits >> k & 1} or {0}
    pa = lambda t: t % mod in allowed  # noqa: E731
    pb = lambda t: (t // 2) % mod in allowed  # noqa: E731
    ds, plain, test = build(shape, (recs(n_a, 1, bits), recs(n_b, 2, bits)), (pa, pb))
    n_steps = 12
    # The oracle: the unfiltered stream, one record per step, with rejected records removed.
    total = None if epochs is None else epochs * len(plain)
    one_by_one = pl.DataLoader(plain, global_batch_size=1, num_epochs=epochs, **KW)
    flat, _, _ = steps(one_by_one, total or n_steps * batch * 20)
    stream = [first_tokens(b)[0] for b in flat]
    accepted = [t for t in stream if test(t)]
    loader = pl.DataLoader(ds, global_batch_size=batch, num_epochs=epochs, **KW)
    if not accepted and epochs is not None:
        with pytest.raises(FilterError, match="reject(s|ed) every record"):
            steps(loader, 1)
        return
    if len(accepted) < n_steps * batch and epochs is None:
        return  # a rare stream: the window of the oracle is too short to check it
    got, state, stats = steps(loader, n_steps)
    want = [accepted[i : i + batch] for i in range(0, min(len(accepted), n_steps * batch), batch)]
    assert [[t for t in first_tokens(b) if t is not None] for b in got] == want
    assert all(all(t is not None for t in first_tokens(b)) for b in got[:-1])  # full batches, but a finite last
    # Counted: every stream position passed over is served or counted as filtered.
    served = sum(len(w) for w in want)
    assert state["samples"] == served + stats["filtered"]
    assert sum(map(test, stream[: state["samples"]])) == served
    # describe names the same records, computed from the plan alone.
    for s, b in enumerate(got):
        assert [row[0][:2] if row else None for row in loader.describe(s)] == [named(shape, t) for t in first_tokens(b)]


def named(shape, token):
    """What describe should say of the record whose first token is ``token``: (source, record)."""
    if token is None:
        return None
    tag, r = divmod(token, 1000)
    if shape == "plain":
        return (None, r)
    if shape == "after_map":  # the map added 1 to every token
        return (None, r - 1)
    return ("ab"[tag - 1], r)


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(SHAPES), st.integers(1, 50), st.integers(1, 30), st.integers(2, 5),
    st.integers(0, 2**16), st.integers(1, 5), st.integers(4, 40),
)
def test_packed_windows_pack_only_accepted_records(shape, n_a, n_b, mod, bits, batch, window):
    allowed = {k for k in range(mod) if bits >> k & 1} or {0}
    pa = lambda t: t % mod in allowed  # noqa: E731
    pb = lambda t: (t // 3) % mod in allowed  # noqa: E731
    ds, plain, test = build(shape, (recs(n_a, 1, bits), recs(n_b, 2, bits)), (pa, pb))
    # The oracle: rejected records become empty ones, which the packer leaves out of every row.
    hollow = plain.map(lambda r: r if test(ident(r)) else {"input_ids": r["input_ids"][:0]})
    kw = dict(KW, global_batch_size=batch, packing=True, packing_window=window, num_epochs=2)
    want, _, _ = steps(pl.DataLoader(hollow, **kw), 15)
    stream = steps(pl.DataLoader(plain, **dict(kw, packing=False, global_batch_size=1)), 2 * len(plain))[0]
    if not any(test(first_tokens(b)[0]) for b in stream):
        with pytest.raises(FilterError):
            steps(pl.DataLoader(ds, **kw), 1)
        return
    loader, oracle = pl.DataLoader(ds, **kw), pl.DataLoader(hollow, **kw)
    got, state, stats = steps(loader, 15)
    assert same(got, want)
    assert [loader.describe(s) for s in range(len(got))] == [oracle.describe(s) for s in range(len(got))]
    ids = np.concatenate([b["input_ids"][b["attention_mask"] > 0] for b in got]) if got else np.zeros(0)
    assert all(test(int(t)) for t in np.unique(ids))


def plain_source(n=40):
    return pl.source(recs(n, 1))


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_at_random_steps_equals_the_uninterrupted_run(packing, workers):
    rng = np.random.default_rng(7)
    m = pl.mix({"a": plain_source().filter(keep(3, {0, 1})), "b": pl.source(recs(25, 2))}, {"a": 1, "b": 1}, block=4)
    ds = m.filter(keep(4, {0, 1, 3}), name="not-2-mod-4")
    kw = dict(global_batch_size=4, seq_len=16, seed=3, packing=packing, packing_window=16)
    whole, _, _ = steps(pl.DataLoader(ds, **kw, prefetch=0), 30)
    for k in rng.choice(np.arange(1, 29), 3, replace=False).tolist():
        _, state, _ = steps(pl.DataLoader(ds, **kw, prefetch=0), k)
        rest, _, _ = steps(pl.DataLoader(ds, **kw, num_workers=workers), 30 - k, state)
        assert same(rest, whole[k:]), k


def test_hosts_split_one_filtered_stream():
    ds = plain_source().filter(keep(5, {1, 2, 4}))
    kw = dict(global_batch_size=6, seq_len=16, seed=1, prefetch=0)
    whole, _, _ = steps(pl.DataLoader(ds, **kw), 10)
    hosts = [steps(pl.DataLoader(ds, **kw).with_shard(k, 3), 10) for k in range(3)]
    for s in range(10):
        assert np.array_equal(np.concatenate([h[0][s]["input_ids"] for h in hosts]), whole[s]["input_ids"])
    _, state, _ = steps(pl.DataLoader(ds, **kw).with_shard(1, 3), 4)  # elastic: 3 hosts -> 1
    assert same(steps(pl.DataLoader(ds, **kw), 6, state)[0], whole[4:])


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("epochs", [None, 1])
def test_a_filter_that_rejects_everything_is_an_error_not_a_hang(packing, epochs):
    ds = pl.mix({"a": plain_source(), "b": pl.source(recs(9, 2))}, {"a": 1, "b": 3}).filter(lambda r: False)
    loader = pl.DataLoader(ds, global_batch_size=4, seq_len=16, packing=packing, num_epochs=epochs, prefetch=0)
    with pytest.raises(FilterError, match="filter .*<lambda> rejected .*(everything|every record)"):
        steps(loader, 1)
    with pytest.raises(FilterError):
        loader.describe(0)


def test_the_limit_stops_long_runs_of_rejections_on_a_large_source(monkeypatch):
    monkeypatch.setattr("portable_loader.plan.MAX_REJECTED", 5000)
    ds = _Counting(100_000).filter(lambda r: False, name="never")  # 2N would be 200,000 reads
    for packing in (False, True):
        loader = pl.DataLoader(ds, global_batch_size=2, seq_len=8, packing=packing, prefetch=0)
        with pytest.raises(FilterError, match=r"filter never rejected (\d+) records in a row .*nearly everything") as e:
            steps(loader, 1)
        assert 5000 <= int(str(e.value).split(" rejected ")[1].split()[0]) <= 5000 + 4096


class _Counting(pl.Dataset):
    """n records whose content is their index: cheap to read, no content digest of a million records."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitems__(self, indices):
        return [{"input_ids": np.full(2, i, np.int32)} for i in np.asarray(indices).tolist()]

    def _identity(self):
        return ("counting", self.n)


def test_rejected_records_are_counted_in_stats():
    ds = plain_source(60).filter(keep(2, {0}))
    loader = pl.DataLoader(ds, global_batch_size=5, seq_len=16, num_epochs=1, prefetch=0)
    got, state, stats = steps(loader, 100)
    stream = [first_tokens(b)[0] for b in steps(pl.DataLoader(plain_source(60), global_batch_size=1, seq_len=16,
                                                               num_epochs=1, prefetch=0), 60)[0]]
    last = max(p for p, t in enumerate(stream) if t % 2 == 0)  # the stream is read up to its last survivor
    assert stats["filtered"] == sum(t % 2 for t in stream[: last + 1]) and state["samples"] == last + 1
    assert sum(int(b["attention_mask"][:, 0].sum()) for b in got) == 30
    assert loader.num_steps() == len(got) == 6 and loader.num_steps(estimate=True) == 6
    packed = pl.DataLoader(ds, global_batch_size=2, seq_len=16, num_epochs=1, packing=True, prefetch=0)
    assert steps(packed, 100)[2]["filtered"] == 30  # a packed window counts all its records at once


def test_fingerprint_covers_the_predicate():
    base = plain_source()
    kw = dict(global_batch_size=4, seq_len=16, prefetch=0)
    _, state, _ = steps(pl.DataLoader(base.filter(keep(3, {0})), **kw), 2)
    steps(pl.DataLoader(plain_source().filter(keep(3, {0})), **kw), 1, state)  # an equal filter resumes
    for other in (base.filter(keep(3, {1})), base.filter(keep(3, {0}), name="v2"), base, base.map(lambda r: r)):
        with pytest.raises(StateError, match="fingerprint"):
            steps(pl.DataLoader(other, **kw), 1, state)
    named = base.filter(keep(3, {0}), name="mod3")
    _, state, _ = steps(pl.DataLoader(named, **kw), 2)
    steps(pl.DataLoader(base.filter(keep(3, {0, 1}), name="mod3"), **kw), 1, state)  # the name speaks for it


def test_predicate_must_be_pure_and_return_a_bool():
    main = os.getpid()
    ds = plain_source().filter(lambda r: os.getpid() == main)
    with pytest.raises(Exception, match="planned as accepted but a filter rejects it now"):
        steps(pl.DataLoader(ds, global_batch_size=4, seq_len=16, num_workers=2), 2)
    with pytest.raises(TypeError, match="returned NoneType for record"):
        steps(pl.DataLoader(plain_source().filter(lambda r: None), global_batch_size=4, seq_len=16, prefetch=0), 1)


def test_records_read_for_the_predicate_are_not_read_again():
    reads = []

    class Reads(pl.Dataset):
        def __len__(self):
            return 50

        def __getitems__(self, indices):
            reads.extend(np.asarray(indices).tolist())
            return [{"input_ids": np.full(3, i, np.int32)} for i in np.asarray(indices).tolist()]

        def _identity(self):
            return ("reads",)

    ds = Reads().filter(lambda r: int(r["input_ids"][0]) % 2 == 0)
    reads.clear()
    steps(pl.DataLoader(ds, global_batch_size=5, seq_len=8, num_epochs=1, prefetch=0), 5)
    assert sorted(reads) == list(range(50))


def test_rejected_index_reads_as_none_and_filters_compose():
    ds = pl.source(recs(6, 1)).filter(keep(2, {0})).map(lambda r: {"input_ids": r["input_ids"] * 0 + 7})
    assert [r is None for r in ds[list(range(6))]] == [False, True, False, True, False, True]
    assert ds.filters == ("filter keep.<locals>.<lambda>",) and ds.accepts([1, 2]).tolist() == [False, True]
    twice = pl.source(recs(6, 1)).filter(keep(2, {0}), name="even").filter(keep(3, {0}), name="three")
    assert twice.accepts(range(6)).tolist() == [t % 6 == 0 for t in range(1000, 1006)]
    assert twice.filters == ("filter even", "filter three")


def test_grain_filter_holes_are_skipped_like_our_filter():
    grain = pytest.importorskip("grain")
    records = recs(30, 1)
    tree = grain.MapDataset.source(records).filter(lambda r: int(r["input_ids"][0]) % 3 != 0).map(lambda r: r)
    ours = pl.source(records).filter(lambda r: int(r["input_ids"][0]) % 3 != 0)
    assert pl.source(tree).filters == ("filter grain holes",)
    kw = dict(global_batch_size=4, seq_len=16, seed=2, num_epochs=1, prefetch=0)
    got, want = steps(pl.DataLoader(tree, **kw), 10)[0], steps(pl.DataLoader(ours, **kw), 10)[0]
    assert same(got, want) and all(None not in first_tokens(b) for b in got[:-1])


@pytest.mark.slow
def test_a_non_empty_filter_fills_the_holes_tokenize_on_read_leaves(tmp_path):
    from conftest import DATA, GPT2, need
    from portable_loader.precache import build_cache

    data, tokenizer = need(DATA / "text" / "llamafactory_c4_demo.jsonl"), need(GPT2)
    options = dict(tokenizer=tokenizer, format="text", split="train[:100]", max_length=200)
    path, summary = build_cache(data, out=tmp_path / "c", num_workers=0, **options)
    dropped = summary["dropped"]["overlong"]
    assert dropped > 0
    ds = pl.tokenized(data, **options).filter(lambda r: len(r["input_ids"]) > 0, name="non-empty")
    loader = pl.DataLoader(ds, global_batch_size=4, seq_len=256, num_epochs=1, prefetch=0)
    batches, state, stats = steps(loader, 100)
    assert all(b["attention_mask"][:, 0].all() for b in batches[:-1])  # no all-padding rows
    cache = pl.open_cache(path)
    served = sorted(tuple(row[m > 0][:8]) for b in batches
                    for row, m in zip(b["input_ids"], b["attention_mask"]) if m[0])
    assert served == sorted(tuple(np.asarray(r["input_ids"])[:8]) for r in cache[0 : len(cache)])
    # Every position up to the last kept record was served or counted; drops after it are never reached.
    assert state["samples"] == len(served) + stats["filtered"] and stats["filtered"] <= dropped


def test_a_map_over_a_mixture_keeps_the_mixture_order_and_names():
    m = pl.mix({"a": plain_source(), "b": pl.source(recs(25, 2))}, {"a": 1, "b": 3}, block=8)
    mapped = m.map(lambda r: {"input_ids": r["input_ids"] + 0}, keeps_lengths=True)
    kw = dict(global_batch_size=4, seq_len=16, seed=9, prefetch=0)
    plain, over = pl.DataLoader(m, **kw), pl.DataLoader(mapped, **kw)
    assert same(steps(over, 6)[0], steps(plain, 6)[0])
    assert [over.describe(s) for s in range(6)] == [plain.describe(s) for s in range(6)]
    assert "schedule" in steps(over, 1)[1]  # the state checks the mixture's schedule as for the mix itself


def test_a_map_that_edits_records_in_place_sees_each_record_fresh():
    class Fresh(pl.Dataset):  # like a cache: every read builds new records
        def __len__(self):
            return 12

        def __getitems__(self, indices):
            return [{"input_ids": np.arange(1, 2 + i % 5, dtype=np.int32)} for i in np.asarray(indices).tolist()]

        def _identity(self):
            return ("fresh",)

    def bos(r):
        r["input_ids"] = np.concatenate([[7], r["input_ids"]]).astype(np.int32)
        return r

    kw = dict(global_batch_size=2, seq_len=3, packing=True, num_epochs=1, prefetch=0, overlong="split")
    filtered = Fresh().filter(lambda r: True, name="all").map(bos)
    assert same(steps(pl.DataLoader(filtered, **kw), 40)[0], steps(pl.DataLoader(Fresh().map(bos), **kw), 40)[0])


def test_a_finite_mixture_whose_filter_rejects_all_of_it_says_so():
    # Its 4 positions reach the run limit (2 x 2 records) exactly where the stream ends: the error
    # must say the whole finite stream was rejected (a hypothesis draw found the run message instead).
    ds, _, _ = build("over_mix", (recs(1, 1, 0), recs(1, 2, 0)), (lambda t: t % 3 == 0, lambda t: (t // 2) % 3 == 0))
    with pytest.raises(FilterError, match="rejected every record of this finite stream"):
        steps(pl.DataLoader(ds, global_batch_size=1, num_epochs=2, **KW), 1)
