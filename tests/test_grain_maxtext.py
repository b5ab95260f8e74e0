"""A MaxText-style Grain input pipeline runs unchanged on ``portable_loader.grain`` (issue 41, item 7).

The pipeline below (``PIPELINE``) is written as MaxText writes its Grain input pipeline
(``input_pipeline/grain_data_processing.py``): ``import grain.python as grain``, ``MapTransform`` /
``RandomMapTransform`` subclasses, an ``ArrayRecordDataSource`` (real Grain's own class, its C++
reader opened in the trainer's process), ``MapDataset.source -> shuffle -> repeat -> shard slice ->
map``, ``to_iter_dataset``, first-fit packing or padding, ``batch``, ``mp_prefetch`` with 2 workers,
``pick_performance_config`` and the other ``grain.experimental`` imports, and a checkpoint through
``PyGrainCheckpointHandler``; JAX is imported and its backend started before any worker (the case
where forking crashed real Grain's reader with SIGSEGV). Each run is its own interpreter, on ours
(only the import lines differ) and on real Grain. It must give:

- on ours with 2 workers, the same batches as on ours with 0 workers, every time (3 iterators,
  each with new workers; no worker death, and none forked by the trainer's process itself);
- the same batches as real Grain (0 workers: Grain's own elements), without shuffling and with it
  (the shuffle is Grain's order);
- the checkpoint restored through the handler continues exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

IMPORTS = {
    "real": "import grain.python as grain\n"
            "from grain.experimental import (InterleaveIterDataset, ParquetIterDataset, TFRecordIterDataset,\n"
            "                                WindowShuffleIterDataset, pick_performance_config)\n",
    "ours": "from portable_loader.grain import python as grain\n"
            "from portable_loader.grain.experimental import (InterleaveIterDataset, ParquetIterDataset, TFRecordIterDataset,\n"
            "                                                WindowShuffleIterDataset, pick_performance_config)\n",
}

PIPELINE = '''
import json
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import psutil

path, workers, shuffle, packing, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1", int(sys.argv[5])
jnp.zeros(1).block_until_ready()  # JAX's backend (and its threads) up before any worker starts
SEQ, BATCH = 16, 4


class ParseFeatures(grain.MapTransform):
    def map(self, record):
        ids = np.frombuffer(record, dtype=np.int32)
        return {"inputs": ids, "targets": ids}


class ShiftData(grain.MapTransform):  # MaxText's: inputs are the targets shifted right, BOS 0 first
    def map(self, x):
        return {"inputs": np.concatenate([[0], x["inputs"][:-1]]).astype(np.int32), "targets": x["targets"]}


class Truncate(grain.MapTransform):
    def map(self, x):
        return {k: v[:SEQ] for k, v in x.items()}


class TokenNoise(grain.RandomMapTransform):  # a random augmentation: one keyed draw per element
    def random_map(self, x, rng):
        return {**x, "noise": np.asarray([rng.integers(0, 1000)], np.int32)}


class ReformatPacking(grain.MapTransform):
    def map(self, x):
        return {"inputs": x["inputs"], "targets": x["targets"], "inputs_segmentation": x["inputs_segment_ids"],
                "inputs_position": x["inputs_positions"]}


class PadToMaxLength(grain.MapTransform):
    def map(self, x):
        out = {}
        for k in ("inputs", "targets"):
            v = x[k]
            out[k] = np.pad(v, (0, SEQ - len(v)))
            out[k + "_segmentation"] = (np.arange(SEQ) < len(v)).astype(np.int32)
        return out


source = grain.ArrayRecordDataSource([path])  # real Grain's reader, opened here, in the trainer's process
dataset = grain.MapDataset.source(source)
if shuffle:
    dataset = dataset.shuffle(seed=11)
dataset = dataset.repeat(2)
dataset = dataset[0::1]  # dataloading_host_index::dataloading_host_count
dataset = dataset.map(ParseFeatures()).map(ShiftData()).map(Truncate())
dataset = dataset.to_iter_dataset(read_options=grain.ReadOptions(num_threads=2, prefetch_buffer_size=16))
dataset = dataset.random_map(TokenNoise(), seed=3)
dataset = dataset.map(lambda x: {k: v for k, v in x.items() if k != "noise"} if packing else x)
if packing:
    dataset = grain.experimental.FirstFitPackIterDataset(
        dataset, length_struct={"inputs": SEQ, "targets": SEQ}, num_packing_bins=BATCH)
    dataset = dataset.map(ReformatPacking())
else:
    dataset = dataset.map(lambda x: {**PadToMaxLength().map(x), "noise": x["noise"]})
dataset = dataset.batch(BATCH, drop_remainder=False)
picked = pick_performance_config(ds=dataset, ram_budget_mb=1024, max_workers=2, max_buffer_size=None)
assert picked.multiprocessing_options.num_workers >= 1, picked  # MaxText's grain_worker_count=-1
dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=2))

def dump(batches):
    return [{k: np.asarray(v).tolist() for k, v in sorted(b.items())} for b in batches]

for run in range(runs):  # each run a new iterator: new worker processes
    it = iter(dataset)
    head = [next(it) for _ in range(3)]
    # Workers this interpreter forked itself, not through multiprocessing's forkserver: the SIGSEGV case.
    forked = []
    for child in psutil.Process().children():
        try:
            if "multiprocessing" not in " ".join(child.cmdline()):
                forked.append(child.pid)
        except psutil.Error:
            pass
    print("FORKED " + json.dumps(forked), flush=True)
    with tempfile.TemporaryDirectory() as d:
        from etils import epath

        ckpt = epath.Path(d) / "iter"
        ckpt.mkdir()  # Orbax makes the item directory before it calls the handler
        grain.PyGrainCheckpointHandler().save(ckpt, args=grain.PyGrainCheckpointSave(it))
        rest = list(it)
        again = iter(dataset)
        grain.PyGrainCheckpointHandler().restore(ckpt, args=grain.PyGrainCheckpointRestore(again))
        resumed = list(again)
    assert dump(resumed) == dump(rest), "the restored iterator does not continue"
    print("RESULT " + json.dumps(dump(head + rest)), flush=True)
'''


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> Path:
    from array_record.python.array_record_module import ArrayRecordWriter

    path = tmp_path_factory.mktemp("maxtext") / "docs.array_record"
    rng = np.random.default_rng(0)
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for i in range(37):
        writer.write(rng.integers(1, 30000, size=int(rng.integers(2, 21))).astype(np.int32).tobytes())
    writer.close()
    return path


def run(impl: str, records: Path, workers: int, shuffle: bool, packing: bool, tmp_path: Path, runs: int = 1) -> list:
    """The batches of ``runs`` iterations of the pipeline in one new interpreter (a list per run)."""
    script = tmp_path / f"pipeline_{impl}.py"
    script.write_text(IMPORTS[impl] + PIPELINE)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", PYTHONFAULTHANDLER="1")
    env.pop("PORTABLE_LOADER_START_METHOD", None)
    proc = subprocess.run([sys.executable, str(script), str(records), str(workers), str(int(shuffle)),
                           str(int(packing)), str(runs)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{impl} workers={workers}: rc={proc.returncode}\n{proc.stderr[-3000:]}"
    assert "WorkerError" not in proc.stderr and "terminated unexpectedly" not in proc.stderr
    out = [json.loads(x[len("RESULT "):]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert len(out) == runs
    forked = [json.loads(x[len("FORKED "):]) for x in proc.stdout.splitlines() if x.startswith("FORKED ")]
    assert forked == [[]] * runs, f"{impl} workers={workers}: workers forked from JAX's process: {forked}"
    return out


def test_the_pipeline_text_is_the_same_for_both_but_the_import():
    assert "portable_loader" not in PIPELINE and "import grain" not in PIPELINE
    assert "ArrayRecordDataSource" in PIPELINE and "mp_prefetch" in PIPELINE


@pytest.mark.slow
@pytest.mark.parametrize("packing", [True, False], ids=["first-fit", "padding"])
def test_unshuffled_equals_real_grain_and_two_workers_equal_none(records, packing, tmp_path):
    [real] = run("real", records, 0, shuffle=False, packing=packing, tmp_path=tmp_path)
    [ours0] = run("ours", records, 0, shuffle=False, packing=packing, tmp_path=tmp_path)
    [ours2] = run("ours", records, 2, shuffle=False, packing=packing, tmp_path=tmp_path)
    assert len(real) >= 10
    assert ours0 == real
    assert ours2 == ours0


@pytest.mark.slow
def test_shuffled_equals_real_grain_and_two_workers_are_the_same_every_run(records, tmp_path):
    [want] = run("ours", records, 0, shuffle=True, packing=True, tmp_path=tmp_path)
    [unshuffled] = run("ours", records, 0, shuffle=False, packing=True, tmp_path=tmp_path)
    assert want != unshuffled  # the shuffle took effect
    assert want == run("real", records, 0, shuffle=True, packing=True, tmp_path=tmp_path)[0]
    # 3 iterators, new workers each. Forked workers crashed with SIGSEGV, but not every time (forced to
    # fork, 2 interpreters of 6 crashed here), so run() checks the cause: no worker of any iterator was
    # forked by the trainer's process itself. With that check one interpreter does (there were 2).
    assert run("ours", records, 2, shuffle=True, packing=True, tmp_path=tmp_path, runs=3) == [want] * 3
