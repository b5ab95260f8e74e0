"""The README's examples run as written, and the README and docs/ point only at files in the repository.

Each ```python block of README.md runs on its own in a fresh interpreter and an empty directory, so
an example that needs a name, a file or a step that is not on the page fails here before a reader
copies it. The README's shell commands are each either run here or a script of this repository.
"""

import ast
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
PYTHON = "\x60\x60\x60python"  # the fence, spelled so that this file is not counted as one


def blocks(path: pathlib.Path, lang: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(path.read_text()) if m.group(1) == lang]


def commands(block: str) -> list[str]:
    """Shell lines of a block: continuations joined, comments and blank lines dropped."""
    joined = block.replace("\\\n", " ")
    return [" ".join(line.split("#")[0].split()) for line in joined.splitlines() if line.split("#")[0].strip()]


def top_level_modules(code: str) -> set[str]:
    return set(re.findall(r"^(?:import|from)\s+(\w+)", code, re.M))


EXAMPLES = blocks(README, "python")


def test_every_python_fence_is_found():
    # The fences counted another way: a parser that missed one would silently skip its example.
    assert len(EXAMPLES) == README.read_text().count(PYTHON) >= 5


@pytest.fixture(scope="module")
def sample_cache(tmp_path_factory):
    """The bundled sample's cache, built once: the examples' own precache calls then find it (a hit)."""
    import portable_loader as pl
    from portable_loader.precache import sample_args

    return pathlib.Path(pl.precache(**sample_args(), out=str(tmp_path_factory.mktemp("cache"))))


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example{i + 1}" for i in range(len(EXAMPLES))])
def test_readme_example_runs_as_written(code, tmp_path, sample_cache):
    missing = sorted(m for m in top_level_modules(code) if importlib.util.find_spec(m) is None)
    if missing:  # only where scripts/test.sh's full install was not used
        pytest.skip(f"example needs {missing}, not installed here")
    # Building the cache is tested below (the README's precache command) and in test_precache.py;
    # here the examples' out="cache" already holds it, so each example pays only for its own work.
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / sample_cache.name).symlink_to(sample_cache)
    (tmp_path / "example.py").write_text(code)
    r = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"README example failed:\n{code}\n--- stderr:\n{r.stderr[-3000:]}"


def test_readme_commands_are_run_here_or_are_scripts_of_the_repository(tmp_path):
    # Repository-relative paths in the commands resolve through a link, so the cache lands in tmp_path.
    (tmp_path / "portable_loader").symlink_to(ROOT / "portable_loader")
    lines = [c for lang in ("bash", "sh", "shell") for b in blocks(README, lang) for c in commands(b)]
    assert lines
    sample = ROOT / "portable_loader" / "sample" / "sample_chat.jsonl"
    for line in lines:
        words = line.split()
        if words[:2] in (["bash", "scripts/test.sh"], ["bash", "scripts/demo.sh"]):
            # Both install packages, so the suite cannot run them; CI runs both (.ci/run).
            assert (ROOT / words[1]).is_file()
            assert line in (ROOT / ".ci" / "run").read_text()
        elif words[:3] == [".venv/bin/python", "-m", "portable_loader.precache"]:
            r = subprocess.run([sys.executable, *words[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr[-3000:]
            import portable_loader as pl

            rows = sum(1 for row in sample.read_text().splitlines() if row.strip())
            assert len(pl.open_cache(str(tmp_path / r.stdout.splitlines()[-1]))) == rows
        else:
            pytest.fail(f"README command neither run by this test nor a known script: {line}")


def test_no_page_refers_outside_the_repository():
    for path in [README, *sorted((ROOT / "docs").rglob("*"))]:
        if path.is_file():
            text = path.read_text(errors="replace")
            for outside in ("../shared", "/work/"):
                assert outside not in text, f"{path.relative_to(ROOT)} mentions {outside}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_point_to_files_in_the_repository(page):
    targets = [t for t in LINK.findall(page.read_text()) if "://" not in t and not t.startswith(("mailto:", "#"))]
    for target in targets:
        resolved = (page.parent / target.split("#")[0]).resolve()
        assert resolved.is_relative_to(ROOT) and resolved.exists(), f"{page.name}: broken link {target}"


def test_files_named_in_the_pages_exist():
    named = re.compile(r"\b((?:scripts|tests|docs|portable_loader|adapters)/[\w/.-]+\.(?:py|sh|md|svg|csv|jsonl))\b")
    for page in PAGES:
        for rel in named.findall(page.read_text()):
            assert (ROOT / rel).is_file() or (page.parent / rel).is_file(), f"{page.name} names {rel}, which is missing"


def test_tests_named_by_the_design_exist():
    # docs/design.md maps each promise to the tests that hold it; a renamed test must not leave a stale map.
    defined = set()
    for f in (ROOT / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", f.read_text(), re.M))
    cited = set(re.findall(r"`(test_\w+)`", (ROOT / "docs" / "design.md").read_text()))
    assert len(cited) >= 20
    assert cited <= defined, f"design.md cites tests that do not exist: {sorted(cited - defined)}"


def defined_names(module: str) -> set[str]:
    """Top-level names of a package module, read from its source: the frameworks it imports stay unloaded."""
    tree = ast.parse(pathlib.Path(importlib.util.find_spec(module).origin).read_text())
    names, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.If, ast.Try, ast.With)):  # names defined only when an import works
            todo += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            todo += [n for h in getattr(node, "handlers", []) for n in h.body]
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


@pytest.mark.parametrize("page", PAGES[1:], ids=[p.name for p in PAGES[1:]])
def test_reference_snippets_in_docs_parse_and_import_real_names(page):
    # The docs' snippets are reference sketches (they use names from their context, such as `src`),
    # so they are not run; they must still parse, and what they import from the package must exist.
    for code in blocks(page, "python"):
        compile(code, str(page), "exec")
        for module, names in re.findall(r"^from (portable_loader[\w.]*) import ([\w, ]+)$", code, re.M):
            missing = set(names.replace(" ", "").split(",")) - defined_names(module)
            assert not missing, f"{page.name}: {module} has no {sorted(missing)}"
