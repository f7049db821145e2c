"""The agent libraries users point at the proxy — LiteLLM, pydantic-ai, the OpenAI Agents SDK,
smolagents, LangGraph — by the requests they send (recorded from each, with the versions, in
tests/data/client_requests.json: the second request of a tool loop, streamed, chat completions
and the Responses API), so the suite needs none of them. Each goes through a real proxy, as
recorded and as JSON, with a round of the proxy's own tools in the answer, and the same request
straight to the scripted upstream is the oracle: what the client gets has the shape of what
the upstream gives it directly — one answer (one id, one ``created``, the role said once),
the upstream's usage chunk, a response that echoes the client's tools and never the proxy's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from runloop_proxy.pipeline.sse import SSEDecoder
from runloop_proxy.scripted import ScriptedUpstream, _as_chat

from .conftest import ProxyServer

REQUESTS: dict[str, dict[str, Any]] = json.loads(
    (Path(__file__).parent / "data" / "client_requests.json").read_text())
KEY = "sk-clients"
SAID = "Looking.found it"  # what the client is told, direct or through the proxy's round


def searching(body: dict[str, Any], pause: float = 0) -> dict[str, Any]:
    """A fake model: through the proxy it searches the history with the proxy's tool, then
    answers (after ``pause`` seconds); straight to the upstream (no such tool) it answers
    what the client would see."""
    chat = _as_chat(body)
    last = chat["messages"][-1]
    if last.get("role") == "tool" and last.get("tool_call_id") == "sh_1":
        return {"content": "found it", "delay": pause}
    search = next((t["function"]["name"] for t in chat.get("tools") or []
                   if t["function"]["name"].endswith("search_history")), None)
    if search is None:
        return {"content": SAID}
    return {"content": "Looking.", "tool_calls": [
        {"id": "sh_1", "name": search, "arguments": {"query": "SECRET"}}]}


def events(raw: bytes) -> list[Any]:
    """A stream's data payloads, parsed (``[DONE]`` kept as it is)."""
    out: list[Any] = []
    decoder = SSEDecoder()
    for ev in [*decoder.feed(raw), *decoder.flush()]:
        out.append(ev.data if ev.is_done else orjson.loads(ev.data))
    return out


def post(url: str, path: str, body: dict[str, Any], session: str) -> httpx.Response:
    r = httpx.post(url.removesuffix("/v1") + path, json=body, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "X-Session-Id": session})
    assert r.status_code == 200, r.text
    return r


def both(proxy: ProxyServer, upstream: ScriptedUpstream, name: str, stream: bool,
         pause: float = 0) -> tuple[httpx.Response, httpx.Response, dict[str, Any]]:
    """The recorded request (streamed as recorded, or as JSON) through the proxy, where the
    proxy answered a round of its own tools (the second ``pause`` seconds after the first),
    and straight to the upstream."""
    case = REQUESTS[name]
    body = dict(case["body"])
    if not stream:
        body.pop("stream_options", None)
        body["stream"] = False
    upstream.responder = lambda b: searching(b, pause)
    session = f"{name}-{stream}".replace(" ", "-")
    via = post(proxy.url, case["path"], body, session)
    rounds = [b for b in upstream.requests if "messages" in b or "input" in b]
    assert len(rounds) == 2, "the proxy answered a round of its own tools"
    direct = post(upstream.url, case["path"], body, session)
    return via, direct, body


CHAT = [n for n, c in REQUESTS.items() if c["path"] == "/v1/chat/completions"]
RESPONSES = [n for n, c in REQUESTS.items() if c["path"] == "/v1/responses"]


@pytest.mark.parametrize("name", CHAT)
def test_a_chat_stream_across_the_proxys_rounds_is_one_answer(
        proxy: ProxyServer, upstream: ScriptedUpstream, name: str) -> None:
    # a second apart: each round's chunks carry their own `created`
    via, direct, body = both(proxy, upstream, name, stream=True, pause=1.0)
    got, want = events(via.content), events(direct.content)
    assert got[-1] == want[-1] == "[DONE]" and got.count("[DONE]") == 1
    got, want = got[:-1], want[:-1]
    # one answer: one id, one time, each choice's role said once (a client adds up what
    # repeats: openai's stream helper made the role "assistantassistant")
    for chunks in (got, want):
        assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    roles = [d["role"] for c in got for ch in c["choices"] for d in [ch["delta"]]
             if d.get("role")]
    assert roles == ["assistant"]
    assert "".join(ch["delta"].get("content") or "" for c in got for ch in c["choices"]) == SAID
    assert not any(ch["delta"].get("tool_calls") for c in got for ch in c["choices"])
    # every chunk has the upstream's fields; the usage chunk is the upstream's own, with the
    # usage of both rounds
    assert {frozenset(c) for c in got if c["choices"]} == \
        {frozenset(c) for c in want if c["choices"]}
    usage = [c for c in got if not c["choices"]]
    if (body.get("stream_options") or {}).get("include_usage"):
        assert len(usage) == 1 and got[-1] is usage[0]
        assert set(usage[0]) == set(want[-1]) and not want[-1]["choices"]
        assert usage[0]["usage"]["prompt_tokens"] == sum(
            u["usage"]["prompt_tokens"] for u in _usage_chunks(upstream))
    else:
        assert not usage


def _usage_chunks(upstream: ScriptedUpstream) -> list[dict[str, Any]]:
    """What each of the proxy's upstream calls reported (the scripted upstream's count)."""
    from runloop_proxy.scripted import estimate_prompt_tokens
    calls = [b for b in upstream.requests if "messages" in b][:2]
    return [{"usage": {"prompt_tokens": estimate_prompt_tokens(b)}} for b in calls]


@pytest.mark.parametrize("name", CHAT)
def test_openais_stream_helper_reads_the_answer_across_the_proxys_rounds(
        proxy: ProxyServer, upstream: ScriptedUpstream, name: str) -> None:
    """The openai SDK's ``chat.completions.stream`` adds up every delta: a role said twice
    came out "assistantassistant", which the next request sends back."""
    upstream.responder = searching
    params = {k: v for k, v in REQUESTS[name]["body"].items() if k != "stream"}
    c = openai.OpenAI(base_url=proxy.url, api_key=KEY, max_retries=0)
    with c.chat.completions.stream(**params) as s:
        final = s.get_final_completion()
    message = final.choices[0].message
    assert message.role == "assistant" and message.content == SAID
    assert not message.tool_calls


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("name", RESPONSES)
def test_a_response_echoes_the_clients_tools_never_the_proxys(
        proxy: ProxyServer, upstream: ScriptedUpstream, name: str, stream: bool) -> None:
    via, direct, body = both(proxy, upstream, name, stream)
    if not stream:
        got, want = via.json(), direct.json()
        assert got["tools"] == want["tools"] == body["tools"]
        assert set(got) == set(want)
        return
    got, want = events(via.content), events(direct.content)
    shown = [e["response"] for e in got if isinstance(e.get("response"), dict)]
    assert [e["type"] for e in got if "response" in e] == \
        [e["type"] for e in want if "response" in e]  # created, in_progress, completed
    for response in shown:  # every response object the client is shown, in every event
        assert response["tools"] == want[0]["response"]["tools"] == body["tools"]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    final = shown[-1]
    assert set(final) == set(want[-1]["response"])
    assert not any(i["type"] == "function_call" for i in final["output"])
    text = "".join(p["text"] for i in final["output"] if i["type"] == "message"
                   for p in i["content"])
    assert text == SAID
