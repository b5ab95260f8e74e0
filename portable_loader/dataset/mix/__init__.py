"""Weighted mixtures of datasets: ``pl.mix`` and Grain's ``mix``/``concatenate``/``select``.

``mixture.py`` holds ``pl.mix`` (exact block arithmetic, schedules, online weight stages),
``order.py`` the arithmetic itself, ``combine.py`` Grain's ``MapDataset.mix`` and friends. These
modules may import the random-access layer, ``orders``, ``cache`` readers and ``collate``, never the
iterator layer or the corpora at module level.

Example:
    >>> from portable_loader.dataset.mix import mix
    >>> m = mix({"a": [{"input_ids": [1]}] * 4, "b": [{"input_ids": [2]}] * 4}, {"a": 1, "b": 1})
    >>> len(m)
    8
"""

from portable_loader.dataset.mix.mixture import Mix, mix

__all__ = ["Mix", "mix"]
