"""A scripted OpenAI-compatible upstream: real HTTP and SSE, a fake LLM.

Used by the tests, the benchmarks and for trying the proxy without an API key
(``python -m runloop_proxy.scripted --port 9000``). Replies come from a queue of scripted
turns, else from a ``responder`` callable, else an echo of the last user message. Every request
it receives is kept for inspection; streams closed early are counted (client-disconnect tests).
It takes time as a provider does (``latency``: a ``scripted_world.Latency`` per call kind,
every pause recorded in ``pauses``) and answers with ids shaped like the providers'. A
summary call (the proxy's own) is answered by default with a summary of what it was asked to
add (``scripted_summary``), and waits for ``summary_gate`` when one is set (an event: tests
hold the summariser slower than any gap between requests without hoping a sleep is long
enough).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import gzip
import hashlib
import itertools
import re
import socket
import sys
import threading
import time
from array import array
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any, Literal

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from . import scripted_messages as anthropic
from . import serving
from .config import ServerSection
from .conversation.items import to_messages, tool_to_chat
from .conversation.messages import Message, message_hash
from .environment import port_number
from .pipeline import encodings
from .pipeline.schemas import render_tools
from .pipeline.tokens import (
    FALLBACK_ENCODING,
    FRAME,
    REPLY_PRIMING,
    TOOLS_OVERHEAD,
    billed_tokens,
)
from .scripted_world import (
    EMBEDDING_DIM,
    CallKind,
    Latency,
    Pauses,
    chat_completion_id,
    ids_follow,
    is_summary_call,
    openai_call_id,
    responses_id,
    scripted_embedding,
    system_fingerprint,
)

Reply = dict[str, Any]
_ids = itertools.count(1)
GATE_LIMIT_S = 600.0  # a summary call held by a gate nobody opens answers after this


def scripted_summary(body: dict[str, Any]) -> Reply:
    """A summary call answered as a careful model would, deterministically: one line per
    turn it was asked to add (its number and its first words) and the identifiers those
    turns hold (words with a digit in them, verbatim), within the tokens it was allowed
    (about four characters a token)."""
    prompt = _text(body["messages"][0].get("content"))
    turns = prompt.rsplit("Turns to add:", 1)[-1]
    lines, ids, seen = [], [], set()
    for m in re.finditer(r"\[turn (\d+)\]\n(?:user: )?([^\n]*)", turns):
        lines.append(f"- turn {m.group(1)}: {m.group(2)[:60]}")
    for tok in re.findall(r"[#\w][\w#./:-]*\d[\w#./:-]*", turns):
        tok = tok.rstrip(".:")
        if tok not in seen and not tok.startswith(("call_", "turn")):
            seen.add(tok)
            ids.append(tok)
    limit = int(body.get("max_tokens") or 1000) * 4
    text = "\n".join(["Goals and facts:", *lines, "Identifiers: " + " ".join(ids)])
    return {"content": text[:limit]}


def _text(content: Any) -> str:
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    return max(1, len(orjson.dumps(body.get("messages", []))) // 4)


class PromptCache:
    """OpenAI's prompt caching, simulated: when a prompt begins with tokens an earlier prompt
    began with, that shared start — in 128-token blocks, from 1,024 tokens on — is served from
    the cache, and ``usage.prompt_tokens_details.cached_tokens`` says how much. The prompt is
    tokenised as the API bills it (``tokens.billed_tokens``, cl100k): the system messages, the
    tool schemas, the other messages, the reply priming — so its ``prompt_tokens`` are what the
    proxy counts, and a proxy calibrating against it keeps a factor of 1."""

    MIN, BLOCK = 1024, 128

    def __init__(self, capacity: int = 1_000_000):
        self.enc = encodings.load(FALLBACK_ENCODING)
        self.capacity = capacity
        self._blocks: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._parts: collections.OrderedDict[bytes, list[int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _part(self, key: bytes, make: Callable[[], list[int]]) -> list[int]:
        hit = self._parts.get(key)
        if hit is None:
            hit = self._parts[key] = make()
            if len(self._parts) > 50_000:
                self._parts.popitem(last=False)
        return hit

    def tokens(self, body: dict[str, Any]) -> list[int]:
        msgs = body.get("messages") or []
        pre = 0
        while pre < len(msgs) and msgs[pre].get("role") in ("system", "developer"):
            pre += 1
        out: list[int] = []
        for m in msgs[:pre]:
            out += self._message(m)
        if body.get("tools"):
            text = render_tools(body["tools"])
            out += self._part(hashlib.blake2b(text.encode(), digest_size=16).digest(),
                              lambda: [FRAME] * TOOLS_OVERHEAD + self.enc.encode_ordinary(text))
        for m in msgs[pre:]:
            out += self._message(m)
        return out + [FRAME] * REPLY_PRIMING

    def _message(self, m: Message) -> list[int]:
        return self._part(message_hash(m).encode(), partial(billed_tokens, self.enc, m))

    def usage(self, body: dict[str, Any], org: str = "") -> tuple[int, int]:
        """(prompt tokens, of which cached); the prompt's blocks are cached from now on, for
        its organization only, as a provider's cache is (``OpenAI-Organization``, or the
        ``X-Scripted-Cache-Scope`` a measurement sets to keep its two sides apart)."""
        tokens = self.tokens(body)
        data = array("I", tokens).tobytes()
        h = hashlib.blake2b(key=org.encode()[:64], digest_size=16)
        keys = []
        for end in range(self.BLOCK, len(tokens) + 1, self.BLOCK):
            h.update(data[(end - self.BLOCK) * 4: end * 4])
            if end >= self.MIN:
                keys.append((end, h.digest()))  # the digest covers the whole prefix
        with self._lock:
            cached = max((end for end, k in keys if k in self._blocks), default=0)
            for _, k in keys:
                self._blocks[k] = None
                self._blocks.move_to_end(k)
            while len(self._blocks) > self.capacity:
                self._blocks.popitem(last=False)
        return len(tokens), cached


class ScriptedUpstream:
    def __init__(self, prompt_cache: bool = False) -> None:
        self.prompt_cache = PromptCache() if prompt_cache else None
        # ids drawn from the request answered, not from the process's count: a test comparing
        # two runs byte for byte gets the same ids for the same request
        self.ids_by_request = False
        self.script: collections.deque[Reply] = collections.deque()
        self.responder: Callable[[dict[str, Any]], Reply] | None = None
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.raw_bodies: list[bytes] = []
        # every other request: (method, raw path with its query, headers, body as received)
        self.other: list[tuple[str, str, dict[str, str], bytes]] = []
        self.streams_started = 0
        self.streams_closed_early = 0
        self.abandoned = 0
        self.keep_requests = True
        self.latency = Latency()
        self.pauses = Pauses()
        self.fingerprint = system_fingerprint()
        # headers added to every answer, as a provider's are (its account, its key's rate
        # limits, its edge's cookies): what a proxy relays of them is the client's to see
        self.answer_headers: list[tuple[str, str]] = []
        self.summary_gate: threading.Event | None = None  # set: summary calls may answer
        self.summary_calls = 0  # summary calls received
        self.summaries_answered = 0  # and answered
        self.embedded = 0  # embeddings calls received
        # each embeddings call: its headers and body (the inputs, the model)
        self.embedding_calls: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.embedding_dim = EMBEDDING_DIM
        self.embeddings_fail: int | None = None  # a status every embeddings call answers
        self.server: ThreadedServer | None = None
        self.port = 0
        self._anthropic: anthropic.AnthropicCache | None = None

    # -- control ---------------------------------------------------------------------------

    def push(self, *replies: Reply) -> None:
        self.script.extend(replies)

    def reset(self) -> None:
        self.script.clear()
        self.responder = None
        self.requests.clear()
        self.headers.clear()
        self.raw_bodies.clear()
        self.other.clear()
        self.streams_started = self.streams_closed_early = self.abandoned = 0
        self.keep_requests = True
        self.answer_headers = []
        self.latency = Latency()
        self.pauses.clear()
        self.summary_gate = None
        self.summary_calls = self.summaries_answered = self.embedded = 0
        self.embedding_calls = []
        self.embedding_dim = EMBEDDING_DIM
        self.embeddings_fail = None

    @property
    def delay(self) -> float:
        """The think time before every answer (``latency.first_byte``)."""
        return self.latency.first_byte

    @delay.setter
    def delay(self, seconds: float) -> None:
        self.latency = dataclasses.replace(self.latency, first_byte=seconds)

    async def pause(self, kind: CallKind, seconds: float) -> None:
        """Wait ``seconds`` as a call of ``kind`` (recorded in ``pauses``)."""
        if seconds > 0:
            self.pauses.add(kind, seconds)
            await asyncio.sleep(seconds)

    async def paced(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """``events`` with ``latency.between_events`` between every two of them."""
        first = True
        async for data in events:
            if not first:
                await self.pause("between_events", self.latency.between_events)
            first = False
            yield data

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, port: int = 0) -> ScriptedUpstream:
        self.server = ThreadedServer(self._with_answer_headers(self.app()), lifespan="off")
        self.port = self.server.start(port)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def _with_answer_headers(self, app: Starlette) -> Any:
        async def wrapped(scope: Any, receive: Any, send: Any) -> None:
            async def sending(message: Any) -> None:
                if message["type"] == "http.response.start" and self.answer_headers:
                    message = {**message, "headers": [
                        *message.get("headers", []),
                        *((k.lower().encode("latin-1"), v.encode("latin-1"))
                          for k, v in self.answer_headers)]}
                await send(message)
            await app(scope, receive, sending)
        return wrapped

    # -- the fake LLM ----------------------------------------------------------------------

    def next_reply(self, body: dict[str, Any]) -> Reply:
        if self.script:
            return self.script.popleft()
        if self.responder is not None:
            return self.responder(body)
        messages = body.get("messages") if "input" not in body else _as_chat(body)["messages"]
        if "input" not in body and is_summary_call(body):
            return scripted_summary(body)
        last_user: dict[str, Any] = next((m for m in reversed(messages or [])
                                          if m.get("role") == "user"), {})
        return {"content": f"echo: {_text(last_user.get('content'))[:200]}"}

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            raw = await request.body()
            try:
                return await answer(request, raw)
            except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError,
                    ValueError) as exc:
                # as a real API would: a request it cannot read is the client's error
                return Response(orjson.dumps({"error": {
                    "message": f"the scripted upstream cannot read this request: {exc}",
                    "type": "invalid_request_error", "param": None, "code": None}}), 400,
                    media_type="application/json")

        async def answer(request: Request, raw: bytes) -> Response:
            responses = request.url.path.endswith("/responses")
            body = orjson.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body is not an object")
            if self.ids_by_request:
                ids_follow(raw)
            if self.keep_requests:
                self.requests.append(body)
                self.raw_bodies.append(raw)
                self.headers.append(dict(request.headers))
            bad = anthropic.bad_signature(body) if request.url.path.endswith("/messages") \
                else None
            if bad is not None:  # Anthropic refuses a changed thinking block before thinking
                return Response(orjson.dumps(anthropic.error(400, "invalid_request_error", bad)),
                                400, media_type="application/json")
            summary = not responses and is_summary_call(body)
            if summary:
                self.summary_calls += 1
                gate = self.summary_gate
                if gate is not None and not gate.is_set():
                    await asyncio.to_thread(gate.wait, GATE_LIMIT_S)
            reply = self.next_reply(body)
            if summary:
                self.summaries_answered += 1
            if request.headers.get("x-scripted-unique-replies") and "content" in reply:
                # every answer different, as a real model's are (nothing cached by content)
                reply = {**reply, "content": f"{reply['content']} #{next(_ids)}"}
            org = request.headers.get("x-scripted-cache-scope") or \
                request.headers.get("openai-organization", "")
            header = request.headers.get("x-scripted-delay-ms")
            kind: CallKind = "summary" if summary else "first_byte"
            wait = self.latency.summary if summary else self.latency.first_byte
            delay = reply.get("delay", float(header) / 1000 if header else wait)
            if delay:
                await self.pause(kind, delay)
                if await request.is_disconnected():
                    self.abandoned += 1  # the caller went away while the "model" thought
            if "status" in reply:
                return Response(orjson.dumps(reply.get("body") or {"error": {
                    "message": "scripted failure", "type": "server_error", "param": None,
                    "code": None}}), reply["status"], media_type="application/json",
                    headers=reply.get("headers"))
            if "raw_body" in reply:
                return _raw(reply)
            if request.url.path.endswith("/messages"):
                return self._messages(body, reply, org or request.headers.get("x-api-key", ""))
            if responses:
                if body.get("stream"):
                    return StreamingResponse(
                        self.paced(cut_stream(self._response_events(body, reply, org), reply,
                                              "responses")),
                        media_type="text/event-stream")
                return Response(orjson.dumps(self._response(body, reply, org)),
                                media_type="application/json")
            if body.get("stream"):
                return StreamingResponse(self.paced(cut_stream(self._stream(body, reply, org),
                                                               reply, "chat")),
                                         media_type="text/event-stream")
            return Response(orjson.dumps(self._completion(body, reply, org)),
                            media_type="application/json")

        async def count_tokens(request: Request) -> Response:
            body = orjson.loads(await request.body())
            self.other.append(("POST", request.url.path, dict(request.headers),
                               orjson.dumps(body)))
            await self.pause("count_tokens", self.latency.count_tokens)
            return Response(orjson.dumps({"input_tokens": self.anthropic.tokens(body)}),
                            media_type="application/json")

        async def models(request: Request) -> Response:
            return Response(orjson.dumps({"object": "list", "data": [
                {"id": "gpt-4o-mini", "object": "model", "created": 0, "owned_by": "scripted"},
                {"id": "gpt-4o", "object": "model", "created": 0, "owned_by": "scripted"}]}),
                media_type="application/json")

        async def embeddings(request: Request) -> Response:
            raw = await request.body()
            if request.headers.get("content-encoding") == "gzip":
                raw = gzip.decompress(raw)  # as APIs that take compressed bodies do
            body = orjson.loads(raw)
            inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
            self.embedded += 1
            if self.keep_requests:
                self.embedding_calls.append((dict(request.headers), body))
            if header := request.headers.get("x-scripted-delay-ms"):  # a slow one, held
                await self.pause("first_byte", float(header) / 1000)
            else:
                await self.pause("embeddings", self.latency.embeddings)
            if self.embeddings_fail is not None:
                return Response(orjson.dumps({"error": {
                    "message": "The server had an error while processing your request.",
                    "type": "server_error", "param": None, "code": None}}),
                    self.embeddings_fail, media_type="application/json")
            # usage as OpenAI counts it: the inputs' tokens (here, their words)
            tokens = sum(max(1, len(str(t).split())) for t in inputs)
            return Response(orjson.dumps({"object": "list", "model": body.get("model"),
                                          "data": [{"object": "embedding", "index": i,
                                                    "embedding": scripted_embedding(
                                                        str(t), self.embedding_dim)}
                                                   for i, t in enumerate(inputs)],
                                          "usage": {"prompt_tokens": tokens,
                                                    "total_tokens": tokens}}),
                            media_type="application/json")

        async def anything(request: Request) -> Response:
            path = request.scope["raw_path"].decode("latin-1")
            query = request.scope["query_string"].decode("latin-1")
            self.other.append((request.method, path + (f"?{query}" if query else ""),
                               dict(request.headers), await request.body()))
            if self.script and "raw_body" in self.script[0]:
                return _raw(self.script.popleft())
            return Response(orjson.dumps({"error": {
                "message": f"no route {request.method} {path}", "type": "invalid_request_error",
                "param": None, "code": "unknown_url"}}), 404, media_type="application/json")

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                 Route("/v1/responses", chat, methods=["POST"]),
                                 Route("/v1/messages", chat, methods=["POST"]),
                                 Route("/v1/messages/count_tokens", count_tokens,
                                       methods=["POST"]),
                                 Route("/v1/models", models), Route("/v1/embeddings",
                                                                    embeddings,
                                                                    methods=["POST"]),
                                 Route("/{path:path}", anything, methods=[
                                     "GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])])

    @property
    def anthropic(self) -> anthropic.AnthropicCache:
        if self._anthropic is None:
            self._anthropic = anthropic.AnthropicCache()
        return self._anthropic

    def _messages(self, body: dict[str, Any], reply: Reply, scope: str) -> Response:
        """An answer of the Messages API (Anthropic's), in JSON or as its event stream."""
        usage = self.anthropic.usage(body, scope)
        if reply.get("prompt_tokens") is not None:
            usage["input_tokens"] = reply["prompt_tokens"]
        if not body.get("stream"):
            return Response(orjson.dumps(anthropic.message(body, reply, usage)),
                            media_type="application/json")

        async def stream() -> AsyncIterator[bytes]:
            self.streams_started += 1
            done = False
            try:
                for chunk in anthropic.events(body, reply, usage):
                    await asyncio.sleep(reply.get("chunk_delay", 0))
                    yield chunk
                done = True
            finally:
                if not done:
                    self.streams_closed_early += 1
        return StreamingResponse(self.paced(cut_stream(stream(), reply, "messages")),
                                 media_type="text/event-stream")

    def _usage(self, body: dict[str, Any], reply: Reply, org: str) -> dict[str, Any]:
        prompt, cached = estimate_prompt_tokens(body), 0
        if self.prompt_cache is not None:
            prompt, cached = self.prompt_cache.usage(body, org)
        prompt = reply.get("prompt_tokens") or prompt
        cached = reply.get("cached_tokens", cached)
        completion = max(1, len(reply.get("content") or "") // 4)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _completion(self, body: dict[str, Any], reply: Reply, org: str
                    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply.get("content"),
                                   "refusal": None, "annotations": []}
        if reply.get("tool_calls"):
            message["tool_calls"] = [_call(c) for c in reply["tool_calls"]]
        n = body.get("n")
        n = n if isinstance(n, int) and 0 < n <= 128 else 1
        finish = "tool_calls" if reply.get("tool_calls") else "stop"
        return {"id": chat_completion_id(), "object": "chat.completion",
                "created": int(time.time()), "model": body.get("model"),
                "system_fingerprint": self.fingerprint,
                "choices": [{"index": i, "message": message, "logprobs": None,
                             "finish_reason": finish} for i in range(n)],
                "usage": self._usage(body, reply, org)}

    def _response(self, body: dict[str, Any], reply: Reply, org: str,
                  status: str = "completed") -> dict[str, Any]:
        """A Responses API answer: the reply's reasoning, text and calls as output items."""
        usage = self._usage(_as_chat(body), reply, org)
        return {"id": reply.get("response_id") or responses_id("resp_"), "object": "response",
                "created_at": int(time.time()), "status": status, "error": None,
                "incomplete_details": None, "instructions": body.get("instructions"),
                "model": body.get("model"), "output": _output_items(reply),
                "parallel_tool_calls": body.get("parallel_tool_calls", True),
                "previous_response_id": body.get("previous_response_id"),
                "store": body.get("store", True), "temperature": 1.0, "top_p": 1.0,
                "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools", []),
                "text": {"format": {"type": "text"}}, "truncation": "disabled",
                "metadata": body.get("metadata") or {},
                "usage": {"input_tokens": usage["prompt_tokens"],
                          "input_tokens_details": {
                              "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                          "output_tokens": usage["completion_tokens"],
                          "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": usage["total_tokens"]}}

    async def _response_events(self, body: dict[str, Any], reply: Reply, org: str
                               ) -> AsyncIterator[bytes]:
        """The Responses API's event stream for one answer, as OpenAI sends it."""
        self.streams_started += 1
        seq = itertools.count()
        done = False

        def event(data: dict[str, Any]) -> bytes:
            data["sequence_number"] = next(seq)
            return b"event: " + str(data["type"]).encode() + b"\ndata: " \
                + orjson.dumps(data) + b"\n\n"

        try:
            if "raw_chunks" in reply:  # exactly these bytes, whatever they are
                for raw in reply["raw_chunks"]:
                    yield raw
                done = True
                return
            final = self._response(body, reply, org)
            start = {**final, "status": "in_progress", "output": [], "usage": None}
            yield event({"type": "response.created", "response": start})
            yield event({"type": "response.in_progress", "response": start})
            for at, item in enumerate(final["output"]):
                if reply.get("die_after") is not None and at >= reply["die_after"]:
                    raise ConnectionAbortedError("scripted death mid-stream")
                await asyncio.sleep(reply.get("chunk_delay", 0))
                for data in _item_events(at, item):
                    yield event(data)
            yield event({"type": "response.completed", "response": final})
            done = True
        finally:
            if not done:
                self.streams_closed_early += 1

    async def _stream(self, body: dict[str, Any], reply: Reply, org: str
                      ) -> AsyncIterator[bytes]:
        self.streams_started += 1
        done = False
        try:
            if "raw_chunks" in reply:
                for raw in reply["raw_chunks"]:
                    yield raw
                    await asyncio.sleep(reply.get("chunk_delay", 0))
                done = True
                return
            cid = chat_completion_id()
            base = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": body.get("model"), "system_fingerprint": self.fingerprint}

            def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
                obj = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                            "finish_reason": finish}]}
                return b"data: " + orjson.dumps(obj) + b"\n\n"

            pieces = reply.get("pieces")
            content = reply.get("content") or ""
            if pieces is None:
                pieces = [content[i:i + 8] for i in range(0, len(content), 8)] if content else []
            yield chunk({"role": "assistant", "content": "", "refusal": None})
            sent = 0
            for piece in pieces:
                await asyncio.sleep(reply.get("chunk_delay", 0))
                if reply.get("die_after") is not None and sent >= reply["die_after"]:
                    raise ConnectionAbortedError("scripted death mid-stream")
                yield chunk({"content": piece})
                sent += 1
            for i, call in enumerate(reply.get("tool_calls") or []):
                c = _call(call)
                name, cut = c["function"]["name"], reply.get("name_pieces")
                if cut:  # the id alone, then the name in pieces (as some providers stream)
                    yield chunk({"tool_calls": [{"index": i, "id": c["id"], "type": "function"}]})
                    for j in range(0, len(name), cut):
                        yield chunk({"tool_calls": [{"index": i, "function":
                                                     {"name": name[j:j + cut]}}]})
                else:
                    yield chunk({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                                 "function": {"name": name, "arguments": ""}}]})
                args = c["function"]["arguments"]
                for j in range(0, len(args), 10):
                    yield chunk({"tool_calls": [{"index": i, "function":
                                                 {"arguments": args[j:j + 10]}}]})
            yield chunk({}, "tool_calls" if reply.get("tool_calls") else "stop")
            if (body.get("stream_options") or {}).get("include_usage"):
                yield b"data: " + orjson.dumps({**base, "choices": [],
                                                "usage": self._usage(body, reply, org)}) + b"\n\n"
            yield b"data: [DONE]\n\n"
            done = True
        finally:
            if not done:
                self.streams_closed_early += 1


class ThreadedServer:
    """An ASGI app under a real uvicorn server on a loopback port, in a daemon thread."""

    def __init__(self, app: Any, lifespan: Literal["auto", "on", "off"] = "on",
                 server: ServerSection | None = None):
        # the proxy runs as it runs in production (serving's protocol and deadlines); the
        # scripted upstream under uvicorn's defaults
        self.config = serving.server_config(app, server, host="127.0.0.1", port=0,
                                            log_level="error", lifespan=lifespan) \
            if server is not None else \
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error",
                           lifespan=lifespan, access_log=False)
        self.server = uvicorn.Server(self.config)
        self.thread: threading.Thread | None = None

    def start(self, port: int = 0, timeout: float = 20, sock: socket.socket | None = None
              ) -> int:
        """Serve on ``port``, or on ``sock`` (``serving.listen``'s) when given; the port."""
        self.config.port = port
        self.thread = threading.Thread(target=self.server.run, daemon=True,
                                       kwargs={"sockets": [sock] if sock else None})
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    def stop(self, timeout: float = 15) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=timeout)


def calls_chunk(calls: int, name: str = "look") -> bytes:
    """One chat-completions stream chunk (an SSE event) carrying ``calls`` tool calls: what a
    hostile or broken upstream may send (``bench/hostile.py``, the tests), as ``raw_chunks``."""
    return b"data: " + orjson.dumps({
        "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "gpt-4o",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "delta": {
            "role": "assistant", "tool_calls": [
                {"index": i, "id": f"call_{i}", "type": "function",
                 "function": {"name": name, "arguments": "{}"}} for i in range(calls)]}}]}) \
        + b"\n\n"


# what each API's upstream sends when it fails mid-stream (OpenAI's chat chunk of an error,
# the Responses API's error event, Anthropic's overloaded_error)
STREAM_ERRORS = {
    "chat": b"data: " + orjson.dumps({"error": {
        "message": "The server is overloaded, please try again later.",
        "type": "server_error", "param": None, "code": "server_overloaded"}}) + b"\n\n",
    "responses": b"event: error\ndata: " + orjson.dumps({
        "type": "error", "code": "server_error", "param": None, "sequence_number": 999,
        "message": "An error occurred while processing your request."}) + b"\n\n",
    "messages": b"event: error\ndata: " + orjson.dumps({"type": "error", "error": {
        "type": "overloaded_error", "message": "Overloaded"}}) + b"\n\n",
}
CUTS = ("error", "drop", "end")


async def cut_stream(stream: AsyncIterator[bytes], reply: Reply, api: str
                     ) -> AsyncIterator[bytes]:
    """A stream as scripted, or (``cut``: ``{"after": N, "how": ...}``) its first N events
    (N < 0: all but its last -N, the end marker among them) and then a fault: ``error`` the
    API's own error event, ``drop`` the connection breaks, ``end`` the stream just stops (no
    end marker, no error)."""
    cut = reply.get("cut")
    if not cut:
        async for raw in stream:
            yield raw
        return
    after: int = cut["after"]
    held: collections.deque[bytes] = collections.deque()
    sent = 0
    async for raw in stream:
        if after >= 0:
            if sent >= after:
                break
            yield raw
            sent += 1
            continue
        held.append(raw)
        if len(held) > -after:
            yield held.popleft()
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
    if cut["how"] == "error":
        yield STREAM_ERRORS[api]
    elif cut["how"] == "drop":
        raise ConnectionAbortedError("scripted death mid-stream")


def _raw(reply: Reply) -> Response:
    """Exactly ``raw_body``'s bytes, whatever they are, with ``headers`` (a
    ``Content-Encoding: gzip`` for a body given compressed); ``cut_after``: the headers
    promise the whole body, the bytes stop there and, after ``hang`` seconds, the connection
    breaks (an answer cut part-way)."""
    data: bytes = reply["raw_body"]
    headers = dict(reply.get("headers") or {})
    cut = reply.get("cut_after")
    if cut is None:
        return Response(data, 200, media_type="application/json", headers=headers)

    async def cut_short() -> AsyncIterator[bytes]:
        yield data[:cut]
        await asyncio.sleep(reply.get("hang", 0))
        raise ConnectionAbortedError("scripted death mid-body")

    return StreamingResponse(cut_short(), 200, media_type="application/json",
                             headers={**headers, "Content-Length": str(len(data))})


def _call(c: dict[str, Any]) -> dict[str, Any]:
    args = c.get("arguments", {})
    return {"id": c.get("id") or openai_call_id(), "type": "function",
            "function": {"name": c["name"],
                         "arguments": args if isinstance(args, str)
                         else orjson.dumps(args).decode()}}


def _as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses request as the chat request it amounts to (for counting its tokens)."""
    if "input" not in body:
        return body
    messages = [{k: v for k, v in m.items() if k not in ("items", "instructions")}
                for m in to_messages(body.get("input"), body.get("instructions"))]
    tools = [tool_to_chat(t) for t in body.get("tools") or [] if isinstance(t, dict)]
    return {"messages": messages, **({"tools": tools} if tools else {})}


def _output_items(reply: Reply) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if reply.get("reasoning") is not None:
        out.append({"type": "reasoning", "id": responses_id("rs_"), "summary": [],
                    "encrypted_content": reply["reasoning"]})
    if reply.get("content"):
        out.append({"type": "message", "id": responses_id("msg_"), "status": "completed",
                    "role": "assistant", "content": [{"type": "output_text", "annotations": [],
                                                      "logprobs": [],
                                                      "text": reply["content"]}]})
    for c in reply.get("tool_calls") or []:
        call = _call(c)
        if c.get("custom"):
            out.append({"type": "custom_tool_call", "id": responses_id("ctc_"),
                        "status": "completed", "call_id": call["id"],
                        "name": call["function"]["name"], "input": call["function"]["arguments"]})
        else:
            out.append({"type": "function_call", "id": responses_id("fc_"),
                        "status": "completed", "call_id": call["id"],
                        "name": call["function"]["name"],
                        "arguments": call["function"]["arguments"]})
    return out


def _item_events(at: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    """The events that stream one output item: added, its deltas, done."""
    kind = item["type"]
    events: list[dict[str, Any]] = []
    if kind == "message":
        events.append({"type": "response.output_item.added", "output_index": at,
                       "item": {**item, "status": "in_progress", "content": []}})
        text = item["content"][0]["text"]
        part = {"type": "output_text", "annotations": [], "text": ""}
        ids = {"item_id": item["id"], "output_index": at, "content_index": 0}
        events.append({"type": "response.content_part.added", **ids, "part": part})
        events += [{"type": "response.output_text.delta", **ids, "delta": text[i:i + 8],
                    "logprobs": []} for i in range(0, len(text), 8)]
        events.append({"type": "response.output_text.done", **ids, "text": text,
                       "logprobs": []})
        events.append({"type": "response.content_part.done", **ids,
                       "part": {**part, "text": text}})
    elif kind == "function_call":
        events.append({"type": "response.output_item.added", "output_index": at,
                       "item": {**item, "status": "in_progress", "arguments": ""}})
        args = item["arguments"]
        ids = {"item_id": item["id"], "output_index": at}
        events += [{"type": "response.function_call_arguments.delta", **ids,
                    "delta": args[i:i + 10]} for i in range(0, len(args), 10)]
        events.append({"type": "response.function_call_arguments.done", **ids,
                       "arguments": args})
    else:
        events.append({"type": "response.output_item.added", "output_index": at,
                       "item": item})
    events.append({"type": "response.output_item.done", "output_index": at, "item": item})
    return events


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m runloop_proxy.scripted",
                                     description="scripted OpenAI-compatible upstream (echo)")
    parser.add_argument("--port", type=port_number, default=9000)
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="think time before every answer (an LLM is never instant)")
    parser.add_argument("--between-events-ms", type=float, default=0.0,
                        help="pause between two events of a stream")
    parser.add_argument("--summary-ms", type=float, default=0.0,
                        help="think time before answering the proxy's summary calls "
                             "(instead of --delay-ms)")
    parser.add_argument("--count-tokens-ms", type=float, default=0.0,
                        help="think time before /v1/messages/count_tokens answers")
    parser.add_argument("--prompt-cache", action="store_true",
                        help="count prompt tokens with tiktoken and report cached_tokens the "
                             "way OpenAI's prefix cache would")
    args = parser.parse_args()
    try:
        sock = serving.listen("127.0.0.1", args.port)
    except OSError as exc:
        print(serving.cannot_listen("127.0.0.1", args.port, exc), file=sys.stderr)
        return 1
    up = ScriptedUpstream(prompt_cache=args.prompt_cache)
    up.keep_requests = False
    for ms in (args.delay_ms, args.between_events_ms, args.summary_ms, args.count_tokens_ms):
        if ms < 0:
            parser.error("a latency is milliseconds >= 0")
    up.latency = Latency(first_byte=args.delay_ms / 1000,
                         between_events=args.between_events_ms / 1000,
                         summary=args.summary_ms / 1000,
                         count_tokens=args.count_tokens_ms / 1000)
    print(f"scripted upstream listening on {serving.address(sock)}/v1", flush=True)
    with sock:
        uvicorn.Server(uvicorn.Config(up.app(), log_level="warning", access_log=False)).run(
            sockets=[sock])
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
