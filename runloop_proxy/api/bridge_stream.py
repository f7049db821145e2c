"""The bridge's event stream (pure): a chat-completions stream, across the proxy's tool rounds,
as one Messages event stream — ``message_start``; a text block that streams as the text
comes; a ``tool_use`` block per client call (``content_block_start``, its input as one
``input_json_delta``, ``content_block_stop``); one ``message_delta`` with the stop reason and
the usage of every round; ``message_stop``.

The chat side is chat_wire's: ``ChunkRound`` reads each chunk (an error chunk raises with the
status it stands for) into the round's answer, as the chat relay's rounds do. The Messages side is
messages_stream's (``OneMessage``: one id, one numbering of blocks across rounds, the end).
A round's calls go to the client when the round is over: chat streams a call's name and
arguments in pieces, interleaved with other calls and with text as a server pleases, where
Messages wants each block whole in turn; held to the end, the blocks a client assembles are
the answer's, the proxy's calls left out, whatever the chunking (and its text is one block,
a refusal after it, as in the JSON answer: ``bridge.message_of``)."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from ..conversation.blocks import assistant, call_input
from ..pipeline.sse import SSEEvent
from ..pipeline.tools import ProxyTools
from ..pipeline.wire import Decision, Reply, Step
from .chat_wire import ChunkRound
from .messages_stream import OneMessage, emit

Block = dict[str, Any]


def stop_reason(finish: Any, calls: bool) -> str:
    """Chat's ``finish_reason`` as Messages' ``stop_reason``: an answer that ends with calls
    stops for them whatever the upstream named it (servers differ), unless it was cut."""
    if finish == "length":
        return "max_tokens"
    if calls:
        return "tool_use"
    return "refusal" if finish == "content_filter" else "end_turn"


def input_of(arguments: Any) -> Any:
    """A chat call's arguments as a ``tool_use`` input (what ``blocks`` makes of them)."""
    return call_input({"id": "", "type": "function", "function": {
        "name": "", "arguments": arguments if isinstance(arguments, str) else ""}})


def usage_of_chat(usage: Any) -> dict[str, Any] | None:
    """Chat's usage in Anthropic's terms: ``input_tokens`` are what the cache did not serve."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    prompt, cached = _int(usage.get("prompt_tokens")), _int(
        details.get("cached_tokens") if isinstance(details, dict) else 0)
    return {"input_tokens": max(0, prompt - cached),
            "output_tokens": _int(usage.get("completion_tokens")),
            "cache_read_input_tokens": min(cached, prompt),
            "cache_creation_input_tokens": 0}


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


class BridgeRelay(OneMessage):
    """A chat stream across the proxy's rounds, as one message: the block the client has open
    (the next block, in this round or the next, closes it), and events a round has not sent
    yet."""

    def __init__(self, model: str):
        super().__init__(model)
        self.started = False
        self.open: tuple[int, Block] | None = None  # the block the client has open: its index
        self.pending: list[bytes] = []

    def round(self, tools: ProxyTools) -> BridgeRound:
        return BridgeRound(self, tools)

    def start(self, chunk: dict[str, Any]) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        rid, model = chunk.get("id"), chunk.get("model")
        self.message_id = rid if isinstance(rid, str) else "msg_bridge"
        return [emit({"type": "message_start", "message": {
            "id": self.message_id, "type": "message", "role": "assistant",
            "model": model if isinstance(model, str) and model else self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0}}})]

    def open_block(self, block: Block) -> list[bytes]:
        """The events that start ``block`` (the open one stopped first: blocks follow one
        another)."""
        out = self.close_block()
        at = self.next_index
        self.next_index += 1
        self.open = (at, block)
        shown = {**block, "input": {}} if block["type"] == "tool_use" else block
        return [*out, emit({"type": "content_block_start", "index": at,
                            "content_block": dict(shown)})]

    def close_block(self) -> list[bytes]:
        if self.open is None:
            return []
        at = self.open[0]
        self.open = None
        return [emit({"type": "content_block_stop", "index": at})]

    def flush(self) -> list[bytes]:
        out, self.pending = self.pending, []
        return out


def tool_use(call: dict[str, Any], at: int = 0) -> Block:
    """A chat tool call as a ``tool_use`` block (its id kept: the result answers it). A
    server that names no id (some local ones) gets one made from the call and its place,
    the same each time the answer is read: a Messages client must answer a ``tool_use`` by
    its id."""
    fn = call.get("function") or {}
    name, arguments = str(fn.get("name", "")), fn.get("arguments")
    cid = call.get("id")
    if not isinstance(cid, str) or not cid:
        made = hashlib.sha256(orjson.dumps([at, name, arguments])).hexdigest()[:24]
        cid = f"toolu_{made}"
    return {"type": "tool_use", "id": cid, "name": name, "input": input_of(arguments)}


class BridgeRound(ChunkRound):
    """One upstream chat stream: its text goes to the client as it comes, the client's calls
    once the round is over, the proxy's never; the end is held until the round's fate is
    known."""

    def __init__(self, relay: BridgeRelay, tools: ProxyTools):
        super().__init__()
        self.relay = relay
        self.tools = tools
        relay.rounds += 1
        self.text: Block | None = None
        self.said: list[str] = []  # the text block's text: joined at the round's end
        self.blocks: list[Block] = []  # the client's blocks of this round, in order

    def feed(self, event: SSEEvent) -> list[bytes]:
        chunk = self.chunk(event)
        if chunk is None:
            return []
        out = [*self.relay.start(chunk), *self.relay.flush()]
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if choice.get("index", 0) == 0 and content:
                out += self._text(content)
        return out

    def _text(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.text is None:
            self.text = {"type": "text", "text": ""}
            self.blocks.append(self.text)
            out += self.relay.open_block(self.text)
        self.said.append(text)  # a string grown per delta is quadratic
        assert self.relay.open is not None and self.relay.open[1] is self.text
        out.append(emit({"type": "content_block_delta", "index": self.relay.open[0],
                         "delta": {"type": "text_delta", "text": text}}))
        return out

    def reply(self) -> Reply:
        """The round's answer, whole; the client's part of what it has not been sent yet (a
        refusal, the calls) goes with the round's end or before the next round's first
        event."""
        out: list[bytes] = []
        refusal = "".join(self.acc.refusal)
        if refusal:
            out += self._text(refusal)
        if self.text is not None:
            self.text["text"] = "".join(self.said)
        calls = [tool_use(c, at)  # type: ignore[arg-type]
                 for at, c in enumerate(self.acc.tool_calls())]
        whole = [*([self.text] if self.text else []), *calls]  # as the model answered
        for call, block in zip(self.acc.tool_calls(), calls, strict=True):
            if self.tools.owns(call):
                continue
            self.blocks.append(block)
            out += self.relay.open_block(block)
            out.append(emit({"type": "content_block_delta", "index": self.relay.next_index - 1,
                             "delta": {"type": "input_json_delta",
                                       "partial_json": orjson.dumps(block["input"]).decode()}}))
        self.relay.pending += out
        self.relay.shown_blocks += self.blocks
        return Reply(assistant(whole), usage_of_chat(self.acc.usage), self.acc.id)

    def close(self, decision: Decision) -> list[bytes]:
        out = [*self.relay.start({}), *self.relay.flush(), *self.relay.close_block()]
        calls = any(b["type"] == "tool_use" for b in self.blocks)
        self.relay.delta = {"stop_reason": "end_turn" if decision.step is Step.WITHDRAWN
                            else stop_reason(self.acc.finish_reason, calls),
                            "stop_sequence": None}
        return out
