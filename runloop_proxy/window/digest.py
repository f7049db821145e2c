"""The extractive summariser (pure): a deterministic digest of run loops, no LLM.

Per loop left out: the question, the answer, and the identifiers the loop produced — ids,
paths, numbers, e-mail addresses, names with digits — taken from the user's words first, then
the calls' arguments and the agent's replies, then the tool results, strongest first (codes
mixing letters and digits, then paths, addresses, dates and long numbers, then the rest:
quantities, prices, clock times, timestamps); deduplicated across the whole summary.

Rolling and append-only: the digest of loops [e, e') is a block (their lines, then the
identifiers they add) appended to the summary of [0, e), so while it fits in ``max_tokens`` the
summary's text only grows and a provider's prefix cache keeps serving what the marker already
showed. Past ``max_tokens`` it is rewritten once as a single block, condensed to
``CONDENSE_SHARE`` of the budget so that the next batches append again: the oldest loop lines go
first, and the identifiers stay longest (they are what a later reply quotes).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from ..conversation.messages import Message, text_of, tool_calls_of

VERSION = "extractive-4"
HEADER = "Turns left out:"
IDS_HEADER = "Identifiers:"
_IDS_HEADERS = (IDS_HEADER, "Identifiers from them:")  # and what extractive-3 wrote
QUESTION_CHARS = 80
ANSWER_CHARS = 120
IDS_PER_LOOP = 12
CONDENSE_SHARE = 0.5  # of the budget, after a rewrite: the next batches append again
_TOKEN = re.compile(r"[^\s,;()\[\]{}<>=\"'`|]+")
_TRIM = ".:!?*"
_MARK = re.compile(r"[\d/@]")
_DATE = re.compile(r"\d{4}-\d\d-\d\d")
_CLOCK = re.compile(r"\d:\d\d")


def identifiers(text: str) -> list[str]:
    """Identifier-like tokens of ``text``, in order: with a digit, a path separator or an @."""
    out = []
    for t in _TOKEN.findall(text):
        if _MARK.search(t):  # the trimmed characters are none of these
            t = t.strip(_TRIM)
            if 3 <= len(t) <= 80:
                out.append(t)
    return out


def strength(ident: str) -> int:
    """How surely a tool result's identifier names a thing a later turn may come back to,
    0 (surest) to 2: what the agent did not repeat is ranked by its look. Codes mixing letters
    and digits (order ids, user names with numbers, SKUs) come first; then dates, paths,
    addresses and long numbers; then short numbers, prices, clock times and timestamps, which
    measure a record more often than they name one."""
    if _DATE.fullmatch(ident):
        return 1
    if _CLOCK.search(ident):
        return 2
    digits = sum(ch.isdigit() for ch in ident)
    if digits and any(ch.isalpha() for ch in ident):
        return 0
    return 1 if digits >= 5 or "/" in ident or "@" in ident else 2


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


class Found(NamedTuple):
    """The identifiers one message holds, by where they stand in a digest's order."""

    user: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    final: tuple[str, ...] = ()
    results: tuple[tuple[str, ...], ...] = ((), (), ())  # a tool result's, by strength


def found_in(m: Message) -> Found:
    """What ``pick`` needs of a message (the regex runs once per message, so a caller that
    keeps these picks over any span of messages without reading their texts again)."""
    role = m.get("role")
    if role == "user":
        return Found(user=tuple(identifiers(text_of(m.get("content")))))
    if role == "tool":
        ranked: tuple[list[str], list[str], list[str]] = ([], [], [])
        for x in identifiers(text_of(m.get("content"))):
            ranked[strength(x)].append(x)
        return Found(results=tuple(map(tuple, ranked)))
    if role != "assistant":
        return Found()
    calls = tool_calls_of(m)
    if calls:
        return Found(args=tuple(x for c in calls for x in identifiers(
            str((c.get("function") or {}).get("arguments") or ""))))
    return Found(final=tuple(identifiers(text_of(m.get("content")))))


def pick(found: Sequence[Found], results: Iterable[Found] | None = None,
         cap: int = IDS_PER_LOOP) -> list[str]:
    """Up to ``cap`` identifiers of a span of messages, without repeats: the users' words,
    the calls' arguments and the final replies first, in order; then the tool results',
    strongest first. ``results``, when given, holds the tool results' (``found`` then need
    not): it is read lazily, only as far as the cap needs."""
    out: list[str] = []
    seen: set[str] = set()

    def full(ids: tuple[str, ...]) -> bool:
        for x in ids:
            if x not in seen:
                seen.add(x)
                out.append(x)
                if len(out) >= cap:
                    return True
        return False

    for field in ("user", "args", "final"):
        if any(full(getattr(f, field)) for f in found):
            return out
    read: list[Found] = []
    for f in found if results is None else results:
        read.append(f)
        if full(f.results[0]):
            return out
    for s in (1, 2):
        if any(full(f.results[s]) for f in read):
            return out
    return out


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
    return line, pick([found_in(m) for m in messages])


def parse(summary: str | None) -> tuple[list[str], list[str]]:
    """A digest's loop lines and identifiers (of all its blocks), to roll it on."""
    if not summary:
        return [], []
    lines: list[str] = []
    ids: list[str] = []
    for ln in summary.splitlines():
        head = next((h for h in _IDS_HEADERS if ln.startswith(h)), None)
        if head is not None:
            ids += ln[len(head):].split()
        elif ln.startswith("- "):
            lines.append(ln)
    return lines, ids


def block(lines: list[str], ids: list[str]) -> str:
    """Loop lines and the identifiers they add, as the lines of one block."""
    return "\n".join([*lines, *([f"{IDS_HEADER} {' '.join(ids)}"] if ids else [])])


def render(lines: list[str], ids: list[str]) -> str:
    return f"{HEADER}\n{block(lines, ids)}"


def roll(previous: str | None, loops: Sequence[Sequence[Message]], max_tokens: int,
         count: Callable[[str], int], lines_too: bool = True) -> str:
    """The summary of what ``previous`` covered and ``loops`` after it, within ``max_tokens``
    (``count`` tells a text's tokens): ``previous`` with a block appended while that fits,
    else everything rewritten into ``CONDENSE_SHARE`` of the budget. Without ``lines_too``
    the blocks hold the identifiers alone (no question → answer line per loop)."""
    lines, ids = parse(previous)
    seen = set(ids)
    new_lines, new_ids = [], []
    for loop in loops:
        line, found = loop_digest(loop)
        if lines_too:
            new_lines.append(line)
        for x in found:
            if x not in seen:
                seen.add(x)
                new_ids.append(x)
    text = f"{previous or HEADER}\n{block(new_lines, new_ids)}"
    if count(text) <= max_tokens:
        return text
    return condensed([*lines, *new_lines], [*ids, *new_ids],
                     max(1, int(max_tokens * CONDENSE_SHARE)), count)


def condensed(lines: list[str], ids: list[str], max_tokens: int,
              count: Callable[[str], int]) -> str:
    """One block within ``max_tokens``: the oldest loop lines leave first, the identifiers
    stay longest."""
    text = render(lines, ids)
    while count(text) > max_tokens and len(lines) > 1:
        lines = lines[1:]  # the oldest loop's line first: its identifiers stay
        text = render(lines, ids)
    while count(text) > max_tokens and ids:
        ids = ids[len(ids) // 8 + 1:]  # then the oldest identifiers
        text = render(lines, ids)
    while count(text) > max_tokens and lines:
        lines = lines[:-1]  # a newest line longer than the whole budget
        text = render(lines, ids)
    return text
