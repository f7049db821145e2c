"""Every error of the proxy's own comes back in its path's API's shape: Anthropic's on
``/v1/messages`` and every path below it (the proxy's routes and those it passes through),
OpenAI's everywhere else — one rule (``api.http.error_shape``), checked by a sweep over the
Messages paths, each method and each way the proxy itself refuses a request."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from runloop_proxy.api.messages_stream import ERROR_TYPES
from runloop_proxy.api.routes import CONVERSATIONS
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import free_port

KEY = "acme-proxy-key-0123456789"
# the Messages API's paths: the proxy's own routes, and those passed through (batches)
MESSAGES = [*(p for p in CONVERSATIONS if p.startswith("/v1/messages")), "/v1/messages/batches",
            "/v1/messages/batches/msgbatch_01", "/v1/messages/batches/msgbatch_01/results",
            "/v1/messages/batches/msgbatch_01/cancel", "/v1/messages/..%2f..%2fmodels"]
OTHERS = [*(p for p in CONVERSATIONS if not p.startswith("/v1/messages")), "/v1/models",
          "/v1/messagesx", "/v1/messages_batches"]
METHODS = ["POST", "GET", "DELETE"]


def tenant(tmp_path: Path, make_proxy: Any, url: str, fmt: str = "any", **kw: Any) -> Any:
    cfg = tmp_path / "cfg"
    (cfg / "tenants").mkdir(parents=True, exist_ok=True)
    (cfg / "runloop.toml").write_text(
        f'[upstreams.up]\nurl = "{url}"\nformat = "{fmt}"\napi_key = "sk-up"\n'
        f'max_retries = 0\n')
    (cfg / "tenants" / "acme.toml").write_text(f'keys = ["{KEY}"]\nupstream = "up"\n')
    return make_proxy(config_dir=str(cfg), **kw)


def check(r: httpx.Response, path: str, status: int) -> None:
    assert r.status_code == status, (path, r.status_code, r.text)
    data = r.json()
    if path in MESSAGES:  # the oracle: the lists above, not the rule under test
        assert data == {"type": "error", "error": {"type": ERROR_TYPES[status],
                                                   "message": data["error"]["message"]}}
        assert isinstance(data["error"]["message"], str) and data["error"]["message"]
    else:
        assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param",
                                                                 "code"}, (path, data)


def send(proxy: Any, method: str, path: str, key: str, body: bytes = b"{}") -> httpx.Response:
    return httpx.request(method, proxy.base + path, content=body if method == "POST" else None,
                         headers={"x-api-key": key, "content-type": "application/json"})


@pytest.mark.parametrize("path", MESSAGES + OTHERS)
def test_a_wrong_key_is_refused_in_the_paths_shape(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream, path: str) -> None:
    proxy = tenant(tmp_path, make_proxy, upstream.url)
    for method in METHODS:
        check(send(proxy, method, path, "wrong-key-0123456789"), path, 401)
    assert not upstream.requests and not upstream.other


@pytest.mark.parametrize("path", MESSAGES + OTHERS)
def test_an_unreachable_upstream_is_a_502_in_the_paths_shape(
        tmp_path: Path, make_proxy: Any, path: str) -> None:
    proxy = tenant(tmp_path, make_proxy, f"http://127.0.0.1:{free_port()}/v1")
    body = b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]' \
           b', "input": "x"}'
    for method in METHODS if path not in CONVERSATIONS else ["POST"]:
        if "%2f" in path:  # a path that would leave /v1/: refused before any call
            check(send(proxy, method, path, KEY, body), path, 400)
        elif path.endswith("count_tokens"):  # counted by the proxy: no call
            assert send(proxy, method, path, KEY, body).status_code == 200
        else:
            check(send(proxy, method, path, KEY, body), path, 502)


@pytest.mark.parametrize("path", MESSAGES + OTHERS)
def test_a_body_over_the_limit_is_a_413_in_the_paths_shape(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream, path: str) -> None:
    proxy = tenant(tmp_path, make_proxy, upstream.url, server={"max_body_bytes": 1024})
    if "%2f" in path:
        return  # refused for its path first (the previous test)
    check(send(proxy, "POST", path, KEY, b"x" * 5000), path, 413)


def test_a_chat_upstream_has_no_messages_endpoints_but_the_proxys(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Through the bridge the upstream speaks chat completions only: a Messages path the
    proxy does not answer itself is a 404 in Anthropic's shape, never sent upstream."""
    proxy = tenant(tmp_path, make_proxy, upstream.url, fmt="chat")
    for path in MESSAGES:
        if path in CONVERSATIONS or "%2f" in path:
            continue
        for method in METHODS:
            r = send(proxy, method, path, KEY)
            check(r, path, 404)
            assert "speaks chat completions" in r.json()["error"]["message"]
    assert not upstream.requests and not upstream.other
    assert send(proxy, "GET", "/v1/models", KEY).status_code == 200  # the rest goes through


def test_an_unknown_path_outside_v1_is_openai_shaped(proxy: Any) -> None:
    check(httpx.get(proxy.base + "/v2/messages"), "/v2/messages", 404)


@pytest.mark.parametrize(("path", "hint"), [
    ("/chat/completions", "did you mean /v1/chat/completions?"),
    ("/responses", "did you mean /v1/responses?"),
    ("/messages", "did you mean /v1/messages?"),
    ("/v1/v1/v1/messages", "the Anthropic SDKs add /v1 themselves"),
    ("/v1/v1/v1/chat/completions", "ends in /v1 twice"),
])
def test_a_base_url_off_by_v1_is_told_so(proxy: Any, upstream: ScriptedUpstream, path: str,
                                         hint: str) -> None:
    """Found by a newcomer: an OpenAI SDK without /v1 in its base URL, or an Anthropic SDK
    with it (then /v1/v1/messages went upstream with the client's key), got a bare 404. Each
    is a 404 that says what to change, answered by the proxy, in the shape of the API the
    client speaks (a newcomer's Claude Code with /v1 in its base URL read an OpenAI-shaped
    404 as "the model may not exist"). A base URL ending in /v1 once too often is served
    (tests/test_base_url.py); twice too often, told so."""
    r = httpx.post(proxy.base + path, json={}, headers={"Authorization": "Bearer sk-x"})
    check(r, "/v1/messages" if path.endswith("/v1/messages") else path, 404)
    assert hint in r.json()["error"]["message"]
    assert not upstream.other and not upstream.requests


# each API's required fields: a value of the wrong type, and what the message must name
REQUIRED = {
    "/v1/chat/completions": ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
                             {"model": (123, "string"), "messages": ("hi", "array")}),
    "/v1/responses": ({"model": "gpt-4o", "input": "hi"},
                      {"model": (["gpt-4o"], "string"),
                       "input": (123, "a string or an array")}),
    "/v1/messages": ({"model": "claude-sonnet-4-6", "max_tokens": 5,
                      "messages": [{"role": "user", "content": "hi"}]},
                     {"model": (False, "string"), "max_tokens": ("x", "integer"),
                      "messages": ("hi", "array")}),
}


@pytest.mark.parametrize("path", REQUIRED)
def test_a_required_field_missing_says_missing_and_one_of_the_wrong_type_names_the_type(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream, path: str) -> None:
    proxy = tenant(tmp_path, make_proxy, upstream.url)
    body, fields = REQUIRED[path]
    for name, (wrong, expected) in fields.items():
        for case, sent in (("missing", {k: v for k, v in body.items() if k != name}),
                           ("wrong", {**body, name: wrong})):
            r = send(proxy, "POST", path, KEY, orjson.dumps(sent))
            check(r, path, 400)
            error = r.json()["error"]
            message = error["message"]
            assert name in message, (path, case, message)
            if path not in MESSAGES:
                assert error["param"] == name, (path, case, error)
            if case == "missing":
                assert "missing" in message.lower(), (path, name, message)
            else:
                assert expected in message and "required" not in message.lower(), (
                    path, name, message)


CANARY = "SSN 078-05-1120"
LOOK = [{"type": "function", "function": {"name": "look", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.mark.parametrize("case", ["wrong shape", "tool round refused", "stream error event",
                                  "Responses failed", "Messages stream error"])
def test_what_an_upstream_quotes_reaches_the_client_and_never_the_logs(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream,
        caplog: pytest.LogCaptureFixture, case: str) -> None:
    """Finding (red team): an upstream's text quoted into an error (a gateway echoing the
    prompt, an error body quoting the input) went into two log lines a request. One rule:
    an UpstreamError keeps what it quotes apart (``quoted``), the client reads it whole,
    and every log line says ``log_text``. Swept over each way an upstream's text becomes
    an error: a body of the wrong shape, a proxy tool round refused, and an error event in
    a chat, Responses and Messages stream."""
    cfg = tmp_path / "cfg"
    (cfg / "tenants").mkdir(parents=True)
    (cfg / "runloop.toml").write_text(f'[upstreams.up]\nurl = "{upstream.url}"\n'
                                      f'api_key = "sk-up"\nmax_retries = 0\n')
    # the proxy's tools ride along: it reads every answer (a relayed one is the client's)
    (cfg / "tenants" / "acme.toml").write_text(
        f'keys = ["{KEY}"]\nupstream = "up"\n[policy]\nproxy_tools = "always"\n')
    proxy = make_proxy(config_dir=str(cfg))
    echo = {"error": {"message": f"invalid input: {CANARY}", "type": "invalid_request_error"}}
    path, body = "/chat/completions", {"model": "m", "tools": LOOK, "messages": [
        {"role": "user", "content": f"my {CANARY}"}]}
    if case == "wrong shape":
        upstream.push({"raw_body": orjson.dumps({"echo": body["messages"]}),
                       "headers": {"Content-Type": "application/json"}})
    elif case == "tool round refused":
        upstream.push({"tool_calls": [{"id": "s1", "name": "search_history",
                                       "arguments": {"query": "x"}}]},
                      {"status": 400, "body": echo})
    elif case == "stream error event":
        body["stream"] = True
        upstream.push({"raw_body": b"data: " + orjson.dumps(echo) + b"\n\n",
                       "headers": {"Content-Type": "text/event-stream"}})
    elif case == "Responses failed":
        path, body = "/responses", {"model": "m", "input": f"my {CANARY}", "stream": True,
                                    "tools": [{"type": "function", "name": "look",
                                               "parameters": LOOK[0]["function"]["parameters"]}]}
        upstream.push({"raw_body": b"data: " + orjson.dumps({"type": "error", **echo})
                       + b"\n\n", "headers": {"Content-Type": "text/event-stream"}})
    else:
        path, body = "/messages", {"model": "m", "max_tokens": 64, "stream": True,
                                   "messages": [{"role": "user", "content": f"my {CANARY}"}],
                                   "tools": [{"name": "look", "input_schema":
                                              LOOK[0]["function"]["parameters"]}]}
        upstream.push({"raw_body": b"event: error\ndata: " + orjson.dumps(
            {"type": "error", "error": {"type": "api_error", "message": echo["error"]["message"]}})
            + b"\n\n", "headers": {"Content-Type": "text/event-stream"}})
    with caplog.at_level("INFO"):
        r = httpx.post(proxy.url + path, json=body, timeout=30,
                       headers={"Authorization": f"Bearer {KEY}"})
        proxy.settle()
    assert CANARY in r.text, (r.status_code, r.text)  # the client can tell what went wrong
    logged = [rec.getMessage() + " " + repr(rec.__dict__) for rec in caplog.records]
    assert logged and not [line for line in logged if CANARY in line]
    assert any("not logged" in line for line in logged)


@pytest.mark.parametrize("path", REQUIRED)
@pytest.mark.parametrize(("field", "value", "expected"), [
    ("stream", "yes", "a boolean"), ("tools", "x", "an array"), ("metadata", [1], "an object")])
def test_an_optional_field_of_the_wrong_type_names_what_it_must_be_in_every_api(
        proxy: Any, upstream: ScriptedUpstream, path: str, field: str, value: Any,
        expected: str) -> None:
    """Found by a newcomer: the same mistake was told three ways ('must be a boolean', 'has
    the wrong type', 'wrong type'). Every API names what the field must be and what it got."""
    body = {**REQUIRED[path][0], field: value}
    r = httpx.post(proxy.base + path, json=body, headers={"Authorization": "Bearer sk-x"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert expected in message and json_kind_of(value) in message, message
    assert not upstream.requests


def json_kind_of(value: Any) -> str:
    return {str: "a string", list: "an array"}[type(value)]


HUGE = " ".join(f"w{i}" for i in range(6000))
OPENAI_WORDS = re.compile(r"This model's maximum context length is (\d+) tokens[^.]*\. "
                          r"However, your messages resulted in (\d+) tokens\. ")
ANTHROPIC_WORDS = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum\. ")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("path", REQUIRED)
def test_a_request_that_cannot_fit_is_told_in_its_apis_own_words(
        make_proxy: Any, upstream: ScriptedUpstream, path: str, stream: bool) -> None:
    """Clients tell a context error by its words as their provider writes them: OpenAI's
    (LiteLLM raises ContextWindowExceededError on "This model's maximum context length is",
    and falls back to a larger model; it read the proxy's own wording as a plain 400), and
    Anthropic's "prompt is too long" (Claude Code compacts) — each alone, in its own API."""
    proxy = make_proxy(context_window=2000)
    body: dict[str, Any] = {**REQUIRED[path][0], "model": "unknown-model", "stream": stream}
    if "input" in body:
        body["input"] = HUGE
    else:
        body["messages"] = [{"role": "user", "content": HUGE}]
    r = httpx.post(proxy.base + path, json=body, timeout=30,
                   headers={"Authorization": "Bearer sk-ctx", "x-api-key": "sk-ctx"})
    check(r, path, 400)
    message = r.json()["error"]["message"]
    if path in MESSAGES:
        words = ANTHROPIC_WORDS.match(message)
        assert words and "maximum context length" not in message, message
        needed, allowed = map(int, words.groups())
    else:
        words = OPENAI_WORDS.match(message)
        assert words and r.json()["error"]["code"] == "context_length_exceeded", message
        allowed, needed = map(int, words.groups())
    assert 0 < allowed < 2000 < needed
    assert not upstream.requests
