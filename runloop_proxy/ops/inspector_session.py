"""The inspector's page about one session: prompt tokens per request, the last request's
window rebuilt the way the proxy built it (loops omitted or reduced, results elided with their
refs, the marker and summary), the summaries and "compact now", the proxy's tool rounds, the
compression records and the branches."""

from __future__ import annotations

from html import escape
from typing import Any, cast

import orjson
from starlette.requests import Request
from starlette.responses import Response

from .. import savings
from ..config import TenantSpec
from ..conversation.identity import name_of
from ..conversation.messages import Message, message_text, tool_calls_of
from ..conversation.runloops import RunLoop, preview, segment
from ..errors import StoreError
from ..history.store import SessionView
from ..history.summaries import MODEL, OMIT
from ..pipeline.offload import offload
from ..pipeline.shadow import Step
from ..pipeline.tools import spliced_stored
from ..pricing import PriceTable
from ..savings import Savings
from ..state import AppState
from ..window.forms import SUMMARY_HEAD, TAG
from .inspector_chart import chart
from .inspector_message import message_html
from .inspector_shell import BASE, csrf_token, error, link, page, tenant_name, viewed, when
from .inspector_window import DEFAULT_MODEL, FATES, Rebuilt, rebuild, spec_of
from .inspector_window import fate as loop_fate
from .views import branch_origin, describe, folded, loop_span, saving, tokens

SUMMARY_NOTE = f"{TAG} {SUMMARY_HEAD}"  # the message the window shows a summary in
MARKER = "Earlier turns are not shown"
RECORDS_SHOWN = 50
ROUNDS_SHOWN = 20


async def session(request: Request) -> Response:
    seen = await viewed(request)
    if isinstance(seen, Response):
        return seen
    state, cookie, tenant, sid, view = seen
    assert state.store is not None
    try:
        points = await state.store.points(tenant, sid)
        stored = await state.store.summaries(tenant, sid)
    except StoreError as exc:
        return error("store unavailable", str(exc), 503)
    # rebuilding a large session's window is the work of a large request: off the loop
    return page(f"session {name_of(sid)}", await offload(view.large, lambda: _body(
        state, cookie, tenant, sid, view, points, stored)))


def _body(state: AppState, cookie: str, tenant: str, sid: str, view: SessionView,
          points: list[dict[str, Any]], stored: dict[str, str]) -> str:
    spec, note = spec_of(state, tenant)
    rebuilt = rebuild(state, spec, tenant, sid, view, points, stored)
    messages = spliced_stored(view.messages, view.internal)[0]
    loops = segment(messages)
    out = [f"<h1>Session {escape(name_of(sid))}</h1><p class='muted'>tenant "
           f"{escape(tenant_name(state, tenant))} · {len(messages)} messages · {len(loops)} "
           f"run loop{'s' if len(loops) != 1 else ''} · {len(view.branches)} "
           f"branch{'es' if len(view.branches) != 1 else ''} · created "
           f"{when(view.created_ms)} · last used {when(view.updated_ms)}</p>",
           headline_html(session_savings(state, points)),
           "<h2>Prompt tokens per request</h2>", chart(points),
           _window(rebuilt, len(points)), note, _loops(tenant, sid, messages, loops, rebuilt),
           _summaries(state, spec, tenant, sid, stored, cookie),
           _rounds(tenant, sid, view, messages), _records(view, rebuilt),
           _shadows(state, tenant, sid),
           _branches(view)]
    return "".join(out)


def session_savings(state: AppState, points: list[dict[str, Any]]) -> Savings:
    """The session's headline figure, at the proxy's prices (``savings``)."""
    return savings.of_points(points, state.config.prices or PriceTable.load())


def headline_html(s: Savings) -> str:
    """The headline and its secondary figure, labelled, with what the headline means."""
    return (f"<p class='headline'><b>{escape(s.headline())}</b> · {escape(s.secondary())}"
            f"</p><p class='muted'>{escape(savings.HEADLINE.capitalize())}: "
            f"{escape(savings.DEFINITION)}.</p>")


def _window(rebuilt: Rebuilt, requests: int) -> str:
    w, frame = rebuilt.window, rebuilt.frame
    out = ["<h2>The last request's window</h2>"]
    if rebuilt.point is None:
        out.append(f"<p>No request of this session kept what its window was built in: below is "
                   f"the window the proxy would build for the stored conversation with "
                   f"{escape(DEFAULT_MODEL)} and no tools — client {tokens(rebuilt.client)} "
                   f"tokens, forwarded {tokens(rebuilt.forwarded)}.</p>")
    elif rebuilt.chained:
        return "".join(out) + (
            f"<p>Request {requests} chained on a stored response (previous_response_id): "
            f"the conversation before it lives upstream, and the request went as it came — "
            f"{tokens(rebuilt.client)} tokens sent and forwarded.</p>")
    else:
        tools = f"the client's tool schemas ({tokens(frame.tools_tokens)} tokens)" \
            if frame.tools_tokens else "no tools of the client's"
        reserve = f"{tokens(frame.max_output)} tokens reserved for the output" \
            if frame.max_output else "the policy's output reserve"
        out.append(f"<p>Request {requests} (the chart's last point), rebuilt the way the "
                   f"proxy built it — {escape(frame.model)}, {tools}, {reserve}: the client "
                   f"sent <b>{tokens(rebuilt.client)}</b> tokens, <b>"
                   f"{tokens(rebuilt.forwarded)}</b> went upstream "
                   f"({saving(rebuilt.client, rebuilt.forwarded)} saved).</p>")
        counted = (rebuilt.point or {}).get("client"), (rebuilt.point or {}).get("forwarded")
        if counted != (rebuilt.client, rebuilt.forwarded):
            out.append(f"<p class='muted'>When it was answered the proxy counted client "
                       f"{tokens(counted[0])}, forwarded {tokens(counted[1])}: what the "
                       f"window depends on has changed since (summaries made, the model's "
                       f"token calibration).</p>")
    kept = " (each kept whole: its ref gets it back)" if w.elided else ""
    out.append(f"<p>{w.omitted_loops} loop{'s' if w.omitted_loops != 1 else ''} omitted "
               f"behind a marker, {w.reduced_loops} reduced to question and answer, "
               f"{len(w.elided)} tool result{'s' if len(w.elided) != 1 else ''} "
               f"elided{kept}.</p>")
    d = w.dropped
    if d.positions:
        loop = next((lp.index for lp in segment(rebuilt.messages)
                     if d.positions[0] in lp.positions), None)
        where = f"inside loop {loop}" if loop is not None else "inside the open loop"
        out.append(f"<p>{d.exchanges} tool exchange{'s' if d.exchanges != 1 else ''} "
                   f"({len(d.positions)} messages, {tokens(d.tokens)} tokens elided) "
                   f"dropped {where}, messages {d.positions[0]}–{d.positions[-1]}: a note "
                   f"on the question before them names their calls, and recall_tool_call "
                   f"returns any of them.</p>")
    marker = "\n".join(t for t in map(message_text, w.messages)
                       if MARKER in t or t.startswith(SUMMARY_NOTE))
    if marker:
        out.append(f"<p>The marker and summary the model reads in place of the omitted "
                   f"loops:</p><pre>{escape(marker)}</pre>")
    return "".join(out)


def _taken(lp: RunLoop, rebuilt: Rebuilt, fate: str) -> str:
    """A loop's fate in words, with what the window took out of it when shown in full:
    the exchanges dropped and the results elided."""
    if fate not in ("open", "whole"):
        return FATES[fate]
    dropped = rebuilt.dropped_in(lp.positions)
    exchanges = sum(1 for i in dropped if rebuilt.messages[i].get("role") == "assistant")
    inside = set(lp.positions)
    elided = sum(1 for e in rebuilt.window.elided if e.position in inside)
    parts = ([f"{exchanges} tool exchange{'s' if exchanges != 1 else ''} dropped "
              f"({len(dropped)} messages)"] if dropped else []) + (
        [f"{elided} tool result{'s' if elided != 1 else ''} elided"] if elided else [])
    if not parts:
        return FATES[fate]
    head = "the open loop" if fate == "open" else "shown"
    return f"{head}: {', '.join(parts)}"


def _loops(tenant: str, sid: str, messages: list[Message], loops: list[RunLoop],
           rebuilt: Rebuilt) -> str:
    elided = {e.position: e for e in rebuilt.window.elided}
    dropped = set(rebuilt.window.dropped.positions)
    names = {str(c.get("id")): str((c.get("function") or {}).get("name"))
             for m in messages for c in tool_calls_of(m)}
    out = ["<table><tr><th>loop</th><th>the user asked</th><th>tool results</th>"
           "<th>the final reply</th><th>in the last request's window</th></tr>"]
    for lp in loops:
        fate = loop_fate(lp, rebuilt)
        results = []
        for i in lp.positions:
            m = messages[i]
            if m.get("role") != "tool":
                continue
            cid = str(m.get("tool_call_id"))
            cut = elided.get(i)
            ref = f" — elided, ref <code>{escape(cut.ref)}</code>" if cut else \
                " — dropped" if i in dropped else ""
            results.append(f"<a href='{link('/message', tenant=tenant, id=sid, pos=i)}'>"
                           f"{escape(cid)}</a> {escape(names.get(cid, 'tool'))}, "
                           f"{tokens(rebuilt.count(m))} tokens{ref}")
        users = [messages[i] for i in lp.user_positions]
        final = messages[lp.final_position] if lp.final_position is not None else None
        out.append(f"<tr class='{fate}'><td>{lp.index}</td><td>"
                   f"{escape(preview(users[0] if users else None))}</td><td>"
                   f"{folded(results)}</td><td>{escape(preview(final))}</td>"
                   f"<td>{escape(_taken(lp, rebuilt, fate))}</td></tr>")
    out.append("</table>")
    return "".join(out)


def _summaries(state: AppState, spec: TenantSpec, tenant: str, sid: str,
               stored: dict[str, str], cookie: str) -> str:
    out = ["<h2>Summaries</h2>"]
    for name, raw in sorted(stored.items(), key=lambda kv: _count(kv[0])):
        e = _count(name)
        span = escape(loop_span([0, e - 1])) if e > 0 else "no loops"
        model = name.startswith(MODEL)
        if name.startswith(OMIT):
            out.append(f"<p>compact now: {span} omitted from message {escape(raw)} on</p>")
        elif raw == "late":
            out.append(f"<p class='muted'>{span}: late (made after the omission it was "
                       f"for)</p>")
        else:
            try:
                s = orjson.loads(raw)
            except orjson.JSONDecodeError:
                s = {}
            if not isinstance(s, dict):
                s = {}
            latency = s.get("latency_ms")
            took = f" · {latency} ms" if isinstance(latency, (int, float)) else ""
            kind = "the model's summary (windows take the newest from their next " \
                "omission on) · " if model else ""
            out.append(f"<p>{kind}{span}{escape(_not_held(s))} · by "
                       f"{escape(str(s.get('summarizer') or 'the summariser'))}"
                       f"{took}</p><pre>{escape(str(s.get('text', '')))}</pre>")
    if spec.policy.summary_model:
        out.append(f"<form method='post' action='{BASE}/compact'><input type='hidden' "
                   f"name='csrf' value='{csrf_token(state, cookie)}'><input type='hidden' "
                   f"name='tenant' value='{escape(tenant)}'><input type='hidden' name='id' "
                   f"value='{escape(sid)}'><button>Compact now</button> <span class='muted'>"
                   f"makes the summaries this session lacks and omits the closed turns they "
                   f"cover from the next request on</span></form>")
    elif len(out) == 1:
        out.append("<p class='muted'>Summaries are off for this tenant (summary_model).</p>")
    return "".join(out)


def _not_held(record: dict[str, Any]) -> str:
    """What a model's summary does not hold of the loops its field names (said in its
    text too): the loops its call was not given, the identifiers it lost."""
    gone = record.get("not_held")
    if not isinstance(gone, dict):
        return ""
    loops, n = gone.get("loops"), gone.get("identifiers_lost")
    parts = [f"{loop_span(loops)} not held"] if isinstance(loops, list) and len(loops) == 2 \
        else []
    if isinstance(n, int) and n:
        parts.append(f"{n:,} identifier{'s' if n != 1 else ''} not held")
    return f" ({', '.join(parts)}: search_history finds them)" if parts else ""


def _count(name: str) -> int:
    """The loop count a summary's (or an omission's) field names: ``e:cover``."""
    head = name[len(OMIT):] if name.startswith(OMIT) \
        else name[len(MODEL):] if name.startswith(MODEL) else name
    e = head.partition(":")[0]
    return int(e) if e.isascii() and e.isdigit() else -1


def _rounds(tenant: str, sid: str, view: SessionView, messages: list[Message]) -> str:
    """The proxy's tool rounds, where they were spliced back (as the message pages number
    them), or on another branch."""
    out = ["<h2>The proxy's tool rounds</h2>"]
    if not view.internal:
        return "".join(out) + ("<p class='muted'>The model has not called "
                               "recall_tool_call or search_history in this session.</p>")
    at = {id(m): i for i, m in enumerate(messages)}
    for entry in list(view.internal.values())[-ROUNDS_SHOWN:]:
        shown = [m for part in ("before", "after") for m in _list(entry, part)]
        if isinstance(entry, dict) and isinstance(entry.get("replace"), dict):
            shown.append(entry["replace"])
        where = sorted(at[id(m)] for m in shown if id(m) in at)
        heading = f"messages {where[0]}–{where[-1]}" if len(where) > 1 else \
            f"message {where[0]}" if where else "on another branch"
        body = "".join(message_html(m, at.get(id(m)), link(
            "/message", tenant=tenant, id=sid, pos=at[id(m)]) if id(m) in at else None)
            for m in shown)
        out.append(f"<details><summary>{heading}: {len(shown)} message"
                   f"{'s' if len(shown) != 1 else ''}</summary>{body}</details>")
    return "".join(out)


def _list(entry: Any, part: str) -> list[Message]:
    items = entry.get(part) if isinstance(entry, dict) else None
    return [cast(Message, m) for m in items if isinstance(m, dict)] \
        if isinstance(items, list) else []


def _records(view: SessionView, rebuilt: Rebuilt) -> str:
    recs = view.records
    out = ["<h2>Compression records</h2>"]
    if not recs:
        w = rebuilt.window
        why = ("Nothing recorded, though the window above leaves loops out: requests stored "
               "before records named the request point they were taken at recorded only "
               "the steps taken at their own point."
               if w.omitted_loops or w.reduced_loops or w.elided else
               "No request of this session has needed its window to change anything the "
               "client sent.")
        return "".join(out) + f"<p class='muted'>{why}</p>"
    if len(recs) > RECORDS_SHOWN:
        out.append(f"<p class='muted'>The last {RECORDS_SHOWN} of {len(recs)}.</p>")
    out.append("<table><tr><th>when</th><th>what</th><th>where</th><th class='num'>tokens "
               "before → after</th><th>why</th></tr>")
    for rec in recs[-RECORDS_SHOWN:]:
        d = describe(rec)
        out.append(f"<tr><td>{when(rec.get('ts'))}</td><td>{escape(d.what)}</td><td>"
                   f"{escape(d.where)}</td><td class='num'>{escape(d.tokens)}</td><td>"
                   f"{escape(d.why)}</td></tr>")
    out.append("</table>")
    return "".join(out)


def _step_html(step: Step | None) -> str:
    if step is None:
        return ""
    calls = "".join(f"<div><code>{escape(t.name)}({escape(t.arguments)})</code></div>"
                    for t in step.tools)
    refusal = "<div><b>refused</b></div>" if step.refusal else ""
    return f"{calls}{refusal}<div>{escape(step.text)}</div>"


def _shadows(state: AppState, tenant: str, sid: str) -> str:
    """This session's shadow comparisons (policy.shadow_rate), a disagreement's two next
    steps side by side: the compressed request's and the full one's."""
    recs = state.shadows.of_session(tenant, sid)
    if not recs:
        return ""
    out = ["<h2>Shadow comparisons</h2><table><tr><th>outcome</th><th>levers</th><th>basis"
           "</th><th class='num'>similarity</th><th class='num'>tokens</th><th>compressed "
           "window's next step</th><th>full window's next step</th></tr>"]
    for r in recs:
        sim = "" if r.similarity is None else f"{r.similarity:.2f}"
        basis = r.basis.value if r.basis is not None else escape(r.error or "")
        out.append(f"<tr><td>{r.outcome.value}</td><td>{escape(', '.join(r.levers))}</td>"
                   f"<td>{basis}</td><td class='num'>{sim}</td><td class='num'>{r.tokens}"
                   f"</td><td>{_step_html(r.compressed)}</td><td>{_step_html(r.full)}</td>"
                   "</tr>")
    out.append("</table>")
    return "".join(out)


def _branches(view: SessionView) -> str:
    out = ["<h2>Branches</h2><table><tr><th>branch</th><th class='num'>messages</th>"
           "<th>where it comes from</th></tr>"]
    for bid, b in view.branches.items():
        head = " (the head)" if str(bid) == str(view.head) else ""
        out.append(f"<tr><td>{escape(str(bid))}{head}</td><td class='num'>"
                   f"{escape(tokens(b.get('length')))}</td><td>"
                   f"{escape(branch_origin(b))}</td></tr>")
    out.append("</table>")
    return "".join(out)
