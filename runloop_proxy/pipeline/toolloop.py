"""The proxy's tool rounds: when the model calls recall_tool_call or search_history, answer and
ask the upstream again — for a JSON answer and for a stream alike (the stream stays live and
free of the proxy's calls). Which calls are whose, and what happens next, is ``wire.decide``'s."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from ..conversation.messages import Message
from ..errors import UpstreamBadReply, UpstreamError
from .offload import events, is_large, offload
from .sse import SSEDecoder
from .tools import ProxyTools, ToolRunner
from .upstream import UpstreamResponse
from .wire import (
    Decision,
    Reply,
    Step,
    StreamRelay,
    StreamRound,
    Wire,
    add_usage,
    client_message,
    decide,
)

Send = Callable[[dict[str, Any]], Awaitable[UpstreamResponse]]


@dataclass(frozen=True)
class Outcome:
    """How the turn ended: the answer as the client got it, the proxy's part of the turn to
    splice back on the next request (``{"before", "replace", "after"}``), and usage summed."""

    shown: Message
    kept: dict[str, Any] | None
    usage: dict[str, Any]
    id: str | None = None  # the id the client got for the answer
    first: dict[str, Any] | None = None  # the first call's usage (the prompt the proxy counted)
    # the upstream's id of the last round, where the client got another (a stream's first):
    # the response stored upstream with the proxy's calls answered, the one to chain on
    chain: str | None = None


@dataclass
class Rounds:
    """What the tool rounds of one request need."""

    wire: Wire
    tools: ProxyTools
    sent: dict[str, Any]  # the first upstream body
    window: list[Message]  # the messages it carried
    runner: ToolRunner
    max_rounds: int
    send: Send  # one upstream call, timed
    max_answer: int  # bytes of an upstream answer the rounds may hold whole
    large: bool = False  # each round's body is made off the event loop (offload.py)

    async def again(self, convo: list[Message], rounds: int) -> UpstreamResponse:
        """The next round; on the last one allowed the proxy's tools are withdrawn, so the
        model has to answer."""
        withdraw = frozenset(self.tools.names) if rounds >= self.max_rounds else frozenset()
        sent = await offload(self.large, lambda: self.wire.next_round(self.sent, convo,
                                                                       withdraw))
        resp = await self.send(sent)
        if resp.status >= 400:
            body = await resp.read(self.max_answer)
            raise UpstreamError(f"the upstream answered {resp.status} to a proxy tool round",
                                quoted=f": {body[:300].decode(errors='replace')}",
                                status=resp.status if resp.status >= 500 else 502)
        return resp


def _kept(before: list[Message], decision: Decision, full: Message,
          after: list[Message]) -> dict[str, Any] | None:
    mixed = decision.step is Step.MIXED
    if not before and not mixed:
        return None
    return {"before": before, "replace": full if mixed else None, "after": after}


async def _finish(r: Rounds, reply: Reply, decision: Decision, before: list[Message],
                  shown: Message, usage: dict[str, Any], answer_id: str | None,
                  first: dict[str, Any] | None) -> Outcome:
    # Mixed with the client's calls, the proxy's are answered now and spliced back after the
    # client's results; withdrawn ones are never run.
    after = [await r.runner.run(c) for c in decision.mine] if decision.step is Step.MIXED \
        else []
    chain = reply.id if reply.id is not None and reply.id != answer_id else None
    return Outcome(shown, _kept(before, decision, reply.message, after), usage, answer_id,
                   first, chain)


def parse_json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise UpstreamBadReply("the upstream's answer is not JSON") from exc


async def parsed(raw: bytes) -> Any:
    """An answer's JSON, parsed off the event loop when it is large."""
    return await offload(is_large(len(raw)), lambda: parse_json(raw))


async def answer_json(r: Rounds, raw: bytes) -> tuple[dict[str, Any], Outcome]:
    """A JSON answer, with the proxy's rounds run until the model answers the client."""
    data = await parsed(raw)
    usage: dict[str, Any] = {}
    convo = list(r.window)
    before: list[Message] = []
    rounds = 0
    first: dict[str, Any] | None = None
    while True:
        reply = r.wire.parse(data)
        first = reply.usage if rounds == 0 else first
        add_usage(usage, reply.usage)
        decision = decide(reply.calls, r.tools, rounds, r.max_rounds)
        if decision.step is not Step.ANSWER:
            break
        results = [await r.runner.run(c) for c in decision.mine]
        before += [reply.message, *results]
        convo += [reply.message, *results]
        rounds += 1
        data = await parsed(await (await r.again(convo, rounds)).read(r.max_answer))
    out = r.wire.client_json(data, decision, usage, r.tools)
    return out, await _finish(r, reply, decision, before, client_message(reply, decision), usage,
                              reply.id, first)


def _decided(rnd: StreamRound, r: Rounds, rounds: int) -> tuple[Reply, Decision]:
    """A round's reply, and what to do with its calls."""
    reply = rnd.reply()
    return reply, decide(reply.calls, r.tools, rounds, r.max_rounds)


def _closed(rnd: StreamRound, relay: StreamRelay, reply: Reply, decision: Decision
            ) -> tuple[list[bytes], Message]:
    """A round's last events, and the answer as the client was shown it."""
    return rnd.close(decision), relay.shown(client_message(reply, decision))


async def answer_stream(r: Rounds, resp: UpstreamResponse, request: dict[str, Any],
                        done: Callable[[Outcome], None]) -> AsyncIterator[bytes]:
    """A streamed answer rewritten for the client, the proxy's rounds run inline; ``done``
    gets the outcome once the client has the whole answer. A stream that stops before its
    answer ends raises (the caller sends the client an error event, never a made-up end)."""
    relay = r.wire.relay(request)
    usage: dict[str, Any] = {}
    convo = list(r.window)
    before: list[Message] = []
    rounds = 0
    first: dict[str, Any] | None = None
    while True:
        rnd = relay.round(r.tools)
        decoder = SSEDecoder(r.max_answer)
        streamed = 0
        try:
            async for raw in resp.iter_chunks():
                streamed += len(raw)
                outs = await events(decoder, raw, rnd.feed)
                if outs:  # what one upstream chunk makes, sent as one piece: a chunk of
                    yield b"".join(outs)  # 20,000 calls is 60,000 events for a Messages client
            for ev in decoder.flush():
                for out in rnd.feed(ev):
                    yield out
        finally:
            resp.close()
        if not rnd.complete:
            raise UpstreamBadReply("the upstream's stream ended before its answer did")
        large = is_large(streamed)  # what is left of a large answer's walks, off the loop
        reply, decision = await offload(large, functools.partial(_decided, rnd, r, rounds))
        first = reply.usage if rounds == 0 else first
        add_usage(usage, reply.usage)
        if decision.step is Step.ANSWER:
            results = [await r.runner.run(c) for c in decision.mine]
            before += [reply.message, *results]
            convo += [reply.message, *results]
            rounds += 1
            resp = await r.again(convo, rounds)
            continue
        closing, shown = await offload(large, functools.partial(_closed, rnd, relay, reply,
                                                                decision))
        for out in closing:
            yield out
        break
    # the proxy's part of a mixed answer is run before the stream's last events: a client
    # that closes its connection on [DONE] (the openai SDK does) would cancel it, and the
    # turn would go unrecorded
    outcome = await _finish(r, reply, decision, before, shown, usage, relay.answer_id, first)
    for out in relay.end(usage):
        yield out
    done(outcome)
