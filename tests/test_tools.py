"""Proxy-owned tools through the real proxy: the model recalls, the client never sees it."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import openai
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy.conversation.identity import named_key
from runloop_proxy.conversation.messages import message_hash, message_refs
from runloop_proxy.pipeline.tokens import TokenCounter
from runloop_proxy.pipeline.tools import (
    MAX_CALLS,
    MAX_QUERY_CHARS,
    MAX_QUERY_TERMS,
    ProxyTools,
    ToolRunner,
    definitions_tokens,
    query_terms,
    rank,
)
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer, until
from .work import calls

CLIENT_TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}}}}]


def long_session(steps: int = 14, size: int = 300) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                  {"role": "user", "content": "fix the bug"}]
    for k in range(steps):
        msgs.append({"role": "assistant", "content": f"step {k}", "tool_calls": [
            {"id": f"call_{k}", "type": "function",
             "function": {"name": "bash", "arguments": f'{{"cmd": "cat f{k}"}}'}}]})
        body = " ".join(f"line{k}_{i}" for i in range(size))
        msgs.append({"role": "tool", "tool_call_id": f"call_{k}", "content": f"OUT{k} {body}"})
    return msgs


def recall_name(body: dict[str, Any], kind: str = "recall_tool_call") -> str | None:
    for t in body.get("tools") or []:
        name = t["function"]["name"]
        if name.endswith(kind):
            return str(name)
    return None


def elided_ref(messages: list[dict[str, Any]], call_id: str) -> str | None:
    """The id the placeholder of ``call_id``'s result tells the model to recall it with."""
    for m in messages:
        if m.get("role") == "tool" and m.get("tool_call_id") == call_id:
            found = re.search(r'recall_tool_call\(call_id="([^"]+)"\)', str(m.get("content")))
            return found.group(1) if found else None
    return None


def recalling_responder(target: str = "call_0") -> Any:
    """A fake model: recalls ``target`` when it sees it elided, then answers with it."""
    def respond(body: dict[str, Any]) -> dict[str, Any]:
        last = body["messages"][-1]
        if last["role"] == "tool" and last["tool_call_id"].startswith("rc_"):
            return {"content": "recalled: " + str(last["content"])[:12],
                    "prompt_tokens": 100}
        name = recall_name(body)
        ref = elided_ref(body["messages"], target)
        if name and ref:
            return {"content": "Let me look.", "tool_calls": [
                {"id": "rc_1", "name": name, "arguments": {"call_id": ref}}],
                "prompt_tokens": 100}
        return {"content": "no recall needed", "prompt_tokens": 100}
    return respond


def test_the_proxy_tools_cost_their_names_and_parameters_alone() -> None:
    """They ride in every request of a session with client tools, so they carry no
    description: the window's notes say which one returns what, with the argument to pass
    (recall_tool_call(call_id="…"), search_history(query)). 32 tokens as gpt-4o renders
    them (41 with the descriptions they had, 59 with sentences)."""
    counter = TokenCounter()
    enc, exact = counter.encoding("gpt-4o")
    functions = ProxyTools.for_request(CLIENT_TOOLS).functions()
    assert exact and [(f["name"], sorted(f), f["parameters"]["required"]) for f in functions] \
        == [("recall_tool_call", ["name", "parameters"], ["call_id"]),
            ("search_history", ["name", "parameters"], ["query"])]
    assert definitions_tokens(counter, enc) == 32


def test_window_is_compressed_and_recall_is_answered_by_the_proxy(
        proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    upstream.responder = recalling_responder()
    msgs = long_session()
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-t", max_retries=0)
    r = c.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=msgs,
                                                    tools=CLIENT_TOOLS)
    resp = r.parse()
    assert resp.choices[0].message.content == "recalled: OUT0 line0_0"
    assert resp.choices[0].message.tool_calls is None
    assert resp.usage is not None and resp.usage.prompt_tokens == 200  # both upstream calls
    first, second = upstream.requests[-2], upstream.requests[-1]
    assert len(orjson.dumps(first["messages"])) < len(orjson.dumps(msgs)) * 0.8
    assert [t["function"]["name"] for t in first["tools"]] == \
        ["bash", "recall_tool_call", "search_history"]
    recalled = second["messages"][-1]
    assert recalled["role"] == "tool" and recalled["content"] == msgs[3]["content"]
    tin, tout = map(int, r.headers["x-runloop-tokens"].split(";"))
    assert tout < tin


@pytest.mark.parametrize(("upstream_status", "client_status"), [(503, 503), (429, 502)])
def test_an_upstream_failing_a_proxy_tool_round_fails_the_request_in_the_clients_shape(
        proxy: ProxyServer, upstream: ScriptedUpstream, upstream_status: int,
        client_status: int) -> None:
    """The model asked for a recall, and the upstream refused the round that answers it: the
    client gets an error, never the first round's half-answer — a server error as the
    upstream said it, a refusal of the proxy's own round (its 4xx is not the client's doing)
    as a bad gateway."""
    recall = recalling_responder()

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        if body["messages"][-1]["role"] == "tool" and \
                body["messages"][-1]["tool_call_id"].startswith("rc_"):
            return {"status": upstream_status}
        return recall(body)
    upstream.responder = respond
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-t", max_retries=0,
                      default_headers={"X-Session-Id": f"failed-round-{upstream_status}"})
    with pytest.raises(openai.APIStatusError) as failed:
        c.chat.completions.create(model="gpt-4o-mini", messages=long_session(),
                                  tools=CLIENT_TOOLS)
    assert failed.value.status_code == client_status
    body: Any = failed.value.body
    assert f"the upstream answered {upstream_status} to a proxy tool round" in body["message"]
    # the round was asked for (and retried as any upstream call is); no third round
    rounds = [b["messages"][-1].get("tool_call_id") for b in upstream.requests]
    assert rounds[0] != "rc_1" and set(rounds[1:]) == {"rc_1"}


def test_streaming_recall_is_invisible_and_content_flows(proxy: ProxyServer,
                                                         upstream: ScriptedUpstream) -> None:
    upstream.responder = recalling_responder()
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-t", max_retries=0)
    stream = c.chat.completions.create(model="gpt-4o-mini", messages=long_session(),
                                       tools=CLIENT_TOOLS, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "Let me look.recalled: OUT0 line0_0"
    assert not any(ch.choices and ch.choices[0].delta.tool_calls for ch in chunks)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices
                and ch.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert len({ch.id for ch in chunks}) == 1
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 200


def test_streaming_raw_has_one_done(proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    upstream.responder = recalling_responder()
    body = {"model": "gpt-4o-mini", "messages": long_session(), "tools": CLIENT_TOOLS,
            "stream": True}
    with httpx.stream("POST", proxy.url + "/chat/completions", json=body, timeout=30) as r:
        raw = b"".join(r.iter_bytes())
    assert raw.count(b"data: [DONE]") == 1 and raw.rstrip().endswith(b"data: [DONE]")
    assert b"recall_tool_call" not in raw
    assert b'"usage"' not in raw  # the client did not ask for usage


def test_mixed_calls_client_gets_its_own_and_proxy_part_is_spliced_back(
        proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    msgs = long_session()

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        if any(m.get("tool_call_id") == "client_1" for m in body["messages"]):
            return {"content": "all done"}
        return {"tool_calls": [{"id": "rc_9", "name": recall_name(body),
                                "arguments": {"call_id": "call_1"}},
                               {"id": "client_1", "name": "bash",
                                "arguments": {"cmd": "ls"}}]}

    upstream.responder = respond
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-t", max_retries=0,
                      default_headers={"X-Session-Id": "mixed-1"})
    first = c.chat.completions.create(model="gpt-4o-mini", messages=msgs, tools=CLIENT_TOOLS)
    calls = first.choices[0].message.tool_calls
    assert calls is not None and [t.id for t in calls] == ["client_1"]
    assert first.choices[0].finish_reason == "tool_calls"
    msgs.append(first.choices[0].message.model_dump(exclude_none=True))
    msgs.append({"role": "tool", "tool_call_id": "client_1", "content": "file_a file_b"})
    until(lambda: proxy.state.store.cached_internal(_tenant(), named_key("mixed-1")),
          what="the proxy's part of the turn kept")
    second = c.chat.completions.create(model="gpt-4o-mini", messages=msgs, tools=CLIENT_TOOLS)
    assert second.choices[0].message.content == "all done"
    sent = upstream.requests[-1]["messages"]
    spliced = [m for m in sent if m.get("tool_calls")
               and {t["id"] for t in m["tool_calls"]} == {"rc_9", "client_1"}]
    assert spliced, "the upstream must see the assistant message with both calls"
    i = sent.index(spliced[0])
    answered = {m["tool_call_id"] for m in sent[i + 1:i + 3]}
    assert answered == {"rc_9", "client_1"}
    recalled = next(m for m in sent if m.get("tool_call_id") == "rc_9")
    assert recalled["content"] == msgs[5]["content"]


def _tenant() -> str:
    import hashlib

    return "pt-" + hashlib.sha256(b"sk-t").hexdigest()[:16]


def test_search_history_returns_ranked_snippets(proxy: ProxyServer,
                                                upstream: ScriptedUpstream) -> None:
    def respond(body: dict[str, Any]) -> dict[str, Any]:
        last = body["messages"][-1]
        if last.get("tool_call_id") == "sh_1":
            return {"content": str(last["content"])[:300]}
        return {"tool_calls": [{"id": "sh_1", "name": recall_name(body, "search_history"),
                                "arguments": {"query": "line3_17"}}]}

    upstream.responder = respond
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-t", max_retries=0)
    r = c.chat.completions.create(model="gpt-4o-mini", messages=long_session(),
                                  tools=CLIENT_TOOLS)
    answer = r.choices[0].message.content or ""
    msgs = long_session()
    refs = message_refs([message_hash(m) for m in msgs])
    ref = next(r for m, r in zip(msgs, refs, strict=True) if m.get("tool_call_id") == "call_3")
    assert "best match" in answer and f"id={ref}" in answer


@pytest.mark.parametrize(("arguments", "why"), [
    ("[1, 2]", "arguments must be a JSON object"),
    ('"c1"', "arguments must be a JSON object"),
    ("{not json", "unexpected character"),
])
@pytest.mark.parametrize("tool", ["recall_tool_call", "search_history"])
def test_arguments_that_are_not_an_object_are_an_error_the_model_reads(
        tool: str, arguments: str, why: str) -> None:
    """The model's arguments are request content: any JSON but an object (or none) is
    answered as an error it can read and correct, counted as bad arguments — never a crash."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    runner = ToolRunner(ProxyTools.for_request(None), msgs,  # type: ignore[arg-type]
                        [message_hash(m) for m in msgs], 5)  # type: ignore[arg-type]
    answer = asyncio.run(runner.run({"id": "x1", "type": "function", "function": {
        "name": tool, "arguments": arguments}}))
    assert answer["role"] == "tool" and answer["tool_call_id"] == "x1"
    assert str(answer["content"]).startswith("error: invalid arguments (")
    assert why.lower() in str(answer["content"]).lower()
    assert runner.outcomes == [(tool, "bad_arguments")]


def recall(messages: list[dict[str, Any]], ref: str) -> tuple[Any, str]:
    runner = ToolRunner(ProxyTools.for_request(None), messages,  # type: ignore[arg-type]
                        [message_hash(m) for m in messages], 5)  # type: ignore[arg-type]
    return asyncio.run(runner.recall(ref))


RECALL_CASES = [
    # (what the model passes, expected content or None, expected outcome)
    ("REF:c1", "first out", "hit"),
    ("REF:c1#2", "second out", "hit"),
    ("c2", "other out", "hit"),  # a plain call id works too
    ("args:c2", '{"cmd":"ls -la /very/long/path"}', "hit"),
    ("args:nope", None, "not_found"),
    ("ffffff", None, "not_found"),
    ("", None, "bad_arguments"),
]


@pytest.mark.parametrize(("ref", "want", "outcome"), RECALL_CASES)
def test_recall_resolves_refs_call_ids_and_arguments(ref: str, want: Any, outcome: str) -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "first out"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "second out"},
        {"role": "assistant", "tool_calls": [{"id": "c2", "type": "function", "function": {
            "name": "bash", "arguments": '{"cmd":"ls -la /very/long/path"}'}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "other out"},
    ]
    refs = [r for m, r in zip(msgs, message_refs([message_hash(m) for m in msgs]),  # type: ignore[arg-type]
                              strict=True) if m["role"] == "tool"]
    ref = {"REF:c1": refs[0], "REF:c1#2": refs[1]}.get(ref, ref)
    content, got = recall(msgs, ref)
    assert got == outcome
    if want is not None:
        assert content == want


def test_recall_of_a_reused_call_id_names_the_other_results() -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "tool", "tool_call_id": "dup", "content": "one"},
        {"role": "tool", "tool_call_id": "dup", "content": "two"}]
    refs = message_refs([message_hash(m) for m in msgs])  # type: ignore[arg-type]
    content, outcome = recall(msgs, "dup")
    assert outcome == "hit" and content.startswith("one") and refs[1] in content


def test_client_tool_with_the_same_name_wins(proxy: ProxyServer,
                                             upstream: ScriptedUpstream) -> None:
    tools = [*CLIENT_TOOLS, {"type": "function", "function": {"name": "recall_tool_call",
                                                              "parameters": {}}}]
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-t", max_retries=0)
    c.chat.completions.create(model="gpt-4o-mini", messages=long_session(), tools=tools)
    names = [t["function"]["name"] for t in upstream.requests[-1]["tools"]]
    assert names == ["bash", "recall_tool_call", "runloop_recall_tool_call", "search_history"]
    # the window's notes name the proxy's tool as renamed, never the client's
    sent = orjson.dumps(upstream.requests[-1]["messages"]).decode()
    assert 'runloop_recall_tool_call(call_id=\\"' in sent
    assert sent.count("recall_tool_call(") == sent.count("runloop_recall_tool_call(")
    assert ProxyTools.for_request(tools).names == {"runloop_recall_tool_call": "recall_tool_call",
                                                  "search_history": "search_history"}


def test_tool_rounds_are_bounded(proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    def respond(body: dict[str, Any]) -> dict[str, Any]:
        name = recall_name(body)
        if name is None:
            return {"content": "gave up recalling"}
        return {"tool_calls": [{"name": name, "arguments": {"call_id": "call_0"}}]}

    upstream.responder = respond
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-t", max_retries=0)
    r = c.chat.completions.create(model="gpt-4o-mini", messages=long_session(),
                                  tools=CLIENT_TOOLS)
    assert r.choices[0].message.content == "gave up recalling"
    assert len(upstream.requests) == 1 + proxy.state.config.passthrough.policy.max_tool_rounds


def test_context_length_exceeded_is_openai_shaped(make_proxy: Any,
                                                  upstream: ScriptedUpstream) -> None:
    proxy = make_proxy(context_window=2000)
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-t", max_retries=0)
    huge = " ".join(f"w{i}" for i in range(6000))
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="unknown-model", messages=[
            {"role": "user", "content": huge}])
    assert info.value.code == "context_length_exceeded"
    assert len(upstream.requests) == 0


def test_rank_prefers_rare_terms() -> None:
    corpus = [("a", {"role": "tool", "content": "common common rare_word"}),
              ("b", {"role": "tool", "content": "common common common"})]
    hits = rank(["rare_word"], corpus, 5)  # type: ignore[arg-type]
    assert [k for _, k, _ in hits] == ["a"]


async def test_async_streaming_recall(proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    upstream.responder = recalling_responder("call_2")
    c = openai.AsyncOpenAI(base_url=proxy.url, api_key="sk-t", max_retries=0)
    stream = await c.chat.completions.create(model="gpt-4o-mini", messages=long_session(),
                                             tools=CLIENT_TOOLS, stream=True)
    text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
    assert text.endswith("recalled: OUT2 line2_0")
    await c.close()
    await asyncio.sleep(0)


def test_compressed_stream_without_proxy_tools_adds_no_usage_chunk(
        proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    body = {"model": "gpt-4o-mini", "messages": long_session(), "stream": True, "n": 2}
    with httpx.stream("POST", proxy.url + "/chat/completions", json=body, timeout=30) as r:
        raw = b"".join(r.iter_bytes())
        client, forwarded = map(int, r.headers["x-runloop-tokens"].split(";"))
        assert forwarded < client  # the window was compressed
    assert b'"choices":[]' not in raw and raw.count(b"[DONE]") == 1
    sent = upstream.requests[-1]
    assert "stream_options" not in sent and "tools" not in sent  # n>1: no proxy tools


@pytest.mark.parametrize("stream", [False, True])
def test_usage_over_the_proxys_rounds_is_summed_and_sent_only_when_asked(
        proxy: ProxyServer, upstream: ScriptedUpstream, stream: bool) -> None:
    """A request the proxy answered in two rounds reports both rounds' usage, every count
    summed, the nested ones too (``prompt_tokens_details.cached_tokens``); a stream sends
    its usage chunk only to a client that asked for it (``include_usage``). Two survivors
    of a planted-bug pass: the first round's details kept alone; a usage chunk sent to any
    client with ``stream_options``."""
    def respond(body: dict[str, Any]) -> dict[str, Any]:
        reply = recalling_responder("call_2")(body)
        return {**reply, "cached_tokens": 40 if reply["content"] == "Let me look." else 60}

    bodies = []
    for asked in (True, False):
        upstream.responder = respond
        body: dict[str, Any] = {"model": "gpt-4o-mini", "messages": long_session(),
                                "tools": CLIENT_TOOLS}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": asked}}
        r = httpx.post(proxy.url + "/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert len(upstream.requests) >= 2  # the proxy's recall round went upstream
        upstream.requests.clear()
        if not stream:
            bodies.append(r.json()["usage"])
            break
        chunks = [orjson.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        usage = [c["usage"] for c in chunks if c.get("usage")]
        if not asked:
            assert usage == [] and not [c for c in chunks if c.get("choices") == []]
        else:
            assert len(usage) == 1
            bodies.append(usage[0])
    (usage,) = bodies
    assert usage["prompt_tokens"] == 200
    assert usage["prompt_tokens_details"]["cached_tokens"] == 100


def test_a_failing_window_passes_the_request_through(proxy: ProxyServer,
                                                     upstream: ScriptedUpstream,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected window bug")

    monkeypatch.setattr("runloop_proxy.pipeline.framing.build_window", broken)
    msgs = long_session()
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-t", max_retries=0)
    r = c.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=msgs,
                                                    tools=CLIENT_TOOLS)
    assert r.parse().choices[0].message.content  # the user's call still succeeded
    assert r.headers["x-runloop-degraded"] == "window"
    assert upstream.requests[-1]["messages"] == msgs  # sent as it came
    metrics = httpx.get(proxy.base + "/metrics").text
    degraded = [line for line in metrics.splitlines()
                if line.startswith("runloop_degraded_requests_total{")]
    assert any('reason="window"' in line and line.endswith(" 1.0") for line in degraded)


def test_a_stream_mixing_the_proxys_and_the_clients_calls_numbers_the_clients_from_0(
        proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    """The upstream streams the proxy's call at index 0 and the client's at index 1: the
    client sees only its own, at index 0 (the SDK assembles calls by index)."""
    def respond(body: dict[str, Any]) -> dict[str, Any]:
        return {"tool_calls": [{"id": "rc_7", "name": recall_name(body),
                                "arguments": {"call_id": "call_2"}},
                               {"id": "client_7", "name": "bash", "arguments": {"cmd": "ls"}}]}

    upstream.responder = respond
    raw = httpx.post(proxy.url + "/chat/completions", timeout=30, json={
        "model": "gpt-4o-mini", "stream": True, "messages": long_session(),
        "tools": CLIENT_TOOLS}).content
    chunks = [orjson.loads(line[6:]) for line in raw.split(b"\n\n")
              if line.startswith(b"data: {")]
    indexes = [tc["index"] for c in chunks for ch in c["choices"]
               for tc in (ch["delta"].get("tool_calls") or [])]
    ids = [tc["id"] for c in chunks for ch in c["choices"]
           for tc in (ch["delta"].get("tool_calls") or []) if tc.get("id")]
    assert ids == ["client_7"] and indexes and set(indexes) == {0}
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["tool_calls"] and raw.endswith(b"data: [DONE]\n\n")
    stream = openai.OpenAI(base_url=proxy.url, api_key="sk-t", max_retries=0)
    calls: dict[int, str] = {}
    for part in stream.chat.completions.create(model="gpt-4o-mini", stream=True,
                                               messages=long_session(),  # type: ignore[arg-type]
                                               tools=CLIENT_TOOLS):  # type: ignore[arg-type]
        for tc in (part.choices[0].delta.tool_calls or []) if part.choices else []:
            calls[tc.index] = calls.get(tc.index, "") + (tc.function.name or "" if tc.function
                                                         else "")
    assert calls == {0: "bash"}


@pytest.mark.parametrize("cut", [1, 7])
def test_a_proxy_call_streamed_with_its_name_in_pieces_never_reaches_the_client(
        proxy: ProxyServer, upstream: ScriptedUpstream, cut: int) -> None:
    """The upstream sends each call's id alone, then its name in pieces ("recall_" and
    "tool_call"), beside a call of the client's: the client sees only its own call, the
    proxy's is answered (spliced back on the next request), whatever the pieces."""
    def respond(body: dict[str, Any]) -> dict[str, Any]:
        return {"name_pieces": cut, "tool_calls": [
            {"id": "rc_3", "name": recall_name(body), "arguments": {"call_id": "call_2"}},
            {"id": "client_3", "name": "bash", "arguments": {"cmd": "ls"}}]}

    upstream.responder = respond
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-t", max_retries=0)
    parts = list(c.chat.completions.create(model="gpt-4o-mini", stream=True,
                                           messages=long_session(),  # type: ignore[arg-type]
                                           tools=CLIENT_TOOLS))  # type: ignore[arg-type]
    calls: dict[int, dict[str, str]] = {}
    for part in parts:
        for tc in (part.choices[0].delta.tool_calls or []) if part.choices else []:
            slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += tc.id or ""
            slot["name"] += (tc.function.name or "") if tc.function else ""
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert calls == {0: {"id": "client_3", "name": "bash", "arguments": '{"cmd":"ls"}'}}
    finishes = [p.choices[0].finish_reason for p in parts if p.choices
                and p.choices[0].finish_reason]
    assert finishes == ["tool_calls"]
    assert len(upstream.requests) == 1  # mixed: the proxy's part waits for the next request


AWKWARD = "tabs\there  and   runs of spaces\n\nblank lines\r\nCRLF \u00e9t\u00e9 \u4e2d\u6587 " \
    "\U0001f600 zero\u200bwidth " + "x " * 400
PARTS = [{"type": "text", "text": "first part  with  spaces\n"},
         {"type": "text", "text": "second \u00fcber part " + "y " * 400}]


@pytest.mark.parametrize("stream", [False, True])
def test_recall_returns_what_it_cut_byte_for_byte(proxy: ProxyServer, upstream: ScriptedUpstream,
                                                  stream: bool) -> None:
    """Unicode, runs of whitespace, CRLF, zero-width characters and a list of content parts
    come back through recall_tool_call exactly as the client sent them."""
    msgs = long_session()
    msgs[3]["content"] = AWKWARD  # call_0's result
    msgs[5]["content"] = PARTS  # call_1's
    recalled: dict[str, Any] = {}

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        last = body["messages"][-1]
        if last["role"] == "tool" and last["tool_call_id"].startswith("rc_"):
            recalled[last["tool_call_id"]] = last["content"]
            if len(recalled) == 2:
                return {"content": "done"}
        name = recall_name(body)
        want = "call_0" if "rc_1" not in recalled else "call_1"
        return {"tool_calls": [{"id": "rc_1" if want == "call_0" else "rc_2", "name": name,
                                "arguments": {"call_id": elided_ref(body["messages"], want)}}]}

    upstream.responder = respond
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-t", max_retries=0)
    if stream:
        text = "".join(p.choices[0].delta.content or "" for p in c.chat.completions.create(
            model="gpt-4o-mini", messages=msgs, tools=CLIENT_TOOLS, stream=True)  # type: ignore[arg-type]
            if p.choices)
    else:
        text = c.chat.completions.create(model="gpt-4o-mini", messages=msgs,  # type: ignore[arg-type]
                                         tools=CLIENT_TOOLS).choices[0].message.content  # type: ignore[arg-type]
    assert text == "done"
    assert recalled == {"rc_1": AWKWARD, "rc_2": PARTS}


def test_search_history_finds_what_only_a_call_s_arguments_hold() -> None:
    """A date the agent passed to a tool (its result empty) is history too: replay's
    retention measure found such references unreachable when search read message text only."""
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "fly me to Denver"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "search_flights",
                      "arguments": '{"destination": "DEN", "date": "2024-05-26"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "[]"},
        {"role": "assistant", "content": "Nothing that day."},
        {"role": "user", "content": "try 2024-05-27 then, and 27 bags"}]
    runner = ToolRunner(ProxyTools.for_request(None), msgs,  # type: ignore[arg-type]
                        [message_hash(m) for m in msgs], 5)  # type: ignore[arg-type]
    text, outcome = asyncio.run(runner.search("2024-05-26"))
    assert outcome == "hit"
    first = text.splitlines()[1]
    assert "calls=c1" in first and '"date": "2024-05-26"' in first


def _search(msgs: list[dict[str, Any]], query: str) -> tuple[str, str]:
    runner = ToolRunner(ProxyTools.for_request(None), msgs,  # type: ignore[arg-type]
                        [message_hash(m) for m in msgs], 5)  # type: ignore[arg-type]
    return asyncio.run(runner.search(query))


def test_search_history_says_when_nothing_matches() -> None:
    """A miss is an answer the model can act on (and counted as one), quoting its query."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "fly me to Denver"},
                                  {"role": "assistant", "content": "Booked."}]
    assert _search(msgs, "zanzibar") == \
        ("no match for 'zanzibar' in this conversation's history", "miss")


def test_search_history_finds_an_id_inside_a_longer_word_and_a_phrase_verbatim() -> None:
    """What replay's retention check found search_history missing: the number of a
    ``gift_card_7091239`` (one word to the ranking), a card's last four digits, a quoted code
    fragment whose words fill other messages more, a version with no word in it."""
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "pay with my gift card"},
        {"role": "tool", "tool_call_id": "c1",
         "content": '{"payment_methods": ["gift_card_7091239", "credit_card_4449932"]}'},
        {"role": "assistant", "content": "super calls super: __init__ and super __init__"},
        {"role": "assistant", "content": "the fix calls super().__init__() first, on 2.0"},
        {"role": "user", "content": "gift_card_1111 is the other gift card"}]
    for query, holder in (("refund 7091239", "gift_card_7091239"), ("9932", "credit_card_4449932"),
                          ("super().__init__()", "the fix calls"), ("2.0", "the fix calls")):
        text, outcome = _search(msgs, query)
        assert outcome == "hit", query
        assert holder in text.splitlines()[1], (query, text)
    # a term some message has as a word matches that word only, not every word holding it
    text, _ = _search(msgs, "gift")
    assert "7091239" not in text.splitlines()[1]
    assert _search(msgs, "2.")[1] == "bad_arguments"  # no word and too short to look for


# -- a search costs what its corpus weighs, whatever the model asks -----------------------

SEARCH_CALLS_PER_BYTE = 3  # measured 0.7-1.2 at this scale; terms x messages is far past
SEARCH_CALLS_FLOOR = 20_000  # asyncio.run and the search set-up

words_st = st.text("ab01_", min_size=1, max_size=12)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(words_st, min_size=1, max_size=30), min_size=1, max_size=20),
       st.lists(words_st, min_size=1, max_size=100))
def test_search_work_is_linear_in_what_it_reads(corpus_words: list[list[str]],
                                                query_words: list[str]) -> None:
    """Counted, not timed: a query of any length (terms repeated, distinct, or matching
    inside thousands of words) over any corpus makes calls linear in the corpus' and the
    query's bytes (the finding: 30k terms over 1,500 messages held the event loop 24 s). The
    drawn corpus and query are scaled tenfold — each message and term repeated under ten
    suffixes, every message holding words that contain the query's 'zzzz' — so that a cost
    of terms times messages, or messages times matching words, shows."""
    scale = 10
    msgs: list[dict[str, Any]] = [
        {"role": "user" if i % 2 else "assistant",
         "content": " ".join([f"{w}{j}" for w in ws] + [f"k{i}zzzz{j}y{n}" for n in range(8)])}
        for j in range(scale) for i, ws in enumerate(corpus_words)]
    query = " ".join(["zzzz"] + [f"{w}{j}" for j in range(scale) for w in query_words])
    size = len(orjson.dumps(msgs)) + len(query)
    (_, outcome), work = calls(_search, msgs, query)
    assert outcome in ("hit", "miss")
    assert work <= SEARCH_CALLS_FLOOR + SEARCH_CALLS_PER_BYTE * size, (work, size)


def test_a_query_is_read_to_its_bound_and_the_answer_says_so() -> None:
    msgs = long_session(steps=3, size=20)
    text, outcome = _search(msgs, "line1_7 " + "zz " * 5000)
    assert outcome == "hit" and f"(the first {MAX_QUERY_CHARS} characters)" in text
    assert len(query_terms("a1 " * 100 + " ".join(f"t{i}" for i in range(100)))) \
        == MAX_QUERY_TERMS
    assert query_terms("Line line LINE two") == ["line", "two"]


def test_calls_past_the_per_request_bound_are_refused_without_work() -> None:
    msgs = long_session(steps=3, size=20)
    runner = ToolRunner(ProxyTools.for_request(None), msgs,  # type: ignore[arg-type]
                        [message_hash(m) for m in msgs], 5)  # type: ignore[arg-type]
    def call(i: int) -> dict[str, Any]:  # each a question of its own (a repeat is a pointer)
        return {"id": f"s{i}", "type": "function", "function": {
            "name": "search_history", "arguments": f'{{"query": "line1_7 q{i}"}}'}}

    answers = [asyncio.run(runner.run(call(i))) for i in range(MAX_CALLS + 5)]  # type: ignore[arg-type]
    assert all("best match" in str(a["content"]) for a in answers[:MAX_CALLS])
    assert all("more than 32 calls" in str(a["content"]) for a in answers[MAX_CALLS:])
    assert [o for _, o in runner.outcomes].count("refused") == 5


def test_a_huge_query_does_not_stall_other_requests(proxy: ProxyServer,
                                                    upstream: ScriptedUpstream) -> None:
    """Finding 5 through real servers: a model's search of 30,000 terms (90 KB) over a long
    session is answered at once (its first terms), and /healthz is served meanwhile."""
    from .test_hardening import _healthz_during

    query = " ".join(f"w{i}x" for i in range(30_000))

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        last = body["messages"][-1]
        if last.get("tool_call_id") == "sh_big":
            return {"content": str(last["content"])}
        return {"tool_calls": [{"id": "sh_big", "name": recall_name(body, "search_history"),
                                "arguments": {"query": query}}]}

    upstream.responder = respond
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-t", max_retries=0, timeout=60)
    answers: list[str] = []
    slowest, took = _healthz_during(proxy, lambda: answers.append(
        c.chat.completions.create(model="gpt-4o-mini", messages=long_session(120, 60),
                                  tools=CLIENT_TOOLS).choices[0].message.content or ""))
    assert f"(the first {MAX_QUERY_CHARS} characters)" in answers[0]
    print(f"\n90 KB query: answered in {took:.3f}s, slowest /healthz {slowest:.3f}s")
    assert slowest < 2.0, f"/healthz waited {slowest:.2f}s (24 s before the fix)"


def test_search_history_ranks_a_whole_token_then_the_query_as_typed_first() -> None:
    """What the careful reader found lost: messages holding the query inside longer words
    (``settings.ROOT_URLCONF_MODULE``) or in another case (``BASE_DIR``), and with its words
    more often, filled the results before the one message that holds it as a whole token,
    as typed."""
    inside = [{"role": "tool", "tool_call_id": f"f{k}", "content":
               "settings.ROOT_URLCONF_MODULE root_urlconf settings root_urlconf settings"}
              for k in range(6)]
    cased = [{"role": "tool", "tool_call_id": f"g{k}", "content": "BASE_DIR = BASE_DIR BASE_DIR"}
             for k in range(6)]
    msgs: list[dict[str, Any]] = [
        *inside[:3], *cased[:3],
        {"role": "tool", "tool_call_id": "c1",
         "content": "the app reads settings.ROOT_URLCONF " + "x " * 60},
        {"role": "assistant", "content": "base_dir = Path(__file__).parent " + "y " * 60},
        *inside[3:], *cased[3:]]
    text, outcome = _search(msgs, "settings.root_urlconf")  # a whole token, another case
    assert outcome == "hit" and "the app reads" in text.splitlines()[1], text
    text, _ = _search(msgs, "base_dir")  # a whole token as typed
    assert "Path(__file__)" in text.splitlines()[1], text


def test_search_history_finds_what_an_edit_wrote_as_the_model_wrote_it() -> None:
    """An edit's arguments are JSON: its newlines are ``\\n`` escapes there; the model asks
    for the code it wrote."""
    edit = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "edit", "arguments": orjson.dumps(
            {"path": "a.py", "new": "if not objs:\n    return\nexcept KeyError:\n    pass"}
        ).decode()}}]}
    msgs: list[dict[str, Any]] = [
        *({"role": "user", "content": f"objs return except keyerror pass note {k}"}
          for k in range(6)), edit]
    text, outcome = _search(msgs, "except KeyError: pass")
    assert outcome == "hit" and "calls=c1" in text.splitlines()[1], text


def test_a_result_recalled_again_in_a_request_is_not_copied_again(
        proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    """Finding (red team): a model that recalled one result 32 times in a round had it sent
    upstream, and stored with the session's exchanges, 32 times (6.6 MB for a 200 KB
    request). A question the proxy's tools answered in this request is answered again by a
    pointer to that answer."""
    def respond(body: dict[str, Any]) -> dict[str, Any]:
        last = body["messages"][-1]
        if last["role"] == "tool" and last["tool_call_id"].startswith("rc_"):
            return {"content": "done"}
        name, ref = recall_name(body), elided_ref(body["messages"], "call_0")
        assert name and ref
        return {"content": "", "tool_calls": [
            {"id": f"rc_{i}", "name": name, "arguments": {"call_id": ref}} for i in range(4)]}

    upstream.responder = respond
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-t", max_retries=0)
    r = c.chat.completions.create(model="gpt-4o-mini", messages=long_session())  # type: ignore[arg-type]
    assert r.choices[0].message.content == "done"
    answers = [m for m in upstream.requests[-1]["messages"]
               if m["role"] == "tool" and m["tool_call_id"].startswith("rc_")]
    assert [m["tool_call_id"] for m in answers] == ["rc_0", "rc_1", "rc_2", "rc_3"]
    assert str(answers[0]["content"]).startswith("OUT0 line0_0")
    assert [m["content"] for m in answers[1:]] == [
        "[runloop-proxy] the same as the answer to rc_0 above"] * 3


@pytest.mark.parametrize("tool", ["search_history", "recall_tool_call"])
def test_a_store_failing_under_a_proxy_tool_leaves_the_request_answered(tool: str) -> None:
    """Fail open, for the proxy's tools too: in a named session they read the session's
    other branches from Redis, and a Redis that fails then must leave the call answered
    from what the request carries (planted: a search whose branch read raised took the
    whole request down with it)."""
    from runloop_proxy.errors import StoreError

    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "where is order W7"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "order W7 ships friday"}]

    async def broken(*args: Any) -> Any:
        raise StoreError("redis went away")

    runner = ToolRunner(ProxyTools.for_request(None), messages,  # type: ignore[arg-type]
                        [message_hash(m) for m in messages], 5,  # type: ignore[arg-type]
                        branches=broken, branch_results=broken)
    args = {"query": "order W7 friday"} if tool == "search_history" else {"call_id": "zz9"}
    out = asyncio.run(runner.run({"id": "p1", "type": "function", "function": {
        "name": tool, "arguments": orjson.dumps(args).decode()}}))  # type: ignore[typeddict-item]
    assert out["role"] == "tool" and out["tool_call_id"] == "p1"
    text = str(out["content"])
    assert ("ships friday" in text) if tool == "search_history" else ("unavailable" in text)


@pytest.mark.parametrize("stream", [False, True])
def test_a_models_token_factor_is_learned_from_the_first_rounds_usage(
        proxy: ProxyServer, upstream: ScriptedUpstream, stream: bool) -> None:
    """The proxy counted the prompt it sent first; a round of its own tools sends a longer
    one. What the upstream reports is compared with what the proxy counted for the same
    prompt: the first round's (planted: the last round's usage compared with the first
    prompt's count taught a model unknown to tiktoken a factor several times too large)."""
    from runloop_proxy.api.http import namespace_of

    upstream.push({"tool_calls": [{"id": "p1", "name": "recall_tool_call",
                                   "arguments": {"call_id": "nowhere"}}], "prompt_tokens": 10})
    upstream.push({"content": "done", "prompt_tokens": 100_000})
    r = httpx.post(proxy.url + "/chat/completions", headers={"Authorization": "Bearer sk-cal"},
                   json={"model": "house-model-7", "stream": stream, "tools": CLIENT_TOOLS,
                         "messages": [{"role": "user", "content": "hello " * 200}]})
    assert r.status_code == 200 and len(upstream.requests) == 2
    factor = proxy.state.tokens.factor("house-model-7", namespace_of(["sk-cal"]) or "")
    assert factor < 1.0, factor  # towards the first round's 10 tokens, not the 100,000


# a word as search_history reads one: letters, digits and underscores, two or more
search_words = st.text("abcXYZ019_", min_size=2, max_size=10)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 120), st.lists(search_words, min_size=1, max_size=30)),
                min_size=1, max_size=8), st.data())
def test_search_history_finds_every_word_the_history_holds_and_shows_it(
        texts: list[tuple[int, list[str]]], data: st.DataObject) -> None:
    """Whatever word a message holds — two characters or ten, any case, at its start or
    deep in a long result — a search for it, as it stands or in another case, answers
    with that message (found by its ref), and the snippet the model reads shows the word.
    Planted, each passed every other test: the query's two-letter words dropped ("go",
    "v2", "id" answered "query must contain words"); the snippet placed by a search of the
    text as typed for the lower-cased term (an upper-case word deep in a result fell
    outside the 240 characters shown)."""
    # each after a run of other words (none of the drawn ones): deep in a long result or not
    msgs: list[dict[str, Any]] = [
        {"role": "tool", "tool_call_id": f"call_{k}",
         "content": " ".join(["lorem-ipsum"] * filler + ws)}
        for k, (filler, ws) in enumerate(texts)]
    keys = [message_hash(m) for m in msgs]
    refs = message_refs(keys)
    k = data.draw(st.integers(0, len(msgs) - 1))
    word = data.draw(st.sampled_from(texts[k][1]))
    query = data.draw(st.sampled_from([word, word.lower(), word.upper()]))
    runner = ToolRunner(ProxyTools.for_request(None), msgs,  # type: ignore[arg-type]
                        keys, len(msgs))
    text, outcome = asyncio.run(runner.search(query))
    assert outcome == "hit", (query, text)
    line = next((ln for ln in text.splitlines()[1:] if f" id={refs[k]}," in ln), None)
    assert line is not None, (query, refs[k], text)
    assert word.lower() in line.split("] ", 1)[1].lower(), (word, line)
