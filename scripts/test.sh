#!/usr/bin/env bash
# The project's one test command: installs everything it needs into .venv, then runs the whole suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k sampler); scripts/test.sh --quick runs the quick
# tier: every module's tests but those marked slow (tests/conftest.py), which the full suite still runs.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/quietly.sh
venv="${PORTABLE_LOADER_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
py="$venv/bin/python"
pins="megatron-core==0.19.2 ai2-olmo-core==3.0.0 cached-path==1.8.10 litdata==0.2.76"  # the peers (below)
# A venv set up before the peers had their own folder holds them among its packages: out first.
stale=$("$py" -c 'import importlib.metadata as m, sys
names = {d.metadata["Name"].lower().replace("_", "-") for d in m.distributions()}
print(*[p.split("==")[0] for p in sys.argv[1:] if p.split("==")[0] in names])' $pins)
if [ -n "$stale" ]; then
    quietly "removing the peers from $venv's packages: $stale" "$py" -m pip uninstall -q -y $stale
fi
# torch is pinned here only: 2.13.0 is a local CPU wheel; an unpinned torch pulls GBs of CUDA packages.
# dataclass-extensions, bettermap and google-cloud-storage: what OLMo-core (a peer, below) imports.
install() {  # (&&: set -e does not hold inside a command that quietly tests)
    "$py" -m pip install -q --disable-pip-version-check --upgrade pip &&
        "$py" -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[all,dev]" \
            dataclass-extensions==0.5.0 bettermap==1.3.1 google-cloud-storage==3.17.1
}
quietly "installing into $venv: pip, torch 2.13.0 (CPU), portable_loader[all,dev] (editable) and OLMo-core's imports" install
# The pretraining peers go to a folder of their own, $venv/peers, which only tests/pretrain_peers.py
# (the peer tests, scripts/bench_pretrain.py) puts on sys.path, after the venv's packages. Their declared
# dependencies cannot install beside torch 2.13 (megatron-core's cp311 wheel declares Python >= 3.12,
# cached-path pins huggingface_hub < 2, filelock < 4 and rich < 14, litdata pulls a torchvision that
# breaks torch 2.13), so they install without them, and the venv keeps only packages that agree (pip's
# resolver reports no conflict).
peers="$venv/peers"
if [ "$(cat "$peers/.pins" 2>/dev/null)" != "$pins" ]; then
    rm -rf "$peers"
    quietly "installing the pretraining peers into $peers: $pins" \
        "$py" -m pip install -q --disable-pip-version-check --no-deps --ignore-requires-python --target "$peers" $pins
    echo "$pins" > "$peers/.pins"
fi
# Two pytest processes (pytest-xdist), a test module to each in turn, so that a module's fixtures are
# built once: on 2 cores the suite's own jobs and workers leave a core idle for much of a one-process run
# (3 processes took as long as 2). PORTABLE_LOADER_TEST_PROCESSES=N sets another count, 0 one process.
# Modules go out in the collection's order, the longest first (tests/conftest.py, LONG_FIRST).
# Bytecode is written (Python's default, which some machines turn off): the suite starts hundreds of
# interpreters, and each would otherwise compile the package's modules again (~0.35 s of CPU each).
unset PYTHONDONTWRITEBYTECODE
exec "$py" -m pytest -n "${PORTABLE_LOADER_TEST_PROCESSES:-2}" --dist loadfile --no-loadscope-reorder "$@"
