"""What a window keeps of what the agent needs next (pure): reference retention.

The *references* of a recorded assistant turn are the identifier-like values its reply uses —
its tool calls' argument values, and in its text the tokens with a digit or a path separator
(order ids, user ids, paths, line numbers, hashes) and quoted strings — that occur earlier in
the conversation's non-system messages and not in the system prompt or the tool schemas: the
reply took them from the history. A window *retains* a reference when it shows it anywhere
(a message, a reduced loop, a note, a summary). The share retained, over a conversation's
turns, is what a compression policy keeps of what the model went on to use; split by origin —
the current run loop or a past one — it shows where a policy loses. Pass-through retains
everything by construction (the measure's own sanity check).

A reference the window hides is not lost when the model can get it back: it lies in a message
whose ref (or a result whose call id) the window shows, for ``recall_tool_call``, or a
``search_history`` for the reference itself finds a message that holds it. What neither
reaches is counted as lost.

Two readers. The *plain* one (``candidates``) takes a call's argument values whole and matches
by substring. The *careful* one (``careful_candidates``), as a reviewer reads, also takes the
identifiers inside them and inside the text — paths, dotted names, snake_case and camelCase
names, numbers inside expressions (``sed -n 100,120p``: 100 and 120) — takes a price with and
without its ``$``, and matches whole tokens only (``594`` is not in ``6594``, nor ``_id`` in
``user_id``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from ..conversation.messages import Message, text_of
from .digest import leaves
from .names import decoded, holds, names

MIN_CHARS = 3
MAX_CHARS = 200
MAX_REFS = 64  # per turn
_TOKEN = re.compile(r"[^\s,;()\[\]{}<>=]+")
_QUOTED = re.compile(r"\"([^\"\n]{3,200})\"|'([^'\n]{3,200})'|`([^`\n]{3,200})`")
_TRIM = ".:!?'\"`*"


def message_text(m: Message) -> str:
    """Everything a message shows the model: its text and its calls' ids, names and
    arguments."""
    parts = [text_of(m.get("content"))]
    for c in m.get("tool_calls") or []:
        fn: Any = c.get("function") or c.get("custom") or {}
        parts += [str(c.get("id") or ""), str(fn.get("name") or ""),
                  str(fn.get("arguments") or fn.get("input") or "")]
    return "\n".join(parts)


def _arguments(reply: Message) -> list[str]:
    """A reply's calls' argument values, each whole (a call whose arguments are not JSON:
    its arguments)."""
    found: list[str] = []
    for c in reply.get("tool_calls") or []:
        fn: Any = c.get("function") or c.get("custom") or {}
        args = fn.get("arguments") if "arguments" in fn else fn.get("input")
        try:
            found += leaves(orjson.loads(args)) if isinstance(args, str) else []
        except orjson.JSONDecodeError:
            found.append(str(args))
    return found


def _distinct(found: list[str]) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    for v in found:
        v = v.strip()
        if MIN_CHARS <= len(v) <= MAX_CHARS and v not in seen:
            seen.add(v)
            out.append(v)
    return out[:MAX_REFS]


def _quoted(text: str) -> list[str]:
    return [next(g for g in q if g) for q in _QUOTED.findall(text)]


def candidates(reply: Message) -> list[str]:
    """The identifier-like values a reply uses, in order, without repeats (the plain
    reader): argument values whole, and the text's tokens with a digit or a path separator
    and its quoted strings."""
    text = text_of(reply.get("content"))
    return _distinct([*_arguments(reply),
                      *(t.strip(_TRIM) for t in _TOKEN.findall(text)
                        if any(ch.isdigit() or ch == "/" for ch in t)),
                      *_quoted(text)])


def careful_candidates(reply: Message) -> list[str]:
    """What a reviewer reads as the reply's identifier-like values: argument values whole
    and the identifiers inside them, the identifiers of the text and its quoted strings."""
    values = _arguments(reply)
    text = text_of(reply.get("content"))
    return _distinct([" ".join(v.split()) for v in (*values, *(x for v in values
                                                              for x in names(v)),
                                                   *names(text), *_quoted(text))])


def _readable(m: Message) -> str:
    return " ".join(decoded(m).split())


def _substring(text: str, ref: str) -> bool:
    return ref in text


@dataclass
class Retention:
    """References found in the history and how many a window showed, by origin."""

    current: int = 0
    current_kept: int = 0
    past: int = 0
    past_kept: int = 0
    by_ref: int = 0  # hidden, in a message whose ref the window shows
    by_search: int = 0  # hidden, else found by search_history for the reference
    measured: bool = False  # whether the ways back were checked

    @property
    def total(self) -> int:
        return self.current + self.past

    @property
    def kept(self) -> int:
        return self.current_kept + self.past_kept

    @property
    def lost(self) -> int:
        return self.total - self.kept - self.by_ref - self.by_search

    def add(self, other: Retention) -> None:
        self.current += other.current
        self.current_kept += other.current_kept
        self.past += other.past
        self.past_kept += other.past_kept
        self.by_ref += other.by_ref
        self.by_search += other.by_search
        self.measured |= other.measured

    def as_dict(self) -> dict[str, Any]:
        def share(kept: int, total: int) -> float | None:
            return round(kept / total, 4) if total else None
        out = {"references": self.total, "retained": share(self.kept, self.total),
               "current_loop": share(self.current_kept, self.current),
               "past_loops": share(self.past_kept, self.past),
               "current_references": self.current, "past_references": self.past}
        if self.measured:
            out |= {"hidden": self.total - self.kept, "recallable_by_ref": self.by_ref,
                    "found_by_search": self.by_search, "lost": self.lost}
        return out


class Conversation:
    """A recorded conversation's texts, computed once, asked turn by turn."""

    def __init__(self, messages: list[Message], fixed: str, careful: bool = False):
        self.messages = messages
        # the careful reader reads arguments decoded (a JSON escape is not a letter) and a
        # run of whitespace as one space, as search_history does
        self.show = _readable if careful else message_text
        self.texts = [self.show(m) for m in messages]
        self.system = [m.get("role") in ("system", "developer") for m in messages]
        self.fixed = fixed  # the system prompt and the tool schemas: not history
        self.read = careful_candidates if careful else candidates
        self.holds: Callable[[str, str], bool] = holds if careful else _substring

    def references(self, i: int, loop_start: int) -> tuple[list[str], list[str]]:
        """The references of the reply at ``i``: (from the current loop, from past loops)."""
        current: list[str] = []
        past: list[str] = []
        has = self.holds
        for ref in self.read(self.messages[i]):
            if has(self.fixed, ref):
                continue
            last = next((k for k in range(i - 1, -1, -1)
                         if not self.system[k] and has(self.texts[k], ref)), None)
            if last is not None:
                (current if last >= loop_start else past).append(ref)
        return current, past

    def retention(self, i: int, loop_start: int, window: list[Message],
                  refs: list[str] | None = None,
                  search: Callable[[str, int], list[int]] | None = None) -> Retention:
        """How many of the references of the reply at ``i`` the ``window`` shows; given the
        messages' ``refs`` and ``search`` (a query and the request's length → the positions
        search_history returns), how the hidden ones can be got back."""
        current, past = self.references(i, loop_start)
        if not current and not past:
            return Retention(measured=refs is not None)
        shown = "\n".join(self.show(m) for m in window)
        has = self.holds
        out = Retention(len(current), sum(has(shown, r) for r in current),
                        len(past), sum(has(shown, r) for r in past), measured=refs is not None)
        if refs is None or search is None:
            return out
        for r in current + past:
            if has(shown, r):
                continue
            holders = [k for k in range(i) if not self.system[k] and has(self.texts[k], r)]
            if any(refs[k] in shown or (self.messages[k].get("tool_call_id") or "\0") in shown
                   for k in holders):
                out.by_ref += 1
            elif set(search(r, i)) & set(holders):
                out.by_search += 1
        return out
