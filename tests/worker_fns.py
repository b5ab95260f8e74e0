"""Functions and transforms that tests hand to worker processes, in a module that imports nothing heavy.

A worker started by forkserver (the start method whenever forking is unsafe: in this suite, once
Grain's prefetch threads or JAX's backend run in the test process) receives a pipeline pickled with
cloudpickle, which sends a module-level function by reference: the worker imports its module. Defined
in a test module, each worker would import that test module, and with it real Grain, JAX, hypothesis
and pytest, seconds per worker; here it imports numpy and portable_loader, which the forkserver has.
"""

from __future__ import annotations

import os

import numpy as np

from portable_loader import grain as pg

# --- tests/test_grain_iter.py: plain functions, the same objects for Grain's pipeline and ours ------


def affine(a, x):
    return x * 3 + a


def not_mod(m, r, x):
    return int(np.sum(x)) % m != r


CALLS = {"map": 0}  # calls of counted and Counted in this process


def jitter(x, rng):
    return x + rng.integers(0, 1000)


def plus_index(i, x):
    return x + 7 * i


def counted(x):
    """The identity, counting its calls in this process (``CALLS``): how a test sees that nothing was replayed."""
    CALLS["map"] += 1
    return x


def fail_at_13(x):
    if x == 13:
        raise KeyError(f"bad element {x}")
    return x * 2


def write_marker(folder, index, count):
    with open(os.path.join(folder, f"{index}-of-{count}"), "w"):
        pass


_FAILED_ONCE: list = []


def flaky_in_workers(main_pid, x):
    """Fails once in each worker process (a transient read error), never in process ``main_pid``.

    The test's pid travels as an argument: a forkserver worker imports this module afresh, so a pid
    taken at import would be the worker's own.
    """
    if os.getpid() != main_pid and not _FAILED_ONCE:
        _FAILED_ONCE.append(x)
        raise OSError("transient")
    return x + 1


# --- tests/test_grain_api.py: transform subclasses of portable_loader.grain -------------------------


class Square(pg.transforms.Map):
    def map(self, x):
        return x * x % 10007


class NotMod3(pg.transforms.Filter):
    def filter(self, x):
        return int(np.sum(x)) % 3 != 0


class Jitter(pg.transforms.RandomMap):
    def random_map(self, x, rng):
        return x + int(rng.integers(1000))


class Counted(pg.transforms.Map):
    """The identity, counting its calls in this process (in a module global: an object's own attributes
    are part of its identity, and a count there would make each new loader a different pipeline)."""

    def map(self, x):
        CALLS["map"] += 1
        return x



class PlusIndex(pg.transforms.MapWithIndex):
    def map_with_index(self, index, x):
        return x + 7 * index


class TagIndex(pg.transforms.MapWithIndex):
    def map_with_index(self, index, x):
        return (index, x)


# --- tests/test_remote_shards.py: a process of its own opening a shared remote cache -----------------


def fetch_first_shard(args):
    """Bytes this process downloaded for shard 0 of ``url`` through the local cache ``cache_dir``.

    A forkserver child has the server's environment: take the test's (the S3 server's endpoint and
    credentials) and have fsspec read it again, as the ``s3`` fixture does."""
    import fsspec.config

    from portable_loader.cache.remote import open_store
    from portable_loader.engine.workers import take_environment

    url, cache_dir, env = args
    take_environment(env)
    fsspec.config.set_conf_env(fsspec.config.conf)
    return open_store(url, cache_dir).fetch(0)
