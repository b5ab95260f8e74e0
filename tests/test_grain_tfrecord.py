"""grain.experimental.TFRecordIterDataset against real Grain 0.2.18: the same records and the same
offset states at every step, resumes from every state, Grain's own TFRecord file read with its
checksums checked, every damaged byte refused naming the file and the record's offset, and
MaxText's import-time subclass working on its own and inside a pipeline, and both checkpoint
handlers writing Grain's file for it."""

import pathlib

import grain
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_loader import grain as pg
from portable_loader.errors import InputError, StateError
from portable_loader.grain.experimental_ops.crc32c import crc32c, crc32c_python
from portable_loader.grain.experimental_ops.tfrecord import write_tfrecord

GRAIN_FILE = pathlib.Path(grain.__file__).parent / "_src" / "python" / "testdata" / "morris_sequence_first_5.tfrecord"
RECORDS = st.lists(st.binary(max_size=40), max_size=12)


def _walk(ds):
    """(element, state after it) at every step, then the states' own continuations."""
    it = iter(ds)
    steps = [(None, it.get_state())]
    steps += [(x, it.get_state()) for x in it]
    return steps


def _rest_after(ds, state):
    it = iter(ds)
    it.set_state(state)
    return list(it)


@settings(max_examples=25, deadline=None)
@given(records=RECORDS)
def test_records_and_states_equal_grains_at_every_step_and_every_state_resumes(tmp_path_factory, records):
    path = str(tmp_path_factory.mktemp("tf") / "r.tfrecord")
    write_tfrecord(path, records)
    ours, real = pg.experimental.TFRecordIterDataset(path), grain.experimental.TFRecordIterDataset(path)
    assert _walk(ours) == _walk(real)
    assert [x for x, _ in _walk(ours)[1:]] == records
    for _, state in _walk(real):
        assert _rest_after(ours, state) == _rest_after(real, state)


def test_grains_own_file_reads_the_same_with_its_checksums_checked_and_our_writer_writes_its_bytes(tmp_path):
    ours = list(pg.experimental.TFRecordIterDataset(str(GRAIN_FILE)))
    assert ours == list(grain.experimental.TFRecordIterDataset(str(GRAIN_FILE))) == [
        b"1", b"1 1", b"2 1", b"1 2 1 1", b"1 1 1 2 2 1"]
    write_tfrecord(tmp_path / "again.tfrecord", ours)   # TensorFlow wrote Grain's file
    assert (tmp_path / "again.tfrecord").read_bytes() == GRAIN_FILE.read_bytes()
    pg.experimental.assert_equal_output_after_checkpoint(pg.experimental.TFRecordIterDataset(str(GRAIN_FILE)))


@settings(max_examples=50, deadline=None)
@given(data=st.binary(max_size=300))
def test_crc32c_in_python_equals_google_crc32c(data):
    import google_crc32c

    assert crc32c_python(data) == crc32c(data) == google_crc32c.value(data)


def test_every_damaged_byte_is_refused_naming_the_file_and_the_records_offset(tmp_path):
    records = [b"alpha", b"", b"gamma-delta"]
    path = tmp_path / "d.tfrecord"
    write_tfrecord(path, records)
    clean = path.read_bytes()
    starts, at = [], 0
    for r in records:
        starts.append(at)
        at += 16 + len(r)
    for i in range(len(clean)):
        path.write_bytes(clean[:i] + bytes([clean[i] ^ 0x10]) + clean[i + 1:])
        record = max(k for k, s in enumerate(starts) if s <= i)
        with pytest.raises(InputError) as caught:
            list(pg.experimental.TFRecordIterDataset(str(path)))
        assert str(path) in str(caught.value) and f"byte offset {starts[record]} " in str(caught.value), i
        # Real Grain checks no checksum: a flipped data byte comes out as wrong data.
        if 12 <= i - starts[record] < 12 + len(records[record]):
            assert list(grain.experimental.TFRecordIterDataset(str(path)))[record] != records[record]


def test_truncated_empty_and_missing_files_fail_as_in_grain(tmp_path):
    path = tmp_path / "t.tfrecord"
    write_tfrecord(path, [b"abc", b"defgh"])
    whole = path.read_bytes()
    for cut in (1, 12, 20, len(whole) - 1):
        path.write_bytes(whole[:cut])
        for g in (grain, pg):
            with pytest.raises(ValueError):
                list(g.experimental.TFRecordIterDataset(str(path)))
        with pytest.raises(InputError, match="byte offset"):
            list(pg.experimental.TFRecordIterDataset(str(path)))
    path.write_bytes(b"")
    assert list(pg.experimental.TFRecordIterDataset(str(path))) == []
    with pytest.raises(FileNotFoundError):
        list(pg.experimental.TFRecordIterDataset(str(tmp_path / "none.tfrecord")))


def test_an_offset_past_the_end_or_not_an_offset_is_refused(tmp_path):
    path = tmp_path / "s.tfrecord"
    write_tfrecord(path, [b"abc"])
    for state in ({"reader_offset": 10**6}, {"reader_offset": -1}, {"reader_offset": "0"}, {}):
        with pytest.raises(StateError, match="reader_offset"):
            iter(pg.experimental.TFRecordIterDataset(str(path))).set_state(state)
    it = iter(pg.experimental.TFRecordIterDataset(str(path)))
    it.set_state({"reader_offset": 5})                  # inside a record: its length checksum fails
    with pytest.raises(InputError, match="byte offset 5 .*not a record's start"):
        next(it)


def test_inside_a_pipeline_elements_equal_grains_and_the_offset_is_a_position(tmp_path):
    path = str(tmp_path / "p.tfrecord")
    write_tfrecord(path, [bytes(range(n)) for n in range(11)])

    def pipeline(g):
        return g.experimental.TFRecordIterDataset(path).map(len).filter(lambda n: n % 3 != 1).batch(2)

    want = [b.tolist() for b in pipeline(grain)]
    assert [b.tolist() for b in pipeline(pg)] == want
    it = iter(pipeline(pg))
    next(it), next(it)
    state = it.get_state()
    assert list(state["cursor"]) == ["0.tfrecord.reader_offset"]
    assert int(state["cursor"]["0.tfrecord.reader_offset"]) == sum(16 + n for n in range(6))
    again = iter(pipeline(pg))
    again.set_state(state)
    assert [b.tolist() for b in again] == want[2:]
    other = iter(pg.experimental.TFRecordIterDataset(path).map(len).batch(2))
    with pytest.raises(StateError, match="pipeline"):
        other.set_state(state)
    with iter(pg.experimental.TFRecordIterDataset(path).map(len).mp_prefetch(pg.MultiprocessingOptions(num_workers=2))
              .batch(2)) as it:
        assert [b.tolist() for b in it] == [b.tolist() for b in grain.experimental.TFRecordIterDataset(path).map(len)
                                           .batch(2)]


class _Upper(pg.experimental.TFRecordIterDataset):   # as MaxText subclasses it at import (a GCS reader there)
    def __iter__(self):
        return _UpperIterator(super().__iter__())


class _UpperIterator(pg.DatasetIterator):
    def __init__(self, inner):
        self._inner = inner

    def __next__(self):
        return next(self._inner).upper()

    def get_state(self):
        return self._inner.get_state()

    def set_state(self, state):
        self._inner.set_state(state)

    def close(self):
        self._inner.close()


class _RealUpper(grain.experimental.TFRecordIterDataset):
    def __iter__(self):
        return _RealUpperIterator(super().__iter__())


class _RealUpperIterator(grain.DatasetIterator):
    def __next__(self):
        return next(self._parent).upper()

    def get_state(self):
        return self._parent.get_state()

    def set_state(self, state):
        self._parent.set_state(state)


def test_a_subclass_with_its_own_iterator_runs_alone_and_inside_a_pipeline(tmp_path):
    path = str(tmp_path / "u.tfrecord")
    write_tfrecord(path, [b"ab", b"cd", b"ef"])
    assert list(_Upper(path)) == list(_RealUpper(path)) == [b"AB", b"CD", b"EF"]
    assert _walk(_Upper(path)) == _walk(_RealUpper(path))
    assert _Upper(path)._path == path
    assert list(_Upper(path).map(lambda b: b + b"!")) == list(_RealUpper(path).map(lambda b: b + b"!"))
    it = iter(_Upper(path).map(lambda b: b + b"!"))
    assert next(it) == b"AB!"
    state = it.get_state()
    # Its own iterator runs as written (an opaque step): its state, Grain's, nests under "steps".
    assert state["steps"] == {"0._Upper": {"reader_offset": 18}}
    again = iter(_Upper(path).map(lambda b: b + b"!"))
    again.set_state(state)
    assert list(again) == [b"CD!", b"EF!"]


def test_the_checkpoint_handlers_save_and_restore_it_as_grains(tmp_path):
    path = str(tmp_path / "c.tfrecord")
    write_tfrecord(path, [b"a", b"bb", b"ccc"])
    real_it = iter(grain.experimental.TFRecordIterDataset(path))
    next(real_it)
    for name in ("real", "ours", "grain"):
        (tmp_path / name).mkdir()
    grain.checkpoint.CheckpointHandler().save(tmp_path / "real", item=real_it)
    for name, handler in (("ours", pg.checkpoint.CheckpointHandler()), ("grain", grain.checkpoint.CheckpointHandler())):
        it = iter(pg.experimental.TFRecordIterDataset(path))
        next(it)
        handler.save(tmp_path / name, item=it)
        assert (tmp_path / name / "process_0-of-1.json").read_text() == \
            (tmp_path / "real" / "process_0-of-1.json").read_text()
        again = iter(pg.experimental.TFRecordIterDataset(path))
        handler.restore(tmp_path / name, item=again)
        assert list(again) == [b"bb", b"ccc"]
