"""Shadow calls end to end: a real proxy on a loopback port, the scripted upstream as a model
that decides from what its window holds, the openai SDK as the client, a real Redis."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from runloop_proxy.scripted import ScriptedUpstream
from tests.conftest import ProxyServer, until
from tests.keys import openai_project_key

MODEL = "gpt-4.1-mini-2025-04-14"
CLIENT_KEY = openai_project_key(7)
UPSTREAM_KEY = openai_project_key(8)
ADMIN_KEY = "adm-" + "k" * 40
ORDER = re.compile(r"ORD-\d{4}")
PADDING = "Carrier events: departed facility, arrived at hub, out for delivery. " * 60


def decides_from_its_window(body: dict[str, Any]) -> dict[str, Any]:
    """A model that answers with the order id it can see, or says it sees none."""
    seen = ORDER.findall(" ".join(str(m.get("content") or "") for m in body["messages"]))
    if seen:
        return {"content": f"Your order number is {seen[-1]}."}
    return {"content": "I cannot find an order number anywhere in this conversation."}


def _conversation(final: str) -> list[dict[str, Any]]:
    """A past loop whose tool result (large, so its loop is reduced) holds the order id,
    then a new question about it."""
    return [
        {"role": "system", "content": "You are the support agent of a parcel shop."},
        {"role": "user", "content": "Look up my last order please."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_Lk3xQ9", "type": "function",
             "function": {"name": "lookup_order", "arguments": '{"customer": "C-20931"}'}}]},
        {"role": "tool", "tool_call_id": "call_Lk3xQ9",
         "content": f"Order ORD-7731 shipped 2026-03-02 via DHL. {PADDING}"},
        {"role": "assistant", "content": final},
        {"role": "user", "content": "And what is its number again?"},
    ]


TOOLS = [{"type": "function", "function": {
    "name": "lookup_order", "description": "Look up a customer's last order",
    "parameters": {"type": "object", "properties": {"customer": {"type": "string"}}}}}]


@pytest.fixture
def shadowing(tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> Any:
    def make(policy: str) -> ProxyServer:
        root = tmp_path / f"cfg{len(list(tmp_path.iterdir()))}"
        (root / "tenants").mkdir(parents=True)
        (root / "runloop.toml").write_text(
            f'[server]\nadmin_key = "{ADMIN_KEY}"\n'
            f'[upstreams.main]\nurl = "{upstream.url}"\napi_key = "{UPSTREAM_KEY}"\n'
            f'max_retries = 0\n[defaults]\nupstream = "main"\n')
        (root / "tenants" / "parcels.toml").write_text(
            f'keys = ["{CLIENT_KEY}"]\n[policy]\nreduce_at_least = 8\nnames_kept = 0\n'
            f'{policy}')
        return make_proxy(config_dir=str(root))  # type: ignore[no-any-return]
    upstream.responder = decides_from_its_window
    return make


def _ask(proxy: ProxyServer, final: str, **kw: Any) -> str:
    client = openai.OpenAI(base_url=proxy.url, api_key=CLIENT_KEY, max_retries=0)
    answer = client.chat.completions.create(model=MODEL, messages=_conversation(final),  # type: ignore[arg-type]
                                            tools=TOOLS, seed=4417, temperature=0, **kw)
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
    got = _ask(proxy, "Your last order has shipped.")
    assert got == "I cannot find an order number anywhere in this conversation."
    until(lambda: _report(proxy)["by_lever"].get("any"), what="the shadow comparison")
    report = _report(proxy)
    assert report["by_lever"]["any"] == {"agree": 0, "differ": 1, "error": 0}
    assert report["by_lever"]["past_loops"] == {"agree": 0, "differ": 1, "error": 0}
    (rec,) = report["recent"]
    assert (rec["outcome"], rec["basis"], rec["levers"]) == ("differ", "text", ["past_loops"])
    assert rec["compressed"]["text"] == got
    assert rec["full"]["text"] == "Your order number is ORD-7731."
    assert rec["tokens"] > 1_000 and report["tokens"] == rec["tokens"]
    assert _metric(proxy, "runloop_shadow_comparisons_total", tenant="parcels",
                   lever="past_loops", outcome="differ") == 1
    assert _metric(proxy, "runloop_shadow_tokens_total", tenant="parcels") == rec["tokens"]
    # two calls upstream: the compressed one, then the shadow (the client's body, whole)
    assert len(upstream.requests) == 2
    compressed, shadow = upstream.requests
    assert "ORD-7731" not in str(compressed["messages"])
    assert shadow["messages"] == _conversation("Your last order has shipped.")
    assert {k: v for k, v in shadow.items() if k != "messages"} == {
        "model": MODEL, "tools": TOOLS, "seed": 4417, "temperature": 0}
    assert upstream.headers[1]["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert CLIENT_KEY not in str(upstream.headers[1])
    # the inspector's session page: the two next steps side by side
    ui = httpx.Client(base_url=proxy.base)
    assert ui.post("/admin/ui/login", data={"key": ADMIN_KEY}).status_code == 303
    page = ui.get("/admin/ui/session", params={"tenant": "parcels",
                                                "id": rec["session"]}).text
    shadow_part = page.split("<h2>Shadow comparisons</h2>", 1)[1]
    assert "Your order number is ORD-7731." in shadow_part and got in shadow_part
    assert "<td>differ</td><td>past_loops</td><td>text</td>" in shadow_part


def test_information_kept_is_an_agreement(shadowing: Any, upstream: ScriptedUpstream) -> None:
    """The loop's final answer named the order, so the compressed window kept what the next
    step needs: both answers name it, an agreement. Streamed, the shadow goes whole. Planted:
    stream_options kept in the shadow's body (red)."""
    proxy = shadowing("shadow_rate = 1.0\n")
    client = openai.OpenAI(base_url=proxy.url, api_key=CLIENT_KEY, max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=_conversation("Your order ORD-7731 has shipped."),  # type: ignore[arg-type]
        tools=TOOLS, stream=True, stream_options={"include_usage": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "Your order number is ORD-7731."
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
    _ask(proxy, "Your last order has shipped.")
    proxy.settle()
    assert len(upstream.requests) == 1
    assert _report(proxy)["by_lever"] == {}


def test_the_daily_cap_stops_the_calls_and_says_so(
        shadowing: Any, upstream: ScriptedUpstream) -> None:
    """A cap of 1000 tokens: the first shadow call (over 1000 tokens) spends it; the next
    sampled request is not shadowed, counted as reason=cap, and the admin API says capped.
    Planted: the spend not added to the ledger (a second shadow call: red)."""
    proxy = shadowing("shadow_rate = 1.0\nshadow_daily_tokens = 1000\n")
    _ask(proxy, "Your last order has shipped.")
    until(lambda: _report(proxy)["by_lever"].get("any"), what="the first comparison")
    assert _report(proxy)["capped"] is True
    _ask(proxy, "Your last order has shipped.")
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
    upstream.push({"content": "I cannot find an order number anywhere in this conversation."},
                  {"status": 500, "body": {"error": {"message": "overloaded",
                                                     "type": "server_error"}}})
    assert _ask(proxy, "Your last order has shipped.") == \
        "I cannot find an order number anywhere in this conversation."
    until(lambda: _report(proxy)["by_lever"].get("any"), what="the failed comparison")
    report = _report(proxy)
    assert report["by_lever"]["any"] == {"agree": 0, "differ": 0, "error": 1}
    assert "500" in report["recent"][0]["error"]
