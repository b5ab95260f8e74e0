"""Rewrite tests/golden/: loader states and the sample cache's key, as this version saves them.

``tests/test_golden.py`` restores every state in tests/golden/ and checks that the next two batches
are the ones recorded there, that a run from step 0 saves the same state, and that the bundled
sample's cache has the same key and content. Those files pin the state format and the streams, so
run this script only for a deliberate change of either, together with a version bump:
``STATE_VERSION`` (portable_loader/state.py) for states and streams, ``FORMAT_VERSION``
(portable_loader/cache/manifest.py) for caches. A golden test that fails after a refactor means the
refactor changed what users get: mend the code, not the files.

    .venv/bin/python scripts/make_golden.py     # rewrites tests/golden/*.json (a few seconds)

What a file holds is free of this machine: no paths, times or worker counts; batches are kept as a
sha256 of their bytes and a few token values, not whole.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys
import tempfile
from typing import Callable, NamedTuple

import numpy as np

import portable_loader as pl
from portable_loader.cache.manifest import read_manifest
from portable_loader.precache import sample_args

GOLDEN = pathlib.Path(__file__).resolve().parent.parent / "tests" / "golden"
CACHE_FILE = "sample_cache.json"
NEXT_BATCHES = 2
HOW_TO_REGENERATE = ("if the change is deliberate, bump STATE_VERSION (portable_loader/state.py) or the cache "
                     "FORMAT_VERSION (portable_loader/cache/manifest.py) and run: "
                     ".venv/bin/python scripts/make_golden.py")


class Case(NamedTuple):
    """A loader over the sample cache, and the step after which its state is saved."""

    about: str
    loader: Callable[[object], pl.DataLoader]
    steps: int
    #: ``it.set_weights`` calls made before the given steps (a mixture re-weighted while running).
    calls: dict = {}


def _at_most_48_tokens(record) -> bool:
    return len(record["input_ids"]) <= 48


def _filtered(src) -> pl.DataLoader:
    # Named: a fingerprint of the function's module path would depend on how this file is imported.
    kept = pl.source(src).filter(_at_most_48_tokens, name="golden: at most 48 tokens")
    return pl.DataLoader(kept, global_batch_size=8, seq_len=64, seed=4)


def _mixture(src) -> pl.DataLoader:
    ds = pl.source(src)
    # Two stages, the second begun before the saved position: the state carries both stages' digests.
    weights = [(0, {"head": 3, "tail": 1}), (64, {"head": 1, "tail": 1})]
    mixed = pl.mix({"head": ds[:1200], "tail": ds[1200:]}, weights, block=16)
    return pl.DataLoader(mixed, global_batch_size=8, seq_len=128, seed=3)


CASES = {
    "padded": Case("one record per row, cut or padded to seq_len",
                   lambda src: pl.DataLoader(src, global_batch_size=8, seq_len=128, seed=1), 3),
    "packed": Case("packing windows of 128 records; the state sits inside a window (row > 0)",
                   lambda src: pl.DataLoader(src, global_batch_size=8, seq_len=256, seed=2, packing=True,
                                             packing_window=128), 5),
    "mixture": Case("pl.mix of two slices, weights 3:1 then 1:1 from record 64, blocks of 16", _mixture, 10),
    "filtered": Case("a filter that keeps records of at most 48 tokens: positions run ahead of rows", _filtered, 3),
    "concat": Case("packing='concat': the records back to back, cut into windows of exactly seq_len tokens",
                   lambda src: pl.DataLoader(src, global_batch_size=8, seq_len=128, seed=6, packing="concat"), 4),
    "online": Case("the mixture re-weighted before steps 3 and 6 (one inside a block of 16): the state carries both",
                   _mixture, 7, {3: {"tail": 1}, 6: {"head": 2, "tail": 1}}),
    "batch_schedule": Case("global batch size 4, 8 from step 3, 16 from step 6; the next batches cross a stage",
                           lambda src: pl.DataLoader(src, global_batch_size=[(0, 4), (3, 8), (6, 16)], seq_len=128,
                                                     seed=5), 5),
}


def sample_cache(out) -> str:
    """The bundled chat sample's cache under ``out`` (built in this process, or found there)."""
    return pl.precache(**sample_args(), out=str(out), num_workers=0)


def batches_digest(it) -> dict:
    """The next ``NEXT_BATCHES`` batches of ``it``: sha256 of their fields' bytes, shapes, a few tokens.

    Example:
        >>> import numpy as np
        >>> it = iter([{"input_ids": np.arange(12, dtype=np.int32).reshape(2, 6)}] * 2)
        >>> got = batches_digest(it)
        >>> got["shapes"], got["first_tokens"], len(got["sha256"])
        ([[2, 6], [2, 6]], [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]], 64)
    """
    h = hashlib.sha256()
    shapes, tokens = [], []
    for _ in range(NEXT_BATCHES):
        batch = next(it)
        for name in sorted(batch):
            # Little-endian whatever the machine, so the digest is the same everywhere.
            value = np.ascontiguousarray(batch[name], dtype=batch[name].dtype.newbyteorder("<"))
            h.update(f"{name} {value.dtype.str} {value.shape}\n".encode())
            h.update(value.tobytes())
        shapes.append(list(batch["input_ids"].shape))
        tokens.append(batch["input_ids"][0, :8].tolist())
    return {"sha256": h.hexdigest(), "shapes": shapes, "first_tokens": tokens}


def record(name: str, src) -> dict:
    """What tests/golden/<name>.json holds: the state after the case's steps and the batches after it."""
    case = CASES[name]
    with iter(case.loader(src)) as it:
        for step in range(case.steps):
            if step in case.calls:
                it.set_weights(case.calls[step])
            next(it)
        state = dict(it.get_state())
        following = batches_digest(it)
    return {"case": name, "about": case.about, "steps": case.steps, "state": state, "next": following}


def cache_record(path: str) -> dict:
    """What tests/golden/sample_cache.json holds: the cache's name, key, key parts, content and layout."""
    m = read_manifest(path)
    counts = {k: v for k, v in m["counts"].items() if k != "tokenize_seconds"}
    return {
        "name": pathlib.Path(path).name,
        "key": m["key"],
        "key_parts": m["key_parts"],
        "format_version": m["format_version"],
        "content_checksum": m["content_checksum"],
        "counts": counts,
        "shards": [{"file": s["file"], "rows": s["rows"]} for s in m["shards"]],
        "source_fingerprint": pl.source(pl.open_cache(path)).fingerprint(),
    }


def write(name: str, body: dict) -> None:
    (GOLDEN / name).write_text(json.dumps(body, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def main() -> int:
    GOLDEN.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = sample_cache(tmp)
        write(CACHE_FILE, cache_record(path))
        src = pl.open_cache(path)
        for name in CASES:
            write(f"{name}.json", record(name, src))
    print(f"wrote {len(CASES) + 1} files to tests/golden/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
