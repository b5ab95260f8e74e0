"""``grain.python.experimental``: the same names as ``grain.experimental`` (Grain 0.2.18 re-exports them there).

Example:
    >>> from portable_loader.grain.python import experimental
    >>> from portable_loader.grain import experimental as top
    >>> experimental.FirstFitPackIterDataset is top.FirstFitPackIterDataset
    True
"""

from portable_loader.grain import experimental as _top
from portable_loader.grain.experimental import *  # noqa: F401,F403

__all__ = list(_top.__all__)


def __getattr__(name: str):
    return getattr(_top, name)
