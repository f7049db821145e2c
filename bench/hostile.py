"""Hostile bodies vs everyone else: the worst stall each one causes (while it is served,
and for half a second after: the work it leaves behind, its history written, counts too).

    python bench/hostile.py [--only NAME ...] [--json]

Starts `runloop-proxy serve` (embedded Redis) as its own process in front of a scripted
upstream (in this process, so it can be told what to answer), then sends a corpus of small
hostile requests one at a time — nested tool schemas, many tools, many parts and messages,
long texts that are a tokenizer's worst case, deep tool outputs, a model's huge search
query, a compressed answer that inflates a thousandfold — while a second client polls
`/healthz` every few milliseconds on its own connection. For each body it prints its size,
the proxy's answer and how long it took, and the slowest `/healthz` answered meanwhile: the
stall it caused everyone else. The goal is no stall above 100 ms for any body under 1 MiB.
Stalls are times on a shared machine: read them against the baseline row (a plain request).
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import orjson

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from runloop_proxy.scripted import ScriptedUpstream, calls_chunk  # noqa: E402
from tests.keys import anthropic_key, jwt, openai_project_key  # noqa: E402

KEY = "sk-hostile"
MESSAGES = "_messages"  # a corpus entry for /v1/messages (the key is not sent)
HEADERS = "_headers"  # a corpus entry's own headers (not sent in the body)
GET = "_get"  # a corpus entry that is a GET of this path (through the pass-through)
# turns that share one named session whose history the proxy supplies: each later one brings
# the stored conversation's work too, whatever its own size
SERVER_HISTORY = {"X-Session-Id": "grown", "X-Runloop-History": "server"}
MiB = 1 << 20
AFTER_S = 0.5  # a request's stall is watched this long after its answer too


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o", "messages": messages, **extra}


def user(text: Any) -> dict[str, Any]:
    return {"role": "user", "content": text}


def tool_fn(name: str, params: dict[str, Any], description: str = "") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": params}}


def nested_kinds(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": ["array", "array", "array", "null"], "items": schema}
    return {"type": "object", "properties": {"x": schema}}


def nested(depth: int, wrap: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """A schema of ``depth`` levels of ``wrap`` around a string, under one property."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = wrap(schema)
    return {"type": "object", "properties": {"x": schema}}


# one piece the tokenizer cannot split (no space, no punctuation), in a body under the size
# that leaves the event loop: tiktoken up to 0.12 merges a piece in time quadratic in its
# length (40,000 CJK characters: seconds), whatever the rest of the request
ONE_PIECE = "字" * 40_000


def session(steps: int, result: Callable[[int], str]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."},
                                  user("start")]
    for k in range(steps):
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{k}", "type": "function",
             "function": {"name": "look", "arguments": json.dumps({"q": f"item {k}"})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{k}", "content": result(k)})
    return msgs


LOOK = [tool_fn("look", {"type": "object", "properties": {"q": {"type": "string"}}})]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def uuids(n: int) -> list[str]:
    return [str(uuid.UUID(int=k * 7919 + 1)) for k in range(n)]


def uuid_events(n: int) -> list[bytes]:
    """A chat stream of ``n`` events, a UUID in each (ids a key's alphabet covers)."""
    return [b'data: {"id":"chatcmpl-h","object":"chat.completion.chunk","created":0,'
            b'"model":"gpt-4o","choices":[{"index":0,"delta":{"content":"' + u.encode()
            + b' "},"finish_reason":null}]}\n\n' for u in uuids(n)] + [b"data: [DONE]\n\n"]


def download(size: int) -> bytes:
    """A file's content as an API stores one: JSON lines of ids, hashes and base64."""
    lines = []
    for k in range(size // 160 + 1):
        lines.append(orjson.dumps({"id": f"file-{k:024x}", "sha256": f"{k * 2654435761:064x}",
                                   "blob": base64.b64encode(k.to_bytes(32, "big")).decode()}))
    return b"\n".join(lines)[:size]


def long_keys() -> list[tuple[str, dict[str, Any], dict[str, Any] | None]]:
    """Answers read with credentials of real lengths, which the proxy masks in them (a
    164-character OpenAI project key, a 108-character Anthropic key, a 2 KB JWT), and a
    credential no one should send (60 KB: refused before anything is sent)."""
    rows: list[tuple[str, dict[str, Any], dict[str, Any] | None]] = []
    for name, key in (("10-char key", KEY), ("164-char key", openai_project_key()),
                      ("2 KB JWT", jwt()), ("108-char key", anthropic_key())):
        rows += [
            (f"long key: 3,000 UUIDs in an answer ({name})",
             chat([user("list them")], **{HEADERS: bearer(key)}),
             {"content": " ".join(uuids(3000))}),
            (f"long key: a stream of 3,000 events ({name})",
             chat([user("list them")], stream=True, **{HEADERS: bearer(key)}),
             {"raw_chunks": uuid_events(3000)}),
            (f"long key: the key quoted in 1,000 lines ({name})",
             chat([user("echo")], **{HEADERS: bearer(key)}),
             {"content": "\n".join(f"line {k}: bad key {key}" for k in range(1000))}),
        ]
    rows += [
        ("long key: a 2.3 MB download through pass-through (164-char key)",
         {GET: "/v1/files/file-hostile/content", HEADERS: bearer(openai_project_key())},
         {"raw_body": download(2_300_000)}),
        ("long key: a 900 KB download through pass-through (2 KB JWT)",
         {GET: "/v1/files/file-hostile/content", HEADERS: bearer(jwt())},
         {"raw_body": download(900_000)}),
        ("pass-through: a 60 KB x-api-key", {
            GET: "/v1/models", HEADERS: {"Authorization": "", "x-api-key": "k" * 60_000}}, None),
    ]
    return rows


def corpus() -> list[tuple[str, dict[str, Any], dict[str, Any] | None]]:
    """(name, request body, what the scripted upstream answers first, if not an echo)."""
    deep_json = "[" * 5000 + "]" * 5000
    ids = " ".join(f"ORD-{i:07d} /srv/app/f{i}.py v{i}.{i % 7}" for i in range(20_000))
    gz = gzip.compress(orjson.dumps({"id": "x", "object": "chat.completion", "model": "m",
                                     "choices": [{"index": 0, "finish_reason": "stop",
                                                  "message": {"role": "assistant",
                                                              "content": "z" * (100 * MiB)}}]}),
                       9)
    return [
        ("baseline: a plain request", chat([user("hello")]), None),
        ("tool schema: type lists nested 13 deep", chat([user("hi")], tools=[
            tool_fn("f", nested_kinds(13))]), None),
        ("tool schema: type lists nested 40 deep, wide", chat([user("hi")], tools=[
            tool_fn(f"f{i}", nested_kinds(40)) for i in range(60)]), None),
        ("tool schema: anyOf nested 25 deep", chat([user("hi")], tools=[
            tool_fn("f", nested(25, lambda s: {"anyOf": [s, {"type": "null"}]}))]), None),
        ("tool schema: objects nested 25 deep, type lists", chat([user("hi")], tools=[
            tool_fn("f", nested(25, lambda s: {"type": ["object", "null"],
                                               "properties": {"p": s, "q": {}}}))]), None),
        ("tool schema: a description of 40,000 CJK characters", chat([user("hi")], tools=[
            tool_fn("f", {"type": "object", "properties": {"x": {
                "type": "string", "description": ONE_PIECE}}})]), None),
        ("Responses: a tool schema, one 40,000-character piece", {
            "model": "gpt-4o", "store": False, "input": "hi", "tools": [
                {"type": "function", "name": "f", "parameters": {
                    "type": "object", "properties": {"x": {"enum": [ONE_PIECE]}}}}]}, None),
        ("Messages: an input_schema, one 40,000-character piece", {
            MESSAGES: True, "model": "claude-sonnet-4-6", "max_tokens": 64,
            "messages": [{"role": "user", "content": "hi"}], "tools": [
                {"name": "f", "input_schema": {"type": "object", "properties": {
                    ONE_PIECE: {"type": "string"}}}}]}, None),
        ("a message of 40,000 CJK characters in one piece", chat([user(ONE_PIECE)]), None),
        ("5,000 tools", chat([user("hi")], tools=[
            tool_fn(f"t{i}", {"type": "object", "properties": {"q": {"type": "string"}}},
                    "Looks a thing up in the catalogue.") for i in range(5000)]), None),
        ("enums: 60,000 values", chat([user("hi")], tools=[tool_fn("f", {
            "type": "object", "properties": {"x": {"enum": list(range(60_000))}}})]), None),
        ("one message of 20,000 parts", chat([user([{"type": "text", "text": f"p{i}"}
                                                    for i in range(20_000)])]), None),
        ("20,000 tiny messages", chat([user(str(i)) if i % 2 == 0 else
                                       {"role": "assistant", "content": str(i)}
                                       for i in range(20_001)]), None),
        ("900 KB of one letter", chat([user("a" * 900_000)]), None),
        ("900 KB of digits without a break", chat([user("7" * 900_000)]), None),
        ("900 KB of mixed scripts", chat([user("Zà字😀\u202e" * 120_000)]), None),
        ("a tool output nested 5,000 deep", chat(session(3, lambda k: deep_json), tools=LOOK),
         None),
        ("tool outputs of 900 KB of identifiers", chat(session(2, lambda k: ids[:450_000]),
                                                       tools=LOOK), None),
        ("an assistant message with 3,000 calls", chat([user("go"), {
            "role": "assistant", "content": None, "tool_calls": [
                {"id": f"k{i}", "type": "function",
                 "function": {"name": "look", "arguments": "{}"}} for i in range(3000)]}] + [
            {"role": "tool", "tool_call_id": f"k{i}", "content": "ok"} for i in range(3000)],
            tools=LOOK), None),
        ("search_history: a 90 KB query over 1,500 messages",
         chat(session(750, lambda k: f"result {k} " + " ".join(f"w{k}_{j}" for j in range(30))),
              tools=LOOK),
         {"tool_calls": [{"id": "s1", "name": "search_history",
                          "arguments": {"query": " ".join(f"q{i}x" for i in range(30_000))}}]}),
        ("search_history: 1,000 a over 4 results of 110 KB of a",
         chat(session(4, lambda k: "a" * 110_000), tools=LOOK),
         {"tool_calls": [{"id": f"s{i}", "name": "search_history",
                          "arguments": {"query": "a" * 1000}} for i in range(4)]}),
        ("search_history: 32 searches over 2 results of 97 KB of distinct words",
         chat(session(2, lambda k: " ".join(f"w{k}x{i}" for i in range(12_000))),
              tools=LOOK),
         {"tool_calls": [{"id": f"s{i}", "name": "search_history",
                          "arguments": {"query": f"w{i % 2}x{i}"}} for i in range(32)]}),
        ("tool schema: an object of 80,000 properties", chat([user("hi")], tools=[
            tool_fn("f", {"type": "object", "properties": {
                f"p{i}": {} for i in range(80_000)}})]), None),
        ("an agent message of 30,000 names, its call cut", chat([
            {"role": "system", "content": "s"}, user("go"),
            {"role": "assistant", "content": [{"type": "text", "text": " ".join(
                f"n_{i}" for i in range(30_000))}], "tool_calls": [
                {"id": "c1", "type": "function", "function": {
                    "name": "look", "arguments": json.dumps({"q": "x " * 400})}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok " * 300},
            {"role": "assistant", "content": "done"},
            *[m for j in range(6) for m in (user(f"next {j}"),
                                            {"role": "assistant", "content": f"fine {j}"})]],
            tools=LOOK), None),
        ("an answer of 100 KB gzip, 100 MiB inflated", chat([user("big")]),
         {"raw_body": gz, "headers": {"Content-Encoding": "gzip"}}),
        ("Responses: 20,000 input items", {"model": "gpt-4o", "store": False, "input": [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"item {i}"}
            for i in range(20_001)]}, None),
        ("Messages: 20,000 content blocks", {MESSAGES: True, "model": "claude-sonnet-4-6",
                                             "max_tokens": 64, "messages": [
            {"role": "user", "content": [{"type": "text", "text": f"b{i}"}
                                         for i in range(20_000)]}]}, None),
        ("Messages: 19,000 consecutive user turns", {MESSAGES: True,
                                                    "model": "claude-sonnet-4-6",
                                                    "max_tokens": 64, "messages": [
            {"role": "user", "content": "x"} for _ in range(19_000)]}, None),
        ("Messages: 6,000 tool results in turns of their own", {
            MESSAGES: True, "model": "claude-sonnet-4-6", "max_tokens": 64, "messages": [
                {"role": "user", "content": "go"}, {"role": "assistant", "content": [
                    {"type": "tool_use", "id": f"t{i}", "name": "look", "input": {}}
                    for i in range(6_000)]},
                *[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                                "content": "ok"}]} for i in range(6_000)],
                {"role": "user", "content": "go on"}],
            "tools": [{"name": "look", "input_schema": {"type": "object"}}]}, None),
        ("Messages: 15,000 consecutive assistant turns", {MESSAGES: True,
                                                         "model": "claude-sonnet-4-6",
                                                         "max_tokens": 64, "messages": [
            {"role": "user", "content": "x"}, *[{"role": "assistant", "content": [
                {"type": "text", "text": "y"}]} for _ in range(15_000)],
            {"role": "user", "content": "go on"}]}, None),
        *[(f"server history: a turn of 850 KB, {k} stored before it", {
            HEADERS: SERVER_HISTORY, "model": "gpt-4o", "messages": [
                user(f"read part {k}"),
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": f"call_{k}", "type": "function",
                    "function": {"name": "read", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": f"call_{k}",
                 "content": f"lorem ipsum dolor sit amet {k} " * 29_000}],
            "tools": [tool_fn("read", {"type": "object"})]}, None)
          for k in range(6)],
        ("server history: a tiny turn over 5 MB stored", {
            HEADERS: SERVER_HISTORY, "model": "gpt-4o", "messages": [user("and so?")]}, None),
        ("Messages: an input_schema nested 13 deep", {MESSAGES: True, "model": "claude-sonnet-4-6",
                                                      "max_tokens": 64, "messages": [
            {"role": "user", "content": "hi"}], "tools": [
            {"name": "f", "input_schema": nested_kinds(13)}]}, None),
        *long_keys(),
        # the upstream as the hostile side: what a stream's answer costs the proxy to read
        ("upstream: a Messages stream of 40,000 text deltas", {
            MESSAGES: True, "model": "claude-sonnet-4-6", "max_tokens": 64, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]},
         {"raw_chunks": messages_stream(40_000)}),
        ("upstream: a chat stream of 20,000 tool calls in one event", chat(
            [user("hi")], stream=True, tools=[tool_fn("look", {"type": "object"})]),
         {"raw_chunks": [calls_chunk(20_000), b"data: [DONE]\n\n"]}),
    ]


def messages_stream(deltas: int) -> list[bytes]:
    """A Messages event stream of one text block in ``deltas`` deltas of 64 characters."""
    def event(kind: str, data: dict[str, Any]) -> bytes:
        return f"event: {kind}\ndata: ".encode() + orjson.dumps({"type": kind, **data}) + b"\n\n"
    usage = {"input_tokens": 5, "output_tokens": 1}
    head = [event("message_start", {"message": {
        "id": "msg_h", "type": "message", "role": "assistant", "model": "claude-sonnet-4-6",
        "content": [], "stop_reason": None, "usage": usage}}),
        event("content_block_start", {"index": 0, "content_block": {"type": "text",
                                                                    "text": ""}})]
    delta = event("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                "text": "x" * 64}})
    tail = [event("content_block_stop", {"index": 0}),
            event("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": usage}),
            event("message_stop", {})]
    return [*head, *([delta * 1000] * (deltas // 1000)), *tail]


POLL = """
import sys, time, httpx
with httpx.Client(timeout=120) as c:
    while True:
        start = time.monotonic()
        c.get(sys.argv[1] + "/healthz")
        print(start, time.monotonic() - start, flush=True)
        time.sleep(0.002)
"""


class Poller:
    """Polls /healthz on its own connection, in a process of its own (so that nothing this
    process does — the upstream, reading the answers — delays it); the slowest answer
    within a time span (CLOCK_MONOTONIC is one clock for every process)."""

    def __init__(self, base: str):
        self.samples: list[tuple[float, float]] = []  # (sent at, took)
        self.proc = subprocess.Popen([sys.executable, "-c", POLL, base],
                                     stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self.read, daemon=True)
        self.thread.start()

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            at, took = line.split()
            self.samples.append((float(at), float(took)))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)

    def worst(self, since: float, until: float) -> float:
        time.sleep(0.2)  # the samples of the span have arrived
        return max((took for at, took in list(self.samples) if since <= at <= until or
                    at <= since <= at + took), default=0.0)


def start_proxy(upstream_url: str, prefix: str, *flags: str) -> tuple[subprocess.Popen[bytes],
                                                                      str]:
    """`runloop-proxy serve` as its own process (embedded Redis in a fresh data dir) on a free
    port, and its base URL (``wait_ready`` before using it)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "runloop_proxy.cli", "serve", "--upstream",
                             upstream_url, "--port", str(port), "--data-dir",
                             tempfile.mkdtemp(prefix=prefix), "--log-level", "error", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(base: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the proxy did not start")
        time.sleep(0.1)


FLOOD_CLIENTS = 6  # tenant A's clients sending large bodies at once
B_REQUESTS = 30  # tenant B's small requests, one at a time, alone and under the flood
TWO_TENANTS = "two tenants: A floods 1 MiB bodies, B's small requests"


def _latencies(c: httpx.Client, base: str, key: str, n: int) -> list[float]:
    out = []
    for k in range(n):
        start = time.monotonic()
        r = c.post(base + "/v1/chat/completions", headers={**bearer(key), "X-Session-Id":
                   f"b-{time.monotonic_ns()}"}, json=chat([user(f"status of build {k}?")]))
        assert r.status_code == 200, r.text
        out.append(time.monotonic() - start)
    return sorted(out)


def two_tenants(base: str) -> dict[str, Any]:
    """Tenant A (its own key) floods large bodies — an agent's 1 MiB of tool results each,
    distinct every time, from FLOOD_CLIENTS clients at once — while tenant B sends small
    requests one at a time: B's latency under the flood against B alone (one run), and
    what A's requests were answered (429s past its share of the worker threads)."""
    a, b = openai_project_key(31), openai_project_key(32)
    template = orjson.dumps(chat(session(40, lambda k: f"TAGTAGTA-{k} " + " ".join(
        uuids(700))[:25_000])))
    statuses: dict[int, int] = {}
    stop = threading.Event()

    def flood(n: int) -> None:
        with httpx.Client(timeout=120) as fc:
            k = 0
            while not stop.is_set():
                k += 1
                tag = f"{n:02d}{k:06x}"[:8].encode()
                r = fc.post(base + "/v1/chat/completions", content=template.replace(
                    b"TAGTAGTA", tag), headers={**bearer(a), "X-Session-Id": f"a{n}-{k}",
                                               "Content-Type": "application/json"})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code == 429:
                    time.sleep(float(r.headers.get("Retry-After", "1")) / 10)

    with httpx.Client(timeout=120) as c:
        alone = _latencies(c, base, b, B_REQUESTS)
        threads = [threading.Thread(target=flood, args=(n,), daemon=True)
                   for n in range(FLOOD_CLIENTS)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # the flood under way
        flooded = _latencies(c, base, b, B_REQUESTS)
        stop.set()
        for t in threads:
            t.join(120)

    def pct(xs: list[float], q: float) -> float:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1)
    return {"alone_p50_ms": pct(alone, 0.5), "alone_p95_ms": pct(alone, 0.95),
            "flooded_p50_ms": pct(flooded, 0.5), "flooded_p95_ms": pct(flooded, 0.95),
            "p50_ratio": round(pct(flooded, 0.5) / max(pct(alone, 0.5), 0.1), 2),
            "p95_ratio": round(pct(flooded, 0.95) / max(pct(alone, 0.95), 0.1), 2),
            "a_statuses": dict(sorted(statuses.items()))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", help="names (substrings) of the bodies to send")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    upstream = ScriptedUpstream().start()
    upstream.keep_requests = False
    proxy, base = start_proxy(upstream.url, "hostile-")
    rows: list[dict[str, Any]] = []
    try:
        wait_ready(base)
        poller = Poller(base)
        time.sleep(0.5)
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
            for n, (name, body, answer) in enumerate(corpus()):
                if args.only and not any(o in name for o in args.only):
                    continue
                headers = {"Content-Type": "application/json", "X-Session-Id": f"h{n}",
                           **body.pop(HEADERS, {})}
                get = body.pop(GET, None)
                path = "/v1/messages" if body.pop(MESSAGES, False) else \
                    "/v1/responses" if "input" in body else "/v1/chat/completions"
                path = get or path
                raw = b"" if get else orjson.dumps(body)
                upstream.reset()
                upstream.keep_requests = False
                if answer is not None:
                    upstream.push(answer)
                time.sleep(0.05)
                start = time.monotonic()
                with c.stream("GET" if get else "POST", base + path, content=raw or None,
                              headers=headers) as r:
                    received = sum(len(b) for b in r.iter_raw())
                took = time.monotonic() - start
                # and what the request leaves behind it: its history written, summaries made
                time.sleep(AFTER_S)
                rows.append({"body": name, "bytes": len(raw), "status": r.status_code,
                             "answer_bytes": received, "seconds": round(took, 3),
                             "worst_stall_ms": round(poller.worst(
                                 start, start + took + AFTER_S) * 1000, 1)})
        poller.close()
        tenants = two_tenants(base) if not args.only or any(
            o in TWO_TENANTS for o in args.only) else None
    finally:
        proxy.terminate()
        proxy.wait(10)
        upstream.stop()
    if args.json:
        print(json.dumps({"bodies": rows, "two_tenants": tenants}, indent=2))
        return 0
    print(f"{'body':<66} {'bytes':>9} {'answer':>9} {'status':>6} {'took s':>7} "
          f"{'worst /healthz ms':>18}")
    for row in rows:
        print(f"{row['body']:<66} {row['bytes']:>9,} {row['answer_bytes']:>9,} "
              f"{row['status']:>6} {row['seconds']:>7} {row['worst_stall_ms']:>18}")
    under = [r for r in rows if r["bytes"] < MiB]
    if under:
        print(f"worst stall for a body under 1 MiB: {max(r['worst_stall_ms'] for r in under)} "
              f"ms ({max(under, key=lambda r: r['worst_stall_ms'])['body']})")
    small = [r for r in under if r["answer_bytes"] < MiB]
    if small:
        print(f"worst stall for a body and an answer under 1 MiB: "
              f"{max(r['worst_stall_ms'] for r in small)} ms "
              f"({max(small, key=lambda r: r['worst_stall_ms'])['body']})")
    if tenants is not None:
        print(f"{TWO_TENANTS}: p50 {tenants['alone_p50_ms']} ms alone, "
              f"{tenants['flooded_p50_ms']} ms flooded ({tenants['p50_ratio']}x); p95 "
              f"{tenants['alone_p95_ms']} -> {tenants['flooded_p95_ms']} ms "
              f"({tenants['p95_ratio']}x); A answered {tenants['a_statuses']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
