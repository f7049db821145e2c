"""Which headers cross the proxy, each way: an upstream's answer headers by a list of what is
allowed (its account and its key's live rate limits only to a caller they describe alone),
and a hop's own headers (the standard set and those its ``Connection`` names) never."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from websockets.sync.client import connect

from runloop_proxy.pipeline.upstream import answer_header, connection_named
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer
from .keys import anthropic_key, openai_project_key

SHARED_KEY = openai_project_key(40)  # the operator's, for every tenant without its own
ALONE_KEY = openai_project_key(41)  # one tenant's own upstream_key
CLAUDE_KEY = anthropic_key(40)
OWN_KEY = openai_project_key(42)  # a pass-through caller's own
ALONE = "alone-proxy-key-4f0c2d9e81b7"
SHARED_A = "shared-a-proxy-key-7d13e05b9c"
SHARED_B = "shared-b-proxy-key-c2e8a6f410"
MODEL = "gpt-4o-2024-08-06"
CLAUDE = "claude-sonnet-4-6"

# what OpenAI's and Anthropic's edges send with an answer (their spellings, values of their
# shapes), and two headers this hop's Connection names: one no list allows, one it does
ACCOUNT = [("openai-organization", "org-Zq3vX8bN2kLm5pRt7wYc9dFh"),
           ("openai-project", "proj_4hT9sKq2WmZ7vNc1XbLp8RdE"),
           ("anthropic-organization-id", "5c1f0e3a-9b27-4d8e-a6f2-71c0b3e94d5a")]
LIMITS = [("x-ratelimit-limit-requests", "10000"), ("x-ratelimit-remaining-requests", "9981"),
          ("x-ratelimit-remaining-tokens", "29987316"), ("x-ratelimit-reset-tokens", "24ms"),
          ("anthropic-ratelimit-requests-remaining", "3987"),
          ("anthropic-ratelimit-input-tokens-remaining", "1993000"),
          ("anthropic-ratelimit-tokens-reset", "2026-12-02T02:15:07Z"),
          ("ratelimit-policy", "10000;w=60")]
KEPT = [("x-request-id", "req_8c2f5a1d3e7b49c0a6f1d2e3b4c5a697"),
        ("request-id", "req_011CVaB3dE5fG7hJ9kL1mN3p"), ("openai-version", "2020-10-01"),
        ("retry-after-ms", "1731")]
NEVER = [("set-cookie", "__cf_bm=Qm8x2Lp0; path=/; domain=.api.openai.com; HttpOnly; Secure"),
         ("cf-ray", "8f1c2b3a4d5e6f70-SJC"), ("alt-svc", 'h3=":443"; ma=86400'),
         ("strict-transport-security", "max-age=31536000; includeSubDomains"),
         ("via", "1.1 google"), ("x-envoy-upstream-service-time", "355"),
         ("x-runloop-degraded", "store"), ("x-hop-secret", "edge-7f3a"),
         ("openai-processing-ms", "361"),  # allowed, but named below: this hop's own
         ("connection", "keep-alive, X-Hop-Secret, openai-processing-ms"),
         ("keep-alive", "timeout=5, max=1000")]


@pytest.fixture
def proxies(tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream
            ) -> dict[str, tuple[ProxyServer, str]]:
    """A tenant on the operator's shared key, one with a key of its own (for both upstream
    formats), and a pass-through proxy whose callers send their own keys."""
    root = tmp_path / "cfg"
    (root / "tenants").mkdir(parents=True)
    (root / "runloop.toml").write_text(
        f'[upstreams.main]\nurl = "{upstream.url}"\napi_key = "{SHARED_KEY}"\n'
        f'max_retries = 0\n[upstreams.claude]\nurl = "{upstream.url}"\nformat = "anthropic"\n'
        f'api_key = "{CLAUDE_KEY}"\nmax_retries = 0\n'
        f'[defaults]\nupstream = "main"\n[defaults.policy]\ncount_tokens = "upstream"\n')
    for name, key, extra in [("alone", ALONE, f'upstream_key = "{ALONE_KEY}"\n'),
                             ("a", SHARED_A, ""), ("b", SHARED_B, ""),
                             ("ca", SHARED_A + "-c", 'upstream = "claude"\n'),
                             ("cb", SHARED_B + "-c", 'upstream = "claude"\n'),
                             ("calone", ALONE + "-c", 'upstream = "claude"\n'
                              f'upstream_key = "{anthropic_key(41)}"\n')]:
        (root / "tenants" / f"{name}.toml").write_text(f'keys = ["{key}"]\n{extra}')
    tenants = make_proxy(config_dir=str(root))
    (tmp_path / "pt").mkdir()  # no tenants/: pass-through, every caller's own key
    (tmp_path / "pt" / "runloop.toml").write_text(
        f'[upstreams.default]\nurl = "{upstream.url}"\nmax_retries = 0\n')
    passthrough = make_proxy(config_dir=str(tmp_path / "pt"))
    return {"shared": (tenants, SHARED_A), "alone": (tenants, ALONE),
            "passthrough": (passthrough, OWN_KEY)}


def _chat(base: str, key: str) -> httpx.Headers:
    c = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
    r = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "which headers?"}])
    assert r.parse().choices[0].message.content == "echo: which headers?"
    return r.headers


def _chat_stream(base: str, key: str) -> httpx.Headers:
    c = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
    with c.chat.completions.with_streaming_response.create(
            model=MODEL, stream=True,
            messages=[{"role": "user", "content": "streamed"}]) as r:
        text = "".join(ch.choices[0].delta.content or "" for ch in r.parse() if ch.choices)
    assert text == "echo: streamed"
    return r.headers


def _responses(base: str, key: str) -> httpx.Headers:
    c = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
    r = c.responses.with_raw_response.create(model=MODEL, input="and here?")
    assert r.parse().output_text == "echo: and here?"
    return r.headers


def _messages(base: str, key: str) -> httpx.Headers:
    c = anthropic.Anthropic(base_url=base, api_key=key + "-c" if key != OWN_KEY else key,
                            max_retries=0)
    r = c.messages.with_raw_response.create(
        model=CLAUDE, max_tokens=512, messages=[{"role": "user", "content": "claude?"}])
    assert r.parse().content[0].text == "echo: claude?"  # type: ignore[union-attr]
    return r.headers


def _count_tokens(base: str, key: str) -> httpx.Headers:
    c = anthropic.Anthropic(base_url=base, api_key=key + "-c" if key != OWN_KEY else key,
                            max_retries=0)
    r = c.messages.with_raw_response.count_tokens(
        model=CLAUDE, messages=[{"role": "user", "content": "count me"}])
    assert r.parse().input_tokens > 0
    return r.headers


def _models(base: str, key: str) -> httpx.Headers:
    c = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
    r = c.models.with_raw_response.list()
    assert [m.id for m in r.parse().data] == ["gpt-4o-mini", "gpt-4o"]
    return r.headers


def _rate_limited(base: str, key: str) -> httpx.Headers:
    c = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.RateLimitError) as err:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert err.value.request_id == "req_8c2f5a1d3e7b49c0a6f1d2e3b4c5a697"
    return err.value.response.headers


CALLS: dict[str, Callable[[str, str], httpx.Headers]] = {
    "chat": _chat, "chat-stream": _chat_stream, "responses": _responses,
    "messages": _messages, "count_tokens": _count_tokens, "passthrough-models": _models,
    "upstream-429": _rate_limited}


@pytest.mark.parametrize("api", list(CALLS))
@pytest.mark.parametrize("who", ["shared", "alone", "passthrough"])
def test_an_answer_tells_a_caller_only_what_is_its_own(
        proxies: dict[str, tuple[ProxyServer, str]], upstream: ScriptedUpstream,
        who: str, api: str) -> None:
    """Bug class: an upstream header relayed that is not the caller's to read. The operator's
    organization and project go to no tenant, the shared key's live rate-limit counters
    (a side channel on the other tenants' traffic) only to a caller whose key no one else
    uses, the edge's cookies and routing to nobody, nor anything this hop's ``Connection``
    names; the request ids and retry hints the SDKs read reach every caller.
    Red with the old deny-list (everything relayed), with rate limits relayed to a shared
    tenant (``own_limits`` always true), and with ``Connection``'s names ignored."""
    proxy, key = proxies[who]
    upstream.answer_headers = ACCOUNT + LIMITS + KEPT + NEVER
    if api == "upstream-429":
        upstream.push({"status": 429, "body": {"error": {
            "message": "Rate limit reached for requests", "type": "requests", "param": None,
            "code": "rate_limit_exceeded"}}})
    got = {k.lower(): v for k, v in CALLS[api](proxy.base, key).items()}
    sent = {k for k, _ in ACCOUNT + LIMITS + KEPT + NEVER}
    want = set() if (who, api) == ("passthrough", "count_tokens") \
        else {k for k, _ in KEPT} | ({k for k, _ in ACCOUNT} if who == "passthrough" else set()) \
        | ({k for k, _ in LIMITS} if who != "shared" else set())
    # (a pass-through proxy counts tokens itself: nothing of the upstream's to relay)
    assert set(got) & sent == want, (who, api)
    assert all(got[k] == v for k, v in ACCOUNT + LIMITS + KEPT if k in want)
    assert "X-Hop-Secret" not in str(got.get("connection", ""))


def test_a_hops_own_headers_never_go_upstream(
        proxies: dict[str, tuple[ProxyServer, str]], upstream: ScriptedUpstream) -> None:
    """Bug class: a hop-by-hop header forwarded. The standard set (Keep-Alive, TE,
    Trailer, Proxy-Connection, Upgrade) and whatever the client's ``Connection`` names stay
    on the client's hop, on the conversation endpoints and the pass-through alike; the rest
    goes on untouched. Red with ``Connection``'s names ignored on the way up, and with
    Proxy-Connection left out of the set."""
    hop = {"Connection": "keep-alive, X-Client-Hop, X-Stainless-Retry-Count",
           "X-Client-Hop": "client-9c1e", "X-Stainless-Retry-Count": "0",
           "Keep-Alive": "timeout=7", "TE": "trailers", "Trailer": "x-checksum",
           "Proxy-Connection": "keep-alive"}
    named = {k.lower() for k in hop} - {"connection"}
    for who in ("alone", "passthrough"):
        proxy, key = proxies[who]
        headers = {**hop, "Authorization": f"Bearer {key}", "X-Stainless-Lang": "python"}
        r = httpx.post(proxy.url + "/chat/completions", headers=headers, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hop"}]})
        assert r.status_code == 200, r.text
        r = httpx.get(proxy.url + "/files", headers=headers)  # passed through as it came
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
        for sent in (upstream.headers[-1], upstream.other[-1][2]):
            assert not named & set(sent), (who, sent)
            assert sent["x-stainless-lang"] == "python"
            assert "x-client-hop" not in sent.get("connection", "").lower()


@pytest.mark.parametrize(("headers", "named"), [
    ([("Connection", "close")], {"close"}),
    ([("connection", " Keep-Alive ,X-A,, x-b ")], {"keep-alive", "x-a", "x-b"}),
    ([("Connection", "x-a"), ("Proxy-Connection", "X-C"), ("X-A", "1")], {"x-a", "x-c"}),
    ([("X-Connection", "x-a"), ("Content-Type", "text/plain")], set()),
])
def test_connection_names_its_hops_headers(headers: list[tuple[str, str]],
                                           named: set[str]) -> None:
    assert connection_named(headers) == named


@pytest.mark.parametrize(("name", "shared", "alone", "own"), [
    ("x-request-id", True, True, True), ("retry-after", True, True, True),
    ("content-type", True, True, True), ("openai-organization", False, False, True),
    ("anthropic-organization-id", False, False, True),
    ("x-ratelimit-remaining-tokens", False, True, True),
    ("anthropic-ratelimit-output-tokens-reset", False, True, True),
    ("ratelimit", False, True, True), ("x-ratelimiter", False, False, False),
    ("set-cookie", False, False, False), ("x-runloop-tokens", False, False, False),
    ("connection", False, False, False), ("server", False, False, False),
])
def test_which_answer_headers_a_caller_reads(name: str, shared: bool, alone: bool,
                                             own: bool) -> None:
    assert answer_header(name) is shared
    assert answer_header(name, own_limits=True) is alone
    assert answer_header(name, own_key=True, own_limits=True) is own


@pytest.mark.parametrize("who", ["shared", "alone", "passthrough"])
def test_a_sockets_error_event_tells_only_what_an_answer_would(
        proxies: dict[str, tuple[ProxyServer, str]], upstream: ScriptedUpstream,
        who: str) -> None:
    """Over the Responses WebSocket an upstream's 429 becomes an error event carrying its
    headers (where Codex and the SDK read Retry-After): the same allow-list as an HTTP
    answer's. Red with the account's organization and project relayed to every caller."""
    proxy, key = proxies[who]
    upstream.answer_headers = ACCOUNT + LIMITS + KEPT + NEVER
    upstream.push({"status": 429, "body": {"error": {
        "message": "Rate limit reached for requests", "type": "requests", "param": None,
        "code": "rate_limit_exceeded"}}})
    url = proxy.base.replace("http://", "ws://") + "/v1/responses"
    with connect(url, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        ws.send(orjson.dumps({"type": "response.create", "model": MODEL,
                              "input": "socket"}).decode())
        err = orjson.loads(ws.recv(timeout=30))
    assert err["type"] == "error" and err["status"] == 429, err
    got = set(err["headers"])
    sent = {k for k, _ in ACCOUNT + LIMITS + KEPT + NEVER}
    want = {k for k, _ in KEPT} | ({k for k, _ in ACCOUNT} if who == "passthrough" else set()) \
        | ({k for k, _ in LIMITS} if who != "shared" else set())
    assert got & sent == want and err["headers"]["retry-after-ms"] == "1731"
