"""The Responses API on the wire (pure): a streamed answer rewritten for the client."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from runloop_proxy.api.responses_wire import ResponsesWire
from runloop_proxy.pipeline.sse import SSEDecoder, SSEEvent
from runloop_proxy.pipeline.tools import ProxyTools
from runloop_proxy.pipeline.wire import decide

TOOLS = ProxyTools.for_request(None)


def call_events(at: int, name_when_added: str, name: str, call_id: str) -> list[dict[str, Any]]:
    """A function call's events: added (with or without its name), an arguments delta, done."""
    added = {"type": "function_call", "id": f"fc_{at}", "call_id": call_id,
             "name": name_when_added, "arguments": ""}
    done = {**added, "name": name, "arguments": "{}", "status": "completed"}
    return [{"type": "response.output_item.added", "output_index": at, "item": added},
            {"type": "response.function_call_arguments.delta", "output_index": at,
             "item_id": f"fc_{at}", "delta": "{}"},
            {"type": "response.output_item.done", "output_index": at, "item": done}]


@pytest.mark.parametrize("name_when_added", ["", "recall_tool_call"])
@pytest.mark.parametrize("first", ["recall_tool_call", "shell"])
def test_an_item_is_judged_once_its_name_is_known(name_when_added: str, first: str) -> None:
    """A call added without its name (some servers name it only when it is done) is held:
    the proxy's never reaches the client, the client's arrives whole and renumbered."""
    events = [*call_events(0, name_when_added if first != "shell" else "", first, "c0"),
              *call_events(1, "shell", "shell", "c1")]
    output = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    events += [{"type": "response.completed", "response": {
        "id": "resp_1", "object": "response", "status": "completed", "output": output}}]
    rnd = ResponsesWire().relay({}).round(TOOLS)
    sent: list[bytes] = []
    for e in events:
        sent += rnd.feed(SSEEvent(orjson.dumps(e).decode(), e["type"]))
    seen = [orjson.loads(ev.data) for ev in SSEDecoder().feed(b"".join(sent))]
    client_calls = [e["item"]["call_id"] for e in seen if e["type"] == "response.output_item.done"]
    assert client_calls == (["c1"] if first != "shell" else ["c0", "c1"])
    assert not any("c0" in str(e) for e in seen) or first == "shell"
    assert sorted({e["output_index"] for e in seen}) == list(range(len(client_calls)))
    decision = decide(rnd.reply().calls, TOOLS, 0, 4)
    assert [c["id"] for c in decision.theirs] == client_calls


def _skipping(n: int) -> list[dict[str, Any]]:
    """A stream whose items are numbered 1, 3, 5, … (the index after each is never sent):
    every item is held until the response's end."""
    events: list[dict[str, Any]] = []
    items = []
    for k in range(n):
        item = {"type": "message", "id": f"m{k}", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": f"t{k}", "annotations": []}]}
        items.append(item)
        events.append({"type": "response.output_item.done", "output_index": 2 * k + 1,
                       "item": item})
    events.append({"type": "response.completed", "response": {
        "id": "resp_1", "object": "response", "status": "completed", "output": items}})
    return events


def test_releasing_held_items_is_linear_in_them() -> None:
    """Finding (red team): at a response's end, each held item was found by a search over
    all those still held (its index skipped, ``min`` per release): an upstream numbering its
    items 1, 3, 5, … made the round quadratic, 8.3 s of the event loop for a 1.27 MB stream.
    Counted, not timed: twice the items cost about twice the calls, and all come out, in the
    upstream's order, numbered 0, 1, 2, …"""
    from .work import calls

    def run(n: int) -> int:
        events = [SSEEvent(orjson.dumps(e).decode(), e["type"]) for e in _skipping(n)]
        rnd = ResponsesWire().relay({}).round(TOOLS)

        def feed() -> list[bytes]:
            return [b for e in events for b in rnd.feed(e)]
        out, count = calls(feed)
        seen = [orjson.loads(ev.data) for ev in SSEDecoder().feed(b"".join(out))]
        done = [e for e in seen if e["type"] == "response.output_item.done"]
        assert [e["item"]["id"] for e in done] == [f"m{k}" for k in range(n)]
        assert [e["output_index"] for e in done] == list(range(n))
        return count

    small, large = run(1_000), run(4_000)
    assert large < 4.6 * small, (small, large)


@pytest.mark.parametrize("index", [[1], {"a": 1}, None, True, 1.5])
def test_an_output_index_that_is_no_index_is_a_bad_answer(index: Any) -> None:
    """An upstream event whose output_index is no integer or string is the upstream's bad
    answer (502 upstream_bad_response), not the proxy's crash (an unhashable one was a
    TypeError: internal_error, a 500, a traceback)."""
    from runloop_proxy.errors import UpstreamBadReply
    rnd = ResponsesWire().relay({}).round(TOOLS)
    event = {"type": "response.output_text.delta", "output_index": index, "delta": "x"}
    with pytest.raises(UpstreamBadReply):
        rnd.feed(SSEEvent(orjson.dumps(event).decode(), event["type"]))
