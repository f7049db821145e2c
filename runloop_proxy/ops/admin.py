"""The admin API: read a tenant's stored sessions (behind the admin key)."""

from __future__ import annotations

import hmac
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from ..api.http import bearer, json_response, shaped_errors
from ..config import hash_key
from ..conversation.identity import name_of, stored_id
from ..conversation.runloops import preview, segment
from ..errors import (
    AuthenticationFailed,
    Conflict,
    InvalidRequest,
    NotFound,
    StoreError,
    error_body,
)
from ..history.store import SessionView
from ..history.summaries import MODEL, OMIT, Job
from ..pipeline.offload import offload
from ..pipeline.shadow import within_cap
from ..pipeline.shadowing import spent, today
from ..pipeline.tools import spliced_stored
from ..state import AppState, state_of
from . import params


def admin_key_of(state: AppState) -> str:
    key = state.config.server.admin_key or state.settings.admin_key
    if not key:
        raise NotFound("admin endpoints are disabled (no admin key configured)")
    return key


def admin_key_matches(configured: str, given: str) -> bool:
    """``given`` is the admin key: the configured key itself, or one whose SHA-256 is the
    configured ``sha256:<hex>`` (``runloop-proxy init`` writes the hash, never the key)."""
    if configured.startswith("sha256:"):
        return hmac.compare_digest(hash_key(given), configured.removeprefix("sha256:").lower())
    return hmac.compare_digest(given.encode(), configured.encode())


def _admin(state: AppState, request: Request) -> str:
    """Check the admin key; return the tenant the request is scoped to."""
    check_admin_key(state, request)
    return _tenant_param(state, request)


def _tenant_param(state: AppState, request: Request) -> str:
    tenant = params.text(request, "tenant")
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
    return {"session_id": view.session_id, "name": name_of(view.session_id),
            "tenant": view.tenant, "head_branch": view.head,
            "message_count": len(messages), "created_ms": view.created_ms,
            "updated_ms": view.updated_ms, "run_loops": loops, "branches": view.branches,
            "compression_records": view.records, "proxy_tool_exchanges": len(view.internal)}


async def _summaries(state: Any, tenant: str, session_id: str
                     ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The session's stored summaries (every branch's), by the loops they cover, and the
    omissions "compact now" asked for (loops omitted from a request point on)."""
    try:
        entries = await state.store.summaries(tenant, session_id)
    except StoreError:
        return [], []
    out, asked = [], []
    for name, raw in entries.items():
        if name.startswith(OMIT):
            e, _, cover = name[len(OMIT):].partition(":")
            asked.append({"loops": [0, int(e)], "cover": cover, "from_message": int(raw)})
            continue
        model = name.startswith(MODEL)  # the model's own summary, kept for later events
        e, _, cover = name[len(MODEL):].partition(":") if model else name.partition(":")
        # "loops" is the batch's range, end excluded; a rolling summary's text covers every
        # loop before its end ("covers": first and last, both included)
        covered = [0, int(e) - 1]
        if model:
            out.append({**orjson.loads(raw), "covers": covered, "cover": cover,
                        "model_summary": True})
        elif raw == "late":
            out.append({"loops": [0, int(e)], "covers": covered, "cover": cover, "late": True})
        else:
            out.append({**orjson.loads(raw), "covers": covered, "cover": cover})
    return sorted(out, key=lambda s: (s["loops"][1], s["cover"])), \
        sorted(asked, key=lambda s: s["from_message"])


async def tenant_of_session(state: AppState, request: Request, session_id: str) -> str:
    """The tenant a session belongs to: ``?tenant=``, else the one tenant, else whichever
    namespace holds that id (pass-through tenants are ``pt-<hash of the key>``, which nobody
    can guess); 409 listing them when several do."""
    try:
        return _tenant_param(state, request)
    except InvalidRequest:
        pass
    assert state.store is not None
    names = [n for n, _ in await state.store.namespaces()]
    found = await state.store.holders(names, session_id)
    if len(found) == 1:
        return found[0]
    if not found:
        raise NotFound(f"no session {name_of(session_id)!r} in any tenant")
    raise Conflict(f"session {name_of(session_id)!r} exists in several tenants: "
                   f"{', '.join(found)}; give ?tenant=NAME", param="tenant")


@shaped_errors
async def admin_tenants(request: Request) -> Response:
    """Every tenant: configured ones and the namespaces holding sessions (pass-through keys)."""
    state = state_of(request)
    check_admin_key(state, request)
    stored: dict[str, int] = {}
    if state.store is not None:
        try:
            stored = dict(await state.store.namespaces())
        except StoreError as exc:
            return _store_unavailable(exc)
    names = sorted(set(state.config.tenants) | set(stored))
    return json_response({"tenants": [
        {"tenant": n, "configured": n in state.config.tenants, "sessions": stored.get(n, 0)}
        for n in names]})


def check_admin_key(state: AppState, request: Request) -> None:
    """The admin key as Bearer (or ``api-key``, ``x-api-key``), else AuthenticationFailed;
    NotFound when no admin key is configured. The gate (``ops.gate``) asks this of every
    admin API request before any handler; the handlers ask it again."""
    if not admin_key_matches(admin_key_of(state), bearer(request) or ""):
        raise AuthenticationFailed("admin endpoints need the admin key as Bearer token")


def _session_request(request: Request) -> tuple[AppState, str]:
    """An admin request about one session: the key checked, a store there; the session's
    key (``stored_id``: a key as listed, or the id a client named)."""
    state = state_of(request)
    check_admin_key(state, request)
    if state.store is None:
        raise NotFound("no store configured")
    return state, stored_id(params.path(request, "session_id"))


@shaped_errors
async def admin_compact(request: Request) -> Response:
    """Compact now (where the session's tenant has ``summary_model``)."""
    state, session_id = _session_request(request)
    try:
        tenant = await tenant_of_session(state, request, session_id)
        return json_response(await compact(state, tenant, session_id))
    except StoreError as exc:
        return _store_unavailable(exc)


async def compact(state: AppState, tenant: str, session_id: str) -> dict[str, Any]:
    assert state.store is not None
    spec = state.config.spec_of_namespace(tenant)
    if spec is None:
        raise NotFound(f"no tenant {tenant!r}")
    if not spec.policy.summary_model:
        raise Conflict(f"tenant {tenant!r} has no summary_model: nothing to compact with",
                       param="summary_model")
    # the key the tenant's own requests go with (one rule: ProxyConfig.upstream_secret)
    secret = state.config.upstream_secret(spec)
    auth = f"Bearer {secret}" if secret else None
    if spec.policy.summary_model != "extractive" and auth is None:
        raise Conflict("an LLM summary needs an upstream key: pass-through tenants use the "
                       "caller's own, so only summary_model = \"extractive\" compacts here")
    view = await state.store.session(tenant, session_id)
    if view is None:
        raise NotFound(f"no session {name_of(session_id)!r} for tenant {tenant!r}")
    job = Job(spec.policy, tenant, spec.name, spec.name, "gpt-4o", spec.upstream, auth,
              spec=state.config.upstreams.get(spec.upstream))
    messages, keys, _ = spliced_stored(view.messages, view.internal)
    made, omitted = await state.summaries.compact(job, session_id, messages, keys)
    return {"session_id": session_id, "tenant": tenant,
            "made": [{"loops": [0, e], "ok": text is not None} for e, text in made],
            "omitted_loops": omitted, "from_message": len(messages) if omitted else None}


@shaped_errors
async def admin_session(request: Request) -> Response:
    state, session_id = _session_request(request)
    assert state.store is not None
    try:
        tenant = await tenant_of_session(state, request, session_id)
        view = await state.store.session(tenant, session_id)
    except StoreError as exc:
        return _store_unavailable(exc)
    if view is None:
        raise NotFound(f"no session {name_of(session_id)!r} for tenant {tenant!r}")
    summaries, compactions = await _summaries(state, tenant, session_id)
    with_messages = params.flag(request, "messages")
    points = None
    if params.flag(request, "points"):  # each request's tokens, frame and upstream usage
        try:
            points = await state.store.points(tenant, session_id)
        except StoreError as exc:
            return _store_unavailable(exc)

    def answer() -> Response:
        out = session_summary(view)
        out["summaries"], out["compactions"] = summaries, compactions
        if with_messages:
            out["messages"] = view.messages
        if points is not None:
            out["points"] = points
        return json_response(out)

    # segmenting a large session and writing it out is the work of a large request
    return await offload(view.large, answer)


@shaped_errors
async def admin_sessions(request: Request) -> Response:
    state = state_of(request)
    tenant = _admin(state, request)
    if state.store is None:
        raise NotFound("no store configured")
    offset, limit = params.integer(request, "offset", 0), params.integer(request, "limit", 50)
    try:
        rows, total = await state.store.list_sessions(tenant, offset, limit)
    except StoreError as exc:
        return _store_unavailable(exc)
    return json_response({"tenant": tenant, "total": total, "offset": offset, "limit": limit,
                          "sessions": [{"session_id": s, "name": name_of(s), "updated_ms": t}
                                       for s, t in rows]})


@shaped_errors
async def admin_shadow(request: Request) -> Response:
    """A tenant's shadow comparisons today: its policy's rate and caps, what the calls cost,
    agreement by lever (and ``any``), the requests sampled and not shadowed by reason, and
    the last comparisons (a disagreement with the two next steps side by side)."""
    state = state_of(request)
    name = _admin(state, request)
    tenant = state.config.tenants.get(name)
    if tenant is None:
        raise NotFound(f"no tenant {name!r} configured")
    policy, day = tenant.policy, today()
    # today's spend is every replica's (Redis); the comparisons are this process's
    spend: dict[str, Any]
    try:
        got = await spent(state, name, day)
        spend = {"tokens": got.tokens, "usd": round(got.usd, 6),
                 "capped": not within_cap(got, day, policy.shadow_daily_tokens,
                                          policy.shadow_daily_usd)}
    except StoreError as exc:  # no shadow call goes until Redis is back (fail closed)
        spend = {"tokens": None, "usd": None, "capped": None,
                 "ledger_error": str(exc)}
    return json_response({
        "tenant": name, "shadow_rate": policy.shadow_rate,
        "daily_tokens": policy.shadow_daily_tokens, "daily_usd": policy.shadow_daily_usd,
        "text_threshold": policy.shadow_text_threshold, "day": day, **spend,
        **state.shadows.report(name)})


def admin_routes() -> list[BaseRoute]:
    return [Route("/admin/tenants", admin_tenants, methods=["GET"]),
            Route("/admin/shadow", admin_shadow, methods=["GET"]),
            Route("/admin/sessions", admin_sessions, methods=["GET"]),
            Route("/admin/sessions/{session_id:path}/compact", admin_compact, methods=["POST"]),
            Route("/admin/sessions/{session_id:path}", admin_session, methods=["GET"])]
