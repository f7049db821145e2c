"""A closed run loop cut into segments for long-term memory (pure).

Seed 002 archives each finished loop: every iteration (observe, think, act) cut by kind — the
user's words, the agent's reasoning, a tool call, a tool result, the final response — each
piece anchored to its place (loop, iteration, segment, kind), so a hit found by meaning can be
opened back into the loop around it. A segment is keyed by its kind and text alone: an echoed
or forked copy of a loop is the same segments, embedded once.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from enum import StrEnum
from typing import NamedTuple

from .messages import Message, content_hash, message_text, tool_calls_of
from .runloops import LoopStatus, RunLoop, segment

SEGMENT_CHARS = 1_200  # at most, a segment's text: what a static embedding still tells apart
MAX_PARTS = 24  # of one message; a longer one (a 480 KB log) is embedded by its first parts
# where a long text is cut, best first: a paragraph, a line, a sentence, a word
_BREAKS = (re.compile(r"\n\s*\n"), re.compile(r"\n"), re.compile(r"(?<=[.!?;])\s"),
           re.compile(r"\s"))
# the same, matched from the end: the greedy prefix backs off from the end to the last one
# (a list of every match was most of the time a 10,000-segment conversation took to cut)
_LAST = tuple(re.compile(r"(?s:.*)(?:" + p.pattern + ")") for p in _BREAKS)


class Kind(StrEnum):
    USER = "user"
    REASONING = "reasoning"  # an assistant's text beside its tool calls
    TOOL_CALL = "tool_call"
    TOOL_RESULT = "tool_result"
    RESPONSE = "response"  # the loop's final reply


class Anchor(NamedTuple):
    """Where a segment stands: its loop, the iteration in the loop (each assistant message
    that calls tools ends one), its index among the loop's segments, its kind, the message's
    position in the conversation and the part of the message it is."""

    loop: int
    iteration: int
    segment: int
    kind: Kind
    position: int
    part: int


class Segment(NamedTuple):
    key: str  # content hash of kind and text: the same piece anywhere is one vector
    anchor: Anchor
    text: str


def closed_loops(messages: list[Message]) -> list[RunLoop]:
    """The loops of ``messages`` that are over (a later user message opened another, or
    the final reply ended them): those seed 002 archives."""
    return [lp for lp in segment(messages) if lp.status is LoopStatus.CLOSED]


def archived_loops(messages: list[Message]) -> list[RunLoop]:
    """What long-term memory keeps of ``messages``: the closed loops whole, and of the open
    one (the last) its finished iterations: all before its newest assistant message, whose
    calls may still be answered. Those never change kind later (no piece of them becomes the
    loop's final reply), so their segments and anchors are the ones the loop has once closed:
    a coding agent's hundred steps under one task are found while the task is still going."""
    loops = segment(messages)
    out = [lp for lp in loops if lp.status is LoopStatus.CLOSED]
    last = loops[-1] if loops else None
    if last is not None and last.status is not LoopStatus.CLOSED:
        newest = next((p for p in reversed(last.positions)
                       if messages[p].get("role") == "assistant"), None)
        if newest is not None and newest > last.start:
            out.append(dataclasses.replace(last, end=newest))
    return out


def segments(messages: list[Message], loops: list[RunLoop],
             max_chars: int = SEGMENT_CHARS) -> list[Segment]:
    """The segments of ``loops`` (of ``messages``), in order."""
    out: list[Segment] = []
    for lp in loops:
        out.extend(loop_segments(messages, lp, max_chars))
    return out


def loop_segments(messages: list[Message], lp: RunLoop,
                  max_chars: int = SEGMENT_CHARS) -> list[Segment]:
    out: list[Segment] = []
    iteration = 0
    for pos in lp.positions:
        m = messages[pos]
        for kind, text in _pieces(m, pos == lp.final_position):
            for part, piece in enumerate(split(text, max_chars)):
                anchor = Anchor(lp.index, iteration, len(out), kind, pos, part)
                out.append(Segment(segment_key(kind, piece), anchor, piece))
        if m.get("role") == "assistant" and tool_calls_of(m):
            iteration += 1
    return out


def segment_key(kind: Kind, text: str) -> str:
    return content_hash(str.encode(kind + "\0" + text))


def _pieces(m: Message, final: bool) -> Iterator[tuple[Kind, str]]:
    role = m.get("role")
    if role == "user":
        yield Kind.USER, message_text(m)
    elif role == "tool":
        yield Kind.TOOL_RESULT, message_text(m)
    elif role == "assistant":
        calls = tool_calls_of(m)
        text = message_text(m)
        if text.strip():
            yield (Kind.RESPONSE if final and not calls else Kind.REASONING), text
        for c in calls:
            fn = c.get("function") or {}
            yield Kind.TOOL_CALL, f"{fn.get('name') or ''}({fn.get('arguments') or ''})"


def split(text: str, max_chars: int = SEGMENT_CHARS) -> list[str]:
    """``text`` in pieces of at most ``max_chars``, cut at the best boundary in the second
    half of each piece (a paragraph, a line, a sentence end, a space; else hard), blank
    pieces dropped, at most ``MAX_PARTS``. Work linear in what it returns."""
    out: list[str] = []
    start, n = 0, len(text)
    while start < n and len(out) < MAX_PARTS:
        end = min(n, start + max_chars)
        if end < n:
            end = _cut(text, start + max_chars // 2, end)
        piece = text[start:end].strip()
        if piece:
            out.append(piece)
        start = end
    return out


def _cut(text: str, lo: int, hi: int) -> int:
    """The last best boundary in ``text[lo:hi]`` (after it), or ``hi``."""
    for pattern in _LAST:
        found = pattern.match(text, lo, hi)
        if found:
            return found.end()
    return hi
