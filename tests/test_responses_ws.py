"""``/v1/responses`` over a WebSocket through real servers: the proxy under uvicorn, the
scripted upstream (HTTP, streamed), a real Redis; the clients a raw socket (``websockets``)
and the official SDK's ``responses.connect()``. A turn over the socket is the request it
amounts to over HTTP; a turn that goes on from the connection's last response with only its
new items reaches the upstream as the whole conversation; errors are the socket's error
events with the HTTP status; the upgrade is refused in HTTP."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer, until

# an OpenAI project key as long as a real one (164 characters)
KEY = "sk-proj-" + "Q7xKpL2mNv8RtY4wZa9B" * 7 + "cD3eF5gH6jK1mN0p"
assert len(KEY) == 164
ADMIN = "admin-ws-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
TENANT = "pt-" + hashlib.sha256(KEY.encode()).hexdigest()[:16]
MODEL = "gpt-5.2-codex-2026-01-14"
PROXY_TOOLS = ("recall_tool_call", "search_history")
ENDS = ("response.completed", "response.incomplete", "response.failed", "error",
        "response.steer.failed")
TOOLS = [{"type": "function", "name": "exec_command", "description": "run a command",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]
DEVELOPER = {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "You are a coding agent."}]}


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def ws_url(proxy: ProxyServer) -> str:
    return proxy.base.replace("http://", "ws://") + "/v1/responses"


def socket(proxy: ProxyServer, key: str = KEY, session: str | None = None,
           **headers: str) -> ClientConnection:
    extra = {"Authorization": f"Bearer {key}", **headers}
    if session:
        extra["session-id"] = session
    return connect(ws_url(proxy), additional_headers=extra, max_size=None, open_timeout=10)


def turn(ws: ClientConnection, event: dict[str, Any]) -> list[dict[str, Any]]:
    """Send one client event; the server's events up to the one that ends its answer."""
    ws.send(orjson.dumps(event).decode())
    out = []
    while True:
        data = orjson.loads(ws.recv(timeout=30))
        out.append(data)
        if data["type"] in ENDS:
            return out


def create(**body: Any) -> dict[str, Any]:
    return {"type": "response.create", "model": MODEL, "store": False, **body}


def stored(proxy: ProxyServer, session: str) -> dict[str, Any]:
    proxy.settle()
    r = httpx.get(f"{proxy.base}/admin/sessions/{session}", headers=AUTH,
                  params={"messages": "1", "tenant": TENANT})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def passthrough(tmp_path: Path, upstream: ScriptedUpstream, extra: str = "") -> str:
    """A pass-through config (no tenants/) whose upstream is not retried."""
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "runloop.toml").write_text(
        f'[upstreams.default]\nurl = "{upstream.url}"\nmax_retries = 0\n{extra}')
    return str(cfg)


def requests_by_api(proxy: ProxyServer) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for metric in proxy.metrics.requests.collect():
        for s in metric.samples:
            if s.name.endswith("_total") and s.value:
                key = (s.labels["api"], s.labels["status"])
                out[key] = out.get(key, 0) + s.value
    return out


def test_a_turn_over_the_socket_is_the_request_over_http(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """The same conversation, once POSTed (streamed) and once as a ``response.create``:
    the upstream gets the same body (the socket's envelope gone, ``stream`` on), the client
    the same events, the store the same session. Red with the envelope forwarded
    (``type``/``generate`` upstream) and with ``stream`` left as the client sent it."""
    proxy = make_proxy(admin_key=ADMIN)
    items = [DEVELOPER, user("list the files")]
    r = httpx.post(proxy.url + "/responses", headers={
        "Authorization": f"Bearer {KEY}", "session-id": "over-http"},
        json={"model": MODEL, "input": items, "tools": TOOLS, "store": False, "stream": True})
    assert r.status_code == 200, r.text
    over_http = [orjson.loads(line[6:]) for line in r.text.splitlines()
                 if line.startswith("data: ")]
    with socket(proxy, session="over-ws") as ws:
        over_ws = turn(ws, create(input=items, tools=TOOLS))
    http_body, ws_body = upstream.requests
    assert ws_body == http_body and "type" not in ws_body and ws_body["stream"] is True
    assert [e["type"] for e in over_ws] == [e["type"] for e in over_http]
    assert over_ws[-1]["response"]["output"][0]["content"][0]["text"] == "echo: list the files"
    assert [e["sequence_number"] for e in over_ws] == list(range(len(over_ws)))
    # stored alike: one session each, one branch, the same messages
    a, b = stored(proxy, "over-http"), stored(proxy, "over-ws")
    assert [(m["role"], m["content"]) for m in a["messages"]] == \
        [(m["role"], m["content"]) for m in b["messages"]]
    assert len(b["branches"]) == 1
    assert requests_by_api(proxy) == {("responses", "200"): 1, ("responses_ws", "200"): 1}


def test_codex_s_turns_go_on_from_the_last_response_with_only_their_new_items(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Codex's way: a warmup (``generate: false``, nothing goes upstream), then each request
    names the last response and sends only what is new. The upstream gets the whole
    conversation every time — what Codex would have POSTed — and the session is one branch.
    Red with a continuation that drops the kept output (forks the session), and with a
    warmup forwarded upstream."""
    proxy = make_proxy(admin_key=ADMIN)

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        if body["input"][-1].get("type") == "function_call_output":
            return {"content": "there are 3 files"}
        return {"content": "Listing.", "reasoning": "enc-1",
                "tool_calls": [{"id": "call_ls_1", "name": "exec_command",
                                "arguments": {"cmd": "ls"}}]}

    upstream.responder = respond
    whole: list[dict[str, Any]] = []
    with socket(proxy, session="codex-thread-1") as ws:
        warm = turn(ws, create(input=[DEVELOPER], tools=TOOLS, generate=False))
        assert [e["type"] for e in warm] == ["response.created", "response.completed"]
        assert warm[-1]["response"]["output"] == [] and upstream.requests == []
        whole += [DEVELOPER]
        delta = [user("how many files?")]
        first = turn(ws, create(input=delta, tools=TOOLS,
                                previous_response_id=warm[-1]["response"]["id"]))
        whole += delta
        assert upstream.requests[-1]["input"] == whole
        assert "previous_response_id" not in upstream.requests[-1]
        done = first[-1]["response"]
        assert done["previous_response_id"] == warm[-1]["response"]["id"]  # as it was asked
        whole += done["output"]
        delta = [{"type": "function_call_output", "call_id": "call_ls_1",
                  "output": "a.py\nb.py\nc.py"}]
        second = turn(ws, create(input=delta, tools=TOOLS, previous_response_id=done["id"]))
        whole += delta
        assert upstream.requests[-1]["input"] == whole
        assert second[-1]["response"]["output"][0]["content"][0]["text"] == "there are 3 files"
    assert len(upstream.requests) == 2
    view = stored(proxy, "codex-thread-1")
    assert len(view["branches"]) == 1
    assert [m["role"] for m in view["messages"]] == [
        "developer", "user", "assistant", "tool", "assistant"]
    assert requests_by_api(proxy) == {("responses_warmup", "200"): 1,
                                      ("responses_ws", "200"): 2}


BIG = "\n".join(f"log line {i}: status ok, checksum {i * 7919 % 100_003}" for i in range(900))


def test_the_proxys_rounds_are_hidden_and_the_next_turn_goes_on_from_what_the_client_saw(
        make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """A small window: old outputs are cut, the model recalls one through the proxy's tool.
    The socket's client never sees that call, its output or the proxy's tools; its next turn
    goes on from the response as it saw it, and the upstream is sent no call left
    unanswered. Red with the proxy's call left in the response the client ends with (so in
    what the connection keeps) and with the proxy's tools echoed in it."""
    # a small window (six outputs of 11,689 tokens), with room for the recalled one whole
    # beside the latest: a recalled result is cut to what the window leaves
    proxy = make_proxy(config_dir=passthrough(tmp_path, upstream, (
        f'[defaults.models."{MODEL}"]\ncontext_window = 32000\n'
        f'[defaults.policy]\nkeep_recent_tool_results = 1\n')), admin_key=ADMIN)
    steps = 6

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        last = body["input"][-1]
        if last.get("call_id") == "call_rc_1":
            return {"content": f"recalled {len(str(last['output']))} chars"}
        outs = [i for i in body["input"] if i.get("type") == "function_call_output"]
        if len(outs) < steps:
            return {"content": None, "tool_calls": [{
                "id": f"call_cat_{len(outs)}", "name": "exec_command",
                "arguments": {"cmd": f"cat log{len(outs)}"}}]}
        recall = next((t["name"] for t in body.get("tools") or []
                       if t.get("name") == "recall_tool_call"), None)
        assert recall, "the proxy's tools went out"
        return {"content": "Checking the first log.", "tool_calls": [{
            "id": "call_rc_1", "name": recall, "arguments": {"call_id": "call_cat_0"}}]}

    upstream.responder = respond
    seen: list[dict[str, Any]] = []
    with socket(proxy, session="hidden-rounds") as ws:
        events = turn(ws, create(input=[DEVELOPER, user("read the logs")], tools=TOOLS))
        seen += events
        for k in range(steps):
            rid = events[-1]["response"]["id"]
            events = turn(ws, create(tools=TOOLS, previous_response_id=rid, input=[
                {"type": "function_call_output", "call_id": f"call_cat_{k}", "output": BIG}]))
            seen += events
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["output"][-1]["content"][0]["text"] == \
        f"recalled {len(BIG)} chars"
    shown = orjson.dumps(seen).decode()
    assert not any(name in shown for name in PROXY_TOOLS) and "call_rc_1" not in shown
    # the round the proxy answered: its output went back whole, the client never saw it
    recalled = upstream.requests[-1]["input"][-1]
    assert recalled["call_id"] == "call_rc_1" and recalled["output"] == BIG
    # every request the upstream got is valid: each call answered, cut outputs say so
    for body in upstream.requests:
        calls = {i["call_id"] for i in body["input"] if i.get("type") == "function_call"}
        outs = {i["call_id"] for i in body["input"] if i.get("type") == "function_call_output"}
        assert calls <= outs | {"call_rc_1"}, calls - outs
    assert len(orjson.dumps(upstream.requests[-2]["input"])) < steps * len(BIG) * 0.5
    assert len(stored(proxy, "hidden-rounds")["branches"]) == 1


def test_errors_are_error_events_with_the_http_status_and_the_socket_goes_on(
        make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """An upstream's 429 (its Retry-After where Codex and the SDK read it), a body the
    proxy refuses, a message that is not JSON, an event it does not know, a steer, and a
    conversation grown past the body limit: each an error event of the status an HTTP
    client would have had, and the next event on the socket is served. Red with the error
    sent without its status (Codex would wait for events that never come) and with the
    socket closed after an error."""
    proxy = make_proxy(config_dir=passthrough(tmp_path, upstream),
                       server={"max_body_bytes": 40_000})
    upstream.push({"status": 429, "headers": {"Retry-After": "7"}, "body": {"error": {
        "message": "Rate limit reached for gpt-5.2-codex", "type": "requests",
        "param": None, "code": "rate_limit_exceeded"}}})
    with socket(proxy) as ws:
        (err,) = turn(ws, create(input="hello"))
        assert err["type"] == "error" and err["status"] == 429
        assert err["error"]["code"] == "rate_limit_exceeded"
        assert err["headers"]["retry-after"] == "7" == err["error"]["headers"]["retry-after"]
        (err,) = turn(ws, {"type": "response.create", "input": "no model"})
        assert (err["status"], err["error"]["param"], err["error"]["type"]) == (
            400, "model", "invalid_request_error")
        ws.send("{not json")
        err = orjson.loads(ws.recv(timeout=10))
        assert err["status"] == 400 and "not valid JSON" in err["error"]["message"]
        (err,) = turn(ws, {"type": "session.update"})
        assert err["status"] == 400 and err["error"]["code"] == "unknown_event_type"
        (failed,) = turn(ws, {"type": "response.steer", "previous_response_id": "resp_9",
                              "input": "stop that"})
        assert failed["type"] == "response.steer.failed"
        assert failed["error"]["code"] == "steering_not_supported"
        assert failed["steer"]["input"] == "stop that"
        ok = turn(ws, create(input="x" * 20_000))
        assert ok[-1]["type"] == "response.completed"
        (err,) = turn(ws, create(input="y" * 20_000,
                                 previous_response_id=ok[-1]["response"]["id"]))
        assert err["status"] == 413 and "server.max_body_bytes" in err["error"]["message"]
        assert turn(ws, create(input="still here"))[-1]["type"] == "response.completed"


def test_an_upstream_failing_mid_stream_is_an_error_event_of_its_status(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """The upstream's stream says it failed (its own error event), or breaks after its
    first event: either way the socket's client gets an error event with a 5xx (Codex
    retries it) and nothing is kept to go on from. Red with the stream's error event
    relayed as it came (no status), and with a cut stream left without an end (the client
    would wait for good)."""
    proxy = make_proxy()
    created = (b'event: response.created\ndata: {"type":"response.created",'
               b'"sequence_number":0,"response":{"id":"resp_cut","object":"response",'
               b'"status":"in_progress","output":[]}}\n\n')
    upstream.push({"raw_chunks": [created, b'event: error\ndata: {"type":"error",'
                                  b'"sequence_number":1,"code":"server_error","message":'
                                  b'"The server had an error","param":null}\n\n']},
                  {"raw_chunks": [created, b"data: {\"type\": \"resp"]})
    with socket(proxy) as ws:
        for _ in range(2):
            events = turn(ws, create(input="hello"))
            assert [e["type"] for e in events] == ["response.created", "error"]
            assert events[-1]["status"] >= 500 and events[-1]["error"]["message"]
        # the cut response is not one to go on from: chained on, it goes upstream as named
        turn(ws, create(input="again", previous_response_id="resp_cut"))
    assert upstream.requests[-1]["previous_response_id"] == "resp_cut"
    assert upstream.requests[-1]["input"] == [user_text("again")]


def user_text(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def test_the_upgrade_is_refused_in_http_in_openais_shape(
        make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """A key that is no tenant's: the handshake gets the 401 an HTTP request would (the
    body OpenAI's error); with the socket turned off, every upgrade gets a 426, which Codex
    reads as "use HTTP" at once. Red with the route answering 403 (Starlette's default,
    which Codex retries five times) and with the key checked only at the first event."""
    cfg = tmp_path / "cfg"
    (cfg / "tenants").mkdir(parents=True)
    (cfg / "runloop.toml").write_text(
        f'[upstreams.up]\nurl = "{upstream.url}"\napi_key = "sk-up"\nmax_retries = 0\n')
    (cfg / "tenants" / "acme.toml").write_text(f'keys = ["{KEY}"]\nupstream = "up"\n')
    proxy = make_proxy(config_dir=str(cfg))
    with pytest.raises(InvalidStatus) as refused:
        socket(proxy, key="sk-proj-" + "n" * 156)
    assert refused.value.response.status_code == 401
    body = orjson.loads(bytes(refused.value.response.body or b"{}"))
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "invalid_api_key"
    with socket(proxy) as ws:  # the tenant's own key is let in
        assert turn(ws, create(input="hi"))[-1]["type"] == "response.completed"
    off = make_proxy(config_dir=str(cfg), server={"websocket": False})
    with pytest.raises(InvalidStatus) as refused:
        socket(off)
    assert refused.value.response.status_code == 426
    assert orjson.loads(bytes(refused.value.response.body or b"{}"))["error"]["code"] == \
        "websocket_not_served"


def test_a_client_that_goes_away_cancels_the_upstream_call(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """The client closes its socket while the model thinks: the upstream call is cancelled
    (the scripted model sees its caller gone) and the request is counted once, as a 499.
    Red with the turn left running after the close, and with a reader that loses the
    disconnect."""
    proxy = make_proxy()
    upstream.delay = 1.5
    with socket(proxy) as ws:
        ws.send(orjson.dumps(create(input="think long")).decode())
        until(lambda: len(upstream.requests) == 1, what="the request to reach the upstream")
    until(lambda: upstream.abandoned == 1, what="the upstream call to be abandoned")
    until(lambda: requests_by_api(proxy).get(("responses_ws", "499")) == 1,
          what="the request to be counted as a 499")
    until(lambda: proxy.state.metrics.websockets._value.get() == 0,
          what="the connection to be closed")


def test_a_socket_outlives_the_request_deadlines_and_closes_when_idle(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """The header and body deadlines are the HTTP request's: a socket idle past both still
    serves its next event; one idle past ``websocket_idle_s`` is closed (1000). Red with
    the body deadline left armed at an upgrade (closed then), and with idle sockets never
    closed."""
    proxy = make_proxy(server={"header_timeout_s": 0.4, "body_timeout_s": 0.7,
                               "websocket_idle_s": 2.5})
    with socket(proxy) as ws:
        time.sleep(1.2)  # past both deadlines
        assert turn(ws, create(input="hi"))[-1]["type"] == "response.completed"
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=20)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000


def test_a_lane_is_echoed_and_the_sdk_reads_every_event(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """The official SDK's ``responses.connect()``: its events parse as its own types, a
    ``stream_id`` comes back on every event of its response, and a turn goes on from the
    last response. Red with the lane dropped from the proxy's own events (a warmup)."""
    import asyncio

    proxy = make_proxy()

    async def run() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=proxy.url, api_key=KEY, max_retries=0)
        got: list[Any] = []
        async with client.responses.connect() as conn:
            for event in ({"generate": False, "input": "warm"}, {"input": "hello"}):
                await conn.send({"type": "response.create", "model": MODEL, "store": False,
                                 "stream_id": "lane-7", **event,
                                 **({"previous_response_id": got[-1].response.id}
                                    if got else {})})
                async for ev in conn:
                    got.append(ev)
                    if ev.type in ("response.completed", "error"):
                        break
        return got

    got = asyncio.run(run())
    assert {ev.stream_id for ev in got} == {"lane-7"}
    assert got[-1].type == "response.completed" and got[-1].response.output_text == \
        "echo: hello"
    assert upstream.requests[-1]["input"] == [user_text("warm"), user_text("hello")]


def test_a_large_conversation_over_the_socket_leaves_little_work_on_the_event_loop(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """test_hardening's bound for every API, over the socket: a ``response.create`` of
    18,000 items leaves under a call an item on the proxy's event loop; one that goes on
    from it with one new item (the conversation expanded from what the connection keeps)
    leaves no more than the same request POSTed whole (its expansion, check and
    serialising run in a worker thread). Red with the expansion kept on the loop."""
    from .test_hardening import _loop_calls

    # Redis given time: a write of 18,000 messages timed out on a loaded machine, and its
    # retries (the loop's work too) made the count the machine's, not the request's
    proxy = make_proxy(store={"timeout_s": 10.0})
    upstream.keep_requests = False
    n = 18_000
    items = [{"type": "message", "role": "user" if i % 2 == 0 else "assistant",
              "content": f"item {i}"} for i in range(n + 1)]
    with socket(proxy, session="loop-warm") as ws:  # what a process loads once
        turn(ws, create(input=items[:201]))
    with socket(proxy, session="loop-large") as ws:
        got: list[dict[str, Any]] = []
        calls = _loop_calls(proxy, lambda: got.extend(turn(ws, create(input=items))))
        assert got[-1]["type"] == "response.completed", got[-1]
        assert calls < n, f"{calls / n:.1f} calls per item on the event loop"
        first = got[-1]["response"]
        got.clear()
        over_ws = _loop_calls(proxy, lambda: got.extend(turn(ws, create(
            input=[user("one more")], previous_response_id=first["id"]))))
        assert got[-1]["type"] == "response.completed", got[-1]
    # the same two requests over HTTP, the second carrying the whole conversation
    headers = {"Authorization": f"Bearer {KEY}", "session-id": "loop-http"}

    def post(body_input: list[dict[str, Any]]) -> httpx.Response:
        r = httpx.post(proxy.url + "/responses", headers=headers, timeout=120, json={
            "model": MODEL, "store": False, "stream": True, "input": body_input})
        assert r.status_code == 200, r.text[:300]
        return r

    done = [orjson.loads(line[6:]) for line in post(items).text.splitlines()
            if line.startswith("data: ")][-1]["response"]["output"]
    over_http = _loop_calls(proxy, lambda: post([*items, *done, user("one more")]))
    assert over_ws < 1.2 * over_http + 2_000, (over_ws, over_http)
