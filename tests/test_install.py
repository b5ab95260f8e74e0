"""What scripts/test.sh and pyproject.toml install: every subpackage, and an environment that agrees.

The setup's first command must print no ERROR: pip reports conflicts between the packages of the
environment it installs into, so the test environment must hold none (the pretraining peers, whose
declared dependencies conflict with it, live in their own folder: scripts/test.sh,
tests/pretrain_peers.py).
"""

import pathlib
import subprocess
import sys
import tomllib

import pytest

import portable_loader

ROOT = pathlib.Path(portable_loader.__file__).resolve().parent.parent


def test_the_package_list_holds_every_subpackage():
    # pyproject.toml lists the packages a wheel gets; a subpackage left out imports from a checkout
    # (and an editable install) but is missing from `pip install portable-loader`.
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    package = ROOT / "portable_loader"
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in package.rglob("__init__.py")}
    assert found <= listed, f"pyproject.toml [tool.setuptools] packages misses {sorted(found - listed)}"


@pytest.mark.slow
def test_the_test_environment_has_no_conflicting_requirements():
    if sys.prefix == sys.base_prefix:
        pytest.skip("not in a virtual environment: the system's packages are not scripts/test.sh's to keep")
    r = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"pip check (what pip reports as ERROR at every install):\n{r.stdout}{r.stderr}"
