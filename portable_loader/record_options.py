"""``RecordOptions``: how an input row becomes a record, as one frozen, checked value.

The tokenizer, the format and the options that change a record's tokens (``fields``,
``max_length``, ``overlong``, ``chat_template``, ``eos_token``, ``on_bad_row``, ``transcript``)
are checked once, here, and travel as this one value: ``pl.precache`` and ``pl.tokenized`` build it
from their keyword options, the command line from its flags, and the build, its engines (local
processes or Ray tasks) and :class:`~portable_loader.corpora.tokenized.Tokenized` take it and pass it
on. It names its own part of the cache key (:meth:`RecordOptions.key_parts`) and of a manifest's
build options (:meth:`RecordOptions.config`), and makes the
:class:`~portable_loader.tokenize.Formatter` that applies it (:meth:`RecordOptions.formatter`).

What the value leaves out is not about records: which rows (the input and its ``split``), where and
how a cache is built (``out``, ``backend``, ``engine``, ``num_workers``, ...).

Example:
    >>> from portable_loader.precache import sample_args
    >>> opts = RecordOptions(sample_args()["tokenizer"], "chat", max_length=512, transcript="hh")
    >>> opts.max_length, opts.transcript                 # checked and normalized: the preset's markers
    (512, (('\\n\\nHuman:', 'user'), ('\\n\\nAssistant:', 'assistant')))
    >>> RecordOptions(**opts.kwargs()) == opts   # as keyword options: pl.precache(input, out=..., **opts.kwargs())
    True
    >>> RecordOptions(opts.tokenizer, "text", overlong="cut")
    Traceback (most recent call last):
    ValueError: overlong must be 'drop' or 'truncate', got 'cut'
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from typing import Any

from portable_loader.io.remote import is_url
from portable_loader.tokenize import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_NO_INPUT,
    FORMATS,
    MIN_MAX_LENGTH,
    Formatter,
    check_fields,
    load_tokenizer,
    read_template,
    tokenizer_identity,
    transcript_markers,
)

__all__ = ["RecordOptions"]


@dataclasses.dataclass(frozen=True)
class RecordOptions:
    """The tokenizer, the format and the options that decide a record's tokens; checked when made.

    ``tokenizer`` is kept as an absolute path (it must be a local folder or file). ``fields``
    (``{name: column}``) and ``transcript`` (a preset name or ``{marker: role}``) are kept as tuples
    of pairs, sorted by name for ``fields``, so that the value is immutable, hashable and picklable
    (it is handed to worker processes and Ray tasks). See :func:`portable_loader.precache` for what
    each option means.

    Example:
        >>> from portable_loader.precache import sample_args
        >>> fields = {"output": "answer", "instruction": "question"}
        >>> opts = RecordOptions(sample_args()["tokenizer"], "alpaca", fields=fields)
        >>> opts.fields, opts.config()["fields"]
        ((('instruction', 'question'), ('output', 'answer')), {'instruction': 'question', 'output': 'answer'})
        >>> tok = opts.load_tokenizer()
        >>> ids, mask = opts.formatter(tokenizer=tok).encode([{"question": "2 + 2?", "answer": "4"}])[0]
        >>> tok.decode(ids[mask == 1])   # trained: the answer and the EOS
        '4<|endoftext|>'
    """

    tokenizer: str
    format: str
    fields: tuple[tuple[str, str], ...] = ()
    max_length: int | None = None
    overlong: str = "drop"
    chat_template: str | None = None
    eos_token: str | None = None
    on_bad_row: str = "error"
    transcript: tuple[tuple[str, str], ...] | None = None

    def __post_init__(self):
        # The checks run in this order, so that an error is the one users saw before the value existed.
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")
        if self.overlong not in ("drop", "truncate"):
            raise ValueError(f"overlong must be 'drop' or 'truncate', got {self.overlong!r}")
        if self.on_bad_row not in ("error", "skip"):
            raise ValueError(f"on_bad_row must be 'error' or 'skip', got {self.on_bad_row!r}")
        m = self.max_length
        if m is not None and (not isinstance(m, numbers.Integral) or isinstance(m, bool) or m < MIN_MAX_LENGTH):
            raise ValueError(f"max_length must be an integer >= {MIN_MAX_LENGTH} (or None for no limit), got {m!r}")
        fields = check_fields(self.format, dict(self.fields or {}))
        transcript = self.transcript
        if transcript is not None:
            if self.format != "chat":
                raise ValueError(f"transcript applies to the chat format only, not {self.format!r}")
            transcript = transcript_markers(transcript if isinstance(transcript, str) else dict(transcript))
        tokenizer = os.fspath(self.tokenizer)
        if is_url(tokenizer):
            raise ValueError(f"tokenizer must be a local folder, got the URL {tokenizer!r}")
        normal = {
            "tokenizer": os.path.abspath(tokenizer),
            "fields": tuple(sorted(fields.items())),
            "transcript": None if transcript is None else tuple(transcript.items()),
        }
        for name, value in normal.items():
            object.__setattr__(self, name, value)  # a frozen value normalizes itself once, here

    @classmethod
    def take(cls, options: dict[str, Any]) -> tuple["RecordOptions", dict[str, Any]]:
        """The value made of the record options among keyword ``options``, and the other options, for
        the caller to use or refuse.

        Example:
            >>> from portable_loader.precache import sample_args
            >>> given = {"tokenizer": sample_args()["tokenizer"], "format": "text", "max_length": 64, "num_workers": 2}
            >>> opts, rest = RecordOptions.take(given)
            >>> opts.max_length, rest
            (64, {'num_workers': 2})
        """
        names = {f.name for f in dataclasses.fields(cls)}
        mine = {k: v for k, v in options.items() if k in names}
        return cls(**mine), {k: v for k, v in options.items() if k not in names}

    def kwargs(self) -> dict[str, Any]:
        """The value as the keyword options of ``pl.precache``, ``pl.tokenized`` and the constructor."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def config(self) -> dict[str, Any]:
        """The options as a cache's manifest records them (``info`` prints them): ``fields`` and
        ``transcript`` as dicts."""
        return {
            **self.kwargs(),
            "fields": dict(self.fields),
            "transcript": None if self.transcript is None else dict(self.transcript),
        }

    def key_parts(self) -> dict[str, Any]:
        """This value's part of the cache key: the tokenizer's files, not its path; templates as text.

        An option that cannot change a record (a chat template for the text format) is left out, and
        ``transcript`` is absent when unset, so that caches built before it existed keep their keys.

        Example:
            >>> from portable_loader.precache import sample_args
            >>> parts = RecordOptions(sample_args()["tokenizer"], "text", max_length=64).key_parts()
            >>> sorted(parts["tokenizer_files"]), parts["max_length"], "transcript" in parts
            (['tokenizer.json', 'tokenizer_config.json'], 64, False)
        """
        chat = self.format == "chat"
        return {
            "tokenizer_files": tokenizer_identity(self.tokenizer),
            "chat_template": read_template(self.chat_template) if self.chat_template is not None and chat else None,
            "eos_token": self.eos_token,
            "alpaca_template": [ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT] if self.format == "alpaca" else None,
            "format": self.format,
            "fields": dict(self.fields),
            "max_length": self.max_length,
            "overlong": self.overlong,
            "on_bad_row": self.on_bad_row,
            **({"transcript": dict(self.transcript)} if self.transcript is not None else {}),
        }

    def load_tokenizer(self):
        """The tokenizer, with this value's chat template and EOS token (see
        :func:`~portable_loader.tokenize.load_tokenizer`)."""
        return load_tokenizer(self.tokenizer, self.chat_template, self.eos_token)

    def formatter(self, path: str = "<input>", tokenizer=None) -> Formatter:
        """The :class:`~portable_loader.tokenize.Formatter` that applies these options to rows of
        ``path`` (named in errors); ``tokenizer``: one already loaded by :meth:`load_tokenizer`."""
        return Formatter(
            self.format, self.load_tokenizer() if tokenizer is None else tokenizer, fields=dict(self.fields),
            max_length=self.max_length, overlong=self.overlong, path=path, on_bad_row=self.on_bad_row,
            transcript=None if self.transcript is None else dict(self.transcript),
        )
