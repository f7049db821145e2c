"""The window stage: the body that goes upstream — the client's, byte for byte, unless a
window changes it (window/ builds it; this stage feeds it counts, the budget, the proxy's
stored exchanges, and turns what it built into the API's body)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..conversation.identity import Session
from ..conversation.messages import Message
from ..errors import ContextLengthExceeded, StoreError
from ..history.summaries import Covering, Made, covering
from ..ops import logs
from ..savings import Placed
from ..state import AppState
from ..window.builder import CompactionKind, Event, Note, Window
from .accounting import RequestLog
from .framing import FirstSeen, Frame, prompt_tokens, prompts_of, sends_proxy_tools, window_in
from .offload import offload
from .tools import ProxyTools, splice_internal
from .values import History, Outgoing, Turn

log = logs.get("window")
STEPS_KEPT = 24  # a request's window steps recorded one by one (the earlier ones counted)


async def shape(state: AppState, turn: Turn, session: Session, history: History,
                rlog: RequestLog) -> Outgoing:
    """The body that goes upstream: the client's, byte for byte, unless a window changes it.
    What its window did is counted and recorded when it is the one that goes
    (``Outgoing.taken``): a request built again in a learned window counts only that one."""
    steps: list[Callable[[], None]] = []
    # the client's tool schemas are rendered to be counted: request content, off the event
    # loop when the request is large (as its messages are)
    frame = await offload(turn.large, lambda: Frame.of(
        state, turn.caller.tenant, turn.body, turn.chat_tools, turn.caller.scope,
        turn.long_context))
    rlog.frame = frame.point()
    if history.degraded:
        degraded = history.degraded
        steps.append(lambda: state.metrics.degraded.labels(turn.caller.label, degraded).inc())
    if turn.chained or history.degraded or not turn.policy.enabled:
        # a chained request's conversation lives upstream: what it carries is counted
        return await _untouched(state, turn, history, frame, rlog, steps)
    keys = [p.hash for p in history.prepared]
    internal = history.internal
    if state.store is not None and turn.caller.namespace is not None:
        internal = state.store.with_writing(turn.caller.namespace, session.id, internal)
    spliced, spliced_keys, protected = splice_internal(
        history.messages, keys, _chains_at(state, turn, session, history, internal), internal)
    tools = ProxyTools.for_request(turn.chat_tools)
    stored = await state.summaries.stored(turn, session)
    dated: list[str] = []  # the dates this request saw first, packed (FirstSeen.packed)
    try:
        window, made, planned = await offload(turn.large or history.large, lambda: _planned(
            compute_window(state, turn, session, history, spliced, spliced_keys, protected,
                           frame, stored, dated), turn, spliced, spliced_keys, stored))
    except Exception:  # noqa: BLE001 - a window bug must not cost the user this call
        log.exception("window failed: passing the request through uncompressed",
                      extra={"tenant": turn.caller.tenant.name, "session": session.id})
        rlog.degraded = "window"
        steps.append(lambda: state.metrics.degraded.labels(turn.caller.label, "window").inc())
        return await _untouched(state, turn, history, frame, rlog, steps)
    if dated and state.store is not None and turn.caller.namespace is not None:
        state.spawn(_store_dates(state, turn.caller.namespace, session.id, dated[0],
                                 turn.caller.tenant.retention_days))
    if not turn.counting:  # a count (count_tokens) plans, keeps and counts nothing
        _after(state, turn, session, spliced, spliced_keys, window, stored, made, planned,
               rlog)
        steps.append(lambda: count_steps(state, turn, window))
    tl, ml = turn.caller.label, state.metrics.model_label(turn.caller.label, turn.model)
    if not window.fits and window.budget is not None and not window.budget.known:
        # a window the proxy guessed is no reason to refuse: the upstream says (and then
        # the proxy knows: serve() learns it from the overflow error and builds again)
        log.info("the window is a guess: forwarding a request past it",
                 extra={"tenant": turn.caller.tenant.name, "session": session.id,
                        "model": turn.model[:64], "tokens": window.tokens_out,
                        "guessed": window.budget.hard})
    elif not window.fits and not turn.counting:
        Outgoing(b"", steps=steps).taken()  # refused: this window is the last
        state.metrics.rejections.labels(tl, ml).inc()
        log_events(state, turn, session, window)
        raise ContextLengthExceeded(
            _too_long(turn, window),
            param="tools" if window.budget is not None and window.budget.hard == 0
            else "messages", needed=window.tokens_out,
            allowed=window.budget.hard if window.budget is not None else None)
    if any(e.kind.value == "hard_truncation" for e in window.events):
        steps.append(lambda: state.metrics.truncations.labels(tl, ml).inc())
    offer, with_tools = sends_proxy_tools(turn.caller.tenant, frame, window,
                                          spliced is not history.messages)
    rlog.prompt_tokens = prompt_tokens(state, turn.caller.tenant, frame, window.tokens_in,
                                       window.tokens_out, with_tools)

    async def prompts(placed: Placed | None = None) -> None:
        if not turn.counting:
            rlog.prompts = await offload(turn.large or history.large, lambda: prompts_of(
                state, turn.caller.tenant, frame, turn.chat_tools, spliced, spliced_keys,
                window, with_tools, placed))
    if not (window.changed or offer or turn.server_history):
        await prompts()
        return Outgoing(await _as_sent(turn, history), steps=steps)
    extra = turn.wire.tool_definitions(tools) if with_tools else []
    body = await _converted(turn, turn.large or history.large, window.messages, extra,
                            window.note)
    # the breakpoints the body carries that the proxy added (Messages, cache_breakpoints =
    # "auto"): the headline prices them
    placed = getattr(turn.wire, "placed", None)
    await prompts(placed if isinstance(placed, Placed) else None)
    if not turn.counting:
        steps.append(lambda: log_events(state, turn, session, window))
    return Outgoing(body, tools if with_tools else None, window, spliced, spliced_keys, steps)


async def _untouched(state: AppState, turn: Turn, history: History, frame: Frame,
                     rlog: RequestLog, steps: list[Callable[[], None]]) -> Outgoing:
    """The request goes as it came, its prompt counted as sent (and so as forwarded)."""
    n = sum(p.tokens or 0 for p in history.prepared)
    rlog.prompt_tokens = prompt_tokens(state, turn.caller.tenant, frame, n, n, False)
    if not turn.counting:
        rlog.prompts = await offload(turn.large or history.large, lambda: prompts_of(
            state, turn.caller.tenant, frame, turn.chat_tools, history.messages,
            [p.hash for p in history.prepared], None, False))
    return Outgoing(await _as_sent(turn, history), steps=steps)


def _too_long(turn: Turn, window: Window) -> str:
    """Why a request cannot fit, naming what does not: the messages, or — when nothing is
    left for any message — the tool schemas and the output reserve."""
    budget = window.budget
    explained = budget.explained() if budget is not None else "the budget"
    if budget is not None and budget.hard == 0:
        return (f"This request does not fit {turn.model}'s context before any message: "
                f"{explained}. Send fewer or shorter tool schemas, or ask for fewer output "
                f"tokens.")
    return (f"This conversation needs {window.tokens_out} prompt tokens after compression, "
            f"more than {turn.model} allows here: {explained}. Shorten the latest messages "
            f"or tool results, or ask for fewer output tokens.")


def _planned(built: tuple[Window, Made | None], turn: Turn, messages: list[Message],
             keys: list[str], stored: dict[str, str]
             ) -> tuple[Window, Made | None, Covering | None]:
    """The window and its inline summary, with what planning the next summary reads."""
    window, made = built
    return window, made, covering(turn.policy, window, messages, keys, stored)


def _after(state: AppState, turn: Turn, session: Session, spliced: list[Message],
           keys: list[str], window: Window, stored: dict[str, str],
           made: Made | None, planned: Covering | None, rlog: RequestLog) -> None:
    """What a window leads to: its inline summary kept, the next summary planned; and, when
    it omits loops without the summary the failing summariser did not make, the request
    marked degraded by it (header, log line, metric)."""
    if made is not None:
        state.summaries.keep_inline(turn, session, made)
    missing = False
    try:
        missing = state.summaries.after(turn, session, spliced, keys, window, stored,
                                        planned)
    except Exception:  # noqa: BLE001 - planning a summary must not cost the user this call
        log.exception("summary planning failed: the window goes without the next one",
                      extra={"tenant": turn.caller.tenant.name, "session": session.id})
        state.metrics.summaries.labels(turn.caller.label, "error").inc()
    ns = turn.caller.namespace
    if missing and ns is not None and state.summaries.failing(ns):
        rlog.degraded = "summary"
        state.metrics.degraded.labels(turn.caller.label, "summary").inc()
        log.warning("summary unavailable: the summariser is failing, the window omits "
                    "loops without one", extra={"tenant": turn.caller.tenant.name,
                                                "session": session.id,
                                                "omitted": window.omitted_loops})


def count_steps(state: AppState, turn: Turn, window: Window) -> None:
    """A window's compaction events, counted (once it is the window that goes)."""
    tl, ml = turn.caller.label, state.metrics.model_label(turn.caller.label, turn.model)
    for kind, n in Counter(event.kind.value for event in window.events).items():
        state.metrics.compactions.labels(tl, ml, kind).inc(n)


def _chains_at(state: AppState, turn: Turn, session: Session, history: History,
               internal: dict[str, Any]) -> list[str]:
    """The chain hash at each message (what the proxy's stored exchanges are keyed by: a
    message in its lineage), computed only when there is something to splice. The lineage
    is what the request carries, from its first message: an exchange kept after a prefix
    the request does not send (what a trimmed history left out) is never spliced in."""
    if not internal or state.store is None or turn.caller.namespace is None:
        return [""] * len(history.messages)
    chains = state.store.chains(turn.caller.namespace, session.id, history.prepared)
    return chains[1:]


async def _as_sent(turn: Turn, history: History) -> bytes | dict[str, Any]:
    """The request as the client sent it; in server-history mode, with the stored history;
    in the upstream's API when it speaks another (the bridge); chained on the response the
    upstream must go on from (``History.chain_to``). A conversion walks every message: a
    large one's runs off the event loop, as the window's does."""
    if turn.server_history and not history.degraded:
        return await _converted(turn, turn.large or history.large, history.messages)
    if turn.wire.translates:
        return await _converted(turn, turn.large, turn.messages)
    if history.chain_to is not None or history.owed:
        return chained_on(turn.body, history)
    return turn.raw


def chained_on(body: dict[str, Any], history: History) -> dict[str, Any]:
    """A chained request as the upstream must read it: on the response that holds the whole
    turn (``History.chain_to``), with the outputs of the proxy's calls in it that the client
    never saw before its own input (``History.owed``)."""
    out = dict(body)
    if history.chain_to is not None:
        out["previous_response_id"] = history.chain_to
    if history.owed:
        given = body.get("input")
        items = given if isinstance(given, list) else \
            [{"role": "user", "content": given}] if isinstance(given, str) else []
        out["input"] = [*history.owed, *items]
    return out


async def _converted(turn: Turn, large: bool, messages: list[Message],
                     extra: list[dict[str, Any]] | None = None, note: Note | None = None
                     ) -> dict[str, Any]:
    """The request's body in the upstream's API around ``messages`` (and ``extra`` tools,
    and the window's ``note``): a walk over every message, off the event loop when
    ``large``."""
    return await offload(large, lambda: turn.wire.outgoing(turn.body, messages, extra or [],
                                                           note))


def compute_window(state: AppState, turn: Turn, session: Session, history: History,
                   messages: list[Message], keys: list[str], protected: frozenset[str],
                   frame: Frame, stored: dict[str, str] | None = None,
                   dated: list[str] | None = None
                   ) -> tuple[Window, Made | None]:
    """The window for this request (``framing.window_in``, which the inspector's rebuild
    calls too), grown from the session's last window when it can be; and the extractive
    summary made for it inline, if any (``stored`` then holds it too)."""
    tenant = turn.caller.tenant
    if messages is history.messages:  # counted in reconcile
        counts = [p.tokens or 0 for p in history.prepared]
    else:  # the proxy's exchanges spliced in: those are counted here
        enc, _ = state.tokens.encoding(frame.model, tenant.encoding_for(frame.model))
        known = {p.hash: p.tokens for p in history.prepared}
        counts = [known.get(k) or state.tokens.message(enc, m, k)
                  for m, k in zip(messages, keys, strict=True)]
    now = int(time.time() * 1000)
    carried = (turn.caller.namespace or "", session.id)
    stamps = FirstSeen(state.first_seen, keys, now, "\0".join(carried))
    if messages and messages[-1].get("role") == "user":
        stamps.date(len(messages) - 1)  # a loop is dated by the request that opens it
    window, made = window_in(state, tenant, frame, messages, keys, counts, protected,
                             stored if stored is not None else {}, now, stamps,
                             "\0".join(carried), state.carries.get(carried),
                             _first_new(messages, history))
    if window.carry is not None:
        state.carries[carried] = window.carry
    if dated is not None and stamps.new:
        dated.append(stamps.packed())
    return window, made


def _first_new(messages: list[Message], history: History) -> int | None:
    """Where in ``messages`` (the request's, the proxy's exchanges spliced in) what no
    earlier request carried begins (``History.new_from``)."""
    if history.new_from is None or messages is history.messages:
        return history.new_from
    theirs = {id(m): i for i, m in enumerate(history.messages)}  # spliced in as they are
    return next((j for j, m in enumerate(messages) if theirs.get(id(m), -1) >= history.new_from),
                len(messages))


def log_events(state: AppState, turn: Turn, session: Session, window: Window) -> None:
    """The window's steps as records (stored with the session, one log line each). A request
    that brings many turns takes a step at each: the last ``STEPS_KEPT`` are recorded one by
    one and the earlier ones in a record of their own (their kinds counted), so what one
    request writes and logs is bounded however many turns it brings."""
    now = int(time.time() * 1000)
    frame = {"messages_before": len(turn.messages), "messages_after": len(window.messages),
             "elided": len(window.elided), "reduced_loops": window.reduced_loops,
             "omitted_loops": window.omitted_loops,
             "dropped_exchanges": window.dropped.exchanges,
             "dropped_messages": len(window.dropped.positions)}
    events = window.events
    records = []
    if len(events) > STEPS_KEPT:
        earlier = events[:len(events) - STEPS_KEPT]
        kinds = Counter(e.kind.value for e in earlier)
        records.append({"ts": now, "kind": "steps", "count": len(earlier),
                        "kinds": dict(sorted(kinds.items())),
                        "tokens_before": earlier[0].tokens_before,
                        "tokens_after": earlier[-1].tokens_after,
                        "at_message": earlier[0].at, "until_message": earlier[-1].at, **frame})
        events = events[len(earlier):]
    for event in events:
        # the request's window (messages, elided, loops) beside the step taken at the
        # request point ``at_message`` (a request that brings several turns takes several)
        records.append({"ts": now, "kind": event.kind.value, "reason": event.reason,
                        "tokens_before": event.tokens_before,
                        "tokens_after": event.tokens_after, "at_message": event.at,
                        **_taken(event), **frame})
    for record in records:
        log.info("compaction", extra={"tenant": turn.caller.tenant.name, "model": turn.model,
                                      "session": session.id, **record})
    if records and state.store is not None and turn.caller.namespace is not None:
        state.spawn(_store_records(state, turn.caller.namespace, session.id, records,
                                   turn.caller.tenant.retention_days))


def _taken(event: Event) -> dict[str, int]:
    """What a step took out, in its own unit, beside the window's figures (an elision's
    results stay counted when a later drop leaves them out whole)."""
    if event.kind is CompactionKind.ELISION:
        return {"results_elided": event.items}
    if event.kind is CompactionKind.DROP:
        return {"exchanges_dropped": event.items, "messages_dropped": event.messages}
    return {}


async def _store_dates(state: AppState, namespace: str, session_id: str,
                       dated: str, retention: float | None) -> None:
    """When this request first saw its loops (``FirstSeen.new``), for every replica and
    the next process: a loop's age is its first request's."""
    assert state.store is not None
    try:
        await state.store.put_dates(namespace, session_id, dated, retention)
    except StoreError as exc:
        log.warning("loop dates not stored", extra={"error": str(exc)})


async def _store_records(state: AppState, namespace: str, session_id: str,
                         records: list[dict[str, Any]], retention: float | None) -> None:
    """A request's records, in the order its window took the steps (one round trip): they
    expire with the session, or (a request refused or cut: no sync) after its retention."""
    assert state.store is not None
    try:
        await state.store.add_records(namespace, session_id, records, retention)
    except StoreError as exc:
        log.warning("compression record not stored", extra={"error": str(exc)})
