"""One chat-completions request, end to end: session, reconcile, window, upstream, record.
Routes hand a validated request here; everything that talks to Redis fails open. The proxy's
tool rounds are in toolloop.py, the request's bookkeeping in exchange.py."""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson
import tiktoken
from starlette.responses import Response

from . import logs
from .errors import ContextLengthExceeded, StoreError, UpstreamError
from .exchange import (
    Exchange,
    call_upstream,
    clean,
    counted,
    finish,
    note_usage,
    prime_counts,
    record,
    record_raw,
    timed_read,
)
from .forms import Budget
from .messages import ChatRequest, Message, message_hash
from .responses import LiveStreamResponse
from .runloops import preamble_end
from .sse import SSEDecoder, encode_json
from .store import Prepared, prepare
from .streaming import StreamAccumulator
from .tokens import REPLY_PRIMING
from .toolloop import stream_tool_loop, tool_loop
from .tools import ProxyTools, definitions_tokens, splice_internal
from .upstream import UpstreamResponse
from .window import Window, build_window

if TYPE_CHECKING:
    from .app import AppState

log = logs.get("chat")
TRUNCATE_CACHE = 20_000
FIRST_SEEN_SIZE = 200_000
PRIME_FROM = 8  # below this many messages, counting is cheaper than a round trip
def resolve_session(header_value: str | None, body: ChatRequest, tenant_id: str) -> str:
    """Header, then prompt_cache_key, metadata.session_id, user; else a fingerprint of the
    tenant and the conversation's first non-system message."""
    if header_value:
        return header_value[:256]
    b: dict[str, Any] = body  # type: ignore[assignment]
    meta = b.get("metadata")
    for candidate in (b.get("prompt_cache_key"),
                      meta.get("session_id") if isinstance(meta, dict) else None,
                      b.get("user")):
        if isinstance(candidate, str) and candidate:
            return candidate[:256]
    first = next((m for m in body["messages"] if m.get("role") not in ("system", "developer")),
                 body["messages"][0])
    digest = hashlib.sha256(f"{tenant_id}\0{message_hash(first)}".encode()).hexdigest()
    return "fp-" + digest[:32]


class WindowTokens:
    """TokenOps backed by the shared counter, with a cache of head+tail truncations."""

    def __init__(self, state: AppState, enc: tiktoken.Encoding):
        self.state = state
        self.enc = enc
        self._truncs: OrderedDict[tuple[str, int], str] = state.truncations

    def count(self, msg: Message) -> int:
        return self.state.tokens.message(self.enc, msg)

    def truncate(self, text: str, max_tokens: int) -> str:
        if len(text) <= max_tokens:  # a token is at least one character
            return text
        key = (hashlib.blake2b(text.encode(), digest_size=16).hexdigest(), max_tokens)
        hit = self._truncs.get(key)
        if hit is not None:
            return hit
        ids = self.enc.encode_ordinary(text)
        if len(ids) <= max_tokens:
            out = text
        else:
            head = max_tokens * 2 // 3
            tail = max_tokens - head
            out = (self.enc.decode(ids[:head]) + f"\n…[runloop-proxy: {len(ids) - max_tokens} "
                   f"tokens elided here]…\n" + self.enc.decode(ids[-tail:]))
        self._truncs[key] = out
        if len(self._truncs) > TRUNCATE_CACHE:
            self._truncs.popitem(last=False)
        return out


async def handle_chat(ex: Exchange) -> Response | LiveStreamResponse:
    state = ex.state
    messages: list[Message] = ex.body["messages"]
    hashed = [prepare(m) for m in messages]
    if len(messages) > PRIME_FROM and not ex.server_history and state.store is not None \
            and state.store.available:
        await prime_counts(ex, [p.hash for p in hashed])
    prepared = counted(ex, messages, hashed)
    internal: dict[str, Any] = {}
    store = state.store
    if store is None or not store.available:
        ex.degraded = "store"
    else:
        try:
            if ex.server_history:
                system = preamble_end(messages)
                stored = await store.append(ex.tenant_id, ex.session_id, prepared,
                                            ex.tenant.retention_days, system=system)
                # this turn's system prompt, if it sent one, stands in for the stored one
                messages = [*messages[:system], *stored[preamble_end(stored):]] if system \
                    else stored
                prepared = counted(ex, messages)
                ex.body = {**ex.body, "messages": messages}
            else:
                cached = store.cached_internal(ex.tenant_id, ex.session_id)
                if cached is None:
                    # First sight of this session on this replica: reconcile before the window,
                    # which needs the proxy's stored tool exchanges. Warm sessions reconcile
                    # write-behind, after the reply (see record).
                    synced = await store.sync(ex.tenant_id, ex.session_id, prepared,
                                              ex.tenant.retention_days)
                    cached = synced.internal
                internal = cached
        except StoreError as exc:
            ex.degraded = "store"
            log.warning("store unavailable: passing through uncompressed",
                        extra={"tenant": ex.tenant.name, "error": str(exc)})
    if ex.degraded:
        state.metrics.degraded.labels(ex.tenant_label, "store").inc()
        return await forward(ex, ex.raw, messages, prepared)
    if not ex.tenant.policy.enabled:
        return await forward(ex, ex.raw, messages, prepared)

    keys = [p.hash for p in prepared]
    spliced, spliced_keys, protected = splice_internal(messages, keys, internal)
    tools = ProxyTools.for_request(ex.body.get("tools"))
    try:
        window = compute_window(ex, spliced, spliced_keys, protected, tools.window_names)
    except Exception:  # noqa: BLE001 - a window bug must not cost the user this call
        log.exception("window failed: passing the request through uncompressed",
                      extra={"tenant": ex.tenant.name, "session": ex.session_id})
        ex.degraded = "window"
        state.metrics.degraded.labels(ex.tenant_label, "window").inc()
        return await forward(ex, dict(ex.body) if ex.server_history else ex.raw, messages,
                             prepared)
    ex.window = window
    tl, ml = ex.labels()
    for event in window.events:
        state.metrics.compactions.labels(tl, ml, event.kind.value).inc()
    if not window.fits:
        state.metrics.rejections.labels(tl, ml).inc()
        log_events(ex, window)
        raise ContextLengthExceeded(
            f"This conversation needs {window.tokens_out} prompt tokens after compression, "
            f"more than the {ex.tenant.context_window(ex.model)}-token context of {ex.model} "
            f"allows with the requested output. Shorten the latest messages or tool results.",
            param="messages")
    if any(e.kind.value == "hard_truncation" for e in window.events):
        state.metrics.truncations.labels(tl, ml).inc()
    offer = window.offers_tools(ex.tenant.policy, bool(ex.body.get("tools"))) \
        or spliced is not messages
    with_tools = offer and (ex.body.get("n") or 1) == 1
    ex.prompt_tokens = prompt_tokens(ex, window, with_tools)
    if not (window.changed or offer or ex.server_history):
        return await forward(ex, ex.raw, messages, prepared)
    body: dict[str, Any] = {**ex.body, "messages": window.messages}
    if with_tools:
        ex.tools = tools
        body["tools"] = [*(body.get("tools") or []), *ex.tools.definitions()]
        if ex.stream:
            # the rewritten stream sums every round's usage; the client gets it if it asked
            body["stream_options"] = {**(body.get("stream_options") or {}),
                                      "include_usage": True}
    log_events(ex, window)
    return await forward(ex, body, messages, prepared, spliced, spliced_keys)


def compute_window(ex: Exchange, messages: list[Message], keys: list[str],
                   protected: frozenset[str], tool_names: tuple[str, str]) -> Window:
    state = ex.state
    enc, exact = state.tokens.encoding(ex.model, ex.tenant.encoding_for(ex.model))
    factor = 1.0 if exact else state.tokens.factor(ex.model)
    counts = [state.tokens.message(enc, m, k) for m, k in zip(messages, keys, strict=True)]
    b: dict[str, Any] = ex.body  # type: ignore[assignment]
    budget = Budget.for_request(
        ex.tenant.policy, ex.tenant.context_window(ex.model),
        b.get("max_completion_tokens") or b.get("max_tokens"),
        state.tokens.tools(enc, b.get("tools")) + _proxy_tools_tokens(state, enc), factor,
        REPLY_PRIMING)
    now = int(time.time() * 1000)
    return build_window(messages, keys, counts, ex.tenant.policy, budget,
                        WindowTokens(state, enc), protected=protected,
                        timestamps=first_seen(state.first_seen, keys, now), now_ms=now,
                        memo=state.window_memo, tool_names=tool_names)


def prompt_tokens(ex: Exchange, window: Window, with_proxy_tools: bool) -> tuple[int, int]:
    """The whole prompt as the proxy counts it, as the client sent it and as it goes
    upstream: messages, tool schemas (the proxy's own when it adds them), reply priming."""
    enc, _ = ex.state.tokens.encoding(ex.model, ex.tenant.encoding_for(ex.model))
    fixed = ex.state.tokens.tools(enc, ex.body.get("tools")) + REPLY_PRIMING
    extra = _proxy_tools_tokens(ex.state, enc) if with_proxy_tools else 0
    return window.tokens_in + fixed, window.tokens_out + fixed + extra


def _proxy_tools_tokens(state: AppState, enc: tiktoken.Encoding) -> int:
    n = state.window_memo.get(("proxy-tools", enc.name))
    if n is None:
        n = state.window_memo[("proxy-tools", enc.name)] = definitions_tokens(state.tokens, enc)
    return n


def first_seen(seen: OrderedDict[str, int], keys: list[str], now: int) -> list[int | None]:
    """When this replica first saw each message (for max_time_range); new ones: now."""
    out: list[int | None] = []
    for k in keys:
        t = seen.get(k)
        if t is None:
            t = seen[k] = now
            if len(seen) > FIRST_SEEN_SIZE:
                seen.popitem(last=False)
        out.append(t)
    return out


def log_events(ex: Exchange, window: Window) -> None:
    for event in window.events:
        record = {"ts": int(time.time() * 1000), "kind": event.kind.value,
                  "reason": event.reason, "tokens_before": event.tokens_before,
                  "tokens_after": event.tokens_after, "messages_before": len(ex.body["messages"]),
                  "messages_after": len(window.messages), "elided": len(window.elided),
                  "reduced_loops": window.reduced_loops, "omitted_loops": window.omitted_loops}
        log.info("compaction", extra={"tenant": ex.tenant.name, "model": ex.model,
                                      "session": ex.session_id, **record})
        if ex.state.store is not None:
            ex.state.spawn(_store_record(ex, record))


async def _store_record(ex: Exchange, record: dict[str, Any]) -> None:
    try:
        await ex.state.store.add_record(ex.tenant_id, ex.session_id, record)  # type: ignore[union-attr]
    except StoreError as exc:
        log.warning("compression record not stored", extra={"error": str(exc)})


async def forward(ex: Exchange, body: bytes | dict[str, Any], messages: list[Message],
                  prepared: list[Prepared], window_msgs: list[Message] | None = None,
                  window_keys: list[str] | None = None) -> Response | LiveStreamResponse:
    resp = await call_upstream(ex, body)
    headers = _response_headers(ex, resp)
    if resp.status >= 400:
        raw = await timed_read(ex, resp)
        record(ex, prepared, None)
        finish(ex, resp.status, None)
        return Response(raw, resp.status, headers=headers)
    if ex.stream:
        gen = _stream(ex, resp, body, messages, prepared, window_msgs or [], window_keys or [])
        return LiveStreamResponse(gen, resp.status, headers)
    raw = await timed_read(ex, resp)
    if ex.tools is None:
        data = record_raw(ex, raw, prepared)
        note_usage(ex, data.get("usage") if data else None)
        finish(ex, resp.status, None)
        return Response(raw, resp.status, headers=headers)
    data = await tool_loop(ex, raw, body, messages, prepared, window_msgs or [],
                            window_keys or [])
    finish(ex, 200, None)
    return Response(orjson.dumps(data), 200, headers=headers)


def _response_headers(ex: Exchange, resp: UpstreamResponse) -> dict[str, str]:
    headers = {k: v for k, v in resp.forward_headers()}
    headers["X-Session-Id"] = ex.session_id
    if ex.degraded:
        headers["X-Runloop-Degraded"] = ex.degraded
    if ex.prompt_tokens is not None:
        headers["X-Runloop-Tokens"] = "{};{}".format(*ex.prompt_tokens)
    return headers


async def _stream(ex: Exchange, resp: UpstreamResponse, body: bytes | dict[str, Any],
                  messages: list[Message], prepared: list[Prepared],
                  window_msgs: list[Message], window_keys: list[str]) -> AsyncIterator[bytes]:
    """Relay the upstream stream; with proxy tools, rewrite it and run the tool loop inline."""
    status = 200
    first = True
    try:
        if ex.tools is None:
            acc = StreamAccumulator()
            decoder = SSEDecoder()
            async for chunk in resp.iter_chunks():
                if first:
                    first = False
                    ex.bound().ttft.observe(
                        time.perf_counter() - ex.started)
                yield chunk
                _observe(decoder.feed(chunk), acc)
            _observe(decoder.flush(), acc)
            note_usage(ex, acc.usage)
            record(ex, prepared, clean(acc.message()))
        else:
            async for out in stream_tool_loop(ex, resp, body, window_msgs, window_keys,
                                               prepared):
                yield out
    except UpstreamError as exc:
        status = exc.status
        record(ex, prepared, None)
        log.warning("upstream failed mid-stream", extra={"tenant": ex.tenant.name,
                                                         "error": str(exc)})
        yield encode_json(exc.body())
    finally:
        resp.close()
        finish(ex, status, None)


def _observe(events: list[Any], acc: StreamAccumulator) -> None:
    for ev in events:
        if ev.is_done or not ev.data:
            continue
        try:
            acc.add(orjson.loads(ev.data))
        except orjson.JSONDecodeError:
            continue


