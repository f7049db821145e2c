"""Forward and relay: one upstream call, timed; the answer back to the client — as it came, or
(when the proxy's tools went out with the request) with the proxy's rounds answered and hidden.
Errors pass through with their status; a stream is counted once it ends, however it ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import orjson

from ..conversation.identity import Session, SessionKind
from ..conversation.messages import Message
from ..errors import (
    PermissionDenied,
    Unavailable,
    UpstreamBadReply,
    UpstreamError,
    UpstreamKeyRefused,
    UpstreamTooLarge,
)
from ..ops import logs
from ..state import AppState
from .accounting import CLIENT_CLOSED, RequestLog, prompt_usage
from .memory import Carried, Found
from .offload import events, is_large, offload
from .reconcile import record
from .shadowing import shadow_after
from .sse import SSEDecoder, SSEEvent
from .toolloop import Outcome, Rounds, answer_json, answer_stream
from .tools import MAX_CALLS, ProxyTools, ToolRunner
from .upstream import UpstreamResponse, json_headers
from .values import Answer, Caller, History, Outgoing, Turn
from .wire import Reply, Wire

log = logs.get("relay")
# server history: an answer ends only once its turn is in Redis, waiting at most this long
# (then it ends saying so); every replica reads the session from Redis, and the client may
# send the next turn to any of them the moment it has this answer
DURABLE_WAIT_S = 2.0
# how long an answer's end waits for its anchors to be in Redis (one round trip)
ANNOUNCE_WAIT_S = 1.0
# what a stream says, before its end, when its server-history turn is not in Redis yet
# (an SSE comment: the SDKs skip it; the turn is queued and written when Redis takes it)
NOT_STORED_EVENT = b": X-Runloop-Degraded: history (this turn is not stored yet)\n\n"


async def forward(state: AppState, turn: Turn, body: bytes | dict[str, Any],
                  rlog: RequestLog, suffix: str = "") -> UpstreamResponse:
    """One upstream call, timed (the client's headers, less hop-by-hop and the proxy's own).
    Every call of a conversation endpoint goes through here, so here a caller whose upstream
    key other tenants use too is refused what names that account's stored objects (their
    listing is refused in the pass-through, ``routes.stateless``; naming one by its id is
    the other way to them)."""
    if turn.caller.shared_key:
        refuse_stored(await offload(turn.large, lambda: turn.stored_references))
    payload = body if isinstance(body, bytes) else orjson.dumps(body)
    headers = json_headers(turn.caller.upstream_headers(turn.headers))
    started = rlog.upstream_started()
    try:
        return await turn.caller.client(state.upstreams).request(
            "POST", turn.wire.upstream_path + suffix, headers, payload,
            holder=turn.caller.holder)
    finally:
        rlog.upstream_took(started)


async def read(state: AppState, resp: UpstreamResponse, rlog: RequestLog) -> bytes:
    started = time.perf_counter()
    try:
        raw = await resp.read(state.config.server.max_answer_bytes, keep=True)
        rlog.at_end(resp.held.release)  # held until the request is done with it
        return raw
    finally:
        rlog.upstream_took(started)


async def relay(state: AppState, turn: Turn, session: Session, history: History,
                out: Outgoing, resp: UpstreamResponse,
                rlog: RequestLog) -> Answer:
    """The upstream's answer to the client: as it came, or (when the proxy's tools went out)
    with the proxy's rounds answered and hidden. Errors pass through with their status; a
    large answer passes through as it arrives, never held whole."""
    headers = response_headers(turn.caller, resp, session, rlog)
    refuse_held_key(turn.caller, resp)
    if resp.status >= 400:
        status, raw = turn.wire.upstream_error(resp.status, await read(state, resp, rlog))
        rlog.finish(status)
        return Answer(status, headers, raw)
    if turn.stream:
        return Answer(resp.status, headers,
                      stream=_streamed(state, turn, session, history, out, resp, rlog))
    if out.tools is None and not turn.wire.translates:
        size = resp.body_size  # unknown for a compressed answer: streamed, never inflated whole
        if size is None or is_large(size):
            return Answer(resp.status, headers,
                          stream=_passed_through(state, turn, session, history, resp, rlog))
        raw = await read(state, resp, rlog)
        reply = _parsed_reply(turn.wire, raw)
        if not await _answered(state, turn, session, history, rlog, reply, False):
            headers["X-Runloop-Degraded"] = "history"
        shadow_after(state, turn, history, out, rlog, reply.message if reply else None)
        rlog.finish(resp.status)
        return Answer(resp.status, headers, raw)
    raw = await read(state, resp, rlog)
    rounds = _rounds(state, turn, session, history, out, rlog)
    try:
        data, outcome = await answer_json(rounds, raw)
    finally:
        _count_calls(state, turn, rounds)
    if rounds.runner.memory_failed is not None:
        headers.setdefault("X-Runloop-Degraded", "memory")
    _calibrate(state, turn, rlog, outcome.first)
    rlog.usage(outcome.usage)
    if not await kept(state, turn, session, history, lambda told: record(
            state, turn, session, history, outcome.shown, outcome.kept,
            answer_id=outcome.id, tokens=rlog.prompt_tokens, prompts=rlog.prompts,
            frame=rlog.frame, usage=rlog.billed, chain=outcome.chain, announced=told)):
        headers["X-Runloop-Degraded"] = "history"
    shadow_after(state, turn, history, out, rlog, outcome.shown)
    rlog.finish(200)
    return Answer(200, headers, orjson.dumps(data))


async def _answered(state: AppState, turn: Turn, session: Session, history: History,
                    rlog: RequestLog, reply: Reply | None, large: bool) -> bool:
    """An answer relayed unchanged: learn from its usage and record it (``kept``)."""
    _calibrate(state, turn, rlog, reply.usage if reply else None)
    rlog.usage(reply.usage if reply else None)
    return await kept(state, turn, session, history, lambda told: record(
        state, turn, session, history, reply.message if reply else None, None, large,
        reply.id if reply else None, rlog.prompt_tokens, rlog.frame, usage=rlog.billed,
        prompts=rlog.prompts, announced=told))


def announces(turn: Turn, session: Session) -> bool:
    """Whether this turn's answer ends only once Redis holds its anchors (``kept``): its
    session is fingerprinted (a client trimming its history finds it by its reply), or its
    response may be chained on."""
    return session.kind is SessionKind.FINGERPRINT or (
        turn.wire.api == "responses" and turn.body.get("store") is not False)


def durable(turn: Turn, history: History) -> bool:
    """Whether this turn's answer ends only once the turn is in Redis: server history, whose
    conversation lives in Redis alone (any replica may serve its next turn, and a replica
    killed after the answer must not have lost it)."""
    return turn.server_history and history.appended is not None and not history.degraded


def held_to_record(turn: Turn, session: Session, history: History) -> bool:
    """Whether the answer's last piece waits for its record (``kept``): the turn's write
    (``durable``) or its anchors (``announces``), so the answer is not whole at the client
    before Redis holds what its next request, to any replica, needs."""
    return durable(turn, history) or announces(turn, session)


async def kept(state: AppState, turn: Turn, session: Session, history: History,
               recording: Callable[[asyncio.Future[bool]], Coroutine[Any, Any, None]]
               ) -> bool:
    """Record a turn (``reconcile.record``): behind the answer — after its anchors are in
    Redis (at most ANNOUNCE_WAIT_S: a request the client sends the moment it has the answer,
    to any replica, finds its session by them) — or, for server history (``durable``),
    before its end: the answer waits (at most DURABLE_WAIT_S) until Redis holds the turn.
    False when it does not yet: Redis refusing writes or slow (the turn stays queued and is
    written when Redis takes it); the caller's answer says so. The recording runs on if the
    client goes away meanwhile (the upstream answered: the turn is kept)."""
    announced: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    task = state.spawn(recording(announced))
    store, ns = state.store, turn.caller.namespace
    if store is None or ns is None:
        return True
    if not durable(turn, history):
        try:
            async with asyncio.timeout(ANNOUNCE_WAIT_S):
                if await asyncio.shield(announced):
                    return True
        except TimeoutError:
            pass
        state.metrics.degraded.labels(turn.caller.label, "history").inc()
        log.warning("session anchors not in Redis before the answer ended: a request sent "
                    "to another replica at once may begin a session of its own",
                    extra={"tenant": turn.caller.tenant.name, "session": session.id})
        return False
    try:
        async with asyncio.timeout(DURABLE_WAIT_S):
            await asyncio.shield(task)  # the turn queued (``record`` catches what it raises)
        if not store.refusing_writes and \
                await store.written(ns, session.id, DURABLE_WAIT_S):
            return True
    except TimeoutError:
        pass
    state.metrics.degraded.labels(turn.caller.label, "history").inc()
    log.warning("server-history turn not stored before its answer ended: queued, written "
                "when Redis takes it", extra={"tenant": turn.caller.tenant.name,
                                               "session": session.id})
    return False


async def _passed_through(state: AppState, turn: Turn, session: Session, history: History,
                          resp: UpstreamResponse, rlog: RequestLog) -> AsyncIterator[bytes]:
    """A large JSON answer, relayed as it arrives; kept for the record only as far as the
    store would keep it (beyond, it is relayed and not recorded: a log line says so)."""
    status = resp.status
    limit = state.config.store.max_message_bytes
    held: list[bytes] = []
    size = 0
    last: bytes | None = None
    behind = held_to_record(turn, session, history)
    try:
        async for chunk in resp.iter_chunks():
            if not behind:
                yield chunk
            elif last is not None:
                yield last
            last = chunk
            size += len(chunk)
            if size <= limit:
                held.append(chunk)
        if size > limit:
            _too_large_to_record(state, turn, size)
        else:
            raw = b"".join(held)
            reply = await offload(is_large(size), lambda: _parsed_reply(turn.wire, raw))
            await _answered(state, turn, session, history, rlog, reply, is_large(size))
        if behind and last is not None:
            yield last  # (a JSON body: a note of its own cannot go in it)
    except UpstreamError as exc:
        # the connection broke mid-answer: the client's body must end cut, never as whole
        status = exc.status
        log.warning("upstream failed mid-answer", extra={"tenant": turn.caller.tenant.name,
                                                         "error": exc.log_text})
        raise
    except (GeneratorExit, asyncio.CancelledError):
        status = CLIENT_CLOSED
        raise
    finally:
        resp.close()
        rlog.finish(status)


def _too_large_to_record(state: AppState, turn: Turn, size: int | None = None) -> None:
    log.warning("answer too large to record: relayed, not stored",
                extra={"tenant": turn.caller.tenant.name, "bytes": size})
    state.metrics.store_errors.labels("too_large").inc()


def refuse_stored(references: list[str]) -> None:
    """A request of a caller whose upstream key other tenants use too that names what the
    account stores (``references``): refused before anything is sent."""
    if references:
        shown = sorted(set(references))
        raise PermissionDenied(
            f"this tenant's upstream key is other tenants' too, so the proxy sends nothing that "
            f"names what that account stores ({', '.join(shown[:8])}"
            f"{', ...' if len(shown) > 8 else ''}); give the tenant its own upstream_key to "
            f"use them")


def refuse_held_key(caller: Caller, resp: UpstreamResponse) -> None:
    """An upstream's 401 or 403 to the key the proxy holds for a tenant, as the proxy's
    502: the client's own key was good, so it is not told otherwise (every answer the
    proxy relays goes through this: the APIs' and the pass-through endpoints')."""
    if resp.status in (401, 403) and caller.proxy_key:
        resp.close()
        raise UpstreamKeyRefused(resp.status)


def response_headers(caller: Caller, resp: UpstreamResponse, session: Session,
                     rlog: RequestLog) -> dict[str, str]:
    return {**dict(caller.answer_headers(resp)), **proxy_headers(session, rlog)}


def proxy_headers(session: Session, rlog: RequestLog) -> dict[str, str]:
    """What the proxy tells a client of every answer it makes, whatever the API: the
    session, whether it served it degraded (and why), the prompt's tokens as sent and as
    forwarded."""
    headers = {"X-Session-Id": session.header_value}
    if rlog.degraded:
        headers["X-Runloop-Degraded"] = rlog.degraded
    if rlog.prompt_tokens is not None:
        headers["X-Runloop-Tokens"] = "{};{}".format(*rlog.prompt_tokens)
    return headers


def _rounds(state: AppState, turn: Turn, session: Session, history: History, out: Outgoing,
            rlog: RequestLog) -> Rounds:
    """The rounds of an answer the proxy rewrites: its tools went out, or the upstream speaks
    another API (then, without its tools, an answer is one round, translated)."""
    assert isinstance(out.body, dict)
    tools = out.tools or ProxyTools.none()
    store, ns = state.store, turn.caller.namespace
    named = session.reaches_store and store is not None and ns is not None \
        and not history.degraded
    runner = ToolRunner(
        tools, out.conversation, out.keys, turn.policy.search_results,
        # the session's other branches: only where the client named the session itself
        branches=(lambda: store.all_messages(ns, session.id)) if named else None,  # type: ignore[union-attr,arg-type]
        branch_results=(lambda cid: store.tool_results(ns, session.id, cid))  # type: ignore[union-attr,arg-type]
        if named else None,
        # each of the up to MAX_CALLS calls reads the request's conversation: charged so
        large=turn.large or history.large or is_large(MAX_CALLS * len(turn.raw)),
        memory=_memory(state, turn, session, history, out.keys), **_room(state, turn, out))

    async def send(body: dict[str, Any]) -> UpstreamResponse:
        return await forward(state, turn, body, rlog)

    return Rounds(turn.wire, tools, out.body,
                  out.window.messages if out.window else out.conversation, runner,
                  turn.policy.max_tool_rounds, send, state.config.server.max_answer_bytes,
                  turn.large or history.large)


def _room(state: AppState, turn: Turn, out: Outgoing) -> dict[str, Any]:
    """What a known window leaves for the proxy's rounds, and how they count it: a guessed
    window is not a reason to cut a recalled result (the upstream says its limit)."""
    budget = out.window.budget if out.window is not None else None
    if budget is None or not budget.known:
        return {}
    enc, _ = state.tokens.encoding(turn.model, turn.caller.tenant.encoding_for(turn.model))
    return {"room": max(budget.hard - out.window.tokens_out, 0),  # type: ignore[union-attr]
            "count": lambda text: state.tokens.text(enc, text)}


def _memory(state: AppState, turn: Turn, session: Session, history: History,
            keys: list[str]) -> Callable[[str, list[Message]], Awaitable[Found]] | None:
    """Long-term memory's search by meaning for this request's tools (policy.memory): the
    session's vectors of what the request carries."""
    if turn.policy.memory == "off":
        return None
    store, ns = state.store, turn.caller.namespace
    usable = store if ns is not None and history.degraded != "store" else None

    cut: list[Carried] = []  # the request's segments, cut once for all its searches
    model = state.memory_model(turn)

    async def search(query: str, messages: list[Message]) -> Found:
        if not cut:
            cut.append(await state.memory.carried(ns or "", session.id, messages, keys))
        return await state.memory.search(usable, ns or "", session.id, query, cut[0],
                                         model=model)

    return search


def _count_calls(state: AppState, turn: Turn, rounds: Rounds) -> None:
    """The proxy's calls this request answered, by tool and outcome; a search that answered
    by words alone, its meaning unavailable, said as every degradation is (a log line, a
    metric; the header where the answer's headers are still to be sent)."""
    for tool, outcome in rounds.runner.outcomes:
        state.metrics.recalls.labels(turn.caller.label, tool, outcome).inc()
    why = rounds.runner.memory_failed
    if why is not None:
        state.metrics.memory.labels(turn.caller.label, "search", "words_only").inc()
        state.metrics.degraded.labels(turn.caller.label, "memory").inc()
        log.warning("memory: search by words alone", extra={
            "tenant": turn.caller.tenant.name, "error": why})


def _parsed_reply(wire: Wire, raw: bytes) -> Reply | None:
    """The answer relayed unchanged, read for the record (what cannot be read is not)."""
    try:
        return wire.parse(orjson.loads(raw))
    except (orjson.JSONDecodeError, UpstreamError):
        return None


def _calibrate(state: AppState, turn: Turn, rlog: RequestLog,
               usage: dict[str, Any] | None) -> None:
    """Learn a model's token factor from its upstream's usage of the first call (when counted
    with a fallback encoding, and the prompt was the one the proxy counted)."""
    if not usage or rlog.prompt_tokens is None or turn.chained:
        return  # a chained request's prompt is mostly upstream's: the proxy counted its part
    _, exact = state.tokens.encoding(turn.model, turn.caller.tenant.encoding_for(turn.model))
    reported, _ = prompt_usage(usage)
    if not exact and reported:
        state.tokens.calibrate(turn.model, rlog.prompt_tokens[1], reported,
                               turn.caller.scope)


async def _streamed(state: AppState, turn: Turn, session: Session, history: History,
                    out: Outgoing, resp: UpstreamResponse,
                    rlog: RequestLog) -> AsyncIterator[bytes]:
    """The stream for the client; counted once it ends, however it ends."""
    status = 200
    outcomes: list[Outcome] = []
    relay = turn.wire.relay(turn.body)
    # the piece held back until the turn's write (``behind``): a stream cut after it still
    # gets it, before the error event, as an answer not held back would have
    last: bytes | None = None
    try:
        if out.tools is None and not turn.wire.translates:
            limit = state.config.store.max_message_bytes
            observer = turn.wire.observer(limit)
            decoder: SSEDecoder | None = SSEDecoder(limit)  # read to record, as it passes

            def observe(ev: SSEEvent) -> tuple[()]:
                observer.feed(ev)
                return ()

            behind = held_to_record(turn, session, history)
            recorded = False
            async for chunk in resp.iter_chunks():
                rlog.first_byte()
                if not behind:
                    yield chunk
                if decoder is not None:
                    try:
                        await events(decoder, chunk, observe)
                    except UpstreamTooLarge:
                        decoder = None  # an event past what the store keeps: relayed only
                        _too_large_to_record(state, turn)
                if behind:
                    # server history: the chunk that ends the answer goes to the client
                    # once its turn is in Redis (or with a note that it is not yet)
                    if decoder is not None and not recorded and observer.ended \
                            and observer.failure is None:
                        for ev in decoder.flush():
                            observer.feed(ev)
                        recorded = True
                        reply = observer.reply()
                        if not await _answered(state, turn, session, history, rlog,
                                               reply, False):
                            yield NOT_STORED_EVENT
                        shadow_after(state, turn, history, out, rlog,
                                     reply.message if reply else None)
                    yield chunk
            if recorded:
                pass
            elif decoder is not None:
                for ev in decoder.flush():
                    observer.feed(ev)
                if observer.failure is not None:
                    # the upstream's error event reached the client as it came (its SDK
                    # raises it); the fragment before it is no answer: nothing recorded
                    status = observer.failure.status
                    log.warning("upstream failed mid-stream: relayed, not recorded", extra={
                        "tenant": turn.caller.tenant.name,
                        "error": observer.failure.log_text})
                elif not observer.ended:
                    raise UpstreamBadReply("the upstream's stream ended before its answer did")
                else:
                    reply = observer.reply()
                    if not await _answered(state, turn, session, history, rlog, reply, False):
                        yield NOT_STORED_EVENT
                    shadow_after(state, turn, history, out, rlog,
                                 reply.message if reply else None)
        else:
            rounds = _rounds(state, turn, session, history, out, rlog)
            # each piece goes one behind, so the last (the answer's end) waits for the record
            behind = held_to_record(turn, session, history)
            try:
                async for piece in answer_stream(rounds, resp, turn.body, outcomes.append):
                    rlog.first_byte()
                    if not behind:
                        yield piece
                        continue
                    if last is not None:
                        yield last
                    last = piece
            finally:
                _count_calls(state, turn, rounds)
            _calibrate(state, turn, rlog, outcomes[0].first)
            rlog.usage(outcomes[0].usage)
            if not await kept(state, turn, session, history, lambda told: record(
                    state, turn, session, history, outcomes[0].shown, outcomes[0].kept,
                    answer_id=outcomes[0].id, tokens=rlog.prompt_tokens,
                    prompts=rlog.prompts, frame=rlog.frame, usage=rlog.billed,
                    chain=outcomes[0].chain, announced=told)):
                yield NOT_STORED_EVENT
            shadow_after(state, turn, history, out, rlog, outcomes[0].shown)
            if last is not None:
                piece, last = last, None
                yield piece
    except UpstreamError as exc:
        status = exc.status
        log.warning("upstream failed mid-stream", extra={"tenant": turn.caller.tenant.name,
                                                         "error": exc.log_text})
        if last is not None:
            yield last
        yield relay.error(exc)
    except Unavailable as exc:  # a round's call past its tenant's share: said, not a crash
        status = exc.status
        log.warning("request refused mid-stream", extra={"tenant": turn.caller.tenant.name,
                                                         "error": exc.log_text})
        if last is not None:
            yield last
        yield relay.error(exc)
    except (GeneratorExit, asyncio.CancelledError):
        status = CLIENT_CLOSED  # the client went away: the relay was cancelled
        raise
    except Exception as exc:  # noqa: BLE001 - the client gets an error event, not a cut stream
        status = 500
        log.exception("stream failed", extra={"tenant": turn.caller.tenant.name})
        if last is not None:
            yield last
        yield relay.error(exc)
    finally:
        resp.close()
        rlog.finish(status)
