"""A scripted OpenAI-compatible upstream: real HTTP and SSE, a fake LLM.

Used by the tests, the benchmarks and for trying the proxy without an API key
(``python -m runloop_proxy.scripted --port 9000``). Replies come from a queue of scripted
turns, else from a ``responder`` callable, else an echo of the last user message. Every request
it receives is kept for inspection; streams closed early are counted (client-disconnect tests).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

Reply = dict[str, Any]
_ids = itertools.count(1)


def _text(content: Any) -> str:
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    return max(1, len(orjson.dumps(body.get("messages", []))) // 4)


class ScriptedUpstream:
    def __init__(self) -> None:
        self.script: collections.deque[Reply] = collections.deque()
        self.responder: Callable[[dict[str, Any]], Reply] | None = None
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.raw_bodies: list[bytes] = []
        self.streams_started = 0
        self.streams_closed_early = 0
        self.abandoned = 0
        self.keep_requests = True
        self.delay = 0.0
        self.server: ThreadedServer | None = None
        self.port = 0

    # -- control ---------------------------------------------------------------------------

    def push(self, *replies: Reply) -> None:
        self.script.extend(replies)

    def reset(self) -> None:
        self.script.clear()
        self.responder = None
        self.requests.clear()
        self.headers.clear()
        self.raw_bodies.clear()
        self.streams_started = self.streams_closed_early = self.abandoned = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, port: int = 0) -> ScriptedUpstream:
        self.server = ThreadedServer(self.app(), lifespan="off")
        self.port = self.server.start(port)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    # -- the fake LLM ----------------------------------------------------------------------

    def next_reply(self, body: dict[str, Any]) -> Reply:
        if self.script:
            return self.script.popleft()
        if self.responder is not None:
            return self.responder(body)
        last_user: dict[str, Any] = next((m for m in reversed(body.get("messages", []))
                                          if m.get("role") == "user"), {})
        return {"content": f"echo: {_text(last_user.get('content'))[:200]}"}

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            raw = await request.body()
            body = orjson.loads(raw)
            if self.keep_requests:
                self.requests.append(body)
                self.raw_bodies.append(raw)
                self.headers.append(dict(request.headers))
            reply = self.next_reply(body)
            header = request.headers.get("x-scripted-delay-ms")
            delay = reply.get("delay", float(header) / 1000 if header else self.delay)
            if delay:
                await asyncio.sleep(delay)
                if await request.is_disconnected():
                    self.abandoned += 1  # the caller went away while the "model" thought
            if "status" in reply:
                return Response(orjson.dumps(reply.get("body") or {"error": {
                    "message": "scripted failure", "type": "server_error", "param": None,
                    "code": None}}), reply["status"], media_type="application/json",
                    headers=reply.get("headers"))
            if body.get("stream"):
                return StreamingResponse(self._stream(body, reply),
                                         media_type="text/event-stream")
            return Response(orjson.dumps(self._completion(body, reply)),
                            media_type="application/json")

        async def models(request: Request) -> Response:
            return Response(orjson.dumps({"object": "list", "data": [
                {"id": "gpt-4o-mini", "object": "model", "created": 0, "owned_by": "scripted"},
                {"id": "gpt-4o", "object": "model", "created": 0, "owned_by": "scripted"}]}),
                media_type="application/json")

        async def embeddings(request: Request) -> Response:
            body = await request.json()
            inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
            return Response(orjson.dumps({"object": "list", "model": body.get("model"),
                                          "data": [{"object": "embedding", "index": i,
                                                    "embedding": [0.1, 0.2, 0.3]}
                                                   for i, _ in enumerate(inputs)],
                                          "usage": {"prompt_tokens": 3, "total_tokens": 3}}),
                            media_type="application/json")

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                 Route("/v1/models", models), Route("/v1/embeddings",
                                                                    embeddings,
                                                                    methods=["POST"])])

    def _usage(self, body: dict[str, Any], reply: Reply) -> dict[str, Any]:
        prompt = reply.get("prompt_tokens") or estimate_prompt_tokens(body)
        completion = max(1, len(reply.get("content") or "") // 4)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": reply.get("cached_tokens", 0)}}

    def _completion(self, body: dict[str, Any], reply: Reply) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply.get("content"),
                                   "refusal": None, "annotations": []}
        if reply.get("tool_calls"):
            message["tool_calls"] = [_call(c) for c in reply["tool_calls"]]
        n = body.get("n") or 1
        finish = "tool_calls" if reply.get("tool_calls") else "stop"
        return {"id": f"chatcmpl-{next(_ids)}", "object": "chat.completion",
                "created": int(time.time()), "model": body.get("model"),
                "system_fingerprint": "fp_scripted",
                "choices": [{"index": i, "message": message, "logprobs": None,
                             "finish_reason": finish} for i in range(n)],
                "usage": self._usage(body, reply)}

    async def _stream(self, body: dict[str, Any], reply: Reply) -> AsyncIterator[bytes]:
        self.streams_started += 1
        done = False
        try:
            if "raw_chunks" in reply:
                for raw in reply["raw_chunks"]:
                    yield raw
                    await asyncio.sleep(reply.get("chunk_delay", 0))
                done = True
                return
            cid = f"chatcmpl-{next(_ids)}"
            base = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": body.get("model"), "system_fingerprint": "fp_scripted"}

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
                if reply.get("die_after") is not None and sent >= reply["die_after"]:
                    raise ConnectionAbortedError("scripted death mid-stream")
                await asyncio.sleep(reply.get("chunk_delay", 0))
                yield chunk({"content": piece})
                sent += 1
            for i, call in enumerate(reply.get("tool_calls") or []):
                c = _call(call)
                yield chunk({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                             "function": {"name": c["function"]["name"],
                                                          "arguments": ""}}]})
                args = c["function"]["arguments"]
                for j in range(0, len(args), 10):
                    yield chunk({"tool_calls": [{"index": i, "function":
                                                 {"arguments": args[j:j + 10]}}]})
            yield chunk({}, "tool_calls" if reply.get("tool_calls") else "stop")
            if (body.get("stream_options") or {}).get("include_usage"):
                yield b"data: " + orjson.dumps({**base, "choices": [],
                                                "usage": self._usage(body, reply)}) + b"\n\n"
            yield b"data: [DONE]\n\n"
            done = True
        finally:
            if not done:
                self.streams_closed_early += 1


class ThreadedServer:
    """An ASGI app under a real uvicorn server on a loopback port, in a daemon thread."""

    def __init__(self, app: Any, lifespan: Literal["auto", "on", "off"] = "on"):
        self.config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error",
                                     lifespan=lifespan, access_log=False)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, port: int = 0, timeout: float = 20) -> int:
        self.config.port = port
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    def stop(self, timeout: float = 15) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=timeout)


def _call(c: dict[str, Any]) -> dict[str, Any]:
    args = c.get("arguments", {})
    return {"id": c.get("id") or f"call_{next(_ids)}", "type": "function",
            "function": {"name": c["name"],
                         "arguments": args if isinstance(args, str)
                         else orjson.dumps(args).decode()}}


def main() -> None:
    parser = argparse.ArgumentParser(description="scripted OpenAI-compatible upstream (echo)")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="think time before every answer (an LLM is never instant)")
    args = parser.parse_args()
    up = ScriptedUpstream()
    up.keep_requests = False
    up.delay = args.delay_ms / 1000
    uvicorn.run(up.app(), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
