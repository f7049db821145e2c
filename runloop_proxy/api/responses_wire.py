"""The Responses API on the wire (pure): a window as an upstream body, an answer as a Reply,
and a streamed answer rewritten for the client — the proxy's function calls and every event of
theirs dropped, output indexes and sequence numbers renumbered across the proxy's rounds, one
``response.created`` and one ``response.completed`` (every round's usage summed, every item
the client saw) for the whole answer. A response echoes the request it answers (its tools
among the rest): every response object the client is shown, JSON or in an event, echoes the
client's tools, never the proxy's (``shown_response``)."""

from __future__ import annotations

import heapq
from typing import Any

import orjson

from ..conversation.items import to_items, to_messages, tool_name
from ..conversation.messages import Message
from ..errors import Unavailable, UpstreamError
from ..pipeline.sse import SSEEvent, encode_event
from ..pipeline.tools import ProxyTools
from ..pipeline.wire import Decision, Ending, Native, Reply, bad_reply, typed_event
from ..window.builder import Note

TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")
ENDS = ("response.completed", "response.incomplete")


class ResponsesWire(Native):
    api = "responses"
    upstream_path = "/responses"

    def outgoing(self, body: dict[str, Any], messages: list[Message],
                 extra_tools: list[dict[str, Any]], note: Note | None = None
                 ) -> dict[str, Any]:
        instructions, items = to_items(messages)
        out = {**body, "input": items}
        if instructions is not None:
            out["instructions"] = instructions
        if extra_tools:
            out["tools"] = [*(body.get("tools") or []), *extra_tools]
        return out

    def next_round(self, sent: dict[str, Any], messages: list[Message],
                   withdraw: frozenset[str]) -> dict[str, Any]:
        out = self.outgoing(sent, messages, [])
        if withdraw:
            kept = [t for t in sent.get("tools") or [] if tool_name(t) not in withdraw]
            if kept:
                out["tools"] = kept
            else:
                for k in TOOL_KEYS:
                    out.pop(k, None)
        return out

    def tool_definitions(self, tools: ProxyTools) -> list[dict[str, Any]]:
        # not strict: strict mode asks for closed schemas and every property required
        return [{"type": "function", **f, "strict": False} for f in tools.functions()]

    def parse(self, data: Any) -> Reply:
        problem = response_problem(data)
        if problem:
            raise bad_reply(f"a response: {problem}", data)
        return reply_of(data)

    def client_json(self, data: dict[str, Any], decision: Decision,
                    usage: dict[str, Any], tools: ProxyTools) -> dict[str, Any]:
        mine = {c["id"] for c in decision.mine}
        data["output"] = [i for i in data["output"] if not _is_call_in(i, mine)]
        if usage:
            data["usage"] = usage
        shown_response(data, tools)
        return data

    def relay(self, request: dict[str, Any]) -> ResponsesRelay:
        return ResponsesRelay()

    def observer(self, limit: int) -> ResponsesObserver:
        return ResponsesObserver(limit)


def response_problem(data: Any) -> str | None:
    """Why ``data`` is not a response with an output this proxy can read, or None."""
    if not isinstance(data, dict):
        return "not a JSON object"
    output = data.get("output")
    if not isinstance(output, list) or not all(isinstance(i, dict) for i in output):
        return "no output items"
    for item in output:
        if item.get("type") == "function_call" and not (
                isinstance(item.get("name"), str) and isinstance(item.get("call_id"), str)
                and isinstance(item.get("arguments", ""), str)):
            return "a function call is malformed"
    return None


def shown_response(response: Any, tools: ProxyTools) -> None:
    """A response object made what the client is shown: its echo of the request's tools
    without the proxy's (they went upstream with the request; the client never sent them)."""
    echoed = response.get("tools") if isinstance(response, dict) else None
    if isinstance(echoed, list):
        response["tools"] = [t for t in echoed if tool_name(t) not in tools.names]


def reply_of(response: dict[str, Any]) -> Reply:
    """A response's output as one assistant message, and its usage."""
    output = response.get("output") or []
    messages = to_messages(output)
    message = messages[0] if len(messages) == 1 and messages[0].get("role") == "assistant" \
        else {"role": "assistant", "content": None, "items": output}
    usage = response.get("usage")
    rid = response.get("id")
    return Reply(message, usage if isinstance(usage, dict) else None,
                 rid if isinstance(rid, str) else None)


def _order(at: Any) -> tuple[bool, str]:
    """Where a held item's index sorts: integers first, by value."""
    return not isinstance(at, int), str(at).zfill(12)


def _is_call_in(item: dict[str, Any], ids: set[str]) -> bool:
    return item.get("type") == "function_call" and item.get("call_id") in ids


def _decode(event: SSEEvent) -> dict[str, Any] | None:
    data = typed_event(event, "a Responses event")
    if data is not None and data["type"] in ("error", "response.failed"):
        err = data.get("error") or (data.get("response") or {}).get("error") or data
        raise UpstreamError("", quoted=str(err.get("message", "the upstream's response failed"))
                            if isinstance(err, dict) else str(err))
    return data


class ResponsesObserver(Ending):
    """Reads a stream relayed unchanged, to record its answer (at most ``limit`` bytes):
    whole at its ``response.completed`` (or ``response.incomplete``: the upstream ended it),
    never after an ``error`` or ``response.failed`` event or an event it could not read."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.size = 0
        self.response: dict[str, Any] | None = None

    def feed(self, event: SSEEvent) -> None:
        self.size += len(event.data)
        if self.size > self.limit:
            # no longer kept, but its end still told (by the event's name: it is not read)
            if event.event in ENDS:
                self.ended = True
            elif event.event in ("error", "response.failed"):
                self.failed(UpstreamError("", quoted="the upstream's response failed"))
            return
        try:
            data = _decode(event)
        except UpstreamError as exc:
            self.failed(exc)
            return
        if data is not None and data["type"] in ENDS:
            self.ended = True
            if isinstance(data.get("response"), dict):
                self.response = data["response"]

    def reply(self) -> Reply | None:
        if not self.whole or self.size > self.limit or self.response is None \
                or response_problem(self.response):
            return None
        return reply_of(self.response)


class ResponsesRelay:
    """A streamed response across the proxy's tool rounds, as one response for the client."""

    def __init__(self) -> None:
        self.response_id: str | None = None
        self.rounds = 0
        self.seq = 0
        self.next_index = 0
        self.items_shown: dict[int, dict[str, Any]] = {}  # client output_index -> its item
        self.last: dict[str, Any] = {}  # the last round's response, closing the client's

    def round(self, tools: ProxyTools) -> ResponsesRound:
        return ResponsesRound(self, tools)

    @property
    def answer_id(self) -> str | None:
        return self.response_id

    @property
    def shown_items(self) -> list[dict[str, Any]]:
        """Every item the client was shown, in the order of its output indexes."""
        return [self.items_shown[k] for k in sorted(self.items_shown)]

    def emit(self, data: dict[str, Any]) -> bytes:
        data["sequence_number"] = self.seq
        self.seq += 1
        return encode_event(orjson.dumps(data), data["type"])

    def shown(self, message: Message) -> Message:
        """The answer as the client saw it: every item it was shown, in every round."""
        messages = to_messages(self.shown_items)
        return messages[0] if len(messages) == 1 else message

    def end(self, usage: dict[str, Any]) -> list[bytes]:
        response = {**self.last, "id": self.response_id or self.last.get("id"),
                    "output": self.shown_items}
        if usage:
            response["usage"] = usage
        kind = "response.incomplete" if response.get("status") == "incomplete" \
            else "response.completed"
        return [self.emit({"type": kind, "response": response})]

    def error(self, exc: Exception) -> bytes:
        err = exc.body()["error"] if isinstance(exc, (UpstreamError, Unavailable)) else {
            "message": "internal error in runloop-proxy", "type": "server_error",
            "code": "internal_error"}
        return self.emit({"type": "error", "code": err.get("code"), "message": err["message"],
                          "param": None})


class ResponsesRound:
    """One upstream stream: the client's items pass (renumbered), the proxy's calls and
    everything about them are dropped, the end is held until the round's fate is known. An
    item is judged by its name once the name is known — at ``output_item.added``, or for a
    call added without one (or an item whose events come before it is added) at its
    ``output_item.done`` or the response's end — and its events are held until then. Items
    are released in the upstream's order (an item waits for those before it to be judged),
    so the client numbers them as the upstream did, whatever the interleaving of their
    events."""

    def __init__(self, relay: ResponsesRelay, tools: ProxyTools):
        self.relay = relay
        self.tools = tools
        self.first = relay.rounds == 0
        relay.rounds += 1
        self.index: dict[Any, int | None] = {}  # released: upstream output_index -> client's
        self.mine: dict[Any, bool] = {}  # judged, not yet released: the proxy's call?
        self.held: dict[Any, list[dict[str, Any]]] = {}  # not yet released: its events
        self.next_at = 0  # the upstream index released next
        self.response: dict[str, Any] | None = None

    @property
    def complete(self) -> bool:
        return self.response is not None

    def feed(self, event: SSEEvent) -> list[bytes]:
        data = _decode(event)
        if data is None:
            return []
        kind, relay = data["type"], self.relay
        if kind in ("response.created", "response.in_progress", "response.queued"):
            if not self.first:
                return []  # later rounds are the same response for the client
            relay.response_id = relay.response_id or (data.get("response") or {}).get("id")
            shown_response(data.get("response"), self.tools)
            return [relay.emit(data)]
        if kind in ENDS:
            if not isinstance(data.get("response"), dict) or response_problem(data["response"]):
                raise bad_reply("a completed response", data)
            self.response = data["response"]
            relay.last = {k: v for k, v in self.response.items() if k != "output"}
            shown_response(relay.last, self.tools)
            output = self.response.get("output") or []
            for at in self.held:
                if at not in self.mine:
                    self._judge(at, output[at] if isinstance(at, int) and 0 <= at < len(output)
                                else {})
            return self._release(end=True)
        if "output_index" not in data:
            return [relay.emit(data)]
        at = data["output_index"]
        if not isinstance(at, (int, str)) or isinstance(at, bool):
            raise bad_reply("an event's output_index", data)
        if at in self.index:
            return self._send(at, data)
        self.held.setdefault(at, []).append(data)
        item = data.get("item") if isinstance(data.get("item"), dict) else None
        if at not in self.mine and item is not None and (
                kind == "response.output_item.done" or item.get("type") != "function_call"
                or item.get("name")):
            self._judge(at, item)
        return self._release()

    def _judge(self, at: Any, item: dict[str, Any]) -> None:
        """Whose item ``at`` is, now that its name is known."""
        self.mine[at] = item.get("type") == "function_call" and \
            item.get("name") in self.tools.names

    def _release(self, end: bool = False) -> list[bytes]:
        """The held events of the judged items whose turn it is (at the end, all of them, in
        order: the first one next, else the lowest index held — one sort, not a search per
        item, which made an upstream's skipped indexes quadratic): each client's item
        numbered in the upstream's order."""
        out: list[bytes] = []
        lowest = [(_order(a), a) for a in self.mine] if end else []
        heapq.heapify(lowest)
        while self.next_at in self.mine or (end and self.mine):
            if self.next_at in self.mine:
                at = self.next_at
            else:
                while lowest[0][1] not in self.mine:  # released since: its turn came first
                    heapq.heappop(lowest)
                at = heapq.heappop(lowest)[1]
            if self.mine.pop(at):
                self.index[at] = None
            else:
                self.index[at] = self.relay.next_index
                self.relay.next_index += 1
            if isinstance(at, int):
                self.next_at = at + 1
            out += [b for data in self.held.pop(at, []) for b in self._send(at, data)]
        return out

    def _send(self, at: Any, data: dict[str, Any]) -> list[bytes]:
        client = self.index[at]
        if client is None:
            return []  # the proxy's call: the client never sees it
        data["output_index"] = client
        if data["type"] == "response.output_item.done" and isinstance(data.get("item"), dict):
            self.relay.items_shown[client] = data["item"]
        return [self.relay.emit(data)]

    def reply(self) -> Reply:
        assert self.response is not None
        return reply_of(self.response)

    def close(self, decision: Decision) -> list[bytes]:
        return []  # the client's response.completed comes with the summed usage (end)
