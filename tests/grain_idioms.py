"""Grain idioms, run as written against `import grain` or `from portable_loader import grain`.

    python tests/grain_idioms.py grain|ours WORKERS OUTDIR

prints one JSON object: idiom name -> its canonical output (or the error's type). The idioms are
taken from Grain's tutorials and tests; tests/test_grain_api.py runs this script once with real
Grain and with ours at two worker counts, in separate processes, and compares. WORKERS is the
worker count of the idioms where Grain's own stream depends on it (Grain runs them with 0).
"""

import functools
import json
import os
import sys

import numpy as np

MODE, WORKERS, OUTDIR = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if MODE == "grain":
    import grain
else:
    from portable_loader import grain


def canon(x):
    """A JSON-able exact form: arrays by dtype, shape and values; dicts sorted; numpy scalars typed."""
    if isinstance(x, (np.ndarray, np.generic)):
        a = np.asarray(x)
        return ["array", a.dtype.str, list(a.shape), a.tolist()]
    if isinstance(x, dict):
        return ["dict", [[k, canon(v)] for k, v in sorted(x.items())]]
    if isinstance(x, (list, tuple)):
        return [type(x).__name__, [canon(v) for v in x]]
    return ["leaf", type(x).__name__, x]


class Square(grain.transforms.Map):
    def map(self, x):
        return x * x


class NotMod3(grain.transforms.Filter):
    def filter(self, x):
        return x % 3 != 0


class Jitter(grain.transforms.RandomMap):
    def random_map(self, x, rng):
        return x * 1000 + int(rng.integers(1000))


class Tag(grain.transforms.MapWithIndex):
    def map_with_index(self, index, x):
        return (index, x)


def index_sampler(n, **kw):
    kw.setdefault("shard_options", grain.sharding.NoSharding())
    return grain.samplers.IndexSampler(n, **kw)


IDIOMS = {}


def idiom(fn):
    IDIOMS[fn.__name__] = fn
    return fn


# --- MapDataset (Grain's "Dataset basics" tutorial and its tests) --------------------------------

@idiom
def source_shuffle_map_batch():
    ds = grain.MapDataset.source(list(range(20))).shuffle(seed=42).map(lambda x: x * 2).batch(batch_size=3)
    return {"len": len(ds), "batches": canon(list(ds))}


@idiom
def range_filter_slice_repeat():
    ds = grain.MapDataset.range(20).filter(lambda x: x % 3 != 0)[2:15:2].repeat(2)
    return {"len": len(ds), "items": canon(list(ds)), "getitem": canon([ds[i] for i in (0, 1, 7, 13)])}


@idiom
def map_with_index_and_random_map():
    ds = grain.MapDataset.range(8).map_with_index(lambda i, x: i * 100 + x).random_map(Jitter(), seed=4)
    return canon(list(ds))


@idiom
def mix_concatenate_select():
    a, b = grain.MapDataset.range(5), grain.MapDataset.range(100, 108)
    return canon([list(grain.MapDataset.mix([a, b], weights=[0.7, 0.3])),
                  list(grain.MapDataset.concatenate([a, b])),
                  list(grain.MapDataset.select_from_datasets([a, b], [(1, 3), (0, 0), (1, 0)]))])


@idiom
def seed_then_shuffle_each_epoch():
    return canon(list(grain.MapDataset.range(10).seed(7).shuffle().repeat(2)))


@idiom
def apply_and_pipe():
    ds = grain.MapDataset.range(7).apply([Square(), grain.transforms.Batch(3, drop_remainder=True)])
    return canon(list(ds.pipe(lambda d, k: d.map(lambda b: b + k), 1)))


@idiom
def dict_elements_batch():
    ds = grain.MapDataset.source([{"x": np.arange(3) + i, "y": i} for i in range(5)]).batch(2)
    return canon(list(ds))


@idiom
def batch_and_pad():
    fn = functools.partial(grain.experimental.batch_and_pad, batch_size=3)
    return canon(list(grain.MapDataset.range(1, 5).batch(3, batch_fn=fn)))


@idiom
def index_shuffle_values():
    return [grain.experimental.index_shuffle(i, max_index=99, seed=3, rounds=4) for i in range(100)]


# --- IterDataset --------------------------------------------------------------------------------

@idiom
def to_iter_map_filter_batch():
    ds = grain.MapDataset.range(30).to_iter_dataset().map(Square()).filter(NotMod3()).batch(4)
    return canon(list(ds))


@idiom
def iter_seed_random_map():
    return canon(list(grain.MapDataset.range(10).to_iter_dataset().seed(3).random_map(Jitter())))


@idiom
def iter_apply_user_transforms():
    ds = grain.MapDataset.range(9).to_iter_dataset().apply([Square(), grain.transforms.Batch(4)])
    return canon(list(ds))


@idiom
def iter_mix_then_batch_then_map():
    a = grain.MapDataset.range(10).to_iter_dataset()
    b = grain.MapDataset.range(100, 120).to_iter_dataset()
    ds = grain.IterDataset.mix([a, b], weights=[1, 2]).batch(4).map(lambda x: x * 2)
    return canon(list(ds))


@idiom
def iter_nested_pytrees_and_strings():
    ds = grain.MapDataset.source([{"a": (i, str(i)), "b": [np.float32(i) / 2]} for i in range(5)])
    return canon(list(ds.to_iter_dataset().batch(2)))


@idiom
def mp_prefetch_map():
    ds = grain.MapDataset.range(40).map(Square()).to_iter_dataset()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
    return canon(list(ds))


@idiom
def mp_prefetch_filter_multiset():
    ds = grain.MapDataset.range(40).to_iter_dataset().filter(NotMod3())
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
    return sorted(ds)


@idiom
def iter_checkpoint_resume():
    ds = grain.MapDataset.range(30).to_iter_dataset().filter(NotMod3()).batch(3)
    it = iter(ds)
    for _ in range(2):
        next(it)
    state = it.get_state()
    rest = [b.tolist() for b in it]
    again = iter(ds)
    again.set_state(state)
    return {"rest": rest, "same": [b.tolist() for b in again] == rest}


# --- DataLoader (Grain's DataLoader tutorial) ----------------------------------------------------

@idiom
def dataloader_map_filter_batch():
    loader = grain.DataLoader(data_source=list(range(25)), sampler=index_sampler(25, shuffle=False, num_epochs=1),
                              operations=[NotMod3(), Square(), grain.transforms.Batch(3)], worker_count=WORKERS)
    return canon(list(loader))


@idiom
def dataloader_random_map_unshuffled_seeded():
    loader = grain.DataLoader(data_source=list(range(12)),
                              sampler=index_sampler(12, shuffle=False, num_epochs=1, seed=5),
                              operations=[Jitter(), Jitter(), grain.transforms.Batch(4)], worker_count=WORKERS)
    return canon(list(loader))


@idiom
def dataloader_shuffled_epochs():
    loader = grain.DataLoader(data_source=list(range(15)), sampler=index_sampler(15, shuffle=True, num_epochs=2, seed=7),
                              operations=[Square()], worker_count=WORKERS)
    return [int(x) for x in loader]


@idiom
def dataloader_sharded_by_one():
    opts = grain.sharding.ShardOptions(shard_index=0, shard_count=1)
    loader = grain.DataLoader(data_source=list(range(10)), sampler=index_sampler(10, num_epochs=2, shard_options=opts),
                              operations=[grain.transforms.Batch(4, drop_remainder=True)], worker_count=WORKERS,
                              shard_options=opts)
    return canon(list(loader))


@idiom
def dataloader_sequential_sampler_and_range_source():
    src = grain.sources.RangeDataSource(0, 20, 3)
    loader = grain.DataLoader(data_source=src, sampler=grain.samplers.SequentialSampler(
        len(src), shard_options=grain.sharding.NoSharding()), worker_count=WORKERS)
    return canon(list(loader))


@idiom
def dataloader_checkpoint_resume():
    def make():
        return grain.DataLoader(data_source=list(range(40)), sampler=index_sampler(40, num_epochs=1),
                                operations=[NotMod3(), grain.transforms.Batch(4)], worker_count=WORKERS)
    it = iter(make())
    for _ in range(3):
        next(it)
    state = it.get_state()
    rest = [b.tolist() for b in it]
    again = iter(make())
    again.set_state(state)
    return {"rest": rest, "same": [b.tolist() for b in again] == rest, "bytes": isinstance(state, bytes)}


@idiom
def load_with_batch():
    return canon(list(grain.load(list(range(10)), num_epochs=1, batch_size=4, transformations=[Square()])))


@idiom
def orbax_checkpoint_manager():
    import orbax.checkpoint as ocp

    def make():
        return iter(grain.DataLoader(data_source=list(range(30)), sampler=index_sampler(30, num_epochs=1),
                                     operations=[grain.transforms.Batch(5)], worker_count=WORKERS))
    mngr = ocp.CheckpointManager(os.path.join(OUTDIR, f"orbax-{MODE}-{WORKERS}"))
    it = make()
    next(it)
    mngr.save(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
    expected = [b.tolist() for b in it]
    restored = mngr.restore(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(make())))
    got = [b.tolist() for b in restored["data"]]
    mngr.close()
    return {"rest": got, "same": got == expected}


def main():
    if MODE == "grain":  # Grain's worker processes read absl flags
        from absl import flags

        flags.FLAGS.mark_as_parsed()
    out = {}
    for name, fn in IDIOMS.items():
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - compared with the other run's outcome
            out[name] = {"error": type(e).__name__, "message": str(e)[:300]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
