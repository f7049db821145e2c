"""One request's state and its bookkeeping: the upstream calls it makes, what it records in
the history, and the metrics and log line it leaves."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from . import logs
from .config import TenantSpec
from .errors import StoreError
from .messages import ChatRequest, Message
from .metrics import BoundMetrics
from .store import Prepared, prepare
from .tools import ProxyTools
from .upstream import UpstreamClient, UpstreamResponse, json_headers, upstream_headers
from .window import Window

if TYPE_CHECKING:
    from .app import AppState

log = logs.get("chat")


HISTORY_HEADER = "x-runloop-history"


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
    window: Window | None = None
    # whole prompts as the proxy counts them (messages, tool schemas, reply priming): the
    # client's, and what went upstream (the proxy's tools included when it added them)
    prompt_tokens: tuple[int, int] | None = None
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


def counted(ex: Exchange, messages: list[Message],
            prepared: list[Prepared] | None = None) -> list[Prepared]:
    """Messages hashed, canonicalised and counted (the counts are cached by hash, so the
    window's own counting costs nothing more, and the store keeps them)."""
    enc, _ = ex.state.tokens.encoding(ex.model, ex.tenant.encoding_for(ex.model))
    items = prepared if prepared is not None else [prepare(m) for m in messages]
    return [p._replace(tokens=ex.state.tokens.message(enc, m, p.hash), encoding=enc.name)
            for m, p in zip(messages, items, strict=True)]


async def prime_counts(ex: Exchange, hashes: list[str]) -> None:
    """A replica that has not seen this session reads its stored token counts first."""
    store = ex.state.store
    if store is None or store.cached_internal(ex.tenant_id, ex.session_id) is not None:
        return
    enc, _ = ex.state.tokens.encoding(ex.model, ex.tenant.encoding_for(ex.model))
    try:
        counts = await store.token_counts(ex.tenant_id, ex.session_id, hashes, enc.name)
    except StoreError:
        return  # the sync right after says whether the store is really down
    ex.state.tokens.prime(enc, counts)


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


def clean(msg: Message) -> Message:
    return {k: v for k, v in msg.items() if v is not None}  # type: ignore[return-value]


def record_raw(ex: Exchange, raw: bytes, prepared: list[Prepared]) -> dict[str, Any] | None:
    """Record a non-streamed reply; return the parsed completion (for usage)."""
    try:
        data = orjson.loads(raw)
        reply = data["choices"][0]["message"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        record(ex, prepared, None)
        return None
    record(ex, prepared, clean(reply))
    return data if isinstance(data, dict) else None


def record(ex: Exchange, prepared: list[Prepared], reply: Message | None) -> None:
    """Add what the client sent, and the reply it received, to the session's full history."""
    store = ex.state.store
    if store is None or ex.degraded == "store":
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


def note_usage(ex: Exchange, usage: dict[str, Any] | None) -> None:
    if not usage:
        return
    b = ex.bound()
    prompt = int(usage.get("prompt_tokens") or 0)
    b.usage_prompt.inc(prompt)
    b.usage_completion.inc(int(usage.get("completion_tokens") or 0))
    details = usage.get("prompt_tokens_details") or {}
    b.usage_cached.inc(int(details.get("cached_tokens") or 0))
    if ex.prompt_tokens is not None and ex.tools is None:
        enc, exact = ex.state.tokens.encoding(ex.model, ex.tenant.encoding_for(ex.model))
        if not exact:
            ex.state.tokens.calibrate(ex.model, ex.prompt_tokens[1], prompt)


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
    if ex.prompt_tokens is not None:
        client, forwarded = ex.prompt_tokens
        b.client_tokens.inc(client)
        b.forwarded_tokens.inc(forwarded)
        b.saved_tokens.inc(max(0, client - forwarded))
    log.info("request", extra={
        "tenant": ex.tenant.name, "model": ex.model, "session": ex.session_id,
        "status": status, "stream": ex.stream,
        "tokens_client": ex.prompt_tokens[0] if ex.prompt_tokens else None,
        "tokens_forwarded": ex.prompt_tokens[1] if ex.prompt_tokens else None,
        "latency_ms": round(elapsed * 1000, 2),
        "upstream_ms": round(ex.upstream_seconds * 1000, 2),
        "proxy_ms": round(overhead * 1000, 3),
        "degraded": ex.degraded, "error": error})
