"""The Responses API over a WebSocket, on the wire (pure): a client's event read into the HTTP
request it amounts to, what a connection keeps of its responses, and the server's events.

A socket client (Codex, the openai SDK's ``responses.connect()``) sends ``response.create``
events: a ``POST /v1/responses`` body less ``stream`` (a socket always streams), in an
envelope — ``type``, ``generate`` (false: a warmup, no output, whose id can be chained on),
``stream_id`` (a lane: its events echo it). It goes on from a response by sending
``previous_response_id`` and only the new items: the server keeps, per connection, what the
response answered and what it said. Here that is the connection's ``Chains``: a response this
connection was shown is expanded into the whole conversation (its input, its output as the
client saw it, the new items) before the pipeline sees the request, so a turn over a socket
is the same request as over HTTP. A previous_response_id this connection never showed is one
the upstream may keep (``store``): the request goes on chained, as over HTTP.

Every error is an ``error`` event carrying the HTTP status the request would have had and the
error object (``{"type": "error", "status", "error": {...}}``, as OpenAI's socket sends them):
Codex reads the status as it reads an HTTP answer's (a 5xx or a 429 is retried, a 4xx shown).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..errors import InvalidRequest
from ..pipeline.sse import SSEEvent

WS_ONLY = ("type", "generate", "stream_id")  # the envelope: no HTTP body has these
ENDS = ("response.completed", "response.incomplete")
CHAINS_KEPT = 8  # responses a connection can go on from (Codex goes on from its last one)
# a socket's handshake headers that say nothing to an HTTP upstream
_HANDSHAKE = ("sec-websocket-",)
WS_BETA = "responses_websockets="  # OpenAI-Beta's token for the socket itself
# the status an error event of a stream stands for, by its code (an HTTP answer would have
# had it): what is left failed mid-answer upstream (502), or in the proxy (500)
_STATUS_OF_CODE = {"rate_limit_exceeded": 429, "insufficient_quota": 429,
                   "tenant_share_exceeded": 429, "proxy_full": 503,
                   "store_unavailable": 503, "shutting_down": 503,
                   "context_length_exceeded": 400, "invalid_request_error": 400,
                   "invalid_prompt": 400, "internal_error": 500, "server_error": 500}
_ANSWER_HEADERS_SKIPPED = ("content-type", "content-length")


@dataclass(frozen=True)
class Kept:
    """What a connection keeps of one response: the conversation it ends (the input it
    answered, then its output as the client saw it), and that conversation's size in
    bytes, roughly (as the client sent it)."""

    items: list[dict[str, Any]]
    size: int


class Chains:
    """The responses a connection can go on from: the most recent ``limit``, by id. A
    conversation kept shares its items with the one it grew from (lists of the same
    dicts): a long session costs one conversation, not one per turn."""

    def __init__(self, limit: int = CHAINS_KEPT):
        self.limit = limit
        self._kept: collections.OrderedDict[str, Kept] = collections.OrderedDict()

    def get(self, response_id: str) -> Kept | None:
        kept = self._kept.get(response_id)
        if kept is not None:
            self._kept.move_to_end(response_id)
        return kept

    def keep(self, response_id: str, kept: Kept) -> None:
        self._kept[response_id] = kept
        self._kept.move_to_end(response_id)
        while len(self._kept) > self.limit:
            self._kept.popitem(last=False)

    def __len__(self) -> int:
        return len(self._kept)


@dataclass(frozen=True)
class Create:
    """A ``response.create`` read: the HTTP body it amounts to (expanded when it goes on
    from a response of this connection), and its envelope."""

    body: dict[str, Any]
    generate: bool = True
    lane: str | None = None  # its stream_id, echoed by every event of its response
    continued: str | None = None  # the response of this connection it went on from
    asked_previous: str | None = None  # its previous_response_id as the client sent it
    size: int = 0  # the conversation's bytes, roughly: what was kept, and this event's
    items: list[dict[str, Any]] = field(default_factory=list)  # its whole input, as kept


def client_event(text: str | bytes) -> dict[str, Any]:
    """A client's message as an event: a JSON object with a string ``type``."""
    try:
        event = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the message is not valid JSON: {exc}") from exc
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise InvalidRequest("a message must be a JSON object with a string \"type\" "
                             "(response.create)", param="type")
    return event


def create_request(event: dict[str, Any], chains: Chains, size: int) -> Create:
    """The HTTP request a ``response.create`` of ``size`` bytes amounts to. A
    ``previous_response_id`` this connection was shown is expanded here: the request then
    carries the whole conversation and names no previous response."""
    generate = event.get("generate", True)
    if not isinstance(generate, bool):
        raise InvalidRequest("generate must be a boolean", param="generate")
    lane = event.get("stream_id")
    if lane is not None and not isinstance(lane, str):
        raise InvalidRequest("stream_id must be a string", param="stream_id")
    if event.get("background"):
        raise InvalidRequest("background is not supported over a WebSocket (send the "
                             "request to POST /v1/responses)", param="background")
    body = {k: v for k, v in event.items() if k not in WS_ONLY}
    body["stream"] = True
    asked = body.get("previous_response_id")
    kept = chains.get(asked) if isinstance(asked, str) else None
    new = _as_items(body.get("input"))
    if kept is None:
        if new is not None:
            body["input"] = new
        items = new or []
        return Create(body, generate, lane, None, asked if isinstance(asked, str) else None,
                      size, items)
    del body["previous_response_id"]
    items = [*kept.items, *(new or [])]
    body["input"] = items
    return Create(body, generate, lane, asked, asked, kept.size + size, items)


def _as_items(input_: Any) -> list[dict[str, Any]] | None:
    """A request's input as items (a string is the user's message); None when it is
    neither (the request's check names it)."""
    if input_ is None:
        return []
    if isinstance(input_, str):
        return [{"type": "message", "role": "user", "content": input_}]
    if isinstance(input_, list):
        return input_
    return None


def http_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """A socket's handshake headers as an HTTP request's: without the socket's own
    (``Sec-WebSocket-*``, OpenAI-Beta's ``responses_websockets`` token)."""
    out = []
    for k, v in headers:
        lk = k.lower()
        if lk.startswith(_HANDSHAKE):
            continue
        if lk == "openai-beta":
            v = ",".join(t for t in (p.strip() for p in v.split(","))
                         if t and not t.startswith(WS_BETA))
            if not v:
                continue
        out.append((k, v))
    return out


class SocketRelay:
    """A response's event stream (the pipeline's, SSE) as a socket's messages: every event's
    JSON as it came, but an error event in the socket's shape, every event of a lane with
    its ``stream_id``, and a response that went on from one of the connection's echoing the
    ``previous_response_id`` it was asked with (the upstream was sent the whole
    conversation, and none); and what the response ended with, to keep for the next turn."""

    def __init__(self, lane: str | None = None, previous: str | None = None):
        self.lane = lane
        self.previous = previous
        self.response: dict[str, Any] | None = None  # the completed response, if it was
        self.failed = False
        self.events = 0
        self.skipped = 0  # events that were not a JSON object (an upstream's own bytes)

    @property
    def ended(self) -> bool:
        """Whether the response's end was sent: completed, incomplete, failed or an error."""
        return self.failed or self.response is not None

    def feed(self, event: SSEEvent) -> list[str]:
        if event.is_done or not event.data.strip():
            return []
        try:
            data = orjson.loads(event.data)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            self.skipped += 1  # a socket's messages are JSON events: not one of them
            return []
        self.events += 1
        kind = data.get("type") or event.event
        changed = False
        if kind == "error":
            data, changed = socket_error(data), True
            self.failed = True
        elif kind == "response.failed":
            self.failed = True
        elif kind in ENDS and isinstance(data.get("response"), dict):
            self.response = data["response"]
        if self.previous is not None and isinstance(data.get("response"), dict):
            data["response"]["previous_response_id"], changed = self.previous, True
        if self.lane is not None:
            data["stream_id"], changed = self.lane, True
        return [orjson.dumps(data).decode()] if changed else [event.data]

    def kept(self, create: Create, answer_size: int) -> tuple[str, Kept] | None:
        """What the connection keeps of the response that ended (None when none did): its
        id, the conversation it ends. A response the client was shown complete is kept
        whatever came after it: the client goes on from it."""
        response = self.response
        if response is None or not isinstance(response.get("id"), str):
            return None
        output = response.get("output")
        if not isinstance(output, list) or not all(isinstance(i, dict) for i in output):
            return None
        return response["id"], Kept([*create.items, *output], create.size + answer_size)


def socket_error(data: dict[str, Any]) -> dict[str, Any]:
    """A stream's error event in the socket's shape: the status it stands for, the error
    object (the event's own code, message and param)."""
    err = data.get("error")
    if isinstance(err, dict) and isinstance(data.get("status"), int):
        return data  # the socket's shape already
    if not isinstance(err, dict):
        err = {k: data.get(k) for k in ("code", "message", "param")}
    code = err.get("code")
    given = data.get("status")
    status: int = given if isinstance(given, int) else \
        _STATUS_OF_CODE.get(code if isinstance(code, str) else "", 502)
    kind = "server_error" if status >= 500 else "rate_limit_error" if status == 429 \
        else "invalid_request_error"
    error = {"type": err.get("type") or kind,
             "code": code, "message": str(err.get("message") or "the response failed"),
             "param": err.get("param")}
    out = {"type": "error", "status": status, "error": error}
    if "sequence_number" in data:
        out["sequence_number"] = data["sequence_number"]
    return out


def error_event(status: int, error: Mapping[str, Any], headers: Mapping[str, str] | None = None,
                lane: str | None = None) -> dict[str, Any]:
    """An error the proxy answers a socket's event with: as an HTTP answer's status and
    error object; its headers (Retry-After, the upstream's rate limits) where each reader
    looks for them (Codex at the top, the openai SDK in the error)."""
    err = {"type": error.get("type") or "invalid_request_error", "code": error.get("code"),
           "message": str(error.get("message") or f"HTTP {status}"),
           "param": error.get("param")}
    out: dict[str, Any] = {"type": "error", "status": status, "error": err}
    shown = {str(k).lower(): str(v) for k, v in (headers or {}).items()
             if k.lower() not in _ANSWER_HEADERS_SKIPPED}
    if shown:
        err["headers"] = shown
        out["headers"] = shown
    if lane is not None:
        out["stream_id"] = lane
    return out


def answer_error(status: int, body: bytes, headers: Mapping[str, str] | None = None,
                 lane: str | None = None) -> dict[str, Any]:
    """An HTTP answer of ``status`` (the proxy's refusal, an upstream's error as it came) as
    a socket's error event: its error object when it has one, else its text."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict):
        text = body.decode("utf-8", "replace").strip()[:2000]
        err = {"type": "server_error" if status >= 500 else "invalid_request_error",
               "message": f"the upstream answered HTTP {status}" + (f": {text}" if text
                                                                     else "")}
    return error_event(status, err, headers, lane)


def warmup_events(create: Create, response_id: str, created_at: int) -> list[dict[str, Any]]:
    """A warmup's answer (``generate: false``): a response with no output, its id the one
    a later turn goes on from. Nothing went upstream: its usage is none."""
    body = create.body
    response = {"id": response_id, "object": "response", "created_at": created_at,
                "status": "in_progress", "error": None, "incomplete_details": None,
                "instructions": body.get("instructions"), "model": body.get("model"),
                "output": [], "parallel_tool_calls": body.get("parallel_tool_calls", True),
                "previous_response_id": create.asked_previous,
                "store": body.get("store", True), "tool_choice": body.get("tool_choice", "auto"),
                "tools": body.get("tools") or [], "text": {"format": {"type": "text"}},
                "truncation": "disabled", "metadata": body.get("metadata") or {},
                "usage": None}
    usage = {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": 0}
    out = [{"type": "response.created", "response": response, "sequence_number": 0},
           {"type": "response.completed", "sequence_number": 1,
            "response": {**response, "status": "completed", "usage": usage}}]
    if create.lane is not None:
        for e in out:
            e["stream_id"] = create.lane
    return out


def steer_failed(event: dict[str, Any]) -> dict[str, Any]:
    """``response.steer`` is not served: its input comes back, for the client to send with
    its next ``response.create`` (as the API asks of a steer it cannot commit)."""
    previous = event.get("previous_response_id")
    return {"type": "response.steer.failed", "sequence_number": 0,
            "error": {"type": "invalid_request_error", "code": "steering_not_supported",
                      "message": "runloop-proxy does not steer a response in flight: send "
                                 "this input with the next response.create"},
            "steer": {"input": event.get("input"),
                      "previous_response_id": previous if isinstance(previous, str) else ""}}
