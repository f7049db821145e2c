"""Chat completions on the wire (pure): a window as an upstream body, an answer as a Reply, and
a streamed answer rewritten for the client — the proxy's tool calls dropped, the client's
renumbered from 0, and across rounds one answer as one upstream would stream it: one id and
one ``created``, each choice's role said once, usage summed into one final chunk shaped as
the upstream's own."""

from __future__ import annotations

import collections
import time
from typing import Any

from ..conversation.messages import Message, ToolCall, clean
from ..errors import Unavailable, UpstreamError
from ..pipeline.sse import DONE, SSEEvent, encode_json
from ..pipeline.tools import ProxyTools
from ..pipeline.wire import Decision, Ending, Native, Reply, Step, bad_reply, event_json
from ..window.builder import Note

TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")


class ChatWire(Native):
    api = "chat"
    upstream_path = "/chat/completions"

    def outgoing(self, body: dict[str, Any], messages: list[Message],
                 extra_tools: list[dict[str, Any]], note: Note | None = None
                 ) -> dict[str, Any]:
        out = {**body, "messages": messages}
        if extra_tools:
            out["tools"] = [*(body.get("tools") or []), *extra_tools]
            if body.get("stream"):
                # the rewritten stream sums every round's usage; the client gets it if it asked
                out["stream_options"] = {**(body.get("stream_options") or {}),
                                         "include_usage": True}
        return out

    def next_round(self, sent: dict[str, Any], messages: list[Message],
                   withdraw: frozenset[str]) -> dict[str, Any]:
        out = {**sent, "messages": messages}
        if withdraw:
            kept = [t for t in sent.get("tools") or []
                    if (t.get("function") or {}).get("name") not in withdraw]
            if kept:
                out["tools"] = kept
            else:
                for k in TOOL_KEYS:
                    out.pop(k, None)
        return out

    def tool_definitions(self, tools: ProxyTools) -> list[dict[str, Any]]:
        return [{"type": "function", "function": d} for d in tools.functions()]

    def parse(self, data: Any) -> Reply:
        problem = completion_problem(data)
        if problem:
            raise bad_reply(f"a chat completion: {problem}", data)
        usage = data.get("usage")
        return Reply(clean(data["choices"][0]["message"]),
                     usage if isinstance(usage, dict) else None)

    def client_json(self, data: dict[str, Any], decision: Decision,
                    usage: dict[str, Any], tools: ProxyTools) -> dict[str, Any]:
        choice = data["choices"][0]
        msg = choice["message"]
        if decision.step is Step.MIXED:
            msg["tool_calls"] = list(decision.theirs)
        elif decision.step is Step.WITHDRAWN:
            msg.pop("tool_calls", None)
            msg["content"] = msg.get("content") or ""
            choice["finish_reason"] = "stop"
        if usage:
            data["usage"] = usage
        return data

    def relay(self, request: dict[str, Any]) -> ChatRelay:
        return ChatRelay(request)

    def observer(self, limit: int) -> ChatObserver:
        return ChatObserver(limit)


def completion_problem(data: Any) -> str | None:
    """Why ``data`` is not a chat completion whose first choice carries a message, or None."""
    if not isinstance(data, dict):
        return "not a JSON object"
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        return "no choices"
    first = choices[0]
    msg = first.get("message") if isinstance(first, dict) else None
    if not isinstance(msg, dict):
        return "choices[0] has no message"
    if msg.get("content") is not None and not isinstance(msg.get("content"), (str, list)):
        return "message.content is neither text nor parts"
    calls = msg.get("tool_calls")
    if calls is not None and (not isinstance(calls, list) or not all(map(_is_call, calls))):
        return "message.tool_calls is malformed"
    return None


def _is_call(c: Any) -> bool:
    fn = c.get("function") if isinstance(c, dict) else None
    return isinstance(fn, dict) and isinstance(fn.get("name"), str) \
        and isinstance(c.get("id"), str) and isinstance(fn.get("arguments", ""), str)


def chunk_problem(chunk: Any) -> str | None:
    """Why ``chunk`` is not a chat-completion chunk this proxy can read, or None."""
    if not isinstance(chunk, dict):
        return "not a JSON object"
    choices = chunk.get("choices")
    if choices is None:
        return None
    if not isinstance(choices, list):
        return "choices is not an array"
    for choice in choices:
        if not isinstance(choice, dict) or not isinstance(choice.get("index", 0), int):
            return "a choice is not an object with an integer index"
        delta = choice.get("delta")
        if delta is None:
            continue
        if not isinstance(delta, dict):
            return "a delta is not an object"
        for key in ("content", "refusal"):
            if delta.get(key) is not None and not isinstance(delta[key], str):
                return f"delta.{key} is not text"
        calls = delta.get("tool_calls")
        if calls is None:
            continue
        if not isinstance(calls, list):
            return "delta.tool_calls is not an array"
        for tc in calls:
            fn = tc.get("function") if isinstance(tc, dict) else None
            if not isinstance(tc, dict) or not isinstance(tc.get("index", 0), int) \
                    or isinstance(tc.get("index"), bool) \
                    or (fn is not None and not isinstance(fn, dict)) \
                    or any((fn or {}).get(k) is not None
                           and not isinstance((fn or {}).get(k), str)
                           for k in ("name", "arguments")):
                return "a streamed tool call is malformed"
    return None


class Accumulator:
    """Builds choice 0's assistant message, the finish reason and usage from chunks (which
    ``chunk_problem`` accepted)."""

    def __init__(self) -> None:
        self.id: str | None = None
        self.model: str | None = None
        self.created: int | None = None
        self.content: list[str] = []
        self.refusal: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self._parts: dict[int, tuple[list[str], list[str]]] = {}  # a call's name, arguments
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        self.id = self.id or chunk.get("id")
        self.model = self.model or chunk.get("model")
        self.created = self.created or chunk.get("created")
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.content.append(delta["content"])
            if delta.get("refusal"):
                self.refusal.append(delta["refusal"])
            for tc in delta.get("tool_calls") or []:
                at = tc.get("index", 0)
                slot = self.calls.setdefault(at, {
                    "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                if tc.get("id"):
                    slot["id"] = tc["id"]
                fn = tc.get("function") or {}
                # parts joined once the call is read: a string grown per delta is quadratic
                name, arguments = self._parts.setdefault(at, ([], []))
                name.append(fn.get("name") or "")
                arguments.append(fn.get("arguments") or "")
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def tool_calls(self) -> list[ToolCall]:
        for at, (name, arguments) in self._parts.items():
            self.calls[at]["function"] = {"name": "".join(name),
                                          "arguments": "".join(arguments)}
        return [self.calls[i] for i in sorted(self.calls)]  # type: ignore[misc]

    def message(self) -> Message:
        msg: Message = {"role": "assistant", "content": "".join(self.content) or None}
        if self.refusal:
            msg["refusal"] = "".join(self.refusal)
        calls = self.tool_calls()
        if calls:
            msg["tool_calls"] = calls
        return clean(msg)


# what an OpenAI-shaped error says it is (its code, else its type), as an HTTP status
ERROR_STATUSES = {"rate_limit_exceeded": 429, "rate_limit_error": 429, "insufficient_quota": 429,
                  "overloaded": 529, "overloaded_error": 529, "server_overloaded": 529,
                  "engine_overloaded": 529, "service_unavailable": 503,
                  "context_length_exceeded": 400, "invalid_request_error": 400,
                  "server_error": 500, "internal_error": 500, "timeout": 504}


def error_status(err: Any) -> int:
    """The status an error a stream carries stands for (a stream has sent its 200 already):
    its numeric code when it has one, else what its code or type names; 502 when unknown."""
    if not isinstance(err, dict):
        return 502
    for key in ("code", "status", "type"):
        v = err.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 400 <= v <= 599:
            return v
        if isinstance(v, str) and v in ERROR_STATUSES:
            return ERROR_STATUSES[v]
    return 502


def decode_chunk(event: SSEEvent) -> dict[str, Any] | None:
    """A data event's chunk; an error event from the upstream raises."""
    chunk = event_json(event)
    if chunk is None:
        return None
    if isinstance(chunk, dict) and chunk.get("error"):
        err = chunk["error"]
        raise UpstreamError("", quoted=str(err.get("message", "upstream error"))
                            if isinstance(err, dict) else str(err), status=error_status(err))
    problem = chunk_problem(chunk)
    if problem:
        raise bad_reply(f"a chat-completion chunk: {problem}", chunk)
    return chunk  # type: ignore[no-any-return]


class ChatObserver(Ending):
    """Reads a stream relayed unchanged, to record its answer; what it cannot read leaves
    the answer unrecorded (the client got the bytes as they came), and past ``limit`` bytes
    it stops keeping the answer (the store would not keep it either). The answer is whole
    at [DONE] only: a finish reason comes before the usage chunk, and a stream cut after it
    did not end."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.acc = Accumulator()
        self.limit = limit
        self.size = 0

    def feed(self, event: SSEEvent) -> None:
        if event.is_done:
            self.ended = True
            return
        self.size += len(event.data)
        if self.size > self.limit or self.ended:
            return
        try:
            chunk = decode_chunk(event)
        except UpstreamError as exc:
            self.failed(exc)
            return
        if chunk is not None:
            self.acc.add(chunk)

    def reply(self) -> Reply | None:
        if not self.whole or self.size > self.limit or (
                self.acc.id is None and not self.acc.content and not self.acc.calls):
            return None
        return Reply(self.acc.message(), self.acc.usage)


class ChatRelay:
    """A streamed chat answer across the proxy's tool rounds."""

    def __init__(self, request: dict[str, Any]):
        options = request.get("stream_options")
        self.want_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        self.model = str(request.get("model", ""))
        self.stream_id: str | None = None
        self.created: Any = None
        self.next_index = 0
        self.template: dict[str, Any] = {}
        self.usage_chunk: dict[str, Any] = {}  # the upstream's last usage chunk: its shape
        self.opened: set[Any] = set()  # the choices whose role the client has been told
        self.content: list[str] = []

    def round(self, tools: ProxyTools) -> ChatRound:
        return ChatRound(self, tools)

    @property
    def answer_id(self) -> str | None:
        return self.stream_id

    def shown(self, message: Message) -> Message:
        """The message as the client saw it: the text of every round, then its calls."""
        text = "".join(self.content)
        out = {k: v for k, v in message.items() if k != "content"}
        return clean({"role": "assistant", "content": text or None, **out})  # type: ignore[typeddict-item]

    def end(self, usage: dict[str, Any]) -> list[bytes]:
        out = []
        if self.want_usage:
            # the upstream's own usage chunk (its system_fingerprint, service_tier, …) when
            # it sent one, with every round's usage
            t = self.usage_chunk or self.template
            out.append(encode_json({
                **{k: v for k, v in self.usage_chunk.items() if k != "usage"},
                "id": self.stream_id, "object": t.get("object", "chat.completion.chunk"),
                "created": t.get("created", int(time.time())),
                "model": t.get("model", self.model), "choices": [], "usage": usage}))
        out.append(DONE)
        return out

    def error(self, exc: Exception) -> bytes:
        body = exc.body() if isinstance(exc, (UpstreamError, Unavailable)) else {"error": {
            "message": "internal error in runloop-proxy", "type": "server_error",
            "param": None, "code": "internal_error"}}
        return encode_json(body)


class CallSplit:
    """Which of a stream's tool calls are the proxy's, for any chunking and interleaving of
    the upstream's deltas. A call is decided once its name is complete — its arguments have
    begun, or no delta can follow — or as soon as its name so far cannot become one of the
    proxy's; until then its deltas are held (merged). The client's calls are released in the
    order the upstream opened them (what the client reassembles is what the proxy records),
    renumbered from the relay's next index."""

    def __init__(self, relay: ChatRelay, tools: ProxyTools):
        self.relay = relay
        self.names = tuple(tools.names)
        self.owner: dict[int, bool] = {}  # upstream index -> the proxy's call? (decided)
        self.client_index: dict[int, int] = {}  # released: upstream index -> client index
        self.held: dict[int, _Held] = {}  # not yet released: the deltas, merged
        # indexes not yet released, in the order they opened (a deque: released from the
        # front, one at a time — a list's pop(0) made 160,000 held calls quadratic)
        self.queue: collections.deque[int] = collections.deque()

    def feed(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The client's tool-call deltas for these upstream ones."""
        out: list[dict[str, Any]] = []
        for tc in calls:
            idx = tc.get("index", 0)
            if idx in self.client_index:
                out.append({**tc, "index": self.client_index[idx]})
                continue
            if self.owner.get(idx) is True:
                continue
            held = self.held.get(idx)
            if held is None:
                self.queue.append(idx)
                held = self.held[idx] = _Held(tc)
            else:
                held.add(tc)
            if idx not in self.owner:
                self._decide(idx, complete=bool(held.parts["arguments"]))
            out += self._release()
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The held client calls, now that no delta can follow."""
        for idx in self.queue:
            if idx not in self.owner:
                self._decide(idx, complete=True)
        return self._release()

    def _decide(self, idx: int, complete: bool) -> None:
        # joined while undecided only: no longer than the proxy's longest name and a delta
        name = "".join(self.held[idx].parts["name"])
        if complete:
            self.owner[idx] = name in self.names
        elif not any(n.startswith(name) for n in self.names):
            self.owner[idx] = False

    def _release(self) -> list[dict[str, Any]]:
        out = []
        while self.queue and self.queue[0] in self.owner:
            idx = self.queue.popleft()
            held = self.held.pop(idx)
            if not self.owner[idx]:
                self.client_index[idx] = self.relay.next_index
                self.relay.next_index += 1
                out.append({**held.delta(), "index": self.client_index[idx]})
        return out


class _Held:
    """A tool call's deltas not yet released, as one delta: the first one's fields, later
    ones' set over them, its name and arguments kept as the parts they came in and joined
    once, at release (joined at each delta, a call held behind an undecided one re-copied
    all its arguments so far every time: 80,000 deltas, 57 s)."""

    def __init__(self, tc: dict[str, Any]):
        self.fields = {**tc}
        self.function = {**(tc.get("function") or {})}
        self.parts: dict[str, list[str]] = {
            key: [self.function[key]] if self.function.get(key) else []
            for key in ("name", "arguments")}

    def add(self, tc: dict[str, Any]) -> None:
        self.fields.update((k, v) for k, v in tc.items() if k != "function" and v is not None)
        fn = tc.get("function") or {}
        for key in ("name", "arguments"):
            if fn.get(key):
                self.parts[key].append(fn[key])

    def delta(self) -> dict[str, Any]:
        function = dict(self.function)
        for key, parts in self.parts.items():
            if parts:
                function[key] = "".join(parts)
        return {**self.fields, "function": function}


class ChunkRound:
    """One upstream stream of chat chunks read into an answer (``acc``), whatever it is
    relayed as: complete at its [DONE]."""

    def __init__(self) -> None:
        self.acc = Accumulator()
        self.done = False

    @property
    def complete(self) -> bool:
        """At [DONE] only: the usage chunk comes after the finish reason, and a stream cut
        between them did not end (the rule every path and API keeps: an answer is whole at
        its upstream's own end marker)."""
        return self.done

    def chunk(self, event: SSEEvent) -> dict[str, Any] | None:
        """The event's chunk, added to the answer; None for [DONE] or an event without one."""
        if event.is_done:
            self.done = True
            return None
        chunk = decode_chunk(event)
        if chunk is not None:
            self.acc.add(chunk)
        return chunk


class ChatRound(ChunkRound):
    """One upstream stream: the client's deltas pass (its calls renumbered), the proxy's calls
    and the usage chunk are absorbed, the finish chunk is held until the round's fate is known."""

    def __init__(self, relay: ChatRelay, tools: ProxyTools):
        super().__init__()
        self.relay = relay
        self.split = CallSplit(relay, tools)
        self.held: dict[str, Any] | None = None

    def feed(self, event: SSEEvent) -> list[bytes]:
        chunk = self.chunk(event)
        if chunk is None:
            return []
        out = self._rewrite(chunk)
        if out is None:
            return []
        self.relay.template = out
        return [encode_json(out)]

    def reply(self) -> Reply:
        self.relay.content += self.acc.content
        return Reply(self.acc.message(), self.acc.usage)

    def close(self, decision: Decision) -> list[bytes]:
        out = []
        rest = self.split.finish()  # a stream that ended without a finish chunk
        if rest:
            t = self.relay.template
            out.append(encode_json({**{k: v for k, v in t.items() if k != "choices"},
                                    "choices": [{"index": 0, "delta": {"tool_calls": rest},
                                                 "finish_reason": None}]}))
        if self.held is not None:
            if decision.step is Step.WITHDRAWN:
                self.held["choices"][0]["finish_reason"] = "stop"
            out.append(encode_json(self.held))
        return out

    def _rewrite(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        relay = self.relay
        if relay.stream_id is None:
            relay.stream_id = chunk.get("id")
            relay.created = chunk.get("created")
        else:  # a later round is the same answer: its id and its time
            for key, value in (("id", relay.stream_id), ("created", relay.created)):
                if key in chunk and value is not None:
                    chunk[key] = value
        choices = chunk.get("choices")
        if not choices:
            if chunk.get("usage") is None:
                return chunk
            relay.usage_chunk = chunk
            return None
        chunk.pop("usage", None)
        for choice in choices:
            delta = choice.get("delta") or {}
            if delta.get("role"):  # said once per choice: a client adds up what repeats
                if choice.get("index", 0) in relay.opened:
                    del delta["role"]
                else:
                    relay.opened.add(choice.get("index", 0))
            kept = self.split.feed(delta.get("tool_calls") or [])
            if choice.get("finish_reason"):
                kept += self.split.finish()
            if kept:
                delta["tool_calls"] = kept
                choice["delta"] = delta
            else:
                delta.pop("tool_calls", None)
            if choice.get("finish_reason"):
                self.held = {**chunk, "choices": [{**choice, "delta": {}}]}
                choice["finish_reason"] = None
                if not _has_payload(delta):
                    return None
        if not any(_has_payload(c.get("delta") or {}) for c in choices) \
                and all(not c.get("finish_reason") and not c.get("logprobs") for c in choices):
            return None
        return chunk


def _has_payload(delta: dict[str, Any]) -> bool:
    return any(v not in (None, "", [], {}) for v in delta.values())
