"""What every command line shares: argument errors and user errors as one ``error:`` line and exit
code 2, with the traceback only under ``-v`` or ``PORTABLE_LOADER_DEBUG=1``.

Example:
    >>> p = Parser(prog="demo")
    >>> _ = p.add_argument("--steps", type=int_at_least(1))
    >>> p.parse_args(["--steps", "3"]).steps
    3
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from portable_loader.errors import DEBUG_VARIABLE, PortableLoaderError

__all__ = ["Parser", "int_at_least", "add_verbose", "user_error"]

#: What a command line answers a user's mistake with (argparse's own code for bad arguments).
USER_ERROR = 2


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one ``error:`` line and exit code 2 (argparse prints its usage too).

    Example:
        >>> p = Parser(prog="demo")
        >>> _ = p.add_argument("--n", type=int)
        >>> import contextlib, io
        >>> err = io.StringIO()
        >>> with contextlib.redirect_stderr(err):
        ...     try:
        ...         p.parse_args(["--n", "x"])
        ...     except SystemExit as e:
        ...         print(e.code)
        2
        >>> err.getvalue()
        "error: argument --n: invalid int value: 'x' (see demo --help)\\n"
    """

    def error(self, message):
        self.exit(USER_ERROR, f"error: {message} (see {self.prog} --help)\n")


def int_at_least(low: int, note: str = ""):
    """An argparse ``type`` that takes an integer ``>= low``; ``note`` is added to the error.

    Example:
        >>> int_at_least(2)("5")
        5
        >>> int_at_least(2, " (a batch and a resumed batch)")("1")
        Traceback (most recent call last):
        argparse.ArgumentTypeError: must be >= 2 (a batch and a resumed batch), got 1
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}{note}, got {value}")
        return value

    return parse


def add_verbose(parser: argparse.ArgumentParser) -> None:
    """Add ``-v/--verbose``: an error also prints its whole traceback, worker processes' included.

    Example:
        >>> p = Parser(prog="demo")
        >>> add_verbose(p)
        >>> p.parse_args(["-v"]).verbose
        True
    """
    parser.add_argument("-v", "--verbose", action="store_true",
                        help=f"on an error, print its whole traceback too (as {DEBUG_VARIABLE}=1 does)")


def user_error(error: BaseException, verbose: bool = False) -> int:
    """Print ``error`` as one ``error:`` line on stderr (after its traceback when ``verbose`` or
    debugging) and return the exit code 2. Call it inside the ``except`` block.

    Example:
        >>> import contextlib, io
        >>> err = io.StringIO()
        >>> with contextlib.redirect_stderr(err):
        ...     try:
        ...         raise PortableLoaderError("data.jsonl: no rows")
        ...     except PortableLoaderError as e:
        ...         code = user_error(e)
        >>> code, err.getvalue()
        (2, 'error: data.jsonl: no rows\\n')
    """
    if verbose or os.environ.get(DEBUG_VARIABLE):
        traceback.print_exc(file=sys.stderr)
    print(f"error: {error}", file=sys.stderr)
    return USER_ERROR

