"""The window stage: the body that goes upstream — the client's, byte for byte, unless a
window changes it (window/ builds it; this stage feeds it counts, the budget, the proxy's
stored exchanges, and turns what it built into the API's body)."""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from typing import Any

import orjson

from ..conversation.identity import Session
from ..conversation.messages import Message
from ..conversation.runloops import RunLoop, segment
from ..errors import ContextLengthExceeded, StoreError
from ..history.summaries import Made, counts_of, covers, inline_digest, summaries_of
from ..ops import logs
from ..state import AppState
from ..window.builder import Carry, Window, aged_loops, build_window
from ..window.forms import Budget
from .accounting import RequestLog
from .offload import offload
from .tokens import REPLY_PRIMING, WindowTokens
from .tools import ProxyTools, definitions_tokens, splice_internal
from .values import History, Outgoing, Turn

log = logs.get("window")


async def shape(state: AppState, turn: Turn, session: Session, history: History,
                rlog: RequestLog) -> Outgoing:
    """The body that goes upstream: the client's, byte for byte, unless a window changes it."""
    as_sent = _as_sent(turn, history)
    if turn.chained:
        return Outgoing(as_sent)  # the conversation lives upstream: untouched
    if history.degraded:
        state.metrics.degraded.labels(turn.caller.label, history.degraded).inc()
        return Outgoing(as_sent)
    if not turn.policy.enabled:
        return Outgoing(as_sent)
    keys = [p.hash for p in history.prepared]
    spliced, spliced_keys, protected = splice_internal(
        history.messages, keys, _chains_at(state, turn, session, history), history.internal)
    tools = ProxyTools.for_request(turn.body.get("tools"))
    stored = await state.summaries.stored(turn, session)
    try:
        window, made = await offload(turn.large, lambda: compute_window(
            state, turn, session, history, spliced, spliced_keys, protected, tools, stored))
    except Exception:  # noqa: BLE001 - a window bug must not cost the user this call
        log.exception("window failed: passing the request through uncompressed",
                      extra={"tenant": turn.caller.tenant.name, "session": session.id})
        rlog.degraded = "window"
        state.metrics.degraded.labels(turn.caller.label, "window").inc()
        return Outgoing(as_sent)
    if made is not None:
        state.summaries.keep_inline(turn, session, made)
    try:
        state.summaries.after(turn, session, spliced, spliced_keys, window, stored)
    except Exception:  # noqa: BLE001 - planning a summary must not cost the user this call
        log.exception("summary planning failed: the window goes without the next one",
                      extra={"tenant": turn.caller.tenant.name, "session": session.id})
        state.metrics.summaries.labels(turn.caller.label, "error").inc()
    tl, ml = turn.caller.label, state.metrics.model_label(turn.model)
    for event in window.events:
        state.metrics.compactions.labels(tl, ml, event.kind.value).inc()
    if not window.fits:
        state.metrics.rejections.labels(tl, ml).inc()
        log_events(state, turn, session, window)
        raise ContextLengthExceeded(
            f"This conversation needs {window.tokens_out} prompt tokens after compression, "
            f"more than {turn.model} allows here: {_explained(window)}. Shorten the "
            f"latest messages or tool results, or ask for fewer output tokens.",
            param="messages")
    if any(e.kind.value == "hard_truncation" for e in window.events):
        state.metrics.truncations.labels(tl, ml).inc()
    offer = window.offers_tools(turn.policy, bool(turn.body.get("tools"))) \
        or spliced is not history.messages
    with_tools = offer and (turn.body.get("n") or 1) == 1
    rlog.prompt_tokens = prompt_tokens(state, turn, window, with_tools)
    if not (window.changed or offer or turn.server_history):
        return Outgoing(as_sent)
    extra = turn.wire.tool_definitions(tools) if with_tools else []
    body = turn.wire.outgoing(turn.body, window.messages, extra)
    log_events(state, turn, session, window)
    return Outgoing(body, tools if with_tools else None, window, spliced, spliced_keys)


def _explained(window: Window) -> str:
    return window.budget.explained() if window.budget is not None else "the budget"


def _chains_at(state: AppState, turn: Turn, session: Session, history: History) -> list[str]:
    """The chain hash at each message (what the proxy's stored exchanges are keyed by: a
    message in its lineage), computed only when there is something to splice. The lineage
    is what the request carries, from its first message: an exchange kept after a prefix
    the request does not send (what a trimmed history left out) is never spliced in."""
    if not history.internal or state.store is None or turn.caller.namespace is None:
        return [""] * len(history.messages)
    chains = state.store.chains(turn.caller.namespace, session.id, history.prepared)
    return chains[1:]


def _as_sent(turn: Turn, history: History) -> bytes | dict[str, Any]:
    """The request as the client sent it; in server-history mode, with the stored history."""
    if turn.server_history and not history.degraded:
        return turn.wire.outgoing(turn.body, history.messages, [])
    return turn.raw


def compute_window(state: AppState, turn: Turn, session: Session, history: History,
                   messages: list[Message], keys: list[str], protected: frozenset[str],
                   tools: ProxyTools, stored: dict[str, str] | None = None
                   ) -> tuple[Window, Made | None]:
    """The window for this request, and the extractive summary made for it inline, if any
    (``stored`` then holds it too)."""
    tenant = turn.caller.tenant
    enc, exact = state.tokens.encoding(turn.model, tenant.encoding_for(turn.model))
    factor = 1.0 if exact else state.tokens.factor(turn.model)
    if messages is history.messages:  # counted in reconcile
        counts = [p.tokens or 0 for p in history.prepared]
    else:  # the proxy's exchanges spliced in: those are counted here
        known = {p.hash: p.tokens for p in history.prepared}
        counts = [known.get(k) or state.tokens.message(enc, m, k)
                  for m, k in zip(messages, keys, strict=True)]
    b = turn.body
    budget = Budget.for_request(
        turn.policy, tenant.context_window(turn.model),
        b.get("max_completion_tokens") or b.get("max_tokens") or b.get("max_output_tokens"),
        state.tokens.tools(enc, b.get("tools")) + _proxy_tools_tokens(state, enc), factor,
        REPLY_PRIMING)
    now = int(time.time() * 1000)
    carried = (turn.caller.namespace or "", session.id)
    carry = state.carries.get(carried)
    entries = stored if stored is not None else {}
    loops = _loops(carry, messages, keys) \
        if entries or turn.policy.summary_model == "extractive" else None
    stamps = FirstSeen(state.first_seen, keys, now, "\0".join(carried))
    if messages and messages[-1].get("role") == "user":
        stamps.date(len(messages) - 1)  # a loop is dated by the request that opens it
    # an omission by age stops where the clock says, off the batches summaries are planned
    # for: its summary is made inline (extractive) and kept under that count
    aged = aged_loops(turn.policy, loops[:-1], stamps, now) if loops else 0
    cover = covers(keys, loops, turn.policy.omission_batch, {aged, *counts_of(entries)}) \
        if loops is not None else None
    made = inline_digest(turn.policy, entries, cover, loops, messages,
                         lambda t: state.tokens.text(enc, t), aged) if loops and cover else None
    if made is not None:
        entries[made.name] = orjson.dumps(made.record).decode()
    summaries, compactions = summaries_of(turn.policy, entries, cover)
    window = build_window(messages, keys, counts, turn.policy, budget,
                          WindowTokens(state.tokens, enc, state.cuts), protected=protected,
                          timestamps=stamps, now_ms=now,
                          memo=state.window_memo, tool_names=tools.window_names,
                          carry=carry, summaries=summaries, compactions=compactions,
                          client_tools=bool(turn.body.get("tools")))
    if window.carry is not None:
        state.carries[carried] = window.carry
    return window, made


def _loops(carry: Carry | None, messages: list[Message], keys: list[str]) -> list[RunLoop]:
    """The request's run loops: the carried segmentation grown by the messages that are new
    since, when the carry holds a prefix of this conversation (the usual case: the time of
    the new messages), else the whole conversation segmented."""
    if carry is not None and carry.conv.seg.n == carry.n <= len(keys) \
            and carry.conv.keys[:carry.n] == keys[:carry.n]:
        seg = carry.conv.seg.copy()
        for m in messages[carry.n:]:
            seg.add(m)
        return seg.loops()
    return segment(messages)


def prompt_tokens(state: AppState, turn: Turn, window: Window,
                  with_proxy_tools: bool) -> tuple[int, int]:
    """The whole prompt as the proxy counts it, as the client sent it and as it goes
    upstream: messages, tool schemas (the proxy's own when it adds them), reply priming."""
    enc, _ = state.tokens.encoding(turn.model, turn.caller.tenant.encoding_for(turn.model))
    fixed = state.tokens.tools(enc, turn.body.get("tools")) + REPLY_PRIMING
    extra = _proxy_tools_tokens(state, enc) if with_proxy_tools else 0
    return window.tokens_in + fixed, window.tokens_out + fixed + extra


def _proxy_tools_tokens(state: AppState, enc: Any) -> int:
    n = state.window_memo.get(("proxy-tools", enc.name))
    if n is None:
        n = state.window_memo[("proxy-tools", enc.name)] = definitions_tokens(state.tokens, enc)
    return int(n)


class FirstSeen:
    """When this replica first saw the message at each position (for max_time_range),
    looked up only where the window asks — the first message of each run loop — and at the
    user message a request ends with, so that a loop is dated by the request that opens it
    (a one-loop conversation's window asks nothing)."""

    def __init__(self, seen: MutableMapping[str, int], keys: list[str], now: int, scope: str):
        self.seen, self.keys, self.now, self.scope = seen, keys, now, scope

    def __getitem__(self, position: int) -> int | None:
        return self.date(position)

    def date(self, position: int) -> int:
        """When the message at ``position`` was first seen, now if not before: in this
        conversation, at this position. (Keyed by the text alone, another session's "yes"
        of a week ago made this session's new "yes" old, and its loop was omitted at once.)"""
        key = f"{self.scope}\0{position}\0{self.keys[position]}"
        t = self.seen.get(key)
        if t is None:
            t = self.seen[key] = self.now
        return t


def log_events(state: AppState, turn: Turn, session: Session, window: Window) -> None:
    for event in window.events:
        record = {"ts": int(time.time() * 1000), "kind": event.kind.value,
                  "reason": event.reason, "tokens_before": event.tokens_before,
                  "tokens_after": event.tokens_after, "messages_before": len(turn.messages),
                  "messages_after": len(window.messages), "elided": len(window.elided),
                  "reduced_loops": window.reduced_loops, "omitted_loops": window.omitted_loops}
        log.info("compaction", extra={"tenant": turn.caller.tenant.name, "model": turn.model,
                                      "session": session.id, **record})
        if state.store is not None and turn.caller.namespace is not None:
            state.spawn(_store_record(state, turn.caller.namespace, session.id, record))


async def _store_record(state: AppState, namespace: str, session_id: str,
                        record: dict[str, Any]) -> None:
    assert state.store is not None
    try:
        await state.store.add_record(namespace, session_id, record)
    except StoreError as exc:
        log.warning("compression record not stored", extra={"error": str(exc)})
