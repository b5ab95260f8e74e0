"""The state of a ``DataLoaderIterator``: a global stream position, as fixed-size JSON.

Fields: ``version`` (1), ``loader`` (what wrote it), ``pipeline`` (the ``DataLoader``'s fingerprint:
data source, sampler, operations; not the worker count, shard options, read options or batch
sizes), ``position`` (20 digits: the global stream position every shard has reached) and ``check``
(a digest of the others, so an edited or damaged state is refused). Its size never depends on the
position, and restoring it costs O(1).

A pipeline with ``FlatMap`` operations may stop inside a record's pieces, so its states add
``pieces`` (per ``FlatMap``, the pieces of the current record already emitted, 20 digits each) and
``shard`` (``"<index>/<count>"``: those pieces belong to this shard's record, so a state with any
piece emitted resumes on this shard only).

Example:
    >>> s = make_state("0123456789abcdef", 42)
    >>> s["position"], read_state(json.dumps(s).encode(), "0123456789abcdef", 100)
    ('00000000000000000042', (42, None, []))
    >>> read_state(make_state("f" * 16, 4, (1, 2), [3]), "f" * 16, 10, flat_maps=1)
    (4, (1, 2), [3])
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
_SPLIT_FIELDS = ("shard", "pieces")  # only in the states of pipelines with FlatMap operations


def _check(pipeline: str, position: str, *split) -> str:
    return digest(LOADER, STATE_VERSION, pipeline, position, *split)


def make_state(pipeline: str, position: int, shard: tuple[int, int] | None = None, pieces=()) -> dict:
    """The state of a ``DataLoader`` with fingerprint ``pipeline`` at global ``position``; with ``FlatMap``
    operations, also ``shard`` (``(index, count)``) and the ``pieces`` emitted of the current records.

    Example:
        >>> sorted(make_state("f" * 16, 0))
        ['check', 'loader', 'pipeline', 'position', 'version']
        >>> make_state("f" * 16, 0, (0, 1), [2])["pieces"]
        ['00000000000000000002']
    """
    pos = f"{int(position):0{_WIDTH}d}"
    state = {"version": STATE_VERSION, "loader": LOADER, "pipeline": pipeline, "position": pos}
    if shard is None:
        return {**state, "check": _check(pipeline, pos)}
    split = (f"{shard[0]}/{shard[1]}", [f"{int(p):0{_WIDTH}d}" for p in pieces])
    return {**state, **dict(zip(_SPLIT_FIELDS, split)), "check": _check(pipeline, pos, *split)}


def encode(state: dict) -> bytes:
    """JSON bytes, indented as Grain's ``DataLoaderIterator.get_state()`` writes them.

    Example:
        >>> len(encode(make_state("f" * 16, 10))) == len(encode(make_state("f" * 16, 10**7)))
        True
    """
    return json.dumps(state, indent=4).encode()


def read_state(raw, pipeline: str, total: int, flat_maps: int = 0) -> tuple[int, tuple[int, int] | None, list[int]]:
    """``(position, shard, pieces)`` of ``raw``, after checking that it is a state of ``pipeline`` (with
    ``flat_maps`` ``FlatMap`` operations) within ``total`` positions; ``StateError`` naming the field otherwise.
    ``shard`` is None and ``pieces`` empty for a pipeline without ``FlatMap``.

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
    fields = _FIELDS + (_SPLIT_FIELDS if flat_maps else ())
    for key in fields:
        if key not in state:
            raise StateError(key, "missing")
    extra = sorted(set(state) - set(fields))
    if extra:
        raise StateError(extra[0], "not a field of this state: refused")
    if state["version"] != STATE_VERSION or isinstance(state["version"], bool):
        raise StateError("version", f"{state['version']!r} is not {STATE_VERSION}, the version this release reads")
    if state["loader"] != LOADER:
        raise StateError("loader", f"{state['loader']!r}: not a portable_loader.grain DataLoader state")
    if state["pipeline"] != pipeline:
        raise StateError("pipeline", f"the state was saved by another pipeline ({state['pipeline']!r}, this one is "
                                     f"{pipeline!r}): a different data source, sampler or operation, or a "
                                     "shuffle saved before shuffles took Grain's order")
    pos = state["position"]
    if not isinstance(pos, str) or len(pos) != _WIDTH or not pos.isascii() or not pos.isdigit():
        raise StateError("position", f"{pos!r} is not a {_WIDTH}-digit string")
    split = tuple(state[k] for k in _SPLIT_FIELDS) if flat_maps else ()
    if state["check"] != _check(pipeline, pos, *split):
        raise StateError("check", "does not match the state's fields: the state was edited or damaged")
    if int(pos) > total:
        raise StateError("position", f"{int(pos)} is past the end of this stream ({total} positions)")
    if not flat_maps:
        return int(pos), None, []
    shard, pieces = split
    if not isinstance(pieces, list) or len(pieces) != flat_maps or \
            not all(isinstance(p, str) and len(p) == _WIDTH and p.isascii() and p.isdigit() for p in pieces):
        raise StateError("pieces", f"{pieces!r} is not a list of {flat_maps} {_WIDTH}-digit strings")
    index, _, count = shard.partition("/") if isinstance(shard, str) else ("", "", "")
    if not (index.isdigit() and count.isdigit()):
        raise StateError("shard", f"{shard!r} is not '<index>/<count>'")
    return int(pos), (int(index), int(count)), [int(p) for p in pieces]
