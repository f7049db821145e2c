"""``/v1/messages`` through real servers: the official ``anthropic`` SDK's ``messages.create``
and ``messages.stream`` against the proxy, the scripted upstream speaking the Messages API
(JSON and events, tool_use, thinking with a signature), a real Redis. Sessions are stored
like chat ones, the request goes upstream as the client sent it when nothing needs
compressing, and every error comes back in Anthropic's shape."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from runloop_proxy.api.routes import CONVERSATIONS
from runloop_proxy.scripted import ScriptedUpstream
from runloop_proxy.scripted_messages import signature

from .conftest import ProxyServer
from .keys import anthropic_key

MODEL = "claude-sonnet-4-6"
KEY = anthropic_key(11)  # 108 characters, as Anthropic's
ADMIN = "admin-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
TENANT = "pt-" + hashlib.sha256(KEY.encode()).hexdigest()[:16]
BASH = {"name": "bash", "description": "run a shell command",
        "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}},
                         "required": ["cmd"]}}
PNG = base64.b64encode(bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d4944415478da63f8cfc0f01f0005000201a5e2a4bb0000000049454e44ae426082"
)).decode()


def sdk(proxy: ProxyServer, **headers: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.base, api_key=KEY, max_retries=0,
                               default_headers=headers or None)


def stored(proxy: ProxyServer, session: str) -> dict[str, Any]:
    proxy.settle()
    view = httpx.get(f"{proxy.base}/admin/sessions/{session}", headers=AUTH,
                     params={"messages": "1", "tenant": TENANT})
    assert view.status_code == 200, view.text
    return view.json()  # type: ignore[no-any-return]


def test_create_is_answered_and_the_echoed_reply_is_the_same_turn(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    proxy = make_proxy(admin_key=ADMIN)
    c = sdk(proxy, **{"X-Session-Id": "anth-plain"})
    first = c.messages.create(model=MODEL, max_tokens=64, system="Be brief.",
                              messages=[{"role": "user", "content": "hello"}])
    assert [b.type for b in first.content] == ["text"]
    assert first.content[0].text == "echo: hello"  # type: ignore[union-attr]
    second = c.messages.create(model=MODEL, max_tokens=64, system="Be brief.", messages=[
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                          for b in first.content]},
        {"role": "user", "content": "again"}])
    assert second.content[0].text == "echo: again"  # type: ignore[union-attr]
    sent = upstream.requests[-1]
    assert sent["system"] == "Be brief." and sent["messages"][-1] == {"role": "user",
                                                                      "content": "again"}
    view = stored(proxy, "anth-plain")
    assert [(m["role"], m["content"]) for m in view["messages"]] == [
        ("system", "Be brief."), ("user", "hello"), ("assistant", "echo: hello"),
        ("user", "again"), ("assistant", "echo: again")]
    assert len(view["branches"]) == 1  # the SDK's echo of its answer is the same turn


@pytest.mark.parametrize("auth", [{"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}])
def test_the_clients_key_and_anthropic_headers_go_upstream_as_sent(
        proxy: ProxyServer, upstream: ScriptedUpstream, auth: dict[str, str]) -> None:
    sent = {**auth, "anthropic-version": "2023-06-01",
            "anthropic-beta": "interleaved-thinking-2025-05-14"}
    r = httpx.post(proxy.url + "/messages", headers=sent, json={
        "model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200 and r.json()["content"][0]["text"] == "echo: x"
    got = upstream.headers[-1]
    assert {k: got.get(k.lower()) for k in sent} == sent
    assert ("authorization" in got) == ("Authorization" in auth)
    assert ("x-api-key" in got) == ("x-api-key" in auth)
    assert r.headers["x-session-id"].startswith("fp-")  # kept per key, like OpenAI keys


def test_a_stream_with_thinking_text_and_a_tool_call_reaches_the_sdk_whole(
        proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    upstream.push({"content": "Let me look.", "reasoning": "the user wants the listing",
                   "tool_calls": [{"id": "toolu_01", "name": "bash",
                                   "arguments": {"cmd": "ls -la /tmp"}}]})
    with sdk(proxy).messages.stream(model=MODEL, max_tokens=256, tools=[BASH], messages=[
            {"role": "user", "content": "list /tmp"}]) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == "Let me look."
    thinking, text, call = final.content
    assert thinking.type == "thinking" and thinking.thinking == "the user wants the listing"
    assert thinking.signature == signature("the user wants the listing")
    assert text.type == "text" and call.type == "tool_use"
    assert (call.id, call.name, call.input) == ("toolu_01", "bash", {"cmd": "ls -la /tmp"})
    assert final.stop_reason == "tool_use" and final.usage.input_tokens > 0
    # the proxy's tools go with every request that carries tools, after the client's
    names = [t["name"] for t in upstream.requests[-1]["tools"]]
    assert names == ["bash", "recall_tool_call", "search_history"]


def test_a_tool_loop_goes_upstream_as_the_client_sent_it(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """With nothing to compress, the turns the proxy rebuilds (it adds its tools) are the
    client's, block for block: thinking with its signature, tool_use, a tool_result with an
    image, an image in a user turn, cache_control where the client put it."""
    proxy = make_proxy(admin_key=ADMIN)
    upstream.push({"content": "Looking.", "reasoning": "plan",
                   "tool_calls": [{"id": "toolu_7", "name": "bash", "arguments": {"cmd": "ls"}}]},
                  {"content": "One file: a.png"})
    c = sdk(proxy, **{"X-Claude-Code-Session-Id": "cc-loop-1"})
    system = [{"type": "text", "text": "You are a coding agent.",
               "cache_control": {"type": "ephemeral"}}]
    opening = {"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
        {"type": "text", "text": "what is in this folder?"}]}
    first = c.messages.create(model=MODEL, max_tokens=256, system=system, tools=[BASH],
                              messages=[opening])
    turns = [opening, {"role": "assistant",
                       "content": [b.model_dump(exclude_none=True) for b in first.content]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_7", "content": [
                     {"type": "text", "text": "a.png"},
                     {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                  "data": PNG}}],
                  "cache_control": {"type": "ephemeral"}}]}]
    second = c.messages.create(model=MODEL, max_tokens=256, system=system, tools=[BASH],
                               messages=turns)
    assert second.content[0].text == "One file: a.png"  # type: ignore[union-attr]
    sent = upstream.requests[-1]
    assert sent["messages"] == turns and sent["system"] == system
    assert upstream.requests[0]["messages"] == [opening]
    view = stored(proxy, "cc-loop-1")
    assert [m["role"] for m in view["messages"]] == ["system", "user", "assistant", "tool",
                                                     "assistant"]
    assert view["messages"][3]["content"][1]["type"] == "image"  # the result as it came


def test_images_in_a_user_turn_are_counted_as_images(
        proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    c = sdk(proxy)
    r = c.messages.with_raw_response.create(model=MODEL, max_tokens=16, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG * 200}},
            {"type": "text", "text": "describe"}]}])
    client, forwarded = map(int, r.headers["x-runloop-tokens"].split(";"))
    # a fixed price per image, not its base64 text (a 40 KB payload would be ~14k tokens)
    assert client == forwarded and 765 < client < 1000


# -- errors, in Anthropic's shape ---------------------------------------------------------------

def test_a_bad_request_is_an_anthropic_400_naming_the_field(
        proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        sdk(proxy).messages.create(model=MODEL, max_tokens=16, messages=[
            {"role": "system", "content": "x"}])  # type: ignore[list-item, typeddict-item]
    assert err.value.status_code == 400
    assert err.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "messages.0.role: must be 'user' or "
                                                    "'assistant'"}}
    assert not upstream.requests


@pytest.mark.parametrize(("status", "kind", "sdk_error"), [
    (529, "overloaded_error", anthropic.InternalServerError),
    (429, "rate_limit_error", anthropic.RateLimitError)])
def test_upstream_errors_pass_through_as_the_upstream_sent_them(
        make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path, status: int, kind: str,
        sdk_error: type[Exception]) -> None:
    proxy = make_proxy()
    body = {"type": "error", "error": {"type": kind, "message": "Overloaded"},
            "request_id": "req_1"}
    upstream.push(*[{"status": status, "body": body, "headers": {"retry-after": "0"}}] * 3)
    with pytest.raises(sdk_error) as err:
        sdk(proxy).messages.create(model=MODEL, max_tokens=16,
                                   messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == status  # type: ignore[attr-defined]
    assert err.value.body == body  # type: ignore[attr-defined]
    assert len(upstream.requests) == 3  # retried, as for an OpenAI upstream, then passed on


def test_an_error_event_mid_stream_reaches_the_sdk_as_its_type(
        proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    upstream.push({"content": "x", "stream_error": {"type": "overloaded_error",
                                                    "message": "Overloaded"}})
    with pytest.raises(anthropic.APIStatusError) as err, sdk(proxy).messages.stream(
            model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "x"}]) as s:
        s.get_final_message()
    assert err.value.body == {"type": "error", "error": {"type": "overloaded_error",
                                                         "message": "Overloaded"}}


def test_an_unreachable_upstream_is_an_anthropic_api_error(make_proxy: Any,
                                                          upstream: ScriptedUpstream) -> None:
    proxy = make_proxy()
    upstream.push({"raw_body": b"not json"})
    with pytest.raises(anthropic.InternalServerError) as err:
        sdk(proxy).messages.create(model=MODEL, max_tokens=16, tools=[BASH],
                                   messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 502
    assert err.value.body["type"] == "error"  # type: ignore[index]
    assert err.value.body["error"]["type"] == "api_error"  # type: ignore[index]


def test_a_missing_key_is_an_anthropic_401(tmp_path: Path, make_proxy: Any,
                                          upstream: ScriptedUpstream) -> None:
    (tmp_path / "cfg" / "tenants").mkdir(parents=True)
    (tmp_path / "cfg" / "runloop.toml").write_text(
        f'[upstreams.claude]\nurl = "{upstream.url}"\nformat = "anthropic"\n'
        f'api_key = "sk-ant-upstream"\n')
    (tmp_path / "cfg" / "tenants" / "acme.toml").write_text(
        'keys = ["acme-proxy-key-0123456789"]\nupstream = "claude"\n')
    proxy = make_proxy(config_dir=str(tmp_path / "cfg"))
    anon = anthropic.Anthropic(base_url=proxy.base, api_key="wrong-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        anon.messages.create(model=MODEL, max_tokens=16,
                             messages=[{"role": "user", "content": "x"}])
    assert err.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    # the tenant's own key: the upstream gets the tenant's upstream key as x-api-key
    ok = anthropic.Anthropic(base_url=proxy.base, api_key="acme-proxy-key-0123456789",
                             max_retries=0)
    ok.messages.create(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "x"}])
    assert upstream.headers[-1]["x-api-key"] == "sk-ant-upstream"
    assert "authorization" not in upstream.headers[-1]


def test_every_conversation_route_answers_errors_in_its_apis_shape(
        proxy: ProxyServer) -> None:
    """A sweep over the route table: a route added later is checked the day it lands."""
    for path in CONVERSATIONS:
        for body in (b"{", b"[]", orjson.dumps({"model": 5})):
            r = httpx.post(proxy.base + path, content=body,
                           headers={"x-api-key": KEY, "content-type": "application/json"})
            assert r.status_code == 400, (path, body)
            data = r.json()
            if path.startswith("/v1/messages"):  # Anthropic's API: its shape
                assert data["type"] == "error" and set(data["error"]) == {"type", "message"}
                assert data["error"]["type"] == "invalid_request_error"
            else:
                assert set(data) == {"error"} and data["error"]["type"] == \
                    "invalid_request_error"


# -- the window, recall and search: the proxy's rounds hidden in JSON and in the stream -------

def big(k: int, lines: int = 260) -> str:
    return "\n".join(f"file{k}.py line {i}: value_{k}_{i} = compute({i}, {k})"
                     for i in range(lines))


def coding_turns(n: int, lines: int = 260) -> list[dict[str, Any]]:
    """One task worked on for ``n`` steps, as Claude Code sends it: thinking, a tool call,
    a large result (the first with an image too)."""
    turns: list[dict[str, Any]] = [{"role": "user", "content": "refactor the project"}]
    for k in range(n):
        turns.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"step {k}", "signature": f"sig-{k}"},
            {"type": "tool_use", "id": f"toolu_{k:02d}", "name": "bash",
             "input": {"cmd": f"cat file{k}.py"}}]})
        content: Any = big(k, lines) if k else [
            {"type": "text", "text": big(k, lines)},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG}}]
        turns.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{k:02d}", "content": content}]})
    return turns


def ref_in(body: dict[str, Any], call_id: str) -> str | None:
    """The ref the window shows for the result of ``call_id``: in its cut result, or (the
    call's own id) in the note that says which exchanges of the open loop are not shown."""
    for turn in body["messages"]:
        if f"(calls {call_id} \u2026" in orjson.dumps(turn).decode():
            return call_id
        for block in turn["content"] if isinstance(turn["content"], list) else []:
            if block.get("type") == "tool_result" and block["tool_use_id"] == call_id:
                text = orjson.dumps(block.get("content")).decode()
                if 'recall_tool_call(call_id=\\"' in text:
                    return text.split('recall_tool_call(call_id=\\"')[1].split("\\")[0]
    return None


def recaller(target: str) -> Any:
    """A fake model: recalls ``target`` when the window cut it, then says what came back."""
    def respond(body: dict[str, Any]) -> dict[str, Any]:
        last = body["messages"][-1]["content"]
        got = [b for b in last if isinstance(b, dict) and b.get("type") == "tool_result"
               and b["tool_use_id"] == "toolu_recall"] if isinstance(last, list) else []
        if got:
            return {"content": "recalled: " + orjson.dumps(got[0]["content"]).decode(),
                    "prompt_tokens": 2000}
        ref = ref_in(body, target)
        if ref is None:
            return {"content": "nothing was cut"}
        return {"content": "Let me look again.", "reasoning": "I need the first file",
                "prompt_tokens": 1000,
                "tool_calls": [{"id": "toolu_recall", "name": "recall_tool_call",
                                "arguments": {"call_id": ref}}]}
    return respond


def asked(c: anthropic.Anthropic, kw: dict[str, Any], stream: bool) -> Any:
    """The answer to ``kw``, created or streamed; a stream carries one message_start and one
    message_stop, whatever rounds the proxy ran behind it."""
    if not stream:
        return c.messages.create(**kw)
    with c.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        answer = s.get_final_message()
    assert kinds.count("message_start") == 1 and kinds.count("message_stop") == 1
    return answer


@pytest.mark.parametrize("stream", [False, True])
def test_a_cut_result_is_recalled_byte_for_byte_and_the_round_is_hidden(
        make_proxy: Any, upstream: ScriptedUpstream, stream: bool) -> None:
    proxy = make_proxy(admin_key=ADMIN)
    upstream.responder = recaller("toolu_00")
    turns = coding_turns(12)
    c = sdk(proxy, **{"X-Claude-Code-Session-Id": f"cc-recall-{stream}"})
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 1024, "tools": [BASH],
                          "system": "You are a coding agent.", "messages": turns}
    answer = asked(c, kw, stream)
    first, second = upstream.requests[-2:]
    # the window cut the old results; the model recalled the first one
    assert ref_in(first, "toolu_00") is not None
    assert len(orjson.dumps(first["messages"])) < 0.5 * len(orjson.dumps(turns))
    recalled = second["messages"][-1]["content"][0]
    assert recalled["type"] == "tool_result" and recalled["tool_use_id"] == "toolu_recall"
    assert recalled["content"] == turns[2]["content"][0]["content"]  # text and image blocks
    # the client sees one message: the text of both rounds, no call of the proxy's
    assert [b.type for b in answer.content] == (["thinking", "text", "text"] if stream
                                                else ["text"])
    text = answer.content[-1].text  # type: ignore[union-attr]
    assert text.startswith("recalled: ") and orjson.loads(text[10:]) == \
        turns[2]["content"][0]["content"]
    assert not any(b.type == "tool_use" for b in answer.content)
    assert answer.stop_reason == "end_turn"
    assert answer.usage.input_tokens == 1000 + 2000  # both rounds' usage, summed
    assert proxy.metrics.registry.get_sample_value(
        "runloop_recalls_total", {"tenant": "passthrough", "tool": "recall_tool_call",
                                  "outcome": "hit"}) == 1


def test_the_proxys_call_beside_the_clients_is_hidden_and_spliced_back(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    proxy = make_proxy(admin_key=ADMIN)
    turns = coding_turns(12)

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        ref = ref_in(body, "toolu_00")
        return {"content": "Both.", "tool_calls": [
            {"id": "toolu_mine", "name": "recall_tool_call", "arguments": {"call_id": ref}},
            {"id": "toolu_theirs", "name": "bash", "arguments": {"cmd": "ls"}}]}

    upstream.responder = respond
    c = sdk(proxy, **{"X-Claude-Code-Session-Id": "cc-mixed"})
    answer = c.messages.create(model=MODEL, max_tokens=512, tools=[BASH], messages=turns)
    assert [(b.type, getattr(b, "id", None)) for b in answer.content] == [
        ("text", None), ("tool_use", "toolu_theirs")]
    assert answer.stop_reason == "tool_use"
    upstream.responder = None
    upstream.push({"content": "done"})
    proxy.settle()
    c.messages.create(model=MODEL, max_tokens=512, tools=[BASH], messages=[
        *turns, {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                  for b in answer.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_theirs",
                                      "content": "a.py"}]}])
    sent = upstream.requests[-1]["messages"]
    # the model's own answer goes back whole, both calls answered in one user turn
    assert [b["id"] for b in sent[-2]["content"] if b["type"] == "tool_use"] == [
        "toolu_mine", "toolu_theirs"]
    answered = [b["tool_use_id"] for b in sent[-1]["content"] if b["type"] == "tool_result"]
    assert sorted(answered) == ["toolu_mine", "toolu_theirs"]


def test_search_history_finds_a_cut_result(make_proxy: Any, upstream: ScriptedUpstream) -> None:
    proxy = make_proxy()
    turns = coding_turns(12)

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        last = body["messages"][-1]["content"]
        got = [b for b in last if isinstance(b, dict) and b.get("tool_use_id") == "toolu_s"]
        if got:
            return {"content": "found: " + str(got[0]["content"])[:400]}
        return {"content": "", "tool_calls": [{"id": "toolu_s", "name": "search_history",
                                               "arguments": {"query": "value_1_7"}}]}

    upstream.responder = respond
    with sdk(proxy).messages.stream(model=MODEL, max_tokens=256, tools=[BASH],
                                    messages=turns) as s:
        answer = s.get_final_message()
    text = "".join(b.text for b in answer.content if b.type == "text")
    assert text.startswith("found: ") and "value_1_7" in text
    assert [b.type for b in answer.content] == ["text"]


# -- counting: count_tokens and the calibrated estimate ---------------------------------------

def test_count_tokens_counts_the_window_in_the_upstreams_tokens(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """After one answer the proxy has learned the model's factor from the upstream's usage
    (input + cache read + cache written); count_tokens then counts the window it would send
    — not the client's whole conversation — within a few percent of the upstream's count."""
    proxy = make_proxy()
    turns = coding_turns(12)
    c = sdk(proxy, **{"X-Claude-Code-Session-Id": "cc-count"})
    kw: dict[str, Any] = {"model": MODEL, "tools": [BASH], "system": "You are a coding agent."}
    for n in (8, 10, 12):  # a session as it grows: each answer calibrates the factor
        c.messages.create(max_tokens=256, messages=coding_turns(n), **kw)
    window = upstream.requests[-1]
    upstreams_count = upstream.anthropic.tokens(window)
    counted = c.messages.count_tokens(messages=turns, **kw)
    assert abs(counted.input_tokens - upstreams_count) / upstreams_count < 0.03
    whole = upstream.anthropic.tokens({**window, "messages": turns})
    assert counted.input_tokens < 0.5 * whole  # the window's size, not the conversation's
    assert [o[1] for o in upstream.other if o[1].endswith("count_tokens")] == []
    assert len(upstream.requests) == 3  # counting called nobody


def test_count_tokens_asks_the_upstream_when_the_tenant_allows(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    (tmp_path / "cfg" / "tenants").mkdir(parents=True)
    (tmp_path / "cfg" / "runloop.toml").write_text(
        f'[upstreams.claude]\nurl = "{upstream.url}"\nformat = "anthropic"\n'
        f'api_key = "sk-ant-upstream"\n')
    (tmp_path / "cfg" / "tenants" / "acme.toml").write_text(
        'keys = ["acme-proxy-key-0123456789"]\nupstream = "claude"\n'
        '[policy]\ncount_tokens = "upstream"\n')
    proxy = make_proxy(config_dir=str(tmp_path / "cfg"))
    c = anthropic.Anthropic(base_url=proxy.base, api_key="acme-proxy-key-0123456789",
                            max_retries=0)
    turns = coding_turns(12)
    counted = c.messages.count_tokens(model=MODEL, tools=[BASH], messages=turns)
    (method, path, headers, raw), = upstream.other
    sent = orjson.loads(raw)
    assert path == "/v1/messages/count_tokens" and headers["x-api-key"] == "sk-ant-upstream"
    assert counted.input_tokens == upstream.anthropic.tokens(sent)
    # the window went to be counted, with the proxy's tools: what a request would send
    assert len(orjson.dumps(sent["messages"])) < 0.5 * len(orjson.dumps(turns))
    assert [t["name"] for t in sent["tools"]] == ["bash", "recall_tool_call", "search_history"]
    assert not upstream.requests


# -- Anthropic's explicit cache: the client's breakpoints kept, the proxy's on request --------

def marks_of(body: dict[str, Any]) -> list[tuple[int, int, int, str | None]]:
    from runloop_proxy.api.breakpoints import marks
    return marks(body)


def tenant_proxy(tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream,
                 policy: str) -> anthropic.Anthropic:
    (tmp_path / "cfg" / "tenants").mkdir(parents=True, exist_ok=True)
    (tmp_path / "cfg" / "runloop.toml").write_text(
        f'[upstreams.claude]\nurl = "{upstream.url}"\nformat = "anthropic"\n'
        f'api_key = "sk-ant-upstream"\n')
    (tmp_path / "cfg" / "tenants" / "acme.toml").write_text(
        f'keys = ["acme-proxy-key-0123456789"]\nupstream = "claude"\n[policy]\n{policy}\n')
    proxy = make_proxy(config_dir=str(tmp_path / "cfg"))
    return anthropic.Anthropic(base_url=proxy.base, api_key="acme-proxy-key-0123456789",
                               max_retries=0,
                               default_headers={"X-Claude-Code-Session-Id": "cc-cache"})


@pytest.mark.parametrize("forward", [False, True])
def test_a_tenants_keys_to_an_anthropic_upstream(tmp_path: Path, make_proxy: Any,
                                                 upstream: ScriptedUpstream,
                                                 forward: bool) -> None:
    """An upstream of Anthropic's format takes its key as x-api-key: the tenant's upstream
    key, or (a tenant that forwards its clients' keys) the client's own, as the client sent
    it; the anthropic-version header goes with it, and no bearer token."""
    (tmp_path / "cfg" / "tenants").mkdir(parents=True)
    (tmp_path / "cfg" / "runloop.toml").write_text(
        f'[upstreams.claude]\nurl = "{upstream.url}"\nformat = "anthropic"\n'
        f'api_key = "sk-ant-upstream"\n')
    (tmp_path / "cfg" / "tenants" / "acme.toml").write_text(
        f'keys = ["acme-proxy-key-0123456789"]\nupstream = "claude"\n'
        f'forward_client_key = {"true" if forward else "false"}\n')
    proxy = make_proxy(config_dir=str(tmp_path / "cfg"))
    r = httpx.post(proxy.url + "/messages", headers={  # as Claude Code sends its key
        "x-api-key": "acme-proxy-key-0123456789", "anthropic-version": "2023-06-01"}, json={
        "model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200 and r.json()["content"][0]["text"] == "echo: x", r.text
    got = upstream.headers[-1]
    assert got["x-api-key"] == ("acme-proxy-key-0123456789" if forward else "sk-ant-upstream")
    assert got["anthropic-version"] == "2023-06-01" and "authorization" not in got


def test_the_clients_breakpoints_stay_where_their_blocks_are_and_none_is_added(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    proxy = make_proxy()
    turns = coding_turns(12)
    system = [{"type": "text", "text": "You are a coding agent.",
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    last = turns[-1]["content"][0]
    turns[-1] = {"role": "user", "content": [{**last, "cache_control": {"type": "ephemeral"}}]}
    sdk(proxy).messages.create(model=MODEL, max_tokens=64, tools=[BASH], system=system,
                               messages=turns)
    sent = upstream.requests[-1]
    assert len(orjson.dumps(sent["messages"])) < 0.5 * len(orjson.dumps(turns))  # compressed
    assert sent["system"] == system
    assert marks_of(sent) == [(1, 0, 0, "1h"), (2, len(sent["messages"]) - 1, 0, None)]
    upstream.reset()
    sdk(proxy).messages.create(model=MODEL, max_tokens=64, tools=[BASH],
                               messages=coding_turns(12))
    assert marks_of(upstream.requests[-1]) == []  # the client set none: the proxy adds none


def test_auto_breakpoints_make_a_long_session_read_the_cache(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """With cache_breakpoints = "auto", a client that marks nothing gets two marks (the end
    of the window's stable prefix, the end of the request) and reads its prefix back from
    the cache on every later request — through compaction events too."""
    c = tenant_proxy(tmp_path, make_proxy, upstream, 'cache_breakpoints = "auto"')
    reads, events = [], 0
    for n in range(2, 40):
        answer = c.messages.create(model=MODEL, max_tokens=64, tools=[BASH],
                                   system="You are a coding agent.",
                                   messages=coding_turns(n, lines=60))
        reads.append(answer.usage.cache_read_input_tokens or 0)
        sent = upstream.requests[-1]
        found = marks_of(sent)
        assert len(found) in (1, 2) and found[-1][:2] == (2, len(sent["messages"]) - 1)
        events += len(found) == 2 and found[0][:2] != (2, 0)
    assert events >= 2  # the window compacted on the way: the stable mark moved on
    assert reads[0] == 0 and sum(r > 0 for r in reads[1:]) >= 0.8 * (len(reads) - 1)
    prompts = sum(upstream.anthropic.tokens(b) for b in upstream.requests[1:])
    assert sum(reads) > 0.6 * prompts
    # calibrated on the whole prompt (input + cache read + cache written), not the uncached
    # part alone: the count of the next window is the upstream's within a few percent
    counted = c.messages.count_tokens(model=MODEL, tools=[BASH], system="You are a coding "
                                      "agent.", messages=coding_turns(39, lines=60))
    whole = upstream.anthropic.tokens(upstream.requests[-1])
    # (a factor, averaged: after an event changes the window's mix of short and long
    # messages it lags by a few percent; counting the uncached part alone is off by half)
    assert abs(counted.input_tokens - whole) / whole < 0.08


def test_auto_breakpoints_keep_a_growing_summary_cached_across_omissions(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """A short-turn support agent whose every turn omits the one before behind an extractive
    summary (globex's shape): the window changes right after the marker each turn, so only a
    breakpoint on the note itself can be read back. The note goes as a text block per piece
    its summary grew by, the last piece marked, and each later request reads the cache
    through the pieces the one before it sent (with the note as one block nothing before
    the change is marked, and nothing is read)."""
    c = tenant_proxy(tmp_path, make_proxy, upstream, 'summary_model = "extractive"\n'
                     'max_run_loops = 0\nomit_batch = 1\ncache_breakpoints = "auto"\n'
                     'proxy_tools = "always"\n')
    system = "You are the support agent of Example Air. " + "Follow the policy. " * 400
    turns: list[dict[str, Any]] = []
    read_after_pieces = 0
    for k in range(8):
        turns.append({"role": "user", "content": f"Change booking BK{k}X{k}9 to flight "
                                                 f"EA{100 + k} on 2024-05-{10 + k}."})
        answer = c.messages.create(model=MODEL, max_tokens=64, tools=[BASH], system=system,
                                   messages=turns)
        # what the agent did for it: a lookup with a large result, then its answer
        turns += [{"role": "assistant", "content": [
                      {"type": "tool_use", "id": f"toolu_{k:02d}", "name": "bash",
                       "input": {"cmd": f"lookup BK{k}X{k}9"}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": f"toolu_{k:02d}",
                       "content": orjson.dumps({"booking": f"BK{k}X{k}9", "rows": [
                           {"seat": f"{r}A", "fare": 100 + r} for r in range(60)]}).decode()}]},
                  {"role": "assistant", "content": f"Done: BK{k}X{k}9 is on EA{100 + k}."}]
        sent = upstream.requests[-1]
        note = next((t for t in sent["messages"] if t["role"] == "assistant"
                     and isinstance(t["content"], list)
                     and str(t["content"][0].get("text", "")).startswith("[runloop-proxy]")),
                    None)
        if k < 2:
            continue
        assert note is not None, "an omission every turn from the second on"
        texts = [b["text"] for b in note["content"] if b.get("type") == "text"]
        pieces = texts[:next(i for i, t in enumerate(texts) if t.startswith("Done:"))]
        assert len(pieces) >= 2 and all(p.strip() for p in pieces)
        assert f"BK{k - 1}X{k - 1}9" in pieces[-1], "the newest piece holds the newest loop"
        marked = [i for i, b in enumerate(note["content"]) if "cache_control" in b]
        assert len(pieces) - 1 in marked and not any(i < len(pieces) - 1 for i in marked), \
            "the note's last piece carries a breakpoint"
        if k >= 3:
            # what the request reads from the cache reaches past the system prompt and the
            # opening into the note: the previous request's pieces
            before = upstream.anthropic.tokens({"tools": sent["tools"], "system": system,
                                                "messages": sent["messages"][:1]})
            read_after_pieces += (answer.usage.cache_read_input_tokens or 0) > before
    assert read_after_pieces == 5
