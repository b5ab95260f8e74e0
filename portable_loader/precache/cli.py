"""The ``python -m portable_loader.precache`` command line.

Building a cache takes options only (``--input ... --format ... --tokenizer ...``, or none for the
bundled sample). Three subcommands look after what was built::

    python -m portable_loader.precache info CACHE [--json]   rows, tokens, length histogram, options
    python -m portable_loader.precache ls [OUT] [--json]     the caches in a folder
    python -m portable_loader.precache rm CACHE [CACHE ...]  delete caches (refuses any other folder)

CACHE and OUT may be URLs (``s3://bucket/caches/...``).

A user's mistake, in the arguments, the data, the tokenizer or a cache, prints one ``error: ...`` line
and exits 2; ``-v`` (or ``PORTABLE_LOADER_DEBUG=1``) prints the traceback before it.

Example:
    $ python -m portable_loader.precache --input hh.jsonl.gz --format chat --tokenizer phi-3-mini \\
          --field messages=chosen --transcript hh
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from portable_loader.cache.manifest import BACKENDS
from portable_loader.cache.opening import open_cache
from portable_loader.command_line import Parser, add_verbose, int_at_least, user_error
from portable_loader.errors import PortableLoaderError
from portable_loader.precache import ENGINES, build, sample_args
from portable_loader.precache.manage import cache_info, format_info, list_caches, remove_cache
from portable_loader.precache.steps import format_dropped
from portable_loader.record_options import RecordOptions
from portable_loader.tokenize import FIELDS, FORMATS, MIN_MAX_LENGTH, TRANSCRIPT_PRESETS

__all__ = ["main"]

SUBCOMMANDS = ("info", "ls", "rm")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one (not ``None``/``False``/``[]``: the help says those)."""

    def _get_help_string(self, action):
        if action.default in (None, False, []):
            return action.help
        return super()._get_help_string(action)


def _parse_fields(pairs: list[str]) -> dict[str, str]:
    fields = {}
    for pair in pairs:
        name, sep, column = pair.partition("=")
        if not sep or not name or not column:
            raise PortableLoaderError(f"--field expects NAME=COLUMN, got {pair!r}")
        fields[name] = column
    return fields


def _parse_transcript(values: list[str]) -> str | dict[str, str] | None:
    """``--transcript hh`` (a preset) or ``--transcript MARKER=ROLE`` repeated, with ``\\n`` escapes."""
    if not values:
        return None
    if len(values) == 1 and "=" not in values[0]:
        return values[0]
    markers = {}
    for value in values:
        marker, sep, role = value.rpartition("=")
        if not sep or not marker:
            raise PortableLoaderError(f"--transcript expects a preset ({', '.join(TRANSCRIPT_PRESETS)}) or MARKER=ROLE, got {value!r}")
        markers[marker.encode("latin-1", "backslashreplace").decode("unicode_escape")] = role
    return markers


def _build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m portable_loader.precache",
        description="Tokenize a dataset into a portable_loader cache and print the cache directory. "
        "With no arguments: the bundled sample chat dataset and tokenizer.",
        epilog="Subcommands: 'info CACHE' (stats), 'ls [OUT]' (list caches), 'rm CACHE...' (delete); "
        "each takes --help.",
        formatter_class=_Help,
    )
    p.add_argument("--input", nargs="+", metavar="PATH",
                   help="files (JSONL(.gz), JSON list, Parquet, .txt), folders of them, globs, or a "
                   "datasets.save_to_disk folder; several are read in the order given")
    p.add_argument("--format", choices=FORMATS, help="text: loss on all; alpaca, chat: loss on the answers only")
    p.add_argument("--tokenizer", help="local tokenizer folder (tokenizer.json [+ tokenizer_config.json])")
    p.add_argument("--out", default="portable_loader_cache", help="parent directory of caches")
    p.add_argument("--max-length", type=int_at_least(MIN_MAX_LENGTH), metavar="TOKENS",
                   help="longest record kept, in tokens (default: no limit); see --overlong")
    p.add_argument("--overlong", choices=("drop", "truncate"), default="drop",
                   help="what happens to a record longer than --max-length (both are counted)")
    p.add_argument("--num-workers", type=int_at_least(0), metavar="N",
                   help="tokenizer processes (default: all cores); 0 or 1: tokenize in this process")
    p.add_argument("--engine", choices=ENGINES, default="local",
                   help="who runs the tasks: local processes, or a Ray cluster (see --ray-address); "
                   "the cache is the same either way")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="--engine ray: 'auto' (the cluster this machine is in) or HOST:PORT of its head "
                   "(default: RAY_ADDRESS, else a Ray started on this machine)")
    p.add_argument("--rows-per-task", type=int_at_least(1), default=None, metavar="ROWS",
                   help="rows per task, so per shard, at most (tasks never span input files; default: the "
                   "input's row count / 64, within [1000, 50000], so the cache never depends on the workers)")
    p.add_argument("--backend", choices=BACKENDS, default="arrow",
                   help="shard format: arrow (memory-mapped, datasets.load_from_disk) or array_record (Grain)")
    p.add_argument("--field", dest="fields", action="append", default=[], metavar="NAME=COLUMN",
                   help="read the format's field NAME from input column COLUMN; names: "
                   + "; ".join(f"{f}: {', '.join(n)}" for f, n in FIELDS.items()))
    p.add_argument("--transcript", action="append", default=[], metavar="PRESET|MARKER=ROLE",
                   help="chat: the messages field is one role-marked string; 'hh' for hh-rlhf "
                   "('\\n\\nHuman:' user, '\\n\\nAssistant:' assistant), or MARKER=ROLE repeated "
                   "(\\n escapes allowed)")
    p.add_argument("--split", help="Hugging Face split slice, e.g. 'train[:1000]'")
    p.add_argument("--chat-template", help="template file, or 'default' for a simple built-in one")
    p.add_argument("--eos-token", help="EOS token, for tokenizers that do not declare one")
    p.add_argument("--on-bad-row", choices=("error", "skip"), default="error",
                   help="a malformed row stops the run, or is skipped and counted")
    p.add_argument("--force", action="store_true", help="rebuild even if the cache exists")
    p.add_argument("--verify", action="store_true", help="check every shard's checksum of the resulting cache")
    p.add_argument("--check", action="store_true",
                   help="tokenize the whole input and report its counts and its first bad row; write no cache")
    add_verbose(p)
    return p


def _build(argv: list[str]) -> int:
    p = _build_parser()
    args = p.parse_args(argv)
    if args.input is None and args.format is None and args.tokenizer is None:
        sample = sample_args()
        args.input, args.format, args.tokenizer = sample["input"], sample["format"], sample["tokenizer"]
    missing = [f"--{n}" for n in ("input", "format", "tokenizer") if getattr(args, n) is None]
    if missing:
        p.error(f"missing {', '.join(missing)} (or give none of them to use the bundled sample)")
    if isinstance(args.input, list) and len(args.input) == 1:
        args.input = args.input[0]  # one path keeps the key a single input always had
    if args.check:
        return _check(args)
    try:
        # Undecorated, so that -v can print the workers' tracebacks that the public function drops.
        path, s = build.__wrapped__(
            args.input, _record(args), out=args.out, split=args.split, num_workers=args.num_workers,
            engine=args.engine, ray_address=args.ray_address, rows_per_task=args.rows_per_task, backend=args.backend,
            force=args.force, show_progress=sys.stderr.isatty(),
        )
        if args.verify:
            open_cache(path, verify=True)
    except PortableLoaderError as e:
        return user_error(e, args.verbose)
    except KeyboardInterrupt:
        print("interrupted: no cache was published", file=sys.stderr)
        return 130
    if s["hit"]:
        print(f"cache hit: {s['rows_out']} records, {s['tokens']} tokens (nothing tokenized, {s['seconds']:.2f} s)")
    else:
        rate = s["rows_in"] / max(s["tokenize_seconds"], 1e-9)
        ran_on = f"workers: {s['num_workers']}"
        if s["engine"] == "ray":
            ran_on = f"Ray CPUs: {s['num_workers']}  nodes: {len(s['nodes'])}  retried: {'unknown' if s['retried'] is None else s['retried']}"
        print(
            f"rows in: {s['rows_in']}  rows out: {s['rows_out']}  dropped: {format_dropped(s['dropped'])}  "
            f"truncated: {s['truncated']}\ntokens: {s['tokens']} ({s['trainable_tokens']} trained)  "
            f"seconds: {s['seconds']:.2f}  rows/s: {rate:,.0f}  tasks: {s['tasks']}  {ran_on}"
        )
    if args.verify:
        print("verified: every shard checksum matches")
    print(path)
    return 0


def _record(args) -> RecordOptions:
    """The record options of the command line: the flags bear their names (``--max-length``: ``max_length``)."""
    given = vars(args) | {"fields": _parse_fields(args.fields), "transcript": _parse_transcript(args.transcript)}
    return RecordOptions.take(given)[0]


def _check(args) -> int:
    """``--check``: what a build would report, with no cache written (and the first bad row as the error)."""
    from portable_loader.corpora.tokenized import Tokenized
    from portable_loader.io import open_inputs

    t0 = time.perf_counter()
    try:
        record = _record(args)
        s = Tokenized(open_inputs(args.input, args.split), record).validate()
    except PortableLoaderError as e:
        return user_error(e, args.verbose)
    print(
        f"check passed: rows in: {s['rows_in']}  rows out: {s['rows_out']}  dropped: {format_dropped(s['dropped'])}  "
        f"truncated: {s['truncated']}\ntokens: {s['tokens']} ({s['trainable_tokens']} trained)  "
        f"seconds: {time.perf_counter() - t0:.2f}  (no cache written)"
    )
    return 0


def _manage(argv: list[str]) -> int:
    p = Parser(prog="python -m portable_loader.precache", formatter_class=_Help)
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    info = sub.add_parser("info", help="a cache's rows, tokens, length histogram and build options")
    info.add_argument("cache", help="a cache directory or URL (what precache printed)")
    info.add_argument("--json", action="store_true", help="print cache_info()'s dict as JSON")
    ls = sub.add_parser("ls", help="the caches in a folder", formatter_class=_Help)
    ls.add_argument("out", nargs="?", default="portable_loader_cache", help="the --out folder or URL of precache")
    ls.add_argument("--json", action="store_true", help="print list_caches()'s list as JSON")
    rm = sub.add_parser("rm", help="delete caches (refuses any folder that is not a cache)")
    rm.add_argument("caches", nargs="+", help="cache directories or URLs")
    for command in (info, ls, rm):
        add_verbose(command)
    args = p.parse_args(argv)
    try:
        if args.command == "info":
            result = cache_info(args.cache)
            print(json.dumps(result, indent=2) if args.json else format_info(result))
        elif args.command == "ls":
            caches = list_caches(args.out)
            if args.json:
                print(json.dumps(caches, indent=2))
            for c in [] if args.json else caches:
                when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c["created_unix"])) if c["created_unix"] else "?"
                state = f"INVALID: {c['error']}" if c["error"] else f"{c['rows']:>10,} rows {c['tokens']:>14,} tokens {c['bytes']:>14,} bytes  {when}"
                print(f"{c['name']:<32} {state}")
            if not args.json and not caches:
                print(f"no caches in {args.out}", file=sys.stderr)
        else:
            for path in args.caches:
                remove_cache(path)
                print(f"removed {path}")
    except PortableLoaderError as e:
        return user_error(e, args.verbose)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line; see ``python -m portable_loader.precache --help``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:
        return _manage(argv)
    return _build(argv)
