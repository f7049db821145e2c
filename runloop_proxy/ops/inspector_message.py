"""A stored message as a person reads it: its role, who it answers, its text (a JSON result
indented), the calls it makes with their arguments indented, and whatever else it carries
(a Responses message's items) folded away — every field escaped, none shown as a raw dict."""

from __future__ import annotations

from collections.abc import Callable
from html import escape
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from ..conversation.identity import name_of
from ..conversation.messages import Message, message_text, tool_calls_of
from ..conversation.runloops import segment
from ..errors import StoreError
from ..history.store import SessionView
from ..pipeline.offload import offload
from ..pipeline.tools import spliced_stored
from . import params
from .inspector_shell import error, link, page, viewed
from .inspector_window import FATES, Rebuilt, fate, rebuild, spec_of
from .views import folded, pretty

SHOWN = {"role", "content", "name", "tool_call_id", "tool_calls", "refusal"}
ROLES = {"system": "system prompt", "user": "user", "assistant": "assistant",
         "tool": "tool result", "developer": "developer prompt"}


def role_of(m: Message) -> str:
    role = str(m.get("role"))
    return ROLES.get(role, role)


def content_html(m: Message) -> str:
    """The message's content: its text (JSON indented), each other part named."""
    content = m.get("content")
    out = []
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            text = part.get("text") if isinstance(part, dict) else None
            if isinstance(text, str):
                out.append(f"<pre>{escape(pretty(text))}</pre>")
            else:
                out.append(f"<p class='muted'>a part of type {escape(str(kind))}:</p>"
                           f"<pre>{escape(_json(part))}</pre>")
        if m.get("refusal"):
            out.append(f"<p class='muted'>refusal:</p><pre>{escape(str(m['refusal']))}</pre>")
    else:
        text = message_text(m)
        if text:
            out.append(f"<pre>{escape(pretty(text))}</pre>")
    return "".join(out)


def calls_html(m: Message) -> str:
    """Each call with its arguments; past ``views.FOLD_AFTER`` calls the rest folded."""
    out = []
    for call in m.get("tool_calls") or []:
        fn = (call.get("function") if isinstance(call, dict) else None) or {}
        cid = call.get("id") if isinstance(call, dict) else None
        out.append(f"<p>calls <b>{escape(str(fn.get('name')))}</b> "
                   f"<span class='muted'>(call id <code>{escape(str(cid))}</code>)</span></p>"
                   f"<pre>{escape(pretty(str(fn.get('arguments') or '')))}</pre>")
    return folded(out, sep="") if out else ""


def message_html(m: Message, position: int | None = None, href: str | None = None) -> str:
    """A message in a box: its role and position (a link to its page), what it answers,
    its content and its calls."""
    at = f" {position}" if position is not None else ""
    head = f"<a href='{href}'>message{at}</a>" if href else f"message{at}"
    answers = f" · answers <code>{escape(str(m['tool_call_id']))}</code>" \
        if m.get("tool_call_id") else ""
    return (f"<div class='msg'><span class='role'>{escape(role_of(m))}</span> {head}"
            f"{answers}{content_html(m)}{calls_html(m)}</div>")


def _json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2, default=str).decode()


async def message(request: Request) -> Response:
    seen = await viewed(request)
    if isinstance(seen, Response):
        return seen
    state, _, tenant, sid, view = seen
    pos = params.integer(request, "pos", -1)
    assert state.store is not None
    try:
        points = await state.store.points(tenant, sid)
        stored = await state.store.summaries(tenant, sid)
    except StoreError:
        points, stored = None, {}  # the page without what the window did

    def fate_of(messages: list[Message]) -> str | None:
        if points is None:
            return None
        spec, _ = spec_of(state, tenant)
        return window_fate(rebuild(state, spec, tenant, sid, view, points, stored),
                           messages, pos)
    # splicing and segmenting a large session is the work of a large request: off the loop
    return await offload(view.large, lambda: _page(tenant, sid, view, pos, fate_of))


def window_fate(rebuilt: Rebuilt, messages: list[Message], pos: int) -> str:
    """What the last request's window did with message ``pos`` (HTML): elided with its
    recall ref, or its loop's fate; before the first loop, in full."""
    cut = next((e for e in rebuilt.window.elided if e.position == pos), None)
    if cut is not None:
        return (f"elided: the window showed a stub in its place ({cut.tokens:,} tokens "
                f"left out); the model gets it back whole by its recall ref "
                f"<code>{escape(cut.ref)}</code>")
    if pos >= len(rebuilt.messages):
        return "not in it: the message came after the last request"
    d = rebuilt.window.dropped
    if pos in d.positions:
        return (f"dropped: one of {d.exchanges:,} tool exchanges (messages "
                f"{d.positions[0]}–{d.positions[-1]}) left out whole inside the open loop, "
                f"behind a note naming their calls; recall_tool_call returns any result")
    loop = next((lp for lp in segment(messages) if pos in lp.positions), None)
    if loop is None:
        return "kept in full (before the first run loop: the system prompt and the opening)"
    said = FATES[fate(loop, rebuilt)]
    return f"{'kept ' if said.startswith('in full') else ''}{said} (run loop {loop.index})"


def _page(tenant: str, sid: str, view: SessionView, pos: int,
          fate_of: Callable[[list[Message]], str | None] = lambda m: None) -> Response:
    messages = spliced_stored(view.messages, view.internal)[0]
    if not 0 <= pos < len(messages):
        return error("not found", "No such message.", 404)
    m = messages[pos]  # numbered as the session page shows them: the proxy's too
    loop = next((lp.index for lp in segment(messages) if pos in lp.positions), None)
    nav = [f"<a href='{link('/session', tenant=tenant, id=sid)}'>← session "
           f"{escape(name_of(sid))}</a>"]
    if pos > 0:
        nav.append(f"<a href='{link('/message', tenant=tenant, id=sid, pos=pos - 1)}'>"
                   f"← message {pos - 1}</a>")
    if pos + 1 < len(messages):
        nav.append(f"<a href='{link('/message', tenant=tenant, id=sid, pos=pos + 1)}'>"
                   f"message {pos + 1} →</a>")
    facts = [("role", escape(str(m.get("role")))),
             ("position", f"{pos} of {len(messages)}"
              + (f", in run loop {loop}" if loop is not None else ", before the first run loop"))]
    told = fate_of(messages)
    if told is not None:
        facts.append(("in the last request's window", told))
    if m.get("name"):
        facts.append(("name", f"<code>{escape(str(m.get('name')))}</code>"))
    if m.get("tool_call_id"):
        cid = str(m.get("tool_call_id"))
        caller = next((i for i in range(pos - 1, -1, -1) if any(
            str(c.get("id")) == cid for c in tool_calls_of(messages[i]))), None)
        made = f" — made in <a href='{link('/message', tenant=tenant, id=sid, pos=caller)}'>" \
            f"message {caller}</a>" if caller is not None else ""
        facts.append(("answers the call", f"<code>{escape(cid)}</code>{made}"))
    out = [f"<p>{' · '.join(nav)}</p><h1>Message {pos}: {escape(role_of(m))}</h1>",
           "<dl class='facts'>" + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts)
           + "</dl>"]
    content = content_html(m)
    out.append(f"<h2>Content</h2>{content}" if content else
               "<p class='muted'>No text content.</p>")
    calls = calls_html(m)
    if calls:
        out.append(f"<h2>Tool calls</h2>{calls}")
    items = m.get("items")
    if isinstance(items, list) and items:
        kinds = ", ".join(dict.fromkeys(str(i.get("type", "message")) if isinstance(i, dict)
                                        else "?" for i in items))
        out.append(f"<details><summary>The Responses items it stands for ({escape(kinds)})"
                   f"</summary><pre>{escape(_json(items))}</pre></details>")
    rest = {k: v for k, v in m.items() if k not in SHOWN and k != "items"}
    if rest:
        out.append(f"<details><summary>Other fields ({escape(', '.join(sorted(rest)))})"
                   f"</summary><pre>{escape(_json(rest))}</pre></details>")
    return page(f"message {pos}", "".join(out))
