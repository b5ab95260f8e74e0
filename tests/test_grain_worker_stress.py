"""Stress: Grain's ``DataLoader`` checkpointing tests with ``worker_count=3``, many times over, under a time limit.

Issue 41, item 6: Grain's ``data_loader_test`` hung in 2 of 4 runs on ours, in
``test_data_loader_checkpointing_object_reconstruction5`` / ``..._same_object5`` (``worker_count=3``),
the trainer's process waiting in ``WorkerPool.wait`` while all three workers waited for a task: a
task or a result was lost when an iterator was dropped or restored mid-flight. These tests run the
same patterns (Grain's ``create_checkpointing_dataloader``: range 0..15, ``+1``, keep even, batch 2;
read ``k`` batches, take the state, read one more, then restore into the same iterator or into a new
loader's, and read to the end) for every ``k``, many times, with 3 workers, in a subprocess killed
after 50 s: a hang fails the test instead of stopping the suite. The batches must be what real Grain
gives with no workers (our stream does not depend on the worker count).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# The pipeline, written once: run on ours in a subprocess, and on real Grain here (the oracle).
PIPELINE = r'''
class PlusOne(grain.MapTransform):
    def map(self, x):
        return x + 1

class FilterEven(grain.FilterTransform):
    def filter(self, x):
        return x % 2 == 0

def loader(workers):
    src = grain.RangeDataSource(start=0, stop=16, step=1)
    sampler = grain.IndexSampler(num_records=len(src), shard_options=grain.NoSharding(), shuffle=False, num_epochs=1)
    return grain.DataLoader(data_source=src, sampler=sampler, operations=[PlusOne(), FilterEven(),
                            grain.BatchOperation(batch_size=2)], worker_count=workers)
'''

SCRIPT = r'''
import json, sys
import numpy as np
from portable_loader.grain import python as grain
''' + PIPELINE + r'''
rounds, workers = int(sys.argv[1]), int(sys.argv[2])
out = []
for r in range(rounds):
    for k in range(4):
        for same_object in (True, False):
            it = iter(loader(workers))
            got = [next(it) for _ in range(k)]
            state = it.get_state()
            extra = next(it)
            if same_object:
                it.set_state(state)
                got += list(it)
            else:
                again = iter(loader(workers))
                again.set_state(state)
                got += list(again)
            out.append([extra.tolist()] + [b.tolist() for b in got])
print(json.dumps(out))
'''


def grain_batches() -> list:
    import grain.python as grain

    namespace = {"grain": grain}
    exec(PIPELINE, namespace)
    return [np.asarray(b).tolist() for b in namespace["loader"](0)]


@pytest.mark.slow
def test_worker_count_3_checkpointing_many_times_without_a_hang():
    want = grain_batches()
    assert want == [[2, 4], [6, 8], [10, 12], [14, 16]]
    rounds = 6
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(rounds), "3"], env=env, capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout)
    assert len(runs) == rounds * 4 * 2
    for i, (extra, *batches) in enumerate(runs):
        k = (i // 2) % 4
        assert extra == want[k], (i, extra)
        assert batches == want, (i, batches)
