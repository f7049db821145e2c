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
import pytest

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
