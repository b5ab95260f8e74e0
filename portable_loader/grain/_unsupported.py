"""What a Grain name that ``portable_loader.grain`` does not offer raises, and why.

A module lists its missing names with the reason; its ``__getattr__`` raises :class:`NotSupportedError`
for them, so ``grain.experimental.ZipMapDataset`` says at once why it is left out (or that it is
planned), instead of an ``AttributeError`` that reads like a typo.

Example:
    >>> from portable_loader.grain import experimental
    >>> experimental.ZipMapDataset
    Traceback (most recent call last):
    ...
    portable_loader.grain._unsupported.NotSupportedError: grain.experimental.ZipMapDataset is not supported by portable_loader.grain: ...
"""

from __future__ import annotations

import importlib

__all__ = ["NotSupportedError", "missing_name", "forward"]

PLANNED = "planned"


class NotSupportedError(NotImplementedError):
    """A Grain name that ``portable_loader.grain`` does not provide (yet, or at all); the message says which and why.

    Example:
        >>> raise NotSupportedError("grain.x is not supported")
        Traceback (most recent call last):
        portable_loader.grain._unsupported.NotSupportedError: grain.x is not supported
    """


def missing_name(module: str, name: str, status: str, why: str) -> NotSupportedError:
    """The error for ``module.name``: ``status`` is ``"planned"`` or ``"not supported"``.

    Example:
        >>> str(missing_name("grain.experimental", "ZipIterDataset", "not supported", "zip two MapDatasets by index instead"))
        'grain.experimental.ZipIterDataset is not supported by portable_loader.grain: zip two MapDatasets by index instead'
    """
    if status == PLANNED:
        return NotSupportedError(f"{module}.{name} is not built yet in portable_loader.grain ({PLANNED}: {why}); "
                                 "use real grain for it meanwhile")
    return NotSupportedError(f"{module}.{name} is not supported by portable_loader.grain: {why}")


def forward(module: str, name: str):
    """``name`` from real Grain's ``module``, imported now (real Grain imports JAX, so only on first use).

    Example:
        >>> forward("grain.constants", "INDEX")
        '_index'
    """
    return getattr(importlib.import_module(module), name)
