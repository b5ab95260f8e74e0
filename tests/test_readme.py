"""Every python example of README.md and docs/*.md runs as written, and the pages point only at files in the repository.

Each `python` fenced block of README.md and of every page in docs/ runs on its own in a fresh interpreter
and an empty directory, so an example that needs a name, a file or a step that is not on the page
fails here before a reader copies it. A block may carry a run marker, an HTML comment on the line
right before its opening fence (`<!-- run: processes=2 s3 timeout=120 -->`), for what it needs:

- `processes=N`: N copies start at once, each with torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
  `MASTER_ADDR`, `MASTER_PORT` (a free port on 127.0.0.1) and without `XLA_FLAGS`; all must exit 0.
  `processes=2,1`: 2 at once, then 1, in the same directory (a checkpoint saved by 2, restored by 1);
- `s3`: a moto S3 server on 127.0.0.1 with a bucket `my-bucket`, which the env points fsspec at;
- `timeout=S`: seconds before the block (all its runs) counts as hung (default 300).

A block without a marker runs as one plain process. A block is skipped only where a module it imports
at top level is not installed. A `text` block right after a python block (nothing but blank lines
between) is that example's output: what it prints must match it line for line, and the README's
quoted output of the demo (`bash scripts/demo.sh`) is the demo's, run here. In a quoted output, a
timing (`... batches/s`, `... tokens/s`, `... s`, `load average ...`) matches any number, and `...`
stands for any text the page leaves out; everything else (cache names, sizes in bytes, counts, positions) is compared as written.

The README's shell commands are each either run here or a script of this repository.
"""

import importlib.util
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
PYTHON = "\x60\x60\x60python"  # the fence, spelled so that this file is not counted as one
MARKER = re.compile(r"^<!-- run: (.*?) -->\n\Z")  # the line right before a fence
MARKERS_ANYWHERE = re.compile(r"<!-- run:")
WORDS = {"processes": re.compile(r"processes=([1-9]\d*(?:,[1-9]\d*)*)"), "s3": re.compile(r"s3"),
         "timeout": re.compile(r"timeout=([1-9]\d*)")}


def blocks(path: pathlib.Path, lang: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(path.read_text()) if m.group(1) == lang]


def marked_blocks(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """The page's python blocks, each with the words of the run marker on the line before it."""
    text, out = path.read_text(), []
    for m in FENCE.finditer(text):
        if m.group(1) == "python":
            before = text[: m.start()]
            line = before[before.rstrip("\n").rfind("\n") + 1 :] if before.endswith("\n") else ""
            marker = MARKER.match(line)
            out.append((m.group(2), marker.group(1).split() if marker else []))
    return out


def run_options(words: list[str]) -> dict:
    """`processes`, `s3` and `timeout` from a marker's words; an unknown word is an error."""
    options = {"processes": None, "s3": False, "timeout": 300}
    for word in words:
        name = word.split("=")[0]
        m = WORDS.get(name) and WORDS[name].fullmatch(word)
        if not m:
            raise ValueError(f"unknown run marker word {word!r}: known are processes=N[,M...], s3, timeout=S")
        if name == "processes":
            options[name] = [int(n) for n in m.group(1).split(",")]
        else:
            options[name] = int(m.group(1)) if m.groups() else True
    return options


def commands(block: str) -> list[str]:
    """Shell lines of a block: continuations joined, comments and blank lines dropped."""
    joined = block.replace("\\\n", " ")
    return [" ".join(line.split("#")[0].split()) for line in joined.splitlines() if line.split("#")[0].strip()]


def top_level_modules(code: str) -> set[str]:
    return set(re.findall(r"^(?:import|from)\s+(\w+)", code, re.M))


def name(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def outputs(path: pathlib.Path) -> dict[int, str]:
    """The quoted outputs of a page's python blocks: block number (1-based) -> the `text` block right after it."""
    text, out, found = path.read_text(), {}, list(FENCE.finditer(path.read_text()))
    number = 0
    for m, after in zip(found, found[1:] + [None]):
        if m.group(1) == "python":
            number += 1
            if after is not None and after.group(1) == "text" and not text[m.end() : after.start()].strip():
                out[number] = after.group(2)
    return out


# Timings: a rate, seconds (`0.41 s`) and the load average they were measured under.
RATE = re.compile(r"[\d,.]+(?= (?:batches|tokens)/s| s\b)|(?<=load average )[\d.]+")


def matches_quoted(quoted: str, printed: str) -> list[str]:
    """The lines where ``printed`` differs from the page's ``quoted`` output (rates masked, ``...`` any text)."""
    want, got = quoted.rstrip("\n").splitlines(), printed.rstrip("\n").splitlines()
    bad = [f"{len(want)} lines quoted, {len(got)} printed"] if len(want) != len(got) else []
    for w, g in zip(want, got):
        pattern = ".*?".join(re.escape(RATE.sub("\0", part)).replace("\0", r"[\d,.]+") for part in w.split("..."))
        if not re.fullmatch(pattern, g):
            bad.append(f"quoted:  {w}\nprinted: {g}")
    return bad


def test_quoted_outputs_compare_what_they_show():
    assert matches_quoted("x: 2,392 batches/s, 4,830,393 tokens/s, 98.6%", "x: 611 batches/s, 1,234,427 tokens/s, 98.6%") == []
    assert matches_quoted('{"a": "eb60...", "b": {...}}', '{"a": "eb606cb0", "b": {"c": 1}}') == []
    assert matches_quoted("first batch: 0.52 s (load average 1.9)", "first batch: 10.79 s (load average 24.5)") == []
    assert matches_quoted("state: 412 bytes", "state: 399 bytes")  # a size is compared, not masked
    assert matches_quoted("chat-2afc (2000 records)", "chat-20c7 (2000 records)")
    assert matches_quoted("one\ntwo", "one")


EXAMPLES = blocks(README, "python")
SNIPPETS = [(name(page), i + 1, code, words) for page in PAGES for i, (code, words) in enumerate(marked_blocks(page))]
OUTPUTS = {(name(page), i): out for page in PAGES for i, out in outputs(page).items()}


def test_every_python_fence_is_found():
    # The fences counted another way: a parser that missed one would silently skip its example.
    assert len(EXAMPLES) == README.read_text().count(PYTHON) >= 5
    for page in DOCS:
        text = page.read_text()
        assert len(marked_blocks(page)) == text.count(PYTHON), f"{name(page)}: a python fence the parser misses"
    assert len(SNIPPETS) == sum(page.read_text().count(PYTHON) for page in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_run_marker_sits_on_a_python_block_and_names_known_words(page):
    found = [words for _, words in marked_blocks(page) if words]
    assert len(found) == len(MARKERS_ANYWHERE.findall(page.read_text())), (
        f"{name(page)}: a run marker not on the line right before a {PYTHON} fence")
    for words in found:
        run_options(words)


@pytest.fixture(scope="module")
def sample_cache(tmp_path_factory):
    """The bundled sample's cache, built once: the examples' own precache calls then find it (a hit)."""
    import portable_loader as pl
    from portable_loader.precache import sample_args

    return pathlib.Path(pl.precache(**sample_args(), out=str(tmp_path_factory.mktemp("cache"))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_server():
    """A moto S3 server on 127.0.0.1 holding an empty bucket `my-bucket`, and the env that points fsspec at it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    # moto's backends are global to the process: start empty when another server ran here before.
    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST")).close()
    urllib.request.urlopen(urllib.request.Request(f"{url}/my-bucket", method="PUT")).close()
    env = {
        "FSSPEC_S3_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    return server, env


def run_processes(n: int | None, env: dict, cwd: pathlib.Path, deadline: float, tag: str) -> list[str]:
    """Run example.py as one plain process (n None) or n ranks at once; the outputs of those that failed."""
    if n is not None:  # as torchrun starts them, all on this machine
        env = {k: v for k, v in env.items() if k != "XLA_FLAGS"}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(n))
    logs, procs = [cwd / f"output-{tag}-{r}.txt" for r in range(n or 1)], []
    try:
        for r, log in enumerate(logs):
            rank = dict(RANK=str(r), LOCAL_RANK=str(r)) if n is not None else {}
            with open(log, "w") as out:  # a file, not a pipe: a rank blocked on a full pipe could hang the others
                procs.append(subprocess.Popen([sys.executable, "example.py"], cwd=cwd, env={**env, **rank},
                                              stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:  # timed out: its whole group, workers included
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [f"--- process {r} of {n or 1} ({tag}) exited {p.returncode}, output:\n{log.read_text()[-3000:]}\n"
            for r, (p, log) in enumerate(zip(procs, logs)) if p.returncode != 0]


@pytest.mark.slow
@pytest.mark.parametrize("page, index, code, words", SNIPPETS, ids=[f"{p}-{i}" for p, i, _, _ in SNIPPETS])
def test_example_runs_as_written(page, index, code, words, tmp_path, sample_cache):
    options = run_options(words)
    needed = top_level_modules(code) | ({"moto", "s3fs"} if options["s3"] else set())
    missing = sorted(m for m in needed if importlib.util.find_spec(m) is None)
    if missing:  # only where scripts/test.sh's full install was not used
        pytest.skip(f"example needs {missing}, not installed here")
    # Building the cache is tested below (the README's precache command) and in test_precache.py;
    # here the examples' out="cache" already holds it, so each example pays only for its own work.
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / sample_cache.name).symlink_to(sample_cache)
    (tmp_path / "example.py").write_text(code)
    env, server, failed = dict(os.environ), None, []
    if options["s3"]:
        server, s3_env = s3_server()
        env.update(s3_env)
    deadline = time.monotonic() + options["timeout"]
    try:
        for k, n in enumerate(options["processes"] or [None]):  # runs one after another, in one folder
            failed = run_processes(n, env, tmp_path, deadline, f"run{k + 1}")
            if failed:
                break
    finally:
        if server is not None:
            server.stop()
    late = " (or ran past its timeout)" if time.monotonic() > deadline else ""
    assert not failed, f"{page} example {index} failed{late}:\n{code}\n" + "".join(failed)
    quoted = OUTPUTS.get((page, index))
    if quoted is not None:
        assert options["processes"] is None, f"{page} example {index}: a quoted output needs one plain process"
        bad = matches_quoted(quoted, (tmp_path / "output-run1-0.txt").read_text())
        assert not bad, f"{page} example {index} prints other than its quoted output:\n" + "\n".join(bad)


@pytest.mark.slow
def test_the_readme_quotes_the_demos_own_output(tmp_path):
    # What scripts/demo.sh runs after its install, in a fresh folder: the cache is built there.
    text = README.read_text()
    found = list(FENCE.finditer(text))
    quoted = [after.group(2) for m, after in zip(found, found[1:]) if "bash scripts/demo.sh" in m.group(2)
              and after.group(1) == "text" and not text[m.end() : after.start()].strip()]
    assert len(quoted) == 1, "README: the demo's command, its output quoted right after it"
    r = subprocess.run([sys.executable, "-m", "portable_loader"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]
    bad = matches_quoted(quoted[0], r.stdout)
    assert not bad, "README's demo output is not what the demo prints:\n" + "\n".join(bad)


def test_the_readme_names_where_the_suites_real_data_is_read():
    # tests/conftest.py reads the real datasets and tokenizers from a folder an environment variable names.
    variable = re.search(r'environ\.get\("(\w+)"', (ROOT / "tests" / "conftest.py").read_text()).group(1)
    assert f"`{variable}`" in README.read_text()


@pytest.mark.slow
def test_readme_commands_are_run_here_or_are_scripts_of_the_repository(tmp_path):
    # Repository-relative paths in the commands resolve through a link, so the cache lands in tmp_path.
    (tmp_path / "portable_loader").symlink_to(ROOT / "portable_loader")
    lines = [c for lang in ("bash", "sh", "shell") for b in blocks(README, lang) for c in commands(b)]
    assert lines
    sample = ROOT / "portable_loader" / "sample" / "sample_chat.jsonl"
    for line in lines:
        words = line.split()
        if words[:2] in (["bash", "scripts/test.sh"], ["bash", "scripts/demo.sh"]):
            # Both install packages, so the suite cannot run them; CI runs both (.ci/run).
            assert (ROOT / words[1]).is_file()
            assert line in (ROOT / ".ci" / "run").read_text()
        elif words[:3] == [".venv/bin/python", "-m", "portable_loader.precache"]:
            r = subprocess.run([sys.executable, *words[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr[-3000:]
            import portable_loader as pl

            rows = sum(1 for row in sample.read_text().splitlines() if row.strip())
            assert len(pl.open_cache(str(tmp_path / r.stdout.splitlines()[-1]))) == rows
        else:
            pytest.fail(f"README command neither run by this test nor a known script: {line}")


def test_no_page_refers_outside_the_repository():
    for path in [README, *sorted((ROOT / "docs").rglob("*"))]:
        if path.is_file():
            text = path.read_text(errors="replace")
            for outside in ("../shared", "/work/"):
                assert outside not in text, f"{path.relative_to(ROOT)} mentions {outside}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_point_to_files_in_the_repository(page):
    targets = [t for t in LINK.findall(page.read_text()) if "://" not in t and not t.startswith(("mailto:", "#"))]
    for target in targets:
        resolved = (page.parent / target.split("#")[0]).resolve()
        assert resolved.is_relative_to(ROOT) and resolved.exists(), f"{page.name}: broken link {target}"


def test_files_named_in_the_pages_exist():
    named = re.compile(r"\b((?:scripts|tests|docs|portable_loader|adapters)/[\w/.-]+\.(?:py|sh|md|svg|csv|jsonl))\b")
    for page in PAGES:
        for rel in named.findall(page.read_text()):
            assert (ROOT / rel).is_file() or (page.parent / rel).is_file(), f"{page.name} names {rel}, which is missing"


def test_tests_named_by_the_design_exist():
    # docs/design.md maps each promise to the tests that hold it; a renamed test must not leave a stale map.
    defined = set()
    for f in (ROOT / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", f.read_text(), re.M))
    cited = set(re.findall(r"`(test_\w+)`", (ROOT / "docs" / "design.md").read_text()))
    assert len(cited) >= 20
    assert cited <= defined, f"design.md cites tests that do not exist: {sorted(cited - defined)}"
