"""What the request path needs from an API's wire format, and the one place that decides, per
upstream reply, which tool calls are the proxy's and which the client's.

An adapter (``api/chat.py``, ``api/responses.py``) turns its requests into the conversation
model (chat-shaped messages) and implements ``Wire``: how a window becomes an upstream body, how
an upstream answer becomes a ``Reply``, and how an answer — JSON or a stream of events — is shown
to the client without the proxy's own calls. The tool rounds (toolloop.py) are written once
against this protocol.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import orjson

from ..conversation.messages import Message, ToolCall
from ..errors import UpstreamBadReply, UpstreamError
from ..window.builder import Note
from .sse import SSEEvent
from .tools import ProxyTools


@dataclass(frozen=True)
class Reply:
    """An upstream answer in the conversation model: the assistant message with every call the
    model made (the proxy's included) and the usage the upstream reported."""

    message: Message
    usage: dict[str, Any] | None = None
    id: str | None = None  # the upstream's id of the answer (a Responses response id)

    @property
    def calls(self) -> list[ToolCall]:
        return list(self.message.get("tool_calls") or [])


class Step(StrEnum):
    FINAL = "final"  # no call of the proxy's: the answer goes to the client as it is
    ANSWER = "answer"  # only the proxy's calls: answer them and ask the upstream again
    MIXED = "mixed"  # both: the client gets its calls, the proxy keeps its part to splice back
    WITHDRAWN = "withdrawn"  # the proxy's calls past max_tool_rounds: dropped, the turn ends


@dataclass(frozen=True)
class Decision:
    step: Step
    mine: tuple[ToolCall, ...]
    theirs: tuple[ToolCall, ...]


def decide(calls: Iterable[ToolCall], tools: ProxyTools, rounds: int, max_rounds: int
           ) -> Decision:
    """What to do with an upstream reply's calls, for JSON and streams alike."""
    mine = tuple(c for c in calls if tools.owns(c))
    theirs = tuple(c for c in calls if not tools.owns(c))
    if not mine:
        step = Step.FINAL
    elif theirs:
        step = Step.MIXED
    elif rounds >= max_rounds:
        step = Step.WITHDRAWN
    else:
        step = Step.ANSWER
    return Decision(step, mine, theirs)


def client_message(reply: Reply, decision: Decision) -> Message:
    """The assistant message as the client sees it (and as its next request echoes it)."""
    if decision.step in (Step.FINAL, Step.ANSWER):
        return reply.message
    out: dict[str, Any] = {k: v for k, v in reply.message.items() if k != "tool_calls"}
    if decision.theirs:
        out["tool_calls"] = list(decision.theirs)
    return out  # type: ignore[return-value]


class StreamRound(Protocol):
    """One upstream stream, rewritten for the client event by event."""

    def feed(self, event: SSEEvent) -> list[bytes]:
        """What to send to the client for this upstream event (the proxy's calls dropped)."""

    @property
    def complete(self) -> bool:
        """Whether the upstream finished its answer (a stream that just stops did not)."""

    def reply(self) -> Reply:
        """The round's answer, assembled from its events."""

    def close(self, decision: Decision) -> list[bytes]:
        """The events that end the round for the client (held back until ``decision``)."""


class StreamRelay(Protocol):
    """A whole streamed answer across the proxy's tool rounds: one id, one numbering of the
    client's calls and items, usage summed."""

    def round(self, tools: ProxyTools) -> StreamRound: ...

    def shown(self, message: Message) -> Message:
        """The answer as the client saw it across every round (what it will echo back)."""

    @property
    def answer_id(self) -> str | None:
        """The id the client got for the whole answer."""

    def end(self, usage: dict[str, Any]) -> list[bytes]:
        """The events after the last round (the summed usage, the terminator)."""

    def error(self, exc: Exception) -> bytes:
        """An error event, the way this API's streams report one."""


class StreamObserver(Protocol):
    """Reads a stream relayed unchanged, to record its answer. Its answer is recorded only
    when the stream is ``whole``: the upstream's own end marker arrived ([DONE],
    ``message_stop``, ``response.completed``) and nothing before it failed (an error event,
    an event it could not read)."""

    ended: bool  # the upstream's own end marker arrived
    failure: UpstreamError | None  # an error event, or an event that is no event of the API

    def feed(self, event: SSEEvent) -> None: ...

    def reply(self) -> Reply | None: ...


class Ending:
    """How a stream relayed unchanged ended, for its observer: its end marker, its first
    failure (an error event the client was relayed as it came, or an event the observer
    could not read)."""

    def __init__(self) -> None:
        self.ended = False
        self.failure: UpstreamError | None = None

    def failed(self, exc: UpstreamError) -> None:
        if self.failure is None:
            self.failure = exc

    @property
    def whole(self) -> bool:
        return self.ended and self.failure is None


class Wire(Protocol):
    api: str  # "chat" | "responses" | "messages": a metric label
    upstream_path: str
    translates: bool  # the upstream speaks another API: no answer is relayed as it came

    def upstream_error(self, status: int, raw: bytes) -> tuple[int, bytes]:
        """An upstream's error answer (status, body) as this API's client gets it."""

    def outgoing(self, body: dict[str, Any], messages: list[Message],
                 extra_tools: list[dict[str, Any]], note: Note | None = None
                 ) -> dict[str, Any]:
        """The upstream body for this window (``extra_tools``: the proxy's, when offered;
        ``note``: the marker's note as the pieces it grew by, for an API that can keep them
        apart)."""

    def next_round(self, sent: dict[str, Any], messages: list[Message],
                   withdraw: frozenset[str]) -> dict[str, Any]:
        """The body of the next tool round (the tools named in ``withdraw`` taken out)."""

    def tool_definitions(self, tools: ProxyTools) -> list[dict[str, Any]]:
        """The proxy's tools in this API's form."""

    def parse(self, data: Any) -> Reply:
        """A JSON answer as a Reply; UpstreamBadReply when it is not one."""

    def client_json(self, data: dict[str, Any], decision: Decision,
                    usage: dict[str, Any], tools: ProxyTools) -> dict[str, Any]:
        """The JSON answer the client gets: the proxy's calls removed, usage of every round,
        nothing of ``tools`` (the proxy's) in what it echoes of the request."""

    def relay(self, request: dict[str, Any]) -> StreamRelay: ...

    def observer(self, limit: int) -> StreamObserver:
        """A reader of a stream relayed unchanged, keeping at most ``limit`` bytes of it."""


class Native:
    """A wire whose upstream speaks the client's own API: answers and errors may pass as they
    came."""

    translates = False

    def upstream_error(self, status: int, raw: bytes) -> tuple[int, bytes]:
        return status, raw


def add_usage(total: dict[str, Any], usage: dict[str, Any] | None) -> None:
    """Sum ``usage`` into ``total``, nested *_details included."""
    if not usage:
        return
    for k, v in usage.items():
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            total[k] = total.get(k, 0) + v
        elif isinstance(v, dict):
            add_usage(total.setdefault(k, {}), v)


def bad_reply(what: str, data: Any) -> UpstreamBadReply:
    shown = repr(data)
    return UpstreamBadReply(f"the upstream's answer is not {what}",
                            quoted=f" ({shown[:120]}{'…' if len(shown) > 120 else ''})")


def event_json(event: SSEEvent) -> Any:
    """An upstream event's JSON payload; None for the end marker or an event without data.
    Data that is not JSON is the upstream's fault."""
    if event.is_done or not event.data:
        return None
    try:
        return orjson.loads(event.data)
    except orjson.JSONDecodeError as exc:
        raise UpstreamBadReply("the upstream streamed an event that is not JSON") from exc


def typed_event(event: SSEEvent, what: str) -> dict[str, Any] | None:
    """An upstream event of an API whose events name their type (Responses, Messages): an
    object whose ``type`` is its own or else the event's name."""
    data = event_json(event)
    if data is None:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("type", event.event), str):
        raise bad_reply(what, data)
    data["type"] = data.get("type") or event.event
    return data
