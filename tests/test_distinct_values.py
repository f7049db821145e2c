"""No two limits a test sets coincide (a sweep of the suite's own source).

A test that gives the header and the body timeout one value (0.6 and 0.6) cannot see a
deadline armed from the wrong setting; one whose store timeout equals its retry pause cannot
see one read for the other. This walks every test file and every configuration a test writes
by hand — a dict literal, a call's keywords, a TOML text — and fails naming each test in which
two numeric settings of the proxy's config (every ``int``/``float`` field of its sections)
take the same value. New tests draw theirs with ``tests/distinct.py``.

Exempt: 0, which turns a setting off (no deadline or bound is armed with it); and a line that
says why its coincidence is the case under test (``# coincide: <why>``)."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runloop_proxy import config as C

TESTS = Path(__file__).parent
SECTIONS = (C.ServerSection, C.StoreSection, C.UpstreamSpec, C.Policy, C.TenantSpec,
            C.ModelSpec)
NUMERIC = {"int", "float", "int | None", "float | None"}
FIELDS = frozenset(name for section in SECTIONS for name, f in section.model_fields.items()
                   if getattr(f.annotation, "__name__", str(f.annotation)) in NUMERIC
                   or str(f.annotation) in NUMERIC)


def _number(node: ast.AST) -> float | None:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def _toml_settings(text: str) -> Iterator[tuple[str, Any]]:
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return
    stack = [table]
    while stack:
        for key, value in stack.pop().items():
            if isinstance(value, dict):
                stack.append(value)
            else:
                yield key, value


def settings(scope: ast.AST) -> Iterator[tuple[str, float, int]]:
    """Every (field, value, line) a piece of test code sets by hand."""
    for node in ast.walk(scope):
        if isinstance(node, ast.Dict):
            pairs = [(k.value, v) for k, v in zip(node.keys, node.values, strict=True)
                     if isinstance(k, ast.Constant) and isinstance(k.value, str)]
        elif isinstance(node, ast.Call):
            pairs = [(kw.arg, kw.value) for kw in node.keywords if kw.arg]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and "=" in node.value and "\n" in node.value:
            for key, value in _toml_settings(node.value):
                if key in FIELDS and not isinstance(value, bool) \
                        and isinstance(value, (int, float)):
                    yield key, value, node.lineno
            continue
        else:
            continue
        for key, value_node in pairs:
            value = _number(value_node)
            if key in FIELDS and value is not None:
                yield key, value, value_node.lineno


def scopes(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """A test file's units of configuration: each function (a test, a fixture, a helper
    that builds a config), and each module-level assignment."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            yield "module", node


def coincidences(source: str) -> list[str]:
    """Each scope of ``source`` in which two settings take one (non-zero) value."""
    lines = source.splitlines()
    found = []
    for name, scope in scopes(ast.parse(source)):
        by_value: dict[float, dict[str, int]] = {}
        for key, value, line in settings(scope):
            if value != 0 and "# coincide:" not in lines[line - 1]:
                by_value.setdefault(value, {})[key] = line
        found += [f"{name}: {sorted(keys)} all {value} (lines {sorted(set(keys.values()))})"
                  for value, keys in by_value.items() if len(keys) > 1]
    return found


def test_the_sweep_sees_each_way_a_test_writes_a_config() -> None:
    """The sweep itself, on code of the shapes it reads: red if it missed one.

    Bug class: a sweep blind to a shape (it would pass a suite full of coincidences).
    Planted: TOML texts not read; a call's keywords not read."""
    assert "header_timeout_s" in FIELDS and "omit_batch" in FIELDS and "timeout_s" in FIELDS
    assert "host" not in FIELDS and "websocket" not in FIELDS
    for code in [
        'LIMITS = {"header_timeout_s": 0.6, "body_timeout_s": 0.6}',
        'def t():\n    make(store={"retry_after_s": 0.2, "timeout_s": 0.2})',
        'def t():\n    Policy(max_run_loops=3, omit_batch=3)',
        "def t():\n    write(policy='omit_batch = 4\\nmax_time_range_s = 4\\n')",
        'def t():\n    a = {"max_body_bytes": 4096}\n    ServerSection(max_header_bytes=4096)',
    ]:
        assert len(coincidences(code)) == 1, code
    for code in [
        'LIMITS = {"header_timeout_s": 0.6, "body_timeout_s": 0.9}',
        'def t():\n    Policy(clear_at_least=0, reduce_at_least=0)',  # both off
        'def t():\n    Policy(max_run_loops=3, omit_batch=3)  # coincide: the batch is it',
        'def t():\n    make(websocket=True, max_retries=1)',  # a flag is no number
    ]:
        assert coincidences(code) == [], code


def test_no_two_settings_a_test_writes_coincide() -> None:
    """Every test file: no two numeric settings of the config one test writes by hand take
    one value (see the module's docstring).

    Bug class: values that coincide in the test world, so that one setting read in another's
    place passes. Seen red with the serving tests' 0.6-second header and body deadlines and
    the store tests' 0.2-second timeout and retry pause (each now drawn or set apart)."""
    found = []
    for path in sorted(TESTS.glob("*.py")):
        found += [f"{path.name}: {c}" for c in coincidences(path.read_text())]
    assert found == [], "\n".join(found)
