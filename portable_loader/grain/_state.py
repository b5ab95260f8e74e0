"""The state of a ``DataLoaderIterator``: a global stream position, as fixed-size JSON.

Fields: ``version`` (1), ``loader`` (what wrote it), ``pipeline`` (the ``DataLoader``'s fingerprint:
data source, sampler, operations; not the worker count, shard options, read options or batch
sizes), ``position`` (20 digits: the global stream position every shard has reached) and ``check``
(a digest of the others, so an edited or damaged state is refused). Its size never depends on the
position, and restoring it costs O(1).

Example:
    >>> s = make_state("0123456789abcdef", 42)
    >>> s["position"], read_state(json.dumps(s).encode(), "0123456789abcdef", 100)
    ('00000000000000000042', 42)
    >>> read_state({**s, "position": "%020d" % 43}, "0123456789abcdef", 100)
    Traceback (most recent call last):
    ...
    portable_loader.errors.StateError: loader state: field 'check': does not match the state's fields: the state was edited or damaged
"""

from __future__ import annotations

import json

from portable_loader.dataset.base import digest
from portable_loader.errors import StateError
from portable_loader.state import parse_state

__all__ = ["encode", "make_state", "read_state"]

STATE_VERSION = 1
LOADER = "portable_loader.grain.DataLoader"
_WIDTH = 20  # digits: 2**64 fits, and the size never depends on the position
_FIELDS = ("version", "loader", "pipeline", "position", "check")


def _check(pipeline: str, position: str) -> str:
    return digest(LOADER, STATE_VERSION, pipeline, position)


def make_state(pipeline: str, position: int) -> dict:
    """The state of a ``DataLoader`` with fingerprint ``pipeline`` at global ``position``.

    Example:
        >>> sorted(make_state("f" * 16, 0))
        ['check', 'loader', 'pipeline', 'position', 'version']
    """
    pos = f"{int(position):0{_WIDTH}d}"
    return {"version": STATE_VERSION, "loader": LOADER, "pipeline": pipeline, "position": pos,
            "check": _check(pipeline, pos)}


def encode(state: dict) -> bytes:
    """JSON bytes, indented as Grain's ``DataLoaderIterator.get_state()`` writes them.

    Example:
        >>> len(encode(make_state("f" * 16, 10))) == len(encode(make_state("f" * 16, 10**7)))
        True
    """
    return json.dumps(state, indent=4).encode()


def read_state(raw, pipeline: str, total: int) -> int:
    """The global position ``raw`` names, after checking that it is a state of ``pipeline`` within ``total``
    positions; ``StateError`` naming the field otherwise.

    Example:
        >>> read_state(b'{"version": 2, "last_seen_indices": {"0": 5}}', "f" * 16, 10)
        Traceback (most recent call last):
        ...
        portable_loader.errors.StateError: loader state: a state of Grain's own DataLoader (last_seen_indices): its positions depend on Grain's worker count and sharding, so it cannot be resumed here; restart, or finish the run with Grain
    """
    state = parse_state(raw)  # bytes, JSON text or a dict; StateError otherwise
    if "last_seen_indices" in state:
        raise StateError(None, "a state of Grain's own DataLoader (last_seen_indices): its positions depend on "
                               "Grain's worker count and sharding, so it cannot be resumed here; restart, or "
                               "finish the run with Grain")
    for key in _FIELDS:
        if key not in state:
            raise StateError(key, "missing")
    extra = sorted(set(state) - set(_FIELDS))
    if extra:
        raise StateError(extra[0], "not a field of this state: refused")
    if state["version"] != STATE_VERSION or isinstance(state["version"], bool):
        raise StateError("version", f"{state['version']!r} is not {STATE_VERSION}, the version this release reads")
    if state["loader"] != LOADER:
        raise StateError("loader", f"{state['loader']!r}: not a portable_loader.grain DataLoader state")
    if state["pipeline"] != pipeline:
        raise StateError("pipeline", f"the state was saved by another pipeline ({state['pipeline']!r}, this one is "
                                     f"{pipeline!r}): a different data source, sampler or operation")
    pos = state["position"]
    if not isinstance(pos, str) or len(pos) != _WIDTH or not pos.isascii() or not pos.isdigit():
        raise StateError("position", f"{pos!r} is not a {_WIDTH}-digit string")
    if state["check"] != _check(pipeline, pos):
        raise StateError("check", "does not match the state's fields: the state was edited or damaged")
    if int(pos) > total:
        raise StateError("position", f"{int(pos)} is past the end of this stream ({total} positions)")
    return int(pos)
