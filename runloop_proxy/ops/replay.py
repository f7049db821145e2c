"""`runloop-proxy replay FILE.jsonl`: what the window saves on recorded conversations.

For every assistant turn i of every conversation it builds the window the proxy would send for
``messages[:i]`` (offline, exactly as the proxy does, minus the proxy's own tool exchanges, which
a recording does not have) and tallies prompt tokens client vs forwarded, a prefix-cache-aware
cost, and requests over ``--context``. ``--proxy URL`` sends each request through a running
proxy instead (see ``HttpReplay``), and ``--direct URL`` straight to the upstream as well, to
price both sides by the upstream's own cached tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from pydantic import ValidationError

from ..caches import ByteLRU
from ..config import Policy, Settings, TenantSpec, load_config, passthrough_tenant
from ..conversation import blocks
from ..conversation.items import to_items, to_messages, tool_to_chat
from ..conversation.messages import Message, message_hash, message_refs, text_of
from ..conversation.runloops import preamble_end, segment
from ..errors import ConfigError
from ..history.summaries import digest, due
from ..pipeline.accounting import prompt_usage
from ..pipeline.tokens import REPLY_PRIMING, TokenCounter, WindowTokens, encoding_name_for
from ..pipeline.tools import Doc, ProxyTools, definitions_tokens, doc, query_terms, rank_docs
from ..window.builder import build_window
from ..window.forms import Budget
from ..window.retention import Conversation as RetentionMeter
from ..window.retention import Retention
from . import anthropic_cost

CACHE_MIN = 1024
CACHE_BLOCK = 128
CACHED_PRICE = 0.1


@dataclass
class Tally:
    requests: int = 0
    client: int = 0
    forwarded: int = 0
    client_cost: float = 0.0
    forwarded_cost: float = 0.0
    forwarded_cost_strict: float = 0.0
    bound: int = 0  # keeping only the system prompt, the tools and the current loop
    bound_cost: float = 0.0
    over_client: int = 0
    over_forwarded: int = 0
    rejected: int = 0
    events: dict[str, int] = field(default_factory=dict)
    retention: Retention = field(default_factory=Retention)
    retention_passthrough: Retention = field(default_factory=Retention)
    summaries: int = 0  # summaries made
    summary_tokens: int = 0  # what the summary calls cost (--summary-cost each)
    reasoning_client: int = 0  # Responses reasoning items sent, summed over requests
    reasoning_forwarded: int = 0
    # Messages conversations priced in Anthropic's cache model too (anthropic_cost.py)
    anthropic: tuple[anthropic_cost.CacheTally, anthropic_cost.CacheTally] | None = None

    def saving(self, a: float, b: float) -> float:
        return 1 - b / a if a else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "client_tokens": self.client,
                "forwarded_tokens": self.forwarded,
                "raw_saving": round(self.saving(self.client, self.forwarded), 4),
                "client_cost": round(self.client_cost), "forwarded_cost":
                    round(self.forwarded_cost),
                "cache_aware_saving": round(self.saving(self.client_cost,
                                                        self.forwarded_cost), 4),
                "forwarded_cost_strict": round(self.forwarded_cost_strict),
                "bound_raw_saving": round(self.saving(self.client, self.bound), 4),
                "bound_cache_aware_saving": round(self.saving(self.client_cost,
                                                              self.bound_cost), 4),
                "cache_aware_saving_strict": round(self.saving(
                    self.client_cost, self.forwarded_cost_strict), 4),
                "over_context_passthrough": self.over_client,
                "over_context_proxy": self.over_forwarded, "rejected": self.rejected,
                "compaction_events": self.events, "retention": self.retention.as_dict(),
                "retention_passthrough": self.retention_passthrough.as_dict(),
                "summaries": self.summaries, "summary_tokens": self.summary_tokens,
                "reasoning_items": {"client": self.reasoning_client,
                                    "forwarded": self.reasoning_forwarded},
                **({"anthropic_cache": _anthropic(*self.anthropic)} if self.anthropic else {})}


def _anthropic(client: anthropic_cost.CacheTally, fwd: anthropic_cost.CacheTally
               ) -> dict[str, Any]:
    return {"client_cost": round(client.cost), "forwarded_cost": round(fwd.cost),
            "saving": round(1 - fwd.cost / client.cost, 4) if client.cost else 0.0,
            "read_share_client": round(client.read / client.tokens, 4) if client.tokens else 0,
            "read_share_forwarded": round(fwd.read / fwd.tokens, 4) if fwd.tokens else 0,
            "written_client": client.written, "written_forwarded": fwd.written}


def cached_cost(total: int, prefix: int) -> float:
    """Cost of a prompt of ``total`` tokens whose first ``prefix`` repeat the last request."""
    cached = (prefix // CACHE_BLOCK) * CACHE_BLOCK if prefix >= CACHE_MIN else 0
    return (total - cached) + CACHED_PRICE * cached


def common_prefix_tokens(prev: list[str] | None, cur: list[str], counts: list[int],
                         prev_msgs: list[Message] | None = None,
                         cur_msgs: list[Message] | None = None,
                         prev_counts: list[int] | None = None) -> int:
    """Tokens of the leading messages ``cur`` shares with ``prev``. Given the messages, the
    first one that differs still counts when one's text extends the other's (text appended
    to a system prompt): a provider's cache matches tokens, not messages."""
    if prev is None:
        return 0
    k = 0
    while k < len(prev) and k < len(cur) and prev[k] == cur[k]:
        k += 1
    shared = sum(counts[:k])
    if prev_msgs is None or cur_msgs is None or prev_counts is None \
            or k >= len(prev) or k >= len(cur):
        return shared
    a, b = prev_msgs[k], cur_msgs[k]
    ta, tb = text_of(a.get("content")), text_of(b.get("content"))
    if a.get("role") == b.get("role") and ta and tb and (tb.startswith(ta) or ta.startswith(tb)):
        shared += min(prev_counts[k], counts[k]) - 1  # its last token may merge with the rest
    return shared


class Replayer:
    def __init__(self, tenant: TenantSpec, model: str, context: int | None,
                 summary_cost: int = 0):
        self.tenant = tenant
        self.summary_cost = summary_cost
        self.model = model
        self.context = context or tenant.context_window(model)
        self.counter = TokenCounter()
        self.counter.warm([tenant.encoding_for(model) or encoding_name_for(model) or ""])
        self.enc, exact = self.counter.encoding(model, tenant.encoding_for(model))
        # what the figures were counted with: the model's own encoding, or the fallback
        self.encoding = self.enc.name if exact else f"{self.enc.name} (fallback)"
        self.proxy_tools = definitions_tokens(self.counter, self.enc)
        self.ops = WindowTokens(self.counter, self.enc, ByteLRU(256 << 20))

    def budget(self, tools_tokens: int) -> Budget:
        return Budget.for_request(self.tenant.policy, self.context, None,
                                  tools_tokens + self.proxy_tools, 1.0, REPLY_PRIMING)

    def client_prompt(self, messages: list[Message], tools: list[dict[str, Any]] | None
                      ) -> int:
        """The whole prompt as the client sends it (messages, tool schemas, priming)."""
        return sum(self.counter.message(self.enc, m) for m in messages) \
            + self.counter.tools(self.enc, tools) + REPLY_PRIMING

    def conversation(self, conv: dict[str, Any], tally: Tally) -> None:
        messages: list[Message] = conv["messages"]
        tools = conv.get("tools") or None
        tools_tokens = self.counter.tools(self.enc, tools)
        budget = self.budget(tools_tokens)
        names = ProxyTools.for_request(tools).window_names
        keys = [message_hash(m) for m in messages]
        counts = [self.counter.message(self.enc, m, k) for m, k in zip(messages, keys,
                                                                       strict=True)]
        # a loop's start depends only on the messages before it: segment the whole
        # conversation once, not each request's prefix
        pre = preamble_end(messages)
        loop_start = [0] * len(messages)
        for lp in segment(messages):
            for k in lp.positions:
                loop_start[k] = lp.start
        refs = RetentionMeter(messages, "\n".join(
            [text_of(m.get("content")) for m in messages[:pre]] +
            [orjson.dumps(tools).decode() if tools else ""]))
        mrefs = message_refs(keys)
        docs: list[Doc] = []

        def search(query: str, upto: int) -> list[int]:
            """The positions search_history returns for ``query`` in messages[:upto] (the
            tool ranks the request's whole conversation, system prompt included)."""
            if not docs:
                docs.extend(doc(str(k), m) for k, m in enumerate(messages))
            hits = rank_docs(query_terms(query), docs[:upto], self.tenant.policy.search_results,
                             query)
            return [int(key) for _, key, _ in hits]

        reasoning = [0]
        for m in messages:
            reasoning.append(reasoning[-1] + _reasoning_items(m.get("items") or []))
        ahead = SummariesAhead(self.tenant.policy, messages, segment(messages),
                               lambda t: self.counter.text(self.enc, t), self.summary_cost)
        prev_client: list[str] | None = None
        prev_bound: list[str] | None = None
        prev_fwd: list[str] | None = None
        prev_fwd_msgs: list[Message] | None = None
        prev_fwd_counts: list[int] | None = None
        prev_fwd_tools = False
        pressed = False
        priced = _AnthropicSides(self, conv, tools, tally) if conv.get("anthropic") else None
        for i in range(1, len(messages)):
            if messages[i].get("role") != "assistant":
                continue
            req, rkeys, rcounts = messages[:i], keys[:i], counts[:i]
            window = build_window(req, rkeys, rcounts, self.tenant.policy, budget, self.ops,
                                  tool_names=names,
                                  summaries=ahead.upto(i, tally, pressed))
            pressed = window.tokens_out > self.tenant.policy.target * budget.working
            client_total = sum(rcounts) + tools_tokens + REPLY_PRIMING
            with_tools = window.offers_tools(self.tenant.policy, bool(tools))
            fwd_tools = tools_tokens + (self.proxy_tools if with_tools else 0)
            if window.changed:
                wkeys = [message_hash(m) for m in window.messages]
                wcounts = [self.counter.message(self.enc, m, k)
                           for m, k in zip(window.messages, wkeys, strict=True)]
            else:
                wkeys, wcounts = rkeys, rcounts
            fwd_total = sum(wcounts) + fwd_tools + REPLY_PRIMING
            tally.requests += 1
            tally.client += client_total
            # The cached prefix: the client's tool schemas (unchanged), the proxy's once they
            # were already there, plus the leading messages shared with the previous request.
            # Strict: providers that render the tools first (tools, system, messages) keep only
            # the client's tools cached when the proxy appends its own: the system prompt and
            # the messages after them are read again.
            first = prev_client is None
            tally.client_cost += cached_cost(client_total, (0 if first else tools_tokens)
                                             + common_prefix_tokens(prev_client, rkeys, rcounts))
            same_tools = prev_fwd is not None and prev_fwd_tools == with_tools
            msg_prefix = common_prefix_tokens(prev_fwd, wkeys, wcounts, prev_fwd_msgs,
                                              window.messages, prev_fwd_counts)
            tools_prefix = 0 if first else tools_tokens + (self.proxy_tools if same_tools
                                                           and with_tools else 0)
            tally.forwarded_cost += cached_cost(fwd_total, tools_prefix + msg_prefix)
            tally.forwarded_cost_strict += cached_cost(
                fwd_total, fwd_tools + msg_prefix if same_tools else tools_prefix)
            tally.forwarded += fwd_total
            # the bound no window reaches: the system prompt, the tools and the current loop
            keep = [*range(pre), *range(loop_start[i - 1], i)] if i > pre else list(range(i))
            bkeys = [keys[k] for k in keep]
            bound = sum(counts[k] for k in keep) + tools_tokens + REPLY_PRIMING
            tally.bound += bound
            tally.bound_cost += cached_cost(bound, (0 if first else tools_tokens) +
                                            common_prefix_tokens(prev_bound, bkeys,
                                                                 [counts[k] for k in keep]))
            prev_bound = bkeys
            tally.over_client += client_total > self.context
            if not window.fits:
                tally.rejected += 1
                tally.over_forwarded += 1
            else:
                tally.over_forwarded += fwd_total > self.context
            for e in window.events:
                tally.events[e.kind.value] = tally.events.get(e.kind.value, 0) + 1
            start = loop_start[i - 1] if i > pre else 0
            tally.retention.add(refs.retention(i, start, window.messages, mrefs, search))
            tally.retention_passthrough.add(refs.retention(i, start, req))
            if reasoning[i]:
                tally.reasoning_client += reasoning[i]
                tally.reasoning_forwarded += _reasoning_items(to_items(window.messages)[1])
            prev_client, prev_fwd, prev_fwd_tools = rkeys, wkeys, with_tools
            prev_fwd_msgs, prev_fwd_counts = window.messages, wcounts
            if priced is not None:
                priced.request(pre, rkeys, rcounts, wkeys, wcounts, with_tools)


class _AnthropicSides:
    """A Messages conversation's requests priced in Anthropic's cache model, both sides: the
    client marks the end of its system prompt and of each request (as Claude Code does); the
    window keeps those, and with ``cache_breakpoints = "auto"`` marks the end of its stable
    prefix too (the last message it rewrote)."""

    def __init__(self, replayer: Replayer, conv: dict[str, Any],
                 tools: list[dict[str, Any]] | None, tally: Tally):
        if tally.anthropic is None:
            tally.anthropic = (anthropic_cost.CacheTally(), anthropic_cost.CacheTally())
        self.client = anthropic_cost.Conversation(tally.anthropic[0])
        self.forwarded = anthropic_cost.Conversation(tally.anthropic[1])
        self.tools = replayer.counter.tools(replayer.enc, tools)
        self.proxy_tools = replayer.proxy_tools
        self.auto = replayer.tenant.policy.cache_breakpoints == "auto"

    def request(self, pre: int, rkeys: list[str], rcounts: list[int], wkeys: list[str],
                wcounts: list[int], with_tools: bool) -> None:
        ends = [pre, len(rkeys)] if pre else [len(rkeys)]  # +1 for the tools part
        self.client.request(["tools", *rkeys], [self.tools, *rcounts], ends, REPLY_PRIMING)
        marks = [pre, len(wkeys)] if pre else [len(wkeys)]
        if self.auto:
            sent = set(rkeys)
            marks.append(next((k + 1 for k in range(len(wkeys) - 1, -1, -1)
                               if wkeys[k] not in sent), 0))
        tools = self.tools + (self.proxy_tools if with_tools else 0)
        self.forwarded.request([f"tools{with_tools}", *wkeys], [tools, *wcounts], marks,
                               REPLY_PRIMING)


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
                tally.forwarded += self.cost
                tally.forwarded_cost += self.cost
                tally.forwarded_cost_strict += self.cost
        return tuple(self.made)


class HttpReplay:
    """Every request point sent through a running proxy, in one proxy session per conversation.

    Raw sizes come from the proxy's ``X-Runloop-Tokens`` header (the whole prompt as sent and as
    forwarded, counted as the offline replay counts). With ``direct`` each request also goes
    straight to the upstream, and both sides are measured by the upstream's own usage: prompt
    tokens and the cached tokens its prefix cache served (the cache-aware cost). The scripted
    upstream keeps the two sides' caches apart (``X-Scripted-Cache-Scope``, which real
    upstreams ignore); a real provider caches per organization, so there the side sent second
    may be served prefixes the first one cached (the system prompt and tools mostly).
    """

    def __init__(self, args: argparse.Namespace, replayer: Replayer):
        import httpx

        self.model, self.context = args.model, replayer.context
        self.replayer = replayer  # counts what a rejected request held
        self.run = f"replay-{time.time_ns()}"
        self.proxy = httpx.Client(base_url=args.proxy.rstrip("/"), timeout=120,
                                  headers=_bearer(args.api_key))
        self.direct = httpx.Client(base_url=args.direct.rstrip("/"), timeout=120,
                                   headers=_bearer(args.direct_key)) if args.direct else None
        self.cached = 0  # upstream-reported cached tokens, both sides

    def summary_tokens(self) -> int:
        """What the proxy's summary calls have used so far (its /metrics), to net them out."""
        try:
            text = self.proxy.get("/metrics").text
        except Exception:  # noqa: BLE001 - a proxy without /metrics: nothing to net out
            return 0
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("runloop_summary_tokens_total{")))

    def close(self) -> None:
        self.proxy.close()
        if self.direct is not None:
            self.direct.close()

    def conversation(self, conv: dict[str, Any], idx: int, tally: Tally) -> None:
        messages = conv["messages"]
        for i in range(1, len(messages)):
            if messages[i].get("role") != "assistant":
                continue
            path, body = _request(self.model, conv, messages[:i])
            payload = orjson.dumps(body)
            r = self.proxy.post("/v1" + path, content=payload, headers={
                "X-Session-Id": f"{self.run}-{idx}", "Content-Type": "application/json",
                "X-Scripted-Cache-Scope": f"{self.run}-proxy"})
            tally.requests += 1
            header = r.headers.get("x-runloop-tokens")
            if r.status_code == 400 and "context_length_exceeded" in r.text:
                # refused, nothing forwarded: counted as sent, over the limit on both sides
                client = self.replayer.client_prompt(messages[:i], conv.get("tools"))
                tally.rejected += 1
                tally.client += client
                tally.forwarded += client
                tally.over_client += 1
                tally.over_forwarded += 1
                continue
            if r.status_code != 200 or not header:
                raise ReplayError(f"conversation {idx}, request {tally.requests}: the proxy "
                                  f"answered {r.status_code} {r.text[:200]}")
            client, forwarded = map(int, header.split(";"))
            tally.client += client
            tally.forwarded += forwarded
            tally.over_client += client > self.context
            tally.over_forwarded += forwarded > self.context
            if self.direct is None:
                continue
            d = self.direct.post(path, content=payload, headers={
                "Content-Type": "application/json", "X-Scripted-Cache-Scope": f"{self.run}-direct"})
            if d.status_code != 200:
                raise ReplayError(f"conversation {idx}: the upstream answered "
                                  f"{d.status_code} {d.text[:200]}")
            tally.client_cost += self._cost(d.json().get("usage"), client)
            tally.forwarded_cost += self._cost(r.json().get("usage"), forwarded)

    def _cost(self, usage: dict[str, Any] | None, tokens: int) -> float:
        """``tokens`` priced with the share of the prompt the upstream served from its cache
        (the upstream may count with another tokenizer: its share carries over, not its
        numbers)."""
        prompt, cached = prompt_usage(usage or {})
        self.cached += cached
        share = cached / prompt if prompt else 0.0
        return tokens * (1 - share) + CACHED_PRICE * tokens * share


class ReplayError(Exception):
    pass


def _reasoning_items(items: list[dict[str, Any]]) -> int:
    return sum(i.get("type") == "reasoning" for i in items)


def conversation_of(line: Any) -> dict[str, Any] | None:
    """A recorded conversation as the replay reads it: chat-shaped messages and tools. A
    Responses conversation (``input`` items, ``instructions``) becomes the conversation model
    the proxy builds from it, and keeps its own form for a replay through a proxy."""
    if not isinstance(line, dict):
        return None
    if isinstance(line.get("messages"), list) and _is_messages_api(line):
        tools = [t for t in line.get("tools") or [] if isinstance(t, dict)]
        return {"messages": blocks.to_messages(line["messages"], line.get("system")),
                "tools": [blocks.tool_to_chat(t) for t in tools], "anthropic": tools}
    if isinstance(line.get("messages"), list):
        return line
    if not isinstance(line.get("input"), list):
        return None
    tools = [t for t in line.get("tools") or [] if isinstance(t, dict)]
    return {"messages": to_messages(line["input"], line.get("instructions")),
            "tools": [tool_to_chat(t) for t in tools], "responses_tools": tools}


def _is_messages_api(line: dict[str, Any]) -> bool:
    """A conversation recorded in Anthropic's Messages format: a top-level ``system``, tools
    with an ``input_schema``, or tool_use / tool_result blocks."""
    if line.get("format") == "anthropic" or "system" in line:
        return True
    if any(isinstance(t, dict) and "input_schema" in t for t in line.get("tools") or []):
        return True
    return any(isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result")
               for m in line["messages"] if isinstance(m, dict)
               and isinstance(m.get("content"), list) for b in m["content"])


def _request(model: str, conv: dict[str, Any], messages: list[Message]
             ) -> tuple[str, dict[str, Any]]:
    """The path and body of the request a client sent at this point of the conversation."""
    if "anthropic" in conv:
        system, turns = blocks.to_anthropic(messages)
        request: dict[str, Any] = {"model": model, "max_tokens": 1, "messages": turns,
                **({"system": system} if system is not None else {}),
                **({"tools": conv["anthropic"]} if conv["anthropic"] else {})}
        return "/messages", request
    if "responses_tools" in conv:
        instructions, items = to_items(messages)
        body: dict[str, Any] = {"model": model, "input": items, "max_output_tokens": 16}
        if instructions is not None:
            body["instructions"] = instructions
        if conv["responses_tools"]:
            body["tools"] = conv["responses_tools"]
        return "/responses", body
    body = {"model": model, "messages": messages, "max_tokens": 1}
    if conv.get("tools"):
        body["tools"] = conv["tools"]
    return "/chat/completions", body


def _pct(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.1%}"


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _progress(done: int, total: int, started: float, enabled: bool) -> None:
    if not enabled:
        return
    width = 30
    filled = int(width * done / max(total, 1))
    rate = done / max(time.monotonic() - started, 1e-9)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                     f"conversations ({rate:.1f}/s)")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _tenant(args: argparse.Namespace) -> TenantSpec:
    if not args.config:
        tenant = passthrough_tenant(Settings(context_window=args.context))
    else:
        config = load_config(Settings(config_dir=args.config, upstream="http://unused"),
                             secrets=False)  # the replay reads policies, never keys
        tenant = config.tenants[args.tenant] if args.tenant else \
            config.passthrough or next(iter(config.tenants.values()))
    overrides: dict[str, Any] = {}
    for item in args.set or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError("--set", item, "expected FIELD=VALUE")
        overrides[name] = orjson.loads(value) if value[:1] in "[{\"0123456789tfn" \
            and value not in ("over_threshold",) else value
    if overrides:
        try:
            policy = Policy.model_validate({**tenant.policy.model_dump(), **overrides})
        except ValidationError as exc:
            raise ConfigError("--set", "policy", str(exc.errors()[0]["msg"])) from exc
        tenant = tenant.model_copy(update={"policy": policy})
    return tenant


def run_replay(args: argparse.Namespace) -> int:
    path = Path(args.file)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        print(f"cannot read {path}: {exc.strerror}", file=sys.stderr)
        return 2
    convs = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            conv = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            print(f"{path}:{n}: not JSON: {exc}", file=sys.stderr)
            return 2
        conv = conversation_of(conv)
        if conv is None:
            print(f"{path}:{n}: expected an object with a 'messages' array (chat) or an "
                  f"'input' array (Responses)", file=sys.stderr)
            return 2
        convs.append(conv)
    if args.limit:
        convs = convs[: args.limit]
    try:
        tenant = _tenant(args)
    except (ConfigError, KeyError) as exc:
        print(f"config: {exc}", file=sys.stderr)
        return 2
    if args.direct and not args.proxy:
        print("--direct compares against a proxy: give --proxy as well", file=sys.stderr)
        return 2
    tally = Tally()
    replayer = Replayer(tenant, args.model, args.context, args.summary_cost)
    http = HttpReplay(args, replayer) if args.proxy else None
    summary_before = http.summary_tokens() if http is not None else 0
    show = not args.no_progress and not args.json and sys.stderr.isatty()
    started = time.monotonic()
    try:
        for k, conv in enumerate(convs):
            if http is not None:
                http.conversation(conv, k, tally)
            else:
                replayer.conversation(conv, tally)
            _progress(k + 1, len(convs), started, show)
    except (ReplayError, OSError) as exc:
        print(f"replay stopped: {exc}", file=sys.stderr)
        return 1
    finally:
        if http is not None:
            # the proxy's summary calls, by the upstream's usage, count as forwarded: net
            spent = http.summary_tokens() - summary_before
            tally.summary_tokens += spent
            tally.forwarded += spent
            tally.forwarded_cost += spent
            http.close()
    # through a proxy, a cache-aware cost needs the upstream's word on both sides
    cache_measured = http is None or (http.direct is not None and http.cached > 0)
    out = tally.as_dict()
    if http is not None:
        for key in ("forwarded_cost_strict", "cache_aware_saving_strict", "bound_raw_saving",
                    "bound_cache_aware_saving", "retention", "retention_passthrough"):
            out.pop(key)
        if not cache_measured:
            for key in ("client_cost", "forwarded_cost", "cache_aware_saving"):
                out[key] = None
    out.update({"file": str(path), "conversations": len(convs), "model": args.model,
                "encoding": replayer.encoding, "context": replayer.context,
                "seconds": round(time.monotonic() - started, 2)})
    if args.json:
        print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
        return 0
    print(f"{path.name}: {len(convs)} conversations, {tally.requests} requests, "
          f"model {args.model} (counted with {replayer.encoding}), context {replayer.context}")
    print(f"  prompt tokens   client {tally.client:>12,}  forwarded {tally.forwarded:>12,}  "
          f"saving {out['raw_saving']:.1%}")
    if not cache_measured:
        print("  cache-aware     not measured: through a proxy it takes --direct UPSTREAM_URL "
              "and an upstream that reports cached tokens")
    else:
        print(f"  cache-aware     client {tally.client_cost:>12,.0f}  forwarded "
              f"{tally.forwarded_cost:>12,.0f}  saving {out['cache_aware_saving']:.1%}"
              + ("  (the upstream's cached tokens)" if http is not None else ""))
    if http is None:
        print(f"  (strict, tools rendered first: the proxy adding its tools mid-session voids "
              f"the cached system prompt and messages: forwarded "
              f"{tally.forwarded_cost_strict:,.0f}, saving "
              f"{out['cache_aware_saving_strict']:.1%})")
    if http is None and tally.bound < tally.client:  # else a single run loop each: no bound
        print(f"  bound (system prompt, tools and the current run loop only, nothing else): "
              f"raw {out['bound_raw_saving']:.1%}, cache-aware "
              f"{out['bound_cache_aware_saving']:.1%}")
    print(f"  over {replayer.context} tokens: pass-through {tally.over_client} "
          f"({tally.over_client / max(tally.requests, 1):.0%}), through the proxy "
          f"{tally.over_forwarded} (rejected {tally.rejected})")
    r, rp = out.get("retention"), out.get("retention_passthrough")
    if r and rp and r["references"]:
        print(f"  references kept window {_pct(r['retained'])} (current loop "
              f"{_pct(r['current_loop'])}, past loops {_pct(r['past_loops'])}; "
              f"{r['references']:,} references: {r['current_references']:,} current, "
              f"{r['past_references']:,} past), pass-through {_pct(rp['retained'])}")
        if "hidden" in r:
            print(f"  references hidden {r['hidden']:,}: recallable by a ref the window shows "
                  f"{r['recallable_by_ref']:,}, found by search_history "
                  f"{r['found_by_search']:,}, lost {r['lost']:,}")
    if tally.summaries:
        print(f"  summaries ({tenant.policy.summary_model}): {tally.summaries:,} made ahead of "
              f"their omission event" + (f", {tally.summary_tokens:,} tokens counted as "
                                         f"forwarded" if tally.summary_tokens else ""))
    elif tally.summary_tokens:
        print(f"  summary calls made by the proxy: {tally.summary_tokens:,} tokens (its "
              f"upstream's usage), counted as forwarded")
    if tally.reasoning_client:
        print(f"  reasoning items sent: client {tally.reasoning_client:,}, forwarded "
              f"{tally.reasoning_forwarded:,} (past loops' reasoning is left out)")
    if tally.events:
        print("  compaction events: " + ", ".join(f"{k} {v}" for k, v in
                                                  sorted(tally.events.items())))
    if tally.anthropic is not None and http is None:
        a = out["anthropic_cache"]
        print(f"  Anthropic's cache (marks: system, end of request"
              f"{', stable prefix' if tenant.policy.cache_breakpoints == 'auto' else ''}; "
              f"writes 1.25x, reads 0.1x): client {a['client_cost']:,} forwarded "
              f"{a['forwarded_cost']:,} saving {a['saving']:.1%}; read from the cache: client "
              f"{a['read_share_client']:.1%}, forwarded {a['read_share_forwarded']:.1%}")
    return 0
