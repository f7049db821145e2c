"""The session inspector: server-rendered pages behind the admin key (``/admin/ui``).

The landing page (``inspector_list``): totals per tenant and overall, and the sessions sorted
and filtered, each with its messages, prompt tokens and bill; a session's page
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

from ..conversation.identity import stored_id
from ..errors import InvalidRequest, ProxyError, StoreError
from ..state import state_of
from . import params
from .admin import admin_key_matches, admin_key_of, compact
from .inspector_list import sessions
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
    login_cookie,
    login_ok,
    page,
)

Handler = Callable[[Request], Awaitable[Response]]


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
