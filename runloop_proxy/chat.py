"""One chat-completions request, end to end: session, reconcile, window, upstream, tool loop,
record. Routes hand a validated request here; everything that talks to Redis fails open."""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
import tiktoken
from starlette.responses import Response

from . import logs
from .config import TenantSpec
from .errors import ContextLengthExceeded, StoreError, UpstreamError
from .messages import ChatRequest, Message, message_hash
from .metrics import BoundMetrics
from .responses import LiveStreamResponse
from .runloops import preamble_end
from .sse import DONE, SSEDecoder, encode_json
from .store import Prepared, prepare
from .streaming import ChunkRewriter, StreamAccumulator, add_usage
from .tokens import REPLY_PRIMING
from .tools import ProxyTools, ToolRunner, splice_internal
from .upstream import UpstreamClient, UpstreamResponse, json_headers, upstream_headers
from .window import Budget, Window, build_window

if TYPE_CHECKING:
    from .app import AppState

log = logs.get("chat")
HISTORY_HEADER = "x-runloop-history"
TRUNCATE_CACHE = 50_000
FIRST_SEEN_SIZE = 1_000_000


@dataclass
class Exchange:
    """Everything one request carries through the pipeline."""

    state: AppState
    tenant: TenantSpec
    tenant_label: str
    tenant_id: str
    body: ChatRequest
    raw: bytes
    client_headers: list[tuple[str, str]]
    authorization: str | None
    session_id: str
    server_history: bool
    started: float = field(default_factory=time.perf_counter)
    upstream_seconds: float = 0.0
    upstream_called_at: float | None = None
    degraded: str | None = None
    forked: bool = False
    window: Window | None = None
    tools: ProxyTools | None = None
    response_headers: dict[str, str] = field(default_factory=dict)

    @property
    def model(self) -> str:
        return self.body["model"]

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def upstream(self) -> UpstreamClient:
        return self.state.upstreams[self.tenant.upstream]

    def labels(self) -> tuple[str, str]:
        return self.tenant_label, self.state.metrics.model_label(self.model)

    def bound(self) -> BoundMetrics:
        return self.state.metrics.bound(*self.labels())


# -- sessions ----------------------------------------------------------------------------------

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


# -- token ops for the window -------------------------------------------------------------------

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


# -- the pipeline -------------------------------------------------------------------------------

async def handle_chat(ex: Exchange) -> Response | LiveStreamResponse:
    state = ex.state
    messages: list[Message] = ex.body["messages"]
    prepared = counted(ex, messages)
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
                    # write-behind, after the reply (see _record).
                    synced = await store.sync(ex.tenant_id, ex.session_id, prepared,
                                              ex.tenant.retention_days)
                    ex.forked = synced.forked
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
    window = compute_window(ex, spliced, spliced_keys, protected)
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
    changed = window.changed or spliced is not messages or ex.server_history
    if not changed:
        return await forward(ex, ex.raw, messages, prepared)
    body: dict[str, Any] = {**ex.body, "messages": window.messages}
    n_choices = body.get("n") or 1
    if window.needs_tools and n_choices == 1:
        ex.tools = ProxyTools.for_request(body.get("tools"))
        body["tools"] = [*(body.get("tools") or []), *ex.tools.definitions()]
    if ex.stream:
        opts = dict(body.get("stream_options") or {})
        opts["include_usage"] = True
        body["stream_options"] = opts
    log_events(ex, window)
    return await forward(ex, body, messages, prepared, spliced, spliced_keys)


def counted(ex: Exchange, messages: list[Message]) -> list[Prepared]:
    """Messages hashed, canonicalised and counted (the counts are cached by hash, so the
    window's own counting costs nothing more, and the store keeps them)."""
    enc, _ = ex.state.tokens.encoding(ex.model, ex.tenant.encoding_for(ex.model))
    out = []
    for m in messages:
        p = prepare(m)
        out.append(p._replace(tokens=ex.state.tokens.message(enc, m, p.hash)))
    return out


def compute_window(ex: Exchange, messages: list[Message], keys: list[str],
                   protected: frozenset[str]) -> Window:
    state = ex.state
    enc, exact = state.tokens.encoding(ex.model, ex.tenant.encoding_for(ex.model))
    factor = 1.0 if exact else state.tokens.factor(ex.model)
    counts = [state.tokens.message(enc, m, k) for m, k in zip(messages, keys, strict=True)]
    b: dict[str, Any] = ex.body  # type: ignore[assignment]
    budget = Budget.for_request(
        ex.tenant.policy, ex.tenant.context_window(ex.model),
        b.get("max_completion_tokens") or b.get("max_tokens"),
        state.tokens.tools(enc, b.get("tools")) + PROXY_TOOLS_TOKENS, factor, REPLY_PRIMING)
    now = int(time.time() * 1000)
    return build_window(messages, keys, counts, ex.tenant.policy, budget,
                        WindowTokens(state, enc), protected=protected,
                        timestamps=first_seen(state.first_seen, keys, now), now_ms=now,
                        memo=state.window_memo)


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


PROXY_TOOLS_TOKENS = 160


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


# -- upstream -----------------------------------------------------------------------------------

async def call_upstream(ex: Exchange, body: bytes | dict[str, Any]) -> UpstreamResponse:
    payload = body if isinstance(body, bytes) else orjson.dumps(body)
    headers = json_headers(upstream_headers(ex.client_headers, ex.authorization))
    started = time.perf_counter()
    if ex.upstream_called_at is None:
        ex.upstream_called_at = started
    try:
        return await ex.upstream.request("POST", "/chat/completions", headers, payload)
    finally:
        ex.upstream_seconds += time.perf_counter() - started


async def timed_read(ex: Exchange, resp: UpstreamResponse) -> bytes:
    started = time.perf_counter()
    try:
        return await resp.read()
    finally:
        ex.upstream_seconds += time.perf_counter() - started


async def forward(ex: Exchange, body: bytes | dict[str, Any], messages: list[Message],
                  prepared: list[Prepared], window_msgs: list[Message] | None = None,
                  window_keys: list[str] | None = None) -> Response | LiveStreamResponse:
    resp = await call_upstream(ex, body)
    headers = _response_headers(ex, resp)
    if resp.status >= 400:
        raw = await timed_read(ex, resp)
        _record(ex, prepared, None)
        finish(ex, resp.status, None)
        return Response(raw, resp.status, headers=headers)
    if ex.stream:
        gen = _stream(ex, resp, body, messages, prepared, window_msgs or [], window_keys or [])
        return LiveStreamResponse(gen, resp.status, headers)
    raw = await timed_read(ex, resp)
    if ex.tools is None:
        data = _record_raw(ex, raw, prepared)
        _note_usage_dict(ex, data.get("usage") if data else None)
        finish(ex, resp.status, None)
        return Response(raw, resp.status, headers=headers)
    data = await _tool_loop(ex, raw, body, messages, prepared, window_msgs or [],
                            window_keys or [])
    finish(ex, 200, None)
    return Response(orjson.dumps(data), 200, headers=headers)


def _response_headers(ex: Exchange, resp: UpstreamResponse) -> dict[str, str]:
    headers = {k: v for k, v in resp.forward_headers()}
    headers["X-Session-Id"] = ex.session_id
    if ex.degraded:
        headers["X-Runloop-Degraded"] = ex.degraded
    if ex.window is not None and ex.window.changed:
        headers["X-Runloop-Tokens"] = f"{ex.window.tokens_in};{ex.window.tokens_out}"
    return headers


async def _tool_loop(ex: Exchange, raw: bytes, body: bytes | dict[str, Any],
                     messages: list[Message], prepared: list[Prepared],
                     window_msgs: list[Message], window_keys: list[str]) -> dict[str, Any]:
    assert ex.tools is not None and isinstance(body, dict)
    data = orjson.loads(raw)
    usage: dict[str, Any] = {}
    add_usage(usage, data.get("usage"))
    runner = _runner(ex, window_msgs, window_keys)
    convo = list(body["messages"])
    exchange: list[Message] = []
    rounds = 0
    while True:
        msg = data["choices"][0]["message"]
        calls = msg.get("tool_calls") or []
        mine = [c for c in calls if ex.tools.owns(c)]
        theirs = [c for c in calls if not ex.tools.owns(c)]
        if not mine:
            break
        results = [await runner.run(c) for c in mine]
        full_assistant = _clean(msg)
        if theirs or rounds >= ex.tenant.policy.max_tool_rounds:
            msg["tool_calls"] = theirs or None
            if not theirs:
                data["choices"][0]["finish_reason"] = "stop"
                msg["content"] = msg.get("content") or ""
            else:
                ex.state.spawn(_keep_internal(ex, msg, exchange, full_assistant, results))
                exchange = []
            break
        exchange += [full_assistant, *results]
        convo += [full_assistant, *results]
        next_body = {**body, "messages": convo}
        if rounds + 1 >= ex.tenant.policy.max_tool_rounds:
            next_body["tools"] = [t for t in body["tools"]
                                  if (t.get("function") or {}).get("name") not in ex.tools.names]
        resp = await call_upstream(ex, next_body)
        nxt = await timed_read(ex, resp)
        if resp.status >= 400:
            raise _upstream_failed(resp.status, nxt)
        data = orjson.loads(nxt)
        add_usage(usage, data.get("usage"))
        rounds += 1
    _count_recalls(ex, runner)
    data["usage"] = usage or data.get("usage")
    _note_usage_dict(ex, usage)
    clean = _clean(data["choices"][0]["message"])
    if exchange:
        ex.state.spawn(_keep_internal(ex, clean, exchange, None, []))
    _record(ex, prepared, clean)
    return data  # type: ignore[no-any-return]


def _upstream_failed(status: int, body: bytes) -> UpstreamError:
    err = UpstreamError(f"upstream answered {status} during a proxy tool round: "
                        f"{body[:300].decode(errors='replace')}")
    err.status = status if status >= 500 else 502
    return err


def _runner(ex: Exchange, window_msgs: list[Message], window_keys: list[str]) -> ToolRunner:
    assert ex.tools is not None
    return ToolRunner(ex.tools, window_msgs, window_keys, ex.state.store, ex.tenant_id,
                      ex.session_id, ex.tenant.policy.search_results)


def _count_recalls(ex: Exchange, runner: ToolRunner) -> None:
    for tool, outcome in runner.outcomes:
        ex.state.metrics.recalls.labels(ex.tenant_label, tool, outcome).inc()


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
            _note_usage_dict(ex, acc.usage)
            _record(ex, prepared, _clean(acc.message()))
        else:
            async for out in _stream_tool_loop(ex, resp, body, window_msgs, window_keys,
                                               prepared):
                yield out
    except UpstreamError as exc:
        status = exc.status
        _record(ex, prepared, None)
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


async def _stream_tool_loop(ex: Exchange, resp: UpstreamResponse, body: bytes | dict[str, Any],
                            window_msgs: list[Message], window_keys: list[str],
                            prepared: list[Prepared]) -> AsyncIterator[bytes]:
    assert ex.tools is not None and isinstance(body, dict)
    want_usage = bool((ex.body.get("stream_options") or {}).get("include_usage"))  # type: ignore[attr-defined]
    runner = _runner(ex, window_msgs, window_keys)
    usage: dict[str, Any] = {}
    convo = list(body["messages"])
    exchange: list[Message] = []
    stream_id: str | None = None
    next_index = 0
    rounds = 0
    last_chunk: dict[str, Any] = {}
    content_so_far: list[str] = []
    while True:
        acc = StreamAccumulator()
        rewriter = ChunkRewriter(ex.tools, stream_id, next_index)
        decoder = SSEDecoder()
        try:
            async for raw in resp.iter_chunks():
                for ev in decoder.feed(raw):
                    out = _rewrite_event(ev, acc, rewriter)
                    if out is not None:
                        last_chunk = out
                        yield encode_json(out)
            for ev in decoder.flush():
                out = _rewrite_event(ev, acc, rewriter)
                if out is not None:
                    yield encode_json(out)
        finally:
            resp.close()
        stream_id = rewriter.stream_id
        next_index = rewriter.next_client_index
        add_usage(usage, acc.usage)
        content_so_far += acc.content
        calls = acc.tool_calls()
        mine = [c for c in calls if ex.tools.owns(c)]
        theirs = [c for c in calls if not ex.tools.owns(c)]
        if mine and not theirs and rounds < ex.tenant.policy.max_tool_rounds:
            results = [await runner.run(c) for c in mine]
            assistant = _clean(acc.message())
            exchange += [assistant, *results]
            convo += [assistant, *results]
            next_body = {**body, "messages": convo}
            if rounds + 1 >= ex.tenant.policy.max_tool_rounds:
                next_body["tools"] = [t for t in body["tools"] if
                                      (t.get("function") or {}).get("name") not in ex.tools.names]
            resp = await call_upstream(ex, next_body)
            if resp.status >= 400:
                raise _upstream_failed(resp.status, await resp.read())
            rounds += 1
            continue
        finish_chunk = rewriter.held_finish
        if finish_chunk is not None:
            if mine and not theirs:
                finish_chunk["choices"][0]["finish_reason"] = "stop"
            yield encode_json(finish_chunk)
        if want_usage:
            template = finish_chunk or last_chunk
            yield encode_json({"id": stream_id, "object": "chat.completion.chunk",
                               "created": template.get("created", int(time.time())),
                               "model": template.get("model", ex.model), "choices": [],
                               "usage": usage})
        yield DONE
        break
    _count_recalls(ex, runner)
    _note_usage_dict(ex, usage)
    final = _clean(acc.message())
    if len(content_so_far) > len(acc.content):
        final["content"] = "".join(content_so_far) or None
    client_view: Message = dict(final)  # type: ignore[assignment]
    if mine:
        full: Message = dict(final)  # type: ignore[assignment]
        client_view = _clean({**client_view, "tool_calls": theirs or None})  # type: ignore[typeddict-item]
        results = [await runner.run(c) for c in mine] if theirs else []
        ex.state.spawn(_keep_internal(ex, client_view, exchange, full if theirs else None,
                                      results))
        exchange = []
    if exchange:
        ex.state.spawn(_keep_internal(ex, client_view, exchange, None, []))
    _record(ex, prepared, client_view)


def _rewrite_event(ev: Any, acc: StreamAccumulator, rewriter: ChunkRewriter
                   ) -> dict[str, Any] | None:
    if ev.is_done or not ev.data:
        return None
    try:
        chunk = orjson.loads(ev.data)
    except orjson.JSONDecodeError:
        return None
    if isinstance(chunk, dict) and chunk.get("error"):
        raise _stream_error(chunk)
    acc.add(chunk)
    return rewriter.rewrite(chunk)


def _stream_error(chunk: dict[str, Any]) -> UpstreamError:
    err = chunk.get("error") or {}
    exc = UpstreamError(str(err.get("message", "upstream error")) if isinstance(err, dict)
                        else str(err))
    return exc


def _clean(msg: Message) -> Message:
    return {k: v for k, v in msg.items() if v is not None}  # type: ignore[return-value]


# -- recording ------------------------------------------------------------------------------------

def _record_raw(ex: Exchange, raw: bytes, prepared: list[Prepared]) -> dict[str, Any] | None:
    """Record a non-streamed reply; return the parsed completion (for usage)."""
    try:
        data = orjson.loads(raw)
        reply = data["choices"][0]["message"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        _record(ex, prepared, None)
        return None
    _record(ex, prepared, _clean(reply))
    return data if isinstance(data, dict) else None


def _record(ex: Exchange, prepared: list[Prepared], reply: Message | None) -> None:
    """Add what the client sent, and the reply it received, to the session's full history."""
    store = ex.state.store
    if store is None or ex.degraded:
        return
    if ex.server_history:
        if reply is not None:
            ex.state.spawn(_append_reply(ex, reply))
        return
    items = [*prepared, *counted(ex, [reply])] if reply is not None else prepared
    store.submit(ex.tenant_id, ex.session_id, items, ex.tenant.retention_days)


async def _append_reply(ex: Exchange, reply: Message) -> None:
    try:
        await ex.state.store.append(ex.tenant_id, ex.session_id,  # type: ignore[union-attr]
                                    counted(ex, [reply]), ex.tenant.retention_days)
    except StoreError as exc:
        log.warning("reply not recorded", extra={"tenant": ex.tenant.name, "error": str(exc)})


async def _keep_internal(ex: Exchange, client_view: Message, before: list[Message],
                         replace: Message | None, after: list[Message]) -> None:
    store = ex.state.store
    if store is None:
        return
    entry: dict[str, Any] = {"before": before, "replace": replace, "after": after}
    try:
        await store.add_internal(ex.tenant_id, ex.session_id, message_hash(client_view),
                                 entry)
    except StoreError as exc:
        log.warning("proxy tool exchange not stored", extra={"error": str(exc)})


# -- accounting -----------------------------------------------------------------------------------

def _note_usage_dict(ex: Exchange, usage: dict[str, Any] | None) -> None:
    if not usage:
        return
    b = ex.bound()
    prompt = int(usage.get("prompt_tokens") or 0)
    b.usage_prompt.inc(prompt)
    b.usage_completion.inc(int(usage.get("completion_tokens") or 0))
    details = usage.get("prompt_tokens_details") or {}
    b.usage_cached.inc(int(details.get("cached_tokens") or 0))
    if ex.window is not None and ex.tools is None:
        enc, exact = ex.state.tokens.encoding(ex.model, ex.tenant.encoding_for(ex.model))
        if not exact:
            tools = ex.state.tokens.tools(enc, ex.body.get("tools"))
            ex.state.tokens.calibrate(ex.model, ex.window.tokens_out + tools + REPLY_PRIMING,
                                      prompt)


def finish(ex: Exchange, status: int, error: str | None) -> None:
    """Count and log the request once, whatever path it took."""
    b = ex.bound()
    elapsed = time.perf_counter() - ex.started
    if ex.stream and ex.upstream_called_at is not None:
        # a stream's body time is the upstream's: the proxy's share is what came before it
        overhead = ex.upstream_called_at - ex.started
        ex.upstream_seconds = elapsed - overhead
    else:
        overhead = max(0.0, elapsed - ex.upstream_seconds)
    b.request(status, ex.stream)
    b.upstream_latency.observe(ex.upstream_seconds)
    b.overhead.observe(overhead)
    w = ex.window
    if w is not None:
        b.client_tokens.inc(w.tokens_in)
        b.forwarded_tokens.inc(w.tokens_out)
        b.saved_tokens.inc(max(0, w.tokens_in - w.tokens_out))
    log.info("request", extra={
        "tenant": ex.tenant.name, "model": ex.model, "session": ex.session_id,
        "status": status, "stream": ex.stream,
        "tokens_client": w.tokens_in if w else None,
        "tokens_forwarded": w.tokens_out if w else None,
        "latency_ms": round(elapsed * 1000, 2),
        "upstream_ms": round(ex.upstream_seconds * 1000, 2),
        "proxy_ms": round(overhead * 1000, 3),
        "degraded": ex.degraded, "error": error})
