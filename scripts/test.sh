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
# The pretraining peers (tests/pretrain_peers.py, scripts/bench_pretrain.py) install beside torch 2.13
# only without their declared dependencies: megatron-core's cp311 wheel declares Python >= 3.12,
# cached-path's pins would downgrade huggingface_hub/filelock/rich, litdata's pull a torchvision that
# breaks torch 2.13. OLMo-core's other dependencies install normally, next to the pinned torch.
"$py" -m pip install -q --disable-pip-version-check --no-deps --ignore-requires-python \
    megatron-core==0.19.2 ai2-olmo-core==3.0.0 cached-path==1.8.10 litdata==0.2.76
"$py" -m pip install -q --disable-pip-version-check "torch==2.13.0" \
    dataclass-extensions==0.5.0 bettermap==1.3.1 google-cloud-storage==3.17.1
exec "$py" -m pytest "$@"
