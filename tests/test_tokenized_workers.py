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
from portable_loader.corpora import spill
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


CONFIGS = {  # (loader options, dataset options): every way the planner reads lengths, and padding, which reads
    # none but is tokenized ahead by blocks all the same
    "packed": (dict(packing=True, num_epochs=2), {}),  # the second epoch: lengths known, nothing sent ahead
    "packed-drop": (dict(packing=True, overlong="drop"), {}),
    "packed-dropped-rows": (dict(packing=True), dict(max_length=200, overlong="drop")),
    "padded": (dict(packing=False), {}),
    "padded-drop": (dict(packing=False, overlong="drop"), {}),
}


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# --- sources that wrap pl.tokenized: a map, a mixture ----------------------------------------------


def crop(r):  # changes lengths: the planner needs fn's lengths, not the tokenizer's
    return {"input_ids": r["input_ids"][:40], "loss_mask": r["loss_mask"][:40]}


def unmask_first(r):  # keeps lengths
    mask = r["loss_mask"].copy()
    mask[:1] = 0
    return dict(r, loss_mask=mask)


def gsm():
    return pl.tokenized(need(DATA / "alpaca" / "gsm8k_train.jsonl"), tokenizer=need(GPT2), format="alpaca",
                        split="train[:120]", fields={"instruction": "question", "output": "answer"})


def listed(n=50):
    return [{"input_ids": np.arange(7 + i % 90, dtype=np.int32), "loss_mask": np.ones(7 + i % 90, np.uint8)}
            for i in range(n)]


def wrapped(shape):
    """(the tokenized sources inside, the dataset the loader reads) for each shape."""
    a, b = c4(), gsm()
    return {
        "map": ([a], a.map(crop)),
        "map-keeps-lengths": ([a], a.map(unmask_first, keeps_lengths=True)),
        "mix-of-two": ([a, b], pl.mix({"c4": a, "gsm": b}, {"c4": 2, "gsm": 1})),
        "mix-with-a-list": ([a], pl.mix({"c4": a, "list": listed()}, {"c4": 1, "list": 1})),
        "map-of-a-mix-of-maps": ([a, b], pl.mix({"c4": a.map(crop), "gsm": b, "list": listed()},
                                               {"c4": 1, "gsm": 1, "list": 1}).map(unmask_first)),
    }[shape]


SHAPES = ["map", "map-keeps-lengths", "mix-of-two", "mix-with-a-list", "map-of-a-mix-of-maps"]


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_wrapped_sources_are_tokenized_by_the_workers_into_the_same_batches(shape):
    kw = dict(global_batch_size=4, seq_len=256, seed=3, packing=True, packing_window=24)

    def run(workers):
        parts, ds = wrapped(shape)
        for part in parts:
            counting(part)
        assert ds.tokenizes_ahead
        with iter(pl.DataLoader(ds, num_workers=workers, **kw)) as it:
            batches = [next(it) for _ in range(40)]  # several windows; a mixture's sources wrap around
        return batches, CountingFormatter.rows, sum(part.encoded for part in parts)

    want, rows_inline, encoded_inline = run(0)
    assert rows_inline > 0 and encoded_inline > 0  # the counts see a tokenizing main process
    got, rows_main, encoded_main = run(2)
    assert_same_batches(got, want)
    assert (rows_main, encoded_main) == (0, 0), "the main process tokenized with 2 workers"


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_a_wrapped_part_tokenized_by_one_worker_is_read_by_another_without_tokenizing(shape):
    import pickle

    parts, ds = wrapped(shape)
    _, fresh = wrapped(shape)
    picks = np.array([0, 3, 41, 150, len(ds) - 1, 77, 9])
    writer = pickle.loads(pickle.dumps(ds))  # a spawned worker: no tokenizer loaded until it must
    lengths = writer.tokenize_ahead(picks, "w0-b0")
    assert lengths.tolist() == fresh.lengths(picks).tolist()
    ds.learn(picks, lengths)  # the main process
    assert ds.unknown(picks).size == 0
    reader = pickle.loads(pickle.dumps(ds))
    got = reader[picks.tolist()]
    assert_same_batches(got, fresh[picks.tolist()])
    assert all(t._fmt is None for t in tokenized_inside(reader)), "the reader tokenized"
    ds.drop_handover()
    assert not any(os.path.exists(part._spill.dir) for part in parts)


def tokenized_inside(ds):
    from portable_loader.corpora.tokenized import Tokenized

    if isinstance(ds, Tokenized):
        return [ds]
    kids = getattr(ds, "children", None) or [getattr(ds, "parent", None)]
    return [t for k in kids if k is not None for t in tokenized_inside(k)]


@pytest.mark.slow
def test_a_map_that_changes_lengths_plans_with_the_mapped_lengths():
    ds = c4().map(crop)
    worker = pickle_copy(ds)
    recs = np.arange(20)
    ds.learn(recs, worker.tokenize_ahead(recs, "w"))
    assert ds.lengths(recs).max() <= 40 and ds.parent.unknown(recs).size == 20  # the parent learnt nothing
    assert ds.lengths(recs).tolist() == [len(r["input_ids"]) for r in c4().map(crop)[recs.tolist()]]
    ds.drop_handover()


def pickle_copy(ds):
    import pickle

    return pickle.loads(pickle.dumps(ds))


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["bare", "map", "mix"])
def test_a_bad_row_met_ahead_by_a_worker_raises_in_the_main_process_naming_it(tmp_path, shape):
    from portable_loader.errors import BadRowError

    rows = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(40)]
    rows[27]["output"] = 7
    data = jsonl(tmp_path / "d.jsonl", rows)
    inner = pl.tokenized(data, tokenizer=need(GPT2), format="alpaca")
    ds = inner
    if shape == "map":
        ds = inner.map(crop)
    elif shape == "mix":
        ds = pl.mix({"bad": inner, "list": listed(10)}, {"bad": 3, "list": 1})
    with pytest.raises(BadRowError) as e:
        with iter(pl.DataLoader(ds, global_batch_size=2, seq_len=64, packing=True, packing_window=8, num_workers=2)) as it:
            for _ in range(100):
                next(it)
    assert (e.value.path, e.value.where, e.value.field) == (str(data), "line 28", "output")
    assert not os.path.exists(inner._spill.dir)
