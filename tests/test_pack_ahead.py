"""With workers, best-fit packing windows are packed in the workers: the trainer's process packs
none, and every batch, state and resume is what the loader without workers gives."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import portable_loader as pl
from conftest import steps
from portable_loader import plan


def docs_of(lengths):
    return [{"input_ids": np.arange(1, n + 1, dtype=np.int32) + 1000 * i} for i, n in enumerate(lengths)]


def batches(loader, n, state=None):
    got, state, _ = steps(loader, n, state)
    return got, state


def same(a, b):
    return len(a) == len(b) and all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def test_the_trainers_process_packs_no_window(monkeypatch):
    docs = docs_of(np.random.default_rng(0).integers(1, 300, 3000))
    loader = pl.DataLoader(docs, global_batch_size=8, seq_len=256, packing=True, packing_window=64,
                           num_workers=2, seed=1)
    ref, _ = batches(pl.DataLoader(docs, **{**loader.options.kwargs(), "num_workers": 0}), 40)
    with iter(loader) as it:
        got = [next(it)]  # the workers exist now: what is patched below is the trainer's process alone

        def refuse(*args, **kwargs):
            raise AssertionError("the trainer's process packed a window")

        monkeypatch.setattr(plan, "pack", refuse)
        got += [next(it) for _ in range(39)]  # ~70 windows of 64 records
    assert same(ref, got)
    with pytest.raises(AssertionError, match="packed a window"):  # the patch does reach a loader without workers
        batches(pl.DataLoader(docs, **{**loader.options.kwargs(), "num_workers": 0, "prefetch": 0}), 1)


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31), window=st.sampled_from([4, 16, 100]), batch=st.integers(1, 9),
       workers=st.integers(1, 3), skipped=st.booleans(), filtered=st.booleans(), cut=st.integers(1, 12))
def test_any_packed_stream_with_workers_is_the_stream_without(seed, window, batch, workers, skipped, filtered, cut):
    rng = np.random.default_rng(seed)
    docs = docs_of(rng.integers(1, 90, 400))
    opts = dict(global_batch_size=batch, seq_len=64, packing=True, packing_window=window, seed=seed % 1000,
                num_epochs=2, overlong="split")
    if skipped:
        opts["skip_batches"] = [(3, 7)]
    source = pl.Dataset.source(docs).filter(lambda d: d["input_ids"][0] % 3 != 0) if filtered else docs
    ref, _ = batches(pl.DataLoader(source, **opts, num_workers=0, prefetch=0), 10_000)
    got, _ = batches(pl.DataLoader(source, **opts, num_workers=workers), 10_000)
    assert same(ref, got)
    # A state taken with workers resumes without them and with them, at the same place.
    head, state = batches(pl.DataLoader(source, **opts, num_workers=workers), cut)
    rest, _ = batches(pl.DataLoader(source, **opts, num_workers=workers), 10_000, state)
    assert same(ref, head + rest)


def test_set_weights_and_skip_with_workers_follow_the_loader_without():
    web = docs_of(np.random.default_rng(1).integers(5, 200, 600))
    code = [{"input_ids": d["input_ids"] + 500_000} for d in docs_of(np.random.default_rng(2).integers(5, 200, 600))]
    opts = dict(global_batch_size=6, seq_len=128, packing=True, packing_window=32, seed=4)

    def run(workers):
        loader = pl.DataLoader(pl.mix({"web": web, "code": code}, {"web": 1, "code": 1}), **opts, num_workers=workers)
        with iter(loader) as it:
            out = [next(it) for _ in range(5)]
            it.set_weights({"code": 3, "web": 1})
            out += [next(it) for _ in range(5)]
            it.skip(4)
            out += [next(it) for _ in range(5)]
        return out

    assert same(run(0), run(2))
