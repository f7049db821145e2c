"""An error's type agrees with its status, by an oracle apart from the code under test:
Anthropic's documented error types (docs.anthropic.com, "Errors": HTTP status -> type), which
its SDKs and Claude Code act on. tests/test_error_shapes.py checks every path's shape, with
the proxy's own table as its oracle, so a wrong entry in that table passed it.

Swept: every status any of the proxy's errors carries and every documented one, through the
one rule every error takes (``api.http.error_shape``) on every path of Anthropic's API; and
for real, the errors a Messages client gets from the proxy itself (a bad key, a bad field, a
body over the limit, an unknown path) and from an upstream of chat completions translated by
the bridge, whatever its status. Planted, each red: 413 typed invalid_request_error; 504
typed api_error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from runloop_proxy import errors
from runloop_proxy.api.http import error_shape
from runloop_proxy.errors import error_body
from runloop_proxy.scripted import ScriptedUpstream

# https://docs.anthropic.com/en/api/errors
ANTHROPIC = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
             403: "permission_error", 404: "not_found_error", 413: "request_too_large",
             429: "rate_limit_error", 500: "api_error", 504: "timeout_error",
             529: "overloaded_error"}
KNOWN = set(ANTHROPIC.values())
KEY = "sk-error-types-0123456789"
MESSAGES = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


def statuses() -> set[int]:
    """Every status one of the proxy's errors carries, and every documented one."""
    out = set(ANTHROPIC)
    todo: list[type] = [errors.ProxyError]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if isinstance(getattr(cls, "status", None), int):
            out.add(cls.status)
    return out


def check(status: int, data: Any, where: str) -> None:
    assert isinstance(data, dict) and data.get("type") == "error", (where, data)
    kind = data["error"]["type"]
    if status in ANTHROPIC:
        assert kind == ANTHROPIC[status], f"{where}: {status} typed {kind!r}"
    else:  # a status Anthropic does not document: still one of its types, never made up
        assert kind in KNOWN, f"{where}: {status} typed {kind!r}"
    assert isinstance(data["error"]["message"], str) and data["error"]["message"], where


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens",
                                  "/v1/messages/batches", "/v1/v1/messages"])
def test_every_status_is_typed_as_anthropic_documents_it(path: str) -> None:
    assert len(statuses()) > len(ANTHROPIC)  # the proxy's own statuses are swept too
    for status in sorted(statuses()):
        body = error_body(f"status {status}", "invalid_request_error", None, None)
        check(status, error_shape(path)(status, body, None), f"{path} {status}")


def test_a_messages_client_reads_each_error_by_its_status(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    cfg = tmp_path / "cfg"
    (cfg / "tenants").mkdir(parents=True)
    (cfg / "runloop.toml").write_text(
        f'[server]\nmax_body_bytes = 4096\n[upstreams.up]\nurl = "{upstream.url}"\n'
        f'format = "chat"\napi_key = "sk-up"\nmax_retries = 0\n')
    (cfg / "tenants" / "acme.toml").write_text(f'keys = ["{KEY}"]\nupstream = "up"\n')
    proxy = make_proxy(config_dir=str(cfg))

    def post(path: str, body: Any, key: str = KEY, **kw: Any) -> httpx.Response:
        return httpx.post(proxy.base + path, json=body, timeout=30, headers={
            "x-api-key": key, "anthropic-version": "2023-06-01"}, **kw)

    # the proxy's own refusals
    answered = {
        "a bad key": post("/v1/messages", MESSAGES, key="sk-wrong-0123456789"),
        "a bad field": post("/v1/messages", {**MESSAGES, "max_tokens": "many"}),
        "a body over the limit": post("/v1/messages", {**MESSAGES, "pad": "x" * 8000}),
        "an unknown path": post("/v1/messages/batches", MESSAGES),
    }
    assert {k: r.status_code for k, r in answered.items()} == {
        "a bad key": 401, "a bad field": 400, "a body over the limit": 413,
        "an unknown path": 404}
    # an upstream of chat completions failing with each status, translated by the bridge
    for status in (400, 401, 403, 404, 413, 422, 429, 500, 502, 503, 504, 529):
        upstream.push({"status": status})
        answered[f"the upstream's {status}"] = post("/v1/messages", MESSAGES)
    for where, r in answered.items():
        check(r.status_code, r.json(), where)
    assert upstream.requests, "the upstream was asked"
