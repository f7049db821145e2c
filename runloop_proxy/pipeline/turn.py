"""One request through the proxy, stage by stage, whatever API it came in by:

    identify → reconcile → window → forward → relay → record

An adapter (``api/chat.py``, ``api/responses.py``) hands over a ``Turn``: the request in the
conversation model, plus the ``Wire`` that speaks its API. Each stage takes what the ones before
produced and returns a value of its own (values.py); only the ``RequestLog`` (timings, tokens,
outcome) is filled in along the way. Record runs inside relay, once the upstream has answered.
Everything that touches Redis fails open: the request goes through uncompressed and says so
(``X-Runloop-Degraded``, a log line, a metric).
"""

from __future__ import annotations

import orjson

from ..conversation.identity import identify
from ..state import AppState
from ..windows import OVERFLOW_STATUSES, overflow_limit, window_name
from .accounting import RequestLog
from .reconcile import reconcile, unrecorded
from .relay import forward, proxy_headers, read, refuse_held_key, relay, response_headers
from .shaping import shape
from .tokens import REPLY_PRIMING
from .values import Answer, Turn


async def serve(state: AppState, turn: Turn, rlog: RequestLog) -> Answer:
    session = identify(turn.headers, turn.body, turn.messages, turn.caller.namespace or "",
                       state.config.server.session_header, turn.caller.tenant.session_sources)
    session, history = await reconcile(state, turn, session, rlog)
    rlog.session, rlog.degraded = session.id, unrecorded(state, turn, history)
    told = await _window_told(state, turn)
    out = await shape(state, turn, session, history, rlog)
    if not told:
        out.taken()  # no overflow error can have it built again: this window goes
    try:
        resp = await forward(state, turn, out.body, rlog)
    except BaseException:
        out.taken()
        raise
    if told and resp.status in OVERFLOW_STATUSES:
        # the model's window was a guess, or the table's: the upstream's overflow error
        # says what it is; with news, the window is built again in it and sent once more
        headers = response_headers(turn.caller, resp, session, rlog)
        refuse_held_key(turn.caller, resp)
        raw = await read(state, resp, rlog)
        limit = overflow_limit(resp.status, raw)
        if limit is None or limit == _window_used(state, turn) or not await state.windows.learn(
                state.store, turn.caller.scope, window_name(turn.model, turn.long_context),
                limit):
            out.taken()
            status, raw = turn.wire.upstream_error(resp.status, raw)
            rlog.finish(status)
            return Answer(status, headers, raw)
        out = await shape(state, turn, session, history, rlog)  # the first goes uncounted
        out.taken()
        resp = await forward(state, turn, out.body, rlog)
    out.taken()
    return await relay(state, turn, session, history, out, resp, rlog)


def _window_used(state: AppState, turn: Turn) -> int:
    learned = state.windows.learned(turn.caller.scope,
                                    window_name(turn.model, turn.long_context))
    return learned if learned is not None else turn.caller.tenant.window_of(
        turn.model, turn.long_context).tokens


async def _window_told(state: AppState, turn: Turn) -> bool:
    """Whether the upstream's word on the model's window counts for this request (a window
    the tenant configured is the operator's): then what another replica learned is read."""
    if turn.caller.tenant.window_of(turn.model, turn.long_context).source == "config":
        return False
    await state.windows.load(state.store, turn.caller.scope,
                             window_name(turn.model, turn.long_context))
    return True


async def count(state: AppState, turn: Turn, rlog: RequestLog) -> Answer:
    """A count of the prompt this request would send (Anthropic's ``count_tokens``):

        identify → reconcile → window → count

    the window is built as for the request itself (nothing recorded, no summary planned);
    the count is the proxy's, in the model's tokens as calibrated from its upstream's
    reports, or (``policy.count_tokens = "upstream"``) the upstream's own for that window."""
    session = identify(turn.headers, turn.body, turn.messages, turn.caller.namespace or "",
                       state.config.server.session_header, turn.caller.tenant.session_sources)
    session, history = await reconcile(state, turn, session, rlog)
    rlog.session, rlog.degraded = session.id, unrecorded(state, turn, history)
    out = await shape(state, turn, session, history, rlog)
    out.taken()
    # (an upstream of another API has no count of this one's: the proxy counts then)
    if turn.policy.count_tokens == "upstream" and not turn.wire.translates:
        resp = await forward(state, turn, out.body, rlog, "/count_tokens")
        headers = response_headers(turn.caller, resp, session, rlog)
        raw = await read(state, resp, rlog)
        rlog.finish(resp.status)
        return Answer(resp.status, headers, raw)
    if rlog.prompt_tokens is None:  # no window was built (degraded, or compression off)
        enc, _ = state.tokens.encoding(turn.model, turn.caller.tenant.encoding_for(turn.model))
        n = sum(p.tokens or 0 for p in history.prepared) \
            + state.tokens.tools(enc, turn.chat_tools) + REPLY_PRIMING
        rlog.prompt_tokens = (n, n)
    headers = {"Content-Type": "application/json", **proxy_headers(session, rlog)}
    tokens = round(rlog.prompt_tokens[1] * state.tokens.factor(turn.model, turn.caller.scope))
    rlog.finish(200)
    return Answer(200, headers, orjson.dumps({"input_tokens": tokens}))
