"""Slice tokenizer: render rows of the ``text``, ``alpaca`` and ``chat`` formats, tokenize, build loss masks.

Every format renders a row to one string plus the character spans that are trained on; the whole
string is tokenized once (so ids equal the tokenizer's own output for the rendered text), and a token
is trained when it *starts* inside a trained span. This needs no ``{% generation %}`` block in the
chat template: assistant contents are located in the rendered conversation, and each span is
extended over the special token that ends the turn (``<|end|>``, ``<|im_end|>``, ``</s>``, ...).

Formats (field names are renameable with ``fields={"instruction": "question", ...}``):

* ``text``: field ``text``; EOS appended; loss on every token.
* ``alpaca``: ``instruction``, optional ``input``, ``output``, rendered with ``ALPACA_PROMPT`` (or
  ``ALPACA_PROMPT_NO_INPUT``); loss on the output and the appended EOS only.
* ``chat``: ``messages`` (role/content) or ShareGPT ``conversations`` (from/value, human/gpt mapped),
  rendered with the tokenizer's chat template; loss on assistant contents and their end-of-turn token.
  With ``transcript=`` the ``messages`` field is instead one string of role-marked turns (hh-rlhf's
  ``"\\n\\nHuman: ...\\n\\nAssistant: ..."``), split into turns by :func:`split_transcript`.

Example:
    >>> from portable_loader.precache import sample_args
    >>> tok = load_tokenizer(sample_args()["tokenizer"])   # the bundled tokenizer; yours: its folder
    >>> fmt = Formatter("alpaca", tok, max_length=2048)
    >>> ids, mask = fmt.encode([{"instruction": "Say hi", "output": "hi"}])[0]
    >>> tok.decode(ids[mask == 1])                         # trained: the output and the EOS only
    'hi<|endoftext|>'
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import numpy as np

from portable_loader.errors import BadRowError, PortableLoaderError, TokenizerError

__all__ = [
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "DEFAULT_CHAT_TEMPLATE",
    "FIELDS",
    "FORMATS",
    "Formatter",
    "MIN_MAX_LENGTH",
    "TRANSCRIPT_PRESETS",
    "split_transcript",
    "transcript_markers",
    "load_tokenizer",
    "load_tokenizer_cached",
    "tokenizer_identity",
    "BackendTokenizer",
]

FORMATS = ("text", "alpaca", "chat")
# The field names each format reads; ``fields={name: column}`` may rename only these.
FIELDS = {"text": ("text",), "alpaca": ("instruction", "input", "output"), "chat": ("messages", "conversations")}
MIN_MAX_LENGTH = 2
# Marker -> role. A marker is matched literally; the text up to the next marker is the turn's content.
TRANSCRIPT_PRESETS = {"hh": {"\n\nHuman:": "user", "\n\nAssistant:": "assistant"}}

# The Stanford Alpaca prompt, verbatim.
ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)

# Used only on request (chat_template="default"), for tokenizers without one (e.g. GPT-2):
# each turn ends with the EOS token, which the mask then treats as the end-of-turn token.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}
_CHAT_ROLES = ("system", "user", "assistant")
_MARK = "\ue000portable_loader:{}\ue001"  # private-use characters around a turn number


def _bad_row(path: str, where, field: str | None, problem: str) -> BadRowError:
    """A BadRowError; ``where`` is ``"line 3"``, or ``(file, "line 3")`` for an input of many files."""
    if isinstance(where, tuple):
        path, where = where
    return BadRowError(path, where, field, problem)


def _tokenizer_dir(path: str) -> str:
    return os.path.dirname(path) if os.path.isfile(path) else path


def tokenizer_identity(path: str) -> dict:
    """sha256 of each tokenizer file in the folder (not model weights): the tokenizer's identity.

    Example:
        >>> from portable_loader.precache import sample_args
        >>> files = tokenizer_identity(sample_args()["tokenizer"])
        >>> sorted(files), len(files["tokenizer.json"])
        (['tokenizer.json', 'tokenizer_config.json'], 64)
    """
    from portable_loader.io import file_digest

    folder = _tokenizer_dir(path)
    if not os.path.isdir(folder):
        raise TokenizerError(f"{path}: no such tokenizer folder")
    found = {n: file_digest(os.path.join(folder, n)) for n in _TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))}
    if not found:
        raise TokenizerError(f"{path}: no tokenizer files (expected tokenizer.json or tokenizer.model)")
    return found


def load_tokenizer(path: str, chat_template: str | None = None, eos_token: str | None = None):
    """A fast ``transformers`` tokenizer from a local folder (never a hub), with EOS resolved.

    ``chat_template`` is template text, a file path, or ``"default"`` (``DEFAULT_CHAT_TEMPLATE``).
    When the tokenizer declares no EOS token, ``eos_token`` names one; failing that, a tokenizer with
    exactly one special added token (GPT-2's ``<|endoftext|>``) uses it.

    Example:
        >>> from portable_loader.precache import sample_args
        >>> tok = load_tokenizer(sample_args()["tokenizer"])
        >>> tok.eos_token
        '<|endoftext|>'
    """
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:  # pragma: no cover - the hf extra is missing
        raise TokenizerError(f"tokenizing needs the 'hf' extra (pip install portable-loader[hf]): {e}") from None
    try:
        if os.path.isfile(path):
            tok = PreTrainedTokenizerFast(tokenizer_file=path)
        elif os.path.isfile(os.path.join(path, "tokenizer_config.json")):
            tok = _named_class(path).from_pretrained(path, local_files_only=True)
        else:
            tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"))
    except Exception as e:  # transformers raises many types for unreadable folders
        raise TokenizerError(f"{path}: cannot load tokenizer: {type(e).__name__}: {e}") from None
    if getattr(tok, "_tokenizer", None) is None:
        raise TokenizerError(f"{path}: a fast tokenizer (tokenizer.json) is needed")
    tok.name_or_path = path  # a bare tokenizer.json leaves it '', and errors name the tokenizer by it
    if eos_token is not None:
        if tok.convert_tokens_to_ids(eos_token) in (None, tok.unk_token_id):
            raise TokenizerError(f"{path}: eos_token {eos_token!r} is not in the vocabulary")
        tok.eos_token = eos_token
    elif tok.eos_token_id is None:
        special = [t.content for t in tok.added_tokens_decoder.values() if t.special]
        if len(special) == 1:
            tok.eos_token = special[0]
    if chat_template is not None:
        tok.chat_template = read_template(chat_template)
    return tok


_BACKEND_CACHE_VERSION = 1  # of the entries below: a change of their layout or meaning makes new keys


class BackendTokenizer:
    """A loaded tokenizer as the ``text`` and ``alpaca`` formats use it, with no ``transformers``
    behind it: the ``tokenizers`` backend that :func:`load_tokenizer` built, its EOS token, its
    special tokens; made by :func:`load_tokenizer_cached`. It has no chat template (the ``chat``
    format renders through ``transformers``).

    Example:
        >>> from tokenizers import Tokenizer, models
        >>> tok = BackendTokenizer(Tokenizer(models.WordLevel({"hi": 0, "<eos>": 1}, unk_token="hi")), "<eos>", 1, [(1, "<eos>")], "toy")
        >>> tok.eos_token_id, tok.decode([0, 1]), [t.content for t in tok.added_tokens_decoder.values()]
        (1, 'hi <eos>', ['<eos>'])
    """

    chat_template = None

    def __init__(self, backend, eos_token: str | None, eos_token_id: int | None, special, name_or_path: str):
        self._tokenizer, self.eos_token, self.eos_token_id = backend, eos_token, eos_token_id
        self.special, self.name_or_path = [(int(i), str(c)) for i, c in special], name_or_path

    @property
    def added_tokens_decoder(self) -> dict:
        from tokenizers import AddedToken

        return {i: AddedToken(c, special=True) for i, c in self.special}

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def _tokenizer_cache_dir() -> str | None:
    folder = os.environ.get("PORTABLE_LOADER_TOKENIZER_CACHE")
    if folder is not None:
        return None if folder.lower() in ("", "0", "off", "false", "no") else folder
    return os.path.join(os.path.expanduser("~"), ".cache", "portable_loader", "tokenizers")


def _backend_key(path: str, eos_token: str | None) -> str | None:
    """What decides the backend ``load_tokenizer`` builds: the tokenizer's files, the EOS asked for,
    and the versions of the code that builds it (transformers rebuilds some backends, e.g.
    Llama's, instead of reading tokenizer.json as it is); None where a version is unknown."""
    import hashlib
    import json
    from importlib import metadata

    from portable_loader.io import file_digest

    try:
        versions = [metadata.version("transformers"), metadata.version("tokenizers")]
    except metadata.PackageNotFoundError:
        return None
    files = {"<file>": file_digest(path)} if os.path.isfile(path) else tokenizer_identity(path)
    text = json.dumps([_BACKEND_CACHE_VERSION, versions, files, eos_token], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def load_tokenizer_cached(path: str, eos_token: str | None = None):
    """:func:`load_tokenizer` for the ``text`` and ``alpaca`` formats, without importing
    ``transformers`` once it has loaded this tokenizer once.

    Loading through ``transformers`` costs ~0.6 s of its import, and it does not read every
    tokenizer.json as it is (it rebuilds Llama-style backends: phi-3-mini's raw tokenizer.json gives
    other ids for a quarter of real rows), so that load is the reference. Its backend, serialized
    by ``tokenizers`` itself, is kept in ``$PORTABLE_LOADER_TOKENIZER_CACHE`` (default
    ``~/.cache/portable_loader/tokenizers``; ``off`` keeps nothing), under a key of the tokenizer's
    files, ``eos_token`` and the versions of ``transformers`` and ``tokenizers``; a later call with
    the same key reads it back (~0.1 s) as a :class:`BackendTokenizer`. A miss, an unreadable
    entry or a folder that cannot be written falls back to :func:`load_tokenizer`.

    Example:
        >>> from portable_loader.precache import sample_args
        >>> path = sample_args()["tokenizer"]
        >>> first = load_tokenizer_cached(path)    # the first time through transformers, kept
        >>> again = load_tokenizer_cached(path)    # then from the kept backend
        >>> type(again).__name__, again.eos_token, again._tokenizer.encode("hi there").ids == first._tokenizer.encode("hi there").ids
        ('BackendTokenizer', '<|endoftext|>', True)
    """
    import json

    folder = _tokenizer_cache_dir()
    key = _backend_key(path, eos_token) if folder is not None else None
    if key is None:
        return load_tokenizer(path, eos_token=eos_token)
    entry = os.path.join(folder, f"{key}.json")
    try:
        with open(entry, encoding="utf-8") as f:
            kept = json.load(f)
        from tokenizers import Tokenizer

        return BackendTokenizer(Tokenizer.from_str(kept["backend"]), kept["eos_token"], kept["eos_token_id"],
                                kept["special"], path)
    except Exception:  # noqa: BLE001 - a miss, or an entry damaged in any way: the reference load
        pass
    tok = load_tokenizer(path, eos_token=eos_token)
    backend = tok._tokenizer.to_str()
    from tokenizers import Tokenizer

    # Kept only where the serialized form reads back as the same tokenizer.
    if Tokenizer.from_str(backend).to_str() == backend:
        special = [(i, t.content) for i, t in tok.added_tokens_decoder.items() if t.special]
        kept = {"backend": backend, "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id, "special": special}
        try:
            os.makedirs(folder, exist_ok=True)
            tmp = f"{entry}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(kept, f)
            os.replace(tmp, entry)  # readers see a whole entry or none
        except OSError:
            pass
    return tok


def _named_class(path: str):
    """The class ``tokenizer_config.json`` names, imported alone; else ``AutoTokenizer``.

    AutoTokenizer resolves the same class, but importing it imports torch (transformers' configs do):
    seconds and ~200 MiB in every process that only tokenizes.
    """
    import json

    import transformers

    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    # AutoTokenizer prefers the fast class, so the Fast name first (an alias of the plain one in transformers 5).
    for candidate in (f"{name}Fast", name) if isinstance(name, str) and name.isidentifier() else ():
        try:
            return getattr(transformers, candidate)
        except (AttributeError, ImportError):  # not a class this transformers knows
            continue
    from transformers import AutoTokenizer

    return AutoTokenizer


def read_template(template: str) -> str:
    """The chat template text for ``template``: a file, ``"default"``, or template text itself."""
    if template == "default":
        return DEFAULT_CHAT_TEMPLATE
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            text = f.read()
        if template.endswith(".json"):
            import json

            text = json.loads(text).get("chat_template", text)
        return text
    if "{%" in template or "{{" in template:
        return template
    raise TokenizerError(f"chat template {template!r}: not a file, not 'default', not template text")


class Formatter:
    """Turns rows of one format into ``(input_ids int32, loss_mask uint8)`` pairs.

    ``encode(rows, where)`` returns, per row, either the pair or a string saying why the row was
    dropped (``"overlong"``, ``"no_target"``, ``"empty"``, ``"bad_row"``); ``truncated`` counts
    truncations. Malformed rows raise ``BadRowError`` naming the row (``where(i)``) and field, or with
    ``on_bad_row="skip"`` are dropped as ``"bad_row"``.

    Example:
        >>> from portable_loader.precache import sample_args
        >>> fmt = Formatter("text", load_tokenizer(sample_args()["tokenizer"]), max_length=4)
        >>> fmt.encode([{"text": "hi"}, {"text": "far too long for four tokens"}])
        [(array([76, 77,  0], dtype=int32), array([1, 1, 1], dtype=uint8)), 'overlong']
    """

    def __init__(
        self,
        fmt: str,
        tokenizer,
        *,
        fields: dict[str, str] | None = None,
        max_length: int | None = None,
        overlong: str = "drop",
        path: str = "<input>",
        on_bad_row: str = "error",
        transcript: str | dict[str, str] | None = None,
    ):
        if fmt not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
        if overlong not in ("drop", "truncate"):
            raise ValueError(f"overlong must be 'drop' or 'truncate', got {overlong!r}")
        if max_length is not None and max_length < MIN_MAX_LENGTH:
            raise ValueError(f"max_length must be >= {MIN_MAX_LENGTH}, got {max_length}")
        self.fmt, self.tok, self.path = fmt, tokenizer, path
        self.fields = check_fields(fmt, fields)
        if transcript is not None and fmt != "chat":
            raise PortableLoaderError(f"transcript applies to the chat format only, not {fmt}")
        self.transcript = None if transcript is None else transcript_markers(transcript)
        self.max_length, self.overlong, self.on_bad_row = max_length, overlong, on_bad_row
        self.backend = tokenizer._tokenizer
        self.eos_id = tokenizer.eos_token_id
        if fmt in ("text", "alpaca") and self.eos_id is None:
            raise TokenizerError(
                f"tokenizer {tokenizer.name_or_path!r} has no EOS token; the {fmt} format appends one "
                "(set eos_token in tokenizer_config.json or pass --eos-token)"
            )
        if fmt == "chat" and not tokenizer.chat_template:
            raise TokenizerError(
                f"tokenizer {tokenizer.name_or_path!r} has no chat template: pass --chat-template FILE, "
                "or --chat-template default for a simple built-in one"
            )
        self.truncated = 0
        self._render: Callable[[dict, Callable[[], str]], tuple[str, list[tuple[int, int]]]] = getattr(
            self, f"_render_{fmt}"
        )
        # What the post-processor adds after a sequence (e.g. an EOS when add_eos_token is set).
        plain = self.backend.encode("a", add_special_tokens=False).ids
        full = self.backend.encode("a", add_special_tokens=fmt != "chat").ids
        self._post_suffix = len(full) - len(plain) - _find(full, plain)
        self._post_eos = fmt != "chat" and self._post_suffix > 0 and full[-1] == self.eos_id
        # The text format trains on every token, so it needs no character offsets: the Rust encoder's
        # encode_batch_fast skips computing them (~20% of encode_batch's time), ids unchanged.
        fast = getattr(self.backend, "encode_batch_fast", None) if fmt == "text" else None
        self._encode_batch = fast or self.backend.encode_batch
        self._turn_ends = sorted(
            {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True
        )

    # --- rendering: row -> (text, trained character spans) -------------------------------------

    def _field(self, row: dict, name: str, where: Callable[[], str], required: bool = True) -> Any:
        column = self.fields.get(name, name)
        if column not in row or row[column] is None:
            if required:
                raise _bad_row(self.path, where(), column, self._missing(row, name, column))
            return None
        return row[column]

    def _missing(self, row: dict, name: str, column: str) -> str:
        """Why a field is missing, with the row's own keys: a typo in ``--field`` shows at once."""
        mapped = f" (the {self.fmt} field {name!r}, renamed by fields/--field)" if column != name else ""
        keys = sorted(map(str, row))
        shown = ", ".join(keys[:12]) + (f", ... ({len(keys)} in all)" if len(keys) > 12 else "")
        return f"missing{mapped}; the row has: {shown or 'no fields'}"

    def _text_field(self, row, name, where, required=True) -> str | None:
        value = self._field(row, name, where, required)
        if value is not None:
            _check_text(value, self.path, where, self.fields.get(name, name))
        return value

    def _render_text(self, row, where):
        text = self._text_field(row, "text", where)
        return text, [(0, len(text))]

    def _render_alpaca(self, row, where):
        instruction = self._text_field(row, "instruction", where)
        extra = self._text_field(row, "input", where, required=False) or ""
        output = self._text_field(row, "output", where)
        template = ALPACA_PROMPT if extra.strip() else ALPACA_PROMPT_NO_INPUT
        prompt = template.format(instruction=instruction, input=extra)
        return prompt + output, [(len(prompt), len(prompt) + len(output))]

    def _messages(self, row, where) -> list[dict]:
        if self.transcript is not None:
            column = self.fields.get("messages", "messages")
            text = self._field(row, "messages", where)
            _check_text(text, self.path, where, column)
            try:
                return split_transcript(text, self.transcript)
            except ValueError as e:
                raise _bad_row(self.path, where(), column, str(e)) from None
        if "messages" in self.fields or "messages" in row:
            column, role_key, text_key, roles = self.fields.get("messages", "messages"), "role", "content", None
        elif "conversations" in self.fields or "conversations" in row:
            column, role_key, text_key, roles = self.fields.get("conversations", "conversations"), "from", "value", _SHAREGPT_ROLES
        else:
            raise _bad_row(
                self.path, where(), "messages",
                f"missing (expected 'messages' or 'conversations'); the row has: {', '.join(sorted(map(str, row))) or 'no fields'}",
            )
        turns = row.get(column)
        if not isinstance(turns, list):
            raise _bad_row(self.path, where(), column, f"expected a list of turns, got {type(turns).__name__}")
        messages = []
        for i, turn in enumerate(turns):
            field = f"{column}[{i}]"
            if not isinstance(turn, dict):
                raise _bad_row(self.path, where(), field, f"expected an object, got {type(turn).__name__}")
            role, content = turn.get(role_key), turn.get(text_key)
            role = roles.get(role) if roles is not None and isinstance(role, str) else role
            if role not in _CHAT_ROLES:
                raise _bad_row(self.path, where(), f"{field}.{role_key}", f"unknown chat role {turn.get(role_key)!r}")
            _check_text(content, self.path, where, f"{field}.{text_key}")
            messages.append({"role": role, "content": content})
        return messages

    def _render_chat(self, row, where):
        messages = self._messages(row, where)
        try:
            text = self.tok.apply_chat_template(messages, tokenize=False)
            # The same conversation with each content replaced by a marker says exactly where each
            # content starts, even when it also occurs in the template's own text ("assistant", "|").
            marked = self.tok.apply_chat_template(
                [dict(m, content=_MARK.format(i)) for i, m in enumerate(messages)], tokenize=False
            )
        except Exception as e:  # the template's own raise_exception, or a jinja error
            raise _bad_row(self.path, where(), "messages", f"chat template failed: {e}") from None
        spans, shift, at = [], 0, 0
        for i, m in enumerate(messages):
            content, mark = m["content"], _MARK.format(i)
            found = marked.find(mark, at)
            start = found + shift
            if found < 0 or text[start : start + len(content)] != content:
                if m["role"] != "assistant" and found < 0:
                    continue  # a turn the template leaves out
                raise _bad_row(
                    self.path, where(), "messages",
                    f"the chat template does not embed this {m['role']} turn verbatim; cannot place the loss mask",
                )
            at, shift = found + len(mark), shift + len(content) - len(mark)
            if m["role"] == "assistant" and content:
                spans.append((start, self._end_of_turn(text, start + len(content))))
        return text, spans

    def _end_of_turn(self, text: str, end: int) -> int:
        """Extend a span over the special token that closes the turn (after optional spaces)."""
        gap = len(text[end : end + 4]) - len(text[end : end + 4].lstrip(" "))
        for token in self._turn_ends:
            if text.startswith(token, end + gap):
                return end + gap + len(token)
        return end

    # --- tokenizing -----------------------------------------------------------------------------

    def encode(self, rows: Sequence[dict | BadRowError], where: Callable[[int], str] = lambda i: f"row {i}") -> list:
        if self.fmt == "text":
            return self._encode_text(rows, where)
        texts, spans, out = [], [], [None] * len(rows)
        for i, row in enumerate(rows):
            rendered = self._rendered(row, i, where)
            if rendered is None:
                out[i] = "bad_row"
                continue
            text, row_spans = rendered
            if not row_spans:
                out[i] = "no_target"
                continue
            texts.append(text)
            spans.append((i, row_spans))
        if not texts:
            return out
        encodings = self._encode_batch(texts, add_special_tokens=self.fmt != "chat")
        for (i, row_spans), text, enc in zip(spans, texts, encodings):
            out[i] = self._finish(enc, len(text), row_spans)
        return out

    def _rendered(self, row, i: int, where):
        """``(text, spans)`` of row ``i``, or None for a bad row skipped (``on_bad_row="skip"``); else its error."""
        try:
            if isinstance(row, BadRowError):
                raise row
            if not isinstance(row, dict):
                raise _bad_row(self.path, where(i), None, f"expected an object, got {type(row).__name__}")
            return self._render(row, lambda: where(i))
        except BadRowError:
            if self.on_bad_row != "skip":
                raise
            return None

    def _encode_text(self, rows, where) -> list:
        """``encode`` for the ``text`` format: a row's text is its record, every token trained.

        Rows that are plainly good (a dict whose text field is an ASCII string, or one that encodes as
        UTF-8) are taken without the general path's per-row calls; any other row goes through
        ``_render_text``, which raises (or skips) with the row's own error.
        """
        column = self.fields.get("text", "text")
        texts, kept, out = [], [], [None] * len(rows)
        for i, row in enumerate(rows):
            text = row.get(column) if type(row) is dict else None
            if type(text) is not str or not (text.isascii() or _utf8(text)):
                rendered = self._rendered(row, i, where)
                if rendered is None:
                    out[i] = "bad_row"
                    continue
                text = rendered[0]
            if not text or text.isspace():  # (what `not text.strip()` says, without a copy)
                out[i] = "empty"
                continue
            texts.append(text)
            kept.append(i)
        if texts:
            for i, record in zip(kept, self._finish_text(self._encode_batch(texts, add_special_tokens=True))):
                out[i] = record
        return out

    def _finish_text(self, encodings) -> list:
        """``_finish`` of the ``text`` format for a whole batch: the same records, built per batch.

        Every record's ids (and its EOS) go into one int32 array and every mask is a slice of one
        array of ones: a few numpy calls a batch instead of several a record, which on short records
        (~100 tokens) cost as much as a tenth of the encoder's time. The slices are read-only views
        (records of one batch share their buffers, so none may be written in place).
        """
        lists = [enc.ids for enc in encodings]
        append_eos = not self._post_eos
        sizes = np.fromiter(map(len, lists), np.int64, len(lists)) + append_eos
        flat: list = []
        if append_eos:
            extend, append, eos = flat.extend, flat.append, self.eos_id
            for raw in lists:
                extend(raw)
                append(eos)
        else:
            for raw in lists:
                flat.extend(raw)
        ids = np.array(flat, dtype=np.int32)
        mask = np.ones(ids.size, dtype=np.uint8)
        ids.flags.writeable = mask.flags.writeable = False
        ends = np.cumsum(sizes)
        starts = ends - sizes
        cut = np.zeros(sizes.size, bool) if self.max_length is None else sizes > self.max_length
        if cut.any():
            if self.overlong == "drop":
                records: list = [None if c else (ids[a:b], mask[a:b])
                                 for a, b, c in zip(starts.tolist(), ends.tolist(), cut.tolist())]
                return ["overlong" if r is None else r if b > a else "no_target"
                        for r, a, b in zip(records, starts.tolist(), ends.tolist())]
            ends = np.minimum(ends, starts + self.max_length)
        self.truncated += int(np.count_nonzero(cut & (sizes > 0)))
        return [(ids[a:b], mask[a:b]) if b > a else "no_target" for a, b in zip(starts.tolist(), ends.tolist())]

    def _token_at(self, enc, char: int, text_len: int, content_tokens: int) -> int:
        """Index of the first token that starts at or after ``char`` (one Rust lookup, no offset list)."""
        while char < text_len:
            t = enc.char_to_token(char)
            if t is not None:
                return t if enc.token_to_chars(t)[0] >= char else t + 1
            char += 1  # a character no token covers (absorbed whitespace): try the next one
        return content_tokens

    def _finish(self, enc, text_len: int, row_spans):
        raw = enc.ids
        n = len(raw)
        append_eos = self.fmt != "chat" and not self._post_eos
        ids = np.empty(n + append_eos, dtype=np.int32)
        ids[:n] = raw
        if self.fmt == "text":
            mask = np.ones(ids.size, dtype=np.uint8)
        else:
            mask = np.zeros(ids.size, dtype=np.uint8)
            content = n - self._post_suffix
            for s, e in row_spans:
                mask[self._token_at(enc, s, text_len, content) : self._token_at(enc, e, text_len, content)] = 1
        if append_eos:
            ids[n] = self.eos_id
            mask[n] = 1
        elif self.fmt != "chat":
            mask[n - 1] = 1  # the tokenizer's post-processor appended EOS already
        cut = self.max_length is not None and ids.size > self.max_length
        if cut:
            if self.overlong == "drop":
                return "overlong"
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        if not mask.any():
            return "no_target"
        self.truncated += cut
        return ids, mask


def check_fields(fmt: str, fields: dict[str, str] | None) -> dict[str, str]:
    """``fields`` checked against the names ``fmt`` reads, so that a typo is refused, not ignored.

    Example:
        >>> check_fields("alpaca", {"instrucion": "question"})
        Traceback (most recent call last):
        portable_loader.errors.PortableLoaderError: unknown field 'instrucion' for the alpaca format: it reads instruction, input, output (fields/--field NAME=COLUMN reads field NAME from input column COLUMN)
    """
    fields = dict(fields or {})
    for name, column in fields.items():
        if name not in FIELDS[fmt]:
            raise PortableLoaderError(
                f"unknown field {name!r} for the {fmt} format: it reads {', '.join(FIELDS[fmt])} "
                "(fields/--field NAME=COLUMN reads field NAME from input column COLUMN)"
            )
        if not isinstance(column, str) or not column:
            raise PortableLoaderError(f"field {name!r}: the column must be a non-empty string, got {column!r}")
    return fields


def transcript_markers(spec: str | dict[str, str]) -> dict[str, str]:
    """The ``{marker: role}`` table of a transcript option: a preset name (``"hh"``) or the table itself.

    Example:
        >>> transcript_markers("hh")
        {'\\n\\nHuman:': 'user', '\\n\\nAssistant:': 'assistant'}
    """
    if isinstance(spec, str):
        if spec not in TRANSCRIPT_PRESETS:
            raise PortableLoaderError(
                f"unknown transcript preset {spec!r}: the presets are {', '.join(TRANSCRIPT_PRESETS)}, "
                "or give markers as {marker: role}"
            )
        return dict(TRANSCRIPT_PRESETS[spec])
    if not isinstance(spec, dict) or not spec:
        raise PortableLoaderError(f"transcript must be a preset name or a non-empty {{marker: role}} dict, got {spec!r}")
    for marker, role in spec.items():
        if not isinstance(marker, str) or not marker.strip():
            raise PortableLoaderError(f"transcript marker {marker!r}: must be a non-blank string")
        if role not in _CHAT_ROLES:
            raise PortableLoaderError(f"transcript marker {marker!r}: role must be one of {_CHAT_ROLES}, got {role!r}")
    return dict(spec)


def split_transcript(text: str, markers: dict[str, str]) -> list[dict]:
    """Split one role-marked transcript into ``[{"role", "content"}, ...]`` turns.

    A turn starts at a marker (matched literally; where two markers match at one place the longest
    wins) and runs to the next one; its content is stripped of surrounding whitespace. Text before the
    first marker, or no marker at all, is a ``ValueError``.

    Example:
        >>> split_transcript("\\n\\nHuman: hi\\n\\nAssistant: hello!", transcript_markers("hh"))
        [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'hello!'}]
    """
    import re

    pattern = re.compile("|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)))
    found = list(pattern.finditer(text))
    if not found:
        raise ValueError(f"no transcript marker in the text (expected {', '.join(map(repr, markers))})")
    if text[: found[0].start()].strip():
        head = text[: found[0].start()].strip()
        raise ValueError(f"text before the first transcript marker: {head[:40]!r}")
    ends = [m.start() for m in found[1:]] + [len(text)]
    return [{"role": markers[m.group()], "content": text[m.end() : end].strip()} for m, end in zip(found, ends)]


def _utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_text(value, path: str, where: Callable[[], str], field: str) -> None:
    if not isinstance(value, str):
        raise _bad_row(path, where(), field, f"expected a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate from a JSON "\\udXXX" escape: not text
        raise _bad_row(path, where(), field, f"not valid Unicode: {e.reason} at character {e.start}") from None


def _find(seq: list, sub: list) -> int:
    for i in range(len(seq) - len(sub) + 1):
        if seq[i : i + len(sub)] == sub:
            return i
    raise TokenizerError("the tokenizer's post-processor alters the text's own tokens; unsupported")
