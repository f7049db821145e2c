"""No tenant's traffic becomes another's latency: each bounded resource (an upstream's
connections, room for answers read whole) has a share per tenant and a process bound
(``pipeline/shares.py``). Shown by the order of events, not by timing: tenant B's request
is answered while tenant A's slow requests still hold their share; A's excess gets a 429
and, once every tenant's share together fills the pool, a third tenant a 503, each with
Retry-After in its API's shape; what a request held is given back when it ends, however
it ends (its client gone included)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from runloop_proxy.errors import ProxyFull, TenantOverShare
from runloop_proxy.pipeline.shares import Held, Shares
from runloop_proxy.scripted import ScriptedUpstream

from .keys import openai_project_key

KEYS = {name: f"sk-{name}-proxy-{openai_project_key(k)[8:40]}"
        for k, name in enumerate(("acme", "globex", "initech"))}
CHAT = {"model": "gpt-4o-2024-08-06", "messages": [{"role": "user", "content": "hi"}]}
SLOW = {"x-scripted-delay-ms": "60000"}  # far longer than the test: held until cancelled
POOL = 4  # the upstream's connections; a tenant's share: 2


def config(root: Path, url: str) -> Path:
    (root / "tenants").mkdir(parents=True)
    (root / "runloop.toml").write_text(f"""
[server]
tenant_share = 0.5
[upstreams.main]
url = "{url}"
api_key = "sk-shared-upstream-0123456789"
max_connections = {POOL}
max_retries = 0
""")
    for k, (name, key) in enumerate(KEYS.items()):
        (root / "tenants" / f"{name}.toml").write_text(
            f'keys = ["{key}"]\nupstream = "main"\n'
            f'upstream_key = "{openai_project_key(10 + k)}"\n')
    return root


async def eventually(cond: Any, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.02)


async def test_a_tenant_holding_its_share_of_connections_costs_another_nothing(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Finding: every tenant of an upstream shared one pool; with it at 8, a tenant holding
    8 slow requests made another wait 5.2 s. Planted, red: no share per tenant (the
    holder's bound the pool's: B waited behind A); a connection not given back when its
    client went away (the last request refused)."""
    proxy = make_proxy(config_dir=str(config(tmp_path / "cfg", upstream.url)))
    client = proxy.state.upstreams["main"]

    async with httpx.AsyncClient(base_url=proxy.url, timeout=90) as c:
        def send(tenant: str, headers: dict[str, str] | None = None,
                 path: str = "/chat/completions") -> Any:
            body = CHAT if path == "/chat/completions" else {**CHAT, "max_tokens": 16}
            return c.post(path, json=body, headers={
                "Authorization": f"Bearer {KEYS[tenant]}", **(headers or {})})

        acme = [asyncio.ensure_future(send("acme", SLOW)) for _ in range(POOL)]
        await eventually(lambda: len(upstream.requests) == 2 and
                         sum(t.done() for t in acme) == 2, "acme's two over its share")
        refused = [t.result() for t in acme if t.done()]
        held = [t for t in acme if not t.done()]
        for r in refused:  # its own excess: a 429 at once, nothing sent upstream
            assert r.status_code == 429, r.text
            assert r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "tenant_share_exceeded"
            assert r.json()["error"]["type"] == "rate_limit_error"
        # globex is answered while acme's two still hold their connections
        r = await send("globex")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        assert not any(t.done() for t in held)
        # Anthropic's shape for acme's excess under /v1/messages
        r = await send("acme", path="/messages")
        assert r.status_code == 429
        assert r.json() == {"type": "error", "error": {
            "type": "rate_limit_error", "message": r.json()["error"]["message"]}}
        # globex fills the rest: the pool is full, within every share, so initech gets a 503
        globex = [asyncio.ensure_future(send("globex", SLOW)) for _ in range(2)]
        await eventually(lambda: client.connections.in_use == POOL, "the pool full")
        r = await send("initech")
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "proxy_full"
        assert len(upstream.requests) == 5  # nothing refused went upstream
        for t in [*held, *globex]:  # their clients go away: what they held comes back
            t.cancel()
        await asyncio.gather(*held, *globex, return_exceptions=True)
        await eventually(lambda: client.connections.in_use == 0, "the connections back")
        r = await send("initech")
        assert r.status_code == 200, r.text
    text = (await asyncio.to_thread(httpx.get, proxy.base + "/metrics")).text
    assert 'runloop_share_refusals_total{reason="tenant",resource="connections"} 3.0' in text
    assert 'runloop_share_refusals_total{reason="process",resource="connections"} 1.0' in text


def test_a_share_refuses_past_the_holder_then_past_the_process() -> None:
    told: list[tuple[str, str]] = []
    shares = Shares("room for answers read whole", 100, 0.4, lambda r, w: told.append((r, w)))
    shares.take("a", 40)
    with pytest.raises(TenantOverShare):
        shares.take("a", 1)
    shares.take("b", 40)
    with pytest.raises(ProxyFull):
        shares.take("c", 21)
    assert shares.in_use == 80 and shares.held("c") == 0
    assert told == [("room for answers read whole", "tenant"),
                    ("room for answers read whole", "process")]
    held = Held(shares, "c")
    held.take(20)
    held.release()
    held.release()  # once
    shares.give("a", 40)
    shares.give("b", 1000)  # never more than it holds
    assert shares.in_use == 0 and shares.held("a") == shares.held("b") == 0
    assert not shares._held  # nothing kept for holders that hold nothing


async def test_an_answer_read_whole_holds_its_bytes_until_its_request_ends(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Finding: answers the proxy holds whole were bounded per request only (10 x 20 MiB
    took the RSS from 232 to 947 MB). Now the bytes of an answer read whole are held in
    its tenant's share of ``held_answers_mb`` until its request ends: one past the share
    is a 429, and when it is done the room is back. Planted, red: the bytes given back at
    the read's end only when it succeeds (a refused read kept them); the relay's read
    never handing its bytes to the request's end (kept for good)."""
    proxy = make_proxy(config_dir=str(config(tmp_path / "cfg", upstream.url)),
                       server={"held_answers_mb": 2, "tenant_share": 0.5})
    answers = proxy.state.answers
    big = "x" * (1 << 20)  # a 1 MiB answer: past acme's 1 MiB share once it is JSON
    upstream.push({"content": big})
    async with httpx.AsyncClient(base_url=proxy.url, timeout=60) as c:
        # read whole: the answer of a request whose client sends tools (the proxy's ride)
        body = {**CHAT, "tools": [{"type": "function", "function": {
            "name": "look", "parameters": {"type": "object"}}}]}
        r = await c.post("/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {KEYS['acme']}"})
        assert r.status_code == 429, r.text
        assert "answers read whole" in r.json()["error"]["message"]
        assert answers.in_use == 0
        upstream.push({"content": "y" * 300_000})
        r = await c.post("/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {KEYS['acme']}"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "y" * 300_000
    await eventually(lambda: answers.in_use == 0, "the room given back")


@pytest.mark.parametrize(("held_mb", "share", "answer", "ok"), [
    (256, 0.5, 64 << 20, True), (64, 0.5, 64 << 20, False), (64, 1.0, 64 << 20, True),
    (3, 0.34, 1 << 20, True), (3, 0.33, 1 << 20, False)])
def test_a_share_of_answers_holds_one_answer_of_the_largest_size(
        held_mb: int, share: float, answer: int, ok: bool) -> None:
    """A config whose tenant share of answers read whole is smaller than the largest answer
    the proxy reads whole is refused where it is read (no tenant could read one)."""
    from pydantic import ValidationError

    from runloop_proxy.config import ServerSection

    fields = {"held_answers_mb": held_mb, "tenant_share": share, "max_answer_bytes": answer}
    if ok:
        assert ServerSection(**fields).held_answers_mb == held_mb
    else:
        with pytest.raises(ValidationError, match="must hold one answer of max_answer_bytes"):
            ServerSection(**fields)


@pytest.mark.parametrize("api", ["chat", "responses", "messages", "bridge"])
def test_a_refusal_mid_stream_is_the_streams_error_event_with_its_status(api: str) -> None:
    """A proxy tool round refused for its tenant's share after the stream began: the
    client's SDK reads the 429's message and code in its API's error event, not an
    internal error. Planted, red: the wires' error events knowing UpstreamError only."""
    import orjson

    from runloop_proxy.api.bridge import BridgeWire
    from runloop_proxy.api.chat_wire import ChatWire
    from runloop_proxy.api.messages_wire import MessagesWire
    from runloop_proxy.api.responses_wire import ResponsesWire

    wire = {"chat": ChatWire, "responses": ResponsesWire, "messages": MessagesWire,
            "bridge": BridgeWire}[api]()
    request = {"model": "gpt-4o-2024-08-06", "stream": True, "max_tokens": 16,
               "messages": [{"role": "user", "content": "hi"}], "input": "hi"}
    refused = TenantOverShare("this caller holds its share of the proxy's connections")
    event = wire.relay(request).error(refused)  # type: ignore[attr-defined]
    data = orjson.loads(event.split(b"data: ", 1)[1])
    if api in ("messages", "bridge"):
        assert data["error"]["type"] == "rate_limit_error"
        assert data["error"]["message"] == str(refused)
    elif api == "responses":
        assert data["code"] == "tenant_share_exceeded" and data["message"] == str(refused)
    else:
        assert data["error"]["code"] == "tenant_share_exceeded"


LARGE_SHARE = 2  # a tenant's share of server.large_requests (4, at tenant_share 0.5)


def _large_body(tenant: str, k: int) -> dict[str, Any]:
    """A chat request whose body is large enough to be worked on in a worker thread: an
    agent's 160 KB tool result (distinct ids), as a huge context brings."""
    ids = " ".join(f"{tenant}-{k}-{n:08x}-4f3a-9c1e-{n * 7919:012x}" for n in range(3600))
    return {"model": "gpt-4o-2024-08-06", "messages": [
        {"role": "user", "content": "what failed?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{k:024d}", "type": "function",
            "function": {"name": "read_log", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": f"call_{k:024d}", "content": ids}]}


async def test_one_tenants_large_bodies_leave_the_worker_threads_to_the_others(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Finding: the CPU work of a large body (parsing, counting, the window) ran in worker
    threads any tenant could fill, so one tenant flooding huge bodies stalled the others'.
    Now a request with a large body holds one of its tenant's share of
    ``server.large_requests`` (the worker threads) until it ends: acme's third concurrent
    large request is a 429 with Retry-After in the API's shape, globex's large and small
    requests are served meanwhile, and once every share together fills the bound initech
    gets a 503; what was held comes back when the requests end, their clients gone too.
    Shown by the order of events, not by timings (``bench/hostile.py``'s two-tenant row
    measures the latency). Planted, red: one holder for every caller (acme never held its
    share: one process-wide count); a unit not given back when its request ended (globex
    still held one after its answer)."""
    root = config(tmp_path / "cfg", upstream.url)
    toml = (root / "runloop.toml").read_text()
    (root / "runloop.toml").write_text(toml.replace(
        "tenant_share = 0.5\n", f"tenant_share = 0.5\nlarge_requests = {2 * LARGE_SHARE}\n")
        .replace(f"max_connections = {POOL}", "max_connections = 16"))
    proxy = make_proxy(config_dir=str(root))
    large = proxy.state.large

    async with httpx.AsyncClient(base_url=proxy.url, timeout=90) as c:
        def send(tenant: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                 path: str = "/chat/completions") -> Any:
            return c.post(path, json=body, headers={
                "Authorization": f"Bearer {KEYS[tenant]}", **(headers or {})})

        acme = [asyncio.ensure_future(send("acme", _large_body("acme", k), SLOW))
                for k in range(LARGE_SHARE + 1)]
        await eventually(lambda: sum(t.done() for t in acme) == 1 and
                         large.held("acme") == LARGE_SHARE,
                         "acme's large request over its share refused")
        refused = next(t.result() for t in acme if t.done())
        assert refused.status_code == 429, refused.text
        assert refused.headers["Retry-After"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "tenant_share_exceeded" and error["type"] == "rate_limit_error"
        assert "large requests" in error["message"]
        held = [t for t in acme if not t.done()]
        # globex is served, large and small, while acme holds its share
        r = await send("globex", _large_body("globex", 0))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        r = await send("globex", CHAT)
        assert r.status_code == 200, r.text
        assert not any(t.done() for t in held) and large.held("globex") == 0
        # Anthropic's shape for acme's excess under /v1/messages
        body = {**_large_body("acme", 9), "max_tokens": 16}
        body["messages"] = [{"role": "user", "content": body["messages"][2]["content"]}]
        r = await send("acme", body, path="/messages")
        assert r.status_code == 429, r.text
        assert r.json() == {"type": "error", "error": {
            "type": "rate_limit_error", "message": r.json()["error"]["message"]}}
        # globex takes its share too: the bound is full, within every share -> initech 503
        globex = [asyncio.ensure_future(send("globex", _large_body("globex", k), SLOW))
                  for k in (1, 2)]
        await eventually(lambda: large.in_use == 2 * LARGE_SHARE, "the bound full")
        r = await send("initech", _large_body("initech", 0))
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "proxy_full"
        r = await send("initech", CHAT)  # a small body holds none: served
        assert r.status_code == 200, r.text
        for t in [*held, *globex]:  # their clients go away: what they held comes back
            t.cancel()
        await asyncio.gather(*held, *globex, return_exceptions=True)
        await eventually(lambda: large.in_use == 0, "the large requests' units back")
        r = await send("initech", _large_body("initech", 1))
        assert r.status_code == 200, r.text
    text = (await asyncio.to_thread(httpx.get, proxy.base + "/metrics")).text
    assert 'runloop_share_refusals_total{reason="tenant",resource="large requests"} 2.0' in text
    assert 'runloop_share_refusals_total{reason="process",resource="large requests"} 1.0' \
        in text


def _one_large_each(root: Path, shared: tuple[str, ...] = ()) -> Path:
    """A config whose tenants hold one large request each (``server.large_requests`` 2 at
    tenant_share 0.5); ``shared``: the tenants that use the upstream's own key together."""
    toml = (root / "runloop.toml").read_text()
    (root / "runloop.toml").write_text(toml.replace(
        "tenant_share = 0.5\n", "tenant_share = 0.5\nlarge_requests = 2\n")
        .replace(f"max_connections = {POOL}", "max_connections = 16"))
    for name in shared:
        (root / "tenants" / f"{name}.toml").write_text(
            f'keys = ["{KEYS[name]}"]\nupstream = "main"\n')
    return root


def _large_inputs(tenant: str, k: int) -> dict[str, Any]:
    """An embeddings request of 2,400 inputs (a repository's chunks, ~170 KB): a body the
    proxy walks for the stored objects it names when the key is other tenants' too."""
    return {"model": "text-embedding-3-small", "input": [
        f"{tenant}/{k}/src/module_{n:04d}.py: def handler_{n}(event, context): return "
        f"route(event['{n * 7919:08x}'])" for n in range(2400)]}


async def test_a_large_pass_through_body_the_proxy_walks_holds_a_large_request(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Finding: a pass-through body the proxy walks in a worker thread (the stored objects
    it names, for a key other tenants share) held no unit of ``server.large_requests``, so
    a tenant could keep every worker thread busy through /v1/embeddings whatever its share.
    Now it holds one until its answer is done: with acme's share at one and its large
    embeddings request held upstream, a second large one is a 429 in OpenAI's shape while
    its small one and globex's large one are served; the unit is back once the held
    request's client goes away. A body relayed unread (initech's own key) holds none.
    Found on the way: a pass-through client gone before the answer left the upstream call
    (and what it held) running until the upstream answered; now it is cancelled. Planted,
    red: the pass-through taking no unit (acme's second large request a 200); the unit not
    given back when the client went away before the answer (never back)."""
    root = _one_large_each(config(tmp_path / "cfg", upstream.url), shared=("acme", "globex"))
    proxy = make_proxy(config_dir=str(root))
    large = proxy.state.large
    assert large.per_holder == 1

    async with httpx.AsyncClient(base_url=proxy.url, timeout=90) as c:
        def send(tenant: str, body: dict[str, Any], headers: dict[str, str] | None = None
                 ) -> Any:
            return c.post("/embeddings", json=body, headers={
                "Authorization": f"Bearer {KEYS[tenant]}", **(headers or {})})

        held = asyncio.ensure_future(send("acme", _large_inputs("acme", 0), SLOW))
        await eventually(lambda: upstream.embedded == 1, "acme's large request upstream")
        assert large.held("acme") == 1
        r = await send("acme", _large_inputs("acme", 1))
        assert r.status_code == 429, r.text
        assert r.headers["Retry-After"] == "1"
        error = r.json()["error"]
        assert error["code"] == "tenant_share_exceeded" and error["type"] == "rate_limit_error"
        assert "large requests" in error["message"] and "(1 of 2)" in error["message"]
        assert upstream.embedded == 1  # nothing refused went upstream
        small = {"model": "text-embedding-3-small", "input": ["def handler(event): ..."]}
        r = await send("acme", small)
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 1
        r = await send("globex", _large_inputs("globex", 0))
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 2400
        assert large.held("globex") == 0  # given back with its answer
        # initech's own key: its body goes unread, so it holds nothing even past a share
        initech = asyncio.ensure_future(send("initech", _large_inputs("initech", 0), SLOW))
        await eventually(lambda: upstream.embedded == 4, "initech's request upstream")
        assert large.held("initech") == 0
        r = await send("initech", _large_inputs("initech", 1))
        assert r.status_code == 200, r.text
        assert not held.done() and large.held("acme") == 1
        for t in (held, initech):  # their clients go away: what acme held comes back
            t.cancel()
        await asyncio.gather(held, initech, return_exceptions=True)
        await eventually(lambda: large.in_use == 0, "acme's unit back")
        r = await send("acme", _large_inputs("acme", 2))
        assert r.status_code == 200, r.text
    text = (await asyncio.to_thread(httpx.get, proxy.base + "/metrics")).text
    assert 'runloop_share_refusals_total{reason="tenant",resource="large requests"} 1.0' in text


async def test_a_small_turn_on_a_large_stored_conversation_holds_a_large_request(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Finding: in server-history mode (``X-Runloop-History: server``) the proxy works on
    the stored conversation with the new message in worker threads when it is large, but a
    small request body held no unit of ``server.large_requests``: a tenant's one-line turns
    on large sessions could fill every worker thread. Now the stored conversation's size
    counts as the body's does: with acme's share at one and one such turn held upstream, a
    second one (another large session) is a 429 in OpenAI's shape, a turn on a small
    session is served, and the unit is back when the held turn's client goes away.
    Planted, red: no unit taken for the stored conversation (the second turn a 200); the
    unit taken twice when the body was large too (the session's first turn a 429)."""
    root = _one_large_each(config(tmp_path / "cfg", upstream.url))
    proxy = make_proxy(config_dir=str(root))
    large = proxy.state.large

    async with httpx.AsyncClient(base_url=proxy.url, timeout=90) as c:
        def send(session: str, messages: list[dict[str, Any]],
                 headers: dict[str, str] | None = None) -> Any:
            return c.post("/chat/completions", json={
                "model": "gpt-4o-2024-08-06", "messages": messages}, headers={
                "Authorization": f"Bearer {KEYS['acme']}", "X-Runloop-History": "server",
                "X-Session-Id": session, **(headers or {})})

        # two sessions whose first turn brings a 160 KB tool result; one that stays small
        for k, session in enumerate(("incident-4121", "incident-4122")):
            r = await send(session, _large_body("acme", k)["messages"])
            assert r.status_code == 200, r.text
        r = await send("standup-notes", [{"role": "user", "content": "what is left today?"}])
        assert r.status_code == 200, r.text
        await eventually(lambda: large.in_use == 0, "the first turns' units back")
        ask = [{"role": "user", "content": "and which host logged it first?"}]
        sent = len(upstream.requests)
        held = asyncio.ensure_future(send("incident-4121", ask, SLOW))
        await eventually(lambda: len(upstream.requests) == sent + 1, "the turn upstream")
        assert large.held("acme") == 1
        # what went upstream is the stored conversation with the new message
        assert len(upstream.requests[-1]["messages"]) >= 4
        r = await send("incident-4122", ask)
        assert r.status_code == 429, r.text
        assert r.headers["Retry-After"] == "1"
        error = r.json()["error"]
        assert error["code"] == "tenant_share_exceeded" and "large requests" in error["message"]
        assert len(upstream.requests) == sent + 1
        r = await send("standup-notes", ask)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        await eventually(lambda: large.in_use == 0, "the held turn's unit back")
        r = await send("incident-4122", ask)
        assert r.status_code == 200, r.text


BASH = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}}}}]


async def test_a_trimmed_history_continuing_a_large_conversation_holds_a_large_request(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Finding: a small request whose trimmed history lines up with a large stored
    conversation (a client that dropped its old messages) has that conversation read,
    matched and counted in worker threads, but held no unit of ``server.large_requests``.
    Now it holds one as a large body does: with acme's share at one and one such request
    held upstream, a second (lining up with another large conversation) is a 429, a small
    request continuing nothing is served, the unit is back when the held one's client goes
    away. Planted, red: no unit taken for the continued conversation (the second a 200)."""
    root = _one_large_each(config(tmp_path / "cfg", upstream.url))
    proxy = make_proxy(config_dir=str(root))
    large = proxy.state.large

    async with httpx.AsyncClient(base_url=proxy.url, timeout=90) as c:
        def send(messages: list[dict[str, Any]], headers: dict[str, str] | None = None
                 ) -> Any:
            return c.post("/chat/completions", json={
                "model": "gpt-4o-2024-08-06", "messages": messages, "tools": BASH}, headers={
                "Authorization": f"Bearer {KEYS['acme']}", **(headers or {})})

        def call(k: int) -> dict[str, Any]:
            return {"id": f"call_{k:04d}Qm3vR8sLx2TfWb9KpZ", "type": "function",
                    "function": {"name": "bash", "arguments": '{"cmd":"grep -c ERROR"}'}}

        for k in (1, 2):  # two agents' sessions, each with a 160 KB log read into it
            upstream.push({"tool_calls": [{"id": call(k)["id"], "name": "bash",
                                           "arguments": {"cmd": "grep -c ERROR"}}]})
            r = await send([{"role": "system", "content": f"You are on-call agent {k}."},
                            *_large_body("acme", k)["messages"],
                            {"role": "user", "content": "count the errors"}])
            assert r.status_code == 200, r.text
        await asyncio.to_thread(proxy.settle)

        def trimmed(k: int) -> list[dict[str, Any]]:  # the old messages dropped
            return [{"role": "system", "content": f"You are on-call agent {k}."},
                    {"role": "assistant", "content": None, "tool_calls": [call(k)]},
                    {"role": "tool", "tool_call_id": call(k)["id"], "content": "4121"},
                    {"role": "user", "content": "which host logged the first one?"}]

        sent = len(upstream.requests)
        held = asyncio.ensure_future(send(trimmed(1), SLOW))
        await eventually(lambda: len(upstream.requests) == sent + 1, "the trimmed one upstream")
        assert large.held("acme") == 1
        r = await send(trimmed(2))
        assert r.status_code == 429, r.text
        error = r.json()["error"]
        assert error["code"] == "tenant_share_exceeded" and "large requests" in error["message"]
        r = await send([{"role": "user", "content": "what is left today?"}])
        assert r.status_code == 200, r.text
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        await eventually(lambda: large.in_use == 0, "the held request's unit back")
        r = await send(trimmed(2))
        assert r.status_code == 200, r.text
        assert large.in_use == 0


async def test_a_reload_that_changes_large_requests_bounds_the_next_request(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Finding: ``server.large_requests`` was read once, at start: a reload (a file change,
    SIGHUP) that lowered it left every tenant its old share, and the worker threads their
    old number. Now the reload resizes the bound, the share and the threads for the next
    request: at 8 (acme's share 4) two of acme's large requests are held upstream at once;
    the file edited to 2 (a share of 1), one held and the second a 429 saying 1 of 2; the
    worker threads 2 + 4. Planted, red: the reload resizing no Shares (still (8, 4)); the
    share's per-tenant part kept ((2, 4)); the worker threads not made again (12)."""
    from runloop_proxy.state import BACKGROUND_WORKERS

    root = config(tmp_path / "cfg", upstream.url)
    toml = root / "runloop.toml"
    toml.write_text(toml.read_text().replace(
        "tenant_share = 0.5\n", "tenant_share = 0.5\nlarge_requests = 8\n")
        .replace(f"max_connections = {POOL}", "max_connections = 16"))
    proxy = make_proxy(config_dir=str(root))
    large = proxy.state.large
    assert (large.total, large.per_holder) == (8, 4)

    async with httpx.AsyncClient(base_url=proxy.url, timeout=90) as c:
        def send(k: int, headers: dict[str, str] | None = None) -> Any:
            return c.post("/chat/completions", json=_large_body("acme", k), headers={
                "Authorization": f"Bearer {KEYS['acme']}", **(headers or {})})

        held = [asyncio.ensure_future(send(k, SLOW)) for k in (0, 1)]
        await eventually(lambda: large.held("acme") == 2 and len(upstream.requests) == 2,
                         "two large requests held at 8")
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await eventually(lambda: large.in_use == 0, "their units back")

        reloads = proxy.state.metrics.config_reloads.labels("ok")
        done = reloads._value.get()
        toml.write_text(toml.read_text().replace("large_requests = 8", "large_requests = 2"))
        os.utime(toml, (time.time() + 5, time.time() + 5))  # a change the poll sees
        await eventually(lambda: reloads._value.get() > done, "the edit reloaded", 30)
        assert (large.total, large.per_holder) == (2, 1)
        assert proxy.state._workers is not None
        assert proxy.state._workers[1] == 2 + BACKGROUND_WORKERS

        one = asyncio.ensure_future(send(2, SLOW))
        await eventually(lambda: large.held("acme") == 1 and len(upstream.requests) == 3,
                         "one large request held at 2")
        r = await send(3)
        assert r.status_code == 429, r.text
        assert "(1 of 2)" in r.json()["error"]["message"]
        assert len(upstream.requests) == 3
        one.cancel()
        await asyncio.gather(one, return_exceptions=True)
        await eventually(lambda: large.in_use == 0, "its unit back")
        r = await send(4)
        assert r.status_code == 200, r.text


async def test_a_reload_resizes_a_tenants_share_of_connections_and_the_summary_calls(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Finding: a reload resized every Shares but two: an upstream's connections kept the
    ``tenant_share`` it was made with (its client is made again only when its spec
    changes), and the summaries' model calls kept ``summary_calls`` and its share, until a
    restart. Now: ``tenant_share`` 0.5 -> 0.25 by the file, the upstream's client is kept and
    acme's share of its 12 connections is 3 (three held, the fourth a 429 saying 3 of 12),
    the summary calls' share 8 of 32; then ``summary_calls`` 32 -> 6, the upstream's client
    is made again with 6 connections kept for them (a pool of 18), the summary calls 6, 1
    each."""
    root = config(tmp_path / "cfg", upstream.url)
    toml = root / "runloop.toml"
    toml.write_text(toml.read_text().replace(f"max_connections = {POOL}",
                                             "max_connections = 12"))
    proxy = make_proxy(config_dir=str(root))
    state = proxy.state
    client = state.upstreams["main"]
    assert (client.connections.total, client.connections.per_holder) == (12, 6)
    assert (state.summaries.calls.total, state.summaries.calls.per_holder) == (32, 16)
    reloads = state.metrics.config_reloads.labels("ok")

    async def edited(old: str, new: str) -> None:
        done = reloads._value.get()
        toml.write_text(toml.read_text().replace(old, new))
        os.utime(toml, (time.time() + 5, time.time() + 5))  # a change the poll sees
        await eventually(lambda: reloads._value.get() > done, "the edit reloaded", 30)

    await edited("tenant_share = 0.5\n", "tenant_share = 0.25\n")
    assert state.upstreams["main"] is client  # its spec did not change: kept
    assert (client.connections.total, client.connections.per_holder) == (12, 3)
    assert (state.summaries.calls.total, state.summaries.calls.per_holder) == (32, 8)
    async with httpx.AsyncClient(base_url=proxy.url, timeout=90) as c:
        def send(headers: dict[str, str] | None = None) -> Any:
            return c.post("/chat/completions", json=CHAT, headers={
                "Authorization": f"Bearer {KEYS['acme']}", **(headers or {})})

        held = [asyncio.ensure_future(send(SLOW)) for _ in range(3)]
        await eventually(lambda: client.connections.held("acme") == 3
                         and len(upstream.requests) == 3, "three held at a share of 3")
        r = await send()
        assert r.status_code == 429, r.text
        assert "(3 of 12)" in r.json()["error"]["message"]
        assert len(upstream.requests) == 3
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await eventually(lambda: client.connections.in_use == 0, "the connections back")

    await edited("tenant_share = 0.25\n", "tenant_share = 0.25\nsummary_calls = 6\n")
    remade = state.upstreams["main"]
    assert remade is not client
    assert remade.summary_connections == 6
    assert remade._session is not None and remade._session.connector is not None
    assert remade._session.connector.limit == 12 + 6
    assert (remade.connections.total, remade.connections.per_holder) == (12, 3)
    assert (state.summaries.calls.total, state.summaries.calls.per_holder) == (6, 1)

