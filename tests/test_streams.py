"""Streams by property: for chat completions and the Responses API, an upstream answer across
the proxy's tool rounds, chunked and interleaved every way a provider may send it — empty
deltas, payload-less chunks (a role alone, a null delta, an empty text, logprobs alone, a chunk
with no choices), a usage-only chunk anywhere, reasoning (DeepSeek's ``reasoning_content``,
the Responses API's reasoning items and their summary deltas), calls whose id, name and
arguments come in pieces, the client's calls mixed with the proxy's, events the proxy does not
know — cut at arbitrary bytes. What the client reassembles must be the upstream's answer less
the proxy's own calls, and what the proxy records must be what the client saw.

The rounds run through the real tool loop (``pipeline/toolloop.answer_stream``), the real
wires, the real SSE decoder and the proxy's real tool runner; only the network is replaced:
each round's bytes come from a list instead of a socket."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import openai
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runloop_proxy.api.chat_wire import ChatWire
from runloop_proxy.api.responses_wire import ResponsesWire
from runloop_proxy.errors import UpstreamBadReply
from runloop_proxy.pipeline.sse import SSEDecoder
from runloop_proxy.pipeline.toolloop import Outcome, Rounds, answer_stream
from runloop_proxy.pipeline.tools import ProxyTools, ToolRunner
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer, until

TOOLS = ProxyTools.for_request(None)
MINE = list(TOOLS.names)  # the proxy's tool names
CLIENTS = ["bash", "lookup", "recall_tool_call_v2", "search", "recall_tool_", "recall"]
ARGUMENTS = {"recall_tool_call": ['{"call_id": "7f"}', "{}", "not json"],
             "search_history": ['{"query": "order 7"}']}
EXAMPLES = 250
MAX_ANSWER = 1 << 20  # bytes of an answer the rounds may hold whole


# -- the network replaced: a round's bytes from a list ------------------------------------------

class Bytes:
    """An upstream stream that yields given pieces (what ``UpstreamResponse`` offers)."""

    status = 200

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces
        self.closed = False

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece

    async def read(self, limit: int | None = None) -> bytes:
        whole = b"".join(self.pieces)
        assert limit is None or len(whole) <= limit, "an answer larger than the rounds may hold"
        return whole

    def close(self) -> None:
        self.closed = True


def run_rounds(wire: Any, request: dict[str, Any], rounds: list[list[bytes]],
               max_rounds: int) -> tuple[bytes, Outcome, list[Bytes]]:
    """The tool loop over these rounds: the bytes the client got, the outcome recorded."""
    upstreams = [Bytes(r) for r in rounds]
    asked: list[dict[str, Any]] = []

    async def send(body: dict[str, Any]) -> Any:
        asked.append(body)
        return upstreams[len(asked)]

    outcomes: list[Outcome] = []
    r = Rounds(wire, TOOLS, {**request, "stream": True}, [{"role": "user", "content": "go"}],
               ToolRunner(TOOLS, [{"role": "user", "content": "go"}], ["k0"], 5), max_rounds,
               send, MAX_ANSWER)

    async def client() -> bytes:
        first: Any = upstreams[0]
        out = [b async for b in answer_stream(r, first, request, outcomes.append)]
        return b"".join(out)

    got = asyncio.run(client())
    assert len(asked) == len(rounds) - 1, "a round was asked for that the answer did not need"
    assert len(outcomes) == 1
    return got, outcomes[0], upstreams


def cuts(draw: st.DrawFn, raw: bytes, most: int = 8) -> list[bytes]:
    at = sorted(draw(st.sets(st.integers(min_value=1, max_value=max(1, len(raw) - 1)),
                             max_size=most))) if len(raw) > 1 else []
    return [raw[a:b] for a, b in zip([0, *at], [*at, len(raw)], strict=True)]


def pieces(draw: st.DrawFn, s: str, most: int = 3) -> list[str]:
    if len(s) <= 1:
        return [s] if s else []
    at = sorted(draw(st.sets(st.integers(min_value=1, max_value=len(s) - 1), max_size=most)))
    return [s[a:b] for a, b in zip([0, *at], [*at, len(s)], strict=True)]


def interleave(draw: st.DrawFn, queues: list[list[Any]], ordered: int = 0) -> list[Any]:
    """The queues' items merged in an arbitrary order, each queue's in its own order; the
    first ``ordered`` queues open in their order (a provider numbers calls as they open)."""
    out: list[Any] = []
    opened = 0
    while any(queues):
        ready = [k for k, q in enumerate(queues) if q and (k >= ordered or k <= opened)]
        k = draw(st.sampled_from(ready))
        if k == opened < ordered:
            opened += 1
        out.append(queues[k].pop(0))
    return out


@dataclass
class Answer:
    """One upstream round as the model meant it."""

    text: str = ""
    reasoning: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    usage: int = 0
    logprobs: list[str] = field(default_factory=list)

    def theirs(self) -> list[dict[str, Any]]:
        return [c for c in self.calls if c["function"]["name"] not in TOOLS.names]


@st.composite
def answers(draw: st.DrawFn, allowed: int | None = None) -> tuple[list[Answer], int]:
    """Rounds of an answer and the rounds allowed: every round but the last calls only the
    proxy's tools (so the loop goes on); the last calls anything — or only the proxy's, once
    the rounds allowed are used up (then they are withdrawn). ``allowed``: the rounds a
    proxy allows (its policy's), and then the last round calls one of the client's too."""
    n = draw(st.integers(min_value=1, max_value=3))
    out = []
    for k in range(n):
        last = k == n - 1
        names = st.sampled_from(MINE + CLIENTS) if last else st.sampled_from(MINE)
        calls = []
        for j in range(draw(st.integers(min_value=0 if last else 1, max_value=3))):
            name = draw(names)
            args = draw(st.sampled_from(ARGUMENTS.get(name, ["", "{}", '{"q": "a b"}'])))
            calls.append({"id": f"call_{k}{j}{draw(st.text('xyz', max_size=2))}",
                          "type": "function", "function": {"name": name, "arguments": args}})
        out.append(Answer(draw(st.text("ab c", max_size=10)), draw(st.text("rs ", max_size=8)),
                          calls, draw(st.integers(min_value=1, max_value=50)),
                          draw(st.lists(st.sampled_from(["t1", "t2"]), max_size=2))))
    withdrawn = bool(out[-1].calls) and not out[-1].theirs()
    if withdrawn and allowed is not None:
        out[-1].calls.append({"id": f"call_{n}c", "type": "function",
                              "function": {"name": "bash", "arguments": "{}"}})
        withdrawn = False
    max_rounds = allowed if allowed is not None else n - 1 if withdrawn else \
        draw(st.integers(min_value=n - 1, max_value=4))
    return out, max_rounds


# -- chat completions ---------------------------------------------------------------------------

PAYLOADLESS: list[dict[str, Any]] = [
    {"choices": [{"index": 0, "delta": {}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": None, "refusal": None},
                  "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": None, "finish_reason": None}]},
    {"choices": [], "prompt_filter_results": [{"prompt_index": 0}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": []}, "finish_reason": None}]},
]


@st.composite
def chat_streams(draw: st.DrawFn, allowed: int | None = None
                 ) -> tuple[list[Answer], int, list[list[bytes]], bool]:
    rounds, max_rounds = draw(answers(allowed))
    streams = []
    for k, a in enumerate(rounds):
        sid = f"up-{k}"
        calls: list[list[dict[str, Any]]] = []
        for i, c in enumerate(a.calls):
            deltas: list[dict[str, Any]] = []
            where = draw(st.sampled_from(["alone-first", "with-name", "last"]))
            if where == "alone-first":
                deltas.append({"index": i, "id": c["id"], "type": "function"})
            for j, part in enumerate(pieces(draw, c["function"]["name"])):
                d: dict[str, Any] = {"index": i, "function": {"name": part}}
                if j == 0 and where == "with-name":
                    d.update(id=c["id"], type="function")
                deltas.append(d)
            deltas += [{"index": i, "function": {"arguments": p}}
                       for p in pieces(draw, c["function"]["arguments"])]
            if where == "last":
                deltas[-1] = {**deltas[-1], "id": c["id"], "type": "function"}
            calls.append([{"tool_calls": [d]} for d in deltas])
        texts = [{"content": p} for p in pieces(draw, a.text)]
        thoughts = [{"reasoning_content": p} for p in pieces(draw, a.reasoning)]
        noise = [draw(st.sampled_from(PAYLOADLESS))
                 for _ in range(draw(st.integers(min_value=0, max_value=3)))]
        probs = [{"logprobs": t} for t in a.logprobs]
        usage_last = draw(st.booleans())  # after the finish, as OpenAI sends it, or anywhere
        order = interleave(draw, [*calls, texts, thoughts, noise, probs,
                                  [] if usage_last else [{"usage": a.usage}]],
                           ordered=len(calls))
        chunks: list[dict[str, Any]] = []
        for d in order:
            if "usage" in d:
                chunks.append({"choices": [], "usage": {"prompt_tokens": d["usage"],
                                                        "completion_tokens": 1}})
            elif "logprobs" in d:
                chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": None,
                                            "logprobs": {"content": [{
                                                "token": d["logprobs"], "logprob": -0.5,
                                                "bytes": None, "top_logprobs": []}]}}]})
            elif "choices" in d:
                chunks.append(orjson.loads(orjson.dumps(d)))
            else:
                chunks.append({"choices": [{"index": 0, "delta": d, "finish_reason": None}]})
        finish = "tool_calls" if a.calls else "stop"
        last = chunks[-1]["choices"] if chunks else []
        if last and last[0].get("delta") and draw(st.booleans()):
            last[0]["finish_reason"] = finish  # the finish with the last delta
        else:
            chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        if usage_last:
            chunks.append({"choices": [], "usage": {"prompt_tokens": a.usage,
                                                    "completion_tokens": 1}})
        raw = b"".join(b"data: " + orjson.dumps({"id": sid, "object": "chat.completion.chunk",
                                                  "created": 1, "model": "m", **c}) + b"\n\n"
                       for c in chunks)
        raw += b"data: [DONE]\n\n"  # whole: a stream without it is a cut (test_cut_answers)
        # the body may end right after the last event's data line, without the blank line
        raw = raw[:-draw(st.integers(min_value=0, max_value=2))] or raw
        streams.append(cuts(draw, raw))
    return rounds, max_rounds, streams, draw(st.booleans())


def client_reads_chat(raw: bytes) -> dict[str, Any]:
    events = [*SSEDecoder().feed(raw)]
    return chat_as_read([orjson.loads(e.data) for e in events if not e.is_done],
                        sum(e.is_done for e in events))


def husks(raw: bytes) -> list[dict[str, Any]]:
    """Chunks with choices that carry nothing: no delta payload, no finish, no logprobs."""
    chunks = [orjson.loads(e.data) for e in SSEDecoder().feed(raw) if not e.is_done]
    return [c for c in chunks if c.get("choices") and all(
        not any(v not in (None, "", [], {}) for v in (ch.get("delta") or {}).values())
        and not ch.get("finish_reason") and not ch.get("logprobs") for ch in c["choices"])]


def chat_as_read(chunks: list[dict[str, Any]], done: int) -> dict[str, Any]:
    """What a client makes of a chat stream's chunks (as the SDKs do: deltas merged by
    index)."""
    text, thought, probs, finishes, usage, filters = [], [], [], [], [], 0
    calls: dict[int, dict[str, Any]] = {}
    for c in chunks:
        if c.get("usage") is not None:
            usage.append(c["usage"])
        filters += "prompt_filter_results" in c
        for ch in c.get("choices") or []:
            d = ch.get("delta") or {}
            text.append(d.get("content") or "")
            thought.append(d.get("reasoning_content") or "")
            for tc in d.get("tool_calls") or []:
                slot = calls.setdefault(tc["index"], {"id": "", "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                slot["id"] = tc.get("id") or slot["id"]
                fn = tc.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
            probs += [t["token"] for t in ((ch.get("logprobs") or {}).get("content") or [])]
            if ch.get("finish_reason"):
                finishes.append(ch["finish_reason"])
    return {"text": "".join(text), "reasoning": "".join(thought), "logprobs": probs,
            "calls": [calls[i] for i in sorted(calls)], "indexes": sorted(calls),
            "finishes": finishes, "usage": usage, "ids": {c.get("id") for c in chunks},
            "done": done, "filters": filters}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=chat_streams())
def test_a_chat_client_gets_the_upstream_answer_less_the_proxys_calls(
        case: tuple[list[Answer], int, list[list[bytes]], bool]) -> None:
    rounds, max_rounds, streams, want_usage = case
    request = {"model": "m", "stream": True,
               **({"stream_options": {"include_usage": True}} if want_usage else {})}
    raw, outcome, upstreams = run_rounds(ChatWire(), request, streams, max_rounds)
    got = client_reads_chat(raw)
    theirs = rounds[-1].theirs()
    assert got["text"] == "".join(a.text for a in rounds)
    assert got["reasoning"] == "".join(a.reasoning for a in rounds)
    assert got["logprobs"] == [t for a in rounds for t in a.logprobs]
    assert got["calls"] == theirs and got["indexes"] == list(range(len(theirs)))
    assert got["finishes"] == ["tool_calls" if theirs else "stop"]
    total = sum(a.usage for a in rounds)
    assert got["usage"] == ([{"prompt_tokens": total, "completion_tokens": len(rounds)}]
                            if want_usage else [])
    assert got["ids"] == {"up-0"} and got["done"] == 1
    assert not husks(raw), husks(raw)  # what the proxy took out leaves no empty chunk
    assert got["filters"] == sum(b"".join(s).count(b"prompt_filter_results") for s in streams)
    assert all(u.closed for u in upstreams)
    # what the proxy records as the answer is what the client saw (its next request echoes it)
    assert outcome.shown.get("content") == (got["text"] or None)
    assert outcome.shown.get("tool_calls", []) == got["calls"]
    assert outcome.usage["prompt_tokens"] == total


# -- the Responses API --------------------------------------------------------------------------

@dataclass
class Items:
    """One Responses round: its output items, the proxy's function calls among them."""

    items: list[dict[str, Any]]
    usage: int


@st.composite
def responses_streams(draw: st.DrawFn, allowed: int | None = None
                      ) -> tuple[list[Items], int, list[list[bytes]]]:
    rounds, max_rounds = draw(answers(allowed))
    out: list[Items] = []
    streams = []
    for k, a in enumerate(rounds):
        items: list[dict[str, Any]] = []
        if a.reasoning or draw(st.booleans()):
            items.append({"type": "reasoning", "id": f"rs_{k}", "encrypted_content": f"enc{k}",
                          "summary": [{"type": "summary_text", "text": a.reasoning}]
                          if a.reasoning else []})
        if a.text:
            items.append({"type": "message", "id": f"msg_{k}", "status": "completed",
                          "role": "assistant", "content": [{"type": "output_text",
                                                            "text": a.text, "annotations": []}]})
        for c in a.calls:
            items.append({"type": "function_call", "id": f"fc_{c['id']}", "status": "completed",
                          "call_id": c["id"], "name": c["function"]["name"],
                          "arguments": c["function"]["arguments"]})
        if k == len(rounds) - 1 and draw(st.booleans()):  # a provider's own call: the client's
            items.insert(draw(st.integers(0, len(items))), {
                "type": "web_search_call", "id": f"ws_{k}", "status": "completed",
                "action": {"type": "search", "query": "q"}})
        order = list(range(len(items)))
        per_item = [item_events(draw, at, item) for at, item in zip(order, items, strict=True)]
        events = interleave(draw, per_item, ordered=len(per_item))
        base = {"id": f"resp_{k}", "object": "response", "model": "m"}
        head = [{"type": "response.created", "response": {**base, "status": "in_progress",
                                                          "output": []}},
                {"type": "response.in_progress", "response": {**base, "status": "in_progress",
                                                              "output": []}}]
        extra = [{"type": "rate_limits.updated", "rate_limits": []}] if draw(st.booleans()) \
            else []
        tail = [{"type": "response.completed", "response": {
            **base, "status": "completed", "output": items,
            "usage": {"input_tokens": a.usage, "output_tokens": 1}}}]
        seq = [*head, *interleave(draw, [events, extra]), *tail]
        # some servers name an event on its event line alone
        bare = draw(st.sets(st.integers(0, len(seq) - 1), max_size=3))
        raw = b"".join(b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(
            {**{k: v for k, v in e.items() if k != "type" or n not in bare},
             "sequence_number": n}) + b"\n\n" for n, e in enumerate(seq))
        streams.append(cuts(draw, raw))
        out.append(Items(items, a.usage))
    return out, max_rounds, streams


def item_events(draw: st.DrawFn, at: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of one output item: added (a call perhaps still without its name), its
    deltas, done."""
    kind = item["type"]
    added = {**item}
    if kind == "function_call":
        added = {**item, "arguments": "", "status": "in_progress"}
        if draw(st.booleans()):
            added["name"] = ""  # named only when done, as some servers do
    elif kind == "message":
        added = {**item, "content": [], "status": "in_progress"}
    elif kind == "reasoning":
        added = {**item, "summary": []}
    events = [{"type": "response.output_item.added", "output_index": at, "item": added}]
    ids = {"item_id": item["id"], "output_index": at}
    if kind == "function_call":
        events += [{"type": "response.function_call_arguments.delta", **ids, "delta": p}
                   for p in pieces(draw, item["arguments"])]
        events.append({"type": "response.function_call_arguments.done", **ids,
                       "arguments": item["arguments"]})
    elif kind == "message":
        text = item["content"][0]["text"]
        events += [{"type": "response.output_text.delta", **ids, "content_index": 0,
                    "delta": p} for p in pieces(draw, text)]
        events.append({"type": "response.output_text.done", **ids, "content_index": 0,
                       "text": text})
    elif kind == "reasoning" and item["summary"]:
        text = item["summary"][0]["text"]
        events += [{"type": "response.reasoning_summary_text.delta", **ids,
                    "summary_index": 0, "delta": p} for p in pieces(draw, text)]
    events.append({"type": "response.output_item.done", "output_index": at, "item": item})
    return events


def client_reads_responses(raw: bytes) -> dict[str, Any]:
    return responses_as_read([orjson.loads(e.data) for e in SSEDecoder().feed(raw)])


def responses_as_read(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client makes of a Responses stream's events: items placed by their index,
    deltas joined per item."""
    kinds = [e["type"] for e in events]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    by_index: dict[int, list[str]] = {}
    deltas: dict[int, str] = {}
    for e in events:
        if "output_index" in e:
            by_index.setdefault(e["output_index"], []).append(e["type"])
            if e["type"] in ("response.output_text.delta",
                             "response.reasoning_summary_text.delta",
                             "response.function_call_arguments.delta"):
                deltas[e["output_index"]] = deltas.get(e["output_index"], "") + e["delta"]
    done.sort(key=lambda e: e["output_index"])  # a client places items by their index
    return {"events": events, "kinds": kinds, "items": [e["item"] for e in done],
            "indexes": [e["output_index"] for e in done], "by_index": by_index,
            "deltas": deltas, "seq": [e.get("sequence_number") for e in events]}


STREAMED = ("message", "reasoning", "function_call")  # items whose text comes in deltas


def streamed_text(item: dict[str, Any]) -> str:
    """What an item's deltas add up to."""
    if item["type"] == "message":
        return str(item["content"][0]["text"])
    if item["type"] == "reasoning":
        return "".join(s["text"] for s in item["summary"])
    return str(item["arguments"])


def is_mine(item: dict[str, Any]) -> bool:
    return item.get("type") == "function_call" and item.get("name") in TOOLS.names


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=responses_streams())
def test_a_responses_client_gets_the_upstream_items_less_the_proxys_calls(
        case: tuple[list[Items], int, list[list[bytes]]]) -> None:
    rounds, max_rounds, streams = case
    raw, outcome, upstreams = run_rounds(ResponsesWire(), {"model": "m", "stream": True},
                                         streams, max_rounds)
    got = client_reads_responses(raw)
    expected = [i for r in rounds for i in r.items if not is_mine(i)]
    # every item of every round the client's — reasoning and the provider's own calls kept,
    # the proxy's calls gone — in order, numbered from 0, each once
    assert got["items"] == expected
    assert got["indexes"] == list(range(len(expected)))
    assert sorted(got["by_index"]) == got["indexes"]
    for at, item in enumerate(expected):
        kinds = got["by_index"][at]
        assert kinds[0] == "response.output_item.added" and \
            kinds[-1] == "response.output_item.done", (at, kinds)
        if item["type"] in STREAMED:
            assert got["deltas"].get(at, "") == streamed_text(item), (at, item)
    assert not any(str(i.get("name")) in MINE for e in got["events"]
                   for i in [e.get("item") or {}])
    # one response: created once, completed once with every item shown and the usage summed
    assert got["kinds"].count("response.created") == 1
    assert got["kinds"][-1] == "response.completed" and \
        got["kinds"].count("response.completed") == 1
    final = got["events"][-1]["response"]
    assert final["output"] == expected and final["id"] == "resp_0"
    assert final["usage"]["input_tokens"] == sum(r.usage for r in rounds)
    assert got["seq"] == list(range(len(got["events"])))
    assert got["kinds"].count("rate_limits.updated") == sum(
        s.count(b"event: rate_limits.updated") for s in (b"".join(x) for x in streams))
    assert all(u.closed for u in upstreams)
    assert outcome.usage["input_tokens"] == sum(r.usage for r in rounds)
    if expected:  # what the proxy records: every item the client was shown, reasoning too
        assert outcome.shown.get("items") == expected


# -- through the proxy: the real servers, the official SDK --------------------------------------

E2E_EXAMPLES = 15
CLIENT_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("bash", "lookup")]
THROUGH = settings(max_examples=E2E_EXAMPLES, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def stored_answer(proxy: ProxyServer, key: str, session: str) -> dict[str, Any]:
    """The answer the proxy recorded in a pass-through session (after the question): the
    stream is recorded once the client has it all, so it is waited for."""
    ns = "pt-" + hashlib.sha256(key.encode()).hexdigest()[:16]
    head: list[Any] = []

    def recorded() -> bool:
        proxy.settle()
        head[:] = proxy.run(proxy.state.store.head(ns, "n:" + session))
        return len(head) >= 2
    until(recorded, what="the answer recorded")
    assert len(head) == 2, head
    return head[-1][1]  # type: ignore[no-any-return]


@THROUGH
@given(case=chat_streams(allowed=4))
def test_through_the_proxy_a_chat_client_gets_the_upstream_answer_less_the_proxys_calls(
        proxy: ProxyServer, upstream: ScriptedUpstream,
        case: tuple[list[Answer], int, list[list[bytes]], bool]) -> None:
    rounds, _, streams, want_usage = case
    upstream.script.clear()
    upstream.push(*({"raw_chunks": s} for s in streams))
    asked = len(upstream.requests)
    session = uuid.uuid4().hex
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-streams", max_retries=0,
                      default_headers={"X-Session-Id": session})
    asking: dict[str, Any] = {"model": "gpt-4o-mini", "stream": True, "tools": CLIENT_TOOLS,
                              "messages": [{"role": "user", "content": "go"}]}
    if want_usage:
        asking["stream_options"] = {"include_usage": True}
    stream: Any = c.chat.completions.create(**asking)
    got = chat_as_read([chunk.model_dump() for chunk in stream], 1)
    theirs = rounds[-1].theirs()
    assert len(upstream.requests) - asked == len(rounds)
    assert (got["text"], got["reasoning"], got["logprobs"]) == (
        "".join(a.text for a in rounds), "".join(a.reasoning for a in rounds),
        [t for a in rounds for t in a.logprobs])
    assert got["calls"] == theirs and got["indexes"] == list(range(len(theirs)))
    assert got["finishes"] == ["tool_calls" if theirs else "stop"]
    assert [u["prompt_tokens"] for u in got["usage"]] == (
        [sum(a.usage for a in rounds)] if want_usage else [])
    recorded = stored_answer(proxy, "sk-streams", session)
    assert recorded.get("content") == (got["text"] or None)
    assert recorded.get("tool_calls", []) == got["calls"]


@THROUGH
@given(case=responses_streams(allowed=4))
def test_through_the_proxy_a_responses_client_gets_the_upstream_items_less_the_proxys_calls(
        proxy: ProxyServer, upstream: ScriptedUpstream,
        case: tuple[list[Items], int, list[list[bytes]]]) -> None:
    rounds, _, streams = case
    upstream.script.clear()
    upstream.push(*({"raw_chunks": s} for s in streams))
    session = uuid.uuid4().hex
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-streams", max_retries=0,
                      default_headers={"X-Session-Id": session})
    tools = [{"type": "function", "name": t["function"]["name"], "strict": False,
              "parameters": {"type": "object"}} for t in CLIENT_TOOLS]
    stream: Any = c.responses.create(model="gpt-4o-mini", input="go", stream=True,
                                     tools=tools)  # type: ignore[arg-type]
    got = responses_as_read([event.model_dump(exclude_none=True) for event in stream])
    expected = [i for r in rounds for i in r.items if not is_mine(i)]
    assert got["items"] == expected
    assert got["indexes"] == list(range(len(expected)))
    final = got["events"][-1]["response"]
    assert final["output"] == expected
    assert final["usage"]["input_tokens"] == sum(r.usage for r in rounds)
    if expected:
        assert stored_answer(proxy, "sk-streams", session).get("items") == expected


# -- a stream the upstream cuts before its end ---------------------------------------------------

def cut_before(draw: Any, streams: list[list[bytes]], end: bytes) -> list[list[bytes]]:
    """The rounds with the last one cut somewhere before the event that ends its answer."""
    raw = b"".join(streams[-1])
    stop = raw.index(end)
    stop = raw.rindex(b"\n\n", 0, stop) + 2 if b"\n\n" in raw[:stop] else 0
    at = draw(st.integers(min_value=0, max_value=stop))
    return [*streams[:-1], [raw[:at]] if at else []]


def cut_short(wire: Any, streams: list[list[bytes]], max_rounds: int
              ) -> tuple[bytes, BaseException | None, list[Outcome]]:
    upstreams = [Bytes(r) for r in streams]
    asked: list[dict[str, Any]] = []
    outcomes: list[Outcome] = []

    async def send(body: dict[str, Any]) -> Any:
        asked.append(body)
        return upstreams[len(asked)]

    r = Rounds(wire, TOOLS, {"model": "m", "stream": True}, [{"role": "user", "content": "go"}],
               ToolRunner(TOOLS, [{"role": "user", "content": "go"}], ["k0"], 5), max_rounds,
               send, MAX_ANSWER)
    got: list[bytes] = []

    async def client() -> BaseException | None:
        first: Any = upstreams[0]
        try:
            async for b in answer_stream(r, first, {"model": "m"}, outcomes.append):
                got.append(b)
        except UpstreamBadReply as exc:
            return exc
        return None

    failed = asyncio.run(client())
    assert all(u.closed for u in upstreams[:len(asked) + 1])
    return b"".join(got), failed, outcomes


@settings(max_examples=EXAMPLES // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=chat_streams(), data=st.data())
def test_a_chat_stream_cut_before_its_end_is_an_error_not_an_answer(
        case: tuple[list[Answer], int, list[list[bytes]], bool], data: st.DataObject) -> None:
    rounds, max_rounds, streams, _ = case
    cut = cut_before(data.draw, streams, b'"finish_reason":"')
    raw, failed, outcomes = cut_short(ChatWire(), cut, max_rounds)
    # the cut is an error (the stream ended early, or its last event is not whole), never
    # an answer: nothing recorded, no end made up for the client
    assert isinstance(failed, UpstreamBadReply), failed
    assert outcomes == []
    assert b"[DONE]" not in raw and b'"finish_reason":"' not in raw  # no made-up end


@settings(max_examples=EXAMPLES // 2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=responses_streams(), data=st.data())
def test_a_responses_stream_cut_before_its_end_is_an_error_not_an_answer(
        case: tuple[list[Items], int, list[list[bytes]]], data: st.DataObject) -> None:
    rounds, max_rounds, streams = case
    cut = cut_before(data.draw, streams, b"event: response.completed")
    raw, failed, outcomes = cut_short(ResponsesWire(), cut, max_rounds)
    assert isinstance(failed, UpstreamBadReply), failed
    assert outcomes == [] and b"response.completed" not in raw


def test_a_stream_goes_out_as_a_stream(proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    """What tells every hop to pass the events on at once: the event-stream type, no
    caching, no buffering in a reverse proxy, no length."""
    import httpx

    body = {"model": "m", "stream": True, "tools": CLIENT_TOOLS,
            "messages": [{"role": "user", "content": "go"}]}
    with httpx.stream("POST", proxy.url + "/chat/completions", json=body,
                      headers={"Authorization": "Bearer sk-streams"}) as r:
        text = r.read().decode()
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
    assert "content-length" not in r.headers and text.endswith("data: [DONE]\n\n")
