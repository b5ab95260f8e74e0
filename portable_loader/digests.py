"""sha256 of a JSON value: cache keys, manifest checksums, loader fingerprints and state digests.

Keys are sorted, so equal dicts give equal digests whatever their insertion order. The compact form
(``","`` and ``":"``) is what cache keys and manifests use; loader fingerprints and states were first
written with :mod:`json`'s default separators, and keep them so that saved states still match.

Example:
    >>> json_sha256({"b": 1, "a": [1, 2]})[:16]
    '94a786c3662bc7be'
    >>> json_sha256({"b": 1, "a": [1, 2]}, compact=False)[:16]
    '3813f9409eb0095b'
"""

from __future__ import annotations

import hashlib
import json

__all__ = ["json_sha256"]


def json_sha256(value, *, compact: bool = True) -> str:
    """Hex sha256 of ``value`` dumped as JSON with sorted keys (compact separators unless ``compact=False``).

    Example:
        >>> len(json_sha256({"seed": 0}))
        64
    """
    separators = (",", ":") if compact else None  # None: json's default ", " and ": "
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=separators).encode()).hexdigest()
