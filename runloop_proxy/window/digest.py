"""The extractive summariser (pure): a deterministic digest of run loops, no LLM.

Per loop left out: the question, the answer, and the identifiers the loop produced — ids,
paths, numbers, e-mail addresses, names with digits — taken from the user's words first, then
the calls' arguments, then the tool results; deduplicated across the whole summary. Rolling:
the digest of loops [e, e') is appended to the summary of [0, e); past ``max_tokens`` the oldest
loop lines go first, and the identifiers stay longest (they are what a later reply quotes).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from ..conversation.messages import Message, text_of, tool_calls_of

VERSION = "extractive-1"
HEADER = "Turns left out (extractive digest):"
IDS_HEADER = "Identifiers from them:"
QUESTION_CHARS = 160
ANSWER_CHARS = 240
IDS_PER_LOOP = 12
_TOKEN = re.compile(r"[^\s,;()\[\]{}<>=\"'`|]+")
_TRIM = ".:!?*"


def identifiers(text: str) -> list[str]:
    """Identifier-like tokens of ``text``, in order: with a digit, a path separator or an @."""
    out = []
    for t in _TOKEN.findall(text):
        t = t.strip(_TRIM)
        if 3 <= len(t) <= 80 and any(ch.isdigit() or ch in "/@" for ch in t):
            out.append(t)
    return out


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def loop_digest(messages: Sequence[Message]) -> tuple[str, list[str]]:
    """One loop as a line (question → answer) and the identifiers it produced."""
    users = [text_of(m.get("content")) for m in messages if m.get("role") == "user"]
    finals = [text_of(m.get("content")) for m in messages
              if m.get("role") == "assistant" and not tool_calls_of(m)]
    calls = [c for m in messages for c in tool_calls_of(m)]
    line = f"- Q: {_clip(' / '.join(users), QUESTION_CHARS)}"
    if calls:
        names = sorted({str((c.get("function") or {}).get("name") or "") for c in calls})
        line += f" [tools: {', '.join(n for n in names if n)}]"
    line += f" → A: {_clip(finals[-1] if finals else '(no answer)', ANSWER_CHARS)}"
    found: list[str] = []
    for text in users + [str((c.get("function") or {}).get("arguments") or "") for c in calls] \
            + finals + [text_of(m.get("content")) for m in messages if m.get("role") == "tool"]:
        found += identifiers(text)
    seen: set[str] = set()
    ids = [x for x in found if not (x in seen or seen.add(x))]  # type: ignore[func-returns-value]
    return line, ids[:IDS_PER_LOOP]


def parse(summary: str | None) -> tuple[list[str], list[str]]:
    """A digest's loop lines and identifiers, to roll it on."""
    if not summary:
        return [], []
    lines, ids, in_ids = [], [], False
    for ln in summary.splitlines():
        if ln == IDS_HEADER:
            in_ids = True
        elif in_ids and ln:
            ids += ln.split(" ")
        elif ln.startswith("- "):
            lines.append(ln)
    return lines, ids


def render(lines: list[str], ids: list[str]) -> str:
    out = [HEADER, *lines]
    if ids:
        out += [IDS_HEADER, " ".join(ids)]
    return "\n".join(out)


def roll(previous: str | None, loops: Sequence[Sequence[Message]], max_tokens: int,
         count: Callable[[str], int]) -> str:
    """The summary of what ``previous`` covered and ``loops`` after it, within ``max_tokens``
    (``count`` tells a text's tokens)."""
    lines, ids = parse(previous)
    seen = set(ids)
    for loop in loops:
        line, found = loop_digest(loop)
        lines.append(line)
        for x in found:
            if x not in seen:
                seen.add(x)
                ids.append(x)
    text = render(lines, ids)
    while count(text) > max_tokens and len(lines) > 1:
        lines.pop(0)  # the oldest loop's line first: its identifiers stay
        text = render(lines, ids)
    while count(text) > max_tokens and ids:
        ids = ids[len(ids) // 8 + 1:]  # then the oldest identifiers
        text = render(lines, ids)
    while count(text) > max_tokens and lines:
        lines.pop()  # a newest line longer than the whole budget
        text = render(lines, ids)
    return text
