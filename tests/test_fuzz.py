"""Hostile and random request bodies against a running proxy: every answer is a 2xx or an
OpenAI-shaped 4xx — never a 500, never a dropped connection. Bodies are generated from the
chat-completions request schema of OpenAI's OpenAPI spec (tests/data/chat_request.schema.json)
and mutated from valid ones, including ones the proxy compresses (its window and tool paths)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer
from .test_tools import CLIENT_TOOLS, long_session

SCHEMA = json.loads((Path(__file__).parent / "data" / "chat_request.schema.json").read_text())
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=12)
                    | st.floats(allow_nan=False, allow_infinity=False),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def from_schema(s: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """A strategy for values of an (OpenAPI-flavoured) JSON schema."""
    if depth > 7 or not s:
        return JSON
    if "allOf" in s:
        merged: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
        for part in s["allOf"]:
            merged["properties"].update(part.get("properties", {}))
            merged["required"] += part.get("required", [])
        return from_schema(merged, depth)
    for key in ("oneOf", "anyOf"):
        if key in s:
            return st.one_of([from_schema(x, depth + 1) for x in s[key]])
    if "enum" in s:
        return st.sampled_from(s["enum"])
    base = _typed(s, depth)
    return st.none() | base if s.get("nullable") else base


def _typed(s: dict[str, Any], depth: int) -> st.SearchStrategy[Any]:
    kind = s.get("type")
    if kind == "object" or "properties" in s:
        props = s.get("properties", {})
        required = [k for k in s.get("required", []) if k in props]
        return st.fixed_dictionaries(
            {k: from_schema(props[k], depth + 1) for k in required},
            optional={k: from_schema(v, depth + 1) for k, v in props.items()
                      if k not in required})
    if kind == "array":
        return st.lists(from_schema(s.get("items", {}), depth + 1),
                        min_size=s.get("minItems", 0), max_size=min(s.get("maxItems", 3), 3))
    if kind == "string":
        return st.text(max_size=24)
    if kind == "integer":
        return st.integers(min_value=s.get("minimum", -5), max_value=s.get("maximum", 4096))
    if kind == "number":
        return st.floats(min_value=s.get("minimum", -3), max_value=s.get("maximum", 3))
    if kind == "boolean":
        return st.booleans()
    return JSON


HTTP = httpx.Client(timeout=30)  # one client: building one costs more than a request


def check(proxy: ProxyServer, body: Any, raw: bytes | None = None) -> None:
    payload = raw if raw is not None else json.dumps(body).encode()
    r = HTTP.post(proxy.url + "/chat/completions", content=payload,
                  headers={"Authorization": "Bearer sk-fuzz", "Content-Type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:300], payload[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert b"internal error in runloop-proxy" not in r.content


@pytest.fixture
def fuzz_proxy(proxy: ProxyServer, upstream: ScriptedUpstream) -> ProxyServer:
    upstream.keep_requests = False
    return proxy


@settings(max_examples=1000, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=from_schema(SCHEMA))
def test_bodies_from_the_schema(fuzz_proxy: ProxyServer, body: Any) -> None:
    check(fuzz_proxy, body)


BASES = [
    {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "gpt-4o-mini", "stream": True, "stream_options": {"include_usage": True},
     "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]},
    # compressed: the window, the proxy's tools and its rounds are all on the path
    {"model": "gpt-4o-mini", "messages": long_session(), "tools": CLIENT_TOOLS},
    {"model": "gpt-4o-mini", "stream": True, "messages": long_session(), "tools": CLIENT_TOOLS},
]


@st.composite
def mutated(draw: Any) -> Any:
    """A valid body with one to three of its values replaced, removed or nested deep."""
    body = json.loads(json.dumps(draw(st.sampled_from(BASES))))
    for _ in range(draw(st.integers(1, 3))):
        node, key = body, None
        path_len = draw(st.integers(0, 4))
        for _ in range(path_len):
            keys = list(node) if isinstance(node, dict) else list(range(len(node))) \
                if isinstance(node, list) else []
            if not keys:
                break
            key = draw(st.sampled_from(keys))
            if not isinstance(node[key], (dict, list)):
                break
            node = node[key]
            key = None
        if not isinstance(node, (dict, list)) or not node:
            continue
        if key is None:
            key = draw(st.sampled_from(list(node) if isinstance(node, dict)
                                       else list(range(len(node)))))
        action = draw(st.sampled_from(["replace", "delete", "deep"]))
        if action == "delete":
            del node[key]
        elif action == "deep":
            depth = draw(st.sampled_from([70, 260, 1000]))
            node[key] = json.loads("[" * depth + "]" * depth)
        else:
            node[key] = draw(JSON)
    return body


@settings(max_examples=1000, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=mutated())
def test_mutated_bodies(fuzz_proxy: ProxyServer, body: Any) -> None:
    check(fuzz_proxy, body)


HAND_WRITTEN = [
    b"", b"null", b"[]", b'"text"', b"{", b'{"model": "m"}', b'{"messages": []}',
    b'{"model": "m", "messages": [{"role": ["user"], "content": "x"}]}',
    b'{"model": "m", "messages": [{"role": {"a": 1}, "content": "x"}]}',
    b'{"model": "m", "messages": [{"role": "assistant", "function_call": "x"}]}',
    b'{"model": "m", "messages": [{"role": "assistant", "content": null, "refusal": [1]}]}',
    # three keys but not the fast path's three (found by the schema fuzzer)
    b'{"model": "m", "messages": [{"role": "assistant", "tool_calls": [], "refusal": 1}]}',
    b'{"model": "m", "stream": true, "stream_options": "yes", "messages": '
    b'[{"role": "user", "content": "x"}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": -1}',
    b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": true}',
    b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "user": 5}',
    b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "metadata": '
    b'{"session_id": "a\\u0000b"}}',
    b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"model": "m", "messages": [{"role": "tool", "content": "x"}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": [1, 2]}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": '
    b'"function", "function": {"name": "f", "parameters": "no"}}]}',
    b'{"model": "' + b"m" * 100_000 + b'", "messages": [{"role": "user", "content": "x"}]}',
    b'{"model": "m", "x": ' + b"[" * 300 + b"]" * 300 + b', "messages": '
    b'[{"role": "user", "content": "x"}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "x"}]' + b" " * 10 + b"}",
    b'\xff\xfe{"model": "m"}',
]


@pytest.mark.parametrize("raw", HAND_WRITTEN)
def test_hand_written_bodies(fuzz_proxy: ProxyServer, raw: bytes) -> None:
    check(fuzz_proxy, None, raw)
