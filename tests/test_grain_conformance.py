"""A fast subset of ``scripts/grain_conformance.py``: Grain 0.2.18's own test files, run on real Grain and
on ``portable_loader.grain`` through the import shim, the files of each library in one process (about
30 s on 2 cores; the script's own runs give each file a process).

The whole run (every file, both libraries) is ``python scripts/grain_conformance.py`` (docs/grain.md).
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

pytest.importorskip("grain")
pytest.importorskip("parameterized")

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "grain_conformance.py"
FILES = [f"dataset/transformations/{n}_test.py" for n in ("map", "flatmap", "mix", "shuffle")] + ["samplers_test.py"]


def _script():
    spec = importlib.util.spec_from_file_location("grain_conformance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    gc = _script()
    results = gc.run_all([(f, impl) for f in FILES for impl in ("real", "ours")], tmp_path_factory.mktemp("gc"),
                         jobs=2, timeout=300, together=True)
    return gc.score(FILES, {f: results[(f, "real")] for f in FILES}, {f: results[(f, "ours")] for f in FILES},
                    gc.wheel())


@pytest.mark.slow
def test_grains_own_tests_pass_on_ours_where_they_use_public_names(report):
    rows = report["files"]
    assert all(r["real_pass"] > 0 for r in rows.values()), rows  # real Grain ran them all
    # Files whose public-name tests all pass (deliberate differences aside): none may regress.
    for name in [f"dataset/transformations/{n}_test.py" for n in ("map", "flatmap", "mix", "shuffle")] + ["samplers_test.py"]:
        row = rows[name]
        assert row["compared"] > 0 and row["pass"] == row["compared"], (name, row, report["failed"])
    passed = {t for f in FILES for t in report["passed"].get(f, ())}
    for test in ("WindowShuffleMapDatasetTest.test_getitem", "WindowShuffleMapDatasetTest.test_getitems_multi_epochs",
                 "IndexSamplerTest.test_shuffle_no_sharding", "IndexSamplerTest.test_determinism",
                 "FlatMapMapDatasetTest.test_with_filter", "MapMapDatasetTest.test_map_checkpointing"):
        assert test in passed, test


@pytest.mark.slow
def test_tests_that_reach_private_names_are_left_out_with_the_names(report):
    left = report["left_out"]
    assert "grain._src.python.dataset.transformations.map.MapMapDataset" in \
        left["dataset/transformations/map_test.py::MapMapDatasetTest.test_map_size"]
    assert "dataset/transformations/flatmap_test.py::FlatMapMapDatasetTest.test_with_filter" not in left
    # setUp/tearDown count: batch_test's classes reload Grain's internal modules after each test.
    gc = _script()
    root = gc.wheel()
    used = gc.private_tests(root / "_src/python/dataset/transformations/batch_test.py", gc.public_map(root), root)
    assert any("tree_lib" in n for n in used["BatchMapDatasetTest.test_epoch_boundaries"])


@pytest.mark.slow
def test_deliberate_differences_are_reported_apart(report):
    # Position sharding (docs/grain.md): every sharded IndexSampler test, shuffled or not.
    sharding = {f"samplers_test.py::IndexSamplerTest.test_{kind}_{drop}_{epochs}"
                for kind in ("sharding_no_shuffle", "shuffle_and_sharding")
                for drop in ("drop_remainder", "no_drop_remainder") for epochs in ("single_epoch", "multi_epoch")}
    assert set(report["deliberate"]) == sharding | {
        f"dataset/transformations/mix_test.py::MixedIterDatasetTest.test_checkpoint_recovery_with_{w}"
        for w in ("different_mixture", "fewer_datasets", "more_datasets")}
