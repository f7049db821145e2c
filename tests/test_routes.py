"""The proxy core through real HTTP: the official openai SDK against the proxy in front of a
scripted upstream."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import socket
import time
from typing import Any

import httpx
import openai
import orjson
import pytest

from runloop_proxy.api.routes import v1_subpath
from runloop_proxy.errors import InvalidRequest
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer, free_port
from .keys import openai_project_key

CLIENT_KEY = openai_project_key(14)


def client(proxy: ProxyServer, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url, api_key=CLIENT_KEY, max_retries=0, **kw)


def test_sync_completion_passes_through(proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    upstream.push({"content": "hello there"})
    resp = client(proxy).chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert resp.choices[0].message.content == "hello there"
    assert resp.usage is not None and resp.usage.total_tokens > 0
    # the client's own key reaches the upstream in pass-through mode
    assert upstream.headers[-1]["authorization"] == f"Bearer {CLIENT_KEY}"


def test_unknown_fields_and_options_pass_through_byte_identical(
        proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    c = client(proxy)
    c.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], seed=7, n=2,
        logprobs=True, top_logprobs=2, response_format={"type": "json_object"},
        extra_body={"some_vendor_field": {"x": [1, 2]}, "another": None})
    sent = upstream.requests[-1]
    assert sent["seed"] == 7 and sent["n"] == 2 and sent["logprobs"] is True
    assert sent["response_format"] == {"type": "json_object"}
    assert sent["some_vendor_field"] == {"x": [1, 2]} and "another" in sent
    # nothing to compress: the body the upstream saw is the body the client sent
    raw = c.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "second"}], seed=1)
    assert raw.http_request.content == upstream.raw_bodies[-1]


def test_n_choices_come_back(proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    resp = client(proxy).chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "x"}], n=3)
    assert [(c.index, c.message.content) for c in resp.choices] == \
        [(0, "echo: x"), (1, "echo: x"), (2, "echo: x")]
    assert upstream.requests[-1]["n"] == 3


def test_streaming_with_usage(proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    upstream.push({"content": "one two three four five six seven"})
    stream = client(proxy).chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "count"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two three four five six seven"
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0


def test_tool_calls_parallel_round_trip(proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    upstream.push({"tool_calls": [{"id": "call_a", "name": "get_weather",
                                   "arguments": {"city": "Paris"}},
                                  {"id": "call_b", "name": "get_weather",
                                   "arguments": {"city": "Rome"}}]},
                  {"content": "Paris 20C, Rome 25C"})
    c = client(proxy)
    msgs: list[dict[str, object]] = [{"role": "user", "content": "weather?"}]
    first = c.chat.completions.create(model="gpt-4o-mini", messages=msgs, tools=tools)
    calls = first.choices[0].message.tool_calls
    assert calls is not None and [t.id for t in calls] == ["call_a", "call_b"]
    assert first.choices[0].finish_reason == "tool_calls"
    msgs.append(first.choices[0].message.model_dump(exclude_none=True))
    for t in calls:
        msgs.append({"role": "tool", "tool_call_id": t.id, "content": "sunny"})
    second = c.chat.completions.create(model="gpt-4o-mini", messages=msgs, tools=tools)
    assert second.choices[0].message.content == "Paris 20C, Rome 25C"
    # the client's tools first, as sent; the proxy's ride along (proxy_tools = "always")
    assert upstream.requests[-1]["tools"][:1] == tools
    assert [t["function"]["name"] for t in upstream.requests[-1]["tools"][1:]] == [
        "recall_tool_call", "search_history"]


def test_streamed_tool_calls(proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    upstream.push({"tool_calls": [{"id": "call_s", "name": "lookup",
                                   "arguments": {"q": "a long argument string here"}}]})
    stream = client(proxy).chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "look"}], stream=True,
        tools=[{"type": "function", "function": {"name": "lookup", "parameters": {}}}])
    args = ""
    finish = None
    for ch in stream:
        for choice in ch.choices:
            for tc in choice.delta.tool_calls or []:
                args += tc.function.arguments or "" if tc.function else ""
            finish = choice.finish_reason or finish
    assert orjson.loads(args) == {"q": "a long argument string here"}
    assert finish == "tool_calls"


async def test_async_client_concurrent(proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    c = openai.AsyncOpenAI(base_url=proxy.url, api_key="sk-async", max_retries=0)
    results = await asyncio.gather(*[
        c.chat.completions.create(model="gpt-4o-mini",
                                  messages=[{"role": "user", "content": f"q{i}"}])
        for i in range(10)])
    assert sorted(r.choices[0].message.content or "" for r in results) == \
        sorted(f"echo: q{i}" for i in range(10))
    stream = await c.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "streamed"}], stream=True)
    text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
    assert text == "echo: streamed"
    await c.close()


def test_models_and_embeddings_pass_through(proxy: ProxyServer,
                                            upstream: ScriptedUpstream) -> None:
    c = client(proxy)
    assert "gpt-4o-mini" in [m.id for m in c.models.list()]
    # a JSON answer is passed whole, as a JSON answer: its length, none of a stream's headers
    r = httpx.get(proxy.url + "/models", headers={"Authorization": "Bearer sk-x"})
    assert int(r.headers["content-length"]) == len(r.content)
    assert "x-accel-buffering" not in r.headers and "no-cache" not in \
        r.headers.get("cache-control", "")
    emb = c.embeddings.create(model="text-embedding-3-small", input=["a", "b"])
    assert len(emb.data) == 2
    # the answer is relayed as the upstream encodes it: asked only in what the client accepts
    for accepts in ("identity", "gzip, br"):
        upstream.other.clear()
        httpx.get(proxy.url + "/files", headers={"Authorization": "Bearer sk-x",
                                                 "Accept-Encoding": accepts})
        (_, _, sent, _), = upstream.other
        assert sent.get("accept-encoding") == accepts


def test_langchain_chat_openai(proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    from langchain_openai import ChatOpenAI

    upstream.push({"content": "from langchain"})
    llm = ChatOpenAI(model="gpt-4o-mini", base_url=proxy.url, api_key="sk-lc", max_retries=0)
    assert llm.invoke("hello").content == "from langchain"


@pytest.mark.parametrize("body,param", [
    (b"{not json", None),
    (b"[]", None),
    (orjson.dumps({"messages": [{"role": "user", "content": "x"}]}), "model"),
    (orjson.dumps({"model": "m", "messages": []}), "messages"),
    (orjson.dumps({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}),
     "messages[0].role"),
    (orjson.dumps({"model": "m", "messages": [{"role": "tool", "content": "x"}]}),
     "messages[0].tool_call_id"),
    (orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                   "stream": "yes"}), "stream"),
    (orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                   "stream": True, "stream_options": {"include_usage": "yes"}}),
     "stream_options.include_usage"),
])
def test_invalid_requests_get_400_naming_the_field(proxy: ProxyServer, body: bytes,
                                                   param: str | None) -> None:
    r = httpx.post(proxy.url + "/chat/completions", content=body,
                   headers={"Authorization": "Bearer k", "Content-Type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param


def test_sdk_raises_bad_request_for_invalid(proxy: ProxyServer) -> None:
    with pytest.raises(openai.BadRequestError):
        client(proxy).chat.completions.create(model="m", messages=[])


@pytest.mark.parametrize("how", ["declared", "chunked"])
@pytest.mark.parametrize("path", ["/chat/completions", "/responses", "/messages",
                                  "/embeddings"])
def test_body_over_limit_is_413(make_proxy: object, upstream: ScriptedUpstream, how: str,
                                path: str) -> None:
    """The body bound holds however a body arrives — with its length declared, or chunked
    with none (planted: the bound checked only the declared length, and a chunked body of
    any size was read whole) — on every route that reads one, the proxy's and the
    pass-through's alike, before the upstream hears of it."""
    proxy = make_proxy(server={"max_body_bytes": 4096})  # type: ignore[operator]
    big = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 8192}]})
    content: Any = big if how == "declared" else iter([big[:4000], big[4000:]])
    r = httpx.post(proxy.url + path, content=content,
                   headers={"Authorization": "Bearer k", "x-api-key": "k"})
    assert r.status_code == 413, (path, how, r.status_code)
    assert "request_too_large" in r.text
    assert not upstream.requests and not upstream.other


@pytest.mark.parametrize("how", ["declared", "chunked"])
@pytest.mark.parametrize("over", [0, 1])
def test_the_body_bound_holds_at_its_exact_value(make_proxy: Any, upstream: ScriptedUpstream,
                                                 request: pytest.FixtureRequest, how: str,
                                                 over: int) -> None:
    """A body of exactly ``max_body_bytes`` (drawn per test) is served, one byte more is a
    413 naming the limit, declared or chunked.

    Bug class: a bound off at its boundary. Planted: ``>=`` for ``>`` on the chunked count
    (the exact size refused); the declared length compared with the limit less one."""
    from .distinct import Distinct

    limit = Distinct(request.node.nodeid).size(4_500, 9_000)
    proxy = make_proxy(server={"max_body_bytes": limit})
    head = {"model": "gpt-4o-mini-2024-07-18", "messages": [{"role": "user", "content": ""}]}
    pad = limit + over - len(orjson.dumps(head))
    body = orjson.dumps({**head, "messages": [{"role": "user", "content": "x" * pad}]})
    assert len(body) == limit + over
    content: Any = body if how == "declared" else iter([body[:limit // 2], body[limit // 2:]])
    r = httpx.post(proxy.url + "/chat/completions", content=content, timeout=30,
                   headers={"Authorization": "Bearer sk-a", "Content-Type": "application/json"})
    if over:
        assert r.status_code == 413 and f"the limit of {limit}" in r.json()["error"]["message"]
        assert not upstream.requests
    else:
        assert r.status_code == 200, r.text[:300]
        assert r.json()["choices"][0]["message"]["content"]
        assert len(upstream.requests) == 1


def test_a_declared_body_over_the_limit_is_refused_before_it_is_sent(make_proxy: object
                                                                      ) -> None:
    """A Content-Length over the limit is answered at once, from the headers: a client
    that declares 1 GB and sends nothing gets its 413 without the proxy waiting for the body
    (whose deadline is far later) or reading a byte of it."""
    import socket

    proxy = make_proxy(server={"body_timeout_s": 60})  # type: ignore[operator]
    host, port = proxy.url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer k\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000000\r\n\r\n")
        head = sock.recv(4096)  # within 10 s, where the body's deadline is 60 s
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert b"request_too_large" in head, head[:400]


def test_upstream_error_status_and_body_pass_through(proxy: ProxyServer,
                                                     upstream: ScriptedUpstream) -> None:
    upstream.push({"status": 400, "body": {"error": {"message": "bad thing", "type":
                                                     "invalid_request_error", "param": "x",
                                                     "code": "weird"}}})
    with pytest.raises(openai.BadRequestError) as info:
        client(proxy).chat.completions.create(model="m", messages=[{"role": "user",
                                                                     "content": "x"}])
    assert info.value.body["code"] == "weird"  # type: ignore[index]


def test_retries_on_503_then_succeeds(proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    upstream.push({"status": 503, "headers": {"Retry-After": "0"}}, {"content": "recovered"})
    resp = client(proxy).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}])
    assert resp.choices[0].message.content == "recovered"
    assert len(upstream.requests) == 2


@pytest.mark.parametrize(("status", "retried"), [
    (429, True), (500, True), (502, True), (503, True), (504, True), (529, True),
    (400, False), (401, False), (403, False), (404, False), (409, False), (413, False),
    (422, False), (501, False)])
def test_which_statuses_are_tried_again(proxy: ProxyServer, upstream: ScriptedUpstream,
                                        status: int, retried: bool) -> None:
    """Each status the upstream answers, to the request: a rate limit, a server's error and
    Anthropic's 529 (overloaded) are tried again (then the reply arrives); a client's error
    is not — tried again it fails again, at the caller's cost — and it reaches the client
    with its own status.

    Bug class: the retry table one status off. Planted: 529 left out (Anthropic's overload
    answered to the client at once); 501 added (a server that cannot do it asked again)."""
    upstream.push({"status": status, "headers": {"Retry-After": "0"}},
                  {"content": "recovered"})
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-a", max_retries=0)
    if retried:
        resp = c.chat.completions.create(model="gpt-4o-mini-2024-07-18",
                                         messages=[{"role": "user", "content": "x"}])
        assert resp.choices[0].message.content == "recovered"
        assert len(upstream.requests) == 2
    else:
        with pytest.raises(openai.APIStatusError) as err:
            c.chat.completions.create(model="gpt-4o-mini-2024-07-18",
                                      messages=[{"role": "user", "content": "x"}])
        assert err.value.status_code == status and len(upstream.requests) == 1


def test_429_after_retries_passes_through(proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    upstream.push(*[{"status": 429, "headers": {"Retry-After": "0"}}] * 3)
    with pytest.raises(openai.RateLimitError) as err:
        client(proxy).chat.completions.create(model="m", messages=[{"role": "user",
                                                                     "content": "x"}])
    assert len(upstream.requests) == 3  # first try + max_retries (2)
    # the upstream's own answer, passed through
    assert err.value.status_code == 429 and "scripted failure" in str(err.value.body)


def test_unreachable_upstream_is_502(make_proxy: object, redis_url: str, tmp_path: object,
                                     caplog: pytest.LogCaptureFixture) -> None:
    """A 502 naming the upstream by its URL — with the credentials a URL may carry left out,
    in the answer and every log line (planted: the pass-through upstream named by its URL
    as written, password and all)."""
    import logging

    from runloop_proxy.config import Settings
    from runloop_proxy.ops.logs import JsonFormatter

    from .conftest import unique_config

    port = free_port()
    settings = Settings(upstream=f"http://ops:hunter2-secret@127.0.0.1:{port}/v1?key=qs-secret",
                        redis_url=redis_url)
    proxy = ProxyServer(settings, unique_config(settings)).start()
    try:
        with caplog.at_level(logging.INFO, logger="runloop"):
            r = httpx.post(proxy.url + "/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "upstream_unreachable"
        assert f"127.0.0.1:{port}" in r.json()["error"]["message"]
        said = r.text + "".join(JsonFormatter().format(rec) for rec in caplog.records)
        assert "hunter2" not in said and "qs-secret" not in said, said
    finally:
        proxy.stop()


def test_upstream_timeout_is_504(redis_url: str, upstream: ScriptedUpstream, tmp_path: object
                                 ) -> None:
    import dataclasses

    from runloop_proxy.config import Settings

    from .conftest import unique_config

    settings = Settings(upstream=upstream.url, redis_url=redis_url)
    config = unique_config(settings)
    slow = config.upstreams["default"].model_copy(update={"read_timeout": 0.3,
                                                          "max_retries": 0})
    config = dataclasses.replace(config, upstreams={"default": slow})
    proxy = ProxyServer(settings, config).start()
    upstream.push({"content": "late", "delay": 1.5})
    try:
        r = httpx.post(proxy.url + "/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "x"}]}, timeout=10)
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "upstream_timeout"
    finally:
        proxy.stop()


def test_upstream_dying_mid_stream_gives_sdk_error(proxy: ProxyServer,
                                                   upstream: ScriptedUpstream) -> None:
    # the pieces arrive before the death: an abortive close (RST) may drop unread bytes in
    # the kernel, which would test TCP rather than the proxy
    upstream.push({"pieces": ["a", "b", "c", "d"], "die_after": 2, "chunk_delay": 0.05})
    stream = client(proxy).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], stream=True)
    got = []
    with pytest.raises(openai.APIError):
        for ch in stream:
            if ch.choices:
                got.append(ch.choices[0].delta.content or "")
    assert "".join(got) == "ab"


@pytest.mark.parametrize("raw_chunks,expected", [
    # CRLF line endings, an event split across chunks, a CR/LF split between chunks
    ([b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":'
      b'[{"index":0,"delta":{"content":"he"},"finish_reason":null}]}\r',
      b'\n\r\ndata: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m",',
      b'"choices":[{"index":0,"delta":{"content":"llo"},"finish_reason":"stop"}]}\r\n\r\n',
      b"data: [DONE]\r\n\r\n"], "hello"),
    # one huge chunk holding many events, and a comment line
    ([b": keep-alive\n\n" + b"".join(
        b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":'
        b'[{"index":0,"delta":{"content":"' + (b"z" * 5000) + b'"},"finish_reason":null}]}\n\n'
        for _ in range(40)) + b"data: [DONE]\n\n"], "z" * 200_000),
])
def test_raw_sse_edge_cases_relay_exactly(proxy: ProxyServer, upstream: ScriptedUpstream,
                                          raw_chunks: list[bytes], expected: str) -> None:
    upstream.push({"raw_chunks": raw_chunks})
    stream = client(proxy).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == expected


def test_stream_events_arrive_as_they_are_produced(proxy: ProxyServer,
                                                  upstream: ScriptedUpstream) -> None:
    upstream.push({"pieces": ["a", "b", "c"], "chunk_delay": 0.4})
    arrivals = []
    with httpx.stream("POST", proxy.url + "/chat/completions", json={
            "model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]},
            timeout=10) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                arrivals.append(time.monotonic())
    assert len(arrivals) == 3
    # no buffering: pieces produced 0.4 s apart reach the client about 0.4 s apart
    assert arrivals[2] - arrivals[0] > 0.5


def test_client_disconnect_cancels_upstream(proxy: ProxyServer,
                                            upstream: ScriptedUpstream) -> None:
    upstream.push({"pieces": ["x"] * 50, "chunk_delay": 0.2})
    body = orjson.dumps({"model": "m", "stream": True,
                         "messages": [{"role": "user", "content": "slow"}]})
    with socket.create_connection(("127.0.0.1", proxy.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert b"200 OK" in s.recv(4096)
    deadline = time.monotonic() + 5
    while upstream.streams_closed_early == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert upstream.streams_closed_early == 1


def test_health_and_ready(proxy: ProxyServer) -> None:
    assert httpx.get(proxy.base + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(proxy.base + "/readyz")
    assert ready.status_code == 200 and ready.json()["checks"]["store"] is True


def test_unknown_path_is_openai_shaped_404(proxy: ProxyServer) -> None:
    r = httpx.get(proxy.base + "/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_client_disconnect_cancels_a_non_streaming_call(proxy: ProxyServer,
                                                       upstream: ScriptedUpstream) -> None:
    upstream.push({"content": "too late", "delay": 1.5})
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "slow"}]})
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", proxy.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.3)
    deadline = time.monotonic() + 5
    while upstream.abandoned == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert upstream.abandoned == 1
    metrics = httpx.get(proxy.base + "/metrics").text
    assert 'status="499"' in metrics
    assert time.monotonic() - started < 5


# -- pass-through paths stay below /v1/ -------------------------------------------------

@pytest.mark.parametrize(("raw", "upstream_path"), [
    (b"/v1/models", "/models"),
    (b"/v1/files/file-abc/content", "/files/file-abc/content"),
    (b"/v1/models/ft:gpt-4o:org:x", "/models/ft:gpt-4o:org:x"),
    (b"/v1/vector_stores/vs_1/files/", "/vector_stores/vs_1/files/"),
    (b"/v1/a%20b", "/a%20b"),
    (b"/v1/a%252e%252e/x", "/a%252e%252e/x"),  # decoded once: a literal %2e, sent re-encoded
    (b"/v1/caf%C3%A9", "/caf%C3%A9"),
    (b"/v1/a..b/.well", "/a..b/.well"),
])
def test_a_pass_through_path_below_v1_is_kept(raw: bytes, upstream_path: str) -> None:
    assert v1_subpath(raw) == upstream_path


@pytest.mark.parametrize("raw", [
    b"/v1/../secret", b"/v1/%2e%2e/%2e%2e/secret", b"/v1/..%2f..%2fsecret",
    b"/v1/models/..%2F..%2Fother", b"/v1/%2E%2E", b"/v1/.", b"/v1/a/./b", b"/v1//etc",
    b"/v1/a%5c..%5cb", b"/v1/a\\b", b"/v1/a%00b", b"/v1/a%0d%0aX-Injected:%201",
    b"/v1/%ff", b"/v2/models", b"/v1",
])
def test_a_pass_through_path_that_leaves_v1_is_refused(raw: bytes) -> None:
    with pytest.raises(InvalidRequest):
        v1_subpath(raw)


def raw_request(proxy: ProxyServer, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """A request whose path goes on the wire exactly as written (no client normalises it)."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={
            "Authorization": f"Bearer {CLIENT_KEY}", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_pass_through_paths_never_leave_v1_upstream(proxy: ProxyServer,
                                                    upstream: ScriptedUpstream) -> None:
    for path in ("/v1/%2e%2e/%2e%2e/secret", "/v1/..%2f..%2fsecret",
                 "/v1/models/..%2F..%2Fother", "/v1/%2e%2e/v1/models"):
        status, body = raw_request(proxy, "GET", path)
        assert status == 400, path
        assert "below /v1/" in orjson.loads(body)["error"]["message"]
    assert upstream.other == []
    status, _ = raw_request(proxy, "GET", "/v1/files/file-1/content?purpose=x%2Fy")
    assert status == 404  # the scripted upstream has no such file; it saw the request:
    method, path, headers, _ = upstream.other[-1]
    assert (method, path) == ("GET", "/v1/files/file-1/content?purpose=x%2Fy")
    assert headers["authorization"] == f"Bearer {CLIENT_KEY}"


def test_a_compressed_pass_through_body_keeps_its_encoding(proxy: ProxyServer,
                                                           upstream: ScriptedUpstream) -> None:
    body = gzip.compress(orjson.dumps({"model": "text-embedding-3-small", "input": ["a", "b"]}))
    status, answer = raw_request(proxy, "POST", "/v1/embeddings", body, {
        "Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 200, answer
    assert [d["index"] for d in orjson.loads(answer)["data"]] == [0, 1]


@pytest.mark.parametrize("path, body", [
    ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/responses", {"input": "hi"}),
    ("/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
    ("/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_a_model_name_longer_than_any_is_refused_in_every_api(
        proxy: ProxyServer, upstream: ScriptedUpstream, path: str, body: dict[str, Any]) -> None:
    """Finding (red team): a model's name keys the token counter's caches, its calibration
    table, metric labels and log lines; 400 requests with 1 MB names held 380 MB. Every API's
    request becomes a turn in one place, which bounds it."""
    long = {**body, "model": "m" * 257}
    r = httpx.post(proxy.url + path, json=long, headers={"Authorization": "Bearer k"})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert "model" in error["message"] and "257 characters" in error["message"]
    if path.startswith("/messages"):
        assert r.json()["type"] == "error" and error["type"] == "invalid_request_error"
    else:
        assert error["param"] == "model"
    assert upstream.requests == []
    ok = httpx.post(proxy.url + path, json={**body, "model": "m" * 256},
                    headers={"Authorization": "Bearer k"})
    assert ok.status_code == 200, ok.text[:300]
