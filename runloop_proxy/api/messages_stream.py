"""A Messages event stream rewritten for the client (pure): the proxy's ``tool_use`` blocks and
every event of theirs dropped, block indexes renumbered across the proxy's rounds, one
``message_start`` and one ``message_stop`` for the whole answer, the last ``message_delta``
carrying every round's usage summed. A block is judged by its name once the name is known (a
``tool_use`` block names its tool when it starts; one that does not is held until it stops),
and its events are held until then."""

from __future__ import annotations

from typing import Any

import orjson

from ..conversation.blocks import assistant
from ..conversation.messages import Message
from ..errors import Unavailable, UpstreamBadReply, UpstreamError
from ..pipeline.sse import SSEEvent, encode_event
from ..pipeline.tools import ProxyTools
from ..pipeline.wire import Decision, Ending, Reply, Step, bad_reply, typed_event

Block = dict[str, Any]
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               402: "billing_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               502: "api_error", 503: "overloaded_error", 504: "timeout_error",
               529: "overloaded_error"}
STATUSES = {"api_error": 500, **{kind: status for status, kind in ERROR_TYPES.items()
                                 if kind != "api_error"}}
BLOCK_EVENTS = ("content_block_start", "content_block_delta", "content_block_stop")


def usage_of(usage: Any) -> dict[str, Any] | None:
    return usage if isinstance(usage, dict) else None


def error_type(status: int) -> str:
    """Anthropic's error type for a status: its documented one, else the client's error for
    a 4xx (a header block too large, a request too slow to arrive) and the API's for a 5xx."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_event(status: int, message: str) -> bytes:
    return emit({"type": "error", "error": {"type": error_type(status), "message": message}})


def emit(data: dict[str, Any]) -> bytes:
    return encode_event(orjson.dumps(data), str(data["type"]))


def decode(event: SSEEvent) -> dict[str, Any] | None:
    """An upstream event as data; an ``error`` event raises (with the upstream's status for
    its type: ``overloaded_error`` stays a 529)."""
    data = typed_event(event, "a Messages event")
    if data is None:
        return None
    kind = data["type"]
    if kind == "error":
        err: dict[str, Any] = data["error"] if isinstance(data.get("error"), dict) else {}
        raise UpstreamError("", quoted=str(err.get("message", "the upstream's stream failed")),
                            status=STATUSES.get(str(err.get("type")), 502))
    problem = _problem(data)
    if problem:
        raise bad_reply(f"a Messages event: {problem}", data)
    return data


def _problem(data: dict[str, Any]) -> str | None:
    kind = data["type"]
    if kind == "message_start" and not isinstance(data.get("message"), dict):
        return "message_start without a message"
    if kind in BLOCK_EVENTS:
        at = data.get("index")
        if not isinstance(at, int) or isinstance(at, bool):
            return "a block event without an integer index"
        if kind == "content_block_start" and not isinstance(data.get("content_block"), dict):
            return "content_block_start without a block"
        if kind == "content_block_delta" and not isinstance(data.get("delta"), dict):
            return "content_block_delta without a delta"
    if kind == "message_delta" and not isinstance(data.get("delta", {}), dict):
        return "message_delta's delta is not an object"
    return None


class Assembled:
    """One upstream answer built from its events: the message, its blocks, its usage."""

    def __init__(self) -> None:
        self.message: dict[str, Any] | None = None
        self.blocks: dict[int, Block] = {}
        self.json: dict[int, list[str]] = {}
        # a block's text and thinking as their deltas came, joined once (``_settle``): a
        # string grown by each delta copied the block so far each time (40,000 deltas: 7 s)
        self.parts: dict[tuple[int, str], list[str]] = {}
        self.cited: set[int] = set()  # blocks whose citations list is this answer's own
        self.usage: dict[str, Any] = {}
        self.delta: dict[str, Any] = {}
        self.stopped = False

    def add(self, data: dict[str, Any]) -> None:
        kind = data["type"]
        if kind == "message_start":
            self.message = data["message"]
            self.usage = dict(usage_of(self.message.get("usage")) or {})
        elif kind == "content_block_start":
            at = data["index"]
            if at in self.blocks:  # an index started again: its old deltas stay its old block's
                self._settle(at)
            self.blocks[at] = dict(data["content_block"])
        elif kind == "content_block_delta":
            self._delta(data["index"], data["delta"])
        elif kind == "content_block_stop":
            self._stop(data["index"])
        elif kind == "message_delta":
            self.delta.update(data.get("delta") or {})
            self.usage.update(usage_of(data.get("usage")) or {})
        elif kind == "message_stop":
            self.stopped = True

    def _delta(self, at: int, delta: dict[str, Any]) -> None:
        block = self.blocks.setdefault(at, {"type": "text", "text": ""})
        kind = delta.get("type")
        if kind == "text_delta":
            self.parts.setdefault((at, "text"), []).append(str(delta.get("text", "")))
        elif kind == "input_json_delta":
            self.json.setdefault(at, []).append(str(delta.get("partial_json", "")))
        elif kind == "thinking_delta":
            self.parts.setdefault((at, "thinking"), []).append(str(delta.get("thinking", "")))
        elif kind == "signature_delta":
            block["signature"] = delta.get("signature", "")
        elif kind == "citations_delta":
            if at not in self.cited:
                block["citations"] = list(block.get("citations") or [])
                self.cited.add(at)
            block["citations"].append(delta.get("citation"))

    def _settle(self, at: int) -> None:
        """The block's text and thinking, with the deltas so far joined in: once, when the
        content is asked for (joined at every stop, an upstream repeating delta and stop on
        one block re-copied all its text each time: quadratic)."""
        for field in ("text", "thinking"):
            parts = self.parts.pop((at, field), None)
            if parts:
                block = self.blocks[at]
                block[field] = str(block.get(field, "")) + "".join(parts)

    def _stop(self, at: int) -> None:
        parts = self.json.pop(at, None)
        if parts is not None and at in self.blocks and "".join(parts).strip():
            try:
                self.blocks[at]["input"] = orjson.loads("".join(parts))
            except orjson.JSONDecodeError as exc:
                raise UpstreamBadReply("the upstream streamed a tool input that is not "
                                       "JSON") from exc

    def content(self) -> list[Block]:
        for at in {at for at, _ in self.parts}:
            self._settle(at)
        return [self.blocks[i] for i in sorted(self.blocks)]

    def reply(self) -> Reply:
        msg = self.message or {}
        rid = msg.get("id")
        return Reply(assistant(self.content()), self.usage or None,
                     rid if isinstance(rid, str) else None)


class MessagesObserver(Ending):
    """Reads a stream relayed unchanged, to record its answer (at most ``limit`` bytes):
    whole at its ``message_stop``, never after an ``error`` event (``overloaded_error``
    mid-stream) or an event it could not read."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.size = 0
        self.acc = Assembled()

    def feed(self, event: SSEEvent) -> None:
        self.size += len(event.data)
        if self.size > self.limit:
            # no longer kept, but its end still told (by the event's name: it is not read)
            if event.event == "message_stop":
                self.ended = True
            elif event.event == "error":
                self.failed(UpstreamError("", quoted="the upstream's stream failed"))
            return
        try:
            data = decode(event)
            if data is not None:
                self.acc.add(data)
        except UpstreamError as exc:
            self.failed(exc)
            return
        self.ended = self.acc.stopped

    def reply(self) -> Reply | None:
        if not self.whole or self.size > self.limit or self.acc.message is None:
            return None
        return self.acc.reply()


class OneMessage:
    """What the client gets of a streamed answer across the proxy's tool rounds, whatever the
    upstream's rounds were: one message, its blocks numbered across rounds, one end with the
    usage of every round (a round's class feeds it: MessagesRound, the bridge's)."""

    def __init__(self, model: str):
        self.model = model
        self.message_id: str | None = None
        self.rounds = 0
        self.next_index = 0
        self.shown_blocks: list[Block] = []
        self.delta: dict[str, Any] = {"stop_reason": "end_turn", "stop_sequence": None}

    @property
    def answer_id(self) -> str | None:
        return self.message_id

    def shown(self, message: Message) -> Message:
        """The answer as the client saw it: the blocks it was shown, in every round."""
        return assistant(self.shown_blocks) if self.shown_blocks else message

    def end(self, usage: dict[str, Any]) -> list[bytes]:
        return [emit({"type": "message_delta", "delta": self.delta,
                      "usage": usage or {"output_tokens": 0}}),
                emit({"type": "message_stop"})]

    def error(self, exc: Exception) -> bytes:
        if isinstance(exc, (UpstreamError, Unavailable)):  # (a share refused mid-stream)
            return error_event(exc.status, str(exc))
        return error_event(500, "internal error in runloop-proxy")


class MessagesRelay(OneMessage):
    """A streamed message across the proxy's tool rounds, as one message for the client."""

    def round(self, tools: ProxyTools) -> MessagesRound:
        return MessagesRound(self, tools)


class MessagesRound:
    """One upstream stream: the client's blocks pass (renumbered), the proxy's calls and their
    events are dropped, the end is held until the round's fate is known."""

    def __init__(self, relay: MessagesRelay, tools: ProxyTools):
        self.relay = relay
        self.tools = tools
        self.first = relay.rounds == 0
        relay.rounds += 1
        self.acc = Assembled()
        self.index: dict[int, int | None] = {}  # upstream index -> the client's (None: ours)
        self.held: dict[int, list[dict[str, Any]]] = {}  # undecided blocks: their events

    @property
    def complete(self) -> bool:
        return self.acc.stopped

    def feed(self, event: SSEEvent) -> list[bytes]:
        data = decode(event)
        if data is None:
            return []
        self.acc.add(data)
        kind = data["type"]
        if kind == "message_start":
            if not self.first:
                return []  # later rounds are the same message for the client
            self.relay.message_id = self.relay.message_id or data["message"].get("id")
            return [emit(data)]
        if kind in ("message_delta", "message_stop"):
            return []  # the relay ends the message, with every round's usage
        if kind not in BLOCK_EVENTS:
            return [emit(data)]  # ping, and what the proxy does not know: as they came
        at = data["index"]
        if at in self.index:
            return self._send(at, data)
        self.held.setdefault(at, []).append(data)
        block = self.acc.blocks.get(at, {})
        if kind == "content_block_stop" or block.get("type") != "tool_use" \
                or block.get("name"):
            self._decide(at)
            return self._release(at)
        return []

    def _decide(self, at: int) -> None:
        block = self.acc.blocks.get(at, {})
        if block.get("type") == "tool_use" and block.get("name") in self.tools.names:
            self.index[at] = None
        else:
            self.index[at] = self.relay.next_index
            self.relay.next_index += 1

    def _release(self, at: int) -> list[bytes]:
        return [out for data in self.held.pop(at, []) for out in self._send(at, data)]

    def _send(self, at: int, data: dict[str, Any]) -> list[bytes]:
        client = self.index[at]
        if client is None:
            return []  # the proxy's call: the client never sees it
        return [emit({**data, "index": client})]

    def reply(self) -> Reply:
        for at in sorted(self.held):  # blocks the stream never decided (it stopped short)
            self._decide(at)
        shown = sorted((c, at) for at, c in self.index.items() if c is not None)
        self.acc.content()  # every block's text whole
        self.relay.shown_blocks += [self.acc.blocks[at] for _, at in shown
                                    if at in self.acc.blocks]
        return self.acc.reply()

    def close(self, decision: Decision) -> list[bytes]:
        delta = {"stop_reason": None, "stop_sequence": None, **self.acc.delta}
        if decision.step is Step.WITHDRAWN:
            delta["stop_reason"] = "end_turn"
        self.relay.delta = delta
        return [out for at in sorted(self.held) for out in self._release(at)]
