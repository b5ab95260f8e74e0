"""The errors users see. Each one names what it is about (file, row, field) in its message."""

from __future__ import annotations

import functools
import os

#: Set to 1 to keep the internal traceback (a worker process's included) on the errors users see.
DEBUG_VARIABLE = "PORTABLE_LOADER_DEBUG"


class PortableLoaderError(ValueError):
    """Base class: a problem with the user's input, tokenizer, cache or state, never an internal bug."""


class InputError(PortableLoaderError):
    """The input cannot be read or is empty.

    Example:
        >>> raise InputError("data.jsonl: no rows")
        Traceback (most recent call last):
        portable_loader.errors.InputError: data.jsonl: no rows
    """


class BadRowError(PortableLoaderError):
    """One row is malformed: the message names the file, row (or line) and field.

    Example:
        >>> str(BadRowError("train.jsonl", "line 3", "output", "missing"))
        'train.jsonl: line 3: field output: missing'
    """

    def __init__(self, path: str, where: str, field: str | None, problem: str):
        self.path, self.where, self.field, self.problem = path, where, field, problem
        field_txt = f"field {field}: " if field else ""
        super().__init__(f"{path}: {where}: {field_txt}{problem}")

    def __reduce__(self):  # survives the trip from a worker process
        return (type(self), (self.path, self.where, self.field, self.problem))


class TokenizerError(PortableLoaderError):
    """The tokenizer cannot be loaded or lacks what the format needs (EOS, a chat template)."""


class CacheError(PortableLoaderError):
    """A cache that is missing, incomplete, corrupted or of another format version: never served."""


class FilterError(PortableLoaderError):
    """A filter rejected so many records in a row that no batch can be filled (or the whole stream).

    Example:
        >>> raise FilterError("filter is_short rejected 20 records in a row from stream position 0")
        Traceback (most recent call last):
        portable_loader.errors.FilterError: filter is_short rejected 20 records in a row from stream position 0
    """


class StateError(PortableLoaderError):
    """A loader state that is malformed, edited, of another version or config, or past the stream's end.

    Example:
        >>> raise StateError("row", "past the end of window 3 (12 rows)")
        Traceback (most recent call last):
        portable_loader.errors.StateError: loader state: field 'row': past the end of window 3 (12 rows)
    """

    def __init__(self, field: str | None, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"loader state: field {field!r}: {problem}" if field else f"loader state: {problem}")

    def __reduce__(self):  # survives the trip from a worker process
        return (type(self), (self.field, self.problem))


class PositionOutOfRange(PortableLoaderError, IndexError):
    """A stream position past the end of a finite stream (a sampler's or another stream order's).

    It is a ``ValueError`` for callers and an ``IndexError`` for Grain, whose ``DataLoader`` reads a
    sampler until ``IndexError`` when it has no length.

    Example:
        >>> from portable_loader import LCGSampler
        >>> LCGSampler(4, seed=0, num_epochs=1).stream_indices([4])
        Traceback (most recent call last):
        portable_loader.errors.PositionOutOfRange: index must be in [0, 4) for this sampler's stream, got 4
    """


class UnpicklableError(PortableLoaderError, TypeError):
    """What a loader must send to its worker processes cannot be pickled; the message names the part that fails.

    A ``TypeError`` (pickle's own kind of error for an object it cannot handle) and a ``ValueError``
    (what Grain raises here, and what ``PortableLoaderError`` is), so code that catches either works.

    Example:
        >>> raise UnpicklableError("the dataset cannot be sent to the loader's worker processes: a lock")
        Traceback (most recent call last):
        portable_loader.errors.UnpicklableError: the dataset cannot be sent to the loader's worker processes: a lock
    """


class WorkerError(RuntimeError):
    """A loader worker (a process or the prefetch thread) failed or died; the message holds the
    worker's own traceback, or how it ended.

    Example:
        >>> raise WorkerError("loader worker 0 (pid 4242) was terminated unexpectedly with exit code -9")
        Traceback (most recent call last):
        portable_loader.errors.WorkerError: loader worker 0 (pid 4242) was terminated unexpectedly with exit code -9
    """


def raised_here(function):
    """Decorate a public function so a :class:`PortableLoaderError` from inside it is raised from the
    caller's frame: the library's frames and a worker pool's ``RemoteTraceback`` are dropped, since
    the message already names the file, row and field. ``PORTABLE_LOADER_DEBUG=1`` keeps them.

    Example:
        >>> @raised_here
        ... def load(path):
        ...     raise InputError(f"{path}: no rows")
        >>> try:
        ...     load("data.jsonl")
        ... except InputError as e:
        ...     print(e, e.__cause__, e.__traceback__.tb_next.tb_next)
        data.jsonl: no rows None None
    """

    @functools.wraps(function)
    def public(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except PortableLoaderError as e:
            if os.environ.get(DEBUG_VARIABLE):
                raise
            raise e.with_traceback(None) from None

    return public
