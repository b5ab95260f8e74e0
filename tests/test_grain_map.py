"""Our ``Dataset`` as Grain's ``MapDataset``, with real Grain as the oracle.

Every pipeline is built twice, once with ``grain.MapDataset`` and once with our ``Dataset``, and
compared: the same elements (type, structure, dtype, shape, value), shuffled orders included
(Grain's shuffles are deterministic), and the same error type where Grain refuses.
"""

import collections
import itertools
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

grain = pytest.importorskip("grain")

from portable_loader.dataset import Dataset as MapDataset  # noqa: E402
from portable_loader.dataset import batch as batch_module  # noqa: E402

G = grain.MapDataset
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def same(a, b) -> bool:
    """Equal pytrees: the same types, dict key order, dtypes, shapes and values."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a == b
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def check(build, *, indices=True):
    """``build(cls)`` with Grain's class and ours: equal length, iteration and (by default) every ``ds[i]``."""
    g, d = build(G), build(MapDataset)
    assert isinstance(d, MapDataset)
    assert len(d) == len(g)
    assert same(list(d), list(g))
    if indices:
        assert same([d[i] for i in range(len(d))], [g[i] for i in range(len(g))])
    return g, d


def raises_alike(build):
    """Grain and we refuse ``build`` with the same exception type (at construction or on read)."""
    errors = []
    for cls in (G, MapDataset):
        with pytest.raises(Exception) as info:
            list(build(cls))
        errors.append(info.type)
    assert errors[0] is errors[1], errors
    return errors[0]


# --- sources, ranges, per-element transforms -------------------------------------------------------


@FAST
@given(st.integers(-20, 20), st.none() | st.integers(-20, 20), st.integers(-4, 4).filter(bool))
def test_range(start, stop, step):
    check(lambda M: M.range(start, stop, step) if stop is not None else M.range(start))


def test_range_positional_and_keyword_forms():
    check(lambda M: M.range(5))
    check(lambda M: M.range(2, 9))
    check(lambda M: M.range(start=1, stop=10, step=3))


@pytest.mark.parametrize("elements", [[3, 1, 4, 1, 5], list("grain"), [(1, "a"), (2, "b")],
                                      [{"x": np.arange(i), "y": i} for i in range(4)], [b"a", b"bc"]])
def test_source_map_filter_map_with_index(elements):
    check(lambda M: M.source(elements))
    check(lambda M: M.source(elements).map(lambda e: (e, 1)))
    check(lambda M: M.source(elements).filter(lambda e: hash(repr(e)) % 2 == 0))
    check(lambda M: M.source(elements).map_with_index(lambda i, e: (i, e)))
    check(lambda M: M.source(elements).filter(lambda e: len(repr(e)) % 2 == 0).map_with_index(lambda i, e: (e, i)))


def test_filtered_index_reads_none_and_iteration_skips_it():
    g, d = check(lambda M: M.range(10).filter(lambda x: x % 3 == 0).map(lambda x: x * 10))
    assert d[1] is None and list(d) == [0, 30, 60, 90]


def test_getitem_negative_and_out_of_range():
    g, d = G.range(3, 10), MapDataset.range(3, 10)
    assert [d[i] for i in range(-7, 7)] == [g[i] for i in range(-7, 7)]
    assert d[np.int64(-2)] == g[-2]
    # An integer past the end reads the next epoch, as Grain's does; below -len stays an IndexError here.
    assert [d[i] for i in range(7, 30)] == [g[i] for i in range(7, 30)]
    with pytest.raises(IndexError):
        d[-8]
    with pytest.raises(TypeError):
        d["1"]
    assert d[[0, -1]] == [3, 9]  # a list of indices gives a list of elements


def test_empty_dataset():
    for build in (lambda M: M.range(0), lambda M: M.source([]), lambda M: M.range(5)[3:1]):
        check(build)
    with pytest.raises(IndexError):
        MapDataset.range(0)[0]


# --- slice ----------------------------------------------------------------------------------------

slices = st.builds(slice, st.none() | st.integers(-25, 25), st.none() | st.integers(-25, 25),
                   st.none() | st.integers(-5, 5).filter(bool))


@FAST
@given(st.integers(0, 20), slices, slices)
def test_slice_and_subscript(n, a, b):
    check(lambda M: M.range(n)[a])
    check(lambda M: M.range(n).slice(a)[b])
    check(lambda M: M.source(list(range(100, 100 + n))).map(lambda x: -x).slice(a))


@FAST
@given(st.integers(1, 12), slices, st.integers(1, 3))
def test_slice_epochs_follow_grain(n, sl, epochs):
    # An index past a slice's end reads the same positions of the parent's next epoch.
    check(lambda M: M.range(n)[sl].repeat(epochs))
    check(lambda M: M.range(n).random_map(lambda x, rng: (x, int(rng.integers(99))), seed=3)[sl].repeat(epochs))


def test_slice_refuses_a_non_slice():
    assert raises_alike(lambda M: M.range(5).slice(3)) is ValueError


# --- batch ----------------------------------------------------------------------------------------

Point = collections.namedtuple("Point", "x y")
PYTREES = {
    "ints": lambda i: i,
    "floats": lambda i: i / 2,
    "strings": lambda i: "s" * (i + 1),
    "bytes": lambda i: b"b" * (i % 3),
    "bools": lambda i: i % 2 == 0,
    "arrays": lambda i: np.full((2, 3), i, np.float16),
    "uint8 scalars": lambda i: np.uint8(i),
    "tuple": lambda i: (i, np.arange(3, dtype=np.int32) + i, "t"),
    "dict, unsorted keys": lambda i: {"z": np.int8(i), "a": [i, {"m": "x" * i}], "k": (np.zeros(2, bool),)},
    "namedtuple": lambda i: Point(np.arange(i % 2 + 1, i % 2 + 3), "p"),
    "ordered dict": lambda i: collections.OrderedDict([("b", i), ("a", np.array([i, i]))]),
    "None inside": lambda i: {"a": None, "b": i},
}


@pytest.mark.parametrize("kind", sorted(PYTREES))
@pytest.mark.parametrize("size, drop", [(1, False), (3, False), (3, True), (7, False), (20, True)])
def test_batch_pytrees(kind, size, drop):
    make = PYTREES[kind]
    check(lambda M: M.range(7).map(make).batch(size, drop_remainder=drop))
    check(lambda M: M.source([make(i) for i in range(7)]).batch(size, drop_remainder=drop).repeat(2))


@pytest.mark.parametrize("kind", sorted(PYTREES))
def test_stack_without_jax_matches_grain(kind, monkeypatch):
    # Grain stacks through jax.tree_util here; our pure-Python pytree walk must give the same batches.
    monkeypatch.setattr(batch_module, "_tree_map", lambda fn, *trees: batch_module._map(fn, trees))
    from grain._src.python.dataset.transformations.batch import make_batch

    for n in (1, 2, 5):
        elements = [PYTREES[kind](i) for i in range(n)]
        assert same(batch_module.stack(elements), make_batch(elements))


@pytest.mark.parametrize("elements", [
    [{"a": 1}, {"b": 1}], [[1], [1, 2]], [[1], (1,)], [None, 1], [np.zeros(2), np.zeros(3)],
    [collections.OrderedDict(a=1, b=2), collections.OrderedDict(b=2, a=1)], [{"a": 1}, collections.OrderedDict(a=1)],
])
@pytest.mark.parametrize("pure", [False, True])
def test_stack_refuses_what_grain_refuses(elements, pure, monkeypatch):
    from grain._src.python.dataset.transformations.batch import make_batch

    if pure:
        monkeypatch.setattr(batch_module, "_tree_map", lambda fn, *trees: batch_module._map(fn, trees))
    with pytest.raises(ValueError):
        make_batch(elements)
    with pytest.raises(ValueError, match="same structure"):
        batch_module.stack(elements)


@pytest.mark.parametrize("pure", [False, True])
def test_stack_of_leaves_over_none_like_grain(pure, monkeypatch):
    # A None after a leaf is taken as a leaf (an object array); a window of Nones batches to None.
    from grain._src.python.dataset.transformations.batch import make_batch

    if pure:
        monkeypatch.setattr(batch_module, "_tree_map", lambda fn, *trees: batch_module._map(fn, trees))
    for elements in ([1, None], [None], [None, None], [{"a": 1}, {"a": None}]):
        assert same(batch_module.stack(elements), make_batch(elements)), elements


def test_batch_of_a_map_that_returns_none():
    check(lambda M: M.range(6).map(lambda x: None if x % 2 else x).batch(2))  # [0, None] -> object arrays
    assert raises_alike(lambda M: M.range(6).map(lambda x: None if x == 3 else x).batch(3)) is ValueError  # None leads
    g, d = check(lambda M: M.range(6).map(lambda x: None if x < 2 else x).batch(2))  # the all-None batch is skipped
    assert d[0] is None and len(list(d)) == 2


def test_batch_fn_and_batch_after_filter():
    check(lambda M: M.range(10).batch(4, batch_fn=lambda xs: sum(xs)))
    check(lambda M: M.range(10).batch(4, batch_fn=tuple, drop_remainder=True))
    assert raises_alike(lambda M: M.range(10).filter(lambda x: x > 2).batch(2)) is ValueError
    assert raises_alike(lambda M: M.range(10).filter(lambda x: x > 2).map(str).repeat(2).batch(2)) is ValueError
    assert raises_alike(lambda M: M.mix([M.range(4), M.range(4).filter(bool)]).batch(2)) is ValueError
    assert raises_alike(lambda M: M.range(10).batch(0)) is ValueError


@FAST
@given(st.integers(0, 30), st.integers(1, 8), st.booleans(), st.integers(1, 3))
def test_batch_epochs_never_straddle(n, size, drop, epochs):
    check(lambda M: M.range(n).batch(size, drop_remainder=drop).repeat(epochs))
    check(lambda M: M.range(n).repeat(epochs).batch(size, drop_remainder=drop))


# --- repeat ---------------------------------------------------------------------------------------


def test_repeat():
    check(lambda M: M.range(4).repeat(3))
    check(lambda M: M.range(4).map_with_index(lambda i, x: (i, x)).repeat(2))
    check(lambda M: M.range(0).repeat())
    g, d = G.range(5).repeat(), MapDataset.range(5).repeat()
    assert len(d) == len(g) == sys.maxsize
    assert d[11111] == g[11111] == 1 and d[sys.maxsize - 1] == g[sys.maxsize - 1]
    assert list(itertools.islice(d, 12)) == list(itertools.islice(g, 12))
    assert same(d.batch(3)[10**15], g.batch(3)[10**15])
    assert raises_alike(lambda M: M.range(3).repeat().repeat()) is ValueError
    assert raises_alike(lambda M: M.range(3).repeat(0)) is ValueError


def test_repeat_reseeds_each_epoch_unless_told_not_to():
    draw = lambda x, rng: (x, int(rng.integers(10**6)))  # noqa: E731
    g, d = check(lambda M: M.range(5).random_map(draw, seed=1).repeat(3))
    assert list(d)[:5] != list(d)[5:10]
    g, d = check(lambda M: M.range(5).random_map(draw, seed=1).repeat(3, reseed_each_epoch=False))
    assert list(d)[:5] == list(d)[5:10]


# --- combining ------------------------------------------------------------------------------------


@pytest.mark.slow
@FAST
@given(st.lists(st.integers(1, 30), min_size=1, max_size=4), st.data())
def test_mix(lengths, data):
    weights = data.draw(st.none() | st.lists(st.integers(1, 9) | st.floats(0.05, 5, allow_nan=False),
                                             min_size=len(lengths), max_size=len(lengths)))

    def build(M):
        parts = [M.range(100 * k, 100 * k + n) for k, n in enumerate(lengths)]
        return M.mix(parts, weights) if weights is not None else M.mix(parts)

    g, d = check(build)
    if len(g):  # past its length a mixture reads its parts' next epochs
        assert same(list(d.repeat(3)), list(g.repeat(3)))


def test_mix_examples_and_errors():
    check(lambda M: M.mix([M.range(5), M.range(7, 10)]))
    check(lambda M: M.mix([M.range(10), M.range(100, 117), M.range(50, 53)], [1, 2.5, 0.3]))
    check(lambda M: M.mix([M.range(10).filter(lambda x: x % 2), M.source(list("abcdef"))], weights=[2, 1]))
    check(lambda M: M.mix([M.range(3).repeat(), M.range(10, 14)], [1, 3]), indices=False)
    assert raises_alike(lambda M: M.mix([M.range(3), M.range(3)], [0, 1])) is ValueError
    assert raises_alike(lambda M: M.mix([M.range(3), M.range(0)])) is ValueError


@FAST
@given(st.lists(st.integers(0, 12), max_size=4), st.integers(1, 3))
def test_concatenate(lengths, epochs):
    check(lambda M: M.concatenate([M.range(100 * k, 100 * k + n) for k, n in enumerate(lengths)]))
    check(lambda M: M.concatenate([M.range(100 * k, 100 * k + n) for k, n in enumerate(lengths)]).repeat(epochs))


@pytest.mark.slow
@settings(max_examples=8, deadline=None)  # Grain iterates a shuffle slowly
@given(st.lists(st.integers(0, 12), min_size=1, max_size=4).filter(sum), st.integers(1, 3))
def test_concatenate_epochs_reach_each_part(lengths, epochs):
    # Epoch e of a concatenation reads epoch e of each part: each part's shuffle of that epoch.
    g, d = (M.concatenate([M.range(n).shuffle(seed=0) for n in lengths]).repeat(epochs) for M in (G, MapDataset))
    got, want = list(d), list(g)
    assert len(got) == len(want) == sum(lengths) * epochs and got == want


def test_concatenate_refuses_infinite_parts():
    assert raises_alike(lambda M: M.concatenate([M.range(3), M.range(2).repeat()])) is ValueError


class EveryOther(grain.transforms.DatasetSelectionMap):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return index % 2, index // 2 + index % 3


def test_select_from_datasets():
    check(lambda M: M.select_from_datasets([M.range(10), M.source(list("abcdefghij"))], EveryOther(12)))
    pairs = [(1, 0), (0, 3), (1, 1), (0, 0)]
    check(lambda M: M.select_from_datasets([M.range(5).map(str), M.range(50, 52)], pairs))
    check(lambda M: M.select_from_datasets([M.range(5), M.range(9)], EveryOther(6)).repeat(2), indices=False)


# --- apply, pipe, Grain transform classes -----------------------------------------------------------


class AddOne(grain.transforms.Map):
    def map(self, x):
        return x + 1


class Odd(grain.transforms.Filter):
    def filter(self, x):
        return x % 2 == 1


class Jitter(grain.transforms.RandomMap):
    def random_map(self, x, rng):
        return x + float(rng.random())


class Tag(grain.transforms.MapWithIndex):
    def __init__(self, tag):
        self.tag = tag

    def map_with_index(self, index, x):
        return (self.tag, index, x)


def test_grain_transform_subclasses_work_unchanged():
    check(lambda M: M.range(9).map(AddOne()).filter(Odd()).map_with_index(Tag("t")))
    check(lambda M: M.range(9).random_map(Jitter(), seed=4))
    check(lambda M: M.range(9).seed(0).apply([AddOne(), Jitter(), grain.transforms.Batch(4, drop_remainder=True)]))
    check(lambda M: M.range(9).seed(3).apply(AddOne()).apply([Jitter(), Tag(1)]))
    check(lambda M: M.range(9).apply([Odd(), AddOne()]))


def grain_style_subclass(M):
    """A dataset written against Grain's MapDataset: __init__(parent), __len__ and __getitem__ only."""

    class PlusK(M):
        def __init__(self, parent, k):
            super().__init__(parent)
            self.k = k

        def __len__(self):
            return len(self._parent)

        def __getitem__(self, index):
            if isinstance(index, slice):
                return self.slice(index)
            x = self._parent[index]
            return None if x is None else (x + self.k, int(self._default_seed or 0))

    return PlusK


def test_grain_style_subclass_works_unchanged():
    check(lambda M: grain_style_subclass(M)(M.range(9).filter(lambda x: x % 3 > 0), 10)[::2].map(str))
    check(lambda M: grain_style_subclass(M)(M.range(5).seed(42), 1).batch(2, batch_fn=list).repeat(2))
    ds = grain_style_subclass(MapDataset)(MapDataset.range(4), 1)
    assert ds.fingerprint() != grain_style_subclass(MapDataset)(MapDataset.range(4), 2).fingerprint()
    assert ds.parents == ds._parents and ds.__getitems__([3, 0]) == [(4, 0), (1, 0)]


def test_pipe():
    check(lambda M: M.range(10).pipe(lambda ds, k, *, off: ds[off::k], 3, off=1))
    assert MapDataset.range(3).pipe(len) == 3


def test_refusals_alike():
    assert raises_alike(lambda M: M.range(3).map(Jitter())) is TypeError
    assert raises_alike(lambda M: M.range(3).shuffle()) is ValueError
    assert raises_alike(lambda M: M.range(3).shuffle(seed=2**32)) is ValueError
    assert raises_alike(lambda M: M.range(3).shuffle(seed=-1)) is ValueError
    assert raises_alike(lambda M: M.range(3).random_map(Jitter())) is ValueError
    assert raises_alike(lambda M: M.range(3).apply([grain.transforms.Batch(2), "not a transform"])) is NotImplementedError


# --- random transforms ----------------------------------------------------------------------------


def draw(x, rng):
    return (x, int(rng.integers(10**9)), float(rng.normal()))


@pytest.mark.slow
@FAST
@given(st.integers(0, 2**32 - 1), st.integers(1, 20))
def test_random_map_draws_equal_grains(seed, n):
    # Grain's keying (a Philox counter set from the index) is reproduced, so the draws are Grain's.
    check(lambda M: M.range(n).random_map(draw, seed=seed))
    check(lambda M: M.range(n).seed(seed).map(str).random_map(draw))  # the default seed, derived as Grain derives it
    check(lambda M: M.range(n).seed(seed).random_map(draw).seed(seed + 1).random_map(draw))


def test_random_map_is_deterministic_per_index():
    ds = MapDataset.range(50).random_map(draw, seed=7)
    whole = list(ds)
    assert [ds[i] for i in range(49, -1, -1)] == whole[::-1]
    assert ds.__getitems__([30, 2, 30]) == [whole[30], whole[2], whole[30]]


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(st.integers(1, 40), st.integers(0, 2**32 - 1), st.integers(1, 3))
def test_shuffle_is_grains_permutation_per_epoch(n, seed, epochs):
    g = G.range(n).shuffle(seed=seed).repeat(epochs)
    d = MapDataset.range(n).shuffle(seed=seed).repeat(epochs)
    got, want = list(d), list(g)
    assert len(d) == len(g) and got == want
    for e in range(epochs):
        assert sorted(got[e * n:(e + 1) * n]) == list(range(n))
    assert list(MapDataset.range(n).shuffle(seed=seed)) == got[:n]  # keyed: the same seed, the same order


def test_shuffle_orders_differ_by_seed_and_epoch():
    orders = {tuple(MapDataset.range(20).shuffle(seed=s)) for s in range(10)}
    assert len(orders) == 10
    d = list(MapDataset.range(20).shuffle(seed=0).repeat(3))
    assert d[:20] != d[20:40] != d[40:]


def test_shuffle_with_pipeline_seed_filter_and_repeat_first():
    g = G.range(30).seed(5).filter(lambda x: x % 3 > 0).shuffle()
    d = MapDataset.range(30).seed(5).filter(lambda x: x % 3 > 0).shuffle()
    assert list(d) == list(g) and sum(x is None for x in d[list(range(30))]) == 10
    # Shuffling after an endless repeat permutes the whole (sys.maxsize) stream, as Grain does.
    d, g = MapDataset.range(4).repeat().shuffle(seed=1), G.range(4).repeat().shuffle(seed=1)
    assert len(d) == sys.maxsize and list(itertools.islice(d, 100)) == [g[i] for i in range(100)]
    g = G.range(12).shuffle(seed=2).batch(5)
    d = MapDataset.range(12).shuffle(seed=2).batch(5)
    assert [b.tolist() for b in d] == [b.tolist() for b in g]


def test_shuffle_is_lazy_and_large():
    d, g = MapDataset.range(10**12).shuffle(seed=9), G.range(10**12).shuffle(seed=9)
    got = d[list(range(5))] + [d[10**12 - 1]]
    assert got == [g[i] for i in (0, 1, 2, 3, 4, 10**12 - 1)]


# --- the pieces together --------------------------------------------------------------------------

ops = st.lists(st.one_of(
    st.tuples(st.just("map"), st.integers(1, 3)),
    st.tuples(st.just("filter"), st.integers(2, 4)),
    st.tuples(st.just("slice"), slices),
    st.tuples(st.just("repeat"), st.integers(1, 3)),
    st.tuples(st.just("map_with_index"), st.integers(0, 1)),
    st.tuples(st.just("batch"), st.integers(1, 4), st.booleans()),
    st.tuples(st.just("concatenate"), st.integers(0, 5)),
    st.tuples(st.just("mix"), st.integers(1, 8), st.integers(1, 4)),
    st.tuples(st.just("random_map"), st.integers(0, 9)),
    st.tuples(st.just("shuffle"), st.integers(0, 2**32 - 1)),
), max_size=5)


def apply_ops(M, n, plan):
    ds = M.range(n)
    for op, *args in plan:
        if op == "map":
            ds = ds.map(lambda x, k=args[0]: x * k + 1)
        elif op == "filter":
            ds = ds.filter(lambda x, m=args[0]: int(np.sum(x)) % m != 0)
        elif op == "slice":
            ds = ds[args[0]]
        elif op == "repeat":
            ds = ds.repeat(args[0]) if len(ds) <= 40 else ds
        elif op == "map_with_index":
            ds = ds.map_with_index(lambda i, x, k=args[0]: x + i * k)
        elif op == "batch":
            ds = ds.batch(args[0], drop_remainder=args[1])
        elif op == "concatenate":
            ds = M.concatenate([ds, M.range(args[0])])
        elif op == "mix":
            ds = M.mix([ds, M.range(1000, 1000 + args[0])], [1, args[1]]) if len(ds) else ds
        elif op == "random_map":
            ds = ds.random_map(lambda x, rng: x + rng.integers(3), seed=args[0])
        elif op == "shuffle":
            ds = ds.shuffle(seed=args[0])
    return ds


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 25), ops)
def test_random_pipelines_equal_grains(n, plan):
    try:
        g = apply_ops(G, n, plan)
    except ValueError:  # e.g. a batch after a filter: we must refuse it too
        with pytest.raises(ValueError):
            apply_ops(MapDataset, n, plan)
        return
    d = apply_ops(MapDataset, n, plan)
    assert len(d) == len(g)
    try:
        want = [g[i] for i in range(len(g))]
    except ValueError:  # stacking a window with a None (a filter in a concatenated part)
        with pytest.raises(ValueError):
            [d[i] for i in range(len(d))]
        return
    assert same([d[i] for i in range(len(d))], want)
    assert same(list(d), [x for x in want if x is not None])


def test_to_iter_dataset_delegates():
    pytest.importorskip("portable_loader.dataset.iter.dataset")
    ds = MapDataset.range(8).filter(lambda x: x % 2)
    assert list(ds.to_iter_dataset()) == list(ds) == [1, 3, 5, 7]


def test_index_past_the_end_reads_later_epochs_as_grain():
    # Grain's tests pin it (slice_test::test_accessing_items_beyond_len_minus_one_succeeds,
    # batch_test::test_epoch_boundaries): deterministic views equal Grain's element for element.
    for build in (lambda M: M.range(5).map(lambda x: x * 2), lambda M: M.range(10)[2:7],
                  lambda M: M.range(5).random_map(lambda x, rng: int(rng.integers(1000)), seed=3),
                  lambda M: M.range(3).repeat(2), lambda M: M.source([5, 6, 7]).filter(lambda x: x != 6)):
        g, d = build(G), build(MapDataset)
        assert [d[i] for i in range(4 * len(d))] == [g[i] for i in range(4 * len(d))]
    g, d = G.range(5).batch(2), MapDataset.range(5).batch(2)
    assert [d[i].tolist() for i in range(9)] == [g[i].tolist() for i in range(9)]
    d, g = MapDataset.range(50).shuffle(seed=1), G.range(50).shuffle(seed=1)  # each epoch its own permutation
    epochs = [[d[i] for i in range(e * 50, (e + 1) * 50)] for e in range(3)]
    assert epochs == [[g[i] for i in range(e * 50, (e + 1) * 50)] for e in range(3)]
    assert all(sorted(e) == list(range(50)) for e in epochs) and epochs[0] != epochs[1] != epochs[2]
