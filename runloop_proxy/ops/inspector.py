"""The session inspector: server-rendered pages behind the admin key (``/admin/ui``).

Sessions per tenant, newest first; a session's run loops, branches, the window the proxy builds
for its stored conversation beside what the client sends (loops reduced or omitted, results
elided with their refs, the marker and summary), the proxy's tool rounds, the compression
records, prompt tokens per request as an inline SVG chart, and "compact now" where summaries
are configured. Everything it loads comes from the proxy itself; no script runs in the page.

Login sets an HttpOnly, SameSite=Strict cookie signed with the admin key (valid 12 hours); the
one form that changes something carries a CSRF token derived from that cookie, and a POST from
another origin is refused.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from html import escape
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from ..conversation.identity import name_of, stored_id
from ..conversation.messages import Message, message_text
from ..conversation.runloops import preview, segment
from ..errors import InvalidRequest, ProxyError, StoreError
from ..history.store import SessionView
from ..history.summaries import OMIT, covers, summaries_of
from ..pipeline.tools import spliced_stored
from ..state import AppState, state_of
from ..window.builder import Window, build_window
from ..window.forms import SUMMARY_HEAD, TAG, Budget
from . import params
from .admin import admin_key_of, compact, tenant_of_session
from .views import pretty

Handler = Callable[[Request], Awaitable[Response]]
COOKIE = "rl_admin"
BASE = "/admin/ui"
VALID_S = 12 * 3600
PAGE = 25
SUMMARY_NOTE = f"{TAG} {SUMMARY_HEAD}"  # the message the window shows a summary in
STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:10px 20px}header a{color:#cfe0ff}
main{padding:16px 20px;max-width:1200px}h1{font-size:20px}h2{font-size:16px;margin-top:24px}
table{border-collapse:collapse;width:100%;background:#fff}td,th{border:1px solid #dde1e8;
padding:4px 8px;text-align:left;vertical-align:top}th{background:#eef1f5}
.omitted{color:#98a0ad}.reduced{background:#fff8e6}.whole{background:#eefaf0}
.open{background:#e8f1ff}pre{white-space:pre-wrap;background:#fff;border:1px solid #dde1e8;
padding:8px;max-height:420px;overflow:auto}.muted{color:#6b7280}form.inline{display:inline}
input,select,button{font:inherit;padding:3px 6px}.err{color:#b42318}
"""


def _sign(key: str, text: str) -> str:
    return hmac.new(key.encode(), text.encode(), hashlib.sha256).hexdigest()


def _cookie_ok(state: AppState, request: Request) -> str | None:
    """The login cookie when it is valid."""
    value = request.cookies.get(COOKIE, "")
    exp, _, sig = value.partition(".")
    try:
        key = admin_key_of(state)
    except ProxyError:
        return None
    if not exp.isdigit() or int(exp) < time.time():
        return None
    return value if hmac.compare_digest(sig, _sign(key, f"ui:{exp}")) else None


def _csrf(state: AppState, cookie: str) -> str:
    return _sign(admin_key_of(state), f"csrf:{cookie}")[:32]


def _page(title: str, body: str, status: int = 200, user: bool = True) -> HTMLResponse:
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


def _q(**params: Any) -> str:
    return urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})


async def login_form(request: Request) -> Response:
    state = state_of(request)
    try:
        admin_key_of(state)
    except ProxyError as exc:
        return _page("disabled", f"<p class='err'>{escape(str(exc))}</p>", 404, user=False)
    return _login(None)


def _login(error: str | None, status: int = 200) -> HTMLResponse:
    msg = f"<p class='err'>{escape(error)}</p>" if error else ""
    return _page("log in", f"<h1>Log in</h1>{msg}<form method='post' action='{BASE}/login'>"
                           f"<label>Admin key <input type='password' name='key' "
                           f"autocomplete='current-password' autofocus></label> "
                           f"<button type='submit'>Log in</button></form>", status, user=False)


async def login(request: Request) -> Response:
    state = state_of(request)
    try:
        key = admin_key_of(state)
    except ProxyError as exc:
        return _page("disabled", f"<p class='err'>{escape(str(exc))}</p>", 404, user=False)
    form = await _form(request)
    given = params.form_text(form, "key")
    if not hmac.compare_digest(given.encode(), key.encode()):
        return _login("That is not the admin key.", 401)
    exp = str(int(time.time()) + VALID_S)
    resp = RedirectResponse(BASE, 303)
    resp.set_cookie(COOKIE, f"{exp}.{_sign(key, f'ui:{exp}')}", max_age=VALID_S,
                    path="/admin/ui", httponly=True, samesite="strict",
                    secure=request.url.scheme == "https")
    return resp


async def logout(request: Request) -> Response:
    resp = RedirectResponse(f"{BASE}/login", 303)
    resp.delete_cookie(COOKIE, path="/admin/ui")
    return resp


async def _form(request: Request) -> dict[str, str]:
    """An urlencoded form (small: the login key, the compact button)."""
    body = await request.body()
    if len(body) > 16_384:
        return {}
    return {k: v[0] for k, v in urllib.parse.parse_qs(body.decode("utf-8", "replace")).items()}


def _guard(request: Request) -> tuple[AppState, str] | Response:
    state = state_of(request)
    cookie = _cookie_ok(state, request)
    if cookie is None:
        return RedirectResponse(f"{BASE}/login", 303)
    if state.store is None:
        return _page("no store", "<p class='err'>No store is configured.</p>", 404)
    return state, cookie


async def sessions(request: Request) -> Response:
    guard = _guard(request)
    if isinstance(guard, Response):
        return guard
    state, _ = guard
    assert state.store is not None
    try:
        stored = dict(await state.store.namespaces())
    except StoreError as exc:
        return _page("store unavailable", f"<p class='err'>{escape(str(exc))}</p>", 503)
    tenants = sorted(set(state.config.tenants) | set(stored))
    tenant = params.text(request, "tenant") or (tenants[0] if tenants else "")
    search = params.text(request, "q").strip()
    page = params.integer(request, "page", 0)
    options = "".join(f"<option value='{escape(t)}'{' selected' if t == tenant else ''}>"
                      f"{escape(t)} ({stored.get(t, 0)})</option>" for t in tenants)
    rows, total = await state.store.list_sessions(tenant, 0 if search else page * PAGE,
                                                  5000 if search else PAGE)
    if search:
        rows = [r for r in rows if search.lower() in name_of(r[0]).lower()]
        total = len(rows)
        rows = rows[page * PAGE:(page + 1) * PAGE]
    body = [f"<h1>Sessions</h1><form method='get' action='{BASE}'>"
            f"<label>Tenant <select name='tenant'>{options}</select></label> "
            f"<label>Session id <input name='q' value='{escape(search)}'></label> "
            f"<button>Show</button></form>",
            f"<p class='muted'>{total} session(s), newest first</p><table><tr><th>session"
            f"</th><th>last used</th></tr>"]
    for sid, ts in rows:
        link = f"{BASE}/session?{_q(tenant=tenant, id=sid)}"
        body.append(f"<tr><td><a href='{escape(link)}'>{escape(name_of(sid))}</a></td>"
                    f"<td>{escape(_when(ts))}</td></tr>")
    body.append("</table>")
    pages = []

    def at(k: int) -> str:
        return escape(f"{BASE}?{_q(tenant=tenant, q=search or None, page=k)}")
    if page > 0:
        pages.append(f"<a href='{at(page - 1)}'>← newer</a>")
    if (page + 1) * PAGE < total:
        pages.append(f"<a href='{at(page + 1)}'>older →</a>")
    body.append(f"<p>{' · '.join(pages)}</p>")
    return _page("sessions", "".join(body))


def _when(ms: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000)) if ms else "—"


def window_of(state: AppState, tenant: str, view: SessionView,
              stored: dict[str, str]) -> tuple[Window, list[Message]]:
    """The window the proxy builds for the stored conversation (its latest request), with
    the stored summaries of its lineage."""
    spec = state.config.tenants.get(tenant) or state.config.passthrough
    assert spec is not None
    model = next((r.get("model") for r in reversed(view.records) if r.get("model")), "gpt-4o")
    enc, exact = state.tokens.encoding(model, spec.encoding_for(model))
    messages, keys, protected = spliced_stored(view.messages, view.internal)
    counts = [state.tokens.message(enc, m, k) for m, k in zip(messages, keys, strict=True)]
    budget = Budget.for_request(spec.policy, spec.context_window(model), None, 0,
                                1.0 if exact else state.tokens.factor(model))
    from ..pipeline.tokens import WindowTokens

    summaries, compactions = summaries_of(spec.policy, stored, covers(
        keys, segment(messages), spec.policy.omission_batch))
    return build_window(messages, keys, counts, spec.policy, budget,
                        WindowTokens(state.tokens, enc, state.cuts), protected=protected,
                        summaries=summaries, compactions=compactions), messages


def chart(points: list[dict[str, int]], width: int = 720, height: int = 160) -> str:
    """Prompt tokens per request, client (grey) vs forwarded (blue), as inline SVG."""
    if not points:
        return "<p class='muted'>No requests recorded yet.</p>"
    top = max(max(p["client"], p["forwarded"]) for p in points) or 1
    step = width / max(len(points) - 1, 1)

    def line(key: str) -> str:
        return " ".join(f"{i * step:.1f},{height - p[key] / top * (height - 10):.1f}"
                        for i, p in enumerate(points))
    last = points[-1]
    return (f"<svg role='img' aria-label='prompt tokens per request' width='{width + 60}' "
            f"height='{height + 24}' viewBox='-50 -4 {width + 60} {height + 24}' "
            f"xmlns='http://www.w3.org/2000/svg'><line x1='0' y1='{height}' x2='{width}' "
            f"y2='{height}' stroke='#999'/><text x='-48' y='10' font-size='11'>{top:,}</text>"
            f"<text x='-48' y='{height}' font-size='11'>0</text>"
            f"<polyline fill='none' stroke='#9aa3af' stroke-width='2' points='{line('client')}'/>"
            f"<polyline fill='none' stroke='#2563eb' stroke-width='2' "
            f"points='{line('forwarded')}'/><text x='0' y='{height + 18}' font-size='11'>"
            f"{len(points)} requests · last: client {last['client']:,}, forwarded "
            f"{last['forwarded']:,} tokens</text></svg>")


async def _viewed(request: Request) -> tuple[AppState, str, str, str, SessionView] | Response:
    """A page about one stored session (``?id=``, ``?tenant=``): the login checked, the
    session read; else the page that says why not."""
    guard = _guard(request)
    if isinstance(guard, Response):
        return guard
    state, cookie = guard
    assert state.store is not None
    sid = stored_id(params.text(request, "id"))
    try:
        tenant = await tenant_of_session(state, request, sid)
        view = await state.store.session(tenant, sid)
    except StoreError as exc:
        return _page("store unavailable", f"<p class='err'>{escape(str(exc))}</p>", 503)
    except ProxyError as exc:
        return _page("not found", f"<p class='err'>{escape(str(exc))}</p>",
                     int(getattr(exc, "status", 404)))
    if view is None:
        return _page("not found", f"<p class='err'>No session {escape(name_of(sid))}.</p>", 404)
    return state, cookie, tenant, sid, view


async def session(request: Request) -> Response:
    viewed = await _viewed(request)
    if isinstance(viewed, Response):
        return viewed
    state, cookie, tenant, sid, view = viewed
    assert state.store is not None
    if tenant not in state.config.tenants and state.config.passthrough is None:
        # a tenant taken out of the config: its sessions stay until they expire, and no
        # window is built for them (its messages still open one by one)
        return _page("not configured", f"<p class='err'>Tenant {escape(tenant)} is not "
                     f"configured: no window is built for its sessions.</p>", 404)
    try:
        points = await state.store.points(tenant, sid)
        stored = await state.store.summaries(tenant, sid)
    except StoreError as exc:
        return _page("store unavailable", f"<p class='err'>{escape(str(exc))}</p>", 503)
    window, messages = window_of(state, tenant, view, stored)
    loops = segment(messages)
    out = [f"<h1>Session {escape(name_of(sid))}</h1><p class='muted'>tenant {escape(tenant)} · "
           f"{len(messages)} messages · {len(loops)} run loops · {len(view.branches)} "
           f"branch(es) · created {_when(view.created_ms)} · last used "
           f"{_when(view.updated_ms)}</p>", "<h2>Prompt tokens per request</h2>",
           chart(points)]
    out.append(f"<h2>What the client sends beside what goes upstream</h2><p class='muted'>"
               f"The window the proxy builds for the stored conversation: client "
               f"{window.tokens_in:,} tokens, upstream {window.tokens_out:,}; "
               f"{window.omitted_loops} loop(s) omitted, {window.reduced_loops} reduced, "
               f"{len(window.elided)} result(s) elided.</p>")
    marker = "\n".join(t for t in map(message_text, window.messages)
                       if "Earlier turns are not shown" in t or t.startswith(SUMMARY_NOTE))
    if marker:
        out.append(f"<p>Marker and summary:</p><pre>{escape(marker)}</pre>")
    elided = {e.position: e for e in window.elided}
    out.append("<table><tr><th>loop</th><th>user</th><th>tool calls</th><th>final reply</th>"
               "<th>in the window</th></tr>")
    for lp in loops:
        fate = "omitted" if lp.index < window.omitted_loops else "reduced" \
            if lp.index < window.omitted_loops + window.reduced_loops else lp.status.value \
            if lp.status.value == "open" else "whole"
        calls = []
        for i in lp.positions:
            m = messages[i]
            if m.get("role") == "tool":
                size = len(message_text(m))
                cut = elided.get(i)
                link = f"{BASE}/message?{_q(tenant=tenant, id=sid, pos=i)}"
                tag = f" — elided, ref <code>{escape(cut.ref)}</code>" if cut else ""
                calls.append(f"<a href='{escape(link)}'>{escape(str(m.get('tool_call_id')))}"
                             f"</a> {size:,} chars{tag}")
        users = [messages[i] for i in lp.user_positions]
        final = messages[lp.final_position] if lp.final_position is not None else None
        out.append(f"<tr class='{fate}'><td>{lp.index}</td><td>"
                   f"{escape(preview(users[0] if users else None))}</td><td>"
                   f"{'<br>'.join(calls) or '—'}</td><td>{escape(preview(final))}</td>"
                   f"<td>{fate}</td></tr>")
    out.append("</table>")
    out.append(_summaries(state, tenant, sid, stored, cookie))
    out.append("<h2>The proxy's tool rounds</h2>")
    if view.internal:
        for at, entry in list(view.internal.items())[-20:]:
            out.append(f"<details><summary>after message {escape(at[:12])}…</summary><pre>"
                       f"{escape(str(entry))}</pre></details>")
    else:
        out.append("<p class='muted'>None: the model has not called recall_tool_call or "
                   "search_history in this session.</p>")
    out.append("<h2>Branches</h2><table><tr><th>branch</th><th>messages</th><th>forked from"
               "</th><th>at</th></tr>")
    for bid, b in view.branches.items():
        out.append(f"<tr><td>{escape(str(bid))}</td><td>{escape(str(b.get('length')))}</td>"
                   f"<td>{escape(str(b.get('parent')))}</td>"
                   f"<td>{escape(str(b.get('fork_at')))}</td></tr>")
    out.append("</table><h2>Compression records</h2><table><tr><th>when</th><th>kind</th>"
               "<th>tokens before → after</th><th>reason</th></tr>")
    for rec in view.records[-50:]:
        out.append(f"<tr><td>{_when(rec.get('ts'))}</td><td>{escape(str(rec.get('kind')))}</td>"
                   f"<td>{escape(str(rec.get('tokens_before')))} → "
                   f"{escape(str(rec.get('tokens_after')))}</td>"
                   f"<td>{escape(str(rec.get('reason') or ''))}</td></tr>")
    out.append("</table>")
    return _page(f"session {name_of(sid)}", "".join(out))


def _summaries(state: AppState, tenant: str, sid: str, stored: dict[str, str],
               cookie: str) -> str:
    import orjson

    spec = state.config.tenants.get(tenant) or state.config.passthrough
    out = ["<h2>Summaries</h2>"]
    asked = {k: v for k, v in stored.items() if k.startswith(OMIT)}
    for name, raw in sorted(stored.items(), key=lambda kv: int(kv[0].partition(":")[0])
                            if kv[0] not in asked else -1):
        e = name.partition(":")[0]
        if name in asked:
            e = name[len(OMIT):].partition(":")[0]
            out.append(f"<p>compact now: loops 0–{escape(e)} omitted from message "
                       f"{escape(raw)} on</p>")
            continue
        if raw == "late":
            out.append(f"<p class='muted'>loops 0–{escape(e)}: late (arrived after its "
                       f"omission event)</p>")
            continue
        s = orjson.loads(raw)
        out.append(f"<p>loops 0–{escape(e)} · {escape(str(s.get('summarizer')))} · "
                   f"{escape(str(s.get('latency_ms')))} ms</p><pre>{escape(s['text'])}</pre>")
    if spec is not None and spec.policy.summary_model:
        out.append(f"<form method='post' action='{BASE}/compact'><input type='hidden' "
                   f"name='csrf' value='{_csrf(state, cookie)}'><input type='hidden' name='tenant'"
                   f" value='{escape(tenant)}'><input type='hidden' name='id' "
                   f"value='{escape(sid)}'><button>Compact now</button> <span class='muted'>"
                   f"makes the summaries this session lacks and omits the closed turns they "
                   f"cover from the next request on</span></form>")
    elif len(out) == 1:
        out.append("<p class='muted'>Summaries are off for this tenant (summary_model).</p>")
    return "".join(out)


async def message(request: Request) -> Response:
    viewed = await _viewed(request)
    if isinstance(viewed, Response):
        return viewed
    _, _, tenant, sid, view = viewed
    pos = params.integer(request, "pos", -1)
    messages = spliced_stored(view.messages, view.internal)[0]
    if not 0 <= pos < len(messages):
        return _page("not found", "<p class='err'>No such message.</p>", 404)
    m = messages[pos]  # numbered as the session page shows them: the proxy's too
    back = f"{BASE}/session?{_q(tenant=tenant, id=sid)}"
    facts = [f"<dt>{label}</dt><dd><code>{escape(str(value))}</code></dd>"
             for label, value in (("name", m.get("name")),
                                  ("answers the call", m.get("tool_call_id"))) if value]
    out = [f"<p><a href='{escape(back)}'>← session {escape(name_of(sid))}</a></p>"
           f"<h1>Message {pos} ({escape(str(m.get('role')))})</h1>",
           f"<dl>{''.join(facts)}</dl>" if facts else ""]
    text = message_text(m)
    if text:
        out.append(f"<h2>Content</h2><pre>{escape(pretty(text))}</pre>")
    for call in m.get("tool_calls") or []:
        fn = (call.get("function") if isinstance(call, dict) else None) or {}
        out.append(f"<h2>Calls {escape(str(fn.get('name')))} "
                   f"<code>{escape(str(call.get('id')))}</code></h2>"
                   f"<pre>{escape(pretty(str(fn.get('arguments') or '')))}</pre>")
    return _page("message", "".join(out))


async def compact_now(request: Request) -> Response:
    guard = _guard(request)
    if isinstance(guard, Response):
        return guard
    state, cookie = guard
    origin = request.headers.get("origin")
    if origin and urllib.parse.urlsplit(origin).netloc != request.url.netloc:
        return _page("refused", "<p class='err'>A form from another site.</p>", 403)
    form = await _form(request)
    if not hmac.compare_digest(params.form_text(form, "csrf"), _csrf(state, cookie)):
        return _page("refused", "<p class='err'>The form has expired; reload the page.</p>",
                     403)
    tenant, sid = params.form_text(form, "tenant"), stored_id(params.form_text(form, "id"))
    try:
        await compact(state, tenant, sid)
    except (StoreError, ProxyError) as exc:
        return _page("error", f"<p class='err'>{escape(str(exc))}</p>", 409)
    return RedirectResponse(f"{BASE}/session?{_q(tenant=tenant, id=sid)}", 303)


def _bad_parameters_answered(handler: Handler) -> Handler:
    """A page whose parameter does not parse (``params``) answers 400 and says which."""
    @functools.wraps(handler)
    async def page(request: Request) -> Response:
        try:
            return await handler(request)
        except InvalidRequest as exc:
            return _page("bad request", f"<p class='err'>{escape(str(exc))}</p>", 400)
    return page


def inspector_routes() -> list[BaseRoute]:
    pages: list[tuple[str, Handler, str]] = [
        (BASE, sessions, "GET"), (f"{BASE}/login", login_form, "GET"),
        (f"{BASE}/login", login, "POST"), (f"{BASE}/logout", logout, "POST"),
        (f"{BASE}/session", session, "GET"), (f"{BASE}/message", message, "GET"),
        (f"{BASE}/compact", compact_now, "POST")]
    return [Route(path, _bad_parameters_answered(h), methods=[method])
            for path, h, method in pages]
