"""Every docstring example in the package runs, each module in a fresh empty directory.

A line may skip only where a resource is missing here (a bucket, a cluster, a GPU), and says which:
``>>> open_cache("s3://b/c")   # needs an S3 bucket  # doctest: +SKIP``.
"""

import doctest
import importlib
import pathlib
import pkgutil
import re

import pytest

import portable_loader

ROOT = pathlib.Path(portable_loader.__file__).resolve().parent
SKIP = re.compile(r"doctest:.*\+SKIP")
REASONED = re.compile(r"#\s*needs [^#]*\S\s*#\s*doctest:[^#]*\+SKIP[^#]*$")
FRAMEWORKS = ("torch", "jax", "lightning", "transformers", "datasets", "ray")


def modules() -> list[str]:
    names = ["portable_loader"]
    names += [m.name for m in pkgutil.walk_packages(portable_loader.__path__, "portable_loader.")
              if not m.name.endswith("__main__")]
    return sorted(names)


def test_every_module_is_found():
    # Counted another way: a walk that missed a folder would silently skip its examples.
    files = {p for p in ROOT.rglob("*.py") if p.name != "__main__.py"}
    assert len(modules()) == len(files) > 50
    assert "portable_loader.adapters.torch" in modules()


@pytest.fixture(scope="module")
def sample_cache(tmp_path_factory):
    """The bundled sample's cache, built once; an example's own ``precache(**sample_args(), out="cache")`` finds it."""
    from portable_loader.precache import sample_args

    return pathlib.Path(portable_loader.precache(**sample_args(), out=str(tmp_path_factory.mktemp("cache"))))


@pytest.mark.slow
@pytest.mark.parametrize("name", modules())
def test_docstring_examples_run(name, tmp_path, monkeypatch, sample_cache):
    monkeypatch.chdir(tmp_path)  # examples write caches and files where they stand
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / sample_cache.name).symlink_to(sample_cache)
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        if e.name and e.name.split(".")[0] in FRAMEWORKS:  # only where scripts/test.sh's full install was not used
            pytest.skip(f"{name} needs {e.name}, not installed here")
        raise
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(module) if t.examples and (t.filename or "").startswith(str(ROOT))]
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (output above)"


def test_a_skipped_example_says_what_it_needs():
    unreasoned = []
    for path in sorted(ROOT.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if SKIP.search(line) and not REASONED.search(line):
                unreasoned.append(f"{path.relative_to(ROOT.parent)}:{n}: {line.strip()}")
    assert not unreasoned, "+SKIP without '# needs <resource>' before it:\n" + "\n".join(unreasoned)


def test_public_functions_and_classes_have_an_example():
    # The package's front door: what `import portable_loader` exports is each shown at work.
    missing = []
    for name in portable_loader.__all__:
        obj = getattr(portable_loader, name)
        if callable(obj) and not (isinstance(obj, type) and issubclass(obj, BaseException)) and ">>>" not in (getattr(obj, "__doc__", "") or ""):
            missing.append(name)
    assert not missing, f"exported without a docstring example: {missing}"
