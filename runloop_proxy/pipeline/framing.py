"""A request's frame and the window built in it — the one computation the proxy's window stage
and the inspector's rebuild of a past request share.

The frame is what a window depends on besides the conversation: the model (its encoding,
context window and calibration), the output it reserves, the client's tool schemas and the
names the proxy's tools take beside them. It is kept with each request's token counts
(``point``), so the inspector rebuilds exactly the window that went upstream and counts its
prompt exactly as the ``X-Runloop-Tokens`` header did.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import orjson

from ..config import TenantSpec
from ..conversation.messages import Message, content_hash, message_hash
from ..conversation.runloops import RunLoop, preamble_end, segment
from ..history.summaries import Made, counts_of, covers, inline_digest, summaries_of
from ..pricing import Block
from ..savings import Placed, Prompt, placed_blocks
from ..state import AppState
from ..window.builder import Carry, Stamps, Window, aged_loops, build_window
from ..window.forms import DEFAULT_NAMES, Budget, SessionMemo, ToolNames
from ..windows import ModelWindow, window_name
from .tokens import REPLY_PRIMING, WindowTokens
from .tools import ProxyTools, definitions_tokens


@dataclass(frozen=True)
class Frame:
    """What a request's window depends on besides its messages."""

    model: str
    max_output: int | None  # the request's own output reserve, if it set one
    tools_tokens: int  # the client's tool schemas as the model reads them (0: none)
    factor: float = 1.0  # model tokens per counted token (a model counted with a fallback)
    names: ToolNames = DEFAULT_NAMES  # the proxy's tools, renamed if the client's take a name
    choices: int = 1  # n: the proxy offers its tools to single-choice requests only
    learned: int | None = None  # the window the upstream's overflow error said it has
    long_context: bool = False  # the request asked for the model's 1M window

    @classmethod
    def of(cls, state: AppState, tenant: TenantSpec, body: dict[str, Any],
           tools: list[dict[str, Any]] | None, scope: str,
           long_context: bool = False) -> Frame:
        """The frame of a request's ``body``; ``tools``: its tools in chat form (what the
        API's adapter made of them: ``Turn.chat_tools``); ``long_context``: its headers ask
        for the 1M window (``Turn.long_context``)."""
        model = str(body["model"])
        enc, exact = state.tokens.encoding(model, tenant.encoding_for(model))
        reserve = body.get("max_completion_tokens") or body.get("max_tokens") \
            or body.get("max_output_tokens")
        choices = body.get("n")
        return cls(model, reserve if isinstance(reserve, int) else None,
                   state.tokens.tools(enc, tools),
                   1.0 if exact else state.tokens.factor(model, scope),
                   ProxyTools.for_request(tools).window_names,
                   choices if isinstance(choices, int) and choices > 0 else 1,
                   state.windows.learned(scope, window_name(model, long_context)),
                   long_context)

    def point(self) -> dict[str, Any]:
        """The frame as kept beside a request's token counts (defaults left out)."""
        out: dict[str, Any] = {"model": self.model, "tools_tokens": self.tools_tokens}
        if self.max_output is not None:
            out["max_output"] = self.max_output
        if self.factor != 1.0:
            out["factor"] = self.factor
        if self.names != DEFAULT_NAMES:
            out["names"] = list(self.names)
        if self.choices != 1:
            out["choices"] = self.choices
        if self.learned is not None:
            out["learned"] = self.learned
        if self.long_context:
            out["long_context"] = True
        return out

    @classmethod
    def from_point(cls, point: dict[str, Any]) -> Frame | None:
        """The frame a request's point keeps; None for a point kept without one."""
        model, tools = point.get("model"), point.get("tools_tokens")
        if not isinstance(model, str) or not isinstance(tools, int):
            return None
        names = point.get("names")
        max_output, factor, choices = (point.get("max_output"), point.get("factor", 1.0),
                                       point.get("choices", 1))
        learned = point.get("learned")
        return cls(model, max_output if isinstance(max_output, int) else None, tools,
                   float(factor) if isinstance(factor, (int, float)) else 1.0,
                   (str(names[0]), str(names[1])) if isinstance(names, list)
                   and len(names) == 2 else DEFAULT_NAMES,
                   choices if isinstance(choices, int) else 1,
                   learned if isinstance(learned, int) else None,
                   point.get("long_context") is True)

    def window(self, tenant: TenantSpec) -> ModelWindow:
        """The model's window for this request: the tenant's when it configured one, else
        what the upstream said, else the table's (known or guessed). What an upstream said
        is its prompt's limit, not a reason to refuse: the request goes, compressed toward
        it, and the upstream answers (its output reserve is held to a quarter, as a guess's)."""
        given = tenant.window_of(self.model, self.long_context)
        if self.learned is not None and given.source != "config":
            return ModelWindow(self.learned, False, "learned")
        return given

    def budget(self, state: AppState, tenant: TenantSpec) -> Budget:
        enc, _ = state.tokens.encoding(self.model, tenant.encoding_for(self.model))
        window = self.window(tenant)
        return Budget.for_request(tenant.policy, window.tokens,
                                  self.max_output, self.tools_tokens + proxy_tools_tokens(
                                      state, enc), self.factor, REPLY_PRIMING, window.known)


def proxy_tools_tokens(state: AppState, enc: Any) -> int:
    """What the proxy's tool definitions add to a prompt (counted once per encoding)."""
    n = state.window_memo.get(("proxy-tools", enc.name))
    if n is None:
        n = state.window_memo[("proxy-tools", enc.name)] = definitions_tokens(state.tokens, enc)
    return int(n)


def window_in(state: AppState, tenant: TenantSpec, frame: Frame, messages: list[Message],
              keys: list[str], counts: list[int], protected: frozenset[str],
              stored: dict[str, str], now: int, stamps: Stamps | None, scope: str,
              carry: Carry | None = None, record_from: int | None = None
              ) -> tuple[Window, Made | None]:
    """The window for a request in ``frame`` carrying ``messages`` (the proxy's exchanges
    spliced in; ``counts`` per message), with the session's ``stored`` summaries; and the
    extractive summary made for it inline, if any (``stored`` then holds it too). ``carry``
    (the last window's) only spares work. ``scope`` names the session (tenant and id): the
    forms the window caches across requests are that session's alone (``SessionMemo``)."""
    policy = tenant.policy
    enc, _ = state.tokens.encoding(frame.model, tenant.encoding_for(frame.model))
    loops = _loops(carry, messages, keys) if policy.summary_model else None
    # an omission by age stops where the clock says, off the batches summaries are planned
    # for: its summary is made inline (extractive) and kept under that count
    aged = aged_loops(policy, loops[:-1], stamps, now) if loops else 0
    cover = covers(keys, loops, policy.omission_batch, {aged, *counts_of(stored)}) \
        if loops is not None else None
    made = inline_digest(policy, stored, cover, loops, messages,
                         lambda t: state.tokens.text(enc, t), aged) if loops and cover else None
    if made is not None:
        stored[made.name] = orjson.dumps(made.record).decode()
    summaries, compactions = summaries_of(policy, stored, cover)
    window = build_window(messages, keys, counts, policy, frame.budget(state, tenant),
                          WindowTokens(state.tokens, enc, state.cuts), protected=protected,
                          timestamps=stamps, now_ms=now,
                          memo=SessionMemo(state.window_memo, scope),
                          tool_names=frame.names, carry=carry, summaries=summaries,
                          compactions=compactions, record_from=record_from,
                          client_tools=frame.tools_tokens > 0)
    e = window.omitted_loops
    if loops and cover is not None and e and e not in dict(summaries) and made is None:
        # an omission off the batch the summary was planned for (over the threshold, asked
        # for): the loops it leaves out are said something about all the same, made now
        cover = covers(keys, loops, policy.omission_batch, {e, aged, *counts_of(stored)})
        made = inline_digest(policy, stored, cover, loops, messages,
                             lambda t: state.tokens.text(enc, t), aged, e)
        if made is not None:
            stored[made.name] = orjson.dumps(made.record).decode()
            summaries, compactions = summaries_of(policy, stored, cover)
            again = build_window(messages, keys, counts, policy, frame.budget(state, tenant),
                                 WindowTokens(state.tokens, enc, state.cuts),
                                 protected=protected, timestamps=stamps, now_ms=now,
                                 memo=SessionMemo(state.window_memo, scope),
                                 tool_names=frame.names, carry=carry, summaries=summaries,
                                 compactions=compactions, record_from=record_from,
                                 client_tools=frame.tools_tokens > 0)
            if again.omitted_loops == e:
                window = again
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


def sends_proxy_tools(tenant: TenantSpec, frame: Frame, window: Window, spliced: bool
                      ) -> tuple[bool, bool]:
    """Whether the proxy's tools are offered (something was left out, the proxy's own
    exchanges are spliced in, or the policy says always), and whether they go out (a
    single-choice request)."""
    offer = window.offers_tools(tenant.policy, frame.tools_tokens > 0) or spliced
    return offer, offer and frame.choices == 1


def prompt_tokens(state: AppState, tenant: TenantSpec, frame: Frame, tokens_in: int,
                  tokens_out: int, with_proxy_tools: bool) -> tuple[int, int]:
    """The whole prompt as the proxy counts it, as the client sent it and as it goes
    upstream: messages, tool schemas (the proxy's own when it adds them), reply priming."""
    enc, _ = state.tokens.encoding(frame.model, tenant.encoding_for(frame.model))
    fixed = frame.tools_tokens + REPLY_PRIMING
    extra = proxy_tools_tokens(state, enc) if with_proxy_tools else 0
    return tokens_in + fixed, tokens_out + fixed + extra


class FirstSeen:
    """When this replica first saw the message at each position (for max_time_range),
    looked up only where the window asks — the first message of each run loop — and at the
    user message a request ends with, so that a loop is dated by the request that opens it
    (a one-loop conversation's window asks nothing). ``dating``: a position not seen yet is
    dated now (a request); else it is unknown (a rebuild reads, never writes)."""

    def __init__(self, seen: MutableMapping[str, int], keys: list[str], now: int, scope: str,
                 dating: bool = True):
        self.seen, self.keys, self.now, self.scope = seen, keys, now, scope
        self.dating = dating
        # the positions dated by this request, as the store keeps them (``position\0key``,
        # the date): written behind, read back by a replica that has not seen the session
        # (after a restart, the loops' dates are the first request's, not the restart's)
        self.new: list[tuple[str, int]] = []

    def __getitem__(self, position: int) -> int | None:
        return self.date(position)

    def packed(self) -> str:
        """The positions this request dated, as ``store.put_dates`` takes them: one string
        (``name\tms`` a line), made where the window is (off the loop for a large request)."""
        return "\n".join([f"{name}\t{ms}" for name, ms in self.new])

    def date(self, position: int) -> int | None:
        """When the message at ``position`` was first seen, now if not before: in this
        conversation, at this position. (Keyed by the text alone, another session's "yes"
        of a week ago made this session's new "yes" old, and its loop was omitted at once.)"""
        name = f"{position}\0{self.keys[position]}"
        key = f"{self.scope}\0{name}"
        t = self.seen.get(key)
        if t is None and self.dating:
            t = self.seen[key] = self.now
            self.new.append((name, t))
        return t


def prompts_of(state: AppState, tenant: TenantSpec, frame: Frame,
               tools: list[dict[str, Any]] | None, messages: list[Message], keys: list[str],
               window: Window | None, with_proxy_tools: bool, placed: Placed | None = None
               ) -> tuple[Prompt, Prompt]:
    """The request's prompt as the client sent it (``messages``, the proxy's exchanges
    spliced in) and as it goes upstream (``window``'s; None: as sent), in the blocks the
    replay prices them in (``ops/replay_offline``): what the headline compares with the
    session's last prompts (``savings.Prompt``), with the breakpoints the proxy added
    (``placed``: the body's). A message the window rewrote is hashed here, as counting it
    did."""
    enc, _ = state.tokens.encoding(frame.model, tenant.encoding_for(frame.model))
    schemas = [Block("tools:" + content_hash(orjson.dumps(tools)), frame.tools_tokens)] \
        if tools else []
    primed = [Block("priming", REPLY_PRIMING)]

    def prompt(ms: list[Message], ks: list[str], extra: list[Block],
               placed: Placed | None = None) -> Prompt:
        blocks = [Block(k, state.tokens.message(enc, m, k), role=str(m.get("role")))
                  for m, k in zip(ms, ks, strict=True)]
        pre = preamble_end(ms)
        after: tuple[int, ...] = ()
        if placed is not None:
            blocks, after = placed_blocks(blocks, placed, lambda t: state.tokens.text(enc, t))
        return Prompt.of(blocks[:pre], [*schemas, *extra], [*blocks[pre:], *primed],
                         [k - pre for k in after])

    client = prompt(messages, keys, [])
    if window is None or (window.messages is messages and not with_proxy_tools
                          and placed is None):
        return client, client
    own = {id(m): k for m, k in zip(messages, keys, strict=True)}
    sent = [own.get(id(m)) or message_hash(m) for m in window.messages]
    extra = [Block("proxy-tools", proxy_tools_tokens(state, enc))] if with_proxy_tools else []
    return client, prompt(window.messages, sent, extra, placed)
