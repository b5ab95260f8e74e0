#!/usr/bin/env bash
# The project's main job on the sample bundled in the package: tokenize it into a cache, load packed
# batches with worker processes, save the loader state half-way and check that the resumed batches
# match bit for bit. Sets itself up: creates or reuses the virtual environment that scripts/test.sh
# uses (.venv, or $PORTABLE_LOADER_VENV) and installs only what the demo needs, not the test tools.
# Extra arguments go to `python -m portable_loader` (e.g. scripts/demo.sh --steps 1000 --num-workers 4);
# it runs in the caller's directory, so the cache lands in ./portable_loader_cache.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
. "$root/scripts/quietly.sh"
venv="${PORTABLE_LOADER_VENV:-.venv}"
case "$venv" in /*) ;; *) venv="$root/$venv" ;; esac  # relative to the repository, as in scripts/test.sh
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
py="$venv/bin/python"
# The precache extra: the tokenizer stack only (no torch, jax or test tools). Reinstalling over the full
# environment that scripts/test.sh builds changes nothing there.
quietly "installing portable_loader[precache] (editable) into $venv" \
    "$py" -m pip install -q --disable-pip-version-check -e "$root[precache]"
exec "$py" -m portable_loader "$@"
