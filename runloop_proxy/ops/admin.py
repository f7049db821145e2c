"""The admin API: read a tenant's stored sessions (behind the admin key)."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from ..api.http import bearer, json_response, openai_errors
from ..conversation.runloops import preview, segment
from ..errors import AuthenticationFailed, InvalidRequest, NotFound, StoreError, error_body
from ..history.store import SessionView
from ..state import AppState, state_of


def _admin(state: AppState, request: Request) -> str:
    """Check the admin key; return the tenant the request is scoped to."""
    admin_key = state.config.server.admin_key or state.settings.admin_key
    if not admin_key:
        raise NotFound("admin endpoints are disabled (no admin key configured)")
    given = bearer(request) or ""
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


def session_summary(view: SessionView) -> dict[str, Any]:
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
    state = state_of(request)
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
    state = state_of(request)
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


def admin_routes() -> list[BaseRoute]:
    return [Route("/admin/sessions", admin_sessions, methods=["GET"]),
            Route("/admin/sessions/{session_id:path}", admin_session, methods=["GET"])]
