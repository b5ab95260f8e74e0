#!/usr/bin/env bash
# The project's one test command: installs everything it needs into .venv, then runs the whole suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k sampler).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${PORTABLE_LOADER_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
py="$venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check --upgrade pip
# torch is pinned here only: 2.13.0 is a local CPU wheel; an unpinned torch pulls GBs of CUDA packages.
"$py" -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[all,dev]"
exec "$py" -m pytest "$@"
