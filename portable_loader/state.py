"""The loader state: build it, and check it field by field before anything trusts it.

A state is a JSON object with exactly these fields:

* ``version``: ``STATE_VERSION``; states of another version describe another stream and are refused.
* ``fingerprint``, ``config``: the loader config the state belongs to (``config`` only for messages).
* ``step``: the trainer's step (global steps served so far).
* ``samples``: rows served so far, Megatron's ``consumed_samples``. Padding: the stream position
  (records consumed). Packing: the position is ``window`` and ``row`` (both 0 when padding).
  Neither depends on the batch size, so a state resumes at any other size or schedule.
* ``batch_size``: the size the saving loader gives the next step (for the reader; a loader resumed
  at another size serves its own).
* ``batch_schedule``: ``[count, digest]`` of the batch-size stages that began before the position.
  A loader configured with a schedule (a list) must agree on them; stages after the position may
  differ. A loader given one integer size serves that size from the position on, whatever the past.
* ``schedule`` (a mixture only): short digests of the weight-schedule stages that began before the
  stream position (``Mix.schedule_digests``). They must match on resume; stages that begin at or after
  the position may differ, so a run can be re-weighted from where it stands. The field is optional
  and the version stays 2: states of loaders over plain datasets are unchanged, and a reader that
  predates mixtures refuses a state that has it ("not a loader state field").
* ``weights`` (a mixture re-weighted while running, ``it.set_weights``): the online stages still in
  use, each ``[start, block, nums, den, base]`` (record weights ``nums/den`` from stream position
  ``start``, each source's draws before it in ``base``): at most four (one set at position 0 and the
  last three: ``MixOrder.with_stage``), so the state stays O(sources) after any number of calls. A
  stage may start after the state's position: a change made after its batch was handed out. ``schedule`` then covers the configured stages before the first of them. Optional: a state
  without it is the configured schedule's, as before, so the version stays 3.
* ``sources``: per-source counts of what was delivered, ``"records:tokens,..."`` in source order (one
  pair for a plain source; see ``LoaderIterator.stats``). Optional on read, so the version stays 3:
  a state saved before the counts restarts them at 0. Skips (``skip_batches``, ``it.skip``) leave no
  field: they move the position.
* ``digest``: a hash over all the other fields, so that a state whose fields were edited apart (for
  instance a packed ``step`` that no longer matches its position) is refused instead of reported.

Every problem raises ``StateError`` naming the field: wrong type, out of range, past the end of a
finite stream, a row past its window, or a state that is not JSON at all.

Example:
    >>> import numpy as np, portable_loader as pl
    >>> loader = pl.DataLoader([{"input_ids": np.arange(5)}] * 6, global_batch_size=2, seq_len=8, num_epochs=1)
    >>> it = iter(loader)
    >>> it.set_state(dict(it.get_state(), step=9))
    Traceback (most recent call last):
    portable_loader.errors.StateError: loader state: field 'digest': does not match the other fields (edited by hand or damaged): refused
"""

from __future__ import annotations

import json
import sys
from typing import Any

from portable_loader.digests import json_sha256
from portable_loader.errors import StateError
from portable_loader.plan import Cursor, Planner

__all__ = ["STATE_VERSION", "LoaderState", "make_state", "parse_state", "check_state"]

# 2: packed rows are served in a keyed order per window (v1 served them in the packer's order), the
# over-long policy joined the config, and the digest field was added.
# 3: the position no longer depends on the batch size (padding: ``samples``, not step x size) and the
# fingerprint leaves the batch size out; batch_size and batch_schedule were added.
STATE_VERSION = 3
_FIELDS = ("version", "fingerprint", "config", "step", "window", "row", "samples", "batch_size",
           "batch_schedule", "digest")
_MIX_FIELD = "schedule"
_SOURCES_FIELD = "sources"  # optional on read: states saved before per-source counts restart them at 0
_ONLINE_FIELD = "weights"  # optional: a mixture's online stages (it.set_weights)


def _digest(state: dict[str, Any]) -> str:
    body = {k: v for k, v in state.items() if k != "digest"}
    return json_sha256(body, compact=False)[:16]


class LoaderState(dict):
    """A loader state: a plain dict that also reads as JSON bytes where a checkpointer expects them.

    Grain's Orbax ``CheckpointHandler`` saves any iterator that is not its own ``DatasetIterator``
    as ``get_state().decode()`` and restores it with ``set_state(text.encode())``; ``decode`` lets it
    save our iterators as they are, and ``set_state`` takes the bytes back.

    Example:
        >>> s = LoaderState({"version": 3, "step": 7})
        >>> s["step"], s.decode(), parse_state(s.decode().encode()) == s
        (7, '{"step": 7, "version": 3}', True)
    """

    def decode(self, *args) -> str:
        return json.dumps(self, sort_keys=True)


def sources_text(counts) -> str:
    """Per-source ``(records, tokens)`` as the state writes them: ``"r:t,r:t,..."`` in source order.

    Example:
        >>> sources_text([(3, 120), (0, 0)]), parse_sources("3:120,0:0", 2)
        ('3:120,0:0', [(3, 120), (0, 0)])
    """
    return ",".join(f"{r}:{t}" for r, t in counts)


def parse_sources(text, n: int) -> list[tuple[int, int]]:
    """The counts of :func:`sources_text` for ``n`` sources; ``StateError`` naming the field otherwise."""
    if not isinstance(text, str):
        raise StateError(_SOURCES_FIELD, f"must be a string of records:tokens per source, got {type(text).__name__}")
    parts = text.split(",")
    if len(parts) != n:
        raise StateError(_SOURCES_FIELD, f"holds counts of {len(parts)} source(s); this loader reads {n}: refused")
    out = []
    for part in parts:
        r, _, t = part.partition(":")
        if not (r.isdigit() and t.isdigit() and r.isascii() and t.isascii()):
            raise StateError(_SOURCES_FIELD, f"{part[:40]!r} is not records:tokens (two integers >= 0): refused")
        out.append((int(r), int(t)))
    return out


def make_state(loader, cursor: Cursor, sources=None, online=()) -> dict[str, Any]:
    """The state of ``loader`` positioned at ``cursor`` (what ``get_state`` returns), with
    ``sources``, the per-source ``(records, tokens)`` delivered before it (zeros when None), and
    ``online``, the mixture's online stages in use (``MixOrder.online``, or a function returning them).

    Example:
        >>> import numpy as np, portable_loader as pl
        >>> loader = pl.DataLoader([{"input_ids": np.arange(5)}] * 20, global_batch_size=2, seq_len=8)
        >>> state = make_state(loader, Cursor(step=5, window=0, row=0))   # samples: filled in by the planner
        >>> state["step"], state["samples"], state["version"] == STATE_VERSION
        (5, 10, True)
        >>> state["sources"]   # per-source counts: none given, so none delivered
        '0:0'
        >>> with iter(loader) as it:   # the iterator's state names the same position, with its counts
        ...     batches = [next(it) for _ in range(5)]
        ...     it.get_state() == make_state(loader, Cursor(5, 0, 0), [(10, 50)])
        True
    """
    cursor = loader.planner().resolve(cursor) if cursor.samples is None else cursor
    sizes = loader.batch_schedule
    state = {
        "version": STATE_VERSION,
        "fingerprint": loader.fingerprint,
        "config": {k: v for k, v in loader.config.items() if k != "source"},
        "step": int(cursor.step),
        "window": int(cursor.window),
        "row": int(cursor.row),
        "samples": int(cursor.samples),
        "batch_size": sizes.size(cursor.step, cursor.samples),
        "batch_schedule": sizes.digest(cursor.step, cursor.samples),
    }
    digests = loader.source.schedule_digests
    if digests is not None:
        online = online() if callable(online) else online
        used = _used(loader, cursor)
        state[_MIX_FIELD] = digests(min(used, online[0].start) if online else used)
        if online:
            state[_ONLINE_FIELD] = [[st.start, st.block, list(st.nums), st.den, list(st.base)] for st in online]
    state[_SOURCES_FIELD] = sources_text(sources if sources is not None else [(0, 0)] * len(loader._groups[0]))
    state["digest"] = _digest(state)
    return state


def _used(loader, cursor: Cursor) -> int:
    """Stream positions whose records the batches up to ``cursor`` were planned from.

    A packed window is planned whole, so a window partly served counts in full.
    """
    if not loader.packing:
        return cursor.samples
    return (cursor.window + (1 if cursor.row else 0)) * loader.packing_window


def online_stages(state: dict, loader) -> list:
    """The online stages a state carries (``weights``), checked; ``StateError`` naming what is wrong.

    Example:
        >>> import numpy as np, portable_loader as pl
        >>> m = pl.mix({"a": [{"input_ids": np.arange(3)}] * 4, "b": [{"input_ids": np.arange(2)}] * 4}, {"a": 1, "b": 1})
        >>> online_stages({"weights": [[8, 256, [1, 0], 1, [3, 5]]]}, pl.DataLoader(m, global_batch_size=2, seq_len=4))
        [Stage(start=8, block=256, nums=(1, 0), den=1, base=(3, 5), online=True)]
    """
    from portable_loader.dataset.mix.order import Stage

    raw = state.get(_ONLINE_FIELD)
    if raw is None:
        return []
    n = len(loader._groups[0])
    if not isinstance(raw, list) or not 1 <= len(raw) <= 4:
        raise StateError(_ONLINE_FIELD, f"must be a list of one to four stages, got {raw!r:.80}")
    stages, last = [], -1

    def whole(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    for st in raw:
        ok = isinstance(st, list) and len(st) == 5
        if ok:
            start, block, nums, den, base = st
            ok = (whole(start) and whole(block) and block >= 1 and whole(den) and den >= 1
                  and isinstance(nums, list) and isinstance(base, list) and len(nums) == len(base) == n
                  and all(map(whole, nums + base)) and sum(nums) == den and sum(base) == start and start > last)
        if not ok:
            raise StateError(_ONLINE_FIELD, f"stage {st!r:.120} is not [start, block, nums, den, base] of this "
                             f"mixture's {n} sources (weights summing to den, base summing to start): refused")
        last = start
        stages.append(Stage(start, block, tuple(nums), den, tuple(base), online=True))
    return stages


def parse_state(raw) -> dict[str, Any]:
    """A state dict from a dict, JSON text or JSON bytes; ``StateError`` for anything else.

    Example:
        >>> parse_state(b"\\xff\\x00")
        Traceback (most recent call last):
        portable_loader.errors.StateError: loader state: is not UTF-8 text: refused
    """
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise StateError(None, "is not UTF-8 text: refused") from None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise StateError(None, f"is not JSON ({e}): refused") from None
    if not isinstance(raw, dict):
        raise StateError(None, f"must be a JSON object (dict), got {type(raw).__name__}")
    return raw


def _int_field(state: dict, name: str) -> int:
    value = state[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise StateError(name, f"must be an integer, got {value!r} ({type(value).__name__})")
    if not 0 <= value <= sys.maxsize:
        raise StateError(name, f"must be in [0, {sys.maxsize}], got {value}")
    return value


def _version_problem(version) -> str:
    """Why a state of ``version`` is refused: the version that saved it, the one read here, what to do.

    Example:
        >>> print(_version_problem(2))
        2 is not 3 (saved by state version 2 of an older portable_loader, whose positions and fingerprints
        differ; this one reads state version 3 only: resume that run with the release that saved it): refused
        >>> print(_version_problem("3"))
        '3' is not 3 (a state version is an integer; this portable_loader reads state version 3): refused
    """
    if isinstance(version, bool) or not isinstance(version, int):
        return (f"{version!r:.40} is not {STATE_VERSION} (a state version is an integer; this portable_loader "
                f"reads state version {STATE_VERSION}): refused")
    if version < STATE_VERSION:
        saved = "an older portable_loader, whose positions and fingerprints differ"
        then = "resume that run with the release that saved it"
    else:
        saved, then = "a newer portable_loader", "upgrade portable_loader to resume it"
    return (f"{version} is not {STATE_VERSION} (saved by state version {version} of {saved}; "
            f"this one reads state version {STATE_VERSION} only: {then}): refused")


def check_state(raw, loader, planner: Planner, sources: list | None = None) -> Cursor:
    """Validate a state for ``loader`` and return the position it names; ``StateError`` otherwise.

    ``planner`` is the one the position will be served from: checking a packed ``row`` plans its
    window (O(window)), which the restore then reuses. ``sources``, a list, receives the per-source
    counts (zeros for a state saved before they were kept).
    """
    state = parse_state(raw)
    if "version" not in state:
        raise StateError("version", f"is missing (this portable_loader reads state version {STATE_VERSION})")
    version = state["version"]
    if version != STATE_VERSION or isinstance(version, bool):
        raise StateError("version", _version_problem(version))
    missing = [k for k in _FIELDS if k not in state]
    if missing:
        raise StateError(missing[0], "is missing")
    mixture = loader.source.schedule_digests is not None
    if mixture and _MIX_FIELD not in state:
        raise StateError(_MIX_FIELD, "is missing (this loader reads a mixture; the state was not saved from one)")
    extra = sorted(set(state) - set(_FIELDS) - {_SOURCES_FIELD} - ({_MIX_FIELD, _ONLINE_FIELD} if mixture else set()),
                   key=str)
    if extra:
        raise StateError(extra[0], "is not a loader state field: refused")
    for name in ("fingerprint", "digest"):
        if not isinstance(state[name], str):
            raise StateError(name, f"must be a string, got {type(state[name]).__name__}")
    if not isinstance(state["config"], dict):
        raise StateError("config", f"must be an object, got {type(state['config']).__name__}")
    step, window, row, samples = (_int_field(state, k) for k in ("step", "window", "row", "samples"))
    if _int_field(state, "batch_size") < 1:
        raise StateError("batch_size", f"must be >= 1, got {state['batch_size']}")
    begun = state["batch_schedule"]
    if not (isinstance(begun, list) and len(begun) == 2 and isinstance(begun[1], str)
            and isinstance(begun[0], int) and not isinstance(begun[0], bool) and begun[0] >= 0):
        raise StateError("batch_schedule", f"must be [count, digest], got {begun!r:.80}")
    if state["digest"] != _digest(state):
        raise StateError("digest", "does not match the other fields (edited by hand or damaged): refused")
    if state["fingerprint"] != loader.fingerprint:
        mine = {k: v for k, v in loader.config.items() if k not in ("source", "global_batch_size")}
        theirs = state["config"]
        diff = [f"{k}: state {theirs.get(k)!r}, loader {mine[k]!r}" for k in mine if theirs.get(k) != mine[k]]
        why = "; ".join(diff) or "the source differs, or a shuffle in it was saved before shuffles took Grain's order"
        raise StateError("fingerprint", f"belongs to another source or config: refused ({why})")
    n = len(loader._groups[0])
    counts = parse_sources(state[_SOURCES_FIELD], n) if _SOURCES_FIELD in state else [(0, 0)] * n
    if sources is not None:
        sources[:] = counts
    if mixture:
        saved = state[_MIX_FIELD]
        if not isinstance(saved, list) or not all(isinstance(d, str) for d in saved):
            raise StateError(_MIX_FIELD, f"must be a list of strings, got {saved!r}")
        used = _used(loader, Cursor(step, window, row, samples))
        online = planner.sampler.online
        why = loader.source.schedule_change(saved, min(used, online[0].start) if online else used)
        if why:
            raise StateError(_MIX_FIELD, f"{why}: refused")
    if not loader.batch_schedule.fixed:  # a schedule speaks for the whole run; one integer only for now on
        why = loader.batch_schedule.change(begun, step, samples)
        if why:
            raise StateError("batch_schedule", f"{why}: refused")
    if not planner.packing:
        for name, value in (("window", window), ("row", row)):
            if value:
                raise StateError(name, f"must be 0 without packing, got {value}")
        if planner.total is not None and samples > planner.total:
            raise StateError("samples", f"{samples} is past the end of the stream ({planner.total} records): refused")
        last = sys.maxsize - max(loader.batch_schedule.sizes)  # positions must stay 64-bit integers
        if samples > last:
            raise StateError("samples", f"{samples} is past the last position this loader can serve ({last}): refused")
        return Cursor(step, 0, 0, samples)
    nwin = planner.num_windows
    last = nwin if nwin is not None else (sys.maxsize - planner.window) // planner.window
    if window > last:
        raise StateError("window", f"{window} is past the end of the stream ({last} windows): refused")
    rows = planner.window_rows(window) if window < last or nwin is None else None
    size = 0 if rows is None else len(rows)
    if row and row >= size:
        raise StateError("row", f"{row} is past the end of window {window} ({size} rows): refused")
    return Cursor(step, window, row, samples)
