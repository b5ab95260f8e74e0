"""A pipeline built again in a new interpreter accepts its own state, whatever its transforms do while
they run (issue 48, item 1; the rule in docs/grain.md, "Fingerprints").

The transforms below are what Grain users write: a dataclass ``MapTransform`` that makes its
processor on the first ``map`` under a lock set in ``__post_init__`` (MaxText's tokenizer), a plain
class that counts its calls, one that opens a file on first use, a filter that fills a cache, a lambda
over a dict it fills. One interpreter builds each pipeline, takes a few elements, saves its state
(``get_state`` or the Orbax handler) and reads on; a second, fresh interpreter builds the same
pipeline, restores the state and must read the same elements. The same script under real Grain
(``import grain``) gives the elements the saving run is compared with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

IMPORTS = {"real": "import grain\nimport grain.experimental\n",
           "ours": "from portable_loader import grain\n"}

SCRIPT = r'''
import dataclasses
import json
import sys
import threading

import numpy as np

mode, out_path, data_path, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
HEAD, TAIL = 3, 5


@dataclasses.dataclass
class LazyTokenizer(grain.transforms.Map):  # MaxText's TokenizeAndTrim: the processor made on first use
    scale: int
    max_len: int = 6

    def __post_init__(self):
        self._processor = None
        self._lock = threading.Lock()

    def __getstate__(self):  # a lock does not pickle: a worker makes its own, as MaxText's transforms do
        return {k: v for k, v in self.__dict__.items() if k not in ("_processor", "_lock")}

    def __setstate__(self, state):
        self.__dict__.update(state, _processor=None, _lock=threading.Lock())

    def map(self, x):
        if self._processor is None:
            with self._lock:
                self._processor = np.arange(1000) * self.scale
        n = 1 + x % self.max_len
        return {"tokens": self._processor[x : x + n].astype(np.int64), "id": np.int64(x)}


class CountingMap(grain.transforms.Map):  # a plain class with a call counter
    def __init__(self, offset):
        self.offset, self.calls = offset, 0

    def map(self, x):
        self.calls += 1
        return {**x, "id": x["id"] + self.offset}


class FileReader(grain.transforms.Map):  # opens its file on the first call and keeps it open
    def __init__(self, path):
        self.path, self._file, self._lock = path, None, threading.Lock()

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])

    def map(self, x):
        with self._lock:  # Grain reads with threads: one file position for all of them
            if self._file is None:
                self._file = open(self.path)
            self._file.seek(0)
            offset = int(self._file.read())
        return {**x, "tokens": x["tokens"] + offset}


@dataclasses.dataclass
class CachingFilter(grain.transforms.Filter):  # remembers every verdict it gave
    modulus: int

    def __post_init__(self):
        self._seen = {}

    def filter(self, x):
        self._seen[int(x)] = x % self.modulus != 1
        return self._seen[int(x)]


def records(change, shuffle=True):
    seen = {}
    ds = grain.MapDataset.range(60)
    if not shuffle:
        ds = ds.filter(CachingFilter(4))
    elif change == "changed_order":
        ds = ds.filter(CachingFilter(4)).shuffle(5)
    else:
        ds = ds.shuffle(6 if change == "changed_seed" else 5).filter(CachingFilter(4))
    ds = ds.map(LazyTokenizer(4 if change == "changed_argument" else 3))
    return ds.map(FileReader(data_path)).map(lambda r: seen.setdefault(int(r["id"]), r))


def pipeline(name, change=None):
    if name.startswith("loader"):
        workers = int(name[-1])
        sampler = grain.samplers.IndexSampler(60, shard_options=grain.sharding.NoSharding(), shuffle=True,
                                              num_epochs=1, seed=7)
        return grain.DataLoader(data_source=grain.MapDataset.range(60), sampler=sampler, worker_count=workers,
                                operations=[LazyTokenizer(3), CountingMap(10), CountingMap(1)])
    it_ds = records(change, shuffle=name != "unshuffled").to_iter_dataset().map(CountingMap(100))
    if name in ("concat_split", "concat_split_mp"):
        it_ds = grain.experimental.ConcatThenSplitIterDataset(it_ds.map(lambda r: {"tokens": r["tokens"]}),
                                                              length_struct={"tokens": 8})
    elif name == "best_fit":
        it_ds = grain.experimental.BestFitPackIterDataset(it_ds.map(lambda r: {"tokens": r["tokens"]}),
                                                          length_struct={"tokens": 8}, num_packing_bins=3)
    elif name in ("batch", "unshuffled", "mp_prefetch", "orbax"):
        it_ds = it_ds.map(lambda r: {"tokens": np.pad(r["tokens"], (0, 6 - len(r["tokens"]))), "id": r["id"]})
        it_ds = it_ds.batch(4)
    if name in ("mp_prefetch", "concat_split_mp"):
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
    return it_ds


def plain(x):
    if isinstance(x, dict):
        return {k: plain(v) for k, v in sorted(x.items())}
    return np.asarray(x).tolist()


def save(it, name):
    if name != "orbax":
        return it.get_state()
    import tempfile
    from etils import epath

    d = epath.Path(tempfile.mkdtemp()) / "iter"
    d.mkdir()  # Orbax makes the item directory before it calls the handler
    grain.checkpoint.CheckpointHandler().save(d, args=grain.checkpoint.CheckpointSave(it))
    return str(d)


def restore(it, name, state):
    if name == "orbax":
        from etils import epath

        grain.checkpoint.CheckpointHandler().restore(epath.Path(state), args=grain.checkpoint.CheckpointRestore(it))
    else:
        it.set_state(state)


def state_text(state):
    return state.decode() if isinstance(state, bytes) else state


results = {}
if mode == "save":
    saved = {}
    for name in names:
        it = iter(pipeline(name))
        head = [plain(next(it)) for _ in range(HEAD)]
        state = save(it, name)
        tail = [plain(next(it)) for _ in range(TAIL)]
        results[name] = {"head": head, "tail": tail, "state": state_text(state)}
else:
    saved = json.load(open(mode))
    for name in names:
        base, _, change = name.partition(":")
        ds = pipeline(base, change or None)
        first = iter(ds)
        next(first)  # the transforms run before the fingerprint is asked for: what they did must not count
        getattr(first, "close", lambda: None)()
        it = iter(ds)
        state = saved[base]["state"]
        try:
            restore(it, base, state.encode() if isinstance(state, str) and base.startswith("loader") else state)
            results[name] = {"tail": [plain(next(it)) for _ in range(TAIL)]}
        except Exception as e:
            results[name] = {"error": f"{type(e).__name__}: {e}"}
json.dump(results, open(out_path, "w"))
'''

SAME = ["batch", "unshuffled", "concat_split", "best_fit", "mp_prefetch", "concat_split_mp", "orbax", "loader0",
        "loader2"]
CHANGED = ["changed_seed", "changed_argument", "changed_order"]


def run(impl: str, mode: str, names: list, tmp_path: Path) -> dict:
    script = tmp_path / f"restart_{impl}.py"
    script.write_text(IMPORTS[impl] + SCRIPT)
    data = tmp_path / "offset.txt"
    data.write_text("1000")
    out = tmp_path / f"{impl}_{Path(mode).stem}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(script), mode, str(out), str(data), ",".join(names)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{impl} {mode}: rc={proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("restart")
    results = run("ours", "save", SAME, tmp)
    (tmp / "saved.json").write_text(json.dumps(results))
    return tmp, results


@pytest.mark.slow  # two interpreters (one starts mp_prefetch's and the loader's workers): ~1 minute on 2 cores
def test_a_fresh_interpreter_resumes_every_configuration(saved):
    tmp, results = saved
    # Each state once as saved and once by a pipeline whose seed, argument or order changed.
    asked = SAME + [f"batch:{c}" for c in CHANGED]
    resumed = run("ours", str(tmp / "saved.json"), asked, tmp)
    for name in SAME:
        assert resumed[name] == {"tail": results[name]["tail"]}, name
    for name in CHANGED:
        error = resumed[f"batch:{name}"].get("error", "")
        assert error.startswith("StateError") and "another pipeline" in error, (name, resumed[f"batch:{name}"])


@pytest.mark.slow
def test_the_saving_run_equals_real_grain(saved):
    tmp, results = saved
    # mp_prefetch and the 2-worker loader keep our stream (docs/grain.md): real Grain's at 0 workers.
    names = ["batch", "unshuffled", "concat_split", "best_fit", "loader0"]
    theirs = run("real", "save", names, tmp)
    for name in names:
        assert results[name]["head"] + results[name]["tail"] == theirs[name]["head"] + theirs[name]["tail"], name
    assert results["mp_prefetch"]["head"] + results["mp_prefetch"]["tail"] == \
        theirs["batch"]["head"] + theirs["batch"]["tail"]
    assert results["concat_split_mp"]["head"] + results["concat_split_mp"]["tail"] == \
        theirs["concat_split"]["head"] + theirs["concat_split"]["tail"]
    assert results["loader2"]["head"] + results["loader2"]["tail"] == \
        theirs["loader0"]["head"] + theirs["loader0"]["tail"]


def test_a_map_dataset_subclass_is_named_as_its_constructor_left_it():
    from portable_loader import grain as ours

    class Cached(ours.MapDataset):  # Grain's way to add a step: fills a cache on every read
        def __init__(self, parent, k):
            super().__init__(parent)
            self.k, self._cache = k, {}

        def __len__(self):
            return len(self._parent)

        def __getitem__(self, i):
            return self._cache.setdefault(i, self._parent[i] * self.k)

    def fingerprint(k, read):
        ds = Cached(ours.MapDataset.range(5), k)
        if read:
            assert [ds[i] for i in range(5)] == [i * k for i in range(5)]
        return ds.fingerprint()

    assert fingerprint(2, read=True) == fingerprint(2, read=False) != fingerprint(3, read=False)


def test_a_dataclass_transform_is_named_by_its_constructor_fields():
    import dataclasses
    import threading

    from portable_loader import grain as ours
    from portable_loader.dataset.base import function_identity

    @dataclasses.dataclass
    class Scale(ours.transforms.Map):
        k: int

        def __post_init__(self):
            self._table, self._lock = None, threading.Lock()

        def map(self, x):
            self._table = self._table or {"k": self.k}
            return x * self._table["k"]

    used = Scale(2)
    assert list(ours.MapDataset.range(3).map(used)) == [0, 2, 4]
    assert function_identity(used) == function_identity(Scale(2)) != function_identity(Scale(3))
    built = ours.MapDataset.range(3).map(Scale(2))
    assert built.fingerprint() == ours.MapDataset.range(3).map(used).fingerprint()
    assert built.fingerprint() != ours.MapDataset.range(3).map(Scale(3)).fingerprint()
