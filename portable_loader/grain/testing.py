"""``grain.experimental.assert_equal_output_after_checkpoint``: a resume check for any dataset whose iterator saves its state.

Example:
    >>> from portable_loader import grain
    >>> assert_equal_output_after_checkpoint(grain.MapDataset.range(5).map(lambda x: x * 2).to_iter_dataset())
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["assert_equal_output_after_checkpoint"]


def _shape(state: Any) -> Any:
    """The structure of a state with its leaves replaced by their types: what must not change between steps."""
    if isinstance(state, dict):
        return {k: _shape(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_shape(v) for v in state)
    return type(state).__name__


def assert_equal_output_after_checkpoint(ds: Any) -> None:
    """Iterate ``ds`` to its end saving the state before every element; then, from each state, a new iterator must restore that state and yield the rest.

    Also checks that every state has the structure of the first (a state's size must not grow
    with the position). Raises ``AssertionError`` naming the step that differs. Use a short dataset:
    restoring at every step costs quadratic time.

    Example:
        >>> from portable_loader import grain
        >>> assert_equal_output_after_checkpoint(grain.MapDataset.range(4).shuffle(seed=1))
    """
    it = iter(ds)
    states, values = [], []
    while True:
        state = it.get_state()
        if states and _shape(state) != _shape(states[0]):
            raise AssertionError(f"the state's structure changed at step {len(states)}: {state} after {states[0]}")
        try:
            value = next(it)
        except StopIteration:
            break
        states.append(state)
        values.append(value)
    assert values, "Dataset did not produce any elements."
    for step, state in enumerate(states):
        again = iter(ds)
        again.set_state(state)
        np.testing.assert_equal(again.get_state(), state, f"restored state differs at step {step}")
        np.testing.assert_equal(list(again), values[step:], f"values after restoring step {step}'s state differ")
