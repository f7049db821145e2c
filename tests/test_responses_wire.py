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
