"""The Responses API over a WebSocket on the wire (pure): client events read into HTTP
requests, a connection's chains against a reference model, the server's events in every
chunking, errors in the socket's shape, and work linear in the stream."""

from __future__ import annotations

import collections
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy.api.responses_ws_wire import (
    CHAINS_KEPT,
    Chains,
    Kept,
    SocketRelay,
    answer_error,
    client_event,
    create_request,
    error_event,
    http_headers,
    socket_error,
    steer_failed,
    warmup_events,
)
from runloop_proxy.errors import InvalidRequest
from runloop_proxy.pipeline.sse import SSEDecoder, SSEEvent, encode_event

from .test_stream_work import RESPONSES
from .test_stream_work import _events as stream_events
from .work import allocated, calls

MODEL = "gpt-5.2-codex-2026-01-14"


def item(text: str, role: str = "user") -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


def kept_chains(**responses: list[dict[str, Any]]) -> Chains:
    chains = Chains()
    for rid, items in responses.items():
        chains.keep(rid, Kept(items, 100))
    return chains


# -- a response.create read ---------------------------------------------------------------

CREATES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("the envelope goes, stream is on",
     {"type": "response.create", "model": MODEL, "input": [item("hi")], "generate": True,
      "stream_id": "lane-1", "stream": False, "store": False},
     {"model": MODEL, "input": [item("hi")], "stream": True, "store": False}),
    ("a string input is the user's message",
     {"type": "response.create", "model": MODEL, "input": "hi"},
     {"model": MODEL, "input": [{"type": "message", "role": "user", "content": "hi"}],
      "stream": True}),
    ("a response of this connection: expanded, named no more",
     {"type": "response.create", "model": MODEL, "previous_response_id": "resp_a",
      "input": [item("next")]},
     {"model": MODEL, "input": [item("first"), item("answer", "assistant"), item("next")],
      "stream": True}),
    ("a continuation may bring nothing new (a warmup's input was the turn's)",
     {"type": "response.create", "model": MODEL, "previous_response_id": "resp_a"},
     {"model": MODEL, "input": [item("first"), item("answer", "assistant")], "stream": True}),
    ("a response this connection never showed: chained, as over HTTP",
     {"type": "response.create", "model": MODEL, "previous_response_id": "resp_other",
      "input": [item("next")]},
     {"model": MODEL, "previous_response_id": "resp_other", "input": [item("next")],
      "stream": True}),
    ("an input of the wrong kind is left for the request's check to name",
     {"type": "response.create", "model": MODEL, "input": 7},
     {"model": MODEL, "input": 7, "stream": True}),
]


@pytest.mark.parametrize(("event", "body"), [c[1:] for c in CREATES],
                         ids=[c[0] for c in CREATES])
def test_a_create_is_the_http_request_it_amounts_to(event: dict[str, Any],
                                                    body: dict[str, Any]) -> None:
    chains = kept_chains(resp_a=[item("first"), item("answer", "assistant")])
    made = create_request(event, chains, 50)
    assert made.body == body
    continued = event.get("previous_response_id") == "resp_a"
    assert made.continued == ("resp_a" if continued else None)
    assert made.size == (150 if continued else 50)
    if isinstance(body["input"], list):
        assert made.items == body["input"]


@pytest.mark.parametrize(("event", "param"), [
    ({"type": "response.create", "generate": "no"}, "generate"),
    ({"type": "response.create", "stream_id": 3}, "stream_id"),
    ({"type": "response.create", "background": True}, "background")])
def test_an_envelope_that_cannot_be_served_names_its_field(event: dict[str, Any],
                                                           param: str) -> None:
    with pytest.raises(InvalidRequest) as bad:
        create_request(event, Chains(), 10)
    assert bad.value.param == param


@pytest.mark.parametrize("text", ["[1]", '{"type": 3}', "nope", '"response.create"'])
def test_a_message_that_is_no_event_is_refused(text: str) -> None:
    with pytest.raises(InvalidRequest):
        client_event(text)


def test_a_warmup_is_a_response_with_no_output_in_its_lane() -> None:
    made = create_request({"type": "response.create", "model": MODEL, "generate": False,
                           "stream_id": "L", "previous_response_id": "resp_x",
                           "input": [item("dev", "developer")]}, Chains(), 10)
    assert made.generate is False
    created, done = warmup_events(made, "resp_w1", 1_796_000_000)
    assert (created["type"], done["type"]) == ("response.created", "response.completed")
    assert created["response"]["id"] == done["response"]["id"] == "resp_w1"
    assert done["response"]["output"] == [] and done["response"]["usage"]["total_tokens"] == 0
    assert done["response"]["previous_response_id"] == "resp_x"
    assert created["stream_id"] == done["stream_id"] == "L"


def test_a_steer_comes_back_with_its_input() -> None:
    out = steer_failed({"type": "response.steer", "previous_response_id": "resp_1",
                        "input": [item("also this")]})
    assert out["type"] == "response.steer.failed"
    assert out["steer"] == {"input": [item("also this")], "previous_response_id": "resp_1"}
    assert out["error"]["code"] == "steering_not_supported"


@pytest.mark.parametrize(("given", "kept"), [
    ([("Sec-WebSocket-Key", "abc=="), ("Sec-WebSocket-Version", "13"),
      ("Sec-WebSocket-Extensions", "permessage-deflate"), ("session-id", "s1")],
     [("session-id", "s1")]),
    ([("OpenAI-Beta", "responses_websockets=2026-02-06")], []),
    ([("openai-beta", "assistants=v2, responses_websockets=2026-02-06")],
     [("openai-beta", "assistants=v2")]),
    ([("Authorization", "Bearer k"), ("Connection", "Upgrade")],
     [("Authorization", "Bearer k"), ("Connection", "Upgrade")]),  # upstream_headers' to drop
])
def test_handshake_headers_as_an_http_requests(given: list[tuple[str, str]],
                                               kept: list[tuple[str, str]]) -> None:
    assert http_headers(given) == kept


# -- chains, against a reference ------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12)), min_size=1, max_size=30),
       st.integers(1, 5))
def test_every_turn_reaches_the_upstream_as_the_whole_conversation(
        turns: list[tuple[int, int]], limit: int) -> None:
    """A client that goes on from any response it was shown (``back`` responses ago) with
    ``n`` new items: the request the proxy builds carries exactly the conversation a
    reference keeps whole (every response's input and output, by id) — while the response
    is among the last ``limit`` used; an older one is chained, as the upstream would
    have it. The reference is a plain dict of every conversation ever made. Red with the
    chains kept first in first out (not by use) and with the new items put before the
    kept ones."""
    chains = Chains(limit)
    reference: dict[str, list[dict[str, Any]]] = {}
    recent: collections.OrderedDict[str, None] = collections.OrderedDict()  # LRU reference
    shown: list[str] = []
    for t, (back, n) in enumerate(turns):
        new = [item(f"turn {t} item {i}") for i in range(n)]
        previous = shown[-1 - back] if back < len(shown) else None
        event: dict[str, Any] = {"type": "response.create", "model": MODEL, "input": new}
        if previous:
            event["previous_response_id"] = previous
        made = create_request(event, chains, 10)
        if previous is not None and previous in recent:
            assert made.body["input"] == [*reference[previous], *new]
            assert "previous_response_id" not in made.body
            recent.move_to_end(previous)
        elif previous is not None:
            assert made.body["previous_response_id"] == previous and made.continued is None
            continue  # chained upstream: not this connection's to keep
        else:
            assert made.body["input"] == new
        rid = f"resp_{t}"
        output = [item(f"answer {t}", "assistant")]
        relay = SocketRelay()
        relay.feed(SSEEvent(orjson.dumps({"type": "response.completed", "response": {
            "id": rid, "status": "completed", "output": output}}).decode()))
        kept = relay.kept(made, 20)
        assert kept is not None
        chains.keep(*kept)
        reference[rid] = [*made.body["input"], *output]
        recent[rid] = None
        while len(recent) > limit:
            recent.popitem(last=False)
        shown.append(rid)
    assert len(chains) <= limit and CHAINS_KEPT >= 1


def test_a_response_that_failed_or_was_cut_is_not_kept() -> None:
    """Red with any response event taken as its end, and with an id not checked."""
    made = create_request({"type": "response.create", "model": MODEL, "input": "x"},
                          Chains(), 10)
    for events in ([{"type": "response.created", "response": {"id": "r1", "output": []}}],
                   [{"type": "error", "code": "server_error", "message": "boom"}],
                   [{"type": "response.failed", "response": {"id": "r1", "output": []}}],
                   [{"type": "response.completed", "response": {"id": 7, "output": []}}],
                   [{"type": "response.completed", "response": {"id": "r1", "output": 3}}]):
        relay = SocketRelay()
        for e in events:
            relay.feed(SSEEvent(orjson.dumps(e).decode(), e["type"]))
        assert relay.kept(made, 0) is None, events


# -- the server's events ------------------------------------------------------------------

STREAM = [
    {"type": "response.created", "sequence_number": 0,
     "response": {"id": "resp_1", "status": "in_progress", "output": []}},
    {"type": "response.output_item.added", "sequence_number": 1, "output_index": 0,
     "item": {"type": "message", "id": "msg_1", "role": "assistant", "content": []}},
    {"type": "response.output_text.delta", "sequence_number": 2, "output_index": 0,
     "content_index": 0, "item_id": "msg_1", "delta": "héllo\r\nwörld"},
    {"type": "response.completed", "sequence_number": 3, "response": {
        "id": "resp_1", "status": "completed", "previous_response_id": None, "output": [
            {"type": "message", "id": "msg_1", "role": "assistant", "content": [
                {"type": "output_text", "text": "héllo\r\nwörld", "annotations": []}]}]}},
]


def _relayed(raw: bytes, cuts: list[int], lane: str | None,
             previous: str | None) -> tuple[list[dict[str, Any]], SocketRelay]:
    relay, decoder, out = SocketRelay(lane, previous), SSEDecoder(1 << 20), []
    at = 0
    for cut in [*sorted(cuts), len(raw)]:
        for ev in decoder.feed(raw[at:cut]):
            out += relay.feed(ev)
        at = cut
    for ev in decoder.flush():
        out += relay.feed(ev)
    return [orjson.loads(m) for m in out], relay


@settings(max_examples=80, deadline=None)
@given(st.data(), st.sampled_from([None, "lane-2"]), st.sampled_from([None, "resp_0"]))
def test_the_events_come_through_in_any_chunking(data: st.DataObject, lane: str | None,
                                                 previous: str | None) -> None:
    """Red with the previous id echoed on the response's end only."""
    raw = b"".join(encode_event(orjson.dumps(e), e["type"]) for e in STREAM) + \
        b"data: [DONE]\n\n"
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=12))
    got, relay = _relayed(raw, cuts, lane, previous)
    expected = [dict(e) for e in orjson.loads(orjson.dumps(STREAM))]
    for e in expected:
        if lane:
            e["stream_id"] = lane
        if previous and "response" in e:
            e["response"]["previous_response_id"] = previous
    assert got == expected
    assert relay.ended and relay.response is not None and relay.response["id"] == "resp_1"


ERRORS = [  # (a stream's error event, the status and type it stands for)
    ({"type": "error", "code": "rate_limit_exceeded", "message": "slow down", "param": None},
     429, "rate_limit_error"),
    ({"type": "error", "code": "context_length_exceeded", "message": "too long",
      "param": "input"}, 400, "invalid_request_error"),
    ({"type": "error", "code": "internal_error", "message": "oops", "param": None},
     500, "server_error"),
    ({"type": "error", "code": "tenant_share_exceeded", "message": "this tenant's share of "
      "tool rounds is in use", "param": None}, 429, "rate_limit_error"),
    ({"type": "error", "code": "proxy_full", "message": "the proxy is full", "param": None},
     503, "server_error"),
    ({"type": "error", "code": None, "message": "the upstream went away", "param": None},
     502, "server_error"),
    ({"type": "error", "status": 503, "error": {"type": "server_error", "code": "overloaded",
                                                "message": "busy"}}, 503, "server_error"),
]


@pytest.mark.parametrize(("event", "status", "kind"), ERRORS,
                         ids=[str(e[0].get("code")) for e in ERRORS])
def test_a_streams_error_is_the_sockets_with_its_status(event: dict[str, Any], status: int,
                                                       kind: str) -> None:
    """Red with a rate limit read as a 502 (Codex would not wait as it is told)."""
    out = socket_error({**event, "sequence_number": 4})
    assert out["type"] == "error" and out["status"] == status
    assert out["error"]["type"] == kind and out["error"]["message"]
    assert out["sequence_number"] == 4


def test_an_answers_error_keeps_its_body_and_its_headers() -> None:
    body = orjson.dumps({"error": {"message": "Rate limit", "type": "requests",
                                   "param": None, "code": "rate_limit_exceeded"}})
    out = answer_error(429, body, {"Retry-After": "3", "Content-Type": "application/json",
                                   "x-ratelimit-remaining-requests": "0"}, "L")
    assert out == {"type": "error", "status": 429, "stream_id": "L", "error": {
        "type": "requests", "code": "rate_limit_exceeded", "message": "Rate limit",
        "param": None, "headers": {"retry-after": "3", "x-ratelimit-remaining-requests": "0"}},
        "headers": {"retry-after": "3", "x-ratelimit-remaining-requests": "0"}}
    html = answer_error(502, b"<html>Bad Gateway</html>")
    assert html["status"] == 502 and "Bad Gateway" in html["error"]["message"]
    assert error_event(404, {"message": "no"})["error"]["type"] == "invalid_request_error"


# -- work ------------------------------------------------------------------------------------

def _relay_all(events: list[SSEEvent]) -> int:
    relay = SocketRelay("lane", "resp_0")
    sent = sum(len(m) for e in events for m in relay.feed(e))
    assert relay.ended
    return sent


@pytest.mark.parametrize("shape", sorted(RESPONSES))
def test_the_socket_relay_does_work_linear_in_the_stream(shape: str) -> None:
    """test_stream_work's Responses shapes at n and 4n events through the socket's relay
    (a lane and a previous id: every event rewritten): calls and bytes about four times.
    Red with a relay that re-copies what it saw at each event."""
    small, large = (stream_events("responses", RESPONSES[shape], n) for n in (500, 2_000))
    _relay_all(small)
    for count in (calls, allocated):
        a = min(count(_relay_all, small)[1] for _ in range(2))
        b = min(count(_relay_all, large)[1] for _ in range(2))
        assert b < 4.6 * a, (count.__name__, a, b)
