"""Tokenize on read with worker processes: the workers tokenize (packing windows planned from their
answers), the main process does not, the batches are those of num_workers=0 for any worker count,
and no hand-over file outlives a close, an exception or a kill -9."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import portable_loader as pl
from portable_loader.dataset import spill
from portable_loader.tokenize import Formatter
from conftest import DATA, GPT2, ROOT, need
from test_many_files import jsonl
from test_tokenized import assert_same_batches


class CountingFormatter(Formatter):
    """The real formatter, counting the rows it encodes in this process."""

    rows = 0

    def encode(self, rows, *args, **kwargs):
        CountingFormatter.rows += len(rows)
        return super().encode(rows, *args, **kwargs)


def counting(ds):
    """``ds`` whose formatter (loaded now, inherited by forked workers) counts its rows."""
    ds._formatter().__class__ = CountingFormatter
    CountingFormatter.rows = 0
    return ds


def c4(**options):
    return pl.tokenized(need(DATA / "text" / "llamafactory_c4_demo.jsonl"), tokenizer=need(GPT2), format="text",
                        split="train[:160]", **options)


CONFIGS = {  # (loader options, dataset options): every way the planner reads lengths, and one it does not
    "packed": (dict(packing=True, num_epochs=2), {}),  # the second epoch: lengths known, nothing sent ahead
    "packed-drop": (dict(packing=True, overlong="drop"), {}),
    "packed-dropped-rows": (dict(packing=True), dict(max_length=200, overlong="drop")),
    "padded": (dict(packing=False), {}),
    "padded-drop": (dict(packing=False, overlong="drop"), {}),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_workers_tokenize_and_the_batches_do_not_depend_on_their_number(config):
    options, ds_options = CONFIGS[config]
    kw = dict(dict(global_batch_size=4, seq_len=256, seed=5, packing_window=24, num_epochs=1), **options)

    def epochs(workers):
        ds = counting(c4(**ds_options))
        with iter(pl.DataLoader(ds, num_workers=workers, **kw)) as it:
            batches = list(it)
        return batches, CountingFormatter.rows, ds.encoded

    want, rows_inline, encoded_inline = epochs(0)
    assert rows_inline >= 160 and encoded_inline >= 160  # the counts see a tokenizing main process
    for workers in (1, 3):
        got, rows_main, encoded_main = epochs(workers)
        assert_same_batches(got, want)
        assert (rows_main, encoded_main) == (0, 0), f"the main process tokenized with {workers} workers"


def test_resume_with_workers_tokenizes_one_window_in_the_main_process():
    kw = dict(global_batch_size=4, seq_len=256, seed=1, packing=True, packing_window=24, num_workers=2)
    with iter(pl.DataLoader(c4(), **kw)) as it:
        want = [next(it) for _ in range(12)]
        state = it.get_state()
        want += [next(it) for _ in range(6)]
    ds = counting(c4())
    with iter(pl.DataLoader(ds, **kw)) as it:
        it.set_state(state)  # checking a packed state plans its window here
        checked = CountingFormatter.rows
        assert_same_batches([next(it) for _ in range(6)], want[12:])
    assert 0 < checked <= 24 and CountingFormatter.rows == checked


def test_a_bad_row_met_ahead_by_a_worker_raises_in_the_main_process_naming_it(tmp_path):
    from portable_loader.errors import BadRowError

    rows = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(40)]
    rows[27]["output"] = 7
    data = jsonl(tmp_path / "d.jsonl", rows)
    ds = pl.tokenized(data, tokenizer=need(GPT2), format="alpaca")
    with pytest.raises(BadRowError) as e:
        with iter(pl.DataLoader(ds, global_batch_size=2, seq_len=64, packing=True, packing_window=8, num_workers=2)) as it:
            for _ in range(100):
                next(it)
    assert (e.value.path, e.value.where, e.value.field) == (str(data), "line 28", "output")
    assert not os.path.exists(ds._spill.dir)


def test_close_mid_epoch_removes_the_hand_over():
    ds = c4()
    it = iter(pl.DataLoader(ds, global_batch_size=4, seq_len=256, packing=True, packing_window=24, num_workers=2))
    [next(it) for _ in range(3)]
    assert os.listdir(ds._spill.dir)  # the workers' windows are there while the loader runs
    it.close()
    assert not os.path.exists(ds._spill.dir)


JOB = textwrap.dedent("""
    import sys, portable_loader as pl
    ds = pl.tokenized(sys.argv[1], tokenizer=sys.argv[2], format="text")
    it = iter(pl.DataLoader(ds, global_batch_size=4, seq_len=256, packing=True, packing_window=24, num_workers=2))
    next(it)
    print(ds._spill.dir, flush=True)
    if sys.argv[3] == "raise":
        raise SystemExit("ends without closing its loader")
    next(it)
    sys.stdin.readline()  # killed meanwhile
""")


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_no_hand_over_outlives_an_exit_or_a_kill(how):
    data, tokenizer = need(DATA / "text" / "llamafactory_c4_demo.jsonl"), need(GPT2)
    job = subprocess.Popen([sys.executable, "-c", JOB, data, tokenizer, how], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    folder = job.stdout.readline().strip()
    assert folder.startswith(spill._base()), job.communicate(timeout=60)
    if how == "kill":
        assert os.listdir(folder)
        job.send_signal(signal.SIGKILL)
    job.communicate(timeout=60)
    if how == "kill":  # nothing ran in the job: the next process that makes a spill removes it
        deadline = time.monotonic() + 30
        while folder not in spill.sweep_stale() and os.path.exists(folder) and time.monotonic() < deadline:
            time.sleep(0.2)  # its workers, ended by the kernel, may still be writing
    assert not os.path.exists(folder)


def test_spill_files_are_immutable_and_a_reader_forgets_removed_ones(tmp_path):
    owner = spill.Spill()
    rec = {i: (np.arange(i, dtype=np.int32), np.ones(i, np.uint8)) for i in range(1, 6)}
    owner.write({i: rec[i] for i in (1, 2)}, "a")
    reader = spill.Spill(owner.dir)
    assert sorted(reader.read([1, 2, 3])) == [1, 2]
    owner.write({i: rec[i] for i in (3, 4)}, "b")
    owner.drop("a")
    got = reader.read([3, 5])
    assert sorted(got) == [3] and np.array_equal(got[3][0], rec[3][0])
    assert list(reader._files) == ["b"]
    owner.clear()
    assert not os.path.exists(owner.dir) and reader.read([6]) == {} and reader._files == {}
    owner.write({5: rec[5]}, "c")  # a later loader over the same dataset
    assert np.array_equal(reader.read([5])[5][1], rec[5][1])
    owner.close()
    assert not os.path.exists(owner.dir)


def test_a_gz_input_is_decompressed_once_into_a_private_file_removed_with_its_table(tmp_path):
    import gc
    import gzip

    from portable_loader.io import open_inputs

    rows = [{"text": f"row {i} " + "z" * (i % 7)} for i in range(300)] + [{"text": ""}]
    plain, packed = jsonl(tmp_path / "d.jsonl", rows), jsonl(tmp_path / "d.jsonl.gz", rows)
    want, table = open_inputs(plain), open_inputs(packed)
    picks = [299, 3, 150, 4, 151]
    assert table.get(picks) == want.get(picks)
    copy = table._plain
    assert os.path.getsize(copy) == len(gzip.decompress(packed.read_bytes()))
    packed.unlink()  # later reads touch the copy only
    assert table.get([7, 298]) == want.get([7, 298])
    del table
    gc.collect()
    assert not os.path.exists(copy)


def test_from_the_second_epoch_nothing_is_sent_ahead(monkeypatch):
    from portable_loader.engine import ahead, processes

    sent = []

    class Recording(ahead.Ahead):  # the real one, recording the blocks it sends
        def __init__(self, *args, send, **kwargs):
            super().__init__(*args, send=lambda j, task: (sent.append(task[0][1]), send(j, task)), **kwargs)

    monkeypatch.setattr(processes, "Ahead", Recording)
    kw = dict(global_batch_size=4, seq_len=256, packing=True, packing_window=20, num_workers=2, num_epochs=2)
    with iter(pl.DataLoader(c4(), **kw)) as it:
        for _ in it:  # blocks in flight stay few: none is kept that has nothing to answer
            assert it._engine is None or len(it._engine._ahead._pending) <= ahead.AHEAD_BLOCKS + 1
    # 160 records: 8 windows an epoch. Every window of the first is sent; of the second, only the
    # first AHEAD_BLOCKS may be (sent while the first epoch's last lengths were still unknown).
    assert set(range(8)) <= set(sent) and max(sent) <= 7 + ahead.AHEAD_BLOCKS
