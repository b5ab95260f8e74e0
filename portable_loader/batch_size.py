"""The global batch size per step: a fixed size, a staged schedule, or Megatron's ramp-up.

A schedule is a list of stages ``[(start, size), ...]``; the first starts at 0 and ``start`` counts
global steps (``unit="steps"``) or samples consumed before the step (``unit="samples"``, Megatron's
``consumed_samples``: a sample is one row of a global batch, so a record when padding and a packed row
when packing). The size of a step is a function of (step, samples consumed) alone, so a run that
resumes with another schedule simply continues from where it stands.

Assuming the schedule was followed from step 0, step -> samples consumed (and back) is arithmetic
over the stages: O(#stages), never O(steps). ``describe(step)`` and ``num_steps`` use that.

Example:
    >>> s = BatchSchedule([(0, 2), (3, 4)])              # 2 rows for steps 0-2, then 4
    >>> [s.size_at(t) for t in range(5)], s.samples_at(5)
    ([2, 2, 2, 4, 4], 14)
    >>> r = rampup(2, 2, 6, 6)                            # Megatron: --rampup-batch-size 2 2 6, gbs 6
    >>> [r.size_at(t) for t in range(5)]
    [2, 2, 4, 6, 6]
"""

from __future__ import annotations

import bisect
import numbers
from typing import NamedTuple, Sequence

from portable_loader.digests import json_sha256

__all__ = ["BatchSchedule", "as_schedule", "rampup"]

UNITS = ("steps", "samples")


class _Span(NamedTuple):
    step: int  # the first step at this size (nominal: the schedule followed from step 0)
    samples: int  # samples consumed before that step
    size: int


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return int(value)


class BatchSchedule:
    """Global batch sizes by step or by samples consumed: ``[(start, size), ...]`` (first start 0).

    Example:
        >>> s = BatchSchedule([(0, 4), (10, 8)], unit="samples")
        >>> [s.size_at(t) for t in range(4)], s.steps_for(20)
        ([4, 4, 4, 8], 4)
    """

    def __init__(self, stages: Sequence, unit: str = "steps", *, rampup: tuple | None = None):
        if unit not in UNITS:
            raise ValueError(f"batch size schedule: unit must be one of {UNITS}, got {unit!r}")
        if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or not stages:
            raise ValueError(f"global_batch_size: a schedule is a non-empty list of (start, size), got {stages!r}")
        clean: list[tuple[int, int]] = []
        for k, item in enumerate(stages):
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise ValueError(f"global_batch_size: stage {k} must be a pair (start, size), got {item!r}")
            start, size = item
            if isinstance(start, bool) or not isinstance(start, numbers.Integral) or start < 0:
                raise ValueError(f"global_batch_size: stage {k} start must be an integer >= 0, got {start!r}")
            size = _positive_int(size, f"global_batch_size: stage {k} size")
            if k == 0 and start != 0:
                raise ValueError(f"global_batch_size: the first stage must start at 0, got {start}")
            if clean and start <= clean[-1][0]:
                raise ValueError(f"global_batch_size: stage {k} starts at {start}, not after stage {k - 1} "
                                 f"({clean[-1][0]}): stages must be in increasing order")
            clean.append((int(start), size))
        self.stages, self.unit, self.rampup = tuple(clean), unit, rampup
        self._starts = [s for s, _ in clean]
        self._spans = self._nominal()
        self._span_steps = [sp.step for sp in self._spans]
        self._span_samples = [sp.samples for sp in self._spans]

    def _nominal(self) -> list[_Span]:
        """The stages as (first step, samples before it, size), the schedule followed from step 0.

        By samples, a stage begins at the first step whose consumed samples reach its start; one that
        is overtaken (its start already passed when the stage before began) never serves a step.
        """
        spans = [_Span(0, 0, self.stages[0][1])]
        for start, size in self.stages[1:]:
            last = spans[-1]
            if self.unit == "steps":
                spans.append(_Span(start, last.samples + (start - last.step) * last.size, size))
            elif start <= last.samples:
                spans[-1] = last._replace(size=size)
            else:
                n = -(-(start - last.samples) // last.size)
                spans.append(_Span(last.step + n, last.samples + n * last.size, size))
        return spans

    @property
    def fixed(self) -> bool:
        """One size for the whole run."""
        return len(self.stages) == 1

    @property
    def sizes(self) -> list[int]:
        """Every size a step can have, in stage order (without repeats)."""
        return list(dict.fromkeys(size for _, size in self.stages))

    def size(self, step: int, samples: int) -> int:
        """The size of the step ``step`` that starts after ``samples`` samples were consumed."""
        at = step if self.unit == "steps" else samples
        return self.stages[bisect.bisect_right(self._starts, at) - 1][1]

    def samples_at(self, step: int) -> int:
        """Samples consumed before ``step`` when the schedule is followed from step 0."""
        sp = self._spans[bisect.bisect_right(self._span_steps, step) - 1]
        return sp.samples + (step - sp.step) * sp.size

    def size_at(self, step: int) -> int:
        """The size of ``step`` when the schedule is followed from step 0."""
        return self._spans[bisect.bisect_right(self._span_steps, step) - 1].size

    def steps_for(self, samples: int) -> int:
        """The fewest steps from step 0 whose sizes add up to ``samples`` or more."""
        if samples <= 0:
            return 0
        sp = self._spans[bisect.bisect_left(self._span_samples, samples) - 1]
        return sp.step + -(-(samples - sp.samples) // sp.size)

    def full_steps(self, samples: int) -> int:
        """The most steps from step 0 whose sizes add up to ``samples`` or fewer (every step full).

        Example:
            >>> s = BatchSchedule([(0, 2), (3, 4)])   # 2, 2, 2, 4, 4, ...
            >>> [s.full_steps(n) for n in (5, 6, 9, 10)], [s.steps_for(n) for n in (5, 6, 9, 10)]
            ([2, 3, 3, 4], [3, 3, 4, 4])
        """
        k = self.steps_for(samples)
        return k if self.samples_at(k) == samples else k - 1

    # --- resume checks ----------------------------------------------------------------------

    def begun(self, step: int, samples: int) -> list:
        """The stages that began before the position (step, samples), as they are written."""
        at = step if self.unit == "steps" else samples
        return [[self.unit if s else None, s, b] for s, b in self.stages if s < at]

    def digest(self, step: int, samples: int) -> list:
        """``[count, digest]`` of the stages begun before the position: what a state records."""
        begun = self.begun(step, samples)
        return [len(begun), json_sha256(begun)[:12]]

    def change(self, saved: list, step: int, samples: int) -> str | None:
        """Why a state whose begun stages had digest ``saved`` cannot resume under this schedule."""
        mine = self.digest(step, samples)
        if saved == mine:
            return None
        return (f"the state was saved after {saved[0]} batch-size stage(s) had begun; the {mine[0]} stage(s) of "
                f"this schedule that begin before the saved position (step {step}, {samples} samples) differ: "
                "stages before the saved position must stay as they were (appending stages after it, or "
                "passing one integer size, is fine)")

    def config(self):
        """A short JSON description for states and messages (an int when fixed)."""
        if self.fixed:
            return self.stages[0][1]
        if self.rampup is not None:
            return {"rampup": list(self.rampup)}
        return {"unit": self.unit, "stages": len(self.stages), "digest": json_sha256(self.stages)[:12],
                "first": list(self.stages[0]), "last": list(self.stages[-1])}

    def __eq__(self, other) -> bool:
        return isinstance(other, BatchSchedule) and (self.stages, self.unit) == (other.stages, other.unit)

    def __hash__(self) -> int:
        return hash((self.stages, self.unit))

    def __repr__(self) -> str:
        if self.rampup is not None:
            return "rampup({}, {}, {}, {})".format(*self.rampup)
        return f"BatchSchedule({list(self.stages)}, unit={self.unit!r})"


def as_schedule(value) -> BatchSchedule:
    """``global_batch_size`` as given (an int, a list of (step, size), a ``BatchSchedule``) as a schedule.

    Example:
        >>> as_schedule(8).fixed, as_schedule([(0, 8), (100, 16)]).sizes
        (True, [8, 16])
    """
    if isinstance(value, BatchSchedule):
        return value
    if isinstance(value, (list, tuple)):
        return BatchSchedule(value)
    return BatchSchedule([(0, _positive_int(value, "global_batch_size"))])


def rampup(start: int, increment: int, ramp_samples: int, global_batch_size: int) -> BatchSchedule:
    """Megatron's ``--rampup-batch-size start increment ramp_samples`` with ``--global-batch-size``.

    The size grows from ``start`` by ``increment`` in equal shares of ``ramp_samples`` consumed
    samples, then stays at ``global_batch_size``: a step after ``c`` samples has size
    ``start + floor(c * n / ramp_samples) * increment`` (n increments) while ``c <= ramp_samples``.
    Megatron computes the same with a float division; the two agree except where its rounding errs.

    Example:
        >>> rampup(32, 32, 1000, 128).stages
        ((0, 32), (334, 64), (667, 96), (1000, 128))
    """
    start = _positive_int(start, "rampup start")
    increment = _positive_int(increment, "rampup increment")
    final = _positive_int(global_batch_size, "global_batch_size")
    if isinstance(ramp_samples, bool) or not isinstance(ramp_samples, numbers.Integral) or ramp_samples < 0:
        raise ValueError(f"rampup ramp_samples must be an integer >= 0, got {ramp_samples!r}")
    if final <= start or (final - start) % increment:
        raise ValueError(f"rampup: global_batch_size {final} must exceed start {start} by a multiple of "
                         f"increment {increment}")
    n = (final - start) // increment
    stages: dict[int, int] = {}
    for i in range(n + 1):  # the size reaches start + i*increment once c * n >= i * ramp_samples
        stages[-(-i * int(ramp_samples) // n)] = start + i * increment
    return BatchSchedule(sorted(stages.items()), "samples", rampup=(start, increment, int(ramp_samples), final))
