"""The import graph: every core module imports first in a fresh interpreter (so no import cycle hides
behind another module having been imported before it), and the core never imports torch, jax or ray."""

import json
import pkgutil
import subprocess
import sys

import pytest

import portable_loader

HEAVY = ("torch", "jax", "ray")


def _core_modules() -> list[str]:
    names = ["portable_loader"]
    for info in pkgutil.walk_packages(portable_loader.__path__, "portable_loader."):
        # __main__ modules run programs when imported; adapters exist to import torch and jax.
        if not info.name.endswith(".__main__") and not info.name.startswith("portable_loader.adapters"):
            names.append(info.name)
    return sorted(names)


def _fresh_import(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_split_modules_are_found():
    names = set(_core_modules())
    for name in ("cache.manifest", "cache.writer", "cache.readers", "cache.publish",
                 "precache.plan", "precache.engine", "digests"):
        assert f"portable_loader.{name}" in names


@pytest.mark.slow
def test_each_module_imports_first_in_a_fresh_interpreter():
    # One interpreter per module would take minutes on a loaded machine; a fresh interpreter that
    # imports each module first, then drops every portable_loader module, checks the same thing.
    # Importing any module runs the package's __init__ first, so a module that __init__ imports is
    # checked by the package's own import (importing it again after would do nothing): only the others
    # get a fresh start of their own.
    code = (
        "import importlib, json, sys\n"
        f"names = {_core_modules()!r}\n"
        "failed, by_package = {}, set()\n"
        "for name in names:\n"
        "    if name in by_package:\n"
        "        continue\n"
        "    for m in [m for m in sys.modules if m == 'portable_loader' or m.startswith('portable_loader.')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        failed[name] = f'{type(e).__name__}: {e}'\n"
        "    if name == 'portable_loader':\n"
        "        by_package = {m for m in sys.modules if m.startswith('portable_loader.')}\n"
        f"heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
        "print(json.dumps([failed, heavy]))\n"
    )
    assert _fresh_import(code) == [{}, []]


@pytest.mark.slow
@pytest.mark.parametrize("module", ["portable_loader", "portable_loader.cache", "portable_loader.precache"])
def test_core_does_not_import_torch_jax_or_ray(module):
    code = f"import json, sys, {module}\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    assert _fresh_import(code) == []


@pytest.mark.parametrize("backend", ["arrow", "array_record"])
def test_a_precache_build_does_not_import_pandas(tmp_path, backend):
    # pyarrow's pa.array() imports pandas (to ask whether it was handed a pandas object): half a second
    # of CPU in every process that writes a shard, precache's workers included.
    code = ("import json, sys, portable_loader as pl\n"
            "from portable_loader.precache import sample_args\n"
            f"path = pl.precache(**sample_args(), out={str(tmp_path)!r}, num_workers=0, backend={backend!r})\n"
            "assert len(pl.open_cache(path)) == 2000\n"
            "print(json.dumps('pandas' in sys.modules))")
    assert _fresh_import(code) is False


@pytest.mark.slow
def test_a_plain_checkout_on_pythonpath_imports_the_adapters(tmp_path):
    # No install: site-packages' libraries stay reachable, but not the editable install's finder (a
    # .pth hook), so the package comes from the checkout's folder alone.
    import pathlib
    import site

    root = pathlib.Path(portable_loader.__file__).resolve().parent.parent
    libs = [p for p in site.getsitepackages() if pathlib.Path(p).is_dir()]
    code = (f"import sys; sys.path[1:1] = {[str(root)]!r}; sys.path += {libs!r}\n"
            "import portable_loader.adapters.torch, portable_loader.adapters.jax, json\n"
            "print(json.dumps([portable_loader.adapters.torch.__file__, "
            "'__editable__' in ' '.join(map(str, sys.meta_path))]))")
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    where, editable = json.loads(out.stdout.strip().splitlines()[-1])
    assert where == str(root / "portable_loader" / "adapters" / "torch.py") and not editable


def test_every_core_module_imports_without_grain_or_array_record():
    # A GPU host (docs/performance.md) has torch and JAX but neither wheel: the package must still import
    # there, Grain's face included, and use them only where asked (a Grain pipeline, an ArrayRecord cache).
    code = (
        "import importlib, json, sys\n"
        "class Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('grain', 'array_record'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Absent())\n"
        "failed = {}\n"
        f"for name in {_core_modules()!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        failed[name] = f'{type(e).__name__}: {e}'\n"
        "print(json.dumps([failed, sorted(m for m in sys.modules if m.split('.')[0] in ('grain', 'array_record'))]))\n"
    )
    assert _fresh_import(code) == [{}, []]
