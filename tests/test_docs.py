"""The README and the docs site say what is true: every fenced shell command in README.md and
docs/ runs as written (or, where it needs a live upstream, an agent or a cluster, is parsed
by the command's own argument parser), the configuration and policy reference pages are the
ones the config model renders today, and every page the site's nav names exists.

A shell block is checked as the HTML comment right before its fence says:

    <!-- check: run -->               run it with bash (the default for an unmarked block)
    <!-- check: parse (why) -->       each python/runloop-proxy command is parsed, not run
    <!-- check: skip (why) -->        not checked (a reason is required)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SHELLS = ("bash", "sh", "shell", "console")
MARK = re.compile(r"<!--\s*check:\s*(\w+)\s*(?:\((.*)\))?\s*-->")
# Commands a parse block may name that are not ours to parse (an agent, a cluster, pip).
EXTERNAL = {"pip", "curl", "docker", "kubectl", "claude", "codex", "npm", "mkdocs", "pytest",
            "printf", "sha256sum", "export", "cd", "git", "kill", "wait", "sleep", "echo"}


@dataclass(frozen=True)
class Block:
    """One fenced shell block of a page, and how it is to be checked."""

    path: str
    line: int
    mode: str
    reason: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def blocks(path: str, text: str) -> list[Block]:
    """The fenced shell blocks of a markdown text, each with its check mark (or an error
    mode when the mark is malformed)."""
    found: list[Block] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not fence:
            i += 1
            continue
        indent, ticks, lang = fence.groups()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(ticks):
            end += 1
        body = "\n".join(line.removeprefix(indent) for line in lines[i + 1:end])
        if lang in SHELLS:
            before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            mark = MARK.search(before)
            mode, reason = ("run", "") if mark is None else (mark[1], (mark[2] or "").strip())
            if mode not in ("run", "parse", "skip"):
                mode, reason = "error", f"unknown check mode {mode!r}"
            elif mode != "run" and not reason:
                mode, reason = "error", f"check: {mode} needs a reason in parentheses"
            found.append(Block(path, i + 1, mode, reason, body))
        i = end + 1
    return found


def commands(script: str) -> list[list[str]]:
    """The simple commands of a shell script, as argv lists with leading VAR=value
    assignments removed; lines joined at a trailing backslash, split at ; & && || |."""
    joined = re.sub(r"\\\n", " ", script)
    out: list[list[str]] = []
    for line in joined.split("\n"):
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        argv: list[str] = []
        for token in lexer:
            if token and set(token) <= set(";&|"):
                if argv:
                    out.append(argv)
                argv = []
            elif not argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", token):
                continue  # an environment assignment before the command
            else:
                argv.append(token)
        if argv:
            out.append(argv)
    return out


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


@contextlib.contextmanager
def _parse_only() -> Iterator[None]:
    """Make every argparse parser raise _Parsed once it has parsed (so a module's main runs
    up to its parse and no further); a parse error still exits 2 as it would."""
    real = argparse.ArgumentParser.parse_args

    def parse_args(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Parsed(real(self, *args, **kwargs))

    argparse.ArgumentParser.parse_args = parse_args  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = real  # type: ignore[method-assign]


def parse_command(argv: list[str]) -> str | None:
    """None when ``argv`` parses as the command it names would parse it, else why not."""
    if argv[0] in EXTERNAL:
        return None
    if argv[0] == "runloop-proxy":
        target, run = "runloop_proxy.cli", lambda: runpy.run_module(
            "runloop_proxy.cli", run_name="__main__")
        args = argv[1:]
    elif argv[0] in ("python", "python3") and argv[1:2] == ["-m"]:
        target = argv[2]
        run = lambda: runpy.run_module(target, run_name="__main__")  # noqa: E731
        args = argv[3:]
    elif argv[0] in ("python", "python3") and len(argv) > 1 and argv[1].endswith(".py"):
        target = str(ROOT / argv[1])
        run = lambda: runpy.run_path(target, run_name="__main__")  # noqa: E731
        args = argv[2:]
    else:
        return f"{argv[0]!r} is not a command this check knows (add it to EXTERNAL?)"
    saved = sys.argv
    sys.argv = [target, *args]
    try:
        with _parse_only(), warnings.catch_warnings():
            # run_module of a module already imported warns that it runs a second copy
            warnings.simplefilter("ignore", RuntimeWarning)
            run()
    except _Parsed:
        return None
    except SystemExit as exc:
        return f"{shlex.join(argv)}: exits {exc.code} when parsed"
    finally:
        sys.argv = saved
    return f"{shlex.join(argv)}: never parsed its arguments"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md")
                                        if "incoming" not in p.relative_to(DOCS).parts)]


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in blocks(str(p.relative_to(ROOT)), p.read_text())]


BLOCKS = all_blocks()


# --- the checker's own parts -------------------------------------------------------------

@pytest.mark.parametrize(("script", "expected"), [
    ("runloop-proxy demo --once", [["runloop-proxy", "demo", "--once"]]),
    ("A=1 B='x y' runloop-proxy check-config config",
     [["runloop-proxy", "check-config", "config"]]),
    ("python -m runloop_proxy.scripted --port 9000 &\nrunloop-proxy serve --port 8081",
     [["python", "-m", "runloop_proxy.scripted", "--port", "9000"],
      ["runloop-proxy", "serve", "--port", "8081"]]),
    ("pip install -e . && runloop-proxy serve \\\n  --upstream http://h/v1  # a comment",
     [["pip", "install", "-e", "."], ["runloop-proxy", "serve", "--upstream", "http://h/v1"]]),
    ("printf %s \"$KEY\" | sha256sum", [["printf", "%s", "$KEY"], ["sha256sum"]]),
    ("a || b; c", [["a"], ["b"], ["c"]]),
    ("X=1 runloop-proxy replay f.jsonl --set max_run_loops=2",
     [["runloop-proxy", "replay", "f.jsonl", "--set", "max_run_loops=2"]]),
])
def test_commands_splits_a_script_as_the_shell_would(script: str,
                                                      expected: list[list[str]]) -> None:
    """Bug class: a command the check never sees (so never checked). Planted: continuation
    lines left unjoined (the --upstream of the 4th row lost), an argument that looks like an
    assignment dropped wherever it stands (the last row's max_run_loops=2)."""
    assert commands(script) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("```bash\nrunloop-proxy demo\n```", [("run", "", "runloop-proxy demo")]),
    ("<!-- check: parse (serves) -->\n\n```sh\nx\n```", [("parse", "serves", "x")]),
    ("<!-- check: skip -->\n```bash\nx\n```", [("error", "check: skip needs a reason in "
                                                         "parentheses", "x")]),
    ("<!-- check: maybe (x) -->\n```bash\nx\n```", [("error", "unknown check mode 'maybe'",
                                                      "x")]),
    ("```python\nprint(1)\n```\n```toml\na = 1\n```", []),
    ("- item\n\n  ```bash\n  runloop-proxy --version\n  ```", [("run", "", "runloop-proxy "
                                                                 "--version")]),
    ("<!-- check: skip (a) -->\n```bash\nx\n```\ntext\n```bash\ny\n```",
     [("skip", "a", "x"), ("run", "", "y")]),
])
def test_blocks_reads_each_shell_fence_and_its_mark(text: str,
                                                    expected: list[tuple[str, str, str]]) -> None:
    """Bug class: a block checked under the wrong mark (a live command run, a runnable one
    skipped). Planted: the mark looked up two lines up (the blank line of row 2 lost it), a
    mark carried over to the next block (row 7's second block skipped)."""
    assert [(b.mode, b.reason, b.text) for b in blocks("x.md", text)] == expected


def test_parse_command_catches_an_option_that_does_not_exist() -> None:
    """Bug class: the docs name an option a command does not have (or a value it refuses).
    Planted: parse_command returning None on SystemExit (every row passes)."""
    assert parse_command(["runloop-proxy", "demo", "--once", "--port", "0"]) is None
    assert parse_command(["runloop-proxy", "serve", "--upstream-format", "chat"]) is None
    assert parse_command(["python", "-m", "runloop_proxy.scripted", "--port", "9000"]) is None
    assert "exits 2" in (parse_command(["runloop-proxy", "demo", "--onse"]) or "")
    assert "exits 2" in (parse_command(["runloop-proxy", "serve", "--upstream-format",
                                        "grpc"]) or "")
    assert "exits 2" in (parse_command(["python", "-m", "runloop_proxy.scripted",
                                        "--prompt-cash"]) or "")
    assert "not a command" in (parse_command(["runloop-prxy", "demo"]) or "")


# --- the pages ----------------------------------------------------------------------------

def test_every_mark_is_well_formed() -> None:
    bad = [f"{b.id}: {b.reason}" for b in BLOCKS if b.mode == "error"]
    assert not bad, "\n".join(bad)


def test_the_readme_and_the_quick_start_run_something() -> None:
    """A page whose every command is skipped checks nothing: the quick start's demo runs."""
    ran = {b.path for b in BLOCKS if b.mode == "run"}
    assert "docs/quickstart.md" in ran
    assert any(b.mode == "run" and "demo" in b.text for b in BLOCKS if b.path == "README.md")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mode == "parse"], ids=lambda b: b.id)
def test_a_parse_block_parses(block: Block) -> None:
    problems = [why for argv in commands(block.text) if (why := parse_command(argv))]
    assert not problems, f"{block.id}:\n" + "\n".join(problems)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mode == "run"], ids=lambda b: b.id)
def test_a_run_block_runs(block: Block, tmp_path: Path) -> None:
    """Run as a user would, from a copy of the repository's config/ (the pages' commands
    name it), with this interpreter's scripts first on PATH."""
    shutil.copytree(ROOT / "config", tmp_path / "config")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "data")}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, (f"{block.id} exited {proc.returncode}\n--- stdout\n"
                                  f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_pages_are_current() -> None:
    """The configuration and policy pages are what the config model renders now: a field
    added, renamed or given another default without `python docs/gen_reference.py` fails
    here. Planted: a changed default of Policy.max_run_loops, a field without description, a
    changed help string of `demo --once` (the command-line page)."""
    gen = _generator()
    assert gen.problems() == []
    for path, text in gen.pages().items():
        assert path.read_text() == text, f"{path.name} is stale: run python docs/gen_reference.py"


def test_the_reference_names_every_field_of_the_model() -> None:
    from runloop_proxy import config

    policy = (DOCS / "reference" / "policy.md").read_text()
    for name in config.Policy.model_fields:
        assert f'<a id="policy-{name}"></a>`{name}`' in policy
    reference = (DOCS / "reference" / "configuration.md").read_text()
    for section, model in (("server", config.ServerSection), ("store", config.StoreSection),
                           ("upstream", config.UpstreamSpec), ("tenant", config.TenantSpec)):
        for name in model.model_fields:
            assert f'<a id="{section}-{name}"></a>`{name}`' in reference


def _table(text: str, header: str) -> list[str]:
    lines = text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    return list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))


def test_the_front_page_and_the_results_page_show_the_same_headline() -> None:
    """One figure, one value wherever it is shown: the README's results table is the one
    the results page shows, row for row. Planted: one cell of the results page's copy
    changed (65.1% to 65.3%)."""
    header = "| traffic, policy | **bill saved**"
    readme = _table((ROOT / "README.md").read_text(), header)
    results = _table((DOCS / "savings" / "results.md").read_text(), header)
    assert len(readme) >= 4 and readme == results


def test_the_command_line_page_names_every_command() -> None:
    """A command added to the CLI shows in the hand-written overview too (the reference
    page is generated; this one is not)."""
    from runloop_proxy import cli

    commands = next(a for a in cli.build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    overview = (DOCS / "cli.md").read_text()
    missing = [n for n in commands.choices if f"`runloop-proxy {n}" not in overview]
    assert not missing, f"docs/cli.md's table does not name {missing}"


def _nav_files(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, list):
        for item in node:
            yield from _nav_files(item)
    elif isinstance(node, dict):
        for value in node.values():
            yield from _nav_files(value)


def test_the_nav_names_every_page_and_only_pages_that_exist() -> None:
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = set(_nav_files(site["nav"]))
    files = {str(p.relative_to(DOCS)) for p in pages() if p.is_relative_to(DOCS)}
    assert nav == files
