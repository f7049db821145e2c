"""The Messages API on the wire (pure): JSON answers without the proxy's calls, and an event
stream rewritten for the client — for any chunking of the upstream's bytes and across the
proxy's rounds — checked by reassembling what the client gets with the ``anthropic`` SDK's own
accumulator."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runloop_proxy.api.messages_stream import MessagesRelay
from runloop_proxy.api.messages_wire import MessagesWire, error_shape, message_problem
from runloop_proxy.errors import ContextLengthExceeded, UpstreamBadReply, UpstreamError
from runloop_proxy.pipeline.sse import SSEDecoder, SSEEvent
from runloop_proxy.pipeline.tools import ProxyTools
from runloop_proxy.pipeline.wire import Step, add_usage, client_message, decide

from .test_chat_wire import fed

TOOLS = ProxyTools.for_request(None)
WIRE = MessagesWire()
NAMES = ["recall_tool_call", "search_history", "bash", "recall", "search_history_v2"]


def event(data: dict[str, Any]) -> bytes:
    return b"event: " + data["type"].encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


@st.composite
def answers(draw: st.DrawFn, tag: str = "") -> tuple[list[dict[str, Any]], bytes]:
    """An upstream answer's blocks and its event stream: thinking, text and tool_use blocks
    (the proxy's among them, client tools named like the proxy's), each block's deltas in
    pieces, pings anywhere."""
    blocks: list[dict[str, Any]] = []
    if draw(st.booleans()):
        blocks.append({"type": "thinking", "thinking": draw(st.text("ab ", min_size=1,
                                                                    max_size=9)),
                       "signature": "sig" + tag})
    if draw(st.booleans()):
        blocks.append({"type": "text", "text": draw(st.text("xy z", min_size=1, max_size=9))})
    for k in range(draw(st.integers(0, 3))):
        blocks.append({"type": "tool_use", "id": f"toolu_{tag}{k}",
                       "name": draw(st.sampled_from(NAMES)),
                       "input": draw(st.sampled_from([{}, {"call_id": "7f"},
                                                      {"q": "a b", "n": [1, 2]}]))})

    def pieces(s: str) -> list[str]:
        cuts = sorted(draw(st.sets(st.integers(1, max(1, len(s) - 1)), max_size=3))) \
            if len(s) > 1 else []
        return [s[a:b] for a, b in zip([0, *cuts], [*cuts, len(s)], strict=True)]

    evs: list[dict[str, Any]] = [{"type": "message_start", "message": {
        "id": f"msg_{tag}", "type": "message", "role": "assistant", "model": "m",
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 100, "output_tokens": 1, "cache_read_input_tokens": 40}}}]
    for at, b in enumerate(blocks):
        if draw(st.booleans()):
            evs.append({"type": "ping"})
        kind = b["type"]
        if kind == "text":
            evs.append({"type": "content_block_start", "index": at,
                        "content_block": {"type": "text", "text": ""}})
            evs += [{"type": "content_block_delta", "index": at,
                     "delta": {"type": "text_delta", "text": p}} for p in pieces(b["text"])]
        elif kind == "thinking":
            evs.append({"type": "content_block_start", "index": at, "content_block": {
                "type": "thinking", "thinking": "", "signature": ""}})
            evs += [{"type": "content_block_delta", "index": at,
                     "delta": {"type": "thinking_delta", "thinking": p}}
                    for p in pieces(b["thinking"])]
            evs.append({"type": "content_block_delta", "index": at,
                        "delta": {"type": "signature_delta", "signature": b["signature"]}})
        else:
            evs.append({"type": "content_block_start", "index": at,
                        "content_block": {**b, "input": {}}})
            evs += [{"type": "content_block_delta", "index": at,
                     "delta": {"type": "input_json_delta", "partial_json": p}}
                    for p in pieces(orjson.dumps(b["input"]).decode())]
        evs.append({"type": "content_block_stop", "index": at})
    calls = any(b["type"] == "tool_use" for b in blocks)
    evs.append({"type": "message_delta", "delta": {
        "stop_reason": "tool_use" if calls else "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": 20}})
    evs.append({"type": "message_stop"})
    return blocks, b"".join(map(event, evs))


def chunked(draw: st.DrawFn, raw: bytes) -> list[bytes]:
    cuts = sorted(draw(st.sets(st.integers(1, len(raw) - 1), max_size=10)))
    return [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]


def reassembled(out: list[bytes]) -> tuple[Any, list[str]]:
    """The message a client builds from the stream (the SDK's accumulator), and the event
    types it got."""
    snapshot: Any = None
    kinds = []
    bufs: dict[int, bytes] = {}
    decoder = SSEDecoder()
    for ev in [*decoder.feed(b"".join(out)), *decoder.flush()]:
        data = orjson.loads(ev.data)
        assert ev.event == data["type"]  # each event named on its event line too
        kinds.append(data["type"])
        if data["type"] != "ping":
            snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot, kinds


def run_round(relay: MessagesRelay, pieces: list[bytes], rounds: int
              ) -> tuple[Any, list[bytes], Any]:
    rnd = relay.round(TOOLS)
    out = fed(rnd, pieces)
    reply = rnd.reply()
    return reply, out, (rnd, decide(reply.calls, TOOLS, rounds, 4))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_the_client_gets_every_rounds_blocks_less_the_proxys_calls(data: Any) -> None:
    """Up to three upstream rounds, each chunked at random bytes: what the client's SDK
    assembles is one message — the client's blocks of every round in order, renumbered from
    0, one message_start and one message_stop, usage summed — and what the proxy reads of
    each round is the upstream's answer whole."""
    relay = WIRE.relay({"model": "m"})
    usage: dict[str, Any] = {}
    shown: list[dict[str, Any]] = []
    out: list[bytes] = []
    for rounds in range(3):
        blocks, raw = data.draw(answers(tag=str(rounds)))
        reply, sent, (rnd, decision) = run_round(relay, chunked(data.draw, raw), rounds)
        assert reply.message.get("blocks") == blocks  # the round read whole
        out += sent
        add_usage(usage, reply.usage)
        shown += [b for b in blocks if not (b["type"] == "tool_use"
                                            and b["name"] in TOOLS.names)]
        if decision.step is not Step.ANSWER or rounds == 2:
            out += rnd.close(decision)
            break
    out += relay.end(usage)
    message, kinds = reassembled(out)
    assert kinds.count("message_start") == 1 and kinds[-1] == "message_stop"
    assert kinds.count("message_stop") == 1
    assert [b.model_dump(exclude_none=True) for b in message.content] == shown
    assert message.usage.input_tokens == usage["input_tokens"] == 100 * (rounds + 1)
    assert message.usage.cache_read_input_tokens == 40 * (rounds + 1)
    assert message.usage.output_tokens == 20 * (rounds + 1)
    expected = "end_turn" if decision.step is Step.WITHDRAWN else \
        ("tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn")
    assert message.stop_reason == expected
    # what the client will echo is what the proxy records
    recorded = relay.shown(client_message(reply, decision))
    assert recorded.get("blocks", []) == shown or (not shown and recorded == reply.message)


def test_a_tool_use_block_without_a_name_at_its_start_is_held_until_it_stops() -> None:
    relay = WIRE.relay({})
    rnd = relay.round(TOOLS)
    evs = [{"type": "message_start", "message": {"id": "m1", "usage": {"input_tokens": 1}}},
           {"type": "content_block_start", "index": 0,
            "content_block": {"type": "tool_use", "id": "t0", "name": "", "input": {}}},
           {"type": "content_block_delta", "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": "{}"}}]
    out = [b for e in evs for b in rnd.feed(SSEEvent(orjson.dumps(e).decode(), e["type"]))]
    assert [orjson.loads(b.split(b"data: ")[1]) ["type"] for b in out] == ["message_start"]
    stop = {"type": "content_block_stop", "index": 0}
    out = rnd.feed(SSEEvent(orjson.dumps(stop).decode()))
    assert len(out) == 3  # its start, its delta, its stop: a client's block after all


def test_an_error_event_raises_with_the_upstreams_type() -> None:
    rnd = WIRE.relay({}).round(TOOLS)
    with pytest.raises(UpstreamError) as err:
        rnd.feed(SSEEvent(orjson.dumps({"type": "error", "error": {
            "type": "overloaded_error", "message": "Overloaded"}}).decode()))
    assert err.value.status == 529
    assert WIRE.relay({}).error(err.value) == event(
        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})


@pytest.mark.parametrize(("data", "problem"), [
    ([], "not a JSON object"), ({"content": "x"}, "no content blocks"),
    ({"content": [{"type": "tool_use", "id": 3, "name": "b"}]}, "a tool_use block is malformed"),
    ({"content": [{"type": "text", "text": "x"}]}, None)])
def test_message_problems(data: Any, problem: str | None) -> None:
    assert message_problem(data) == problem
    if problem is None:
        assert WIRE.parse(data).message["content"] == "x"
    else:  # what the proxy cannot read is the upstream's fault, said so, never a KeyError
        with pytest.raises(UpstreamBadReply, match=f"not a message: {problem}"):
            WIRE.parse(data)


def test_the_client_json_loses_the_proxys_calls_and_sums_usage() -> None:
    data = {"id": "m", "content": [
        {"type": "text", "text": "x"},
        {"type": "tool_use", "id": "t1", "name": "recall_tool_call", "input": {}},
        {"type": "tool_use", "id": "t2", "name": "bash", "input": {}}],
        "stop_reason": "tool_use", "usage": {"input_tokens": 5, "output_tokens": 1,
                                             "service_tier": "standard"}}
    reply = WIRE.parse(data)
    decision = decide(reply.calls, TOOLS, 0, 4)
    assert decision.step is Step.MIXED
    out = WIRE.client_json(data, decision, {"input_tokens": 12, "output_tokens": 3}, TOOLS)
    assert [b["type"] for b in out["content"]] == ["text", "tool_use"]
    assert out["content"][1]["id"] == "t2" and out["stop_reason"] == "tool_use"
    assert out["usage"] == {"input_tokens": 12, "output_tokens": 3, "service_tier": "standard"}
    withdrawn = decide(reply.calls[:1], TOOLS, 4, 4)
    assert WIRE.client_json({**data, "content": data["content"][:2]}, withdrawn,
                            {}, TOOLS)["stop_reason"] == "end_turn"


def test_the_next_round_withdraws_the_proxys_tools() -> None:
    sent = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [
        {"name": "recall_tool_call", "input_schema": {}}], "tool_choice": {
        "type": "tool", "name": "recall_tool_call"}}
    body = WIRE.next_round(sent, [{"role": "user", "content": "x"}],
                           frozenset({"recall_tool_call"}))
    assert "tools" not in body and "tool_choice" not in body


def test_a_request_that_cannot_fit_says_so_in_anthropics_words() -> None:
    exc = ContextLengthExceeded("needs more", needed=250_000, allowed=190_000)
    body = error_shape(400, exc.body(), exc)
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("prompt is too long: 250000 tokens > 190000 "
                                               "maximum")


# -- breakpoints: the proxy's, on request, at most four ----------------------------------------

def test_auto_marks_the_stable_prefix_and_the_end_taking_the_next_marks_lifetime() -> None:
    from runloop_proxy.api.breakpoints import marks, with_auto
    body = {"system": [{"type": "text", "text": "S"}], "messages": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [{"type": "text", "text": "b"},
                                          {"type": "thinking", "thinking": "t",
                                           "signature": "s"}]},
        {"role": "user", "content": [{"type": "text", "text": "c",
                                      "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                                     {"type": "text", "text": "d"}]}]}
    out = with_auto(body, 1)
    # the stable mark skips the thinking block and takes the 1h of the mark after it
    assert out["messages"][1]["content"][0]["cache_control"] == {"type": "ephemeral",
                                                                  "ttl": "1h"}
    assert out["messages"][2]["content"][1]["cache_control"] == {"type": "ephemeral"}
    assert [m[:3] for m in marks(out)] == [(2, 1, 0), (2, 2, 0), (2, 2, 1)]
    assert body["messages"][1]["content"][0] == {"type": "text", "text": "b"}  # not mutated
    assert with_auto(body, -1)["system"][0]["cache_control"] == {"type": "ephemeral",
                                                                 "ttl": "1h"}
    plain = with_auto({"messages": [{"role": "user", "content": "hi"}]}, None)
    assert plain["messages"][0]["content"] == [{"type": "text", "text": "hi",
                                                "cache_control": {"type": "ephemeral"}}]


def test_auto_never_makes_more_than_four_marks() -> None:
    from runloop_proxy.api.breakpoints import marks, with_auto
    cc = {"type": "ephemeral"}
    body = {"tools": [{"name": f"t{i}", "input_schema": {}, "cache_control": cc}
                      for i in range(3)],
            "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                         {"role": "user", "content": "c"}]}
    assert len(marks(with_auto(body, 0))) == 4
    assert len(marks(with_auto({**body, "tools": [*body["tools"], body["tools"][0]]}, 0))) == 4


@pytest.mark.parametrize(("usage", "prompt"), [
    ({"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 40}}, (100, 40)),
    ({"input_tokens": 100, "input_tokens_details": {"cached_tokens": 40}}, (100, 40)),
    ({"input_tokens": 10, "cache_read_input_tokens": 60, "cache_creation_input_tokens": 30},
     (100, 60)),
    ({"input_tokens": 10, "cache_creation_input_tokens": 30}, (40, 0)),
    ({}, (0, 0))])
def test_the_whole_prompt_an_upstream_reports(usage: dict[str, Any],
                                              prompt: tuple[int, int]) -> None:
    from runloop_proxy.pipeline.accounting import prompt_usage
    assert prompt_usage(usage) == prompt


def _every_mark(value: Any) -> int:
    """cache_control marks anywhere in a body, counted without the proxy's reader."""
    if isinstance(value, dict):
        return int(isinstance(value.get("cache_control"), dict)) \
            + sum(_every_mark(v) for k, v in value.items() if k != "cache_control")
    if isinstance(value, list):
        return sum(_every_mark(v) for v in value)
    return 0


_CC = {"type": "ephemeral"}
_text = st.builds(lambda marked: {"type": "text", "text": "t", **({"cache_control": _CC}
                                                                   if marked else {})},
                  st.booleans())
# marks at any depth Anthropic's blocks allow: a search_result's text inside a tool_result, a
# document whose source is content blocks (a red team's: one level was all that was counted)
_search = st.builds(lambda inner, marked: {"type": "search_result", "source": "s", "title": "t",
                                           "content": inner,
                                           **({"cache_control": _CC} if marked else {})},
                    st.lists(_text, max_size=2), st.booleans())
_document = st.builds(lambda inner, marked: {"type": "document", "source": {
    "type": "content", "content": inner}, **({"cache_control": _CC} if marked else {})},
                      st.lists(_text, max_size=2), st.booleans())
_result = st.builds(lambda inner, marked: {"type": "tool_result", "tool_use_id": "u",
                                           "content": inner,
                                           **({"cache_control": _CC} if marked else {})},
                    st.lists(st.one_of(_text, _search), max_size=3), st.booleans())


@settings(max_examples=200, deadline=None)
@given(system=st.lists(_text, max_size=2), tools=st.lists(st.booleans(), max_size=2),
       turns=st.lists(st.lists(st.one_of(_text, _result, _document), min_size=1, max_size=3),
                      min_size=1, max_size=4),
       stable=st.integers(-1, 3))
def test_auto_marks_stay_within_four_wherever_the_client_put_its_own(
        system: list[dict[str, Any]], tools: list[bool], turns: list[list[dict[str, Any]]],
        stable: int) -> None:
    """Every mark the client set counts — on a tool, a system block, a message's block or a
    block inside it at any depth (a tool_result's, a search_result's in it, a document's
    content source) — and the proxy adds its own only while all of them are fewer than four
    (nested marks were not counted: five went upstream; then only one level down)."""
    from runloop_proxy.api.breakpoints import marks, with_auto
    body = {"system": system or "s",
            "tools": [{"name": f"t{i}", "input_schema": {}, **({"cache_control": _CC} if m
                                                               else {})}
                      for i, m in enumerate(tools)],
            "messages": [{"role": "user" if k % 2 == 0 else "assistant", "content": blocks}
                         for k, blocks in enumerate(turns)]}
    assert len(marks(body)) == _every_mark(body)
    out = with_auto(body, min(stable, len(turns) - 1))
    assert _every_mark(out) <= max(4, _every_mark(body))
    assert _every_mark(out) - _every_mark(body) <= 2


# -- the marker's note in pieces: a breakpoint the next omission repeats -----------------------

def test_the_note_goes_as_a_block_per_piece_with_the_last_one_marked() -> None:
    from runloop_proxy.api.breakpoints import marks, with_auto
    from runloop_proxy.api.messages_wire import in_pieces
    pieces = ("[runloop-proxy] marker\nSummary of the turns not shown:", "ids: A1", "ids: B2")
    note = "\n".join(pieces)
    turns = [{"role": "user", "content": "task"},
             {"role": "assistant", "content": [{"type": "text", "text": note},
                                               {"type": "text", "text": "kept reply"}]},
             {"role": "user", "content": "next"}]
    split, at = in_pieces(turns, 1, pieces)
    assert at == (1, 2)
    assert [b["text"] for b in split[1]["content"]] == [*pieces, "kept reply"]
    assert turns[1]["content"][0]["text"] == note  # not mutated
    out = with_auto({"system": "S", "messages": split}, 1, at)
    # the end of the request first, then the note's last piece, then the stable prefix
    assert [m[:3] for m in marks(out)] == [(2, 1, 2), (2, 1, 3), (2, 2, 0)]
    # one slot left (three of the client's): it goes to the end of the request
    cc = {"type": "ephemeral"}
    crowded = {"system": [{"type": "text", "text": f"S{i}", "cache_control": cc}
                          for i in range(3)], "messages": split}
    assert [m[:3] for m in marks(with_auto(crowded, 1, at)) if m[0] == 2] == [(2, 2, 0)]
    # a turn that does not hold the note's text as one block is left as it is
    assert in_pieces(turns, 2, pieces) == (turns, None)
    plain, at = in_pieces([{"role": "assistant", "content": note}], 0, pieces)
    assert at == (0, 2) and [b["text"] for b in plain[0]["content"]] == list(pieces)


_KINDS = ["system", "user", "user_blocks", "assistant", "assistant_calls", "tool"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_KINDS), min_size=1, max_size=12))
def test_each_window_message_is_told_the_turn_it_went_into(kinds: list[str]) -> None:
    """``to_anthropic`` says, for each window message, the Messages turn it went into (-1:
    the system prompt) — where ``cache_breakpoints = "auto"`` puts the note's pieces and
    the stable prefix's mark. Whatever the window holds (a system turn later on, runs of
    one role merged, results, a window that opens with the model's words and gets a user
    turn before them), each message's content is in the turn it is told. Planted, each
    passed every other test: the turns not shifted past the user turn put first (every
    mark one turn early: on the stand-in, and off the note); the shift moving the system
    prompt's -1 to that stand-in turn too."""
    from runloop_proxy.conversation.blocks import to_anthropic

    messages: list[dict[str, Any]] = []
    for i, kind in enumerate(kinds):
        tag = f"<m{i}>"
        if kind == "user_blocks":
            messages.append({"role": "user", "content": [{"type": "text", "text": tag}]})
        elif kind == "assistant_calls":
            messages.append({"role": "assistant", "content": tag, "tool_calls": [
                {"id": f"call{i}", "type": "function", "function": {
                    "name": "f", "arguments": orjson.dumps({"x": tag}).decode()}}]})
        elif kind == "tool":
            messages.append({"role": "tool", "tool_call_id": f"call{i}", "content": tag})
        else:
            messages.append({"role": kind, "content": tag})
    turn_of: list[int] = []
    system, turns = to_anthropic(messages, None, turn_of)
    assert len(turn_of) == len(messages)
    for i, t in enumerate(turn_of):
        where = system if t == -1 else turns[t]
        assert f"<m{i}>" in orjson.dumps(where).decode(), (i, kinds, turn_of, turns)


def _auto_reference(body: dict[str, Any], stable: int | None,
                    note: tuple[int, int] | None) -> dict[str, Any]:
    """``with_auto`` the slow way, from what the docstring promises: the places wanted, in
    order (the request's last turn, the note's block, the stable turn; -1 the system prompt),
    each given a mark on its last markable block (or the note's block, else the markable one
    before it) while the body holds fewer than four marks anywhere; a place whose block is
    marked already takes none; each mark takes the ttl of the first mark after it."""
    import copy

    out = copy.deepcopy(body)
    turns = out.get("messages") or []

    def as_blocks(content: Any) -> list[Any]:
        return content if isinstance(content, list) else [{"type": "text", "text": content}]

    def rendered() -> list[tuple[tuple[int, int, int], Any]]:
        """Every block that can hold a mark, with its place, in the order the API renders."""
        order: list[tuple[tuple[int, int, int], Any]] = []
        order += [((0, 0, i), t) for i, t in enumerate(out.get("tools") or [])]
        if isinstance(out.get("system"), list):
            order += [((1, 0, i), b) for i, b in enumerate(out["system"])]
        for t, turn in enumerate(turns):
            if isinstance(turn.get("content"), list):
                for i, b in enumerate(turn["content"]):
                    order += [((2, t, i), b)]
        return order

    places: list[tuple[int, int | None]] = [(len(turns) - 1, None)]
    places += [note] if note is not None else []
    places += [(stable, None)] if stable is not None else []
    done: list[tuple[int, int | None]] = []
    for t, block in places:
        if (t, block) in done or (t < 0 and not out.get("system")):
            continue
        done.append((t, block))
        if _every_mark(out) >= 4:
            break
        if t >= len(turns):
            continue
        holder, key, part = (out, "system", 1) if t < 0 else (turns[t], "content", 2)
        blocks = as_blocks(holder[key])
        candidates = [i for i, b in enumerate(blocks)
                      if (block is None or i <= block) and isinstance(b, dict)
                      and b.get("type") not in ("thinking", "redacted_thinking")
                      and (b.get("type") != "text" or b.get("text"))]
        if not candidates or "cache_control" in blocks[candidates[-1]]:
            continue
        at = candidates[-1]
        place = (part, max(t, 0), at)
        later = [m["cache_control"] for where, b in rendered() if where > place
                 for m in _marked_in_order(b)]
        ttl = later[0].get("ttl") if later and isinstance(later[0].get("ttl"), str) else None
        blocks = [dict(b) if isinstance(b, dict) else b for b in blocks]
        blocks[at]["cache_control"] = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
        holder[key] = blocks
    return out


def _marked_in_order(block: Any) -> list[dict[str, Any]]:
    """The marked blocks of ``block`` and inside it, in the order they are written."""
    if isinstance(block, list):
        return [m for v in block for m in _marked_in_order(v)]
    if not isinstance(block, dict):
        return []
    here = [block] if isinstance(block.get("cache_control"), dict) else []
    return here + [m for k, v in block.items() if k != "cache_control"
                   for m in _marked_in_order(v)]


_ttl_text = st.builds(lambda text, ttl: {"type": "text", "text": text, **(
    {"cache_control": {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}}
    if ttl is not None else {})}, st.sampled_from(["", "t", "longer text"]),
    st.sampled_from([None, None, "", "1h", "5m"]))
_thinking = st.sampled_from([{"type": "thinking", "thinking": "hm", "signature": "EqQBCgIYAh"},
                             {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"}])
_auto_result = st.builds(lambda inner: {"type": "tool_result", "tool_use_id": "toolu_01",
                                        "content": inner}, st.lists(_ttl_text, max_size=2))


@settings(max_examples=400, deadline=None)
@given(system=st.one_of(st.sampled_from(["", "You are terse."]), st.lists(_ttl_text, max_size=2)),
       tools=st.lists(st.sampled_from([None, "1h", ""]), max_size=2),
       turns=st.lists(st.one_of(st.sampled_from(["", "a question"]), st.lists(
           st.one_of(_ttl_text, _thinking, _auto_result), min_size=1, max_size=4)),
           min_size=1, max_size=5),
       stable=st.one_of(st.none(), st.integers(-1, 4)), note=st.one_of(
           st.none(), st.tuples(st.integers(0, 4), st.integers(0, 3))))
@example(system="S", tools=[], turns=["q", "a", [{
    "type": "tool_result", "tool_use_id": "toolu_01", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"type": "text", "text": "y", "cache_control": {"type": "ephemeral"}}]}], "go on"],
    stable=1, note=None)  # found by it: the mark took y's 5 minutes, before x's hour
def test_auto_marks_are_exactly_where_the_reference_puts_them(
        system: Any, tools: list[str | None], turns: list[Any], stable: int | None,
        note: tuple[int, int] | None) -> None:
    """The proxy's breakpoints are where they pay, not only at most four: the whole body
    ``with_auto`` returns equals the slow reference's (each place in its order, the last
    markable block, the ttl of the next mark after it), for bodies with thinking blocks,
    empty texts, string contents, marks nested in tool results and the client's own ttls.

    Bug class: a mark that exists but sits in a worse place (a shorter prefix cached, a
    higher bill). Found by it: the stable mark before a tool result whose blocks carry
    marks of an hour then of five minutes took the five minutes (the blocks inside were
    read last first), and a five-minute mark before an hour's is a request the API refuses.
    Planted: the stable prefix's mark before the note's (one slot left goes to
    the wrong place); a mark on the first markable block of a turn instead of the last; the
    ttl taken from the mark before it, not after; a redacted_thinking block taken as
    markable (the API refuses a mark on it)."""
    from runloop_proxy.api.breakpoints import with_auto
    body: dict[str, Any] = {
        "system": system, "messages": [
            {"role": "user" if k % 2 == 0 else "assistant", "content": c}
            for k, c in enumerate(turns)],
        "tools": [{"name": f"lookup_{i}", "input_schema": {"type": "object"}, **(
            {"cache_control": {"type": "ephemeral", **({"ttl": t} if t else {})}}
            if t is not None else {})} for i, t in enumerate(tools)]}
    if note is not None and (note[0] >= len(turns) or not isinstance(turns[note[0]], list)
                             or note[1] >= len(turns[note[0]])):
        note = None  # the builder names only a block of a turn in blocks
    stable = None if stable is None else min(stable, len(turns) - 1)
    want = _auto_reference(body, stable, note)
    assert with_auto(body, stable, note) == want
