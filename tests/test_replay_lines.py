"""``runloop-proxy replay`` and a trace's malformed lines: any JSON value as a line, and chat,
Responses and Messages lines with any field of the wrong JSON type, each answered with the
one line ``FILE:LINE: why`` (exit 2), or replayed — never a traceback."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runloop_proxy.cli import main

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.text(max_size=10)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["role", "content", "type", "text", "messages", "input", "tools",
                         "tool_calls", "id", "name", "function", "arguments", "call_id",
                         "output", "system", "instructions", "meta", "tool_use_id",
                         "input_schema", "parameters", "x"]) | st.text(max_size=6),
        inner, max_size=4), max_leaves=12)

CALL = "call_Xk2m9QpR4vT7wY1zA3bC5dE8"
CHAT = {"id": "conv-chat-1", "meta": {"domain": "retail"}, "messages": [
    {"role": "system", "content": "You are the shop's agent."},
    {"role": "user", "content": "Where is order 4417?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": CALL, "type": "function", "function": {"name": "get_order",
                                                      "arguments": '{"id": "4417"}'}}]},
    {"role": "tool", "tool_call_id": CALL, "content": "{\"status\": \"shipped\"}"},
    {"role": "assistant", "content": "It shipped yesterday."}],
    "tools": [{"type": "function", "function": {"name": "get_order", "parameters": {
        "type": "object", "properties": {"id": {"type": "string"}}}}}]}
RESPONSES = {"id": "conv-resp-1", "instructions": "Be brief.", "input": [
    {"role": "user", "content": [{"type": "input_text", "text": "List the repo."}]},
    {"type": "function_call", "call_id": CALL, "name": "shell", "arguments": '{"cmd": "ls"}'},
    {"type": "function_call_output", "call_id": CALL, "output": "README.md\nsrc"},
    {"type": "message", "role": "assistant", "content": [
        {"type": "output_text", "text": "Two entries."}]}],
    "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]}
MESSAGES = {"id": "conv-msg-1", "system": "You are Claude Code.", "messages": [
    {"role": "user", "content": "Run the tests."},
    {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9", "name": "Bash",
         "input": {"command": "pytest -q"}}]},
    {"role": "user", "content": [{"type": "tool_result",
                                  "tool_use_id": "toolu_01A09q90qw90lq917835lq9",
                                  "content": "3 passed"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "All three pass."}]}],
    "tools": [{"name": "Bash", "input_schema": {"type": "object"}}]}
SHAPES = [CHAT, RESPONSES, MESSAGES]


def _places(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON value (the path to it), the value itself included."""
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _places(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _places(v, (*path, i))
    return out


@st.composite
def wrong_typed(draw: st.DrawFn) -> Any:
    """A recorded line of one of the three shapes, one value somewhere in it replaced by
    any JSON (a string where an array goes, an object for a role, a number for a call)."""
    line = copy.deepcopy(draw(st.sampled_from(SHAPES)))
    place = draw(st.sampled_from(_places(line)[1:]))
    parent = line
    for key in place[:-1]:
        parent = parent[key]
    parent[place[-1]] = draw(JSON)
    return line


def replay(tmp_path: Path, line: bytes) -> tuple[int, str, str]:
    f = tmp_path / "trace.jsonl"
    f.write_bytes(line + b"\n")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["replay", str(f), "--json", "--no-progress"])
        except BaseException as exc:  # what the CLI lets out is a traceback for the user
            raise AssertionError(f"{line[:300]!r} raised {type(exc).__name__}: {exc}") from exc
    return code, out.getvalue(), err.getvalue()


def _check(tmp_path: Path, line: bytes) -> None:
    code, out, err = replay(tmp_path, line)
    f = tmp_path / "trace.jsonl"
    if code == 0:
        assert json.loads(out)["conversations"] == 1 and err == ""
        return
    assert code == 2, (code, err)
    assert re.fullmatch(rf"{re.escape(str(f))}:1: \S[^\n]*\n", err), err
    assert "Traceback" not in err and out == ""


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(JSON)
def test_any_json_value_as_a_line_is_answered_in_one_line(tmp_path: Path, value: Any) -> None:
    """Bug class: a malformed line that reaches the replay's readers and raises there (a
    traceback, not the line's place). Red with the reader before this fix (a chat line
    whose message is ``null``: AttributeError) and with the Responses items passed to the
    conversion unchecked."""
    _check(tmp_path, json.dumps(value).encode())


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(wrong_typed())
def test_a_field_of_the_wrong_type_anywhere_is_answered_in_one_line(
        tmp_path: Path, line: Any) -> None:
    """Chat, Responses and Messages lines with one value anywhere replaced by any JSON:
    replayed, or refused as ``FILE:LINE: why``. Red with a Messages line's turns and blocks
    left unchecked, and with a chat line's left unchecked and no net around the replay of
    each conversation (what the checks let through is named by its line too)."""
    _check(tmp_path, json.dumps(line).encode())


def test_the_three_shapes_replay_and_a_broken_one_names_its_line(tmp_path: Path) -> None:
    for shape in SHAPES:
        code, out, err = replay(tmp_path, json.dumps(shape).encode())
        assert code == 0 and json.loads(out)["conversations"] == 1, err
    f = tmp_path / "trace.jsonl"
    f.write_text("\n".join([json.dumps(CHAT), "", json.dumps(
        {**RESPONSES, "input": [{"type": "function_call_output", "call_id": 7}]})]) + "\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["replay", str(f), "--no-progress"]) == 2
    assert err.getvalue().startswith(f"{f}:3: ") and err.getvalue().count("\n") == 1
