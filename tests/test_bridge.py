"""The bridge through real servers: the official ``anthropic`` SDK against the proxy, whose
upstream (``--upstream-format chat``) is the scripted OpenAI-compatible one, a real Redis.
Requests go upstream as chat completions, answers come back as Messages (JSON and events),
errors in Anthropic's shape; the window, recall and search work through it, the proxy's
rounds hidden in the Messages stream."""

from __future__ import annotations

import hashlib
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer, serve_command
from .keys import openai_project_key
from .test_anthropic import BASH, PNG, asked, big, coding_turns

MODEL = "gpt-4o"
KEY = openai_project_key(12)  # 164 characters, as OpenAI's project keys
ADMIN = "admin-0123456789abcdef"
TENANT = "pt-" + hashlib.sha256(KEY.encode()).hexdigest()[:16]
CHAT_BASH = {"type": "function", "function": {
    "name": "bash", "parameters": BASH["input_schema"], "description": BASH["description"]}}


def bridge(make_proxy: Any, **kw: Any) -> ProxyServer:
    return make_proxy(upstream_format="chat", admin_key=ADMIN, **kw)  # type: ignore[no-any-return]


def sdk(proxy: ProxyServer, **headers: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.base, api_key=KEY, max_retries=0,
                               default_headers=headers or None)


def stored(proxy: ProxyServer, session: str) -> dict[str, Any]:
    proxy.settle()
    view = httpx.get(f"{proxy.base}/admin/sessions/{session}",
                     headers={"Authorization": f"Bearer {ADMIN}"},
                     params={"messages": "1", "tenant": TENANT})
    assert view.status_code == 200, view.text
    return view.json()  # type: ignore[no-any-return]


def dumped(blocks: Any) -> list[dict[str, Any]]:
    return [b.model_dump(exclude_none=True) for b in blocks]


def test_create_goes_upstream_as_chat_and_the_echo_is_the_same_turn(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    proxy = bridge(make_proxy)
    upstream.push({"content": "hello there", "prompt_tokens": 1500, "cached_tokens": 1024})
    c = sdk(proxy, **{"X-Session-Id": "br-plain", "anthropic-version": "2023-06-01",
                      "anthropic-beta": "interleaved-thinking-2025-05-14"})
    first = c.messages.create(model=MODEL, max_tokens=64, system="Be brief.",
                              stop_sequences=["STOP"], metadata={"user_id": "u-42"},
                              extra_body={"temperature": 0.3, "top_p": 0.8},  # (not in 2.13)
                              messages=[{"role": "user", "content": "hello"}])
    assert dumped(first.content) == [{"type": "text", "text": "hello there"}]
    assert (first.model, first.stop_reason, first.role) == (MODEL, "end_turn", "assistant")
    assert first.id.startswith("chatcmpl-")
    assert (first.usage.input_tokens, first.usage.cache_read_input_tokens,
            first.usage.cache_creation_input_tokens) == (1500 - 1024, 1024, 0)
    assert upstream.requests[-1] == {
        "model": MODEL, "max_tokens": 64, "temperature": 0.3, "top_p": 0.8, "stop": ["STOP"],
        "user": "u-42", "messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "hello"}]}
    # the client's key goes as the bearer token a chat upstream reads; Anthropic's headers
    # stay behind
    got = upstream.headers[-1]
    assert got["authorization"] == f"Bearer {KEY}"
    assert not {"x-api-key", "anthropic-version", "anthropic-beta"} & set(got)
    second = c.messages.create(model=MODEL, max_tokens=64, system="Be brief.", messages=[
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": dumped(first.content)},
        {"role": "user", "content": "again"}])
    assert second.content[0].text == "echo: again"  # type: ignore[union-attr]
    assert upstream.requests[-1]["messages"][1:] == [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "again"}]
    view = stored(proxy, "br-plain")
    assert [(m["role"], m["content"]) for m in view["messages"]] == [
        ("system", "Be brief."), ("user", "hello"), ("assistant", "hello there"),
        ("user", "again"), ("assistant", "echo: again")]
    assert len(view["branches"]) == 1  # the SDK's echo of its answer is the same turn


@pytest.mark.parametrize("auth", [{"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}])
def test_the_clients_key_goes_as_a_bearer_token_and_anthropics_headers_stay(
        make_proxy: Any, upstream: ScriptedUpstream, auth: dict[str, str]) -> None:
    """Claude Code sends its key as x-api-key (the anthropic SDK as a bearer token): a chat
    upstream reads it as a bearer token either way."""
    proxy = bridge(make_proxy)
    r = httpx.post(proxy.url + "/messages", headers={
        **auth, "anthropic-version": "2023-06-01", "anthropic-beta": "x-2025"}, json={
        "model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200 and r.json()["content"][0]["text"] == "echo: x"
    got = upstream.headers[-1]
    assert got["authorization"] == f"Bearer {KEY}"
    assert not {"x-api-key", "anthropic-version", "anthropic-beta"} & set(got)
    assert r.headers["x-session-id"].startswith("fp-")  # kept per key


@pytest.mark.parametrize("forward", [False, True])
def test_a_tenants_keys_through_the_bridge(tmp_path: Path, make_proxy: Any,
                                          upstream: ScriptedUpstream, forward: bool) -> None:
    """The tenant's upstream key goes as a bearer token and the client's proxy key never
    goes upstream; a tenant that forwards its clients' keys sends the client's as one."""
    (tmp_path / "cfg" / "tenants").mkdir(parents=True)
    (tmp_path / "cfg" / "runloop.toml").write_text(
        f'[upstreams.oai]\nurl = "{upstream.url}"\nformat = "chat"\napi_key = "sk-upstream"\n')
    (tmp_path / "cfg" / "tenants" / "acme.toml").write_text(
        f'keys = ["acme-proxy-key-0123456789"]\nupstream = "oai"\n'
        f'forward_client_key = {"true" if forward else "false"}\n')
    proxy = make_proxy(config_dir=str(tmp_path / "cfg"))
    r = httpx.post(proxy.url + "/messages", headers={
        "x-api-key": "acme-proxy-key-0123456789", "anthropic-version": "2023-06-01"}, json={
        "model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200, r.text
    got = upstream.headers[-1]
    assert got["authorization"] == ("Bearer acme-proxy-key-0123456789" if forward
                                    else "Bearer sk-upstream")
    assert not {"x-api-key", "anthropic-version"} & set(got)


def test_a_tool_loop_with_images_through_the_bridge_json_and_stream_alike(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Tools go as functions (input_schema as parameters, tool_choice as chat's), the model's
    call comes back as a tool_use block with its input — streamed (the name in pieces) and
    JSON alike; the result, with an image, goes back as a tool message and the image after
    it; an image in a user turn as an image_url part."""
    proxy = bridge(make_proxy)
    call = {"id": "call_7", "name": "bash", "arguments": {"cmd": "ls -la"}}
    upstream.push({"content": "Looking at it now.", "tool_calls": [call], "name_pieces": 2},
                  {"content": "Looking at it now.", "tool_calls": [call]})
    opening = {"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
        {"type": "text", "text": "what is in this folder?"}]}
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 256, "tools": [BASH],
                          "tool_choice": {"type": "tool", "name": "bash"},
                          "messages": [opening]}
    c = sdk(proxy, **{"X-Claude-Code-Session-Id": "br-loop"})
    with c.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_message()
    created = c.messages.create(**kw)
    for answer in (streamed, created):
        assert dumped(answer.content) == [
            {"type": "text", "text": "Looking at it now."},
            {"type": "tool_use", "id": "call_7", "name": "bash", "input": {"cmd": "ls -la"}}]
        assert answer.stop_reason == "tool_use"
    assert kinds.count("message_start") == 1 and kinds[-1] == "message_stop"
    # the message is the upstream's answer, by its id, streamed or not
    assert streamed.id.startswith("chatcmpl-") and created.id.startswith("chatcmpl-")
    sent = upstream.requests[0]
    assert sent["tools"][0] == CHAT_BASH
    assert [t["function"]["name"] for t in sent["tools"]] == [
        "bash", "recall_tool_call", "search_history"]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "bash"}}
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["messages"] == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
        {"type": "text", "text": "what is in this folder?"}]}]
    upstream.push({"content": "One file: a.png"})
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_7",
                                           "content": [
        {"type": "text", "text": "a.png"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": PNG}}]}]}
    final = c.messages.create(**{**kw, "messages": [
        opening, {"role": "assistant", "content": dumped(created.content)}, result]})
    assert final.content[0].text == "One file: a.png"  # type: ignore[union-attr]
    assert upstream.requests[-1]["messages"][1:] == [
        {"role": "assistant", "content": "Looking at it now.", "tool_calls": [
            {"id": "call_7", "type": "function",
             "function": {"name": "bash", "arguments": '{"cmd":"ls -la"}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "a.png"},
        {"role": "user", "content": [
            {"type": "text", "text": "[runloop-proxy] images from the tool results above "
                                     "(call_7)"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}]
    view = stored(proxy, "br-loop")
    assert [m["role"] for m in view["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert len(view["branches"]) == 1  # what the SDK echoed is the answer recorded


def test_a_stream_the_proxy_adds_nothing_to_is_translated_too(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """No tools, nothing to compress: the proxy's tools do not go out, and the answer is
    still a chat stream to translate, never relayed as it came."""
    proxy = bridge(make_proxy)
    upstream.push({"content": "a streamed answer", "prompt_tokens": 40})
    with sdk(proxy).messages.stream(model=MODEL, max_tokens=64, messages=[
            {"role": "user", "content": "hi"}]) as s:
        texts = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(texts) == "a streamed answer" and len(texts) > 1  # as it came, in pieces
    assert dumped(final.content) == [{"type": "text", "text": "a streamed answer"}]
    assert (final.stop_reason, final.usage.input_tokens) == ("end_turn", 40)
    assert "tools" not in upstream.requests[-1]


def test_a_call_of_a_tool_the_proxy_did_not_offer_is_the_clients(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Nothing was cut and the client has no tools: the proxy's did not go out, so a call
    named like one of them is the model's own business with the client, not the proxy's."""
    proxy = bridge(make_proxy)
    upstream.push({"content": "", "tool_calls": [
        {"id": "call_x", "name": "recall_tool_call", "arguments": {"call_id": "abc"}}]})
    answer = sdk(proxy).messages.create(model=MODEL, max_tokens=64, messages=[
        {"role": "user", "content": "hi"}])
    assert "tools" not in upstream.requests[-1] and len(upstream.requests) == 1
    assert dumped(answer.content) == [{"type": "tool_use", "id": "call_x",
                                       "name": "recall_tool_call", "input": {"call_id": "abc"}}]
    assert answer.stop_reason == "tool_use"


def test_thinking_is_dropped_with_a_log_line(make_proxy: Any, upstream: ScriptedUpstream,
                                             caplog: pytest.LogCaptureFixture) -> None:
    proxy = bridge(make_proxy)
    with caplog.at_level(logging.INFO, logger="runloop.bridge"):
        sdk(proxy).messages.create(
            model=MODEL, max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024},
            messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig-1"},
                {"type": "text", "text": "b"}]}, {"role": "user", "content": "c"}])
    assert upstream.requests[-1]["messages"] == [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"}]
    assert "thinking" not in upstream.requests[-1]
    lines = [r for r in caplog.records if r.name == "runloop.bridge"]
    assert len(lines) == 1 and lines[0].dropped == ["thinking", "thinking blocks"]  # type: ignore[attr-defined]


# -- errors: the upstream's, OpenAI-shaped, in Anthropic's shape -------------------------------

@pytest.mark.parametrize(("status", "err", "kind", "sdk_error"), [
    (429, {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"},
     "rate_limit_error", anthropic.RateLimitError),
    (529, {"message": "Overloaded", "type": "server_error"}, "overloaded_error",
     anthropic.InternalServerError),
    (503, {"message": "Overloaded", "type": "server_error"}, "overloaded_error",
     anthropic.InternalServerError),
    (400, {"message": "Invalid 'messages'", "type": "invalid_request_error"},
     "invalid_request_error", anthropic.BadRequestError),
    (401, {"message": "Incorrect API key provided", "type": "invalid_request_error",
           "code": "invalid_api_key"}, "authentication_error", anthropic.AuthenticationError),
    (404, {"message": "The model does not exist", "type": "invalid_request_error",
           "code": "model_not_found"}, "not_found_error", anthropic.NotFoundError)])
@pytest.mark.parametrize("stream", [False, True])
def test_upstream_errors_come_back_in_anthropics_shape(
        make_proxy: Any, upstream: ScriptedUpstream, status: int, err: dict[str, Any],
        kind: str, sdk_error: type[Exception], stream: bool) -> None:
    proxy = bridge(make_proxy)
    upstream.push(*[{"status": status, "body": {"error": {**err, "param": None}},
                     "headers": {"retry-after": "0"}}] * 3)  # the proxy retries 429 and 5xx
    with pytest.raises(sdk_error) as raised:
        if stream:
            with sdk(proxy).messages.stream(model=MODEL, max_tokens=16, messages=[
                    {"role": "user", "content": "x"}]) as s:
                s.get_final_message()
        else:
            sdk(proxy).messages.create(model=MODEL, max_tokens=16,
                                       messages=[{"role": "user", "content": "x"}])
    assert raised.value.status_code == status  # type: ignore[attr-defined]
    assert raised.value.body == {"type": "error", "error": {  # type: ignore[attr-defined]
        "type": kind, "message": err["message"]}}


def test_a_prompt_too_long_for_the_upstream_says_so_in_anthropics_words(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    proxy = bridge(make_proxy)
    upstream.push({"status": 400, "body": {"error": {
        "message": "This model's maximum context length is 128000 tokens. However, your "
                   "messages resulted in 140000 tokens.", "type": "invalid_request_error",
        "param": "messages", "code": "context_length_exceeded"}}})
    with pytest.raises(anthropic.BadRequestError) as err:
        sdk(proxy).messages.create(model=MODEL, max_tokens=16,
                                   messages=[{"role": "user", "content": "x"}])
    assert err.value.body["error"]["message"].startswith(  # type: ignore[index]
        "prompt is too long: 140000 tokens > 128000 maximum.")


def test_an_error_chunk_mid_stream_reaches_the_sdk_as_its_type(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    proxy = bridge(make_proxy)
    first = {"id": "c1", "object": "chat.completion.chunk", "model": MODEL,
             "choices": [{"index": 0, "delta": {"content": "part"}, "finish_reason": None}]}
    upstream.push({"raw_chunks": [
        b"data: " + orjson.dumps(first) + b"\n\n",
        b'data: {"error": {"message": "Rate limit reached", "type": "requests", '
        b'"code": "rate_limit_exceeded"}}\n\n']})
    with pytest.raises(anthropic.APIStatusError) as err, sdk(proxy).messages.stream(
            model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "x"}]) as s:
        s.get_final_message()
    assert err.value.body == {"type": "error", "error": {"type": "rate_limit_error",
                                                         "message": "Rate limit reached"}}


# -- the window, recall and search through the bridge -----------------------------------------

def chat_ref(body: dict[str, Any], call_id: str) -> str | None:
    """The ref the window shows for ``call_id``'s result in a chat body: in the result's
    placeholder, or (its own id) in the note naming the open loop's exchanges not shown."""
    for m in body["messages"]:
        if f"(calls {call_id} \u2026" in str(m.get("content")):
            return call_id
        if m.get("role") == "tool" and m.get("tool_call_id") == call_id:
            found = re.search(r'recall_tool_call\(call_id="([^"]+)"\)', str(m["content"]))
            return found.group(1) if found else None
    return None


def recaller(target: str) -> Any:
    """A chat model: recalls ``target`` when the window cut it, then says what came back."""
    def respond(body: dict[str, Any]) -> dict[str, Any]:
        got = [m for m in body["messages"] if m.get("tool_call_id") == "call_recall"]
        if got:
            at = body["messages"].index(got[0])
            return {"content": "recalled: " + orjson.dumps(
                body["messages"][at:at + 2]).decode(), "prompt_tokens": 2000}
        ref = chat_ref(body, target)
        if ref is None:
            return {"content": "nothing was cut"}
        return {"content": "Let me look again.", "prompt_tokens": 1000, "tool_calls": [
            {"id": "call_recall", "name": "recall_tool_call", "arguments": {"call_id": ref}}]}
    return respond


@pytest.mark.parametrize("stream", [False, True])
def test_a_cut_result_is_recalled_and_the_round_is_hidden(
        make_proxy: Any, upstream: ScriptedUpstream, stream: bool) -> None:
    proxy = bridge(make_proxy)
    upstream.responder = recaller("toolu_00")
    turns = coding_turns(12)
    c = sdk(proxy, **{"X-Claude-Code-Session-Id": f"br-recall-{stream}"})
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 1024, "tools": [BASH],
                          "system": "You are a coding agent.", "messages": turns}
    answer = asked(c, kw, stream)
    first, second = upstream.requests[-2:]
    assert chat_ref(first, "toolu_00") is not None  # the window cut the old results
    assert len(orjson.dumps(first["messages"])) < 0.5 * len(orjson.dumps(turns))
    # the recalled result, whole: its text in the tool message, its image after it
    at = next(i for i, m in enumerate(second["messages"])
              if m.get("tool_call_id") == "call_recall")
    assert second["messages"][at:at + 2] == [
        {"role": "tool", "tool_call_id": "call_recall", "content": big(0)},
        {"role": "user", "content": [
            {"type": "text", "text": "[runloop-proxy] images from the tool results above "
                                     "(call_recall)"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}]
    # the client sees one message: the text of both rounds, no call of the proxy's
    assert [b.type for b in answer.content] == (["text", "text"] if stream else ["text"])
    text = answer.content[-1].text  # type: ignore[union-attr]
    assert orjson.loads(text.removeprefix("recalled: ")) == second["messages"][at:at + 2]
    assert answer.stop_reason == "end_turn"
    assert answer.usage.input_tokens == 1000 + 2000  # both rounds' usage, summed
    assert proxy.metrics.registry.get_sample_value(
        "runloop_recalls_total", {"tenant": "passthrough", "tool": "recall_tool_call",
                                  "outcome": "hit"}) == 1


def test_the_proxys_call_beside_the_clients_is_hidden_and_spliced_back(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    proxy = bridge(make_proxy)
    turns = coding_turns(12)

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        return {"content": "Both.", "tool_calls": [
            {"id": "call_mine", "name": "recall_tool_call",
             "arguments": {"call_id": chat_ref(body, "toolu_00")}},
            {"id": "call_theirs", "name": "bash", "arguments": {"cmd": "ls"}}]}

    upstream.responder = respond
    c = sdk(proxy, **{"X-Claude-Code-Session-Id": "br-mixed"})
    with c.messages.stream(model=MODEL, max_tokens=512, tools=[BASH], messages=turns) as s:
        answer = s.get_final_message()
    assert [(b.type, getattr(b, "id", None)) for b in answer.content] == [
        ("text", None), ("tool_use", "call_theirs")]
    assert answer.stop_reason == "tool_use"
    upstream.responder = None
    upstream.push({"content": "done"})
    proxy.settle()
    c.messages.create(model=MODEL, max_tokens=512, tools=[BASH], messages=[
        *turns, {"role": "assistant", "content": dumped(answer.content)},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_theirs",
                                      "content": "a.py"}]}])
    sent = upstream.requests[-1]["messages"]
    # the model's own answer goes back whole, both calls answered (the recalled result's
    # image after the results)
    at = next(i for i, m in enumerate(sent) if m.get("content") == "Both.")
    assert [c["id"] for c in sent[at]["tool_calls"]] == ["call_mine", "call_theirs"]
    assert [m.get("tool_call_id") for m in sent[at + 1:]] == ["call_theirs", "call_mine", None]
    assert sent[at + 2]["content"] == big(0) and sent[-1]["role"] == "user"


def test_search_history_finds_a_cut_result(make_proxy: Any, upstream: ScriptedUpstream) -> None:
    proxy = bridge(make_proxy)

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        last = body["messages"][-1]
        if last.get("tool_call_id") == "call_s":
            return {"content": "found: " + last["content"][:400]}
        return {"content": "", "tool_calls": [{"id": "call_s", "name": "search_history",
                                               "arguments": {"query": "value_1_7"}}]}

    upstream.responder = respond
    with sdk(proxy).messages.stream(model=MODEL, max_tokens=256, tools=[BASH],
                                    messages=coding_turns(12)) as s:
        answer = s.get_final_message()
    assert [b.type for b in answer.content] == ["text"]
    assert answer.content[0].text.startswith("found: ")  # type: ignore[union-attr]
    assert "value_1_7" in answer.content[0].text  # type: ignore[union-attr]


def test_count_tokens_is_the_proxys_own_through_the_bridge(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """A chat upstream has no count_tokens: the proxy counts the window, even for a tenant
    that asks the upstream to count. The tenant's key goes as a bearer token."""
    (tmp_path / "cfg" / "tenants").mkdir(parents=True)
    (tmp_path / "cfg" / "runloop.toml").write_text(
        f'[upstreams.oai]\nurl = "{upstream.url}"\nformat = "chat"\napi_key = "sk-upstream"\n')
    (tmp_path / "cfg" / "tenants" / "acme.toml").write_text(
        'keys = ["acme-proxy-key-0123456789"]\nupstream = "oai"\n'
        '[policy]\ncount_tokens = "upstream"\n')
    proxy = make_proxy(config_dir=str(tmp_path / "cfg"))
    c = anthropic.Anthropic(base_url=proxy.base, api_key="acme-proxy-key-0123456789",
                            max_retries=0)
    counted = c.messages.count_tokens(model=MODEL, tools=[BASH], messages=coding_turns(12))
    assert 0 < counted.input_tokens < 20_000  # the window's, not the conversation's
    assert not upstream.requests and not upstream.other
    c.messages.create(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "x"}])
    assert upstream.headers[-1]["authorization"] == "Bearer sk-upstream"
    assert "x-api-key" not in upstream.headers[-1]


# -- the command line: `serve --upstream URL --upstream-format chat` ---------------------------

@pytest.mark.parametrize("how", ["flag", "env"])
def test_serve_takes_the_upstreams_format(how: str, upstream: ScriptedUpstream,
                                         redis_url: str, tmp_path: Path) -> None:
    """What the README says to run for Claude Code on an OpenAI-compatible model."""
    flags, env = (["--upstream-format", "chat"], {}) if how == "flag" \
        else ([], {"RUNLOOP_UPSTREAM_FORMAT": "chat"})
    with serve_command(upstream.url, redis_url, tmp_path, flags, env) as (base, args, _):
        c = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)
        answer = c.messages.create(model=MODEL, max_tokens=16,
                                   messages=[{"role": "user", "content": "hi"}])
        assert answer.content[0].text == "echo: hi"  # type: ignore[union-attr]
        assert answer.id.startswith("chatcmpl-")  # a chat completion, translated
        assert upstream.headers[-1]["authorization"] == f"Bearer {KEY}"
    bad = subprocess.run([sys.executable, "-m", "runloop_proxy", *args[:len(args) - len(flags)],
                          "--upstream-format", "grpc"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "'grpc' is not one of any, anthropic, chat" in bad.stderr
