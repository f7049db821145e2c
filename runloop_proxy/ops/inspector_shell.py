"""What every inspector page shares: the page around its body (no script, nothing loaded from
elsewhere), the login cookie and the CSRF token, and the checks that come before a page about
one session (logged in, a store, the session found)."""

from __future__ import annotations

import hashlib
import hmac
import time
import urllib.parse
from html import escape
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from ..conversation.identity import name_of, stored_id
from ..errors import ProxyError, StoreError
from ..history.store import SessionView
from ..state import ADMIN_LOGIN_S, AppState, state_of
from . import logs, params
from .admin import admin_key_of, tenant_of_session
from .views import tenant_label

COOKIE = "rl_admin"
BASE = "/admin/ui"
VALID_S = ADMIN_LOGIN_S
NONCE_CHARS = 32
HEX = frozenset("0123456789abcdef")
log = logs.get("inspector")
STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:10px 20px}header a{color:#cfe0ff}
main{padding:16px 20px;max-width:1400px}h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;width:100%;background:#fff}td,th{border:1px solid #dde1e8;
padding:4px 8px;text-align:left;vertical-align:top}th{background:#eef1f5}
td.num,th.num{text-align:right;white-space:nowrap}td.when{white-space:nowrap}
.omitted{color:#98a0ad}.reduced{background:#fff8e6}.whole{background:#eefaf0}
.open{background:#e8f1ff}pre{white-space:pre-wrap;background:#fff;border:1px solid #dde1e8;
padding:8px;max-height:420px;overflow:auto;margin:4px 0 12px}.muted{color:#6b7280}
form.inline{display:inline}input,select,button{font:inherit;padding:3px 6px}
.err{color:#b42318}svg.chart{background:#fff;border:1px solid #dde1e8}
svg.chart text{font:11px system-ui,sans-serif;fill:#374151}
.role{display:inline-block;padding:0 6px;border-radius:4px;background:#eef1f5;
font-size:12px;font-weight:600}dl.facts{display:grid;grid-template-columns:max-content auto;
gap:2px 12px}dl.facts dt{color:#6b7280}dl.facts dd{margin:0}
.msg{background:#fff;border:1px solid #dde1e8;padding:6px 10px;margin:6px 0}
"""


def sign(key: str, text: str) -> str:
    return hmac.new(key.encode(), text.encode(), hashlib.sha256).hexdigest()


def login_cookie(key: str, exp: int, nonce: str, epoch: str) -> str:
    """A login's cookie: its expiry, its own nonce (no two logins share a cookie, nor the
    CSRF token made from it), signed with the admin key and the logins' epoch."""
    return f"{exp}.{nonce}.{sign(key, f'ui:{exp}:{nonce}:{epoch}')}"


async def login_ok(state: AppState, request: Request) -> str | None:
    """The login cookie when it is valid: signed by the admin key of now, its time not
    over, and made in the logins' epoch of now (a logout or a rotated admin key began a
    new one, on every replica: it is kept in the store). Fails closed: with the epoch
    unreadable, no login holds."""
    value = request.cookies.get(COOKIE, "")
    exp, nonce, sig = (value.split(".") + ["", ""])[:3] if value.count(".") == 2 \
        else ("", "", "")
    try:
        key = admin_key_of(state)
    except ProxyError:
        return None
    # ASCII digits, as many as a time has: str.isdigit() takes "²", and int() refuses a
    # string of 4,300 digits with an error (the gate answered a cookie of 5,000 a 500)
    if not (0 < len(exp) <= 12 and exp.isascii() and exp.isdigit()) or int(exp) < time.time():
        return None
    if not (len(nonce) == NONCE_CHARS and all(c in HEX for c in nonce)):
        return None
    try:
        epoch = await state.logins(VALID_S * 1000)
    except StoreError as exc:
        log.error("admin login refused: the logins' epoch cannot be read",
                  extra={"error": str(exc)})
        return None
    if epoch is None:
        return None
    return value if hmac.compare_digest(sig, sign(key, f"ui:{exp}:{nonce}:{epoch}")) else None


def csrf_token(state: AppState, cookie: str) -> str:
    return sign(admin_key_of(state), f"csrf:{cookie}")[:32]


def page(title: str, body: str, status: int = 200, user: bool = True) -> HTMLResponse:
    nav = f'<a href="{BASE}">sessions</a> · <form class="inline" method="post" ' \
          f'action="{BASE}/logout"><button>log out</button></form>' if user else ""
    html = (f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)} · "
            f"runloop-proxy</title><style>{STYLE}</style></head><body><header>"
            f"<b>runloop-proxy</b> inspector &nbsp; {nav}</header><main>{body}</main>"
            f"</body></html>")
    return HTMLResponse(html, status, headers={
        "Cache-Control": "no-store", "X-Frame-Options": "DENY",
        "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
                                   "img-src 'self' data:; form-action 'self'"})


def error(title: str, message: str, status: int) -> HTMLResponse:
    return page(title, f"<p class='err'>{escape(message)}</p>", status)


def link(path: str, **query: Any) -> str:
    """An inspector address, escaped for an attribute."""
    q = urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
    return escape(f"{BASE}{path}?{q}" if q else f"{BASE}{path}")


def when(ms: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000)) \
        if isinstance(ms, int) and ms > 0 else "—"


def tenant_name(state: AppState, namespace: str) -> str:
    """A namespace as the pages name it (``views.tenant_label``); a pass-through caller's
    with the host its calls go to (the host alone: a URL may carry a user and password)."""
    cfg, host = state.config, ""
    if cfg.passthrough is not None and cfg.passthrough.upstream in cfg.upstreams:
        host = urllib.parse.urlsplit(cfg.upstreams[cfg.passthrough.upstream].url).hostname \
            or ""
    return tenant_label(namespace, namespace in cfg.tenants, host)


async def guard(request: Request) -> tuple[AppState, str] | Response:
    """The app state and the login cookie; else where to go instead."""
    state = state_of(request)
    cookie = await login_ok(state, request)
    if cookie is None:
        return RedirectResponse(f"{BASE}/login", 303)
    if state.store is None:
        return error("no store", "No store is configured.", 404)
    return state, cookie


async def viewed(request: Request) -> tuple[AppState, str, str, str, SessionView] | Response:
    """A page about one stored session (``?id=``, ``?tenant=``): the login checked, the
    session read; else the page that says why not."""
    guarded = await guard(request)
    if isinstance(guarded, Response):
        return guarded
    state, cookie = guarded
    assert state.store is not None
    sid = stored_id(params.text(request, "id"))
    try:
        tenant = await tenant_of_session(state, request, sid)
        view = await state.store.session(tenant, sid)
    except StoreError as exc:
        return error("store unavailable", str(exc), 503)
    except ProxyError as exc:
        return error("not found", str(exc), int(getattr(exc, "status", 404)))
    if view is None:
        return error("not found", f"No session {name_of(sid)}.", 404)
    return state, cookie, tenant, sid, view
