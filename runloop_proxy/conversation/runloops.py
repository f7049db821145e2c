"""Segmentation of a conversation into run loops (pure).

A run loop starts with a user message and ends with the assistant's final reply (an assistant
message without tool calls). A user message that arrives while a loop is still open joins it
(seed 002: the user may add messages mid-loop). Leading system/developer messages form the
preamble and belong to no loop; every later message belongs to exactly one loop, in order.
"""

from __future__ import annotations

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


def preamble_end(messages: list[Message]) -> int:
    i = 0
    while i < len(messages) and messages[i].get("role") in PREAMBLE_ROLES:
        i += 1
    return i


def segment(messages: list[Message]) -> list[RunLoop]:
    start = preamble_end(messages)
    bounds: list[int] = []
    closed = True
    for i in range(start, len(messages)):
        msg = messages[i]
        if msg.get("role") == "user" and closed:
            bounds.append(i)
            closed = False
        elif not bounds:
            bounds.append(i)  # a conversation that does not begin with a user message
            closed = False
        if msg.get("role") == "assistant":
            closed = is_final(msg)
        elif msg.get("role") in ("tool", "function"):
            closed = False  # a tool result means the agent is still working
    loops = []
    for k, b in enumerate(bounds):
        e = bounds[k + 1] if k + 1 < len(bounds) else len(messages)
        loops.append(_loop(messages, k, b, e))
    return loops


def _loop(messages: list[Message], index: int, start: int, end: int) -> RunLoop:
    users = tuple(i for i in range(start, end) if messages[i].get("role") == "user")
    ids: list[str] = []
    for i in range(start, end):
        if messages[i].get("role") == "assistant":
            ids.extend(c.get("id", "") for c in tool_calls_of(messages[i]))
    last_assistant = next((i for i in range(end - 1, start - 1, -1)
                           if messages[i].get("role") == "assistant"), None)
    closed = last_assistant is not None and is_final(messages[last_assistant]) \
        and all(messages[i].get("role") not in ("user", "tool")
                for i in range(last_assistant + 1, end))
    return RunLoop(index=index, start=start, end=end,
                   status=LoopStatus.CLOSED if closed else LoopStatus.OPEN,
                   user_positions=users, final_position=last_assistant if closed else None,
                   tool_call_ids=tuple(ids))


def preview(msg: Message | None, chars: int = 120) -> str:
    if msg is None:
        return ""
    text = " ".join(message_text(msg).split())
    return text if len(text) <= chars else text[: chars - 1] + "…"
