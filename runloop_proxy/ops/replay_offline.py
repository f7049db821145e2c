"""The offline replay: for every assistant turn of a recorded conversation, the window the proxy
would send for ``messages[:i]`` (exactly as the proxy builds it, minus its own tool exchanges,
which a recording does not have), priced on both sides by every cost model.

Cost models (``replay_tally.MODELS``, input-token equivalents, cached tokens at 10%, 1,024
tokens before anything is cached, then 128-token steps): ``cache_aware`` caches the tool
schemas and the message prefix apart; ``strict`` renders the tools first (Anthropic's order),
so a tool list that changes re-reads the system prompt and every message after it. Money is
priced with a provider's own cache and a model's prices (``pricing``): OpenAI's automatic
prefix cache over the system messages, the tools, then the rest; or Anthropic's breakpoints
over the tools, the system prompt and the messages, with a breakpoint after the system prompt
and one at the end of each prompt, the placement both sides get (as Claude Code places them);
with ``cache_breakpoints = "auto"`` the proxy's side gets the proxy's own as well, where the
live proxy's body puts them (``auto_placed``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from ..api.messages_wire import auto_marked
from ..caches import ByteLRU
from ..config import Policy, TenantSpec
from ..conversation.blocks import to_anthropic
from ..conversation.items import to_items
from ..conversation.messages import (
    Message,
    content_hash,
    message_hash,
    message_refs,
    text_of,
)
from ..conversation.runloops import preamble_end, segment
from ..history.summaries import digest, due
from ..pipeline.tokens import REPLY_PRIMING, TokenCounter, WindowTokens, encoding_name_for
from ..pipeline.tools import Doc, ProxyTools, doc, query_terms, rank_docs
from ..pricing import Block, BreakpointCache, PrefixCache, Price, Provider
from ..savings import Meter, Placed, Prompt, placed_blocks
from ..window.builder import Window, build_window
from ..window.forms import Budget
from ..window.retention import Conversation as RetentionMeter
from .replay_tally import SEPARATE, STRICT, Tally

CACHE_MIN = 1024
CACHE_BLOCK = 128
CACHED_PRICE = 0.1


def cached_cost(total: int, prefix: int, step: int = CACHE_BLOCK) -> float:
    """Cost of a prompt of ``total`` tokens whose first ``prefix`` repeat an earlier one."""
    cached = (prefix // step) * step if prefix >= CACHE_MIN else 0
    return (total - cached) + CACHED_PRICE * cached


class Side:
    """One side of a conversation — the client's requests, or what the proxy forwards —
    priced request by request under every cost model."""

    def __init__(self, provider: Provider | None, price: Price | None,
                 step: int = CACHE_BLOCK):
        self.messages = PrefixCache(0, 1)  # the shared message prefix, to the token
        self.tools_seen: set[str] = set()
        self.step = step  # the token models' cache granularity (1: no rounding)
        self.strict = PrefixCache(CACHE_MIN, step)
        self.provider, self.price = provider, price
        self.cache = provider.new_cache() if provider is not None and price is not None \
            else None

    def bill(self, system: list[Block], tools: list[Block], rest: list[Block],
             marked: Marked = None) -> tuple[float, float, float]:
        """The request's cost: cache-aware, strict, and in money (0 without a price).
        ``marked``: with Anthropic's cache, the messages as the proxy's own breakpoints
        split and mark them (``auto_marked``), in place of ``rest``."""
        total = sum(b.tokens for b in system) + sum(b.tokens for b in tools) \
            + sum(b.tokens for b in rest) + REPLY_PRIMING
        primed = [Block("priming", REPLY_PRIMING)]
        shared = self.messages.bill([*system, *rest]).cached \
            + sum(b.tokens for b in tools if b.key in self.tools_seen)
        self.tools_seen.update(b.key for b in tools)
        separate = cached_cost(total, shared, self.step)
        strict = self.strict.bill([*tools, *system, *rest, *primed]).tokens_cost(CACHED_PRICE)
        money = 0.0
        if isinstance(self.cache, BreakpointCache) and self.price is not None:
            head = len(tools) + len(system)
            parts, after = marked if marked is not None else (rest, ())
            blocks = [*tools, *system, *parts, *primed]
            money = self.price.cost(self.cache.bill(
                blocks, [head, *(head + k for k in after), len(blocks) - 1]))
        elif isinstance(self.cache, PrefixCache) and self.price is not None:
            money = self.price.cost(self.cache.bill([*system, *tools, *rest, *primed]))
        return separate, strict, money


# the messages of a request as Anthropic blocks, and the proxy's breakpoints among them (a
# breakpoint k caches the first k)
Marked = tuple[list[Block], tuple[int, ...]] | None


def auto_placed(window: Window, sent: set[str]) -> Placed:
    """Where ``cache_breakpoints = "auto"`` puts the proxy's breakpoints in ``window``'s
    messages: the body ``api/messages_wire`` sends for it, its turns merged as the live
    proxy merges them (``sent``: the hashes of the request's messages; the last message
    not among them ends the stable prefix)."""
    turn_of: list[int] = []
    system, turns = to_anthropic(window.messages, None, turn_of)
    out: dict[str, Any] = {"messages": turns, **({} if system is None else {"system": system})}
    stable = next((k for k in range(len(window.messages) - 1, -1, -1)
                   if message_hash(window.messages[k]) not in sent), -1)
    return auto_marked(out, turn_of, stable, window.note)[1]


class Replayer:
    def __init__(self, tenant: TenantSpec, model: str, context: int | None,
                 summary_cost: int = 0, provider: Provider | None = None,
                 cache_step: int = CACHE_BLOCK):
        self.tenant = tenant
        self.cache_step = cache_step  # the token cost models' step (money: the provider's)
        self.summary_cost = summary_cost
        self.model = model
        self.context = context or tenant.context_window(model)
        self.counter = TokenCounter()
        self.counter.warm([tenant.encoding_for(model) or encoding_name_for(model) or ""])
        self.enc, exact = self.counter.encoding(model, tenant.encoding_for(model))
        # what the figures were counted with: the model's own encoding, or the fallback
        self.encoding = self.enc.name if exact else f"{self.enc.name} (fallback)"
        self.ops = WindowTokens(self.counter, self.enc, ByteLRU(256 << 20))
        self.provider = provider
        self.price = provider.price(model) if provider is not None else None
        # a provider whose cache reads at breakpoints (Anthropic's): the proxy adds its own
        self.breakpoints = provider is not None and provider.cache == "breakpoints"

    def meter(self) -> Meter:
        """A conversation's headline figure, priced by the replay's provider."""
        return Meter([self.provider] if self.provider is not None else [])

    def proxy_tools_tokens(self, tools: list[dict[str, Any]] | None) -> int:
        """What the proxy's tools add to a request carrying ``tools`` (with none, the tools
        section's frame as well)."""
        defs = ProxyTools.for_request(tools).definitions()
        return self.counter.tools(self.enc, [*(tools or []), *defs]) \
            - self.counter.tools(self.enc, tools)

    def budget(self, tools: list[dict[str, Any]] | None) -> Budget:
        return Budget.for_request(self.tenant.policy, self.context, None,
                                  self.counter.tools(self.enc, tools)
                                  + self.proxy_tools_tokens(tools), 1.0, REPLY_PRIMING)

    def client_prompt(self, messages: list[Message], tools: list[dict[str, Any]] | None
                      ) -> int:
        """The whole prompt as the client sends it (messages, tool schemas, priming)."""
        return sum(self.counter.message(self.enc, m) for m in messages) \
            + self.counter.tools(self.enc, tools) + REPLY_PRIMING

    def conversation(self, conv: dict[str, Any], tally: Tally,
                     seen: Callable[[int, list[Message], Window], None] | None = None) -> None:
        """Replay one conversation into ``tally``; ``seen`` is told each request point's
        messages as the client sent them and the window built for them."""
        messages: list[Message] = conv["messages"]
        tools = conv.get("tools") or None
        tools_tokens = self.counter.tools(self.enc, tools)
        proxy_tokens = self.proxy_tools_tokens(tools)
        budget = self.budget(tools)
        policy = self.tenant.policy
        names = ProxyTools.for_request(tools).window_names
        keys = [message_hash(m) for m in messages]
        counts = [self.counter.message(self.enc, m, k) for m, k in zip(messages, keys,
                                                                       strict=True)]
        blocks = {id(m): (m, Block(k, c, text_of(m.get("content")), str(m.get("role"))))
                  for m, k, c in zip(messages, keys, counts, strict=True)}

        def block(m: Message) -> Block:
            hit = blocks.get(id(m))
            if hit is None or hit[0] is not m:
                k = message_hash(m)
                hit = blocks[id(m)] = (m, Block(k, self.counter.message(self.enc, m, k),
                                                text_of(m.get("content")),
                                                str(m.get("role"))))
            return hit[1]

        tools_block = [Block("tools:" + content_hash(orjson.dumps(tools)), tools_tokens)] \
            if tools else []
        proxy_block = [Block("proxy-tools", proxy_tokens)]
        primed = [Block("priming", REPLY_PRIMING)]
        last: tuple[Prompt | None, Prompt | None] = (None, None)
        # a loop's start depends only on the messages before it: segment the whole
        # conversation once, not each request's prefix
        pre = preamble_end(messages)
        loop_start = [0] * len(messages)
        for lp in segment(messages):
            for k in lp.positions:
                loop_start[k] = lp.start
        fixed = "\n".join([text_of(m.get("content")) for m in messages[:pre]]
                          + [orjson.dumps(tools).decode() if tools else ""])
        plain = RetentionMeter(messages, fixed)
        careful = RetentionMeter(messages, fixed, careful=True)
        mrefs = message_refs(keys)
        docs: list[Doc] = []

        def search(query: str, upto: int) -> list[int]:
            """The positions search_history returns for ``query`` in messages[:upto] (the
            tool ranks the request's whole conversation, system prompt included)."""
            if not docs:
                docs.extend(doc(str(k), m) for k, m in enumerate(messages))
            hits = rank_docs(query_terms(query), docs[:upto], policy.search_results, query)
            return [int(key) for _, key, _ in hits]

        reasoning = [0]
        for m in messages:
            reasoning.append(reasoning[-1] + _reasoning_items(m.get("items") or []))
        ahead = SummariesAhead(policy, messages, segment(messages),
                               lambda t: self.counter.text(self.enc, t), self.summary_cost)
        meter = self.meter()
        client = Side(self.provider, self.price, self.cache_step)
        forwarded = Side(self.provider, self.price, self.cache_step)
        bound = Side(None, None, self.cache_step)
        pressed = False
        carry = None
        for i in range(1, len(messages)):
            if messages[i].get("role") != "assistant":
                continue
            req, rcounts = messages[:i], counts[:i]
            # the last window's carry, as the proxy keeps it: it spares recomputing the
            # conversation's forms and never changes a window (tests/test_window.py)
            window = build_window(req, keys[:i], rcounts, policy, budget, self.ops,
                                  tool_names=names, client_tools=bool(tools), carry=carry,
                                  summaries=ahead.upto(i, tally, pressed))
            carry = window.carry
            if seen is not None:
                seen(i, req, window)
            pressed = window.tokens_out > policy.target * budget.working
            client_total = sum(rcounts) + tools_tokens + REPLY_PRIMING
            with_tools = window.offers_tools(policy, bool(tools))
            wblocks = [block(m) for m in window.messages]
            fwd_total = sum(b.tokens for b in wblocks) + tools_tokens \
                + (proxy_tokens if with_tools else 0) + REPLY_PRIMING
            tally.requests += 1
            tally.client += client_total
            tally.forwarded += fwd_total
            cblocks = [block(m) for m in req]
            wpre = preamble_end(window.messages)
            # the proxy's own breakpoints, where the live proxy's Messages body puts them (it
            # converts a window that changed or offers its tools); OpenAI's has none
            placed = auto_placed(window, set(keys[:i])) \
                if policy.cache_breakpoints == "auto" and self.breakpoints \
                and (window.changed or with_tools) else None
            fblocks, after = placed_blocks(wblocks, placed, lambda t: self.counter.text(
                self.enc, t)) if placed is not None else (wblocks, ())
            marks = tuple(k - wpre for k in after)
            # the headline's facts, as the proxy records them (``savings.Prompt``)
            prompts = (Prompt.of(cblocks[:pre], tools_block, [*cblocks[pre:], *primed]),
                       Prompt.of(fblocks[:wpre],
                                 [*tools_block, *(proxy_block if with_tools else [])],
                                 [*fblocks[wpre:], *primed], marks))
            meter.add(self.model, client_total, fwd_total, None,
                      (prompts[0].shared(last[0]), prompts[1].shared(last[1])),
                      (prompts[0].head, prompts[1].head), (prompts[0].marks, prompts[1].marks))
            last = prompts
            c_sep, c_strict, c_money = client.bill(cblocks[:pre], tools_block, cblocks[pre:])
            marked = (fblocks[wpre:], marks) if placed is not None else None
            f_sep, f_strict, f_money = forwarded.bill(
                wblocks[:wpre], [*tools_block, *(proxy_block if with_tools else [])],
                wblocks[wpre:], marked)
            tally.charge(SEPARATE, c_sep, f_sep)
            tally.charge(STRICT, c_strict, f_strict)
            tally.money[0] += c_money
            tally.money[1] += f_money
            if self.price is not None:
                tally.output_money += counts[i] * self.price.output / 1_000_000
            # the bound no window reaches: the system prompt, the tools and the current loop
            keep = [*range(pre), *range(loop_start[i - 1], i)] if i > pre else list(range(i))
            b_sep, _, _ = bound.bill(cblocks[:pre], tools_block,
                                     [cblocks[k] for k in keep if k >= pre])
            tally.bound += sum(counts[k] for k in keep) + tools_tokens + REPLY_PRIMING
            tally.bound_cost += b_sep
            tally.over_client += client_total > self.context
            if not window.fits:
                tally.rejected += 1
                tally.over_forwarded += 1
            else:
                tally.over_forwarded += fwd_total > self.context
            for e in window.events:
                tally.events[e.kind.value] = tally.events.get(e.kind.value, 0) + 1
            start = loop_start[i - 1] if i > pre else 0
            tally.retention.add(plain.retention(i, start, window.messages, mrefs, search))
            tally.careful.add(careful.retention(i, start, window.messages, mrefs, search))
            tally.retention_passthrough.add(plain.retention(i, start, req))
            if reasoning[i]:
                tally.reasoning_client += reasoning[i]
                tally.reasoning_forwarded += _reasoning_items(to_items(window.messages)[1])
        tally.savings = meter.total


class SummariesAhead:
    """The summaries a proxy would have ready at each request point: each made when the proxy
    would start it (``history.summaries.due``: one loop before the omission event that needs
    it), with the extractive digest; with ``summary_model`` a model, the digest stands in for
    its text and each call is priced at ``cost`` tokens."""

    def __init__(self, policy: Policy, messages: list[Message], loops: list[Any],
                 count: Callable[[str], int], cost: int):
        self.policy, self.messages, self.count, self.cost = policy, messages, count, cost
        self.closed = [lp for lp in loops if lp.final_position is not None]
        self.made: list[tuple[int, str]] = []

    def upto(self, i: int, tally: Tally, pressed: bool = False) -> tuple[tuple[int, str], ...]:
        """The summaries made by request point ``i`` (messages[:i]), each when the proxy
        would start it (``due``; ``pressed``: the last window was past its target)."""
        if not self.policy.summary_model:
            return ()
        b = self.policy.omission_batch
        done = sum(1 for lp in self.closed if lp.end <= i)
        while due(self.policy, (len(self.made) + 1) * b, done, pressed):
            e = (len(self.made) + 1) * b
            previous = self.made[-1][1] if self.made else None
            self.made.append((e, digest(self.policy, previous, self.messages,
                                        self.closed[e - b:e], self.count)))
            tally.summaries += 1
            if self.policy.summary_model != "extractive":
                # the net saving pays for the summary calls, at full price
                tally.summary_tokens += self.cost
                tally.spend(self.cost)
        return tuple(self.made)


def _reasoning_items(items: list[dict[str, Any]]) -> int:
    return sum(i.get("type") == "reasoning" for i in items)
