"""grain.experimental.PackAndBatchOperation against real Grain 0.2.18: the same packed batches,
segment ids and positions over random lengths, features and row limits, called over records as
Grain's legacy operation and inside grain.DataLoader at 0 and 2 workers, whose state resumes."""

import logging

import grain
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portable_loader import grain as pg
from portable_loader.errors import StateError

logging.getLogger("absl").setLevel(logging.CRITICAL)  # Grain logs its deprecation as an error


def _elements(lengths):
    return [{"a": np.arange(1, n + 1, dtype=np.int32), "b": np.full((m, 2), n, np.float32)} for n, m in lengths]


def _plain(batch):
    data, seg, pos = batch
    return [{k: v.tolist() for k, v in part.items()} for part in (data, seg, pos)]


LENGTHS = st.lists(st.tuples(st.integers(1, 6), st.integers(0, 4)), max_size=14)


@settings(max_examples=25, deadline=None)
@given(lengths=LENGTHS, batch=st.integers(1, 3), per_row=st.sampled_from([None, 1, 2]))
def test_called_over_records_it_gives_grains_batches(lengths, batch, per_row):
    def run(g):
        records = [g.Record(g.RecordMetadata(index=i, record_key=i), e) for i, e in enumerate(_elements(lengths))]
        op = g.experimental.PackAndBatchOperation(length_struct={"a": 6, "b": 4}, batch_size=batch,
                                                  max_sequences_per_bin=per_row)
        return [(r.metadata.index, r.metadata.record_key, _plain(r.data)) for r in op(iter(records))]

    if not lengths:  # Grain's generator fails on no input (its open batch is None); ours yields nothing
        assert run(pg) == []
        return
    assert run(pg) == run(grain)


def _loader(g, lengths, batch, workers):
    return g.DataLoader(data_source=_elements(lengths), sampler=g.samplers.SequentialSampler(len(lengths)),
                        operations=[_Twice(g),
                                    g.experimental.PackAndBatchOperation(length_struct={"a": 6, "b": 4},
                                                                         batch_size=batch)],
                        worker_count=workers)


def _Twice(g):  # noqa: N802 (a Map transform of either library)
    class Twice(g.transforms.Map):
        def map(self, e):
            return {"a": e["a"] * 2, "b": e["b"]}

    return Twice()


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_in_a_data_loader_batches_equal_grains_and_every_state_resumes_at_another_worker_count(workers):
    lengths = [(n % 5 + 1, n % 3) for n in range(23)]
    want = [_plain(b) for b in _loader(grain, lengths, 2, 0)]
    it = iter(_loader(pg, lengths, 2, workers))
    states, got = [it.get_state()], []
    for b in it:
        got.append(_plain(b))
        states.append(it.get_state())
    it.close()
    assert got == want
    for k in (0, 1, len(states) // 2, len(states) - 1):
        again = iter(_loader(pg, lengths, 2, 2 - workers))
        again.set_state(states[k])
        assert [_plain(b) for b in again] == want[k:]
        again.close()
    with pytest.raises(StateError):
        iter(_loader(pg, lengths, 3, 0)).set_state(states[1])     # another batch size packs other rows


def test_a_too_long_element_is_grains_error():
    for g in (grain, pg):
        op = g.experimental.PackAndBatchOperation(length_struct={"a": 2, "b": 4}, batch_size=1)
        with pytest.raises(ValueError, match="truncated to max length"):
            list(op(iter([g.Record(g.RecordMetadata(index=0), _elements([(3, 1)])[0])])))
