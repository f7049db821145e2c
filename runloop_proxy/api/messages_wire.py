"""Anthropic's Messages API on the wire (pure): a window as an upstream body, an answer as a
Reply, the JSON answer without the proxy's calls, and errors in Anthropic's shape. The event
stream is ``messages_stream.py``'s."""

from __future__ import annotations

from typing import Any

from ..conversation.blocks import assistant, chat_to_tool, to_anthropic, to_messages
from ..conversation.messages import Message, message_hash
from ..errors import ContextLengthExceeded
from ..pipeline.tools import ProxyTools
from ..pipeline.wire import Decision, Native, Reply, Step, bad_reply
from ..savings import Placed
from ..window.builder import Note
from .breakpoints import marks, with_auto
from .messages_stream import MessagesObserver, MessagesRelay, error_type, usage_of

TOOL_KEYS = ("tools", "tool_choice")


class MessagesWire(Native):
    """The Messages API for one request (``auto_cache``: the tenant's
    ``cache_breakpoints = "auto"``)."""

    api = "messages"
    upstream_path = "/messages"

    def __init__(self, auto_cache: bool = False):
        self.auto_cache = auto_cache
        self.stable: int | None = None  # the last message of the window's stable prefix
        self.note: Note | None = None  # the marker's note, as the pieces it grew by
        # where the last body's own breakpoints went: what the headline prices
        self.placed: Placed | None = None

    def outgoing(self, body: dict[str, Any], messages: list[Message],
                 extra_tools: list[dict[str, Any]], note: Note | None = None
                 ) -> dict[str, Any]:
        turn_of: list[int] = []
        system, turns = to_anthropic(messages, body.get("messages"), turn_of)
        out = {**body, "messages": turns}
        if system is None:
            out.pop("system", None)
        else:
            out["system"] = system
        if extra_tools:
            out["tools"] = [*(body.get("tools") or []), *extra_tools]
        if not self.auto_cache:
            return out
        if self.stable is None:  # the first body: later rounds keep its stable prefix
            self.stable, self.note = last_rewritten(body, messages), note
        out, self.placed = auto_marked(out, turn_of, self.stable, self.note)
        return out

    def next_round(self, sent: dict[str, Any], messages: list[Message],
                   withdraw: frozenset[str]) -> dict[str, Any]:
        out = self.outgoing(sent, messages, [])
        if withdraw:
            kept = [t for t in sent.get("tools") or [] if t.get("name") not in withdraw]
            if kept:
                out["tools"] = kept
            else:
                for k in TOOL_KEYS:
                    out.pop(k, None)
            choice = out.get("tool_choice")
            if isinstance(choice, dict) and choice.get("name") in withdraw:
                out.pop("tool_choice")
        return out

    def tool_definitions(self, tools: ProxyTools) -> list[dict[str, Any]]:
        return [chat_to_tool(f) for f in tools.functions()]

    def parse(self, data: Any) -> Reply:
        problem = message_problem(data)
        if problem:
            raise bad_reply(f"a message: {problem}", data)
        return Reply(assistant(data["content"]), usage_of(data.get("usage")),
                     data.get("id") if isinstance(data.get("id"), str) else None)

    def client_json(self, data: dict[str, Any], decision: Decision,
                    usage: dict[str, Any], tools: ProxyTools) -> dict[str, Any]:
        mine = {c["id"] for c in decision.mine}
        data["content"] = [b for b in data["content"]
                           if not (b.get("type") == "tool_use" and b.get("id") in mine)]
        if decision.step is Step.WITHDRAWN:
            data["stop_reason"] = "end_turn"
        if usage:
            data["usage"] = {**(data.get("usage") or {}), **usage}
        return data

    def relay(self, request: dict[str, Any]) -> MessagesRelay:
        return MessagesRelay(str(request.get("model", "")))

    def observer(self, limit: int) -> MessagesObserver:
        return MessagesObserver(limit)


def auto_marked(out: dict[str, Any], turn_of: list[int], stable: int, note: Note | None
                ) -> tuple[dict[str, Any], Placed]:
    """``out`` (a window's body, ``turn_of`` its messages' turns: ``to_anthropic``) with
    the proxy's breakpoints: the marker's ``note`` in pieces, marks at its end, at the end
    of the turn of message ``stable`` (the last the window rewrote, -1: none) and at the
    end; and where they went in the window's messages (``Placed``; a turn merges messages
    of one role, so a mark at a turn's end follows its last message)."""
    at = None
    if note is not None and note[0] < len(turn_of):
        out["messages"], at = in_pieces(out["messages"], turn_of[note[0]], note[1])
    before = {m[:3] for m in marks(out)}
    body = with_auto(out, turn_of[stable] if stable >= 0 else None, at)
    last_of = {t: i for i, t in enumerate(turn_of)}
    after = set()
    for part, t, b, _ in marks(body):
        if part != 2 or (part, t, b) in before:
            continue  # the client's own, or the system prompt's (the head's)
        if at is not None and note is not None and (t, b) == at:
            after.add(note[0] + 1)
        elif t in last_of:
            after.add(last_of[t] + 1)
    return body, Placed(note if at is not None else None, tuple(sorted(after)))


def in_pieces(turns: list[dict[str, Any]], t: int, pieces: tuple[str, ...]
              ) -> tuple[list[dict[str, Any]], tuple[int, int] | None]:
    """``turns`` with the marker's note in turn ``t`` as a text block per piece it grew by,
    and where its last block is (turn, block): a breakpoint there is a prefix the next
    omission repeats — the same blocks, one more appended — where one text block would
    differ. Unchanged (None) when the turn does not hold the note's text as one block."""
    text = "\n".join(pieces)
    content = turns[t].get("content")
    blocks = [{"type": "text", "text": p} for p in pieces]
    if content == text:
        at, content = 0, blocks
    elif isinstance(content, list):
        at = next((i for i, b in enumerate(content) if isinstance(b, dict)
                   and b.get("type") == "text" and b.get("text") == text
                   and "cache_control" not in b), -1)
        if at < 0:
            return turns, None
        content = [*content[:at], *blocks, *content[at + 1:]]
    else:
        return turns, None
    out = list(turns)
    out[t] = {**turns[t], "content": content}
    return out, (t, at + len(blocks) - 1)


def last_rewritten(body: dict[str, Any], messages: list[Message]) -> int:
    """The position of the last message of the window the request does not carry as it is
    (a cut result, a reduced loop, the marker), -1 when there is none: everything up to it
    keeps its form until the next compaction event."""
    sent = {message_hash(m) for m in to_messages(body.get("messages"), body.get("system"))}
    return next((i for i in range(len(messages) - 1, -1, -1)
                 if message_hash(messages[i]) not in sent), -1)


def message_problem(data: Any) -> str | None:
    """Why ``data`` is not a message this proxy can read, or None."""
    if not isinstance(data, dict):
        return "not a JSON object"
    content = data.get("content")
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        return "no content blocks"
    for block in content:
        if block.get("type") == "tool_use" and not (
                isinstance(block.get("id"), str) and isinstance(block.get("name"), str)):
            return "a tool_use block is malformed"
    return None


def error_shape(status: int, body: dict[str, Any], exc: Exception | None) -> dict[str, Any]:
    """An error the proxy answers, in Anthropic's shape (from its OpenAI-shaped body). A
    request that cannot fit says so in Anthropic's words, which clients act on (Claude Code
    compacts its conversation on "prompt is too long")."""
    err: dict[str, Any] = body["error"] if isinstance(body.get("error"), dict) else {}
    message = str(err.get("message", "error"))
    if isinstance(exc, ContextLengthExceeded) and exc.needed is not None:
        message = f"prompt is too long: {exc.needed} tokens > {exc.allowed} maximum. " \
            f"{exc.message}"  # Anthropic's words, not OpenAI's too
    return {"type": "error", "error": {"type": error_type(status), "message": message}}
