"""A script that does everything right exits silently: exit code 0 and not one byte on stderr.

The README's examples run as a user runs them, as scripts in a fresh interpreter, once as written
(``with`` blocks, ``close()``) and once with every loader left open for the exit hook and garbage
collection at interpreter shutdown to close (the same code with its ``with`` statements over our
loaders turned into plain assignments and its ``close()`` calls dropped). A traceback printed by a
finalizer ("Exception ignored in ...") or a warning from a thread or worker torn down at exit shows
up here even though the exit code stays 0.
"""

import ast
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from test_readme import README, blocks, top_level_modules

# The README examples that start loaders of each kind: a DataLoader with workers, the pretokenized
# corpus, the Grain face, torch and JAX adapters. Found by what they call, so that an edit of the
# README keeps them covered (and a removed one fails below rather than silently vanishing).
KINDS = {
    "workers": "num_workers=2)",
    "pretokenized": "pl.pretokenized(",
    "grain": "from portable_loader import grain",
    "torch": "TorchLoader(loader, device=device)",
    "jax": "JaxLoader(loader, sharding=sharding)",
}
OPENERS = {"iter", "TorchLoader", "JaxLoader"}


def example(kind: str) -> str:
    found = [b for b in blocks(README, "python") if KINDS[kind] in b]
    assert len(found) == 1, f"README: expected one python example with {KINDS[kind]!r}, found {len(found)}"
    return found[0]


class LeaveOpen(ast.NodeTransformer):
    """``with iter(x) as it: body`` -> ``it = iter(x); body`` (loaders only), and no ``.close()``."""

    def visit_With(self, node):
        self.generic_visit(node)
        ours = [i for i in node.items if isinstance(i.context_expr, ast.Call)
                and getattr(i.context_expr.func, "id", None) in OPENERS]
        if not ours:
            return node
        kept = [i for i in node.items if i not in ours]
        opened = [ast.Assign([i.optional_vars], i.context_expr) if i.optional_vars else ast.Expr(i.context_expr)
                  for i in ours]
        return opened + ([ast.With(kept, node.body)] if kept else node.body)

    def visit_Expr(self, node):
        call = node.value
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "close":
            return None
        return node


def left_open(code: str) -> str:
    return ast.unparse(ast.fix_missing_locations(LeaveOpen().visit(ast.parse(code))))


def test_leaving_open_removes_every_with_and_close_over_a_loader():
    code = left_open(example("torch") + "\n" + example("grain") + "\n" + example("workers"))
    assert "with TorchLoader" not in code and "with iter" not in code and ".close()" not in code
    assert "tl = TorchLoader(loader, device=device)" in code and "it = iter(loader)" in code
    ast.parse(code)


@pytest.fixture(scope="module")
def sample_cache(tmp_path_factory):
    import portable_loader as pl
    from portable_loader.precache import sample_args

    return pathlib.Path(pl.precache(**sample_args(), out=str(tmp_path_factory.mktemp("cache"))))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["closed", "left_open"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_readme_example_exits_silently(kind, how, tmp_path, sample_cache):
    code = example(kind)
    missing = sorted(m for m in top_level_modules(code) if importlib.util.find_spec(m) is None)
    if missing:  # only where scripts/test.sh's full install was not used
        pytest.skip(f"example needs {missing}, not installed here")
    if how == "left_open":
        code = left_open(code)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / sample_cache.name).symlink_to(sample_cache)
    (tmp_path / "example.py").write_text(code)
    # JAX_PLATFORMS: a machine with a GPU but a CPU jaxlib would otherwise warn about the GPU.
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stderr == "", f"{kind} example ({how}) exited {r.returncode}:\n{code}\n{r.stderr[-4000:]}"
