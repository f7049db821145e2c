"""The bridge on the wire (pure): a Messages request as a chat-completions body, a chat answer
— JSON, or its stream in any chunking and across the proxy's rounds — as the Messages answer
the client gets (checked by reassembling the stream with the ``anthropic`` SDK's own
accumulator), and an OpenAI-shaped error as Anthropic's."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy.api.bridge import (
    BridgeWire,
    anthropic_error,
    chat_request,
    message_of,
    to_chat,
    tool_choice,
)
from runloop_proxy.api.bridge_stream import stop_reason, usage_of_chat
from runloop_proxy.api.chat_wire import error_status
from runloop_proxy.api.messages import validate_messages_request
from runloop_proxy.conversation.blocks import to_messages
from runloop_proxy.errors import InvalidRequest, UpstreamError
from runloop_proxy.pipeline.sse import SSEDecoder, SSEEvent
from runloop_proxy.pipeline.tools import ProxyTools
from runloop_proxy.pipeline.wire import Step, add_usage, client_message, decide

from .test_chat_wire import fed, upstream_answers
from .test_messages_wire import reassembled
from .work import allocated

TOOLS = ProxyTools.for_request(None)
PNG = "iVBORw0KGgo="


# -- the request ------------------------------------------------------------------------------

def test_a_messages_request_becomes_a_chat_body() -> None:
    body = {"model": "gpt-4o", "max_tokens": 300, "temperature": 0.2, "top_p": 0.9,
            "top_k": 5, "stop_sequences": ["END"], "stream": True,
            "metadata": {"user_id": "user_1"}, "thinking": {"type": "enabled"},
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {
                "type": "ephemeral"}}],
            "tools": [{"name": "bash", "description": "run",
                       "input_schema": {"type": "object", "properties": {}}},
                      {"type": "web_search_20250305", "name": "web_search"}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [{"role": "user", "content": "hi"}]}
    dropped: set[str] = set()
    out = BridgeWire().outgoing(body, to_messages(body["messages"], body["system"]), [])
    assert out == {
        "model": "gpt-4o", "max_tokens": 300, "temperature": 0.2, "top_p": 0.9,
        "stop": ["END"], "stream": True, "stream_options": {"include_usage": True},
        "user": "user_1",
        "tools": [{"type": "function", "function": {
            "name": "bash", "parameters": {"type": "object", "properties": {}},
            "description": "run"}}],
        "tool_choice": "required", "parallel_tool_calls": False,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "hi"}]}
    chat_request(body, dropped)
    assert dropped == {"top_k", "thinking", "tool web_search_20250305"}


@pytest.mark.parametrize(("choice", "chat"), [
    ({"type": "auto"}, {"tool_choice": "auto"}), ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "any"}, {"tool_choice": "required"}),
    ({"type": "tool", "name": "bash"}, {"tool_choice": {"type": "function",
                                                        "function": {"name": "bash"}}}),
    ({"type": "auto", "disable_parallel_tool_use": True},
     {"tool_choice": "auto", "parallel_tool_calls": False}),
    (None, {}), ("auto", {})])
def test_tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    assert tool_choice(choice) == chat


def test_the_conversation_becomes_chat_messages() -> None:
    """Thinking dropped, calls kept with their ids, a result's images after the results (chat's
    tool messages carry text), a user's image and documents as content parts."""
    turns = [
        {"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG}},
            {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                            "data": "notes"}},
            {"type": "document", "title": "a.pdf", "source": {
                "type": "base64", "media_type": "application/pdf", "data": "JVBE"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"},
            {"type": "text", "text": "Running."},
            {"type": "tool_use", "id": "call_1", "name": "bash", "input": {"cmd": "ls"}},
            {"type": "tool_use", "id": "call_2", "name": "shot", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "call_1", "content": "a.py"},
            {"type": "tool_result", "tool_use_id": "call_2", "content": [
                {"type": "text", "text": "the screen"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                             "data": PNG}}]},
            {"type": "text", "text": "and?"}]},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"},
                                          {"type": "text", "text": "Done."}]}]
    dropped: set[str] = set()
    assert to_chat(to_messages(turns, "sys"), dropped) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
            {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
            {"type": "text", "text": "notes"},
            {"type": "file", "file": {"filename": "a.pdf",
                                      "file_data": "data:application/pdf;base64,JVBE"}}]},
        {"role": "assistant", "content": "Running.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "bash", "arguments": '{"cmd":"ls"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "shot",
                                                              "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py"},
        {"role": "tool", "tool_call_id": "call_2", "content": "the screen"},
        {"role": "user", "content": [
            {"type": "text", "text": "[runloop-proxy] images from the tool results above "
                                     "(call_2)"},
            {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{PNG}"}}]},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "Done."}]
    assert dropped == {"thinking blocks"}


def test_an_assistant_block_chat_cannot_carry_is_named_as_dropped() -> None:
    """A provider's own block in an assistant turn (a server tool's use, its result) has no
    chat form: it is left out and named in what the bridge says it dropped, by its kind (a
    line the mutation smoke found no test ran)."""
    turns = [{"role": "user", "content": "search it"},
             {"role": "assistant", "content": [
                 {"type": "server_tool_use", "id": "srv_1", "name": "web_search",
                  "input": {"query": "x"}},
                 {"type": "web_search_tool_result", "tool_use_id": "srv_1", "content": []},
                 {"type": "text", "text": "Found it."}]}]
    dropped: set[str] = set()
    out = to_chat(to_messages(turns, ""), dropped)
    assert out[-1] == {"role": "assistant", "content": "Found it."}
    assert dropped == {"server_tool_use blocks", "web_search_tool_result blocks"}


def test_a_system_turn_is_a_chat_system_message_in_its_place() -> None:
    """What Claude Code sends a model it does not know: its environment as a system turn
    after the first (accepted there, not first: the system prompt is ``system``)."""
    turns = [{"role": "user", "content": "go"},
             {"role": "system", "content": [{"type": "text", "text": "# Environment"}]},
             {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    body = validate_messages_request({"model": "m", "max_tokens": 5, "messages": turns})
    assert to_chat(to_messages(body["messages"], "S"), set()) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "go"},
        {"role": "system", "content": "# Environment"},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    for bad, why in (([turns[1], *turns], "messages.0.role: must be 'user' or 'assistant'"),
                     ([turns[0], {"role": "system", "content": [{"type": "image"}]}],
                      "messages.1.content.0: must be a content block with a type 'text'")):
        with pytest.raises(InvalidRequest) as err:
            validate_messages_request({"model": "m", "max_tokens": 5, "messages": bad})
        assert str(err.value) == why


def test_next_round_is_chat_and_withdraws_the_proxys_tools() -> None:
    wire = BridgeWire()
    body = {"model": "m", "max_tokens": 10, "tools": [
        {"name": "bash", "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": "hi"}]}
    messages = to_messages(body["messages"])
    sent = wire.outgoing(body, messages, wire.tool_definitions(TOOLS))
    assert [t["function"]["name"] for t in sent["tools"]] == [
        "bash", "recall_tool_call", "search_history"]
    after = [*messages, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "recall_tool_call",
                                                     "arguments": "{}"}}]},
             {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "r"}]}]
    nxt = wire.next_round(sent, after, frozenset(TOOLS.names))  # type: ignore[arg-type]
    assert [t["function"]["name"] for t in nxt["tools"]] == ["bash"]
    assert nxt["messages"][-1] == {"role": "tool", "tool_call_id": "c", "content": "r"}


# -- the answer -------------------------------------------------------------------------------

def completion(text: str | None, calls: list[dict[str, Any]], finish: str | None,
               usage: dict[str, Any] | None = None, refusal: str | None = None
               ) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        msg["tool_calls"] = calls
    if refusal:
        msg["refusal"] = refusal
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "gpt-4o",
            "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
            **({"usage": usage} if usage else {})}


def call(cid: str, name: str, args: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def test_a_chat_completion_is_a_messages_answer() -> None:
    data = completion("Let me see.", [call("call_1", "bash", '{"cmd": "ls"}'),
                                      call("call_2", "bash", "not json")], "tool_calls",
                      {"prompt_tokens": 1200, "completion_tokens": 30,
                       "prompt_tokens_details": {"cached_tokens": 1024}})
    assert message_of(data, "asked") == {
        "id": "chatcmpl-1", "type": "message", "role": "assistant", "model": "gpt-4o",
        "content": [{"type": "text", "text": "Let me see."},
                    {"type": "tool_use", "id": "call_1", "name": "bash",
                     "input": {"cmd": "ls"}},
                    {"type": "tool_use", "id": "call_2", "name": "bash",
                     "input": {"arguments": "not json"}}],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 176, "output_tokens": 30, "cache_read_input_tokens": 1024,
                  "cache_creation_input_tokens": 0}}


def test_the_client_json_loses_the_proxys_calls_and_sums_usage() -> None:
    wire = BridgeWire()
    data = completion("x", [call("m1", "recall_tool_call", "{}"), call("t1", "bash", "{}")],
                      "tool_calls", {"prompt_tokens": 10, "completion_tokens": 2})
    reply = wire.parse(data)
    decision = decide(reply.calls, TOOLS, 0, 4)
    assert decision.step is Step.MIXED
    out = wire.client_json(data, decision, {"input_tokens": 25, "output_tokens": 4}, TOOLS)
    assert [b.get("id") for b in out["content"]] == [None, "t1"]
    assert out["stop_reason"] == "tool_use"
    assert out["usage"]["input_tokens"] == 25 and out["usage"]["output_tokens"] == 4
    only_mine = completion(None, [call("m1", "recall_tool_call", "{}")], "tool_calls")
    withdrawn = decide(wire.parse(only_mine).calls, TOOLS, 4, 4)
    assert withdrawn.step is Step.WITHDRAWN
    out = wire.client_json(only_mine, withdrawn, {}, TOOLS)
    assert out["content"] == [] and out["stop_reason"] == "end_turn"


@pytest.mark.parametrize(("finish", "calls", "reason"), [
    ("stop", False, "end_turn"), ("length", False, "max_tokens"),
    ("length", True, "max_tokens"), ("tool_calls", True, "tool_use"),
    ("stop", True, "tool_use"),  # servers that say "stop" after calls
    ("tool_calls", False, "end_turn"), ("content_filter", False, "refusal"),
    (None, False, "end_turn"), (None, True, "tool_use"), ("function_call", True, "tool_use")])
def test_stop_reason(finish: Any, calls: bool, reason: str) -> None:
    assert stop_reason(finish, calls) == reason


@pytest.mark.parametrize(("usage", "want"), [
    ({"prompt_tokens": 100, "completion_tokens": 5},
     {"input_tokens": 100, "output_tokens": 5, "cache_read_input_tokens": 0,
      "cache_creation_input_tokens": 0}),
    ({"prompt_tokens": 100, "completion_tokens": 5, "prompt_tokens_details": {
        "cached_tokens": 64}}, {"input_tokens": 36, "output_tokens": 5,
                                "cache_read_input_tokens": 64,
                                "cache_creation_input_tokens": 0}),
    ({"prompt_tokens": "x", "prompt_tokens_details": None},
     {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0,
      "cache_creation_input_tokens": 0}),
    (None, None), ([], None)])
def test_usage_in_anthropics_terms(usage: Any, want: Any) -> None:
    assert usage_of_chat(usage) == want


# -- errors -----------------------------------------------------------------------------------

def openai_error(message: str, kind: str, code: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None,
                                   "code": code}})


@pytest.mark.parametrize(("status", "raw", "kind", "message"), [
    (429, openai_error("Rate limit reached", "requests", "rate_limit_exceeded"),
     "rate_limit_error", "Rate limit reached"),
    (529, openai_error("busy", "server_error"), "overloaded_error", "busy"),
    (503, openai_error("busy", "server_error"), "overloaded_error", "busy"),
    (500, openai_error("oops", "server_error"), "api_error", "oops"),
    (401, openai_error("Incorrect API key", "invalid_request_error", "invalid_api_key"),
     "authentication_error", "Incorrect API key"),
    (403, openai_error("no", "invalid_request_error"), "permission_error", "no"),
    (404, openai_error("The model `x` does not exist", "invalid_request_error",
                       "model_not_found"), "not_found_error", "The model `x` does not exist"),
    (400, openai_error("bad", "invalid_request_error"), "invalid_request_error", "bad"),
    (422, b'{"detail": "x"}', "invalid_request_error", '{"detail": "x"}'),
    (502, b"<html>bad gateway</html>", "api_error", "<html>bad gateway</html>"),
    (400, openai_error("This model's maximum context length is 128000 tokens. However, your "
                       "messages resulted in 130512 tokens.", "invalid_request_error",
                       "context_length_exceeded"), "invalid_request_error",
     "prompt is too long: 130512 tokens > 128000 maximum. This model's maximum context "
     "length is 128000 tokens. However, your messages resulted in 130512 tokens."),
    (400, openai_error("too long", "invalid_request_error", "context_length_exceeded"),
     "invalid_request_error", "prompt is too long: too long"),
    (400, b'{"error": "plain words"}', "invalid_request_error", "plain words")])
def test_an_openai_error_in_anthropics_shape(status: int, raw: bytes, kind: str,
                                             message: str) -> None:
    assert anthropic_error(status, raw) == {"type": "error", "error": {"type": kind,
                                                                       "message": message}}
    got_status, body = BridgeWire().upstream_error(status, raw)
    assert got_status == status and orjson.loads(body) == anthropic_error(status, raw)


@pytest.mark.parametrize(("err", "status"), [
    ({"message": "x", "type": "rate_limit_error"}, 429),
    ({"message": "x", "code": "rate_limit_exceeded", "type": "requests"}, 429),
    ({"message": "x", "code": 503}, 503), ({"message": "x", "type": "overloaded_error"}, 529),
    ({"message": "x", "type": "server_error"}, 500), ({"message": "x"}, 502),
    ({"code": True}, 502), ("a string", 502)])
def test_a_streamed_errors_status(err: Any, status: int) -> None:
    assert error_status(err) == status


def test_an_error_chunk_mid_stream_is_an_anthropic_error_event_of_its_type() -> None:
    relay = BridgeWire().relay({"model": "m"})
    rnd = relay.round(TOOLS)
    rnd.feed(SSEEvent(orjson.dumps({"id": "s", "choices": [{"index": 0, "delta": {
        "content": "hi"}}]}).decode()))
    with pytest.raises(UpstreamError) as err:
        rnd.feed(SSEEvent(orjson.dumps({"error": {"message": "slow down", "type": "requests",
                                                  "code": "rate_limit_exceeded"}}).decode()))
    assert orjson.loads(relay.error(err.value).split(b"data: ")[1]) == {
        "type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}


# -- the stream: what the client assembles is the answer, for any chunking ---------------------



@st.composite
def bridge_answers(draw: st.DrawFn) -> tuple[str, list[dict[str, Any]], str, list[bytes]]:
    """``upstream_answers`` (text and calls in any pieces, interleaved, split at any byte),
    sometimes with a refusal in pieces among its chunks, cut again at random bytes."""
    text, calls, pieces = draw(upstream_answers())
    events = b"".join(pieces).split(b"\n\n")[:-1]  # the last one is [DONE]
    refusal = draw(st.text(alphabet="no ", max_size=6))
    at = 0  # each piece after the one before
    for piece in [refusal[i:i + 2] for i in range(0, len(refusal), 2)]:
        chunk = {"id": "s", "choices": [{"index": 0, "delta": {"refusal": piece},
                                         "finish_reason": None}]}
        at = draw(st.integers(at, len(events) - 1))
        events.insert(at, b"data: " + orjson.dumps(chunk))
        at += 1
    raw = b"\n\n".join(events) + b"\n\n"
    cuts = sorted(draw(st.sets(st.integers(min_value=1, max_value=len(raw) - 1), max_size=8)))
    return text, calls, refusal, [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)],
                                                          strict=True)]


def as_completion(text: str, calls: list[dict[str, Any]], refusal: str) -> dict[str, Any]:
    """The answer a chat stream of ``bridge_answers`` makes, as the JSON one."""
    return completion(text, calls, "tool_calls" if calls else "stop", {"prompt_tokens": 3},
                      refusal)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_client_gets_the_chat_answer_less_the_proxys_calls(data: Any) -> None:
    """Up to three upstream rounds, each a chat stream whose text, refusal and calls (the
    proxy's among them, client names that start like the proxy's) come in any pieces,
    interleaved, split at random bytes: the client's SDK assembles one message — the JSON
    answer's blocks of every round, less the proxy's calls, one message_start and one
    message_stop, usage summed — and what the proxy reads of each round is the JSON answer
    (what it records)."""
    wire = BridgeWire()
    relay = wire.relay({"model": "m"})
    usage: dict[str, Any] = {}
    shown: list[dict[str, Any]] = []
    out: list[bytes] = []
    for rounds in range(3):
        text, calls, refusal, pieces = data.draw(bridge_answers())
        rnd = relay.round(TOOLS)
        out += fed(rnd, pieces)
        reply = rnd.reply()
        whole = as_completion(text, calls, refusal)
        assert reply.message == wire.parse(whole).message  # the round read whole
        add_usage(usage, reply.usage)
        decision = decide(reply.calls, TOOLS, rounds, 4)
        shown += [b for b in message_of(whole, "m")["content"]
                  if not (b["type"] == "tool_use" and b["name"] in TOOLS.names)]
        if decision.step is not Step.ANSWER or rounds == 2:
            out += rnd.close(decision)
            break
    out += relay.end(usage)
    message, kinds = reassembled(out)
    assert kinds[0] == "message_start" and kinds.count("message_start") == 1
    assert kinds[-1] == "message_stop" and kinds.count("message_stop") == 1
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == len(shown)
    assert [b.model_dump(exclude_none=True) for b in message.content] == shown
    assert message.usage.input_tokens == 3 * (rounds + 1)
    theirs = any(b["type"] == "tool_use" for b in message_of(whole, "m")["content"]
                 if b.get("name") not in TOOLS.names)
    assert message.stop_reason == ("end_turn" if decision.step is Step.WITHDRAWN else
                                   "tool_use" if theirs else "end_turn")
    # what the client will echo is what the proxy records
    recorded = relay.shown(client_message(reply, decision))
    assert recorded.get("blocks", []) == shown or (not shown and recorded == reply.message)


def chunks(*deltas: dict[str, Any], finish: str) -> list[SSEEvent]:
    raw = b"".join(b"data: " + orjson.dumps({"id": "s", "choices": [
        {"index": 0, "delta": d, "finish_reason": None}]}) + b"\n\n" for d in deltas)
    raw += b"data: " + orjson.dumps({"id": "s", "choices": [
        {"index": 0, "delta": {}, "finish_reason": finish}]}) + b"\n\ndata: [DONE]\n\n"
    return SSEDecoder().feed(raw)


def test_what_a_round_sends_at_its_end_comes_before_the_next_rounds_blocks() -> None:
    """A round of the proxy's alone that ends with a refusal (sent once the round is over):
    the refusal's block comes before the next round's, whole (the case the property meets
    rarely)."""
    relay = BridgeWire().relay({"model": "m"})
    out: list[bytes] = []
    rounds = [chunks({"content": "Let me"}, {"refusal": " not"}, {"tool_calls": [
        {"index": 0, "id": "c", "function": {"name": "recall_tool_call", "arguments": "{}"}}]},
        finish="tool_calls"), chunks({"content": "Found it."}, finish="stop")]
    for k, events in enumerate(rounds):
        rnd = relay.round(TOOLS)
        for ev in events:
            out += rnd.feed(ev)
        decision = decide(rnd.reply().calls, TOOLS, k, 4)
    out += rnd.close(decision) + relay.end({})
    message, kinds = reassembled(out)
    assert [b.text for b in message.content] == ["Let me not", "Found it."]
    assert kinds == ["message_start", "content_block_start", "content_block_delta",
                     "content_block_delta", "content_block_stop", "content_block_start",
                     "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]


def _deltas(kind: str, n: int) -> list[SSEEvent]:
    piece = "abcdefgh" * 8
    deltas: list[dict[str, Any]]
    if kind == "text":
        deltas = [{"content": piece} for _ in range(n)]
    else:
        deltas = [{"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f"}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": "'}}]},
                  *[{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
                    for _ in range(n)],
                  {"tool_calls": [{"index": 0, "function": {"arguments": '"}'}}]}]
    return [SSEEvent(orjson.dumps({"id": "s", "choices": [{"index": 0, "delta": d}]}).decode())
            for d in deltas]


@pytest.mark.parametrize("kind", ["text", "arguments"])
def test_a_long_streamed_answer_is_assembled_in_linear_work(kind: str) -> None:
    """An answer streamed in n deltas (its text, a call's arguments) costs bytes copied linear
    in n: a string grown by ``+=`` per delta re-copies all it has, every time."""

    def relayed(events: list[SSEEvent]) -> Any:
        rnd = BridgeWire().relay({"model": "m"}).round(TOOLS)
        for ev in events:
            rnd.feed(ev)
        return rnd.reply()

    copied = {}
    for n in (1000, 2000):
        events = _deltas(kind, n)
        reply, copied[n] = allocated(relayed, events)
        said = reply.message.get("content") if kind == "text" else \
            reply.message["tool_calls"][0]["function"]["arguments"]
        assert len(said) >= 64 * n
    assert copied[2000] <= 2.2 * copied[1000], copied


@pytest.mark.parametrize(("system", "why"), [
    (5, "system: must be a string or an array of content blocks"),
    ({"type": "text", "text": "S"}, "system: must be a string or an array of content blocks"),
    ([{"type": "image", "source": {}}], "system.0: must be a content block with a type 'text'"),
    (["S"], "system.0: must be a content block with a type 'text'"),
    ([{"type": "text"}], "system.0.text: Field required"),
])
def test_a_system_prompt_that_is_not_text_is_refused_naming_the_part(system: Any,
                                                                     why: str) -> None:
    """The top-level ``system`` is a string or text blocks: anything else is a 400 naming the
    part, never a request the window then cannot read."""
    with pytest.raises(InvalidRequest) as err:
        validate_messages_request({"model": "m", "max_tokens": 5, "system": system,
                                   "messages": [{"role": "user", "content": "hi"}]})
    assert str(err.value) == why
    ok = validate_messages_request({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"}], "system": [{"type": "text", "text": "S"}]})
    assert ok["system"] == [{"type": "text", "text": "S"}]


@pytest.mark.parametrize("body, counting, ok", [
    ({"max_tokens": 16}, False, True),
    ({}, False, False),  # a message must say how long its answer may be
    ({}, True, True),  # a count does not
    ({"max_tokens": 16}, True, True),
    ({"max_tokens": "16"}, True, False),  # but one it sends is checked all the same
    ({"max_tokens": 0}, False, False),
    ({"max_tokens": True}, False, False),
    ({"max_tokens": 16, "model": ""}, False, False),  # and a model, in every case
    ({"model": None}, True, False),
])
def test_a_model_always_and_max_tokens_of_a_message_are_required(
        body: dict[str, Any], counting: bool, ok: bool) -> None:
    full = {"model": "claude-sonnet-4-6", "messages": [{"role": "user", "content": "hi"}], **body}
    if ok:
        validate_messages_request(full, counting)
    else:
        with pytest.raises(InvalidRequest, match="max_tokens" if "model" not in body
                           else "model"):
            validate_messages_request(full, counting)
