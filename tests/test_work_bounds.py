"""What a request's tool schemas cost the event loop, through a real proxy, on every path that
reads them: chat completions, the Responses API, the Messages API (to an Anthropic upstream,
and bridged to a chat one), and count_tokens on both.

One event loop serves every client, so a body small enough to stay on it (DESIGN.md: "No
request can stall the others") must cost it work linear in its bytes. A red team reported a
1 KB tool schema that held every request 13 s; the class is any walk of a schema, or of the
text made of it, that is not linear — a node rendered once per kind of a type list, a
subtree walked again from each ancestor, a piece the tokenizer merges in quadratic time. The
test counts the calls the proxy's event-loop thread makes while it serves a request (and
writes what it leaves behind) for one shape of schema nested n and 4n levels deep, generated,
and holds the growth to about four times (counted, not timed: it holds on any machine).
"""

from __future__ import annotations

import itertools
import sys
import uuid
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from runloop_proxy.pipeline.offload import is_large_body

from .conftest import ProxyServer
from .test_schemas import LEAVES, LEVELS, fill

KEY = "sk-work-bounds"
HTTP = httpx.Client(timeout=60)
DEPTHS = (1, 4, 13)  # levels of the generated shape: a baseline, then n and 4n more
SLACK = 400  # calls a request's own handling varies by (its session, its write: ~40)
DESCRIBED = b'"Looks it up."'  # every body's tool, as ``bodies`` describes it
SENDS = itertools.count(100_000)


def loop_calls(proxy: ProxyServer, work: Any) -> int:
    """The calls made on the proxy's event-loop thread while ``work`` runs and while what it
    leaves behind runs (a profiler hook set in that thread only), from a quiet proxy to a
    quiet one: each request's summary runs behind its answer (the defaults make one), and
    one ending in the next request's window moved a count by 300 to 500 calls."""
    count = [0]

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call" or event == "c_call":
            count[0] += 1

    async def set_hook(h: Any) -> None:
        sys.setprofile(h)

    proxy.quiet()
    proxy.run(set_hook(hook))
    try:
        work()
        proxy.quiet()
    finally:
        proxy.run(set_hook(None))
    return count[0]


def bodies(schema: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """The same schema as each API carries it: path and body."""
    anthropic = {"model": "claude-sonnet-4-6", "max_tokens": 64,
                 "messages": [{"role": "user", "content": "hi"}],
                 "tools": [{"name": "f", "description": "Looks it up.", "input_schema": schema}]}
    return {
        "chat": ("/chat/completions", {
            "model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {
                "name": "f", "description": "Looks it up.", "parameters": schema}}]}),
        "responses": ("/responses", {
            "model": "gpt-4o", "store": False, "input": "hi", "tools": [
                {"type": "function", "name": "f", "description": "Looks it up.",
                 "parameters": schema}]}),
        "messages": ("/messages", anthropic),
        "count_tokens": ("/messages/count_tokens",
                         {k: v for k, v in anthropic.items() if k != "max_tokens"}),
    }


def send(proxy: ProxyServer, path: str, body: dict[str, Any]) -> int:
    """The event loop's calls for one request (a session of its own), answered 200: the
    fewest of three sends (what else the loop ran meanwhile — a timer, a Redis reply read
    in parts, a few more store calls — adds 100 to 200 to one of them, never takes away;
    the one level's count is multiplied by five in ``growth``). Each send's tool is
    described apart (a number of six digits, two tokens): the same tools again were
    counted from the cache of their tokens, and the fewer was always that one — a render
    of the schema gone quadratic stayed green."""
    raw = orjson.dumps(body)
    assert not is_large_body(raw), "the body must stay on the event loop to be measured"
    assert raw.count(DESCRIBED) == 1

    def once() -> int:
        got: list[httpx.Response] = []
        told = raw.replace(DESCRIBED, f'"Looks it up, {next(SENDS)}."'.encode())
        calls = loop_calls(proxy, lambda: got.append(HTTP.post(
            proxy.url + path, content=told, headers={
                "Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
                "X-Session-Id": uuid.uuid4().hex})))
        assert got[0].status_code == 200, got[0].text[:300]
        return calls
    return min(once(), once(), once())


def schema_of(levels: list[Any], leaf: Any, depth: int, width: int) -> dict[str, Any]:
    inner = leaf
    for _ in range(depth):
        for level in levels:
            inner = fill(level, inner)
    return {"type": "object", "properties": {f"x{i}": inner for i in range(width)}}


def growth(proxy: ProxyServer, api: str, levels: list[Any], leaf: Any,
           drawn: bool = False) -> None:
    sent = [bodies(schema_of(levels, leaf, depth, width=1))[api] for depth in DEPTHS]
    if drawn:
        # a drawn shape that holds its leaf twice a level doubles at each: one past the size
        # that leaves the event loop is not the loop's to bear (test_hardening has those)
        assume(not any(is_large_body(orjson.dumps(body)) for _, body in sent))
    measured = []
    for path, body in sent:
        schema = body["tools"][0].get("parameters") or body["tools"][0].get("input_schema") \
            or body["tools"][0]["function"]["parameters"]
        measured.append((send(proxy, path, body), len(orjson.dumps(schema))))
    (base, _), (small, small_bytes), (large, large_bytes) = measured
    assert large - base <= 5 * max(small - base, 0) + SLACK, \
        f"{api}: {base:,} calls at one level, {small:,} at {small_bytes:,} B, " \
        f"{large:,} at {large_bytes:,} B"


@pytest.fixture
def native(make_proxy: Any, upstream: Any) -> ProxyServer:
    upstream.keep_requests = False
    proxy: ProxyServer = make_proxy()
    for path, body in bodies({"type": "object"}).values():
        send(proxy, path, body)  # warm: what a process's first request loads
    return proxy


@pytest.fixture
def bridged(make_proxy: Any, upstream: Any) -> ProxyServer:
    upstream.keep_requests = False
    proxy: ProxyServer = make_proxy(upstream_format="chat")
    for api in ("messages", "count_tokens"):
        send(proxy, *bodies({"type": "object"})[api])
    return proxy


SHAPES = st.tuples(st.lists(LEVELS, min_size=1, max_size=2), LEAVES)
PROPERTY = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("api", ["chat", "responses", "messages", "count_tokens"])
@PROPERTY
@given(shape=SHAPES)
def test_a_schema_nested_deeper_costs_the_event_loop_linear_work(
        native: ProxyServer, api: str, shape: tuple[list[Any], Any]) -> None:
    growth(native, api, *shape, drawn=True)


@pytest.mark.parametrize("api", ["messages", "count_tokens"])
@PROPERTY
@given(shape=SHAPES)
def test_a_bridged_schema_nested_deeper_costs_the_event_loop_linear_work(
        bridged: ProxyServer, api: str, shape: tuple[list[Any], Any]) -> None:
    """The bridge translates a Messages request's tools to chat's and counts them itself."""
    growth(bridged, api, *shape, drawn=True)


# the shapes found or feared, as they were sent: each nested deeper, on every path
HOSTILE: dict[str, list[Any]] = {
    "type lists": [{"type": ["array", "array", "array", "null"], "items": "<hole>"}],
    "anyOf": [{"anyOf": ["<hole>", {"type": "null"}]}],
    "objects and type lists": [{"type": ["object", "null"], "properties": {
        "p": "<hole>", "q": {}}, "required": ["p"]}],
    "kinds reading both parts": [{"type": ["array", "object"], "items": "<hole>",
                                  "properties": {"p": {"type": "string"}}}],
}


@pytest.mark.parametrize("shape", sorted(HOSTILE))
@pytest.mark.parametrize("api", ["chat", "responses", "messages", "count_tokens"])
def test_the_hostile_shapes_cost_the_event_loop_linear_work(native: ProxyServer, api: str,
                                                            shape: str) -> None:
    growth(native, api, HOSTILE[shape], {"type": "string"})


@pytest.mark.parametrize("api", ["chat", "responses", "messages", "count_tokens"])
def test_one_long_piece_in_a_schema_costs_the_event_loop_linear_work(
        native: ProxyServer, api: str) -> None:
    """A description the tokenizer cannot split (one script, no spaces): four times as long,
    about four times the calls on the loop (tiktoken's own merge, quadratic before 0.13,
    makes no calls: tests/test_tokens.py counts it in a pure-Python merge)."""
    def calls_for(n: int) -> int:
        schema = {"type": "object", "properties": {"x": {
            "type": "string", "description": "".join(chr(0x4E00 + (i * 7919 + n) % 20_000)
                                                     for i in range(n))}}}
        return send(native, *bodies(schema)[api])

    base, small, large = calls_for(0), calls_for(2_000), calls_for(8_000)
    assert large - base <= 5 * max(small - base, 0) + SLACK, (base, small, large)
