"""The session inspector: server-rendered pages behind the admin key (``/admin/ui``).

Sessions per tenant, newest first, with their messages and prompt tokens; a session's page
(``inspector_session``): prompt tokens per request as an inline SVG chart, the last request's
window rebuilt the way the proxy built it (``inspector_window``), summaries with "compact now",
the proxy's tool rounds, compression records and branches; a message's page
(``inspector_message``). Everything it loads comes from the proxy itself; no script runs in
the page.

Login sets an HttpOnly, SameSite=Strict cookie signed with the admin key (valid 12 hours); the
one form that changes something carries a CSRF token derived from that cookie, and a POST from
another origin is refused.
"""

from __future__ import annotations

import functools
import hmac
import secrets
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from html import escape

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from .. import savings
from ..conversation.identity import log_name, name_of, stored_id
from ..errors import InvalidRequest, ProxyError, StoreError
from ..pricing import PriceTable
from ..savings import DEFINITION, HEADLINE, Savings, percent, usd
from ..state import state_of
from . import params
from .admin import admin_key_matches, admin_key_of, compact
from .inspector_message import message
from .inspector_session import session
from .inspector_shell import (
    BASE,
    COOKIE,
    NONCE_CHARS,
    VALID_S,
    csrf_token,
    error,
    guard,
    link,
    login_cookie,
    login_ok,
    page,
    tenant_name,
    when,
)
from .views import saving, tokens

Handler = Callable[[Request], Awaitable[Response]]
PAGE = 25
SEARCHED = 5000  # sessions a search by id looks through, newest first


async def login_form(request: Request) -> Response:
    state = state_of(request)
    try:
        admin_key_of(state)
    except ProxyError as exc:
        return page("disabled", f"<p class='err'>{escape(str(exc))}</p>", 404, user=False)
    return _login(None)


def _login(message: str | None, status: int = 200) -> Response:
    msg = f"<p class='err'>{escape(message)}</p>" if message else ""
    return page("log in", f"<h1>Log in</h1>{msg}<form method='post' action='{BASE}/login'>"
                          f"<label>Admin key <input type='password' name='key' "
                          f"autocomplete='current-password' autofocus></label> "
                          f"<button type='submit'>Log in</button></form>", status, user=False)


async def login(request: Request) -> Response:
    state = state_of(request)
    try:
        key = admin_key_of(state)
    except ProxyError as exc:
        return page("disabled", f"<p class='err'>{escape(str(exc))}</p>", 404, user=False)
    form = await _form(request)
    given = params.form_text(form, "key")
    if not admin_key_matches(key, given):
        return _login("That is not the admin key.", 401)
    try:
        epoch = await state.logins(VALID_S * 1000, start=True)
    except StoreError:
        epoch = None
    if epoch is None:  # no epoch, no login: a cookie no replica could check
        return _login("The store is unavailable, so no login can be kept; try again.", 503)
    exp = int(time.time()) + VALID_S
    resp = RedirectResponse(BASE, 303)
    resp.set_cookie(COOKIE, login_cookie(key, exp, secrets.token_hex(NONCE_CHARS // 2), epoch),
                    max_age=VALID_S, path="/admin/ui", httponly=True, samesite="strict",
                    secure=request.url.scheme == "https")
    return resp


async def logout(request: Request) -> Response:
    """Ends every login made before it, on every replica (the logins' epoch moves on), when
    it comes from a login: a copy of the cookie taken before opens nothing after. Anyone
    else's logout only drops their own cookie."""
    state = state_of(request)
    resp = RedirectResponse(f"{BASE}/login", 303)
    resp.delete_cookie(COOKIE, path="/admin/ui")
    if await login_ok(state, request) is not None:
        try:
            await state.end_logins(VALID_S * 1000)
        except StoreError:
            failed = page("not logged out", "<p class='err'>The store is unavailable, so the "
                          "logins could not be ended; try again.</p>", 503, user=False)
            failed.delete_cookie(COOKIE, path="/admin/ui")
            return failed
    return resp


async def _form(request: Request) -> dict[str, str]:
    """An urlencoded form (small: the login key, the compact button)."""
    body = await request.body()
    if len(body) > 16_384:
        return {}
    return {k: v[0] for k, v in urllib.parse.parse_qs(body.decode("utf-8", "replace")).items()}


TENANT_COOKIE = "rl_tenant"  # the tenant the sessions page shows when none is asked


async def sessions(request: Request) -> Response:
    guarded = await guard(request)
    if isinstance(guarded, Response):
        return guarded
    state, _ = guarded
    assert state.store is not None
    try:
        stored = dict(await state.store.namespaces())
    except StoreError as exc:
        return error("store unavailable", str(exc), 503)
    tenants = sorted(set(state.config.tenants) | set(stored))
    chosen = params.text(request, "tenant")
    remembered = urllib.parse.unquote(request.cookies.get(TENANT_COOKIE, ""))
    # the tenant chosen last stays the landing page's (a cookie), until another is chosen
    tenant = chosen or (remembered if remembered in tenants else "") or \
        (tenants[0] if tenants else "")
    search = params.text(request, "q").strip()
    at = params.integer(request, "page", 0)
    options = "".join(f"<option value='{escape(t)}'{' selected' if t == tenant else ''}>"
                      f"{escape(tenant_name(state, t))} ({stored.get(t, 0)})</option>"
                      for t in tenants)
    try:
        rows, total = await state.store.list_sessions(tenant, 0 if search else at * PAGE,
                                                      SEARCHED if search else PAGE)
        if search:
            rows = [r for r in rows if search.lower() in name_of(r[0]).lower()
                    or search == log_name(r[0])]  # a log line's digest of it
            total = len(rows)
            rows = rows[at * PAGE:(at + 1) * PAGE]
        overviews = await state.store.overviews(tenant, [sid for sid, _ in rows])
    except StoreError as exc:
        return error("store unavailable", str(exc), 503)
    prices = state.config.prices or PriceTable.load()
    bills = [savings.of_points(o.points, prices) for o in overviews]
    listed = sum(bills, Savings())
    body = [f"<h1>Sessions</h1><form method='get' action='{BASE}'>"
            f"<label>Tenant <select name='tenant'>{options}</select></label> "
            f"<label>Session id <input name='q' value='{escape(search)}'></label> "
            f"<button>Show</button></form>",
            f"<p class='muted'>{total} session{'s' if total != 1 else ''} of "
            f"{escape(tenant_name(state, tenant))}, the most recently used first. Prompt "
            f"tokens are whole prompts summed over the session's requests: what the client "
            f"sent, and what the proxy forwarded.</p>",
            f"<p class='headline'>The {len(rows)} session{'s' if len(rows) != 1 else ''} "
            f"listed: <b>{escape(listed.headline())}</b> · {escape(listed.secondary())}</p>"
            f"<p class='muted'>{escape(HEADLINE.capitalize())}: {escape(DEFINITION)}.</p>"
            f"<table><tr><th>session</th>"
            f"<th class='num'>messages</th><th class='num'>requests</th><th class='num'>"
            f"prompt tokens sent → forwarded</th><th class='num'>tokens saved</th>"
            f"<th class='num'>{escape(HEADLINE)}</th><th class='num'>money saved</th>"
            f"<th>last used</th></tr>"]
    for (sid, ts), o, bill in zip(rows, overviews, bills, strict=True):
        body.append(f"<tr><td><a href='{link('/session', tenant=tenant, id=sid)}'>"
                    f"{escape(name_of(sid))}</a></td><td class='num'>{o.messages:,}</td>"
                    f"<td class='num'>{o.requests:,}</td><td class='num'>{tokens(o.client)}"
                    f" → {tokens(o.forwarded)}</td><td class='num'>"
                    f"{saving(o.client, o.forwarded)}</td><td class='num'>"
                    f"{'—' if bill.bill_saved is None else percent(bill.bill_saved)}</td>"
                    f"<td class='num'>{usd(bill.money_saved) if bill.priced else '—'}</td>"
                    f"<td>{escape(when(ts))}</td></tr>")
    body.append("</table>")
    pages = []
    if at > 0:
        pages.append(f"<a href='{link('', tenant=tenant, q=search or None, page=at - 1)}'>"
                     f"← newer</a>")
    if (at + 1) * PAGE < total:
        pages.append(f"<a href='{link('', tenant=tenant, q=search or None, page=at + 1)}'>"
                     f"older →</a>")
    body.append(f"<p>{' · '.join(pages)}</p>")
    answer = page("sessions", "".join(body))
    if chosen and chosen in tenants:
        # quoted: a tenant's name may hold any character, a header only Latin-1
        answer.set_cookie(TENANT_COOKIE, urllib.parse.quote(chosen, safe=""),
                          max_age=VALID_S, path=BASE, httponly=True, samesite="strict",
                          secure=request.url.scheme == "https")
    return answer


async def compact_now(request: Request) -> Response:
    guarded = await guard(request)
    if isinstance(guarded, Response):
        return guarded
    state, cookie = guarded
    origin = request.headers.get("origin")
    if origin:  # an origin is its scheme, host and port: any of them other is another site
        sent = urllib.parse.urlsplit(origin)
        if (sent.scheme, sent.netloc) != (request.url.scheme, request.url.netloc):
            return error("refused", "A form from another site.", 403)
    form = await _form(request)
    if not hmac.compare_digest(params.form_text(form, "csrf"), csrf_token(state, cookie)):
        return error("refused", "The form has expired; reload the page.", 403)
    tenant, sid = params.form_text(form, "tenant"), stored_id(params.form_text(form, "id"))
    try:
        await compact(state, tenant, sid)
    except (StoreError, ProxyError) as exc:
        return error("error", str(exc), 409)
    back = urllib.parse.urlencode({"tenant": tenant, "id": sid})
    return RedirectResponse(f"{BASE}/session?{back}", 303)


def _bad_parameters_answered(handler: Handler) -> Handler:
    """A page whose parameter does not parse (``params``) answers 400 and says which."""
    @functools.wraps(handler)
    async def answered(request: Request) -> Response:
        try:
            return await handler(request)
        except InvalidRequest as exc:
            return error("bad request", str(exc), 400)
    return answered


def inspector_routes() -> list[BaseRoute]:
    pages: list[tuple[str, Handler, str]] = [
        (BASE, sessions, "GET"), (f"{BASE}/login", login_form, "GET"),
        (f"{BASE}/login", login, "POST"), (f"{BASE}/logout", logout, "POST"),
        (f"{BASE}/session", session, "GET"), (f"{BASE}/message", message, "GET"),
        (f"{BASE}/compact", compact_now, "POST")]
    return [Route(path, _bad_parameters_answered(h), methods=[method])
            for path, h, method in pages]
