"""The inspector's window: a session's last request rebuilt the way the proxy built it — its
messages from the stored conversation, its frame from the request's point (model, output
reserve, tool schemas), the session's summaries, and ``framing.window_in``, the function the
proxy's window stage calls — so the figures and the loops it shows are what went upstream.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from html import escape
from typing import Any

from ..config import TenantSpec
from ..conversation.messages import Message
from ..conversation.runloops import RunLoop
from ..history.store import SessionView
from ..pipeline.framing import FirstSeen, Frame, prompt_tokens, sends_proxy_tools, window_in
from ..pipeline.tools import spliced_stored
from ..state import AppState
from ..window.builder import Window

FATES = {"omitted": "omitted (behind the marker)", "reduced": "reduced to question and answer",
         "whole": "in full", "open": "in full (the open loop)"}

DEFAULT_MODEL = "gpt-4o"  # for a session whose requests kept no frame


@dataclass(frozen=True)
class Rebuilt:
    """The last request's window and its prompt as the proxy counts it."""

    window: Window
    messages: list[Message]  # what it was built from: the request's, the proxy's spliced in
    client: int  # whole prompts: messages, tool schemas, reply priming
    forwarded: int  # ... and the proxy's tools when they went out
    frame: Frame
    point: dict[str, Any] | None  # the request's point, when one kept its frame
    chained: bool = False  # it chained on previous_response_id: passed through untouched
    # a message's tokens as the proxy counted them for this request (its model's encoding)
    count: Callable[[Message], int] = lambda m: 0

    def dropped_in(self, positions: Iterable[int]) -> list[int]:
        """Which of ``positions`` the window left out whole (a drop inside the open loop)."""
        dropped = set(self.window.dropped.positions)
        return [i for i in positions if i in dropped]


def last_request(view: SessionView, point: dict[str, Any] | None) -> list[Message]:
    """The messages the request of ``point`` carried: the stored conversation up to there,
    without what the request had trimmed (stored for the record only)."""
    messages = view.messages
    if point is None:
        return messages
    cut = point.get("earlier")
    if isinstance(cut, list) and len(cut) == 2 and all(isinstance(c, int) for c in cut):
        messages = [*messages[:cut[0]], *messages[cut[0] + cut[1]:]]
    n = point.get("messages")
    return messages[:n] if isinstance(n, int) else messages


def rebuild(state: AppState, spec: TenantSpec, namespace: str, session_id: str,
            view: SessionView, points: list[dict[str, Any]], stored: dict[str, str]
            ) -> Rebuilt:
    """The window of the session's last request (of the stored conversation when no request
    kept its frame: the default model, no tools)."""
    point = points[-1] if points else None
    frame = Frame.from_point(point) if point is not None else None
    if frame is None:
        point, frame = None, Frame(DEFAULT_MODEL, None, 0)
    messages, keys, protected = spliced_stored(last_request(view, point), view.internal)
    enc, _ = state.tokens.encoding(frame.model, spec.encoding_for(frame.model))
    counts = [state.tokens.message(enc, m, k) for m, k in zip(messages, keys, strict=True)]

    def count(m: Message) -> int:
        return state.tokens.message(enc, m)
    if point is not None and point.get("chained"):
        n = sum(counts)
        client, forwarded = prompt_tokens(state, spec, frame, n, n, False)
        return Rebuilt(Window(messages, False, True, n, n), messages, client, forwarded,
                       frame, point, chained=True, count=count)
    now = point["ts"] if point is not None and isinstance(point.get("ts"), int) \
        else int(time.time() * 1000)
    # when this replica first saw each loop, as the request read it (never dated here)
    scope = f"{namespace}\0{session_id}"
    stamps = FirstSeen(state.first_seen, keys, now, scope, dating=False)
    window, _ = window_in(state, spec, frame, messages, keys, counts, protected,
                          dict(stored) if spec.policy.summary_model else {}, now, stamps,
                          scope)
    _, with_tools = sends_proxy_tools(spec, frame, window, bool(view.internal))
    client, forwarded = prompt_tokens(state, spec, frame, window.tokens_in, window.tokens_out,
                                      with_tools)
    return Rebuilt(window, messages, client, forwarded, frame, point, count=count)


def spec_of(state: AppState, tenant: str) -> tuple[TenantSpec, str]:
    """The tenant's config, and a note when the namespace's own is gone (its sessions are
    still stored): then another tenant's stands in for the rebuild."""
    spec = state.config.spec_of_namespace(tenant)
    if spec is not None:
        return spec, ""
    spec = next(iter(state.config.tenants.values()))
    return spec, (f"<p class='muted'>No tenant of this name is configured any more: the "
                  f"window below is rebuilt with tenant {escape(spec.name)}'s policy.</p>")


def fate(lp: RunLoop, rebuilt: Rebuilt) -> str:
    """What the last request's window did with a run loop (a key of ``FATES``)."""
    w = rebuilt.window
    if lp.index < w.omitted_loops:
        return "omitted"
    if lp.index < w.omitted_loops + w.reduced_loops:
        return "reduced"
    return "open" if lp.status.value == "open" or lp.end >= len(rebuilt.messages) else "whole"
