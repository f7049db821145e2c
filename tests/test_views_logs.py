"""How ``runloop-proxy inspect`` says things in a line (ops/views.py, pure: loop spans, record
lines, pretty JSON) and the JSON logs (ops/logs.py) as a machine reads them; the inspector's
own wording is test_views.py's."""

from __future__ import annotations

import io
import threading
from typing import Any

import orjson
import pytest

from runloop_proxy.ops import logs
from runloop_proxy.ops.views import (
    KINDS,
    PRETTY_MAX,
    branch_origin,
    loop_span,
    pretty,
    record_line,
)
from runloop_proxy.window.builder import CompactionKind

from .conftest import logged_as_served


@pytest.mark.parametrize(("span", "said"), [
    ([0, 4], "loops 0–4"), ([3, 3], "loop 3"), (["2", "7"], "loops 2–7"), ((0, 0), "loop 0")])
def test_loop_span(span: Any, said: str) -> None:
    assert loop_span(span) == said


@pytest.mark.parametrize(("record", "said"), [
    ({"kind": "past_loop_reduction", "tokens_before": 12000, "tokens_after": 3400,
      "reason": "past run loops"}, "past loops reduced: 12,000 → 3,400 tokens (past run loops)"),
    ({"kind": "loop_omission", "at_message": 40, "tokens_before": 9000, "tokens_after": 5000},
     "loops omitted at message 40: 9,000 → 5,000 tokens"),
    ({"kind": "rejection", "tokens_before": 200000, "tokens_after": None},
     "rejected: over the context window: 200,000 → — tokens"),
    ({"kind": "branch_pruned", "branch": 2, "length": 9},
     "branch 2 pruned (9 messages; past max_branches, least recently used)"),
    ({}, "event: — → — tokens"),
    ({"kind": "summary", "at_message": "7", "reason": ""}, "summary of loops (by the summariser)"),
])
def test_record_line(record: dict[str, Any], said: str) -> None:
    assert record_line(record) == said


def test_every_compaction_kind_has_a_phrase() -> None:
    assert set(KINDS) == set(CompactionKind)
    assert record_line({"kind": "in_loop_elision"}).startswith("tool results elided: ")


@pytest.mark.parametrize(("branch", "said"), [
    ({"parent": None, "fork_at": 0}, "the session's first branch"),
    ({}, "the session's first branch"),
    ({"parent": 0, "fork_at": 5}, "forked from 0 at message 5"),
    ({"parent": 2, "fork_at": None}, "forked from 2"),
    ({"parent": 1, "fork_at": 0}, "forked from 1 at message 0"),
])
def test_branch_origin(branch: dict[str, Any], said: str) -> None:
    assert branch_origin(branch) == said


@pytest.mark.parametrize(("text", "shown"), [
    ('{"a": 1, "b": [2]}', '{\n  "a": 1,\n  "b": [\n    2\n  ]\n}'),
    ('  [1]', "[\n  1\n]"),
    ("{not json", "{not json"),
    ("plain text {1}", "plain text {1}"),
    ("", ""),
    ("[" + "1," * PRETTY_MAX + "1]", "[" + "1," * PRETTY_MAX + "1]"),
])
def test_pretty_indents_json_and_leaves_the_rest(text: str, shown: str) -> None:
    assert pretty(text) == shown


def logged(fmt: str, **extra: Any) -> str:
    stream = io.StringIO()
    with logged_as_served(stream, fmt):  # conftest puts the loggers back after the test
        logs.get("test").info("request", extra=extra)
        logs.get("test").debug("not at info")
    return stream.getvalue()


def test_json_logs_are_one_object_a_line_with_their_fields() -> None:
    lines = logged("json", tenant="acme", status=200, tokens=None).splitlines()
    assert len(lines) == 1  # the debug line is below the level
    rec = orjson.loads(lines[0])
    assert {k: rec[k] for k in ("level", "logger", "msg", "tenant", "status", "tokens")} == {
        "level": "info", "logger": "runloop.test", "msg": "request", "tenant": "acme",
        "status": 200, "tokens": None}
    assert rec["ts"].endswith("Z") and rec["ts"][10] == "T"


def test_text_logs_are_for_a_terminal() -> None:
    line = logged("text", tenant="acme").strip()
    assert "INFO" in line and line.endswith("request tenant=acme")
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(line)


def test_replay_says_what_is_wrong_and_nothing_it_was_told_not_to(tmp_path: Any) -> None:
    """``--no-progress``: nothing on stderr but what went wrong; ``--direct`` alone says it
    needs ``--proxy``."""
    import subprocess
    import sys

    path = tmp_path / "c.jsonl"
    path.write_text(orjson.dumps({"messages": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "yo"},
                                               {"role": "user", "content": "and?"}]}).decode())

    def replay(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "runloop_proxy", "replay", str(path),
                               *args], capture_output=True, text=True, timeout=120)
    quiet = replay("--no-progress")
    assert quiet.returncode == 0 and quiet.stderr == "" and "saving" in quiet.stdout.lower()
    alone = replay("--no-progress", "--direct", "http://127.0.0.1:9/v1")
    assert alone.returncode == 2
    assert "--direct compares against a proxy: give --proxy as well" in alone.stderr


def test_a_line_is_formatted_in_the_writers_thread_not_the_callers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A logging call on the event loop only queues its record: every formatter's fields
    (``logs.fields``) are made in the writer's thread. The event-loop bounds let a little
    formatting on the loop pass (planted: the record formatted in ``_Enqueue.prepare``,
    green there); this is red with it."""
    made_in: list[threading.Thread] = []
    fields = logs.fields

    def where(record: Any) -> dict[str, Any]:
        made_in.append(threading.current_thread())
        return fields(record)

    monkeypatch.setattr(logs, "fields", where)
    stream = io.StringIO()
    with logged_as_served(stream):
        logs.get("test").info("request", extra={"tenant": "acme"})
    assert made_in and threading.current_thread() not in made_in
    assert orjson.loads(stream.getvalue())["tenant"] == "acme"
