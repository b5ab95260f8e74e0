"""Shared fixtures: the real data in ../shared/data (skipped with a clear message where absent)."""

import itertools
import os
import pathlib
import signal

import numpy as np
import pytest

# A suite started in the background (nohup, `&`, some CI runners) inherits an ignored SIGINT, which every
# job it starts would inherit too: the tests that press Ctrl-C on a job need Python's own handler.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Eight virtual CPU devices for the JAX tests; must be set before jax is first imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = pathlib.Path(os.environ.get("PORTABLE_LOADER_DATA", ROOT.parent / "shared" / "data"))
PHI3 = DATA / "tokenizers" / "phi-3-mini"
GPT2 = DATA / "tokenizers" / "gpt2"
SAMPLE = ROOT / "portable_loader" / "sample"


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help="the quick tier: every module's fast tests, leaving out those marked slow "
                          "(scripts/test.sh --quick; the full suite still runs them)")


# The modules that take minutes, first: a parallel run (scripts/test.sh) hands modules out in the order
# they come, and one of these started last would leave the other processes idle at the end.
LONG_FIRST = ["test_exit.py", "test_readme.py", "test_faults.py", "test_ray.py", "test_lightning.py", "test_grain_api.py",
              "test_precache.py", "test_grain_maxtext.py", "test_gpu_check.py", "test_jax.py", "test_torch.py",
              "test_grain_conformance.py"]
assert all((ROOT / "tests" / name).is_file() for name in LONG_FIRST), "LONG_FIRST names a module that is gone"


def pytest_configure(config):
    """One JAX compilation cache for the whole run, empty at its start: the suite's JAX trainers and
    docs examples compile the same programs in process after process (half of a trainer's CPU). Set
    here, in the process that starts the test processes, so that they and every job they start
    inherit it; a cache the user set is kept."""
    if hasattr(config, "workerinput") or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="portable-loader-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # (JAX's default: those over 1 s)
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


def pytest_collection_modifyitems(config, items):
    rank = {name: k for k, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: a module's own order is kept)
    if not config.getoption("--quick"):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        left = set(map(id, slow))
        items[:] = [item for item in items if id(item) not in left]


@pytest.fixture(scope="session", autouse=True)
def own_tokenizer_cache(tmp_path_factory):
    """The run's own kept tokenizers (pl.tokenized keeps the backends it loads): never the user's
    ~/.cache, and a cold start in every run, so both the first load and the kept one are exercised."""
    before = os.environ.get("PORTABLE_LOADER_TOKENIZER_CACHE")
    os.environ["PORTABLE_LOADER_TOKENIZER_CACHE"] = str(tmp_path_factory.mktemp("tokenizers"))
    yield
    if before is None:
        os.environ.pop("PORTABLE_LOADER_TOKENIZER_CACHE", None)
    else:
        os.environ["PORTABLE_LOADER_TOKENIZER_CACHE"] = before


@pytest.fixture(scope="session", autouse=True)
def one_forkserver_for_the_run():
    """The run's forkserver, started first, importing once what the workers of its tests import (the
    package, as the loader's own does, the tests' shared modules, transformers' tokenizer class that
    precache's workers load); a worker it forks then starts without importing them again (several
    times faster: most of the suite's worker starts)."""
    import multiprocessing
    import multiprocessing.forkserver

    from portable_loader.engine.workers import PRELOAD

    # (The tokenizer class's module under transformers 5 and 4: the server skips one it cannot import.)
    tokenizers = ["transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast"]
    multiprocessing.set_forkserver_preload([*PRELOAD, "numpy", "psutil", "hypothesis", "conftest", "worker_fns", *tokenizers])
    multiprocessing.forkserver.ensure_running()


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


def run_ranks(script: str, n: int, args, env=None, timeout: int = 300) -> None:
    """Start ``n`` processes of ``script`` (one per rank) on a free localhost port; all must exit 0.

    ``args(rank, port)`` gives each process's arguments.
    """
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, script, *map(str, args(r, port))], stderr=subprocess.PIPE, text=True, env=env)
             for r in range(n)]
    errs = [p.communicate(timeout=timeout)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * n, [e[-3000:] for e in errs]


def spans_records(spans):
    """The (ids, mask) of every record a ``Spans`` names, read from its buffers (a test oracle's view)."""
    out = []
    for k, n in enumerate(spans.length):
        ids = bytes(spans.ids[spans.buf[k]][spans.ids_at[k] : spans.ids_at[k] + 4 * n])
        mask = bytes(spans.masks[spans.buf[k]][spans.mask_at[k] : spans.mask_at[k] + n])
        out.append((np.frombuffer(ids, np.int32).tolist(), list(mask)))
    return out


def canon(x, key_order: bool = False):
    """An exact, comparable form of an element: arrays by dtype, shape and values, dicts by key
    (sorted, or in their own order with ``key_order``: where the order is part of what is compared)."""
    if isinstance(x, (np.ndarray, np.generic)):
        a = np.asarray(x)
        return ("array", a.dtype.str, a.shape, a.tolist())
    if isinstance(x, dict):
        items = x.items() if key_order else sorted(x.items())
        return ("dict", tuple((k, canon(v, key_order)) for k, v in items))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(canon(v, key_order) for v in x))
    return ("leaf", type(x).__name__, x)


def take(it, k: int) -> list:
    """The next ``k`` elements of ``it``, fewer where it ends."""
    return list(itertools.islice(it, k))


def loader_processes(pid: int | None = None) -> list:
    """The worker processes under ``pid`` (this process): forked, or started by multiprocessing's
    forkserver (a child of the forkserver); the forkserver and the resource tracker themselves are
    multiprocessing's, shared for the process's life, and not counted."""
    import psutil

    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in kids:
        try:
            cmd = " ".join(p.cmdline())
            if p.status() == psutil.STATUS_ZOMBIE or "forkserver import main" in cmd and p.ppid() == (pid or os.getpid()):
                continue
            if "resource_tracker import main" in cmd:
                continue
        except psutil.NoSuchProcess:
            continue
        out.append(p)
    return out


def steps(loader, n, state=None):
    """Up to ``n`` batches of a fresh iterator of ``loader`` (restored to ``state`` first), its state
    after them and its stats."""
    it = iter(loader)
    if state is not None:
        it.set_state(state)
    with it:
        out = []
        for _ in range(n):
            try:
                out.append(next(it))
            except StopIteration:
                break
        return out, it.get_state(), it.stats


# A fork with JAX's threads running copies their locks mid-use; JAX warns, and a module marked with
# NO_FORK fails instead (the warning comes from an at-fork hook, so it surfaces as an unraisable
# exception). Its ``jax_running`` starts JAX's backend first, as the suite's earlier JAX tests have, so
# the check holds whatever order the modules run in.
NO_FORK = [
    pytest.mark.filterwarnings("error:os.fork\\(\\) was called:RuntimeWarning",
                               "error::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.usefixtures("jax_running"),
]


@pytest.fixture(scope="module")
def jax_running():
    try:
        import jax
    except ImportError:  # no JAX installed: nothing to warn, and the module's own tests still run
        return
    jax.devices()
