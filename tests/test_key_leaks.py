"""A key goes where it is meant to and nowhere else: swept over every API, both upstream
formats, tenant and pass-through mode, answers that succeed, retry and fail, and keys that
are refused. The proxy's tenant keys, the upstream keys, the admin key, a caller's own key
and a key the proxy refused are each looked for in every log record (as any handler reads it
and as the proxy's formatters write it), in /metrics, in every answer the proxy gave (its
body and headers: never even a caller's own key quoted back), and upstream (only the
upstream's key, only in the header its format takes it in; a caller's own key only where it
is forwarded). A log line or a label added later that carries a key fails here whatever it
is named. Planted, each red: the refused key logged; an upstream retry logged with its
request headers; the refused key quoted in the 401."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy.ops.logs import JsonFormatter, TextFormatter
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer

ADMIN_KEY = "admin-LEAKCHECK-0123456789"
ACME_KEY = "acme-proxy-LEAKCHECK-0123456789"
GLOBEX_KEY = "globex-proxy-LEAKCHECK-0123456789"
MAIN_UPSTREAM_KEY = "sk-main-upstream-LEAKCHECK-0123"
ACME_UPSTREAM_KEY = "sk-acme-upstream-LEAKCHECK-0123"
CLAUDE_UPSTREAM_KEY = "sk-ant-upstream-LEAKCHECK-0123"
REFUSED_KEY = "sk-live-REFUSED-LEAKCHECK-0123"  # a real key of something else, mistyped here
OWN_KEY = "sk-callers-own-LEAKCHECK-0123"  # a pass-through caller's own
SECRETS = [ADMIN_KEY, ACME_KEY, GLOBEX_KEY, MAIN_UPSTREAM_KEY, ACME_UPSTREAM_KEY,
           CLAUDE_UPSTREAM_KEY, REFUSED_KEY, OWN_KEY]

CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "gpt-4o-mini", "input": "hi"}
MESSAGES = {"model": "claude-sonnet-4-6", "max_tokens": 32,
            "messages": [{"role": "user", "content": "hi"}]}
COUNT = {"model": "claude-sonnet-4-6", "messages": [{"role": "user", "content": "hi"}]}
# every API, JSON and streamed, and the pass-through (answered, and a path the upstream lacks)
CALLS: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
    ("POST", "/v1/responses", RESPONSES), ("POST", "/v1/responses", {**RESPONSES, "stream": True}),
    ("POST", "/v1/messages", MESSAGES), ("POST", "/v1/messages", {**MESSAGES, "stream": True}),
    ("POST", "/v1/messages/count_tokens", COUNT),
    ("GET", "/v1/models", None), ("GET", "/v1/files/file-1", None),
]


def config(root: Path, url: str) -> Path:
    (root / "tenants").mkdir(parents=True)
    (root / "runloop.toml").write_text(f"""
[server]
admin_key = "{ADMIN_KEY}"
[upstreams.main]
url = "{url}"
api_key = "{MAIN_UPSTREAM_KEY}"
max_retries = 1
backoff_base = 0.0
[upstreams.claude]
url = "{url}"
format = "anthropic"
api_key = "{CLAUDE_UPSTREAM_KEY}"
max_retries = 1
backoff_base = 0.0
""")
    (root / "tenants" / "acme.toml").write_text(
        f'keys = ["{ACME_KEY}"]\nupstream = "main"\nupstream_key = "{ACME_UPSTREAM_KEY}"\n')
    (root / "tenants" / "globex.toml").write_text(
        f'keys = ["{GLOBEX_KEY}"]\nupstream = "claude"\n')
    return root


class Traffic:
    """What the proxies answered, each answer as its caller read it."""

    def __init__(self) -> None:
        self.answers: list[str] = []

    def send(self, proxy: ProxyServer, method: str, path: str, body: dict[str, Any] | None,
             headers: dict[str, str]) -> httpx.Response:
        r = httpx.request(method, proxy.base + path, json=body, timeout=30,
                          headers={**headers, "X-Session-Id": "leak-check"})
        self.answers.append(f"{method} {path} {r.status_code} {dict(r.headers)} {r.text}")
        return r


def looked_through(where: str, texts: list[str], allowed: frozenset[str] = frozenset()) -> None:
    for secret in SECRETS:
        if secret in allowed:
            continue
        found = [t for t in texts if secret in t]
        assert not found, f"{secret!r} in {where}: {found[0][:600]}"


def test_no_key_goes_anywhere_but_where_it_is_meant_to(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream,
        caplog: pytest.LogCaptureFixture) -> None:
    traffic = Traffic()
    tenant: ProxyServer = make_proxy(config_dir=str(config(tmp_path / "cfg", upstream.url)))
    passthrough: ProxyServer = make_proxy(admin_key=ADMIN_KEY)
    with caplog.at_level(logging.DEBUG):
        for key, expect in ((ACME_KEY, "acme"), (GLOBEX_KEY, "globex")):
            for method, path, body in CALLS:
                for auth in ({"Authorization": f"Bearer {key}"}, {"x-api-key": key}):
                    r = traffic.send(tenant, method, path, body, auth)
                    assert r.status_code != 401, (expect, path, r.text)
            # an upstream busy once (retried), then failing for good
            upstream.push({"status": 429, "headers": {"Retry-After": "0"}})
            assert traffic.send(tenant, "POST", "/v1/chat/completions" if expect == "acme"
                                else "/v1/messages", CHAT if expect == "acme" else MESSAGES,
                                {"Authorization": f"Bearer {key}"}).status_code == 200
            upstream.push({"status": 500}, {"status": 500})
            assert traffic.send(tenant, "POST", "/v1/responses" if expect == "acme"
                                else "/v1/messages", RESPONSES if expect == "acme" else MESSAGES,
                                {"x-api-key": key}).status_code == 500
        for method, path, body in [*CALLS, ("GET", "/admin/tenants", None),
                                   ("GET", "/admin/sessions", None)]:
            for auth in ({"Authorization": f"Bearer {REFUSED_KEY}"}, {"x-api-key": REFUSED_KEY},
                         {"api-key": REFUSED_KEY}):
                assert traffic.send(tenant, method, path, body, auth).status_code == 401
        assert traffic.send(tenant, "GET", "/admin/tenants", None,
                            {"Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 200
        for method, path, body in CALLS:
            traffic.send(passthrough, method, path, body, {"Authorization": f"Bearer {OWN_KEY}"})
        upstream.push({"status": 429, "headers": {"Retry-After": "0"}})
        traffic.send(passthrough, "POST", "/v1/chat/completions", CHAT,
                     {"Authorization": f"Bearer {OWN_KEY}"})
        for proxy in (tenant, passthrough):
            proxy.settle()
    records = caplog.records
    assert len(records) > 20, "the sweep saw the proxy's log lines"
    looked_through("a log record", [str(rec.__dict__) for rec in records])
    for fmt in (JsonFormatter(), TextFormatter()):
        looked_through(f"a {type(fmt).__name__} line", [fmt.format(rec) for rec in records])
    for proxy in (tenant, passthrough):
        looked_through("/metrics", [httpx.get(proxy.base + "/metrics").text])
    looked_through("an answer", traffic.answers)
    # upstream: its own key, in its format's header alone; a caller's own key where forwarded
    sent = [*upstream.headers, *(h for _, _, h, _ in upstream.other)]
    assert len(sent) > 40
    for headers in sent:
        auth = headers.get("authorization", "")
        api_key = headers.get("x-api-key", "")
        if auth == f"Bearer {OWN_KEY}":  # the pass-through caller's own, forwarded
            looked_through("a forwarded request's headers", [str(headers)], frozenset({OWN_KEY}))
        elif api_key == CLAUDE_UPSTREAM_KEY:
            assert not auth, headers
            looked_through("globex's upstream headers", [str(headers)],
                           frozenset({CLAUDE_UPSTREAM_KEY}))
        else:
            assert auth == f"Bearer {ACME_UPSTREAM_KEY}" and not api_key, headers
            looked_through("acme's upstream headers", [str(headers)],
                           frozenset({ACME_UPSTREAM_KEY}))
    looked_through("an upstream body", [b.decode("utf-8", "replace") for b in [
        *upstream.raw_bodies, *(body for *_, body in upstream.other)]])


def quoting_upstream(status: int, compress: bool) -> Any:
    """An upstream that refuses everything with ``status``, its error quoting every
    credential it got — whole, and cut across the chunks it sends (as gateways and
    OpenAI-compatible servers do: "Incorrect API key provided: sk-…") — and a header
    quoting the last of them."""
    import asyncio
    import gzip

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from runloop_proxy.scripted import ThreadedServer

    async def refuse(request: Request) -> StreamingResponse:
        await request.body()
        quoted = " and ".join(f"{k}: {v}" for k, v in request.headers.items()
                              if k in ("authorization", "x-api-key", "api-key"))
        body = orjson.dumps({"error": {"message": f"Incorrect API key provided: {quoted}",
                                       "type": "invalid_request_error", "param": None,
                                       "code": "invalid_api_key"}})
        headers = {"WWW-Authenticate": f"Bearer error=invalid_token, got={quoted[-40:]!r}"}
        if compress:
            body = gzip.compress(body)
            headers["Content-Encoding"] = "gzip"

        async def pieces() -> Any:  # seven bytes at a time: every key is cut somewhere
            for k in range(0, len(body), 7):
                yield body[k:k + 7]
                await asyncio.sleep(0)
        return StreamingResponse(pieces(), status, media_type="application/json",
                                 headers=headers)

    app = Starlette(routes=[Route("/{path:path}", refuse, methods=["GET", "POST"])])
    server = ThreadedServer(app, lifespan="off")
    port = server.start(0)
    return server, f"http://127.0.0.1:{port}/v1"


@pytest.mark.parametrize(("status", "compress"), [(400, False), (401, True), (403, False),
                                                  (404, True), (429, False), (500, True)])
def test_an_upstream_error_quoting_the_key_it_got_never_shows_it(
        tmp_path: Path, make_proxy: Any, status: int, compress: bool) -> None:
    """An upstream's error answer reaches the client on every path — an API's answer, JSON
    or streamed, count_tokens, a pass-through endpoint, as the upstream encoded it — and an
    upstream that refuses a key quotes it. Whatever key went upstream (a tenant's, the
    shared one, an Anthropic-format one, a pass-through caller's own), the answer shows
    none of them (every credential a request carried is masked in its error answers, in
    ``UpstreamResponse``, however the chunks cut it), and a tenant whose proxy key was good
    is not told it was not: a 401 or 403 to the proxy's key is a 502 upstream_auth_failed.
    Found by a red team: a tenant read the operator's key in a 401 on every API."""
    server, url = quoting_upstream(status, compress)
    try:
        tenant: ProxyServer = make_proxy(config_dir=str(config(tmp_path / "cfg", url)))
        passthrough: ProxyServer = make_proxy(admin_key=ADMIN_KEY, upstream_url=url)
        traffic = Traffic()
        for proxy, key in ((tenant, ACME_KEY), (tenant, GLOBEX_KEY), (passthrough, OWN_KEY)):
            for method, path, body in CALLS:
                r = traffic.send(proxy, method, path, body, {"Authorization": f"Bearer {key}"})
                # count_tokens to a chat upstream is the proxy's own count (200)
                assert r.status_code in (200, status, 502), (key, path, r.status_code, r.text)
                if status in (401, 403) and proxy is tenant and r.status_code != 200:
                    assert r.status_code == 502, (key, path, r.text)
                    assert "the upstream refused the key" in r.text, r.text
        looked_through("an answer", traffic.answers)
        assert any("[the upstream key]" in a for a in traffic.answers)
    finally:
        server.stop()


KEYS = ("sk-ab/0123456789+xyzLEAK", "sk-ab/01")  # one begins the other; "/" and "+" escape


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from([*KEYS, "sk-ab/0123456", "0123456789+xyzLEAK", "56789+xy",
                                 "sk-ab\\/0123456789+xyzLEAK", "sk-ab%2F0123456789%2BxyzLEAK",
                                 "x", "sk-", "é", " ", "****"]), max_size=24), st.data())
def test_a_masked_body_shows_no_run_of_a_key_however_it_is_cut(
        words: list[str], data: st.DataObject) -> None:
    """``Masker`` over any chunking of any body: the same output as the body in one chunk;
    no form of a key (as sent, JSON-escaped, percent-encoded) is left whole, nor any run of
    one ``RUN`` bytes or longer (a key cut short); and a body holding no such run comes out
    as it went in. Found by it: a short key that begins a longer one masked before the
    longer one's end had come (its tail shown); and by a red team, the key's JSON-escaped,
    percent-encoded and cut-short forms shown whole."""
    from runloop_proxy.pipeline.masking import (
        MASK,
        RUN,
        Masker,
        credentials_sent,
        forms_of,
        table_of,
    )

    values = credentials_sent({"Authorization": f"Bearer {KEYS[0]}", "x-api-key": KEYS[1]})
    table = table_of(values)
    assert table is not None
    forms = sorted({f for v in values for f in forms_of(v)}, key=len, reverse=True)
    body = "".join(words).encode()
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=8)))
    chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    masker = Masker(table)
    out = b"".join(masker.feed(c) for c in chunks) + masker.end()
    whole = Masker(table)
    assert out == whole.feed(body) + whole.end()
    left = out.split(MASK)
    held = False  # whether the body holds any run at all
    for form in forms:
        size = min(RUN, len(form))
        runs = {form[k:k + size] for k in range(len(form) - size + 1)}
        assert not any(r in part for part in left for r in runs), (form, out)
        held = held or any(r in body for r in runs)
    assert held or out == body
    # a chunk that ends after a byte no key holds is sent whole (a stream's event, at once)
    event = b'data: {"x": "sk-ab/01"}\n\n'
    assert Masker(table).feed(event) == event.replace(b"sk-ab/01", MASK)
