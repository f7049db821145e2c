"""Segmentation of a conversation into run loops (pure).

A run loop starts with a user message and ends with the assistant's final reply (an assistant
message without tool calls). A user message that arrives while a loop is still open joins it
(seed 002: the user may add messages mid-loop). Leading system/developer messages form the
preamble and belong to no loop; every later message belongs to exactly one loop, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from .messages import Message, message_text, tool_calls_of

PREAMBLE_ROLES = frozenset({"system", "developer"})


class LoopStatus(StrEnum):
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True)
class RunLoop:
    index: int
    start: int  # first message position
    end: int  # one past the last message position
    status: LoopStatus
    user_positions: tuple[int, ...]
    final_position: int | None
    tool_call_ids: tuple[str, ...]

    @property
    def positions(self) -> range:
        return range(self.start, self.end)


def is_final(msg: Message) -> bool:
    return msg.get("role") == "assistant" and not tool_calls_of(msg)


def preamble_end(messages: Sequence[Message]) -> int:
    i = 0
    while i < len(messages) and messages[i].get("role") in PREAMBLE_ROLES:
        i += 1
    return i


def segment(messages: list[Message]) -> list[RunLoop]:
    seg = Segmenter(preamble_end(messages))
    for m in messages[seg.start:]:
        seg.add(m)
    return seg.loops()


class Segmenter:
    """The run loops of a growing conversation, message by message: a loop closes once its
    last assistant message is a final reply with nothing after it, and a user message after a
    closed loop opens the next. ``copy`` and ``add`` let a conversation that grew by a few
    messages be segmented in the time of those few."""

    def __init__(self, start: int):
        self.start = start  # the first message after the preamble
        self.n = start
        self.closed: list[RunLoop] = []
        self.open: _OpenLoop | None = None
        self._boundary = True  # a user message now would open a new loop

    def add(self, msg: Message) -> None:
        """The message at position ``n``."""
        role = msg.get("role")
        if self.open is None or (role == "user" and self._boundary):
            if self.open is not None:
                self.closed.append(self.open.loop(self.n))
            self.open = _OpenLoop(len(self.closed), self.n)
            self._boundary = False
        self.open.add(self.n, msg)
        if role == "assistant":
            self._boundary = is_final(msg)
        elif role in ("tool", "function"):
            self._boundary = False  # a tool result means the agent is still working
        self.n += 1

    def loops(self) -> list[RunLoop]:
        return [*self.closed, self.open.loop(self.n)] if self.open is not None \
            else list(self.closed)

    def copy(self) -> Segmenter:
        out = Segmenter(self.start)
        out.n, out.closed, out._boundary = self.n, list(self.closed), self._boundary
        out.open = self.open.copy() if self.open is not None else None
        return out


class _OpenLoop:
    """The last loop as it grows: what its RunLoop needs, accumulated."""

    def __init__(self, index: int, start: int):
        self.index, self.start = index, start
        self.users: list[int] = []
        self.ids: list[str] = []
        self.last_assistant: int | None = None
        self.final = False  # the last assistant message is a final reply ...
        self.settled = False  # ... and no user message or tool result came after it

    def add(self, i: int, msg: Message) -> None:
        role = msg.get("role")
        if role == "user":
            self.users.append(i)
        if role == "assistant":
            calls = tool_calls_of(msg)
            self.ids.extend(c.get("id", "") for c in calls)
            self.last_assistant, self.final, self.settled = i, not calls, True
        elif role in ("user", "tool"):
            self.settled = False

    def loop(self, end: int) -> RunLoop:
        closed = self.final and self.settled
        return RunLoop(index=self.index, start=self.start, end=end,
                       status=LoopStatus.CLOSED if closed else LoopStatus.OPEN,
                       user_positions=tuple(self.users),
                       final_position=self.last_assistant if closed else None,
                       tool_call_ids=tuple(self.ids))

    def copy(self) -> _OpenLoop:
        out = _OpenLoop(self.index, self.start)
        out.users, out.ids = list(self.users), list(self.ids)
        out.last_assistant, out.final, out.settled = self.last_assistant, self.final, self.settled
        return out


LONG_WORD = 4  # a single word up to this many previews long is shown whole (a URL, a path)


def preview(msg: Message | None, chars: int = 120) -> str:
    """A message's text on one line, about ``chars`` long, cut between words and never inside
    one: an order number cut in two reads as another number. A first word longer than that
    is shown whole up to ``LONG_WORD`` times as long; beyond, it is no identifier, and cut."""
    if msg is None:
        return ""
    text = " ".join(message_text(msg).split())
    if len(text) <= chars:
        return text
    cut = text.rfind(" ", 0, chars)
    if cut > 0:
        return text[:cut] + " …"
    word = text.split(" ", 1)[0]
    if len(word) <= LONG_WORD * chars:
        return word + (" …" if len(word) < len(text) else "")
    return text[: chars - 1] + "…"
