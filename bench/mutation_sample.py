"""Sampled mutation testing of the whole package: each run mutates a random sample of the
package's lines — every module, not only the pure core — runs the tests that reach the mutated
module against each mutant, and prints the score and the surviving mutants.

    python bench/mutation_sample.py                      # a few minutes, a fresh sample
    python bench/mutation_sample.py --budget 3600 --jobs 2 --json mutants.json
    python bench/mutation_sample.py --seed 7 --only ops/ api/ history/
    python bench/mutation_sample.py --rerun mutants.json     # its survivors, today's code

A mutant is one small change at one place (ast-level, so it always parses): an arithmetic or
comparison operator swapped, ``and``/``or`` swapped, a ``not`` dropped, a condition negated,
a number moved by one, a flag flipped, a statement deleted. A line is drawn uniformly among the
package's mutable lines, then one mutation on it. A module's test files are those named
after it or importing it (or, for a module no test imports, those importing its importers;
``EXTRA`` adds what the import graph cannot see, e.g. the Lua scripts the store runs); each
runs once unmutated with coverage by test, which says which of its tests pass and which run
each line. A mutant runs only the passing tests that run its line, fastest first, stopped at
the first failure (``-x``) — seconds, not the suite's minutes — in a scratch copy of the
repository (the working tree is never touched). A mutant no test runs is a survivor
("uncovered"); one that times out (a loop) is killed. Not a gate: the numbers are printed,
the exit status is 0 unless the tool itself fails. Read a survivor with ``--json`` (each
one's file, line, change and the tests that let it through); DEVELOPERS.md says what to do
with one."""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "runloop_proxy"
# what the import graph does not show: modules reached through a running proxy or a script
EXTRA: dict[str, list[str]] = {
    "history/scripts.py": ["test_store.py", "test_units.py", "test_sessions.py"],
    "history/embedded.py": ["test_store.py"],
    "app.py": ["test_routes.py", "test_route_security.py", "test_config.py"],
    "api/http.py": ["test_store.py", "test_hardening.py", "test_routes.py"],
    "state.py": ["test_config.py", "test_routes.py"],
    "environment.py": ["test_cli.py"],
    "ops/logs.py": ["test_metrics.py", "test_cli.py"],
    "ops/views.py": ["test_cli.py", "test_inspector.py"],
    "scripted.py": ["test_routes.py", "test_responses.py"],
    "ops/admin.py": ["test_inspector.py", "test_summaries.py"],
    "ops/demo.py": ["test_cli.py"],
    "api/chat.py": ["test_hardening.py", "test_routes.py"],
    "api/responses_wire.py": ["test_streams.py", "test_responses.py"],
    "history/store.py": ["test_lifecycle.py", "test_units.py", "test_sessions.py"],
    "history/writes.py": ["test_store.py", "test_hardening.py"],
    "history/summaries.py": ["test_lifecycle.py", "test_units.py"],
    "pipeline/accounting.py": ["test_units.py", "test_metrics.py"],
    "pipeline/offload.py": ["test_hardening.py"],
    "pipeline/framing.py": ["test_summaries.py", "test_window.py"],
    "pipeline/reconcile.py": ["test_sessions.py", "test_units.py", "test_store.py"],
    "pipeline/relay.py": ["test_routes.py", "test_streams.py", "test_tools.py",
                          "test_hardening.py", "test_metrics.py"],
    "ops/metrics.py": ["test_metrics.py", "test_config.py"],
    "window/builder.py": ["test_window.py"],
    "conversation/identity.py": ["test_identity.py", "test_sessions.py"],
    "pipeline/shaping.py": ["test_units.py", "test_tools.py", "test_summaries.py"],
    "pipeline/toolloop.py": ["test_tools.py"],
    "pipeline/turn.py": ["test_routes.py"],
    "pipeline/upstream.py": ["test_routes.py"],  # the retry table, through a proxy
}
SKIP_FILES = {"__init__.py", "__main__.py"}
NOISE_CALLS = ("log.", "logs.", "logger.")  # deleting a log line: no test reads logs
SWAPS: dict[type, type] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv, ast.LShift: ast.RShift,
    ast.RShift: ast.LShift, ast.BitOr: ast.BitAnd, ast.BitAnd: ast.BitOr,
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot,
    ast.IsNot: ast.Is, ast.And: ast.Or, ast.Or: ast.And,
}


@dataclass
class Mutant:
    file: str  # relative to the package
    line: int
    kind: str
    before: str  # the source segment replaced
    after: str
    start: tuple[int, int]
    end: tuple[int, int]
    outcome: str = ""  # killed | survived | uncovered | timeout | invalid
    tests: list[str] = field(default_factory=list)
    seconds: float = 0.0
    killer: str = ""


# -- where to mutate -----------------------------------------------------------------------------

def _annotations(tree: ast.AST) -> set[int]:
    """ids of nodes inside annotations (mutating a type changes nothing at run time)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        parts: list[ast.AST | None] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            parts.append(node.returns)
            args = node.args
            parts += [a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs,
                                             args.vararg, args.kwarg) if a is not None]
        elif isinstance(node, ast.AnnAssign):
            parts.append(node.annotation)
        for part in parts:
            if part is not None:
                out |= {id(n) for n in ast.walk(part)}
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0]))
                out.add(id(body[0].value))
    return out


def _replaced(node: ast.AST, **changes: object) -> str:
    clone = ast.parse(ast.unparse(node), mode="eval").body if isinstance(node, ast.expr) \
        else ast.parse(ast.unparse(node)).body[0]
    for k, v in changes.items():
        setattr(clone, k, v)
    return ast.unparse(clone)


def sites(path: Path, rel: str) -> Iterator[Mutant]:
    """Every mutation of one module."""
    text = path.read_text()
    tree = ast.parse(text)
    skip = _annotations(tree) | _docstrings(tree)

    def mutant(node: ast.AST, kind: str, after: str) -> Mutant:
        seg = ast.get_source_segment(text, node) or ""
        return Mutant(rel, node.lineno, kind, seg, after,  # type: ignore[attr-defined]
                      (node.lineno, node.col_offset),  # type: ignore[attr-defined]
                      (node.end_lineno, node.end_col_offset))  # type: ignore[attr-defined]

    for node in ast.walk(tree):
        if id(node) in skip or not hasattr(node, "lineno"):
            continue
        if isinstance(node, ast.BinOp) and type(node.op) in SWAPS:
            yield mutant(node, "operator", _replaced(node, op=SWAPS[type(node.op)]()))
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in SWAPS:
            yield mutant(node, "comparison", _replaced(node, ops=[SWAPS[type(node.ops[0])]()]))
        elif isinstance(node, ast.BoolOp):
            yield mutant(node, "boolean", _replaced(node, op=SWAPS[type(node.op)]()))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield mutant(node, "not dropped", ast.unparse(node.operand))
        elif isinstance(node, ast.Constant) and isinstance(node.value, int):
            v = node.value
            after = repr(not v) if isinstance(v, bool) else repr(v + 1) if v != 1 else "0"
            yield mutant(node, "constant", after)
        if isinstance(node, (ast.If, ast.While)) and id(node.test) not in skip:
            yield mutant(node.test, "negated", f"not ({ast.unparse(node.test)})")
        if isinstance(node, (ast.Expr, ast.Assign, ast.AugAssign, ast.Return, ast.Raise)) \
                and not isinstance(getattr(node, "value", None), ast.Constant) \
                and not ast.unparse(node).startswith(NOISE_CALLS):
            yield mutant(node, "deleted", "pass")


def package_sites(only: list[str]) -> list[Mutant]:
    out: list[Mutant] = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        rel = path.relative_to(ROOT / PACKAGE).as_posix()
        if path.name in SKIP_FILES or (only and not rel.startswith(tuple(only))):
            continue
        out += sites(path, rel)
    return out


def sample(all_sites: list[Mutant], n: int, rng: random.Random) -> list[Mutant]:
    """``n`` mutants: a line drawn uniformly among the mutable lines, then one of its
    mutations."""
    by_line: dict[tuple[str, int], list[Mutant]] = {}
    for m in all_sites:
        by_line.setdefault((m.file, m.line), []).append(m)
    lines = list(by_line)
    rng.shuffle(lines)
    return [rng.choice(by_line[k]) for k in lines[:n]]


def apply(text: str, m: Mutant) -> str:
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line.encode()))
    raw = text.encode()
    a = offsets[m.start[0] - 1] + m.start[1]
    b = offsets[m.end[0] - 1] + m.end[1]
    return (raw[:a] + m.after.encode() + raw[b:]).decode()


# -- which tests ---------------------------------------------------------------------------------

def module_name(rel: str) -> str:
    return PACKAGE + "." + rel.removesuffix(".py").replace("/", ".")


def imports_of(path: Path, package: str | None = None) -> set[str]:
    """The package's modules a file imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith(PACKAGE)}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level and package:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith(PACKAGE):
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names}
    return out


def test_map() -> dict[str, list[str]]:
    """Module (relative path) -> the test files to run against its mutants."""
    modules = {module_name(p.relative_to(ROOT / PACKAGE).as_posix()): p
               for p in (ROOT / PACKAGE).rglob("*.py")}
    importers: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for dep in imports_of(path, pkg):
            if dep in importers and dep != name:
                importers[dep].add(name)
    tests = {p.name: imports_of(p) for p in sorted((ROOT / "tests").glob("test_*.py"))}
    out: dict[str, list[str]] = {}
    for name in modules:
        rel = name.removeprefix(PACKAGE + ".").replace(".", "/") + ".py"
        direct = [t for t, deps in tests.items() if name in deps]
        named = [t for t in tests if t == f"test_{Path(rel).stem}.py"]
        # then its kin: named after its package (window/builder.py: test_window*.py) or its
        # stem's first word (ops/inspector_session.py: test_inspector.py) — importers come in
        # file-name order, and only the first --max-files are run
        words = {Path(rel).parent.name, Path(rel).stem.split("_")[0]} - {"", PACKAGE}
        kin = [t for t in tests if t.removeprefix("test_").removesuffix(".py").split("_")[0]
               in words]
        hop = [t for t, deps in tests.items() if deps & importers[name]] if not direct else []
        chosen = dict.fromkeys([*named, *EXTRA.get(rel, []), *kin, *direct, *hop])
        out[rel] = [t for t in chosen if t in tests]
    return out


# -- running -------------------------------------------------------------------------------------

@dataclass
class Covered:
    """What one test file's unmutated run says: the tests that pass, their seconds, and for
    each line of the package the tests that run it."""

    passed: dict[str, float] = field(default_factory=dict)  # node id -> seconds
    lines: dict[str, dict[int, list[str]]] = field(default_factory=dict)  # file -> line -> ids


class Scratch:
    """A copy of the repository the mutants are written into (one per worker)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="rl-mutants-"))
        ignore = shutil.ignore_patterns(".venv*", ".git", "mutants", "__pycache__", ".runloop",
                                        ".hypothesis", ".pytest_cache", "*.egg-info",
                                        ".coverage*")
        shutil.copytree(ROOT, self.dir / "repo", ignore=ignore)
        self.repo = self.dir / "repo"
        # the copy measures the processes its tests start too (the CLI, replay, demo)
        # (what the project's own config lacks of it: a key written twice is no TOML, and
        # every test file then maps to no test)
        config = self.repo / "pyproject.toml"
        text = config.read_text()
        wanted = [line for key, line in (("patch", 'patch = ["subprocess"]'),
                                         ("parallel", "parallel = true"))
                  if not re.search(rf"(?m)^{key}\s*=", text)]
        config.write_text(text.replace('concurrency = ["thread"]', "\n".join(
            ['concurrency = ["thread"]', *wanted])))
        tomllib.loads(config.read_text())  # fails here, not as 0 tests per file
        self.running: subprocess.Popen[str] | None = None
        self.env = {**os.environ, "PYTHONPATH": str(self.repo), "WINDOW_EXAMPLES": "25",
                    "PYTHONDONTWRITEBYTECODE": "1"}
        check = subprocess.run([sys.executable, "-c",
                                f"import {PACKAGE}; print({PACKAGE}.__file__)"],
                               cwd=self.repo, env=self.env, capture_output=True, text=True)
        if not check.stdout.startswith(str(self.repo)):
            raise SystemExit(f"the scratch copy does not shadow the installed package: "
                             f"{check.stdout or check.stderr}")

    def _pytest(self, args: list[str], timeout: float, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess[str] | None:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p",
               "no:cacheprovider", "--timeout", str(int(timeout) + 5), "--hypothesis-seed", "0",
               *args]
        # a session of its own: on a timeout (or when this tool stops) the whole group goes,
        # the servers its tests started with it
        proc = subprocess.Popen(cmd, cwd=self.repo, env=env or self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        self.running = proc
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            return None
        finally:
            self.running = None
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def stop(self) -> None:
        """End the test run under way, and every process it started."""
        proc = self.running
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()

    def cover(self, test_file: str) -> Covered:
        """Run a test file unmutated, with coverage by test (which test runs which line)."""
        from coverage import CoverageData

        tag = test_file.removesuffix(".py")
        data_file, junit = self.dir / f".cov-{tag}", self.dir / f"junit-{tag}.xml"
        run = self._pytest([f"--cov={PACKAGE}", "--cov-context=test", "--cov-report=",
                            "--cov-fail-under=0", f"--junitxml={junit}", f"tests/{test_file}"],
                           1800, {**self.env, "COVERAGE_FILE": str(data_file)})
        if run is not None and run.returncode not in (0, 1):  # not a test's failure: the run's
            print(f"  broken    {test_file}: pytest exited {run.returncode}: "
                  f"{(run.stderr or run.stdout).strip()[-300:]}", flush=True)
        out = Covered()
        if junit.exists():
            import xml.etree.ElementTree as ET

            for case in ET.parse(junit).iter("testcase"):
                if any(c.tag in ("failure", "error", "skipped") for c in case):
                    continue
                parts = case.get("classname", "").split(".")
                node = "/".join(parts[:2]) + ".py::" + "::".join([*parts[2:],
                                                                   case.get("name", "")])
                out.passed[node] = float(case.get("time") or 0)
        if data_file.exists():
            data = CoverageData(basename=str(data_file))
            data.read()
            base = self.repo / PACKAGE
            for measured in data.measured_files():
                path = Path(measured)
                if base not in path.parents:
                    continue
                by_line = data.contexts_by_lineno(measured)
                # a line run at import (no test's context: collection) or in a process a
                # test started (no context there either) counts for every test of the file
                out.lines[path.relative_to(base).as_posix()] = {
                    line: sorted(set(out.passed) if "" in ctx else
                                 {c.rsplit("|", 1)[0] for c in ctx} & set(out.passed))
                    for line, ctx in by_line.items()}
        return out

    def run(self, m: Mutant, tests: list[str], timeout: float) -> None:
        path = self.repo / PACKAGE / m.file
        original = path.read_text()
        try:
            mutated = apply(original, m)
            compile(mutated, str(path), "exec")
        except (SyntaxError, ValueError):
            m.outcome = "invalid"
            return
        path.write_text(mutated)
        started = time.monotonic()
        try:
            r = self._pytest(["-x", "--no-cov", *tests], timeout)
        finally:
            path.write_text(original)
        m.seconds = time.monotonic() - started
        if r is None:
            m.outcome = "timeout"
        else:
            m.outcome = "survived" if r.returncode == 0 else "killed"
            m.killer = next((ln.split()[1] for ln in r.stdout.splitlines()
                             if ln.startswith(("FAILED", "ERROR"))), "")

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def cached(where: str | None, test_file: str, make: Callable[[], Covered]) -> Covered:
    """A test file's map from the cache when its sources are unchanged, else made (and kept)."""
    if where is None:
        return make()
    h = hashlib.sha256(b"map v3")
    for path in sorted((ROOT / PACKAGE).rglob("*.py")) + [ROOT / "tests" / "conftest.py",
                                                          ROOT / "tests" / test_file]:
        h.update(path.as_posix().encode() + b"\0" + path.read_bytes())
    entry = Path(where) / f"{test_file}.{h.hexdigest()[:16]}.json"
    if entry.exists():
        raw = json.loads(entry.read_text())
        return Covered(raw["passed"], {f: {int(k): v for k, v in lines.items()}
                                       for f, lines in raw["lines"].items()})
    made = make()
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.write_text(json.dumps(asdict(made)))
    return made


def rerun(path: str, all_sites: list[Mutant]) -> list[Mutant]:
    """The survivors of an earlier run, found again in today's code (by file, change and
    text: lines move); one whose code is gone is reported and left out."""
    out = []
    for old in json.loads(Path(path).read_text())["mutants"]:
        if old["outcome"] not in ("survived", "uncovered"):
            continue
        same = [m for m in all_sites if (m.file, m.kind, m.before, m.after) ==
                (old["file"], old["kind"], old["before"], old["after"])]
        if not same:
            print(f"  gone      {old['file']}:{old['line']} {old['kind']}: "
                  f"{old['before'][:50]!r} (the code changed)")
            continue
        out.append(min(same, key=lambda m: abs(m.line - old["line"])))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=240,
                        help="seconds in all (the unmutated runs that map tests to lines "
                             "included)")
    parser.add_argument("--mutants", type=int, default=400, help="at most this many")
    parser.add_argument("--seed", type=int, default=None, help="default: a fresh sample")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--only", nargs="*", default=[],
                        help="module path prefixes under the package (ops/ api/ …)")
    parser.add_argument("--max-files", type=int, default=4,
                        help="test files whose tests may kill a module's mutants")
    parser.add_argument("--json", help="write every mutant and its outcome here")
    parser.add_argument("--rerun", help="a --json file: run its survivors again (the same "
                                        "changes, today's code and tests) instead of a sample")
    parser.add_argument("--cache", help="a directory keeping each test file's map between "
                                        "runs (valid while it, conftest and the package are "
                                        "unchanged)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    rng = random.Random(seed)
    all_sites = package_sites(args.only)
    lines = len({(m.file, m.line) for m in all_sites})
    chosen = sample(all_sites, args.mutants, rng) if not args.rerun else \
        rerun(args.rerun, all_sites)
    tmap = test_map()
    print(f"seed {seed}: {len(all_sites)} mutations on {lines} lines of "
          f"{len({m.file for m in all_sites})} modules; {len(chosen)} drawn", flush=True)
    scratches = [Scratch() for _ in range(max(1, args.jobs))]
    covered: dict[str, Covered | None] = {}  # test file -> its map (None: being made)
    lock = threading.Lock()

    def coverage_of(test_file: str, scratch: Scratch) -> Covered:
        with lock:
            fresh = test_file not in covered
            if fresh:
                covered[test_file] = None
        if fresh:
            covered[test_file] = cached(args.cache, test_file, lambda: scratch.cover(test_file))
            c = covered[test_file]
            assert c is not None
            print(f"  mapped    {test_file}: {len(c.passed)} tests", flush=True)
        while covered[test_file] is None:
            time.sleep(0.2)
        result = covered[test_file]
        assert result is not None
        return result

    def selection(m: Mutant, scratch: Scratch) -> list[str]:
        """The tests of the module's test files that run the mutated line, fastest first."""
        tests: dict[str, float] = {}
        for t in tmap.get(m.file, [])[:args.max_files]:
            c = coverage_of(t, scratch)
            at = c.lines.get(m.file, {})
            for line in range(m.start[0], m.end[0] + 1):
                tests.update({n: c.passed[n] for n in at.get(line, [])})
        return sorted(tests, key=lambda n: tests[n])

    started = time.monotonic()
    done: list[Mutant] = []
    pending = list(chosen)
    halted = threading.Event()

    def work(scratch: Scratch) -> None:
        while time.monotonic() - started < args.budget:
            with lock:
                if not pending:
                    return
                m = pending.pop(0)
            m.tests = selection(m, scratch)
            if not m.tests:
                m.outcome = "uncovered"  # no test of the module's runs the line
            else:
                maps = [c for t in tmap[m.file][:args.max_files] if (c := covered.get(t))]
                took = sum(c.passed.get(n, 0.0) for c in maps for n in m.tests)
                scratch.run(m, m.tests, 3 * took + 30)
            if halted.is_set():
                return
            done.append(m)
            print(f"  {m.outcome:9s} {m.file}:{m.line} {m.kind}: {m.before[:50]!r} -> "
                  f"{m.after[:50]!r} ({len(m.tests)} tests, {m.seconds:.0f}s)", flush=True)

    def stopped(signum: int, frame: object) -> None:
        halted.set()
        pending.clear()  # no new mutant; the ones under way are ended and not counted
        for s in scratches:
            s.stop()

    signal.signal(signal.SIGTERM, stopped)
    try:
        with ThreadPoolExecutor(len(scratches)) as pool:
            list(pool.map(work, scratches))
    finally:
        for s in scratches:
            s.close()
    report(done, seed, time.monotonic() - started)
    if args.json:
        Path(args.json).write_text(json.dumps({"seed": seed, "mutants": [asdict(m) for m in done]},
                                              indent=1))


def report(done: list[Mutant], seed: int, took: float) -> None:
    counts: dict[str, int] = {}
    for m in done:
        counts[m.outcome] = counts.get(m.outcome, 0) + 1
    killed = counts.get("killed", 0) + counts.get("timeout", 0)
    scored = killed + counts.get("survived", 0) + counts.get("uncovered", 0)
    print(f"\n{len(done)} mutants in {took:.0f} s (seed {seed}): " +
          ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    if scored:
        print(f"mutation score: {killed}/{scored} = {100 * killed / scored:.1f}% (timeouts "
              f"count as killed, mutants no test runs as survivors; invalid ones not scored)")
    by_dir: dict[str, list[int]] = {}
    for m in done:
        if m.outcome in ("killed", "timeout", "survived", "uncovered"):
            d = m.file.split("/")[0] if "/" in m.file else "."
            tally = by_dir.setdefault(d, [0, 0])
            tally[0] += m.outcome in ("killed", "timeout")
            tally[1] += 1
    for d, (dead, n) in sorted(by_dir.items()):
        print(f"  {d + '/':15s} {dead}/{n} killed")
    survivors = [m for m in done if m.outcome in ("survived", "uncovered")]
    if survivors:
        print("\nsurvivors (file:line, change, tests run):")
        for m in sorted(survivors, key=lambda m: (m.file, m.line)):
            why = f"{len(m.tests)} tests ran it" if m.tests else "no test runs the line"
            print(f"  {m.file}:{m.line} {m.kind}: {m.before[:70]!r} -> {m.after[:70]!r}"
                  f"  [{why}]")


if __name__ == "__main__":
    main()
