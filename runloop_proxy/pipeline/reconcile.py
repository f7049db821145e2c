"""The history side of a turn: line the request up with what the store holds (reconcile), and
write the turn once the upstream has answered it (record). Nothing is written before that: a
request the upstream refuses leaves no trace. Everything here fails open — except server-history
mode, where the client does not hold its conversation and a window without it would be wrong."""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from typing import Any

import orjson

from ..conversation.identity import (
    NAMED_PREFIXES,
    Session,
    SessionKind,
    anchor,
    anchors,
    chained_key,
    continued,
)
from ..conversation.items import to_items
from ..conversation.messages import Message, content_hash
from ..conversation.runloops import preamble_end
from ..errors import Conflict, InvalidRequest, StoreError, StoreUnavailable
from ..history.store import Prepared, RedisStore, prepare
from ..ops import logs
from ..savings import Prompt
from ..state import AppState
from .accounting import RequestLog
from .framing import Frame
from .offload import answer_is_large, is_large, offload
from .values import History, Recent, Turn

log = logs.get("reconcile")
# a trimmed history continues the stored conversation it lines up with only when that one
# holds at most this many messages more than the request carries, four for each it
# carries: reading, matching and storing what the client no longer sends is the stored
# conversation's work, and a request of a few hundred bytes must not buy much more of it
CONTINUED_FLOOR = 512
CONTINUED_PER_MESSAGE = 4
# server-history mode reads the conversation it forwards from Redis: a turn still queued to
# be written (Redis refusing writes, or the next request sent the moment an answer arrived)
# is waited for this long, then the request fails closed (503) rather than go without it;
# a trimmed history waits as long for the turn it continues (then goes on without it)
WRITTEN_WAIT_S = 2.0
# how often a trimmed history that came to another replica than the one writing the turn it
# continues looks again whether that turn is in Redis (within WRITTEN_WAIT_S)
ANNOUNCED_POLL_S = 0.02


def counted(state: AppState, turn: Turn, messages: list[Message],
            prepared: list[Prepared] | None = None, reply: bool = False) -> list[Prepared]:
    """Messages hashed, canonicalised and counted (the counts are cached by hash, so the
    window's own counting costs nothing more, and the store keeps them)."""
    enc, _ = state.tokens.encoding(turn.model, turn.caller.tenant.encoding_for(turn.model))
    items = prepared if prepared is not None else [prepare(m, reply=reply) for m in messages]
    return [p._replace(tokens=state.tokens.message(enc, m, p.hash), encoding=enc.name)
            for m, p in zip(messages, items, strict=True)]


async def _counted(state: AppState, turn: Turn, messages: list[Message],
                   prepared: list[Prepared] | None = None) -> list[Prepared]:
    return await offload(turn.large, lambda: counted(state, turn, messages, prepared))


def _counted_held(state: AppState, turn: Turn, messages: list[Message],
                  prepared: list[Prepared]) -> tuple[list[Prepared], int]:
    """``counted``, with the bytes the counted messages will hold in ``state.recent``."""
    out = counted(state, turn, messages, prepared)
    return out, sum(map(held_bytes, out))


def _known(state: AppState, turn: Turn, session: Session) -> Recent | None:
    """The session's last request, when this one starts with exactly its messages (one
    comparison of the two lists, in C): then only what is new is hashed and counted."""
    recent = state.recent.get((turn.caller.namespace or "", session.id))
    if recent is None:
        return None
    n = len(recent.messages)
    enc, _ = state.tokens.encoding(turn.model, turn.caller.tenant.encoding_for(turn.model))
    if recent.encoding != enc.name or len(turn.messages) < n \
            or turn.messages[:n] != recent.messages:
        return None
    return recent


def _remember(state: AppState, turn: Turn, session: Session, prepared: list[Prepared],
              known: Recent | None, held: int) -> None:
    """The request's messages, for the session's next request (``held``: the bytes of
    those not known already)."""
    if not prepared:
        return
    size = (known.size if known is not None else 0) + held
    state.recent[(turn.caller.namespace or "", session.id)] = Recent(
        turn.messages, prepared, prepared[-1].encoding, size)


def held_bytes(p: Prepared) -> int:
    """What a message kept in ``state.recent`` holds: the parsed message (a dict per object
    of its JSON, ~250 bytes each beyond their text), its stored form, hashes and count —
    within a quarter of tracemalloc's figure for tiny messages, tool results and calls."""
    return 2 * len(p.body) + 450 + 250 * p.body.count(b"{")


async def reconcile(state: AppState, turn: Turn, session: Session, rlog: RequestLog
                    ) -> tuple[Session, History]:
    """The session the turn belongs to (a trimmed history continues the session it came
    from) and what the store holds for it. A stored conversation that makes the turn's work
    large (server-history mode, a trimmed history continued) holds one of its tenant's
    ``server.large_requests`` before that work is done, as a large body does."""
    messages = turn.messages
    ns, store = turn.caller.namespace, state.store
    if turn.server_history and turn.wire.api != "chat":
        raise InvalidRequest("server-history mode (X-Runloop-History: server) is for chat "
                             "completions: a Responses conversation continues upstream with "
                             "previous_response_id, and a Messages client sends its whole "
                             "conversation")
    if turn.server_history and ns is None:
        raise InvalidRequest("server-history mode needs an API key: the history is kept per "
                             "key, and a request without one has none")
    if turn.server_history and not session.reaches_store:
        # the stored conversation goes to the model: only a session the client named may
        # reach it (a fingerprint of the new messages could be anyone's)
        raise InvalidRequest("server-history mode needs a named session (the X-Session-Id "
                             "header or metadata.session_id): the proxy supplies the stored "
                             "conversation, and only a session you named can reach it")
    known = None if turn.server_history else _known(state, turn, session)
    k = len(known.prepared) if known is not None else 0
    new, largest = await offload(turn.large, lambda: _prepared(messages[k:]))
    hashed = [*known.prepared, *new] if known is not None else new

    async def counted_all() -> list[Prepared]:
        fresh, held = await offload(turn.large, lambda: _counted_held(
            state, turn, messages[k:], new))
        out = [*known.prepared, *fresh] if known is not None else fresh
        _remember(state, turn, session, out, known, held)
        return out

    # an earlier request of the session ended where this one's messages were its, and its
    # answer comes next: the points up to there were windowed (and recorded) then
    new_from = len(known.messages) + 1 if known is not None else None
    if store is None or ns is None:
        return session, History(messages, await counted_all(), new_from=new_from)
    try:
        if not store.available:
            raise StoreError("store marked down")
        if turn.chained:
            return await _chained(state, turn, session, store, ns, hashed)
        if turn.server_history:
            history = await _server_history(state, turn, session, store, ns, hashed, rlog)
            store.check_limits(len(history.prepared), largest)
            return session, history
        store.check_limits(len(hashed), largest)
        internal = store.cached_internal(ns, session.id)
        earlier: list[Message] = []
        large = turn.large
        if internal is None:
            session, earlier, large = await _continuation(state, turn, session, store, ns,
                                                          rlog)
            enc, _ = state.tokens.encoding(turn.model,
                                           turn.caller.tenant.encoding_for(turn.model))
            loaded = await store.load(ns, session.id, [p.hash for p in hashed], enc.name,
                                      large)

            def primed() -> None:  # an entry each: off the loop for a large session
                state.tokens.prime(enc, loaded.counts)
                _known_dates(state, ns, session.id, loaded.dates)

            await offload(large, primed)
            internal = loaded.internal
            if new_from is None:
                new_from = loaded.stored
        earlier_prepared = await offload(large, lambda: counted(state, turn, earlier))
        return session, History(messages, await counted_all(), internal,
                                earlier=earlier, earlier_prepared=earlier_prepared,
                                earlier_at=preamble_end(messages), new_from=new_from,
                                large=large)
    except StoreError as exc:
        if turn.server_history:
            raise StoreUnavailable(
                "the history store is unavailable, and in server-history mode the "
                "conversation lives there: retry shortly",
                retry_after=state.config.store.retry_after_s) from exc
        log.warning("store unavailable: passing through uncompressed",
                    extra={"tenant": turn.caller.tenant.name, "error": str(exc)})
        return session, History(messages, await counted_all(), degraded="store")


def _known_dates(state: AppState, ns: str, session_id: str, dates: dict[str, int]) -> None:
    """The session's loop dates as Redis keeps them, into this replica's (the earlier of
    the two wins: a loop is as old as the first request that opened it)."""
    scope = f"{ns}\0{session_id}"
    for name, ms in dates.items():
        key = f"{scope}\0{name}"
        held = state.first_seen.get(key)
        if held is None or ms < held:
            state.first_seen[key] = ms


async def _server_history(state: AppState, turn: Turn, session: Session, store: RedisStore,
                          ns: str, hashed: list[Prepared], rlog: RequestLog) -> History:
    """The stored conversation with the new messages after it (a system prompt the request
    sends stands in for the stored one this turn)."""
    messages = turn.messages
    if not await store.written(ns, session.id, WRITTEN_WAIT_S):
        raise StoreError("an earlier turn of this session is not stored yet")
    if store.lost(ns, session.id):
        # what Redis holds of this conversation has a gap for good: going on from it would
        # send the model the conversation without that turn, saying nothing
        raise Conflict("a turn of this session could not be stored (Redis refused it past "
                       "the retry time, or the store's limits), so the stored conversation "
                       "is missing it: send the conversation yourself (X-Runloop-History: "
                       "client) or start a new session", param="X-Session-Id")
    head, size = await store.head_sized(ns, session.id)
    stored = [m for _, m in head]
    system = preamble_end(messages)
    full = [*messages[:system], *stored[preamble_end(stored):], *messages[system:]] \
        if system else [*stored, *messages]
    internal = store.cached_internal(ns, session.id)
    if internal is None:
        internal = (await store.load(ns, session.id, [], "")).internal
    # the work this turn brings is the stored conversation's as well as the request's
    large = turn.large or is_large(size + len(turn.raw), len(full))
    if large:
        rlog.hold(state.large, turn.caller.holder)
    counted_full = await offload(large, lambda: counted(state, turn, full))
    return History(full, counted_full, internal,
                   appended=(await _counted(state, turn, messages, hashed), system),
                   new_from=len(full) - len(messages) + system, large=large)


def unrecorded(state: AppState, turn: Turn, history: History) -> str | None:
    """Why the request is served degraded: the store's reason (``History.degraded``), else
    ``history`` while Redis refuses the history's writes — the answer is whole and
    compressed, but its turn waits unwritten (counted and logged, as every degraded one)."""
    if history.degraded is not None:
        return history.degraded
    store = state.store
    if store is None or turn.caller.namespace is None or not store.refusing_writes:
        return None
    state.metrics.degraded.labels(turn.caller.label, "history").inc()
    log.warning("history not being stored: Redis refuses writes (they wait and are retried)",
                extra={"tenant": turn.caller.tenant.name})
    return "history"


def response_anchor(response_id: str) -> str:
    return content_hash(f"response\0{response_id}".encode())


def response_alias(response_id: str) -> str:
    """Where the id a request must chain on in place of ``response_id`` is kept."""
    return content_hash(f"response-alias\0{response_id}".encode())


def response_owed(response_id: str) -> str:
    """Where the outputs of the proxy's calls in ``response_id`` are kept: an answer that
    mixed the client's calls with the proxy's shows the client its own, and a request that
    chains on it answers only those."""
    return content_hash(f"response-owed\0{response_id}".encode())


async def _chained(state: AppState, turn: Turn, session: Session, store: RedisStore, ns: str,
                   hashed: list[Prepared]) -> tuple[Session, History]:
    """A request chained on ``previous_response_id``: the conversation is upstream. It joins
    the session its previous response was recorded in, and appends what it adds — unless
    that session is a named one: a response id is no name for it (anyone shown the id could
    then write into it and be shown its name), so the chain goes on in a session of its own."""
    assert turn.chained is not None
    # a streamed answer the proxy's tools took rounds over showed the client its first
    # round's id (a stream's identity cannot change), stored upstream with the proxy's call
    # unanswered: the chain goes on from the last round's, which holds the whole turn
    chain_to = await store.anchored(ns, response_alias(turn.chained))
    owed_raw = await store.anchored(ns, response_owed(turn.chained))
    owed = orjson.loads(owed_raw) if owed_raw else []
    if session.kind is SessionKind.FINGERPRINT:
        found = await store.anchored(ns, response_anchor(turn.chained))
        if found is not None and found.startswith(NAMED_PREFIXES):
            found = None  # anchored by an earlier version: named sessions set none now
        key = found or chained_key(turn.chained)
        session = Session(key, SessionKind.CHAINED, "previous_response_id", label=key)
    prepared = await _counted(state, turn, turn.messages, hashed)
    return session, History(turn.messages, prepared, appended=(prepared, 0),
                            chain_to=chain_to, owed=owed if isinstance(owed, list) else [])


async def _continuation(state: AppState, turn: Turn, session: Session, store: RedisStore,
                        ns: str, rlog: RequestLog) -> tuple[Session, list[Message], bool]:
    """A fingerprinted request its fingerprint does not know, carrying replies recorded in
    another session of the namespace: a client that trimmed its history (or restarted it
    under a new system prompt). It is *stored* in that session when its messages line up with
    it (what it no longer sends is stored before it: ``History.earlier``); it reads nothing
    of it — its label stays its own fingerprint, and the window and the proxy's tools see
    only what the request carries. Anyone who knows a reply can forge such a line-up.

    What it costs — the stored conversation read, matched and stored again with the turn
    (and a fork copied inside Redis) — is the stored conversation's size, not the request's:
    a conversation more than ``CONTINUED_PER_MESSAGE`` times the request's messages (plus
    ``CONTINUED_FLOOR``) is not continued (its length is read first, one field), and what is
    read is worked on off the event loop when large. Also whether the turn is large now."""
    large = turn.large
    if session.kind is not SessionKind.FINGERPRINT:
        return session, [], large
    keys = anchors(turn.messages, session.scope)
    if not keys:
        return session, [], large
    other = await store.continuation(ns, session.id, keys)
    if other is None or other == session.id:
        return session, [], large
    # its last turn may still be on its way to Redis (the anchor is in Redis, or noted
    # here, before the answer ended; the turn is written behind it): the request lines up
    # with the conversation only once that turn is there — waited for here when this replica
    # writes it, and while one announced it (``RedisStore.announce``) when another does
    deadline = time.monotonic() + WRITTEN_WAIT_S
    if not store.refusing_writes:
        await store.written(ns, other, WRITTEN_WAIT_S)
    read, holding = -1, False
    while True:
        held = await store.head_length(ns, other)
        if held > CONTINUED_FLOOR + CONTINUED_PER_MESSAGE * len(turn.messages):
            log.info("trimmed history not continued: the stored conversation outweighs it",
                     extra={"tenant": turn.caller.tenant.name, "session": other,
                            "messages": len(turn.messages), "stored": held})
            return session, [], large
        if held != read:
            read = held
            head, size = await store.head_sized(ns, other)
            large = large or is_large(size, len(head))
            if large and not holding:
                rlog.hold(state.large, turn.caller.holder)
                holding = True
            stored = [m for _, m in head]
            at = await offload(large, functools.partial(continued, stored, turn.messages))
            if at is not None:
                break
        if store.refusing_writes or time.monotonic() >= deadline \
                or not await store.announced(ns, other):
            return session, [], large
        await asyncio.sleep(ANNOUNCED_POLL_S)
    log.info("trimmed history continues its session", extra={
        "tenant": turn.caller.tenant.name, "session": other, "earlier": at})
    return (Session(other, SessionKind.FINGERPRINT, "continuation", session.scope,
                    label=session.label),
            stored[preamble_end(stored):at], large)


def _prepared(messages: list[Message]) -> tuple[list[Prepared], int]:
    """The messages prepared, and the bytes of the largest (the store's limit reads it)."""
    new = [prepare(m) for m in messages]
    return new, max((len(p.body) for p in new), default=0)


async def record(state: AppState, turn: Turn, session: Session, history: History,
                 reply: Message | None, kept: dict[str, Any] | None,
                 large: bool = False, answer_id: str | None = None,
                 tokens: tuple[int, int] | None = None,
                 frame: dict[str, Any] | None = None, chain: str | None = None,
                 usage: dict[str, Any] | None = None,
                 prompts: tuple[Prompt, Prompt] | None = None,
                 announced: asyncio.Future[bool] | None = None) -> None:
    """After a 2xx, off the request path: add the client's side of the turn and the answer it
    got to the session's history (written behind), the proxy's part of the turn to splice
    back next time, and for a fingerprinted session an anchor that finds it again from its
    reply. ``large``: the answer is counted off the event loop. ``chain``: the upstream id a
    request chaining on ``answer_id`` must go on from (``toolloop.Outcome.chain``).
    ``usage``: the upstream's bill for the request (``accounting.billed``), kept with its
    point; ``prompts``: its prompts as blocks (``framing.prompts_of``), what the point says
    they share with the session's last ones (the headline's facts, ``savings``).
    ``announced``: told, before anything else here waits, whether Redis holds the answer's
    anchors (``RedisStore.announce``): the answer ends after that (``relay.kept``)."""
    store, ns = state.store, turn.caller.namespace
    try:
        if store is None or ns is None or history.degraded == "store":
            return
        # outstanding from the first step, before anything here waits (a large answer is
        # counted in a thread): a server-history request that comes the moment this answer
        # arrives waits for this turn (``_server_history``), where it read Redis before the
        # turn was queued
        store.reserve(ns, session.id)
        try:
            await _record(state, turn, session, history, store, ns, reply, kept, large,
                          answer_id, tokens, frame, chain, usage, prompts, announced)
        finally:
            store.release(ns, session.id)
    finally:
        if announced is not None and not announced.done():
            announced.set_result(True)  # nothing to announce (or nothing recorded)


async def _record(state: AppState, turn: Turn, session: Session, history: History,
                  store: RedisStore, ns: str, reply: Message | None,
                  kept: dict[str, Any] | None, large: bool, answer_id: str | None,
                  tokens: tuple[int, int] | None, frame: dict[str, Any] | None,
                  chain: str | None, usage: dict[str, Any] | None,
                  prompts: tuple[Prompt, Prompt] | None,
                  announced: asyncio.Future[bool] | None) -> None:
    # what a request sent the moment this answer arrives looks its session up by, to this
    # replica or another: noted here and written to Redis before anything else here waits
    # (the answer ends once Redis holds them, ``relay.kept``). A client that trims its
    # history sends the reply and none of what the session was fingerprinted by; a client
    # chaining on a response sends its id
    found: list[tuple[str, str]] = []
    if reply is not None and session.kind is SessionKind.FINGERPRINT:
        reply_anchor = anchor(reply, session.scope)
        if reply_anchor is not None:
            found.append((reply_anchor, session.id))
    chainable = answer_id is not None and turn.wire.api == "responses" \
        and turn.body.get("store") is not False
    if chainable and chain is not None:
        found.append((response_alias(str(answer_id)), chain))
    if chainable and kept is not None and kept.get("after"):
        # the answer mixed the proxy's calls with the client's: the client answers its own
        # when it chains on it, and the proxy's outputs go with them (the upstream wants all)
        found.append((response_owed(str(answer_id)),
                      orjson.dumps(to_items(kept["after"])[1]).decode()))
    if chainable and not session.explicit:
        # a named session is found only by its name
        found.append((response_anchor(str(answer_id)), session.id))
    for key, value in found:
        store.note_anchor(ns, key, value)
    token = secrets.token_hex(8) if found else None
    if token is not None:
        told = await _announce(store, ns, session.id, found,
                               turn.caller.tenant.retention_days, token)
        if announced is not None and not announced.done():
            announced.set_result(told)
    large = large or answer_is_large(reply)  # every path's answer, weighed here
    answer = await offload(large, lambda: counted(state, turn, [reply], reply=True)) \
        if reply is not None else []
    conversation = [*history.to_store(), *answer]
    if reply is not None and answer:
        state.summaries.replied(ns, session.id, reply, answer[0].hash)
    if kept is not None and reply is not None:
        # the reply, in the lineage the request carries (what the next request's window
        # splices by: never what it trimmed, see shaping._chains_at)
        at = store.chains(ns, session.id, [*history.prepared, *answer])[-1]
        store.writing_internal(ns, session.id, at, kept)  # known before the write's task runs
        state.spawn(_keep_internal(store, ns, session.id, at, kept,
                                   turn.caller.tenant.retention_days))
    retention = turn.caller.tenant.retention_days
    # the prompt as sent and as forwarded (the inspector's chart), written with the turn,
    # and what the inspector rebuilds its window from: the messages it carried, its frame
    facts = state.compared(ns, session.id, prompts) if tokens is not None else {}
    point = {"ts": int(time.time() * 1000), "client": tokens[0], "forwarded": tokens[1],
             **facts, **request_point(state, turn, history, frame),
             **({"usage": usage} if usage else {})} if tokens is not None else None
    if point is not None and tokens is not None:  # the dashboard's headline, as the point's
        state.bill(ns, session.id, turn.caller.label, str(point.get("model") or ""), tokens,
                   point["ts"] / 1000, facts)
    size = 0
    if (turn.large or history.large) and history.appended is None:
        # a conversation's chain hashes are made once and then grown: a large new one's are
        # made here, off the event loop, for the job below to find (and its size measured)
        size = await offload(True, lambda: store.prepared(ns, session.id, conversation))
    try:
        if history.appended is not None:
            new, system = history.appended
            store.submit_append(ns, session.id, [*new, *answer], retention, system, point)
        else:
            store.submit(ns, session.id, conversation, retention, point, size)
    except StoreError as exc:
        log.warning("history not stored", extra={"tenant": turn.caller.tenant.name,
                                                 "error": str(exc)})
        return
    if token is not None:
        state.spawn(_landed(store, ns, session.id, token))
    if reply is not None and turn.policy.memory != "off":
        # the loops this answer closed, into long-term memory (in the background)
        state.memory.after_answer(store, turn.caller.label, ns, session.id,
                                  [*history.messages, reply], retention,
                                  state.memory_model(turn))


def request_point(state: AppState, turn: Turn, history: History,
                  frame: dict[str, Any] | None) -> dict[str, Any]:
    """What a request's point keeps besides its token counts: how many messages of the
    stored conversation it carried (and where the ones it trimmed sit among them), and the
    frame its window was built in (``framing.Frame``, taken then: the answer may have
    recalibrated the model since) — or that it chained on a response upstream."""
    if frame is None:
        frame = Frame.of(state, turn.caller.tenant, turn.body, turn.chat_tools,
                         turn.caller.scope, turn.long_context).point()
    out: dict[str, Any] = {"messages": len(history.messages), **frame}
    if history.earlier:
        out["earlier"] = [history.earlier_at, len(history.earlier)]
    if turn.chained:
        out["chained"] = True
    return out


async def _keep_internal(store: RedisStore, namespace: str, session_id: str, at: str,
                         kept: dict[str, Any], retention: float | None) -> None:
    try:
        await store.add_internal(namespace, session_id, at, kept, retention)
    except StoreError as exc:
        log.warning("proxy tool exchange not stored", extra={"error": str(exc)})


async def _announce(store: RedisStore, namespace: str, session_id: str,
                    found: list[tuple[str, str]], retention: float | None,
                    token: str) -> bool:
    """An answer's anchors into Redis (kept as long as the tenant's sessions are), and its
    session's write announced until it lands (``_landed``), at most for as long as a request
    continuing it waits for that write (``_continuation``). False when Redis did not take
    them (the answer says so)."""
    try:
        await store.announce(namespace, session_id, found, retention,
                             int(WRITTEN_WAIT_S * 1000), token)
    except StoreError as exc:
        log.warning("session anchors not stored", extra={"error": str(exc),
                                                        "session": session_id})
        return False
    return True


async def _landed(store: RedisStore, namespace: str, session_id: str, token: str) -> None:
    """Once this replica's writes of the session are in Redis, its announcement of them
    (``token``) ends: a request to another replica whose messages do not line up with the
    session stops waiting then, not when the announcement expires (WRITTEN_WAIT_S later)."""
    if await store.written(namespace, session_id, WRITTEN_WAIT_S):
        await store.unannounce(namespace, session_id, token)
