"""The inspector's landing page: the totals per tenant and overall, and the sessions of the
tenant chosen (or of all), filtered by model, by when they were last used and by id, sorted
by any column, a page at a time (``listing`` decides which rows and in what order).

What it reads is bounded: each tenant's ``TALLIED`` most recently used sessions, for at most
``TENANTS`` tenants, ``READ`` sessions in all (the chosen tenant's first); the page says when
a figure counts fewer sessions than the tenant holds, and which tenants it left out. Pricing
each session's points (``savings``) is most of a first view's time; a session's priced row is
kept until the session changes, so a later view prices only those that did
(``bench/inspector_list.py``).
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import replace
from html import escape
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from .. import savings
from ..conversation.identity import name_of
from ..errors import StoreError
from ..pipeline.offload import offload
from ..pricing import PriceTable
from ..savings import DEFINITION, HEADLINE, Savings, percent, usd
from ..state import AppState, Listed
from . import params
from .inspector_shell import BASE, VALID_S, error, guard, link, page, tenant_name
from .listing import (
    ALL,
    SORT_WORDS,
    SORTS,
    WITHIN_WORDS,
    Query,
    Row,
    Total,
    matching,
    models_in,
    models_of,
    ordered,
    per_tenant,
    total,
)
from .views import saving, tokens

PAGE = 25
TALLIED = 500  # a tenant's most recently used sessions read for its list and its totals
TENANTS = 20  # tenants in the totals (configured ones first, then the most sessions)
READ = 1000  # sessions a page reads in all
LARGE_POINTS = 5000  # priced off the event loop past this many requests' points
TENANT_COOKIE = "rl_tenant"  # the tenant the page shows when none is asked
ORDER_WORDS = [("desc", "most / newest first"), ("asc", "least / oldest first")]
TEXT_SORTS = ("model", "tenant")  # first click: A to Z; any other column: the most first


def _tallied(tenants: Sequence[str], configured: set[str], stored: dict[str, int],
             chosen: str) -> list[str]:
    """The tenants the totals read, in the order they are read: the chosen one first, then
    configured ones, then those with the most sessions."""
    ranked = sorted(tenants, key=lambda t: (t != chosen, t not in configured,
                                            -stored.get(t, 0), t))
    return ranked[:TENANTS]


async def _read(state: AppState, tallied: list[str]) -> dict[str, list[Row]]:
    """Each tenant's rows, in order, while ``READ`` lasts (a tenant past it is not read)."""
    out: dict[str, list[Row]] = {}
    left = READ
    for t in tallied:
        if left <= 0:
            break
        out[t] = await _rows(state, t, min(TALLIED, left))
        left -= len(out[t])
    return out


async def _rows(state: AppState, tenant: str, most: int) -> list[Row]:
    """A tenant's ``most`` most recently used sessions, each priced (``savings``). A
    session's row is kept (``state.listed``) until the session changes (``store.stamps``)
    or the prices do: a page reads and prices only the sessions that changed since."""
    assert state.store is not None
    listed, _ = await state.store.list_sessions(tenant, 0, most)
    ids = [sid for sid, _ in listed]
    stamps = await state.store.stamps(tenant, ids)
    prices = state.config.prices or PriceTable.load()
    kept: dict[str, Row] = {}
    for sid, stamp in zip(ids, stamps, strict=True):
        hit = state.listed.get((tenant, sid))
        if hit is not None and hit.stamp == stamp and hit.prices is prices:
            kept[sid] = hit.row
    changed = [(sid, stamp) for sid, stamp in zip(ids, stamps, strict=True)
               if sid not in kept]
    overviews = await state.store.overviews(tenant, [sid for sid, _ in changed])

    def priced() -> None:
        for (sid, stamp), o in zip(changed, overviews, strict=True):
            row = kept[sid] = Row(tenant, sid, o.updated_ms, o.created_ms, o.messages,
                                  models_of(o.points), savings.of_points(o.points, prices))
            state.listed[(tenant, sid)] = Listed(stamp, prices, row)

    await offload(sum(o.requests for o in overviews) > LARGE_POINTS, priced)
    # the list's own time when the session's is not stored (a session from before it was)
    return [replace(kept[sid], last_ms=kept[sid].last_ms or ts) for sid, ts in listed]


class Links:
    """Addresses of this page that keep what the user chose, changing one thing."""

    def __init__(self, query: Query):
        self.query = query

    def to(self, **changes: Any) -> str:
        q = self.query
        values: dict[str, Any] = {"tenant": q.tenant, "model": q.model or None,
                                  "within": q.within or None, "q": q.search or None,
                                  "sort": None if q.sort == "last" else q.sort,
                                  "order": None if q.order == "desc" else q.order}
        values.update(changes)
        values = {k: v for k, v in values.items() if v not in (None, "", 0)}
        return link("", **values)

    def header(self, label: str, sort: str, css: str = "") -> str:
        """A column's heading, a link that sorts by it (again: the other way)."""
        first = "asc" if sort in TEXT_SORTS else "desc"
        now = self.query.sort == sort
        order = ("asc" if self.query.order == "desc" else "desc") if now else first
        arrow = (" ▼" if self.query.order == "desc" else " ▲") if now else ""
        cls = f" class='{css}'" if css else ""
        return (f"<th{cls}><a href='{self.to(sort=sort, order=order, page=None)}'>"
                f"{escape(label)}{arrow}</a></th>")


def _figures(bill: Savings) -> str:
    """A row's requests, tokens and bill: the cells every table of the page shares."""
    return (f"<td class='num'>{bill.requests:,}</td><td class='num'>"
            f"{tokens(bill.client_tokens)} → {tokens(bill.forwarded_tokens)}</td>"
            f"<td class='num'>{saving(bill.client_tokens, bill.forwarded_tokens)}</td>"
            f"<td class='num'>{'—' if bill.bill_saved is None else percent(bill.bill_saved)}"
            f"</td><td class='num'>{usd(bill.money_saved) if bill.priced else '—'}</td>")


FIGURE_HEADS = (f"<th class='num'>requests</th><th class='num'>prompt tokens sent → "
                f"forwarded</th><th class='num'>tokens saved</th><th class='num'>"
                f"{escape(HEADLINE)}</th><th class='num'>money saved</th>")


def _totals(state: AppState, links: Links, tallied: list[str], totals: dict[str, Total],
            stored: dict[str, int], tenants: Sequence[str]) -> str:
    out = [f"<h2>Totals</h2><table class='totals'><tr><th>tenant</th><th class='num'>"
           f"sessions</th>{FIGURE_HEADS}</tr>"]
    for t in tallied:
        one = totals.get(t, Total())
        held = stored.get(t, 0)
        count = f"{one.sessions:,}" if one.sessions >= held else \
            f"{one.sessions:,} of {held:,}"
        out.append(f"<tr><td><a href='{links.to(tenant=t, page=None)}'>"
                   f"{escape(tenant_name(state, t))}</a></td><td class='num'>{count}</td>"
                   f"{_figures(one.bill)}</tr>")
    overall = sum((totals.get(t, Total()) for t in tallied), Total())
    out.append(f"<tr class='overall'><td><b><a href='{links.to(tenant=ALL, page=None)}'>"
               f"all tenants</a></b></td><td class='num'>{overall.sessions:,}</td>"
               f"{_figures(overall.bill)}</tr></table>")
    notes = []
    if any(totals.get(t, Total()).sessions < stored.get(t, 0) for t in tallied):
        notes.append(f"A tenant is counted over its {TALLIED:,} most recently used sessions "
                     f"at most, and the page over {READ:,} in all.")
    left = [t for t in tenants if t not in tallied]
    if left:
        notes.append(f"{len(left):,} more tenant{'s' if len(left) != 1 else ''} "
                     f"({sum(stored.get(t, 0) for t in left):,} sessions) not in the totals: "
                     f"choose one to see its own.")
    out.append(f"<p class='muted'>The overall row is the sum of the rows above it. "
               f"{' '.join(notes)}</p>")
    return "".join(out)


def _form(state: AppState, query: Query, tenants: Sequence[str], stored: dict[str, int],
          models: list[str]) -> str:
    def options(values: Sequence[tuple[str, str]], chosen: str) -> str:
        return "".join(f"<option value='{escape(v)}'{' selected' if v == chosen else ''}>"
                       f"{escape(label)}</option>" for v, label in values)

    tenant_opts = [(ALL, "all tenants"), *((t, f"{tenant_name(state, t)} ({stored.get(t, 0)})")
                                           for t in tenants)]
    model_opts = [("", "any model"), *((m, m) for m in models)]
    if query.model and query.model not in models:
        model_opts.append((query.model, query.model))  # asked for: shown, even with no match
    return (f"<form method='get' action='{BASE}'>"
            f"<label>Tenant <select name='tenant'>{options(tenant_opts, query.tenant)}"
            f"</select></label> <label>Model <select name='model'>"
            f"{options(model_opts, query.model)}</select></label> "
            f"<label>Last used <select name='within'>"
            f"{options(list(WITHIN_WORDS.items()), query.within)}</select></label> "
            f"<label>Session id <input name='q' value='{escape(query.search)}'></label> "
            f"<label>Sort by <select name='sort'>"
            f"{options([(k, SORT_WORDS[k]) for k in SORTS], query.sort)}</select></label> "
            f"<select name='order' aria-label='order'>{options(ORDER_WORDS, query.order)}"
            f"</select> <button>Show</button></form>")


def _minute(ms: int) -> str:
    """A time in the list, to the minute ("2026-12-02 06:42 UTC"); its seconds are on the
    session's page."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ms / 1000)) if ms > 0 else "—"


def _table(state: AppState, links: Links, rows: Sequence[Row], every: bool) -> str:
    out = ["<table class='sessions'><tr>"]
    if every:
        out.append(links.header("tenant", "tenant"))
    out.append(f"<th>session</th>{links.header('messages', 'messages', 'num')}"
               f"{links.header('requests', 'requests', 'num')}<th class='num'>prompt tokens "
               f"sent → forwarded</th><th class='num'>tokens saved</th><th class='num'>"
               f"{escape(HEADLINE)}</th>{links.header('money saved', 'saved', 'num')}"
               f"{links.header('model', 'model')}{links.header('first seen', 'first')}"
               f"{links.header('last used', 'last')}</tr>")
    for r in rows:
        b = r.bill
        cells = f"<td>{escape(tenant_name(state, r.tenant))}</td>" if every else ""
        out.append(f"<tr>{cells}<td><a href='{link('/session', tenant=r.tenant, id=r.session_id)}'>"
                   f"{escape(name_of(r.session_id))}</a></td><td class='num'>{r.messages:,}</td>"
                   f"{_figures(b)}<td class='when'>{escape(r.model) or '—'}</td>"
                   f"<td class='when'>{_minute(r.first_ms)}</td>"
                   f"<td class='when'>{_minute(r.last_ms)}</td></tr>")
    out.append("</table>")
    return "".join(out)


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
    configured = set(state.config.tenants)
    tenants = sorted(configured | set(stored))
    chosen = params.text(request, "tenant")
    if chosen and chosen != ALL and chosen not in tenants:
        return error("not found", f"No tenant {chosen} (none configured, no sessions).", 404)
    remembered = urllib.parse.unquote(request.cookies.get(TENANT_COOKIE, ""))
    # the tenant chosen last stays the landing page's (a cookie), until another is chosen
    tenant = chosen or (remembered if remembered in tenants or remembered == ALL else "") \
        or (tenants[0] if tenants else "")
    query = Query(tenant, params.text(request, "model"), params.choice(request, "within", ""),
                  params.text(request, "q").strip(), params.choice(request, "sort", "last"),
                  params.choice(request, "order", "desc"), params.integer(request, "page", 0))
    ranked = _tallied(tenants, configured, stored, tenant)
    try:
        by_tenant = await _read(state, ranked)
    except StoreError as exc:
        return error("store unavailable", str(exc), 503)
    # shown in the same order whichever is chosen: configured, then the most sessions
    tallied = sorted(by_tenant, key=lambda t: (t not in configured, -stored.get(t, 0), t))
    every = tenant == ALL
    scope = [r for t in tallied for r in by_tenant[t]] if every else by_tenant.get(tenant, [])
    totals = per_tenant(r for t in tallied for r in by_tenant[t])
    links = Links(query)
    found = ordered(matching(scope, query, int(time.time() * 1000)), query.sort, query.order)
    shown = found[query.page * PAGE:(query.page + 1) * PAGE]
    listed = total(found)
    whose = "all tenants" if every else tenant_name(state, tenant)
    asked = [f"model {query.model}"] if query.model else []
    if query.within:
        asked.append(f"used in {WITHIN_WORDS[query.within]}")
    if query.search:
        asked.append(f"id containing “{query.search}”")
    n = len(found)
    body = ["<h1>Sessions</h1>", _totals(state, links, tallied, totals, stored, tenants),
            f"<h2>Sessions of {escape(whose)}</h2>",
            _form(state, query, tenants, stored, models_in(scope)),
            f"<p class='muted'>{n:,} session{'s' if n != 1 else ''} of {escape(whose)}"
            f"{escape(' (' + ', '.join(asked) + ')') if asked else ''}, by "
            f"{escape(SORT_WORDS[query.sort])}, "
            f"{'most or newest' if query.order == 'desc' else 'least or oldest'} first. "
            f"Prompt tokens are whole prompts summed over the session's requests: what the "
            f"client sent, and what the proxy forwarded.</p>",
            f"<p class='headline'>The {n} session{'s' if n != 1 else ''} listed: "
            f"<b>{escape(listed.bill.headline())}</b> · {escape(listed.bill.secondary())}</p>"
            f"<p class='muted'>{escape(HEADLINE.capitalize())}: {escape(DEFINITION)}.</p>",
            _table(state, links, shown, every)]
    pages = []
    if query.page > 0:
        pages.append(f"<a href='{links.to(page=query.page - 1)}'>← previous</a>")
    if (query.page + 1) * PAGE < n:
        pages.append(f"<a href='{links.to(page=query.page + 1)}'>next →</a>")
    body.append(f"<p>page {query.page + 1:,} of {max(0, n - 1) // PAGE + 1:,} "
                f"{' · '.join(pages)}</p>")
    answer = page("sessions", "".join(body))
    if chosen and (chosen in tenants or chosen == ALL):
        # quoted: a tenant's name may hold any character, a header only Latin-1
        answer.set_cookie(TENANT_COOKIE, urllib.parse.quote(chosen, safe=""),
                          max_age=VALID_S, path=BASE, httponly=True, samesite="strict",
                          secure=request.url.scheme == "https")
    return answer
