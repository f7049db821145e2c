"""Shadow calls: for a sampled share (``policy.shadow_rate``) of the requests the proxy
compressed, the request is sent once more as the client sent it, and the two answers' next
steps compared (shadow.py).

The call goes after the client's answer (when its request is done), in the background, with
the tenant's upstream, key and headers as the request itself went, and the body the upstream
would have had uncompressed (the client's; in server-history mode with the stored
conversation; bridged, in the upstream's API) with ``stream`` off; it is never streamed to
anyone and never recorded as a turn. Every API and path shadows alike: a Responses request
chained on a ``previous_response_id`` the upstream keeps is never compressed (its
conversation is upstream), so it has nothing to compare; one over a socket that goes on from
the connection's own response is expanded into the whole conversation first. It holds one
of the tenant's upstream connections, and goes only while the tenant holds less than half of
its share of them, so it never takes room the tenant's own requests need. Its tokens and
money count against the tenant's daily cap (``shadow_daily_tokens``, ``shadow_daily_usd``);
once reached, no more go that day (a log line and ``runloop_shadow_skipped_total{reason=
"cap"}`` say so). A failed shadow call is counted as an error and logged; the client's
request was done before it began."""

from __future__ import annotations

import datetime
import random
from typing import Any

import orjson

from ..conversation.messages import Message
from ..errors import ProxyFull, StoreError, TenantOverShare, UpstreamError
from ..ops import logs
from ..state import AppState
from .accounting import RequestLog, prompt_usage
from .offload import offload
from .shadow import (
    BASELINE,
    Basis,
    Outcome,
    Record,
    Spend,
    Step,
    compare,
    counted_under,
    levers_of,
    micro_usd,
    sampled,
    step_of_message,
    within_cap,
)
from .values import History, Outgoing, Turn

log = logs.get("shadow")
_draws = random.SystemRandom()


def today() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")


def shadow_after(state: AppState, turn: Turn, history: History, out: Outgoing,
                 rlog: RequestLog, shown: Message | None, draw: float | None = None) -> None:
    """Decide whether this answered request is shadowed, and if so send its shadow call once
    the request is done. ``shown``: the answer the client got, in the conversation model;
    ``history``: the conversation the request stands for (in server-history mode, the
    stored one with the new messages)."""
    policy = turn.policy
    window = out.window
    if policy.shadow_rate <= 0 or shown is None or window is None or not window.changed \
            or turn.counting:
        return
    if not sampled(policy.shadow_rate, _draws.random() if draw is None else draw):
        return
    day = today()
    if _busy(state, turn):
        _skipped(state, turn, rlog.session, "busy")
        return
    levers = levers_of(window.reduced_loops, len(window.elided), window.omitted_loops,
                       (e.kind.value for e in window.events))
    session, model = rlog.session, turn.model

    def go() -> None:
        state.spawn(_within_cap(state, turn, history, levers, shown, session, model, day))

    rlog.at_end(go)


def _busy(state: AppState, turn: Turn) -> bool:
    """Whether the tenant holds half its share of the upstream's connections or more."""
    holder = turn.caller.holder
    if holder is None:
        return False
    connections = turn.caller.client(state.upstreams).connections
    return connections.held(holder) >= connections.per_holder // 2


def _skipped(state: AppState, turn: Turn, session: str | None, reason: str) -> None:
    state.shadows.skip(turn.caller.tenant.name, reason)
    state.metrics.shadow_skipped.labels(turn.caller.label, reason).inc()
    log.info("shadow call skipped", extra={"tenant": turn.caller.tenant.name,
                                           "session": session, "reason": reason})


async def spent(state: AppState, tenant: str, day: str) -> Spend:
    """What ``tenant``'s shadow calls spent on ``day``, every replica's (Redis). Raises
    StoreError when Redis cannot say."""
    if state.store is None:
        raise StoreError("no store")
    tokens, micro = await state.store.shadow_spend(tenant, day)
    return Spend.of_ledger(day, tokens, micro)


async def _within_cap(state: AppState, turn: Turn, history: History, levers: tuple[str, ...],
                      shown: Message, session: str | None, model: str, day: str) -> None:
    """The shadow call, when the tenant's spend today (every replica's, in Redis) is under
    its cap. Fail closed: while Redis cannot say what was spent, no shadow call goes (a
    cap per replica would be the cap times the replicas), and the skip says so."""
    policy = turn.policy
    try:
        spend = await spent(state, turn.caller.tenant.name, day)
    except StoreError as exc:
        log.warning("shadow call skipped: the spend ledger (Redis) is unavailable",
                    extra={"tenant": turn.caller.tenant.name, "error": str(exc)})
        _skipped(state, turn, session, "store")
        return
    if not within_cap(spend, day, policy.shadow_daily_tokens, policy.shadow_daily_usd):
        _skipped(state, turn, session, "cap")
        return
    await shadow_call(state, turn, history, levers, shown, session, model, day)


def shadow_body(turn: Turn, history: History) -> bytes:
    """The request as the upstream would have had it without the proxy's window, answered
    whole: the client's body; in server-history mode with the stored conversation, and for
    an upstream of another API (the bridge) in its API — as ``shaping._as_sent`` sends an
    unchanged request. ``stream`` (and what only a stream reads) off; every other field,
    the client's seed and sampling parameters, as sent."""
    body: dict[str, Any] = turn.wire.outgoing(turn.body, history.messages, []) \
        if turn.server_history or turn.wire.translates else dict(turn.body)
    body.pop("stream_options", None)
    if body.get("stream"):
        body["stream"] = False
    if turn.wire.api.startswith("responses"):
        body["store"] = False  # no stored response upstream: the shadow is never a turn
    return orjson.dumps(body)


async def shadow_call(state: AppState, turn: Turn, history: History, levers: tuple[str, ...],
                      shown: Message, session: str | None, model: str, today: str,
                      draw: float | None = None) -> Record:
    """The shadow call, its comparison, and its record (book, metrics, log line); for
    ``policy.shadow_baseline_share`` of them (``draw``), the same request once more and its
    answer compared with the first: the model's own agreement (lever ``baseline``)."""
    policy, tenant = turn.policy, turn.caller.tenant.name
    full_step, tokens, usd, error = await _ask(state, turn, history, model)
    compressed_step = step_of_message(shown)
    record = _compared(tenant, session, model, levers, compressed_step, full_step, tokens, usd,
                       error, policy.shadow_text_threshold)
    await _recorded(state, turn, record, today)
    if full_step is not None and sampled(policy.shadow_baseline_share,
                                         _draws.random() if draw is None else draw):
        again, tokens, usd, error = await _ask(state, turn, history, model)
        await _recorded(state, turn, _compared(
            tenant, session, model, (BASELINE,), again, full_step, tokens, usd, error,
            policy.shadow_text_threshold) if again is not None else Record(
            tenant, session, model, (BASELINE,), Outcome.ERROR, None, None, tokens, usd,
            error), today)
    return record


def _compared(tenant: str, session: str | None, model: str, levers: tuple[str, ...],
              step: Step, full_step: Step | None, tokens: int, usd: float | None,
              error: str | None, threshold: float) -> Record:
    """``step`` against the full request's (None: its call failed) as a record."""
    if full_step is None:
        return Record(tenant, session, model, levers, Outcome.ERROR, None, None, tokens, usd,
                      error)
    verdict = compare(step, full_step, threshold)
    differ = verdict.outcome is Outcome.DIFFER
    return Record(tenant, session, model, levers, verdict.outcome, verdict.basis,
                  verdict.similarity, tokens, usd, None, step if differ else None,
                  full_step if differ else None)


async def _ask(state: AppState, turn: Turn, history: History, model: str
               ) -> tuple[Step | None, int, float | None, str | None]:
    """The request as the upstream would have had it uncompressed, answered: its step
    (None when the call failed), its tokens and cost, the failure."""
    tokens, usd = 0, None
    try:
        # a whole stored conversation is converted off the event loop, as the window's is
        body = await offload(turn.large or history.large, lambda: shadow_body(turn, history))
        resp = await turn.caller.client(state.upstreams).request(
            "POST", turn.wire.upstream_path, turn.caller.upstream_headers(turn.headers),
            body, holder=turn.caller.holder)
        try:
            raw = await resp.read(state.config.server.max_answer_bytes)
        finally:
            resp.close()
        if resp.status >= 400:
            raise UpstreamError(f"the shadow call was answered {resp.status}",
                                status=resp.status)
        reply = turn.wire.parse(orjson.loads(raw))
        if reply.usage:
            prompt, _ = prompt_usage(reply.usage)
            completion = reply.usage.get("completion_tokens", reply.usage.get("output_tokens"))
            tokens = prompt + (completion if isinstance(completion, int) else 0)
            price = state.metrics.price(model)
            if price is not None:
                usd = sum(price.usage_cost(reply.usage).values())
        return step_of_message(reply.message), tokens, usd, None
    except (UpstreamError, TenantOverShare, ProxyFull, orjson.JSONDecodeError) as exc:
        return None, tokens, usd, getattr(exc, "log_text", None) or str(exc) \
            or type(exc).__name__
    except Exception as exc:  # noqa: BLE001 - a shadow call never breaks anything: counted
        log.exception("shadow call failed", extra={"tenant": turn.caller.tenant.name})
        return None, tokens, usd, type(exc).__name__


async def _recorded(state: AppState, turn: Turn, record: Record, today: str) -> None:
    await _spend(state, record, today)
    state.shadows.add(record)
    _count(state, turn.caller.label, record)
    log.info("shadow comparison", extra={
        "tenant": record.tenant, "session": record.session, "model": record.model,
        "levers": ",".join(record.levers) or "none", "outcome": record.outcome.value,
        "basis": record.basis.value if isinstance(record.basis, Basis) else None,
        "similarity": record.similarity, "shadow_tokens": record.tokens,
        "shadow_usd": record.usd, "error": record.error})


async def _spend(state: AppState, record: Record, today: str) -> None:
    """The call's cost into the day's ledger (Redis): the cap every replica reads."""
    if state.store is None or not (record.tokens or record.usd):
        return
    try:
        await state.store.add_shadow_spend(record.tenant, today, record.tokens,
                                           micro_usd(record.usd))
    except StoreError as exc:
        log.warning("shadow spend not added to the ledger (Redis): the cap does not count "
                    "this call", extra={"tenant": record.tenant, "error": str(exc)})


def _count(state: AppState, label: str, record: Record) -> None:
    m = state.metrics
    for lever in counted_under(record):
        m.shadow_comparisons.labels(label, lever, record.outcome.value).inc()
    m.shadow_tokens.labels(label).inc(record.tokens)
    if record.usd:
        m.shadow_cost.labels(label).inc(record.usd)
