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

from ..conversation.identity import identify
from ..state import AppState
from .accounting import RequestLog
from .reconcile import reconcile
from .relay import forward, relay
from .shaping import shape
from .values import Answer, Turn


async def serve(state: AppState, turn: Turn, rlog: RequestLog) -> Answer:
    session = identify(turn.headers, turn.body, turn.messages, turn.caller.namespace or "",
                       state.config.server.session_header, turn.caller.tenant.session_sources)
    session, history = await reconcile(state, turn, session)
    rlog.session, rlog.degraded = session.id, history.degraded
    out = await shape(state, turn, session, history, rlog)
    resp = await forward(state, turn, out.body, rlog)
    return await relay(state, turn, session, history, out, resp, rlog)
