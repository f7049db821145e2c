"""Shadow calls end to end: a real proxy on a loopback port, the scripted upstream as a model
that decides from what its window holds, the openai SDK as the client, a real Redis."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from websockets.sync.client import connect

from runloop_proxy.scripted import ScriptedUpstream
from tests.conftest import ProxyServer, RedisServer, serve_command, until
from tests.keys import anthropic_key, openai_project_key
from tests.parcels import (
    ANTHROPIC_TOOLS,
    CHAT_TOOLS,
    FOUND,
    HIDDEN,
    KEPT,
    NOT_FOUND,
    RESPONSES_TOOLS,
    RESULT,
    SYSTEM,
    anthropic_turns,
    conversation,
    decides_from_its_window,
    response_items,
)
from tests.policies import mechanism_toml

MODEL = "gpt-4.1-mini-2025-04-14"
CLIENT_KEY = openai_project_key(7)
UPSTREAM_KEY = openai_project_key(8)
ADMIN_KEY = "adm-" + "k" * 40


@pytest.fixture
def shadowing(tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> Any:
    def make(policy: str, upstream_format: str = "any", upstream_key: str = UPSTREAM_KEY,
             **proxy: Any) -> ProxyServer:
        root = tmp_path / f"cfg{len(list(tmp_path.iterdir()))}"
        (root / "tenants").mkdir(parents=True)
        (root / "runloop.toml").write_text(
            f'[server]\nadmin_key = "{ADMIN_KEY}"\n'
            f'[upstreams.main]\nurl = "{upstream.url}"\napi_key = "{upstream_key}"\n'
            f'format = "{upstream_format}"\n'
            f'max_retries = 0\n[defaults]\nupstream = "main"\n'
            f'[defaults.policy]\n{mechanism_toml()}')  # a hidden result stays hidden
        (root / "tenants" / "parcels.toml").write_text(
            f'keys = ["{CLIENT_KEY}"]\n[policy]\nreduce_at_least = 8\nnames_kept = 0\n'
            f'{policy}')
        return make_proxy(config_dir=str(root), **proxy)  # type: ignore[no-any-return]
    upstream.responder = decides_from_its_window
    return make


def _ask(proxy: ProxyServer, final: str, **kw: Any) -> str:
    client = openai.OpenAI(base_url=proxy.url, api_key=CLIENT_KEY, max_retries=0)
    answer = client.chat.completions.create(model=MODEL, messages=conversation(final),  # type: ignore[arg-type]
                                            tools=CHAT_TOOLS, seed=4417, temperature=0, **kw)
    return answer.choices[0].message.content or ""


def _report(proxy: ProxyServer) -> dict[str, Any]:
    r = httpx.get(proxy.base + "/admin/shadow", params={"tenant": "parcels"},
                  headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _metric(proxy: ProxyServer, name: str, **labels: str) -> float:
    value = proxy.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_hidden_information_is_a_measured_disagreement(
        shadowing: Any, upstream: ScriptedUpstream) -> None:
    """The compressed window hid the tool result naming the order: the client's answer says
    it sees none, the shadow call (the request as sent) names it; a disagreement on the text
    basis, both steps side by side in the admin API, counted by lever, its cost in tokens.
    The shadow call carries nothing the client's request did not: its body is the client's
    (stream off), its key the tenant's upstream key. Bug class: the shadow compared with
    itself. Planted: the shadow step taken from the client's answer (an agreement: red), and
    the shadow's spend not added to the ledger (red), the inspector's section left empty (red)."""
    proxy = shadowing("shadow_rate = 1.0\n")
    got = _ask(proxy, HIDDEN)
    assert got == NOT_FOUND
    until(lambda: _report(proxy)["by_lever"].get("any"), what="the shadow comparison")
    report = _report(proxy)
    assert report["by_lever"]["any"] == {"agree": 0, "differ": 1, "error": 0}
    assert report["by_lever"]["past_loops"] == {"agree": 0, "differ": 1, "error": 0}
    (rec,) = report["recent"]
    assert (rec["outcome"], rec["basis"], rec["levers"]) == ("differ", "text", ["past_loops"])
    assert rec["compressed"]["text"] == got
    assert rec["full"]["text"] == FOUND
    assert rec["tokens"] > 1_000 and report["tokens"] == rec["tokens"]
    assert _metric(proxy, "runloop_shadow_comparisons_total", tenant="parcels",
                   lever="past_loops", outcome="differ") == 1
    assert _metric(proxy, "runloop_shadow_tokens_total", tenant="parcels") == rec["tokens"]
    # two calls upstream: the compressed one, then the shadow (the client's body, whole)
    assert len(upstream.requests) == 2
    compressed, shadow = upstream.requests
    assert "ORD-7731" not in str(compressed["messages"])
    assert shadow["messages"] == conversation(HIDDEN)
    assert {k: v for k, v in shadow.items() if k != "messages"} == {
        "model": MODEL, "tools": CHAT_TOOLS, "seed": 4417, "temperature": 0}
    assert upstream.headers[1]["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert CLIENT_KEY not in str(upstream.headers[1])
    # the inspector's session page: the two next steps side by side
    ui = httpx.Client(base_url=proxy.base)
    assert ui.post("/admin/ui/login", data={"key": ADMIN_KEY}).status_code == 303
    page = ui.get("/admin/ui/session", params={"tenant": "parcels",
                                                "id": rec["session"]}).text
    shadow_part = page.split("<h2>Shadow comparisons</h2>", 1)[1]
    assert FOUND in shadow_part and got in shadow_part
    assert "<td>differ</td><td>past_loops</td><td>text</td>" in shadow_part


def test_information_kept_is_an_agreement(shadowing: Any, upstream: ScriptedUpstream) -> None:
    """The loop's final answer named the order, so the compressed window kept what the next
    step needs: both answers name it, an agreement. Streamed, the shadow goes whole. Planted:
    stream_options kept in the shadow's body (red)."""
    proxy = shadowing("shadow_rate = 1.0\n")
    client = openai.OpenAI(base_url=proxy.url, api_key=CLIENT_KEY, max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=conversation(KEPT),  # type: ignore[arg-type]
        tools=CHAT_TOOLS, stream=True, stream_options={"include_usage": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == FOUND
    until(lambda: _report(proxy)["by_lever"].get("any"), what="the shadow comparison")
    report = _report(proxy)
    assert report["by_lever"]["any"] == {"agree": 1, "differ": 0, "error": 0}
    assert report["recent"][0]["full"] is None  # an agreement keeps no texts
    assert upstream.requests[1]["stream"] is False
    assert "stream_options" not in upstream.requests[1]


def test_shadow_mode_is_off_by_default(shadowing: Any, upstream: ScriptedUpstream) -> None:
    """Default policy: one upstream call, nothing recorded. Planted: shadow_rate's default 1
    (red)."""
    proxy = shadowing("")
    _ask(proxy, HIDDEN)
    proxy.settle()
    assert len(upstream.requests) == 1
    assert _report(proxy)["by_lever"] == {}


def test_the_daily_cap_stops_the_calls_and_says_so(
        shadowing: Any, upstream: ScriptedUpstream) -> None:
    """A cap of 1000 tokens: the first shadow call (over 1000 tokens) spends it; the next
    sampled request is not shadowed, counted as reason=cap, and the admin API says capped.
    Planted: the spend not added to the ledger (a second shadow call: red)."""
    proxy = shadowing("shadow_rate = 1.0\nshadow_daily_tokens = 1000\n")
    _ask(proxy, HIDDEN)
    until(lambda: _report(proxy)["by_lever"].get("any"), what="the first comparison")
    assert _report(proxy)["capped"] is True
    _ask(proxy, HIDDEN)
    until(lambda: _metric(proxy, "runloop_shadow_skipped_total", tenant="parcels",
                          reason="cap") == 1, what="the capped request counted")
    proxy.settle()
    assert len(upstream.requests) == 3  # two requests, one shadow call
    assert _report(proxy)["skipped"] == {"cap": 1}


def test_a_failed_shadow_call_never_touches_the_clients_request(
        shadowing: Any, upstream: ScriptedUpstream) -> None:
    """The upstream fails the shadow call (a 500): the client's answer was whole and its
    own; the comparison is counted as an error. Planted: the shadow error raised out of the
    background task (the comparison is never recorded: red)."""
    proxy = shadowing("shadow_rate = 1.0\n")
    upstream.push({"content": NOT_FOUND},
                  {"status": 500, "body": {"error": {"message": "overloaded",
                                                     "type": "server_error"}}})
    assert _ask(proxy, HIDDEN) == \
        NOT_FOUND
    until(lambda: _report(proxy)["by_lever"].get("any"), what="the failed comparison")
    report = _report(proxy)
    assert report["by_lever"]["any"] == {"agree": 0, "differ": 0, "error": 1}
    assert "500" in report["recent"][0]["error"]


# --- every path a compressed request takes ------------------------------------------------
#
# On each, the request as the upstream would have had it uncompressed is what a tenant
# with compression off sends for the same requests (``shaping._as_sent``): the shadow
# call's body is checked against that proxy's, field for field.

CLAUDE = "claude-sonnet-4-6"
SESSION = "parcels-ticket-4471"


def _shadowed(shadowing: Any, upstream: ScriptedUpstream, send: Any, **kw: Any
              ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``send(proxy)`` through a shadowing proxy, then through one with compression off:
    the comparison recorded, the shadow call's body, the uncompressed proxy's last body."""
    proxy = shadowing("shadow_rate = 1.0\n", **kw)
    send(proxy)
    until(lambda: _report(proxy)["by_lever"].get("any"), what="the shadow comparison")
    (rec,) = _report(proxy)["recent"]
    shadow = upstream.requests[-1]
    plain = shadowing("enabled = false\nshadow_rate = 1.0\n", **kw)
    send(plain)
    plain.settle()
    return rec, shadow, upstream.requests[-1]


def _whole(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("stream", "stream_options")}


def test_a_responses_request_is_shadowed_as_sent_with_store_off(
        shadowing: Any, upstream: ScriptedUpstream) -> None:
    """The Responses API, streamed: the client's answer (its window reduced the past loop)
    sees no order, the shadow call — the client's body, whole, ``store`` false — names it.
    Planted: ``store`` left as the client set it (red)."""
    def send(proxy: ProxyServer) -> None:
        client = openai.OpenAI(base_url=proxy.url, api_key=CLIENT_KEY, max_retries=0)
        with client.responses.stream(model=MODEL, instructions=SYSTEM, store=True,
                                     input=response_items(HIDDEN),  # type: ignore[arg-type]
                                     tools=RESPONSES_TOOLS) as stream:  # type: ignore[arg-type]
            assert stream.get_final_response().output_text in (NOT_FOUND, FOUND)
    rec, shadow, plain = _shadowed(shadowing, upstream, send)
    assert (rec["outcome"], rec["compressed"]["text"], rec["full"]["text"]) == \
        ("differ", NOT_FOUND, FOUND)
    assert (shadow["store"], shadow["stream"]) == (False, False)
    assert _whole(shadow) == {**_whole(plain), "store": False}
    assert shadow["input"] == response_items(HIDDEN)


def test_a_messages_request_to_anthropic_is_shadowed_with_its_key(
        shadowing: Any, upstream: ScriptedUpstream) -> None:
    """The Messages API to an Anthropic upstream: the shadow call is the client's body
    (system, turns, tools, max_tokens) with the tenant's upstream key as x-api-key.
    Planted: the shadow sent with a Bearer Authorization in place of x-api-key (red)."""
    key = anthropic_key(31)

    def send(proxy: ProxyServer) -> None:
        client = anthropic.Anthropic(base_url=proxy.base, api_key=CLIENT_KEY, max_retries=0)
        client.messages.create(model=CLAUDE, max_tokens=1536, system=SYSTEM,
                               messages=anthropic_turns(HIDDEN),  # type: ignore[arg-type]
                               tools=ANTHROPIC_TOOLS)  # type: ignore[arg-type]
    rec, shadow, plain = _shadowed(shadowing, upstream, send, upstream_format="anthropic",
                                   upstream_key=key)
    assert (rec["outcome"], rec["compressed"]["text"], rec["full"]["text"]) == \
        ("differ", NOT_FOUND, FOUND)
    assert _whole(shadow) == _whole(plain)
    assert shadow["messages"] == anthropic_turns(HIDDEN) and shadow["system"] == SYSTEM
    assert upstream.headers[-2]["x-api-key"] == key  # the shadow's, before the plain one's
    assert "authorization" not in upstream.headers[-2]


def test_a_bridged_messages_request_is_shadowed_in_the_upstreams_api(
        shadowing: Any, upstream: ScriptedUpstream) -> None:
    """The bridge (a Messages client, a chat-completions upstream): the shadow call is the
    client's request translated as an uncompressed one is — chat completions with the whole
    conversation, the tool result in full. Before, such requests were skipped. Planted:
    the client's Messages body sent as it came (red: not the chat body)."""
    def send(proxy: ProxyServer) -> None:
        client = anthropic.Anthropic(base_url=proxy.base, api_key=CLIENT_KEY, max_retries=0)
        client.messages.create(model=MODEL, max_tokens=1536, system=SYSTEM,
                               messages=anthropic_turns(HIDDEN),  # type: ignore[arg-type]
                               tools=ANTHROPIC_TOOLS, stream=False)  # type: ignore[arg-type]
    rec, shadow, plain = _shadowed(shadowing, upstream, send, upstream_format="chat")
    assert (rec["outcome"], rec["compressed"]["text"], rec["full"]["text"]) == \
        ("differ", NOT_FOUND, FOUND)
    assert _whole(shadow) == _whole(plain)
    assert shadow["messages"][0] == {"role": "system", "content": SYSTEM}
    assert [m["content"] for m in shadow["messages"] if m["role"] == "tool"] == [RESULT]


def test_a_server_history_request_is_shadowed_with_the_stored_conversation(
        shadowing: Any, upstream: ScriptedUpstream) -> None:
    """Server-history mode: the client sends only its question; the shadow call carries the
    stored conversation before it, as the upstream would have had it uncompressed. Before,
    such requests were skipped. Planted: the body as the client sent it (only the question:
    an agreement, red), and the request's own messages converted in place of the stored
    conversation (red)."""
    def send(proxy: ProxyServer) -> None:
        client = openai.OpenAI(base_url=proxy.url, api_key=CLIENT_KEY, max_retries=0,
                               default_headers={"X-Session-Id": SESSION,
                                                "X-Runloop-History": "server"})
        upstream.push({"content": HIDDEN})
        client.chat.completions.create(model=MODEL, messages=conversation(HIDDEN)[:4],  # type: ignore[arg-type]
                                       tools=CHAT_TOOLS)
        proxy.settle()
        client.chat.completions.create(model=MODEL, messages=conversation(HIDDEN)[5:],  # type: ignore[arg-type]
                                       tools=CHAT_TOOLS)
    rec, shadow, plain = _shadowed(shadowing, upstream, send)
    assert (rec["outcome"], rec["compressed"]["text"], rec["full"]["text"]) == \
        ("differ", NOT_FOUND, FOUND)
    assert _whole(shadow) == _whole(plain)
    assert [(m["role"], m.get("content")) for m in shadow["messages"]] == \
        [(m["role"], m.get("content")) for m in conversation(HIDDEN)]


def test_a_socket_turn_going_on_from_its_response_is_shadowed_whole(
        shadowing: Any, upstream: ScriptedUpstream) -> None:
    """Over the WebSocket a turn names the connection's last response and sends only its
    question; the proxy expands it into the whole conversation, and the shadow call carries
    that (no previous_response_id, store and stream off). Planted: the socket's turns
    skipped (``rlog.api == "responses_ws"``: red, never shadowed)."""
    proxy = shadowing("shadow_rate = 1.0\n")
    url = proxy.base.replace("http://", "ws://") + "/v1/responses"
    upstream.push({"content": HIDDEN})
    with connect(url, additional_headers={"Authorization": f"Bearer {CLIENT_KEY}"},
                 open_timeout=10) as ws:
        def turn(**body: Any) -> dict[str, Any]:
            ws.send(orjson.dumps({"type": "response.create", "model": MODEL, "store": False,
                                  "instructions": SYSTEM, "tools": RESPONSES_TOOLS,
                                  **body}).decode())
            while True:
                event = orjson.loads(ws.recv(timeout=30))
                if event["type"] in ("response.completed", "error"):
                    return event  # type: ignore[no-any-return]
        first = turn(input=response_items(HIDDEN)[:3])["response"]
        second = turn(input=response_items(HIDDEN)[4:], previous_response_id=first["id"])
    assert second["response"]["output"][0]["content"][0]["text"] == NOT_FOUND
    until(lambda: _report(proxy)["by_lever"].get("any"), what="the shadow comparison")
    (rec,) = _report(proxy)["recent"]
    assert (rec["outcome"], rec["full"]["text"]) == ("differ", FOUND)
    shadow = upstream.requests[-1]
    assert shadow["input"] == [*response_items(HIDDEN)[:3], *first["output"],
                               *response_items(HIDDEN)[4:]]
    assert "previous_response_id" not in shadow
    assert (shadow["store"], shadow["stream"]) == (False, False)


# --- the daily cap, every replica's --------------------------------------------------------

def test_the_cap_holds_across_two_replicas_on_one_redis(
        tmp_path: Path, upstream: ScriptedUpstream, redis_url: str) -> None:
    """Two ``serve`` processes on one Redis, a cap of 1000 tokens a day: the first
    replica's shadow call spends it (over 1000 tokens); the second replica, asked next,
    reads the same day's spend in Redis and sends none (reason=cap), and says it is capped
    with the first one's tokens. Bug class: a cap kept per process (each replica spends a
    whole cap). Planted: the day's key named per process (``id(self)`` in its name: each
    replica its own ledger, the second sends a shadow call: red)."""
    upstream.responder = decides_from_its_window
    root = tmp_path / "cfg"
    (root / "tenants").mkdir(parents=True)
    (root / "runloop.toml").write_text(
        f'[server]\nadmin_key = "{ADMIN_KEY}"\n'
        f'[store]\nkey_prefix = "t{uuid.uuid4().hex[:10]}"\n'
        f'[upstreams.main]\nurl = "{upstream.url}"\napi_key = "{UPSTREAM_KEY}"\n'
        f'max_retries = 0\n[defaults]\nupstream = "main"\n')
    (root / "tenants" / "parcels.toml").write_text(
        f'keys = ["{CLIENT_KEY}"]\n[policy]\nreduce_at_least = 8\nnames_kept = 0\n'
        f'shadow_rate = 1.0\nshadow_daily_tokens = 1000\n')
    flags = ["--config", str(root)]
    with serve_command(upstream.url, redis_url, tmp_path / "a", flags, {}) as (a, _, _), \
            serve_command(upstream.url, redis_url, tmp_path / "b", flags, {}) as (b, _, _):
        def report(base: str) -> dict[str, Any]:
            r = httpx.get(base + "/admin/shadow", params={"tenant": "parcels"},
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            assert r.status_code == 200, r.text
            return r.json()  # type: ignore[no-any-return]

        def ask(base: str) -> None:
            client = openai.OpenAI(base_url=base + "/v1", api_key=CLIENT_KEY, max_retries=0)
            client.chat.completions.create(model=MODEL, messages=conversation(HIDDEN),  # type: ignore[arg-type]
                                           tools=CHAT_TOOLS)
        ask(a)
        until(lambda: report(a)["by_lever"].get("any"), what="the first replica's shadow")
        (rec,) = report(a)["recent"]
        assert rec["tokens"] > 1_000
        ask(b)
        until(lambda: report(b)["skipped"].get("cap"), what="the second replica's skip")
        got = report(b)
        assert (got["capped"], got["tokens"], got["by_lever"]) == (True, rec["tokens"], {})
        assert report(a)["capped"] is True
    assert len(upstream.requests) == 3  # two requests, one shadow call


def test_without_redis_no_shadow_call_goes_and_it_is_said(
        shadowing: Any, upstream: ScriptedUpstream) -> None:
    """Redis goes away while the compressed request is answered: the client gets its whole
    answer; the shadow call is not sent (the cap cannot be read: fail closed), counted as
    reason=store, a log line, and the admin API says the ledger is unavailable. Planted:
    the ledger's failure read as no spend (a shadow call went: red), and the skip not
    counted (red)."""
    server = RedisServer().start()
    try:
        proxy = shadowing("shadow_rate = 1.0\nshadow_daily_tokens = 900000\n",
                          redis=server.url, store={"timeout_s": 0.2, "retry_after_s": 0.3})
        upstream.push({"content": NOT_FOUND, "delay": 1.2})
        stopper = threading.Thread(target=lambda: (
            until(lambda: len(upstream.requests) == 1, what="the request upstream"),
            server.stop()))
        stopper.start()
        assert _ask(proxy, HIDDEN) == NOT_FOUND
        stopper.join()
        until(lambda: _metric(proxy, "runloop_shadow_skipped_total", tenant="parcels",
                              reason="store") == 1, what="the skip counted")
        report = _report(proxy)
        assert (report["skipped"], report["capped"], report["by_lever"]) == (
            {"store": 1}, None, {})
        assert "ledger_error" in report
        assert len(upstream.requests) == 1
    finally:
        server.cleanup()


def test_the_models_own_agreement_is_measured_beside_the_figure(
        shadowing: Any, upstream: ScriptedUpstream) -> None:
    """``shadow_baseline_share = 1``: after the shadow call, the request goes uncompressed
    once more and the two uncompressed answers are compared, counted under lever=baseline
    only (never under ``any``), its tokens added to the day's spend. A model steady on one
    window agrees with itself, though the compressed window misled it. Planted: the
    baseline counted under ``any`` too (red), and the second answer compared with the
    compressed one (red: a disagreement)."""
    # coincide: every request shadowed, and every shadow call followed by a second one
    proxy = shadowing("shadow_rate = 1.0\nshadow_baseline_share = 1.0\n")  # coincide: all
    _ask(proxy, HIDDEN)
    until(lambda: _report(proxy)["by_lever"].get("baseline"), what="the baseline comparison")
    report = _report(proxy)
    assert report["by_lever"]["baseline"] == {"agree": 1, "differ": 0, "error": 0}
    assert report["by_lever"]["any"] == {"agree": 0, "differ": 1, "error": 0}
    baseline, shadow = report["recent"]  # the newest first
    assert (baseline["levers"], shadow["levers"]) == (["baseline"], ["past_loops"])
    assert len(upstream.requests) == 3 and upstream.requests[1] == upstream.requests[2]
    assert report["tokens"] == baseline["tokens"] + shadow["tokens"]
    assert _metric(proxy, "runloop_shadow_comparisons_total", tenant="parcels",
                   lever="baseline", outcome="agree") == 1
