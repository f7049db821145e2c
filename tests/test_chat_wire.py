"""Chat completions on the wire (pure): reading answers and chunks, and a stream rewritten for
the client across the proxy's tool rounds."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy.api.chat_wire import (
    Accumulator,
    ChatObserver,
    ChatWire,
    chunk_problem,
    completion_problem,
)
from runloop_proxy.errors import UpstreamBadReply, UpstreamError
from runloop_proxy.pipeline.sse import SSEDecoder, SSEEvent
from runloop_proxy.pipeline.tools import ProxyTools
from runloop_proxy.pipeline.wire import Reply, Step, client_message, decide

WIRE = ChatWire()
TOOLS = ProxyTools.for_request(None)
CLIENT_CALL = {"id": "k1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
PROXY_CALL = {"id": "p1", "type": "function",
              "function": {"name": "recall_tool_call", "arguments": '{"call_id": "ab"}'}}


def completion(message: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"id": "c", "choices": [{"index": 0, "message": message,
                                    "finish_reason": "tool_calls"}], **extra}


@pytest.mark.parametrize(("data", "problem"), [
    (completion({"role": "assistant", "content": "hi"}), None),
    ([], "not a JSON object"),
    ({"foo": 1}, "no choices"),
    ({"choices": []}, "no choices"),
    ({"choices": ["x"]}, "choices[0] has no message"),
    (completion({"role": "assistant", "content": 5}), "message.content is neither text nor parts"),
    (completion({"role": "assistant", "tool_calls": "x"}), "message.tool_calls is malformed"),
    (completion({"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": 1}}]}),
     "message.tool_calls is malformed"),
    (completion({"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}),
     "message.tool_calls is malformed"),
    (completion({"role": "assistant", "tool_calls": [
        {"id": "a", "function": {"name": "f", "arguments": {}}}]}),
     "message.tool_calls is malformed"),
])
def test_completion_problems(data: Any, problem: str | None) -> None:
    assert completion_problem(data) == problem


@pytest.mark.parametrize(("chunk", "problem"), [
    ({"choices": [{"index": 0, "delta": {"content": "x"}}]}, None),
    ({"choices": None, "usage": {}}, None),
    ({"choices": [{"delta": None}]}, None),
    ([1, 2], "not a JSON object"),
    ({"choices": "abc"}, "choices is not an array"),
    ({"choices": ["x"]}, "a choice is not an object with an integer index"),
    ({"choices": [{"index": "0"}]}, "a choice is not an object with an integer index"),
    ({"choices": [{"delta": "text"}]}, "a delta is not an object"),
    ({"choices": [{"delta": {"content": 3}}]}, "delta.content is not text"),
    ({"choices": [{"delta": {"refusal": []}}]}, "delta.refusal is not text"),
    ({"choices": [{"delta": {"tool_calls": {}}}]}, "delta.tool_calls is not an array"),
    ({"choices": [{"delta": {"tool_calls": [{"index": "x"}]}}]},
     "a streamed tool call is malformed"),
    ({"choices": [{"delta": {"tool_calls": [{"index": True}]}}]},
     "a streamed tool call is malformed"),
    ({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": "f"}]}}]},
     "a streamed tool call is malformed"),
    ({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": 1}}]}}]},
     "a streamed tool call is malformed"),
    ({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": []}}]}}]},
     "a streamed tool call is malformed"),
])
def test_chunk_problems(chunk: Any, problem: str | None) -> None:
    assert chunk_problem(chunk) == problem


def test_parse_keeps_the_message_without_its_nulls_and_the_usage() -> None:
    reply = WIRE.parse(completion({"role": "assistant", "content": None, "refusal": None,
                                   "tool_calls": [CLIENT_CALL]}, usage={"prompt_tokens": 3}))
    assert reply.message == {"role": "assistant", "tool_calls": [CLIENT_CALL]}
    assert reply.usage == {"prompt_tokens": 3} and reply.calls == [CLIENT_CALL]
    assert WIRE.parse(completion({"role": "assistant"}, usage="x")).usage is None
    with pytest.raises(UpstreamBadReply):
        WIRE.parse({"choices": []})


@pytest.mark.parametrize(("calls", "rounds", "step"), [
    ([CLIENT_CALL], 0, Step.FINAL),
    ([], 0, Step.FINAL),
    ([PROXY_CALL], 0, Step.ANSWER),
    ([PROXY_CALL], 3, Step.ANSWER),
    ([PROXY_CALL], 4, Step.WITHDRAWN),
    ([PROXY_CALL, CLIENT_CALL], 0, Step.MIXED),
    ([CLIENT_CALL, PROXY_CALL], 9, Step.MIXED),
])
def test_who_owns_which_call(calls: list[Any], rounds: int, step: Step) -> None:
    d = decide(calls, TOOLS, rounds, 4)
    assert d.step is step
    assert list(d.mine) == [c for c in calls if c is PROXY_CALL]
    assert list(d.theirs) == [c for c in calls if c is CLIENT_CALL]


def test_the_client_json_loses_the_proxys_calls() -> None:
    mixed = completion({"role": "assistant", "content": None,
                        "tool_calls": [PROXY_CALL, CLIENT_CALL]})
    out = WIRE.client_json(mixed, decide([PROXY_CALL, CLIENT_CALL], TOOLS, 0, 4),
                           {"prompt_tokens": 7}, TOOLS)
    assert out["choices"][0]["message"]["tool_calls"] == [CLIENT_CALL]
    assert out["choices"][0]["finish_reason"] == "tool_calls" and out["usage"]["prompt_tokens"] == 7
    withdrawn = completion({"role": "assistant", "content": None, "tool_calls": [PROXY_CALL]})
    out = WIRE.client_json(withdrawn, decide([PROXY_CALL], TOOLS, 4, 4), {}, TOOLS)
    msg = out["choices"][0]["message"]
    assert "tool_calls" not in msg and msg["content"] == "" and \
        out["choices"][0]["finish_reason"] == "stop" and "usage" not in out


def test_next_round_withdraws_the_proxys_tools_and_drops_an_empty_list() -> None:
    sent = {"model": "m", "messages": [], "tools": [
        {"type": "function", "function": {"name": "bash"}},
        {"type": "function", "function": {"name": "recall_tool_call"}}],
        "tool_choice": "auto", "parallel_tool_calls": True}
    msgs = [{"role": "user", "content": "x"}]
    assert WIRE.next_round(sent, msgs, frozenset()) == {**sent, "messages": msgs}  # type: ignore[arg-type]
    out = WIRE.next_round(sent, msgs, frozenset({"recall_tool_call"}))  # type: ignore[arg-type]
    assert [t["function"]["name"] for t in out["tools"]] == ["bash"]
    only = {**sent, "tools": [sent["tools"][1]]}  # type: ignore[index]
    out = WIRE.next_round(only, msgs, frozenset({"recall_tool_call"}))  # type: ignore[arg-type]
    assert not {"tools", "tool_choice", "parallel_tool_calls"} & set(out)


def test_outgoing_adds_the_proxys_tools_and_asks_for_usage_on_a_stream() -> None:
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"x": 1},
            "tools": [{"type": "function", "function": {"name": "bash"}}]}
    extra = WIRE.tool_definitions(TOOLS)
    out = WIRE.outgoing(body, [{"role": "user", "content": "w"}], extra)  # type: ignore[list-item]
    assert out["tools"] == [*body["tools"], *extra]  # type: ignore[misc]
    assert out["stream_options"] == {"x": 1, "include_usage": True}
    assert WIRE.outgoing({**body, "stream": False}, [], extra).get("stream_options") == {"x": 1}
    assert WIRE.outgoing(body, [], [])["tools"] == body["tools"]
    assert [d["function"]["name"] for d in extra] == ["recall_tool_call", "search_history"]


def ev(obj: Any) -> SSEEvent:
    return SSEEvent(obj if isinstance(obj, str) else orjson.dumps(obj).decode())


def chunk(delta: dict[str, Any], finish: str | None = None, cid: str = "u1",
          **extra: Any) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion.chunk", "created": 5, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


def sent(out: list[bytes]) -> list[dict[str, Any]]:
    return [orjson.loads(b[6:]) for b in out if b.startswith(b"data: {")]


def test_a_stream_round_hides_the_proxys_calls_and_holds_the_finish() -> None:
    relay = WIRE.relay({"model": "m", "stream_options": {"include_usage": True}})
    rnd = relay.round(TOOLS)
    out: list[bytes] = []
    for c in (chunk({"role": "assistant", "content": "Let me "}),
              chunk({"content": "look."}),
              chunk({"tool_calls": [{"index": 0, "id": "p1", "type": "function", "function": {
                  "name": "recall_tool_call", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"call_id":"x"}'}}]}),
              chunk({"tool_calls": [{"index": 1, "id": "k1", "type": "function", "function": {
                  "name": "bash", "arguments": '{"cmd":'}}]}),
              chunk({"tool_calls": [{"index": 1, "function": {"arguments": '"ls"}'}}]}),
              chunk({}, "tool_calls"),
              {"id": "u1", "choices": [], "usage": {"prompt_tokens": 9}}):
        out += rnd.feed(ev(c))
    assert not rnd.complete  # a finish reason and the usage, no [DONE]: not ended yet
    assert rnd.feed(ev("[DONE]")) == []
    assert rnd.complete
    shown = sent(out)
    calls = [tc for c in shown for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [tc.get("id") for tc in calls] == ["k1", None] and {tc["index"] for tc in calls} == {0}
    assert all(c["choices"][0]["finish_reason"] is None for c in shown)
    assert all("usage" not in c for c in shown)
    reply = rnd.reply()
    assert [c["id"] for c in reply.calls] == ["p1", "k1"] and reply.usage == {"prompt_tokens": 9}
    assert reply.message["content"] == "Let me look."
    d = decide(reply.calls, TOOLS, 0, 4)
    closing = sent(rnd.close(d))
    assert closing[0]["choices"][0]["finish_reason"] == "tool_calls"
    end = relay.end({"prompt_tokens": 9})
    assert sent(end)[0]["usage"] == {"prompt_tokens": 9} and end[-1] == b"data: [DONE]\n\n"
    assert relay.shown(Reply({"role": "assistant", "tool_calls": [CLIENT_CALL]}).message) == \
        {"role": "assistant", "content": "Let me look.", "tool_calls": [CLIENT_CALL]}


def test_rounds_share_one_id_and_number_the_clients_calls_on() -> None:
    relay = WIRE.relay({"model": "m"})
    first = relay.round(TOOLS)
    first.feed(ev(chunk({"tool_calls": [{"index": 0, "id": "k1", "type": "function",
                                         "function": {"name": "bash", "arguments": ""}}]},
                        cid="first")))
    second = relay.round(TOOLS)
    out = second.feed(ev(chunk({"tool_calls": [{"index": 0, "id": "k2", "type": "function",
                                                "function": {"name": "bash",
                                                             "arguments": ""}}]},
                               cid="second")))
    c = sent(out)[0]
    assert c["id"] == "first" and c["choices"][0]["delta"]["tool_calls"][0]["index"] == 1
    assert relay.end({}) == [b"data: [DONE]\n\n"]  # no usage chunk the client did not ask for
    withdrawn = relay.round(TOOLS)
    withdrawn.feed(ev(chunk({}, "tool_calls")))
    assert sent(withdrawn.close(decide([PROXY_CALL], TOOLS, 4, 4)))[0]["choices"][0][
        "finish_reason"] == "stop"


@pytest.mark.parametrize("bad", ["not json", '{"error": {"message": "boom"}}', "[1,2]"])
def test_an_unreadable_or_failed_chunk_raises(bad: str) -> None:
    rnd = WIRE.relay({}).round(TOOLS)
    with pytest.raises(UpstreamError) as err:
        rnd.feed(ev(bad))
    assert ("boom" in str(err.value)) == ("boom" in bad)


def test_the_observer_records_only_a_whole_stream_and_stops_at_its_limit() -> None:
    """Whole: read to its [DONE], every event read. Red with the observer recording the
    answer at its finish reason (no [DONE]) and with an unreadable event skipped."""
    answer = (chunk({"role": "assistant", "content": "a"}), chunk({"refusal": "no"}),
              chunk({"content": "b"}, "stop"))
    obs = ChatObserver(10_000)
    for c in answer:
        obs.feed(ev(c))
    assert obs.reply() is None and not obs.ended  # the finish reason is not the end
    obs.feed(ev("[DONE]"))
    reply = obs.reply()
    assert reply is not None and reply.message == {"role": "assistant", "content": "ab",
                                                   "refusal": "no"}
    for bad in ([1, 2], "not json", {"error": {"message": "Overloaded"}}):
        obs = ChatObserver(10_000)
        for c in (*answer[:2], bad, *answer[2:], "[DONE]"):
            obs.feed(ev(c))
        assert obs.ended and obs.failure is not None and obs.reply() is None
    small = ChatObserver(10)
    small.feed(ev(chunk({"content": "a long enough answer"})))
    assert small.reply() is None
    assert ChatObserver(100).reply() is None  # nothing read


def test_the_accumulator_builds_calls_by_index_and_ignores_other_choices() -> None:
    acc = Accumulator()
    acc.add(chunk({"tool_calls": [{"index": 1, "id": "b", "function": {"name": "g"}}]}))
    acc.add(chunk({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f",
                                                                        "arguments": "{"}}]}))
    acc.add(chunk({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}))
    acc.add({"choices": [{"index": 1, "delta": {"content": "other choice"}}]})
    assert [c["id"] for c in acc.tool_calls()] == ["a", "b"]
    assert acc.tool_calls()[0]["function"] == {"name": "f", "arguments": "{}"}
    assert acc.message() == {"role": "assistant", "tool_calls": acc.tool_calls()}
    assert acc.id == "u1" and acc.model == "m" and acc.finish_reason is None


# -- the splitter holds for any chunking and interleaving of the upstream's deltas ------------

ARGUMENTS = ["", "{}", '{"q": "a b"}', '{"call_id": "7f"}']
NAMES = ["recall_tool_call", "search_history", "bash", "recall_tool_call_v2", "search", "recall",
         "recall_tool_", "lookup"]


@st.composite
def upstream_answers(draw: st.DrawFn) -> tuple[str, list[dict[str, Any]], list[bytes]]:
    """An upstream streamed answer: its text, its calls (the proxy's among them, client names
    that start like the proxy's), and its bytes — each call's id, name and arguments cut into
    pieces, the calls' deltas interleaved (each call's in order, its name before its
    arguments; its id before, with or after its name), text, empty deltas and a usage-only
    chunk anywhere, split at random bytes."""
    text = draw(st.text(alphabet="ab c", max_size=12))
    calls = []
    for k in range(draw(st.integers(min_value=0, max_value=4))):
        calls.append({"id": f"call_{k}{draw(st.text(alphabet='xyz', max_size=3))}",
                      "type": "function", "function": {
                          "name": draw(st.sampled_from(NAMES)),
                          "arguments": draw(st.sampled_from(ARGUMENTS))}})

    def pieces(s: str) -> list[str]:
        cuts = sorted(draw(st.sets(st.integers(min_value=1, max_value=max(1, len(s) - 1)),
                                   max_size=3))) if len(s) > 1 else []
        return [s[a:b] for a, b in zip([0, *cuts], [*cuts, len(s)], strict=True)]

    streams: list[list[dict[str, Any]]] = []
    for k, c in enumerate(calls):
        deltas: list[dict[str, Any]] = []
        where = draw(st.sampled_from(["alone-first", "with-name", "last"]))  # the id's delta
        if where == "alone-first":
            deltas.append({"index": k, "id": c["id"], "type": "function"})
        for j, part in enumerate(pieces(c["function"]["name"])):
            d: dict[str, Any] = {"index": k, "function": {"name": part}}
            if j == 0 and where == "with-name":
                d.update(id=c["id"], type="function")
            deltas.append(d)
        deltas += [{"index": k, "function": {"arguments": part}}
                   for part in pieces(c["function"]["arguments"])]
        if where == "last":
            deltas[-1] = {**deltas[-1], "id": c["id"], "type": "function"}
        streams.append(deltas)
    texts = [{"content": part} for part in pieces(text)] if text else []
    order: list[dict[str, Any]] = []
    queues = [*streams, texts, [{}], [{"usage": True}]]  # {}: an empty delta
    opened = 0  # a call's index is the order it opens in (how providers number them)
    while any(queues):
        ready = [q for k, q in enumerate(queues) if q and (k >= len(streams) or k <= opened)]
        q = draw(st.sampled_from(ready))
        if next(k for k, x in enumerate(queues) if x is q) == opened < len(streams):
            opened += 1
        order.append(q.pop(0))
    chunks = []
    for d in order:
        if d.get("usage"):
            chunks.append({"id": "s", "choices": [], "usage": {"prompt_tokens": 3}})
        elif "index" in d:
            chunks.append({"id": "s", "choices": [{"index": 0, "delta": {"tool_calls": [d]},
                                                   "finish_reason": None}]})
        else:
            chunks.append({"id": "s", "choices": [{"index": 0, "delta": d,
                                                   "finish_reason": None}]})
    chunks.append({"id": "s", "choices": [{"index": 0, "delta": {},
                                           "finish_reason": "tool_calls" if calls else "stop"}]})
    raw = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    cuts = sorted(draw(st.sets(st.integers(min_value=1, max_value=len(raw) - 1), max_size=8)))
    return text, calls, [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]


def reassembled(out: list[bytes]) -> tuple[str, list[dict[str, Any]], list[str]]:
    """What a client builds from the stream it got (as the SDKs do: deltas merged by index)."""
    acc = Accumulator()
    finishes = []
    decoder = SSEDecoder()
    for ev in [*decoder.feed(b"".join(out)), *decoder.flush()]:
        if ev.is_done:
            continue
        chunk = orjson.loads(ev.data)
        acc.add(chunk)
        finishes += [c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")]
    return "".join(acc.content), acc.tool_calls(), finishes


def fed(rnd: Any, pieces: list[bytes]) -> list[bytes]:
    """An upstream stream in these pieces, decoded and fed to a relay's round (any API's):
    what the round lets through to the client. The round must be complete after it."""
    decoder = SSEDecoder()
    out: list[bytes] = []
    for piece in pieces:
        for ev in decoder.feed(piece):
            out += rnd.feed(ev)
    for ev in decoder.flush():
        out += rnd.feed(ev)
    assert rnd.complete
    return out


@settings(max_examples=400, deadline=None)
@given(answer=upstream_answers())
def test_the_client_gets_the_upstream_answer_less_the_proxys_calls(
        answer: tuple[str, list[dict[str, Any]], list[bytes]]) -> None:
    text, calls, pieces = answer
    relay = WIRE.relay({"model": "m", "stream": True})
    rnd = relay.round(TOOLS)
    out = fed(rnd, pieces)
    reply = rnd.reply()
    assert reply.calls == calls  # the proxy read the upstream's answer whole
    decision = decide(reply.calls, TOOLS, 0, 4)
    theirs = [c for c in calls if not TOOLS.owns(c)]
    if decision.step is Step.ANSWER:  # only the proxy's: the next round follows, nothing shown
        assert reassembled(out)[1] == []
        return
    out += rnd.close(decision)
    out += relay.end(reply.usage or {})
    got_text, got_calls, finishes = reassembled(out)
    assert (got_text, got_calls) == (text, theirs)
    assert finishes == ["tool_calls" if theirs else "stop"] if decision.step is not \
        Step.WITHDRAWN else finishes == ["stop"]
    shown = relay.shown(client_message(reply, decision))
    assert shown.get("tool_calls", []) == got_calls  # what the client will echo is recorded
