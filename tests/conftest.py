"""Shared fixtures: the real data in ../shared/data (skipped with a clear message where absent)."""

import os
import pathlib

import pytest

# Eight virtual CPU devices for the JAX tests; must be set before jax is first imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = pathlib.Path(os.environ.get("PORTABLE_LOADER_DATA", ROOT.parent / "shared" / "data"))
PHI3 = DATA / "tokenizers" / "phi-3-mini"
GPT2 = DATA / "tokenizers" / "gpt2"
SAMPLE = ROOT / "portable_loader" / "sample"


def need(path: pathlib.Path) -> str:
    if not path.exists():
        pytest.skip(f"real test data not found at {path} (expected ../shared/data beside the project)")
    return str(path)


@pytest.fixture(scope="session")
def phi3():
    from portable_loader.tokenize import load_tokenizer

    return load_tokenizer(need(PHI3))


@pytest.fixture(scope="session")
def gpt2():
    from portable_loader.tokenize import load_tokenizer

    return load_tokenizer(need(GPT2))
