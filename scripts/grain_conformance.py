"""Grain 0.2.18's own unit tests, run on ``portable_loader.grain`` and on real Grain.

    python scripts/grain_conformance.py                  # every file below, both libraries (about 10 minutes on 2 cores)
    python scripts/grain_conformance.py --files map_test filter_test --jobs 2
    python scripts/grain_conformance.py --list           # also print every test left out, and every failure

The test files are read from the installed ``grain`` wheel (nothing of Grain is copied here). For
``ours``, a ``sys.meta_path`` finder (``install_shim``) makes ``grain`` resolve to
``portable_loader.grain`` and each of Grain's internal modules (``grain._src...``) to a module that
holds only the names Grain itself re-exports publicly (read from Grain's public modules'
``from grain._src... import X as Y`` lines): ``grain._src.python.dataset.dataset.MapDataset`` becomes
``portable_loader.grain.MapDataset``. Any other name of an internal module is private: the finder
hands out a stand-in that raises :class:`PrivateName` when used.

A test is left out when it uses a private name: found in its source (its body, decorators, the
helpers and ``setUp`` it reaches, module-level helpers it names) or, failing that, by a
``PrivateName`` raised while it ran on ours. The score is the share of the tests that pass on real
Grain and are not left out that pass on ours; ``DELIBERATE`` lists the tests that assert what our
guarantees change on purpose (docs/grain.md), reported apart.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import functools
import importlib
import importlib.abc
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
import types
import unittest
from pathlib import Path

FILES = ["dataset/dataset_test.py"] + [f"dataset/transformations/{n}_test.py" for n in (
    "map", "filter", "batch", "shuffle", "slice", "repeat", "mix", "source", "flatmap", "prefetch", "packing",
    "packing_concat_then_split", "zip", "limit", "rebatch", "cache", "interleave")] + [
    "dataset/sources/tfrecord_dataset_test.py", "dataset/sources/parquet_dataset_test.py",
    "dataset/elastic_iterator_test.py", "samplers_test.py", "data_loader_test.py"]
PUBLIC_MODULES = ["grain", "grain.experimental", "grain.transforms", "grain.samplers", "grain.sharding", "grain.sources",
                  "grain.checkpoint", "grain.constants", "grain.multiprocessing", "grain.python"]
_OTHER_MIXTURE = "a state of another mixture (other weights or datasets) is refused with a StateError"
_WORKERS = "the element stream does not depend on the worker count (Grain's interleaves per-worker slices)"
_SHARDS = ("a shard reads every K-th position of one global stream, so a state resumes on another number of hosts "
           "(Grain's contiguous ranges tie the stream to the shard count)")
#: Tests whose assertion is what portable_loader changes on purpose: test id -> why (docs/grain.md).
DELIBERATE: dict[str, str] = {
    "MixedIterDatasetTest.test_checkpoint_recovery_with_different_mixture": _OTHER_MIXTURE,
    "MixedIterDatasetTest.test_checkpoint_recovery_with_fewer_datasets": _OTHER_MIXTURE,
    "MixedIterDatasetTest.test_checkpoint_recovery_with_more_datasets": _OTHER_MIXTURE,
    # Grain's expected batches with 2 and 3 workers are its per-worker interleaving of a filtered stream.
    "DataLoaderTest_*.test_data_loader_checkpointing_same_object[456]": _WORKERS,
    "DataLoaderTest_*.test_data_loader_checkpointing_object_reconstruction[45]": _WORKERS,
    "DatasetTest.test_prefetch_with_slice_source": _WORKERS,
    # Grain gives shard k a contiguous range (shuffled in Grain's order when shuffling); here shard k
    # reads every K-th position of the one global stream (itself in Grain's order when shuffling).
    "IndexSamplerTest.test_sharding_no_shuffle_*": _SHARDS,
    "IndexSamplerTest.test_shuffle_and_sharding_*": _SHARDS,
    # The maps right after to_iter_dataset run over chunks of positions read ahead (1, 2, 4, ... 64):
    # the elements are Grain's, but a map's own call counter also counts those read past a limit.
    "InMemoryCacheIterDatasetTest.test_in_memory_with_limit_and_repeat": "a map right after to_iter_dataset runs "
                                                                          "over chunks read ahead, so its call count "
                                                                          "includes elements past a limit",
    # Grain's ElasticIterator refuses a filter; ours reads filtered datasets by position (docs/grain.md).
    "ElasticIteratorTest.test_filter_raises_error": "ElasticIterator takes filters here (a position state needs no "
                                                    "per-shard record), where Grain raises a ValueError",
}
IMPL_ENV = "GRAIN_CONFORMANCE_IMPL"
#: Modules of the wheel that hold tests for other files to run (loaded from the wheel as test files are).
TEST_HELPERS = ("testing_util",)


@functools.lru_cache(maxsize=1)
def wheel() -> Path:
    """The installed Grain package's folder, found without importing it (and before the shim hides it)."""
    return Path(importlib.util.find_spec("grain").submodule_search_locations[0])


def public_map(root: Path) -> dict[str, dict[str, tuple[str, str]]]:
    """Internal module -> {name: (public module, public name)}, from the imports of Grain's public modules.

    The top-level modules come before ``grain.python``, so a name public in both maps to the top level.
    """
    out: dict[str, dict[str, tuple[str, str]]] = {}
    for public in PUBLIC_MODULES:
        rel = Path(*public.split(".")[1:])
        path = root / rel / "__init__.py" if (root / rel).is_dir() else root / rel.with_suffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("grain._src"):
                for a in node.names:
                    out.setdefault(node.module, {}).setdefault(a.name, (public, a.asname or a.name))
    return out


_importing = False


class PrivateName(AttributeError):
    """A test used a name that Grain does not export publicly."""


class _Private:
    """Stands for a private name of an internal module: any use raises ``PrivateName``."""

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)

    def _refuse(self, *args, **kwargs):
        if _importing:  # a test's parameters built at import: refused when the test uses them
            return _Private(f"{self._name}(...)")
        raise PrivateName(f"{self._name} is not a public Grain name")

    __call__ = __getitem__ = __iter__ = _refuse

    def __mro_entries__(self, bases):
        # A module-level subclass must not stop the file's import: its instances raise instead.
        return (type(self._name.rsplit(".", 1)[-1], (), {"__init__": self._refuse}),)

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        self._refuse()


class _Shim(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``grain`` -> ``portable_loader.grain``; ``grain._src.X`` -> X's public names; ``*_test`` files from the wheel."""

    def __init__(self, root: Path, real: dict):
        self.root, self.names, self.real = root, public_map(root), real

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "grain" and not fullname.startswith("grain."):
            return None
        rel = self.root.joinpath(*fullname.split(".")[1:])
        if fullname.endswith(("_test",) + TEST_HELPERS) and rel.with_suffix(".py").exists():
            return importlib.util.spec_from_file_location(fullname, rel.with_suffix(".py"))
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec):
        if spec.name in PUBLIC_MODULES:
            return importlib.import_module("portable_loader.grain" + spec.name[len("grain"):])
        module = types.ModuleType(spec.name)
        mapped = self.names.get(spec.name, {})

        def attr(name):
            if name in mapped:
                public, new = mapped[name]
                try:
                    return getattr(importlib.import_module("portable_loader.grain" + public[len("grain"):]), new)
                except ImportError:  # a name portable_loader.grain takes from real Grain (its ArrayRecordDataSource)
                    return getattr(self.real[public], new)
            if name.startswith("__"):
                raise AttributeError(name)
            sub = self.root.joinpath(*spec.name.split(".")[1:], name)
            if sub.is_dir() or sub.with_suffix(".py").exists():
                return importlib.import_module(f"{spec.name}.{name}")
            return _Private(f"{spec.name}.{name}")

        module.__getattr__ = attr
        return module

    def exec_module(self, module):
        if not module.__name__.startswith("portable_loader"):  # ours keep their own __path__
            module.__path__ = []


def install_shim() -> None:
    """Make ``import grain...`` resolve to ``portable_loader.grain`` (see the module docstring).

    Real Grain's public modules are imported first and kept, for the few names portable_loader.grain
    takes from real Grain (``sources.ArrayRecordDataSource``, ``config``, ...).
    """
    real = {name: importlib.import_module(name) for name in PUBLIC_MODULES}
    for name in [n for n in sys.modules if n == "grain" or n.startswith("grain.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _Shim(wheel(), real))


if os.environ.get(IMPL_ENV) == "ours":  # worker processes started by spawn import this file again
    install_shim()


# -- which tests use private names (from their source) -------------------------------------------------

def _aliases(tree: ast.Module, names, root: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Names bound to internal modules (alias -> module) and to private names of them (name -> dotted)."""
    modules, private = {}, {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("grain._src") and a.asname:
                    modules[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("grain._src", "grain.proto")):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                rel = root.joinpath(*full.split(".")[1:])
                if rel.with_suffix(".py").exists() or rel.is_dir():
                    modules[a.asname or a.name] = full
                elif a.name not in names.get(node.module, {}):
                    private[a.asname or a.name] = full
    return modules, private


def _uses(node: ast.AST, modules, private, names) -> set[str]:
    """The private names used in ``node``'s source."""
    found = set()
    attr_values = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in modules:
            attr_values.add(id(n.value))
            mod = modules[n.value.id]
            if n.attr not in names.get(mod, {}):
                found.add(f"{mod}.{n.attr}")
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("grain._src"):
            found.add(n.value)
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            if n.id in private:
                found.add(private[n.id])
            elif n.id in modules and id(n) not in attr_values:
                found.add(f"{modules[n.id]} (the module itself)")
    return found


class _Source:
    """One parsed file of the wheel: its internal-module aliases, private imports and top-level definitions."""

    def __init__(self, path: Path, names, root: Path):
        self.tree = ast.parse(path.read_text())
        self.names = names
        self.modules, self.private = _aliases(self.tree, names, root)
        body = self.tree.body
        self.top = {n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        self.top.update({t.id: n for n in body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)})

    def reach(self, node, members, seen) -> set[str]:
        """Private names used by ``node`` and by what it calls: module-level helpers, ``self.`` methods."""
        found = _uses(node, self.modules, self.private, self.names)
        for n in ast.walk(node):
            if isinstance(n, ast.Name):
                target = self.top.get(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                target = members.get(n.attr)
            else:
                continue
            if target is not None and id(target) not in seen:
                seen.add(id(target))
                src, node_ = target if isinstance(target, tuple) else (self, target)
                found |= src.reach(node_, members, seen)
        return found


def private_tests(path: Path, names, root: Path) -> dict[str, set[str]]:
    """``Class.method`` -> the private names it reaches, for every test method of one file.

    Base classes defined in the file or in a test-helper module of the wheel it imports
    (``testing_util``) lend their methods, as unittest runs them.
    """
    main = _Source(path, names, root)
    sources = {None: main}
    for alias, module in main.modules.items():
        if module.endswith(TEST_HELPERS):
            sources[alias] = _Source(root.joinpath(*module.split(".")[1:]).with_suffix(".py"), names, root)

    def members_of(src: _Source, cls: ast.ClassDef) -> dict:
        out = {}
        for base in reversed(cls.bases):
            if isinstance(base, ast.Name) and isinstance(src.top.get(base.id), ast.ClassDef):
                out.update(members_of(src, src.top[base.id]))
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id in sources:
                other = sources[base.value.id]
                if isinstance(other.top.get(base.attr), ast.ClassDef):
                    out.update(members_of(other, other.top[base.attr]))
        out.update({m.name: (src, m) for m in cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))})
        return out

    out = {}
    for cls in [n for n in main.tree.body if isinstance(n, ast.ClassDef)]:
        members = members_of(main, cls)
        fixtures = ("setUp", "setUpClass", "tearDown", "tearDownClass")
        shared = set().union(*(members[m][0].reach(members[m][1], members, set()) for m in fixtures if m in members))
        for name, (src, m) in members.items():
            if name.startswith("test"):
                out[f"{cls.name}.{name}"] = shared | src.reach(m, members, {id(m)})
    return out


def method_of(test: str, methods: dict) -> str | None:
    """The test method a generated test id (``Class.test_x0``, ``Class.test_x_named``) comes from: the longest prefix."""
    keys = [k for k in methods if test == k or test.startswith(k)]
    return max(keys, key=len) if keys else None


# -- running one file in this process ------------------------------------------------------------------

class _Record(unittest.TestResult):
    """Writes one JSON line per finished test, so a file that hangs still reports what ran."""

    def __init__(self, sink):
        super().__init__()
        self.sink = sink

    def _put(self, test, outcome, err=None):
        line = {"id": f"{type(test).__name__}.{getattr(test, '_testMethodName', test.id())}", "outcome": outcome}
        if err is not None:
            line["error"] = "".join(traceback.format_exception_only(err[0], err[1])).strip()[-400:]
            line["private"] = issubclass(err[0], PrivateName) or "is not a public Grain name" in line["error"]
        self.sink.write(json.dumps(line) + "\n")
        self.sink.flush()

    def addSuccess(self, test):
        self._put(test, "pass")

    def addFailure(self, test, err):
        self._put(test, "fail", err)

    def addError(self, test, err):
        self._put(test, "error", err)

    def addSkip(self, test, reason):
        self._put(test, "skip")

    def addExpectedFailure(self, test, err):
        self._put(test, "pass")

    def addUnexpectedSuccess(self, test):
        self._put(test, "fail")


def module_name(rel: str) -> str:
    return "grain._src.python." + rel[:-3].replace("/", ".")


def run_file(rel: str, out: Path) -> None:
    """Run one test file of the wheel here, writing its outcomes to ``out`` (JSON lines)."""
    from absl import flags

    flags.FLAGS(["grain_conformance", f"--test_srcdir={wheel() / '_src' / 'python'}"], known_only=True)
    with out.open("w") as sink:
        global _importing
        try:
            _importing = True
            module = importlib.import_module(module_name(rel))
            _importing = False
        except BaseException as e:  # the whole file fails: every one of its tests counts as failed
            sink.write(json.dumps({"id": "<import>", "outcome": "error", "error": repr(e)[-400:],
                                   "private": isinstance(e, PrivateName)}) + "\n")
            return
        suite = unittest.defaultTestLoader.loadTestsFromModule(module)
        suite.run(_Record(sink))


# -- the report --------------------------------------------------------------------------------------------

def _out_name(rel: str, impl: str) -> str:
    return f"{impl}-{rel.replace('/', '-')}.jsonl"


def _outcomes(path: Path) -> dict[str, dict]:
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return {x["id"]: x for x in lines}


def run_all(runs: list[tuple[str, str]], outdir: Path, jobs: int, timeout: float, together: bool = False) -> dict:
    """Each (file, "real" or "ours") in its own process, ``jobs`` at a time; -> test id -> outcome line.

    ``together``: the files of one library in one process instead (a process's start, Grain and JAX
    imported, is most of a small file's time), each given ``timeout``; a file that leaves state behind
    can then change the outcomes of the files after it.
    """
    groups = [([rel], impl) for rel, impl in runs]
    if together:
        groups = [([rel for rel, i in runs if i == impl], impl) for impl in dict.fromkeys(i for _, i in runs)]
    pending, running, results = groups, [], {}
    while pending or running:
        while pending and len(running) < jobs:
            rels, impl = pending.pop(0)
            env = dict(os.environ, **{IMPL_ENV: impl})
            proc = subprocess.Popen([sys.executable, __file__, "--run-files", *rels, "--outdir", str(outdir)], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            running.append(((rels, impl), proc, time.monotonic()))
        time.sleep(0.2)
        for item in list(running):
            (rels, impl), proc, start = item
            late = time.monotonic() - start > timeout * len(rels)
            if proc.poll() is None and not late:
                continue
            if late:
                proc.kill()
            proc.wait()
            running.remove(item)
            for rel in rels:
                results[(rel, impl)] = _outcomes(outdir / _out_name(rel, impl))
                if late:
                    results[(rel, impl)]["<timeout>"] = {"id": "<timeout>", "outcome": "error",
                                                         "error": f"killed after {timeout * len(rels)} s"}
    return results


def score(files, real, ours, root: Path) -> dict:
    """Counts and lists per file: compared, passed, left out (private), deliberate, failed."""
    names = public_map(root)
    report = {"files": {}, "left_out": {}, "deliberate": {}, "failed": {}, "passed": {}}
    for rel in files:
        static = private_tests(root / "_src" / "python" / rel, names, root)
        base = {t: x for t, x in real.get(rel, {}).items() if x["outcome"] == "pass"}
        got = ours.get(rel, {})
        row = {"real_pass": len(base), "compared": 0, "pass": 0, "left_out": 0, "deliberate": 0}
        for test, x in base.items():
            key = method_of(test, static)
            used = static[key] if key else None
            y = got.get(test, {"outcome": "error", "error": got.get("<import>", got.get("<timeout>", {})).get(
                "error", "did not run")})
            if used or y.get("private"):
                row["left_out"] += 1
                report["left_out"][f"{rel}::{test}"] = sorted(used) if used else [y["error"]]
                continue
            why = next((w for k, w in DELIBERATE.items() if k == key or fnmatch.fnmatchcase(test, k)), None)
            if why:
                row["deliberate"] += 1
                report["deliberate"][f"{rel}::{test}"] = why
                continue
            row["compared"] += 1
            if y["outcome"] == "pass":
                row["pass"] += 1
                report["passed"].setdefault(rel, []).append(test)
            else:
                report["failed"][f"{rel}::{test}"] = y.get("error", y["outcome"])
        report["files"][rel] = row
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", nargs="*", help="stems or paths of the files to run (default: all)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900, help="seconds per file before it is killed")
    p.add_argument("--outdir", default="/tmp/grain_conformance")
    p.add_argument("--keep", nargs="*", default=[], choices=["real", "ours"],
                   help="reuse these outcomes from --outdir where there (real Grain's do not change)")
    p.add_argument("--list", action="store_true", help="print every test left out and every failure")
    p.add_argument("--json", help="write the whole report here")
    p.add_argument("--run-files", nargs="+", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.run_files:  # (a process of run_all: the library is the one IMPL_ENV names)
        for rel in a.run_files:
            run_file(rel, Path(a.outdir) / _out_name(rel, os.environ.get(IMPL_ENV, "real")))
        return
    files = [f for f in FILES if not a.files or any(s in (f, Path(f).stem) for s in a.files)]
    outdir = Path(a.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    runs = [(f, i) for f in files for i in ("real", "ours")]
    kept = {r: _outcomes(outdir / _out_name(*r)) for r in runs if r[1] in a.keep and (outdir / _out_name(*r)).exists()}
    results = {**run_all([r for r in runs if r not in kept], outdir, a.jobs, a.timeout), **kept}
    report = score(files, {f: results[(f, "real")] for f in files}, {f: results[(f, "ours")] for f in files}, wheel())
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    if a.list:
        for key in ("left_out", "deliberate", "failed"):
            print(f"\n{key}:")
            for test, why in sorted(report[key].items()):
                print(f"  {test}: {why}")
    total = {k: sum(r[k] for r in report["files"].values()) for k in ("real_pass", "compared", "pass", "left_out",
                                                                       "deliberate")}
    print(f"\n{'file':48} {'real':>6} {'left':>5} {'delib':>5} {'cmp':>6} {'pass':>6} {'rate':>7}")
    for rel, r in list(report["files"].items()) + [("total", total)]:
        rate = f"{100 * r['pass'] / r['compared']:.1f}%" if r["compared"] else "-"
        print(f"{rel:48} {r['real_pass']:6} {r['left_out']:5} {r['deliberate']:5} {r['compared']:6} {r['pass']:6} "
              f"{rate:>7}")


if __name__ == "__main__":
    main()
