"""What a Grain name that ``portable_loader.grain`` does not offer raises, and why.

A module lists its missing names with the reason; its ``__getattr__`` hands out a stand-in
(:func:`refused`) that imports, so Grain code that imports or annotates with the name still loads,
and raises :class:`NotSupportedError` saying why when it is used (called, built, subclassed, or an
attribute read), instead of an ``AttributeError`` that reads like a typo.

Example:
    >>> ZipMapDataset = refused("grain.experimental", "ZipMapDataset", "not supported", "a reason")
    >>> ZipMapDataset([])
    Traceback (most recent call last):
    ...
    portable_loader.grain._unsupported.NotSupportedError: grain.experimental.ZipMapDataset is not supported by portable_loader.grain: a reason
"""

from __future__ import annotations

import functools
import importlib

__all__ = ["NotSupportedError", "missing_name", "forward", "refused"]

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
    found = importlib.import_module(module)
    if found.__name__.startswith("portable_loader"):  # `grain` is an alias of this package here: no real Grain
        raise ImportError(f"{module}.{name} is real Grain's own object, but 'grain' is portable_loader.grain here")
    return getattr(found, name)


class _Refusing(type):
    """Metaclass of a refused class: building it, subclassing it or reading its attributes raises."""

    def __call__(cls, *args, **kwargs):
        raise cls._error

    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise cls._error


@functools.lru_cache(maxsize=None)  # one stand-in per name, as one object per name in Grain
def refused(module: str, name: str, status: str, why: str):
    """A stand-in for ``module.name`` that imports but raises :func:`missing_name`'s error when used.

    A capitalized name becomes a class (``isinstance`` against it is False), another a function.

    Example:
        >>> Cache = refused("grain.experimental", "CacheIterDataset", "not supported", "use pl.precache")
        >>> isinstance(3, Cache)
        False
        >>> Cache(None)
        Traceback (most recent call last):
        ...
        portable_loader.grain._unsupported.NotSupportedError: grain.experimental.CacheIterDataset is not supported by portable_loader.grain: use pl.precache
    """
    error = missing_name(module, name, status, why)
    if name[:1].isupper():
        def no_subclass(cls, **kwargs):
            raise error

        return _Refusing(name, (), {"_error": error, "__module__": module, "__init_subclass__": classmethod(no_subclass),
                                    "__doc__": str(error)})

    def stand_in(*args, **kwargs):
        raise error

    stand_in.__name__ = stand_in.__qualname__ = name
    stand_in.__module__, stand_in.__doc__ = module, str(error)
    return stand_in
