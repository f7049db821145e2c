"""One request through the proxy, stage by stage, whatever API it came in by:

    identify → reconcile → window → forward → relay → record

An adapter (``api/chat.py``, ``api/responses.py``) hands over a ``Turn``: the request in the
conversation model, plus the ``Wire`` that speaks its API. Each stage takes what the ones before
produced and returns a value of its own; only the ``RequestLog`` (timings, tokens, outcome) is
filled in along the way. Everything that touches Redis fails open: the request goes through
uncompressed and says so (``X-Runloop-Degraded``, a log line, a metric).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..config import TenantSpec
from ..conversation.identity import Session, identify
from ..conversation.messages import Message, message_hash
from ..conversation.runloops import preamble_end
from ..errors import ContextLengthExceeded, StoreError, UpstreamError
from ..history.store import Prepared, prepare
from ..ops import logs
from ..state import AppState
from ..window.builder import Window, build_window
from ..window.forms import Budget
from .accounting import CLIENT_CLOSED, RequestLog
from .sse import SSEDecoder
from .tokens import REPLY_PRIMING, WindowTokens
from .toolloop import Outcome, Rounds, answer_json, answer_stream
from .tools import ProxyTools, ToolRunner, definitions_tokens, splice_internal
from .upstream import UpstreamResponse, json_headers, upstream_headers
from .wire import Reply, Wire

log = logs.get("turn")
FIRST_SEEN_SIZE = 200_000
PRIME_FROM = 8  # below this many messages, counting is cheaper than a round trip


@dataclass(frozen=True)
class Caller:
    """Who is calling, as authentication found it."""

    tenant: TenantSpec
    label: str  # the metric label: the tenant's name, or "passthrough"
    namespace: str | None  # where its history lives; None: none is kept (no key to scope it)
    upstream_auth: str | None  # the Authorization header the upstream gets


@dataclass(frozen=True)
class Turn:
    """One client request in the conversation model."""

    caller: Caller
    wire: Wire
    body: dict[str, Any]
    raw: bytes
    messages: list[Message]
    headers: list[tuple[str, str]]
    server_history: bool = False

    @property
    def model(self) -> str:
        return str(self.body["model"])

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def policy(self) -> Any:
        return self.caller.tenant.policy


@dataclass(frozen=True)
class History:
    """What reconcile found: the conversation the window works on, what record stores for the
    client's side of the turn, and the proxy's tool exchanges stored for the session."""

    messages: list[Message]
    prepared: list[Prepared]
    internal: dict[str, Any] = field(default_factory=dict)
    degraded: str | None = None


@dataclass(frozen=True)
class Answer:
    """What the client gets: a body, or a stream of bytes (counted once it ends)."""

    status: int
    headers: dict[str, str]
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None


@dataclass(frozen=True)
class Outgoing:
    """What goes upstream: the body, and when it is a window, the window and its parts."""

    body: bytes | dict[str, Any]
    tools: ProxyTools | None = None  # the proxy's tools, when they went out with it
    window: Window | None = None
    conversation: list[Message] = field(default_factory=list)  # what it was built from
    keys: list[str] = field(default_factory=list)


async def serve(state: AppState, turn: Turn, rlog: RequestLog) -> Answer:
    session = identify(turn.headers, turn.body, turn.messages, turn.caller.namespace or "",
                       state.config.server.session_header)
    rlog.session = session.id
    history = await reconcile(state, turn, session)
    rlog.degraded = history.degraded
    out = shape(state, turn, session, history, rlog)
    resp = await forward(state, turn, out.body, rlog)
    return await relay(state, turn, session, history, out, resp, rlog)


# -- reconcile -------------------------------------------------------------------------------

def counted(state: AppState, turn: Turn, messages: list[Message],
            prepared: list[Prepared] | None = None) -> list[Prepared]:
    """Messages hashed, canonicalised and counted (the counts are cached by hash, so the
    window's own counting costs nothing more, and the store keeps them)."""
    enc, _ = state.tokens.encoding(turn.model, turn.caller.tenant.encoding_for(turn.model))
    items = prepared if prepared is not None else [prepare(m) for m in messages]
    return [p._replace(tokens=state.tokens.message(enc, m, p.hash), encoding=enc.name)
            for m, p in zip(messages, items, strict=True)]


async def reconcile(state: AppState, turn: Turn, session: Session) -> History:
    """Line the request up with the stored history; fail open when the store is down."""
    messages = turn.messages
    ns = turn.caller.namespace
    store = state.store
    hashed = [prepare(m) for m in messages]
    if store is None or ns is None:
        return History(messages, counted(state, turn, messages, hashed))
    if not store.available:
        return History(messages, counted(state, turn, messages, hashed), degraded="store")
    if len(messages) > PRIME_FROM and not turn.server_history:
        await _prime_counts(state, turn, session, [p.hash for p in hashed])
    prepared = counted(state, turn, messages, hashed)
    try:
        if turn.server_history:
            system = preamble_end(messages)
            stored = await store.append(ns, session.id, prepared,
                                        turn.caller.tenant.retention_days, system=system)
            # this turn's system prompt, if it sent one, stands in for the stored one
            full = [*messages[:system], *stored[preamble_end(stored):]] if system else stored
            return History(full, counted(state, turn, full))
        internal = store.cached_internal(ns, session.id)
        if internal is None:
            # First sight of this session on this replica: reconcile before the window, which
            # needs the proxy's stored tool exchanges. Warm sessions reconcile write-behind,
            # after the reply (see record).
            internal = (await store.sync(ns, session.id, prepared,
                                         turn.caller.tenant.retention_days)).internal
        return History(messages, prepared, internal)
    except StoreError as exc:
        log.warning("store unavailable: passing through uncompressed",
                    extra={"tenant": turn.caller.tenant.name, "error": str(exc)})
        return History(messages, prepared, degraded="store")


async def _prime_counts(state: AppState, turn: Turn, session: Session,
                        hashes: list[str]) -> None:
    """A replica that has not seen this session reads its stored token counts first."""
    store, ns = state.store, turn.caller.namespace
    if store is None or ns is None or store.cached_internal(ns, session.id) is not None:
        return
    enc, _ = state.tokens.encoding(turn.model, turn.caller.tenant.encoding_for(turn.model))
    try:
        counts = await store.token_counts(ns, session.id, hashes, enc.name)
    except StoreError:
        return  # the sync right after says whether the store is really down
    state.tokens.prime(enc, counts)


# -- window ----------------------------------------------------------------------------------

def shape(state: AppState, turn: Turn, session: Session, history: History,
          rlog: RequestLog) -> Outgoing:
    """The body that goes upstream: the client's, byte for byte, unless a window changes it."""
    as_sent = _as_sent(turn, history)
    if history.degraded:
        state.metrics.degraded.labels(turn.caller.label, history.degraded).inc()
        return Outgoing(as_sent)
    if not turn.policy.enabled:
        return Outgoing(as_sent)
    keys = [p.hash for p in history.prepared]
    spliced, spliced_keys, protected = splice_internal(history.messages, keys, history.internal)
    tools = ProxyTools.for_request(turn.body.get("tools"))
    try:
        window = compute_window(state, turn, spliced, spliced_keys, protected, tools)
    except Exception:  # noqa: BLE001 - a window bug must not cost the user this call
        log.exception("window failed: passing the request through uncompressed",
                      extra={"tenant": turn.caller.tenant.name, "session": session.id})
        rlog.degraded = "window"
        state.metrics.degraded.labels(turn.caller.label, "window").inc()
        return Outgoing(as_sent)
    tl, ml = turn.caller.label, state.metrics.model_label(turn.model)
    for event in window.events:
        state.metrics.compactions.labels(tl, ml, event.kind.value).inc()
    if not window.fits:
        state.metrics.rejections.labels(tl, ml).inc()
        log_events(state, turn, session, window)
        raise ContextLengthExceeded(
            f"This conversation needs {window.tokens_out} prompt tokens after compression, "
            f"more than the {turn.caller.tenant.context_window(turn.model)}-token context of "
            f"{turn.model} allows with the requested output. Shorten the latest messages or "
            f"tool results.", param="messages")
    if any(e.kind.value == "hard_truncation" for e in window.events):
        state.metrics.truncations.labels(tl, ml).inc()
    offer = window.offers_tools(turn.policy, bool(turn.body.get("tools"))) \
        or spliced is not history.messages
    with_tools = offer and (turn.body.get("n") or 1) == 1
    rlog.prompt_tokens = prompt_tokens(state, turn, window, with_tools)
    if not (window.changed or offer or turn.server_history):
        return Outgoing(as_sent)
    extra = turn.wire.tool_definitions(tools) if with_tools else []
    body = turn.wire.outgoing(turn.body, window.messages, extra)
    log_events(state, turn, session, window)
    return Outgoing(body, tools if with_tools else None, window, spliced, spliced_keys)


def _as_sent(turn: Turn, history: History) -> bytes | dict[str, Any]:
    """The request as the client sent it; in server-history mode, with the stored history."""
    if turn.server_history and not history.degraded:
        return turn.wire.outgoing(turn.body, history.messages, [])
    return turn.raw


def compute_window(state: AppState, turn: Turn, messages: list[Message], keys: list[str],
                   protected: frozenset[str], tools: ProxyTools) -> Window:
    tenant = turn.caller.tenant
    enc, exact = state.tokens.encoding(turn.model, tenant.encoding_for(turn.model))
    factor = 1.0 if exact else state.tokens.factor(turn.model)
    counts = [state.tokens.message(enc, m, k) for m, k in zip(messages, keys, strict=True)]
    b = turn.body
    budget = Budget.for_request(
        turn.policy, tenant.context_window(turn.model),
        b.get("max_completion_tokens") or b.get("max_tokens") or b.get("max_output_tokens"),
        state.tokens.tools(enc, b.get("tools")) + _proxy_tools_tokens(state, enc), factor,
        REPLY_PRIMING)
    now = int(time.time() * 1000)
    return build_window(messages, keys, counts, turn.policy, budget,
                        WindowTokens(state.tokens, enc, state.truncations), protected=protected,
                        timestamps=first_seen(state.first_seen, keys, now), now_ms=now,
                        memo=state.window_memo, tool_names=tools.window_names)


def prompt_tokens(state: AppState, turn: Turn, window: Window,
                  with_proxy_tools: bool) -> tuple[int, int]:
    """The whole prompt as the proxy counts it, as the client sent it and as it goes
    upstream: messages, tool schemas (the proxy's own when it adds them), reply priming."""
    enc, _ = state.tokens.encoding(turn.model, turn.caller.tenant.encoding_for(turn.model))
    fixed = state.tokens.tools(enc, turn.body.get("tools")) + REPLY_PRIMING
    extra = _proxy_tools_tokens(state, enc) if with_proxy_tools else 0
    return window.tokens_in + fixed, window.tokens_out + fixed + extra


def _proxy_tools_tokens(state: AppState, enc: Any) -> int:
    n = state.window_memo.get(("proxy-tools", enc.name))
    if n is None:
        n = state.window_memo[("proxy-tools", enc.name)] = definitions_tokens(state.tokens, enc)
    return int(n)


def first_seen(seen: dict[str, int], keys: list[str], now: int) -> list[int | None]:
    """When this replica first saw each message (for max_time_range); new ones: now."""
    out: list[int | None] = []
    for k in keys:
        t = seen.get(k)
        if t is None:
            t = seen[k] = now
            if len(seen) > FIRST_SEEN_SIZE:
                seen.pop(next(iter(seen)))
        out.append(t)
    return out


def log_events(state: AppState, turn: Turn, session: Session, window: Window) -> None:
    for event in window.events:
        record = {"ts": int(time.time() * 1000), "kind": event.kind.value,
                  "reason": event.reason, "tokens_before": event.tokens_before,
                  "tokens_after": event.tokens_after, "messages_before": len(turn.messages),
                  "messages_after": len(window.messages), "elided": len(window.elided),
                  "reduced_loops": window.reduced_loops, "omitted_loops": window.omitted_loops}
        log.info("compaction", extra={"tenant": turn.caller.tenant.name, "model": turn.model,
                                      "session": session.id, **record})
        if state.store is not None and turn.caller.namespace is not None:
            state.spawn(_store_record(state, turn.caller.namespace, session.id, record))


async def _store_record(state: AppState, namespace: str, session_id: str,
                        record: dict[str, Any]) -> None:
    assert state.store is not None
    try:
        await state.store.add_record(namespace, session_id, record)
    except StoreError as exc:
        log.warning("compression record not stored", extra={"error": str(exc)})


# -- forward ---------------------------------------------------------------------------------

async def forward(state: AppState, turn: Turn, body: bytes | dict[str, Any],
                  rlog: RequestLog) -> UpstreamResponse:
    """One upstream call, timed (the client's headers, less hop-by-hop and the proxy's own)."""
    payload = body if isinstance(body, bytes) else orjson.dumps(body)
    headers = json_headers(upstream_headers(turn.headers, turn.caller.upstream_auth))
    started = rlog.upstream_started()
    try:
        return await state.upstream(turn.caller.tenant.upstream).request(
            "POST", turn.wire.upstream_path, headers, payload)
    finally:
        rlog.upstream_took(started)


async def read(resp: UpstreamResponse, rlog: RequestLog) -> bytes:
    started = time.perf_counter()
    try:
        return await resp.read()
    finally:
        rlog.upstream_took(started)


# -- relay -----------------------------------------------------------------------------------

async def relay(state: AppState, turn: Turn, session: Session, history: History,
                out: Outgoing, resp: UpstreamResponse,
                rlog: RequestLog) -> Answer:
    """The upstream's answer to the client: as it came, or (when the proxy's tools went out)
    with the proxy's rounds answered and hidden. Errors pass through with their status."""
    headers = response_headers(resp, session, rlog)
    if resp.status >= 400:
        raw = await read(resp, rlog)
        rlog.finish(resp.status)
        return Answer(resp.status, headers, raw)
    if turn.stream:
        return Answer(resp.status, headers,
                      stream=_streamed(state, turn, session, history, out, resp, rlog))
    raw = await read(resp, rlog)
    if out.tools is None:
        reply = _parsed_reply(turn.wire, raw)
        _calibrate(state, turn, rlog, reply)
        rlog.usage(reply.usage if reply else None)
        record(state, turn, session, history, reply.message if reply else None, None)
        rlog.finish(resp.status)
        return Answer(resp.status, headers, raw)
    data, outcome = await answer_json(_rounds(state, turn, session, out, rlog), raw)
    rlog.usage(outcome.usage)
    record(state, turn, session, history, outcome.shown, outcome.kept)
    rlog.finish(200)
    return Answer(200, headers, orjson.dumps(data))


def response_headers(resp: UpstreamResponse, session: Session,
                     rlog: RequestLog) -> dict[str, str]:
    headers = dict(resp.forward_headers())
    headers["X-Session-Id"] = session.header_value
    if rlog.degraded:
        headers["X-Runloop-Degraded"] = rlog.degraded
    if rlog.prompt_tokens is not None:
        headers["X-Runloop-Tokens"] = "{};{}".format(*rlog.prompt_tokens)
    return headers


def _rounds(state: AppState, turn: Turn, session: Session, out: Outgoing,
            rlog: RequestLog) -> Rounds:
    assert out.tools is not None and isinstance(out.body, dict)
    runner = ToolRunner(out.tools, out.conversation, out.keys, state.store,
                        turn.caller.namespace or "", session.id, turn.policy.search_results)

    async def send(body: dict[str, Any]) -> UpstreamResponse:
        return await forward(state, turn, body, rlog)

    return Rounds(turn.wire, out.tools, out.body,
                  out.window.messages if out.window else out.conversation, runner,
                  turn.policy.max_tool_rounds, send)


def _parsed_reply(wire: Wire, raw: bytes) -> Reply | None:
    """The answer relayed unchanged, read for the record (what cannot be read is not)."""
    try:
        return wire.parse(orjson.loads(raw))
    except (orjson.JSONDecodeError, UpstreamError):
        return None


def _calibrate(state: AppState, turn: Turn, rlog: RequestLog, reply: Reply | None) -> None:
    """Learn a model's token factor from its upstream's usage (when counted with a fallback
    encoding, and the prompt was the one the proxy counted)."""
    if reply is None or not reply.usage or rlog.prompt_tokens is None:
        return
    _, exact = state.tokens.encoding(turn.model, turn.caller.tenant.encoding_for(turn.model))
    reported = reply.usage.get("prompt_tokens", reply.usage.get("input_tokens"))
    if not exact and isinstance(reported, int):
        state.tokens.calibrate(turn.model, rlog.prompt_tokens[1], reported)


async def _streamed(state: AppState, turn: Turn, session: Session, history: History,
                    out: Outgoing, resp: UpstreamResponse,
                    rlog: RequestLog) -> AsyncIterator[bytes]:
    """The stream for the client; counted once it ends, however it ends."""
    status = 200
    outcomes: list[Outcome] = []
    relay = turn.wire.relay(turn.body)
    try:
        if out.tools is None:
            observer = turn.wire.observer()
            decoder = SSEDecoder()
            async for chunk in resp.iter_chunks():
                rlog.first_byte()
                yield chunk
                for ev in decoder.feed(chunk):
                    observer.feed(ev)
            for ev in decoder.flush():
                observer.feed(ev)
            reply = observer.reply()
            rlog.usage(reply.usage if reply else None)
            record(state, turn, session, history, reply.message if reply else None, None)
        else:
            rounds = _rounds(state, turn, session, out, rlog)
            async for piece in answer_stream(rounds, resp, turn.body, outcomes.append):
                rlog.first_byte()
                yield piece
            rlog.usage(outcomes[0].usage)
            record(state, turn, session, history, outcomes[0].shown, outcomes[0].kept)
    except UpstreamError as exc:
        status = exc.status
        log.warning("upstream failed mid-stream", extra={"tenant": turn.caller.tenant.name,
                                                         "error": str(exc)})
        yield relay.error(exc)
    except GeneratorExit:
        status = CLIENT_CLOSED  # the client went away: the relay was cancelled
        raise
    except Exception as exc:  # noqa: BLE001 - the client gets an error event, not a cut stream
        status = 500
        log.exception("stream failed", extra={"tenant": turn.caller.tenant.name})
        yield relay.error(exc)
    finally:
        resp.close()
        rlog.finish(status)


# -- record ----------------------------------------------------------------------------------

def record(state: AppState, turn: Turn, session: Session, history: History,
           reply: Message | None, kept: dict[str, Any] | None) -> None:
    """Add the client's side of the turn and the answer it got to the session's history
    (write-behind), and the proxy's part of the turn, to splice back next time."""
    store, ns = state.store, turn.caller.namespace
    if store is None or ns is None or history.degraded == "store":
        return
    if kept is not None and reply is not None:
        state.spawn(_keep_internal(state, ns, session.id, reply, kept))
    if turn.server_history:
        if reply is not None:
            state.spawn(_append_reply(state, turn, session, reply))
        return
    items = [*history.prepared, *counted(state, turn, [reply])] if reply is not None \
        else history.prepared
    store.submit(ns, session.id, items, turn.caller.tenant.retention_days)


async def _append_reply(state: AppState, turn: Turn, session: Session, reply: Message) -> None:
    assert state.store is not None and turn.caller.namespace is not None
    try:
        await state.store.append(turn.caller.namespace, session.id,
                                 counted(state, turn, [reply]),
                                 turn.caller.tenant.retention_days)
    except StoreError as exc:
        log.warning("reply not recorded", extra={"tenant": turn.caller.tenant.name,
                                                 "error": str(exc)})


async def _keep_internal(state: AppState, namespace: str, session_id: str, shown: Message,
                         kept: dict[str, Any]) -> None:
    assert state.store is not None
    try:
        await state.store.add_internal(namespace, session_id, message_hash(shown), kept)
    except StoreError as exc:
        log.warning("proxy tool exchange not stored", extra={"error": str(exc)})
