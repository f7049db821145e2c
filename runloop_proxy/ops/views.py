"""How the inspector and ``runloop-proxy inspect`` say things about a session: loop spans,
compression records, branches (pure: values in, text out; the caller escapes for HTML)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from ..window.builder import CompactionKind

KINDS = {CompactionKind.PAST_LOOPS: "past loops reduced", CompactionKind.OMISSION: "loops omitted",
         CompactionKind.ELISION: "tool results elided", CompactionKind.DROP: "exchanges dropped",
         CompactionKind.TRUNCATION: "hard limit", CompactionKind.SUMMARY: "summary",
         CompactionKind.REJECTION: "rejected: over the context window"}


def loop_span(first_last: Sequence[int]) -> str:
    """``[0, 4]`` → "loops 0–4" (both included); ``[3, 3]`` → "loop 3"."""
    first, last = int(first_last[0]), int(first_last[1])
    return f"loop {first}" if first == last else f"loops {first}–{last}"


def _tokens(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else "—"


def record_line(rec: Mapping[str, Any]) -> str:
    """A compression record in one line: what it did, the tokens before and after, why."""
    kind = str(rec.get("kind") or "event")
    label = KINDS[CompactionKind(kind)] if kind in set(CompactionKind) else kind
    where = f" at message {rec['at_message']}" if isinstance(rec.get("at_message"), int) else ""
    reason = f" ({rec['reason']})" if rec.get("reason") else ""
    return (f"{label}{where}: {_tokens(rec.get('tokens_before'))} → "
            f"{_tokens(rec.get('tokens_after'))} tokens{reason}")


def branch_origin(branch: Mapping[str, Any]) -> str:
    """Where a branch comes from: the first branch, or the one it forked from and where."""
    if branch.get("parent") is None:
        return "the session's first branch"
    at = branch.get("fork_at")
    return f"forked from {branch['parent']}" + (f" at message {at}" if at is not None else "")


PRETTY_MAX = 2 << 20  # larger texts are shown as they are


def pretty(text: str) -> str:
    """A JSON text indented for reading (a tool's result, a call's arguments); any other
    text as it is."""
    if not text or len(text) > PRETTY_MAX or text.lstrip()[:1] not in ("{", "["):
        return text
    try:
        return orjson.dumps(orjson.loads(text), option=orjson.OPT_INDENT_2).decode()
    except orjson.JSONDecodeError:
        return text
