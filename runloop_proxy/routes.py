"""HTTP endpoints: the OpenAI surface, health, metrics and the admin API."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from . import logs
from .chat import handle_chat, resolve_session
from .config import TenantSpec
from .errors import (
    AuthenticationFailed,
    ClientError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    StoreError,
    UpstreamError,
    error_body,
)
from .exchange import HISTORY_HEADER, Exchange, finish
from .messages import validate_chat_request
from .responses import LiveStreamResponse
from .runloops import preview, segment
from .upstream import upstream_headers

if TYPE_CHECKING:
    from .app import AppState

log = logs.get("routes")
Handler = Callable[[Request], Awaitable[Any]]
CHAT_PATH = "/v1/chat/completions"
ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status, headers=headers, media_type="application/json")


def openai_errors(handler: Handler) -> Handler:
    """Turn the proxy's errors into OpenAI-shaped bodies with the right status."""
    @functools.wraps(handler)
    async def wrapped(request: Request) -> Any:
        state: AppState = request.app.state.runloop
        state.metrics.in_flight.inc()
        try:
            return await handler(request)
        except ClientGone:
            raise
        except ClientError as exc:
            return json_response(exc.body(), exc.status)
        except UpstreamError as exc:
            log.warning("upstream error", extra={"error": str(exc), "status": exc.status})
            return json_response(exc.body(), exc.status)
        except Exception:
            log.exception("unexpected error")
            return json_response(error_body("internal error in runloop-proxy", "server_error",
                                            None, "internal_error"), 500)
        finally:
            state.metrics.in_flight.dec()
    return wrapped


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit}")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("api-key")


def authenticate(state: AppState, request: Request) -> tuple[TenantSpec, str, str, str | None]:
    """(tenant, metric label, storage id, Authorization to send upstream)."""
    cfg = state.config
    key = _bearer(request)
    if cfg.passthrough is not None:
        # Single-tenant pass-through: the client's own key goes upstream; its hash keeps
        # each key's sessions apart.
        tid = "pt-" + (hashlib.sha256(key.encode()).hexdigest()[:16] if key else "anonymous")
        return cfg.passthrough, "passthrough", tid, request.headers.get("authorization")
    if key is None:
        raise AuthenticationFailed("Missing API key: send it as 'Authorization: Bearer <key>'.")
    tenant = cfg.tenant_for_key(key)
    if tenant is None:
        raise AuthenticationFailed("Incorrect API key provided.")
    if tenant.forward_client_key:
        upstream_auth = request.headers.get("authorization")
    else:
        secret = tenant.upstream_key or cfg.upstreams[tenant.upstream].api_key
        upstream_auth = f"Bearer {secret}" if secret else None
    return tenant, tenant.name, tenant.name, upstream_auth


@openai_errors
async def chat_completions(request: Request) -> Response | LiveStreamResponse:
    state: AppState = request.app.state.runloop
    tenant, label, tid, upstream_auth = authenticate(state, request)
    raw = await read_body(request, state.config.server.max_body_bytes)
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc
    body = validate_chat_request(parsed)
    session_header = state.config.server.session_header
    session_id = resolve_session(request.headers.get(session_header), body, tid)
    ex = Exchange(state=state, tenant=tenant, tenant_label=label, tenant_id=tid, body=body,
                  raw=raw, client_headers=list(request.headers.items()),
                  authorization=upstream_auth, session_id=session_id,
                  server_history=request.headers.get(HISTORY_HEADER, "").lower() == "server")
    # The body is read: the next thing the client can send is a disconnect. Until a response
    # starts (a stream has its own listener), a client that goes away cancels the upstream call.
    watcher = asyncio.create_task(_cancel_on_disconnect(request, asyncio.current_task()))
    try:
        return await handle_chat(ex)
    except (ClientError, UpstreamError) as exc:
        finish(ex, exc.status, str(exc))
        raise
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            finish(ex, CLIENT_CLOSED, "client disconnected")
            raise ClientGone() from None
        raise
    finally:
        watcher.cancel()


class ClientGone(Exception):
    """The client disconnected before the answer: there is nobody to answer."""


CLIENT_CLOSED = 499  # nginx's "client closed request", for logs and metrics


async def _cancel_on_disconnect(request: Request, task: asyncio.Task[Any] | None) -> None:
    message = await request.receive()
    if message["type"] == "http.disconnect" and task is not None:
        task.cancel()


@openai_errors
async def passthrough(request: Request) -> Response | LiveStreamResponse:
    """Any other /v1 endpoint (models, embeddings, files, …) goes through untouched."""
    state: AppState = request.app.state.runloop
    tenant, label, _, upstream_auth = authenticate(state, request)
    raw = await read_body(request, state.config.server.max_body_bytes)
    path = "/" + request.path_params["path"]
    headers = upstream_headers(request.headers.items(), upstream_auth)
    client = state.upstreams[tenant.upstream]
    resp = await client.request(request.method, path, headers, raw or None,
                                query=request.url.query)
    state.metrics.passthrough_requests.labels(label, str(resp.status)).inc()
    fwd = dict(resp.forward_headers())
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        async def relay() -> Any:
            try:
                async for chunk in resp.iter_chunks():
                    yield chunk
            finally:
                resp.close()
        return LiveStreamResponse(relay(), resp.status, fwd)
    return Response(await resp.read(), resp.status, headers=fwd)


async def healthz(request: Request) -> Response:
    return json_response({"status": "ok"})


async def readyz(request: Request) -> Response:
    state: AppState = request.app.state.runloop
    checks: dict[str, Any] = {"config": bool(state.upstreams)}
    if state.store is not None:
        checks["store"] = await state.store.ping()
    ok = all(checks.values())
    return json_response({"status": "ready" if ok else "not ready", "checks": checks},
                         200 if ok else 503)


async def metrics_endpoint(request: Request) -> Response:
    state: AppState = request.app.state.runloop
    body, content_type = state.metrics.render()
    return Response(body, headers={"Content-Type": content_type})


# -- admin ----------------------------------------------------------------------------------------

def _admin(state: AppState, request: Request) -> str:
    """Check the admin key; return the tenant the request is scoped to."""
    admin_key = state.config.server.admin_key or state.settings.admin_key
    if not admin_key:
        raise NotFound("admin endpoints are disabled (no admin key configured)")
    given = _bearer(request) or ""
    if not hmac.compare_digest(given.encode(), admin_key.encode()):
        raise AuthenticationFailed("admin endpoints need the admin key as Bearer token")
    tenant = request.query_params.get("tenant")
    if tenant:
        return tenant
    if len(state.config.tenants) == 1:
        return next(iter(state.config.tenants))
    raise InvalidRequest("give ?tenant=NAME (the tenant whose sessions to read)", param="tenant")


def _store_unavailable(exc: StoreError) -> Response:
    return json_response(error_body(str(exc), "store_unavailable", None, "store_unavailable"),
                         503)


def session_summary(view: Any) -> dict[str, Any]:
    messages = view.messages
    loops = []
    for lp in segment(messages):
        users = [messages[i] for i in lp.user_positions]
        final = messages[lp.final_position] if lp.final_position is not None else None
        loops.append({"index": lp.index, "start": lp.start, "end": lp.end - 1,
                      "status": lp.status.value, "tool_call_ids": list(lp.tool_call_ids),
                      "user_preview": preview(users[0] if users else None),
                      "final_preview": preview(final)})
    return {"session_id": view.session_id, "tenant": view.tenant, "head_branch": view.head,
            "message_count": len(messages), "created_ms": view.created_ms,
            "updated_ms": view.updated_ms, "run_loops": loops, "branches": view.branches,
            "compression_records": view.records, "proxy_tool_exchanges": len(view.internal)}


@openai_errors
async def admin_session(request: Request) -> Response:
    state: AppState = request.app.state.runloop
    tenant = _admin(state, request)
    if state.store is None:
        raise NotFound("no store configured")
    session_id = request.path_params["session_id"]
    try:
        view = await state.store.session(tenant, session_id)
    except StoreError as exc:
        return _store_unavailable(exc)
    if view is None:
        raise NotFound(f"no session {session_id!r} for tenant {tenant!r}")
    out = session_summary(view)
    if request.query_params.get("messages") in ("1", "true"):
        out["messages"] = view.messages
    return json_response(out)


@openai_errors
async def admin_sessions(request: Request) -> Response:
    state: AppState = request.app.state.runloop
    tenant = _admin(state, request)
    if state.store is None:
        raise NotFound("no store configured")
    try:
        offset = max(0, int(request.query_params.get("offset", "0")))
        limit = min(500, max(1, int(request.query_params.get("limit", "50"))))
    except ValueError as exc:
        raise InvalidRequest("offset and limit must be integers") from exc
    try:
        rows, total = await state.store.list_sessions(tenant, offset, limit)
    except StoreError as exc:
        return _store_unavailable(exc)
    return json_response({"tenant": tenant, "total": total, "offset": offset, "limit": limit,
                          "sessions": [{"session_id": s, "updated_ms": t} for s, t in rows]})


def routes() -> list[BaseRoute]:
    return [
        Route(CHAT_PATH, chat_completions, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/admin/sessions", admin_sessions, methods=["GET"]),
        Route("/admin/sessions/{session_id:path}", admin_session, methods=["GET"]),
        Route("/v1/{path:path}", passthrough, methods=ALL_METHODS),
    ]
