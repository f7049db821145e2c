"""The headline savings figure, defined once (pure): **bill saved**.

*Bill saved* is the share of the provider's bill for prompts that the proxy saved: each
request's prompt priced at the provider's prices with its prompt cache (cached reads and cache
writes at their own prices, ``pricing``), as forwarded, against the same requests sent
uncompressed, priced the same way. *Money saved* is that difference in USD. Output tokens are
left out: an answer costs the same either way.

Both sides are priced from what every place that shows the figure has — each request's model,
its whole prompt's tokens as the client sent it and as it was forwarded, the tokens of the
prefix it shares with the previous prompt of its side (``Prompt.shared``), the tokens of its
system messages and tool schemas (its *head*), and its time — so the demo, ``replay``, the
inspector, the dashboard and ``wrap`` say the same for the same session. The provider's cache
serves a prompt the prefix it shares with the previous one, if still alive: all of it when the
prompt only grew, the head and the messages before the first one a compaction changed when it
shrank. Anthropic's cache reads only at a breakpoint: each prompt has one after its head and
one at its end (where agents put them), so a compaction reads the head there. A point recorded
before points carried their shared prefix is read as before: a prompt that grew extends the
last, one that shrank is cached nothing. The raw token saving (``raw_saved``) is shown beside
it, labelled.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .conversation.messages import content_hash
from .pipeline.tokens import REPLY_PRIMING
from .pricing import Bill, Block, Price, PriceTable, Provider

HEADLINE = "bill saved"
MONEY = "money saved"
RAW = "prompt tokens saved"
DEFINITION = ("the share of the provider's bill for prompts saved, at its prices with its "
              "prompt cache, against the same requests sent uncompressed")


@dataclass(frozen=True)
class Savings:
    """What a set of requests cost and saved, both sides priced the same way."""

    requests: int = 0
    client_tokens: int = 0  # prompt tokens as the client sent them
    forwarded_tokens: int = 0  # as the upstream got them
    client_usd: float = 0.0  # the client's prompts, priced
    forwarded_usd: float = 0.0  # the forwarded prompts, priced
    unpriced: frozenset[str] = frozenset()  # models no price table names

    @property
    def priced(self) -> bool:
        return self.client_usd > 0

    @property
    def bill_saved(self) -> float | None:
        """The headline, a fraction (negative when forwarding cost more); None: not priced."""
        return 1 - self.forwarded_usd / self.client_usd if self.client_usd > 0 else None

    @property
    def money_saved(self) -> float:
        return self.client_usd - self.forwarded_usd

    @property
    def raw_saved(self) -> float | None:
        """The prompt tokens saved, a fraction (secondary)."""
        return 1 - self.forwarded_tokens / self.client_tokens if self.client_tokens else None

    def __add__(self, other: Savings) -> Savings:
        return Savings(self.requests + other.requests,
                       self.client_tokens + other.client_tokens,
                       self.forwarded_tokens + other.forwarded_tokens,
                       self.client_usd + other.client_usd,
                       self.forwarded_usd + other.forwarded_usd,
                       self.unpriced | other.unpriced)

    def headline(self) -> str:
        """"bill saved 61.2% ($0.0123 of $0.0201)"; what is missing when it is not priced."""
        if self.bill_saved is None:
            if self.unpriced:
                return f"{HEADLINE}: not priced (no price for {', '.join(sorted(self.unpriced))}"\
                       f"; add it to prices.toml)"
            return f"{HEADLINE}: —"
        return f"{HEADLINE} {percent(self.bill_saved)} ({usd(self.money_saved)} of " \
               f"{usd(self.client_usd)})"

    def secondary(self) -> str:
        """The raw token figure, labelled."""
        raw = "—" if self.raw_saved is None else percent(self.raw_saved)
        return f"{RAW} {raw} ({self.client_tokens:,} sent, {self.forwarded_tokens:,} forwarded)"

    def as_dict(self) -> dict[str, Any]:
        return {"bill_saved": None if self.bill_saved is None else round(self.bill_saved, 4),
                "money_saved_usd": round(self.money_saved, 6),
                "client_usd": round(self.client_usd, 6),
                "forwarded_usd": round(self.forwarded_usd, 6),
                "raw_saved": None if self.raw_saved is None else round(self.raw_saved, 4),
                "requests": self.requests, "client_tokens": self.client_tokens,
                "forwarded_tokens": self.forwarded_tokens, "unpriced": sorted(self.unpriced)}


def percent(share: float) -> str:
    """One decimal everywhere the headline is shown ("61.2%"), so the places agree digit for
    digit."""
    return f"{share:.1%}"


def usd(amount: float) -> str:
    return f"-${-amount:,.4f}" if amount < 0 else f"${amount:,.4f}"


@dataclass(frozen=True)
class Prompt:
    """A prompt as the next one of its side is compared with it: its blocks' keys (content
    identities) in the order OpenAI renders them — system messages, tool schemas, the other
    messages, the reply's priming — and the tokens up to the end of each. Anthropic renders the
    tools before the system messages: the two orders share the same prefix unless the system
    prompt or the tool list changed."""

    keys: tuple[str, ...]  # mostly the messages' own hashes, held by the conversation
    ends: array[int]  # four bytes a block: a session's last prompts stay small
    head: int  # the system messages' and tool schemas' tokens (the first breakpoint)
    # the tokens before each breakpoint the proxy adds itself (``cache_breakpoints =
    # "auto"``), between the head and the end: Anthropic's cache reads at these too
    marks: tuple[int, ...] = ()

    @classmethod
    def of(cls, system: Sequence[Block], tools: Sequence[Block], rest: Sequence[Block],
           after: Sequence[int] = ()) -> Prompt:
        """``after``: the proxy's own breakpoints, each after ``rest[:k]``."""
        keys, ends, total = [], array("I"), 0
        for b in (*system, *tools, *rest):
            total += b.tokens
            keys.append(b.key)
            ends.append(total)
        head = sum(b.tokens for b in system) + sum(b.tokens for b in tools)
        fixed = len(system) + len(tools)
        marks = tuple(sorted({ends[fixed + k - 1] for k in after if 0 < k <= len(rest)}))
        return cls(tuple(keys), ends, head, marks)

    @property
    def tokens(self) -> int:
        return self.ends[-1] if self.ends else 0

    def shared(self, last: Prompt | None) -> int:
        """The tokens of the blocks this prompt starts with that ``last`` started with too,
        in order (0 without a last prompt): what the provider's cache can still serve."""
        if last is None:
            return 0
        n = 0
        for mine, theirs in zip(self.keys, last.keys, strict=False):
            if mine != theirs:
                break
            n += 1
        return self.ends[n - 1] if n else 0


class Placed(NamedTuple):
    """Where a request's own breakpoints went (``cache_breakpoints = "auto"``, as
    ``api/messages_wire`` sends them), in the window's messages: the marker's note sent as a
    text block per piece it grew by (its position and pieces; None: sent as it is), and
    each breakpoint the proxy added after ``messages[:k]``, in ``after``."""

    note: tuple[int, tuple[str, ...]] | None
    after: tuple[int, ...]


def placed_blocks(blocks: Sequence[Block], placed: Placed, count: Callable[[str], int]
                  ) -> tuple[list[Block], tuple[int, ...]]:
    """A window's messages as blocks (one a message) as ``placed`` sent them: the note's a
    block per piece (the message's own frame in the first), so the next omission, which
    appends a piece, shares them; and its breakpoints, each after the first k of these."""
    parts, shift = list(blocks), 0
    note = placed.note
    if note is not None and note[0] < len(blocks):
        k, pieces = note
        tokens = [count(p) for p in pieces]
        tokens[0] += max(0, blocks[k].tokens - sum(tokens))
        parts[k:k + 1] = [Block(content_hash(p.encode()), n, p, blocks[k].role)
                          for p, n in zip(pieces, tokens, strict=True)]
        shift = len(pieces) - 1
    else:
        note = None
    return parts, tuple(sorted({a + (shift if note is not None and a > note[0] else 0)
                                for a in placed.after}))


@dataclass
class Chain:
    """One side's prompts in a provider's cache, each billed after the last, by the rules of
    ``pricing``'s caches over the facts a point keeps (its tokens, head and shared prefix).

    OpenAI's prefix cache serves the prefix a prompt shares with the last one (the longest
    any earlier prompt left: the last prompt used every prefix it kept), from its minimum,
    in whole steps, while the last prompt is alive. Anthropic's breakpoints: a prompt writes
    an entry at each of its breakpoints and reads the longest live entry that is a prefix of
    it; the entries kept are the ones still a prefix of the last prompt (a prompt sharing
    ``shared`` tokens with it keeps those at or before that)."""

    spec: Provider
    last: int = 0
    at: float | None = None
    started: bool = False
    # a breakpoint cache's entries that are prefixes of the last prompt: tokens -> last used
    entries: dict[int, float] = field(default_factory=dict)

    def bill(self, tokens: int, price: Price, at: float | None, shared: int | None = None,
             head: int = 0, marks: Sequence[int] = ()) -> float:
        """``shared``: the tokens this prompt shares with the last (None: not recorded — as
        much as the last when it grew, nothing when it shrank); ``head``: its system
        messages' and tool schemas' tokens (Anthropic's first breakpoint); ``marks``: the
        tokens before each breakpoint the proxy added (``Prompt.marks``)."""
        if shared is None:
            shared = self.last if tokens >= self.last else 0
        shared = min(shared, self.last, tokens) if self.started else 0
        if self.spec.cache == "breakpoints":
            bill = self._breakpoints(tokens, head, shared, at, marks)
        else:
            bill = self._prefix(tokens, shared, at)
        self.last, self.at, self.started = tokens, at, True
        return price.cost(bill)

    def _live(self, used: float | None, at: float | None) -> bool:
        ttl = self.spec.ttl_s
        return ttl is None or at is None or used is None or at - used <= ttl

    def _prefix(self, tokens: int, shared: int, at: float | None) -> Bill:
        spec = self.spec
        cached = (shared // spec.cache_step) * spec.cache_step \
            if shared >= spec.cache_min and self._live(self.at, at) else 0
        return Bill(tokens - cached, cached)

    def _breakpoints(self, tokens: int, head: int, shared: int, at: float | None,
                     added: Sequence[int] = ()) -> Bill:
        """Breakpoints after the head and after the last message, before the reply's
        priming (where agents put them), and the proxy's own (``added``)."""
        spec = self.spec
        kept = {k: t for k, t in self.entries.items() if k <= shared}
        marks = sorted({m for m in (head, *added, tokens - REPLY_PRIMING) if 0 < m <= tokens})
        marks = marks[-spec.max_breakpoints:] if spec.max_breakpoints else []
        last = marks[-1] if marks else 0
        read = max((k for k, t in kept.items() if k <= last and self._live(t, at)), default=0)
        now = at if at is not None else 0.0
        if read:
            kept[read] = now
        written = 0
        if last > read and last >= spec.cache_min:
            written = last - read
            kept.update({m: now for m in marks if m >= spec.cache_min})
        self.entries = kept
        return Bill(tokens - read - written, read, written)


class Meter:
    """One session's requests priced on both sides, request by request (``add``)."""

    def __init__(self, providers: Sequence[Provider]):
        self.providers = providers  # the first that prices a request's model prices it
        self._chains: dict[str, tuple[Chain, Chain]] = {}  # per provider
        self.total = Savings()

    def _find(self, model: str) -> tuple[Provider, Price] | None:
        for spec in self.providers:
            price = spec.price(model)
            if price is not None:
                return spec, price
        return None

    def add(self, model: str, client: int, forwarded: int, at: float | None = None,
            shared: Sequence[int] | None = None, head: Sequence[int] = (0, 0),
            marks: Sequence[Sequence[int]] = ((), ())) -> Savings:
        """One request (its whole prompt's tokens on each side, its time in seconds, and on
        each side the tokens it shares with the last prompt, its head and the proxy's own
        breakpoints: ``Prompt``); what it cost and saved. Without ``shared`` (a point
        recorded before points carried it) a prompt that grew extends the last, one that
        shrank is cached nothing."""
        found = self._find(model)
        if found is None:
            one = Savings(1, client, forwarded, unpriced=frozenset({model or "(none)"}))
        else:
            spec, price = found
            chains = self._chains.get(spec.name)
            if chains is None:
                chains = self._chains[spec.name] = (Chain(spec), Chain(spec))
            one = Savings(1, client, forwarded,
                          chains[0].bill(client, price, at,
                                         None if shared is None else shared[0], head[0],
                                         marks[0]),
                          chains[1].bill(forwarded, price, at,
                                         None if shared is None else shared[1], head[1],
                                         marks[1]))
        self.total = self.total + one
        return one


def providers(prices: PriceTable, provider: str | None = None) -> list[Provider]:
    """The table's providers, ``provider``'s alone when it is named."""
    return [prices.provider(provider)] if provider else list(prices.providers.values())


def of_points(points: Iterable[Mapping[str, Any]], prices: PriceTable,
              provider: str | None = None) -> Savings:
    """A session's savings from its stored points (the proxy's per-request records: ``ts``
    in ms, ``client``, ``forwarded``, ``model``, and ``shared``, ``head``, ``marks`` as
    pairs, client then forwarded); points without token counts are skipped."""
    return priced(points, Meter(providers(prices, provider)))


def priced(points: Iterable[Mapping[str, Any]], meter: Meter) -> Savings:
    """A session's stored points priced by ``meter`` (``of_points``)."""
    for p in points:
        client, forwarded = p.get("client"), p.get("forwarded")
        if not isinstance(client, int) or not isinstance(forwarded, int):
            continue
        ts = p.get("ts")
        meter.add(str(p.get("model") or ""), client, forwarded,
                  ts / 1000 if isinstance(ts, (int, float)) else None,
                  _pair(p.get("shared")), _pair(p.get("head")) or (0, 0),
                  marks_of(p.get("marks")))
    return meter.total


def facts(prompts: tuple[Prompt, Prompt], last: tuple[Prompt, Prompt] | None
          ) -> dict[str, list[Any]]:
    """What a point keeps of its prompts (as sent, as forwarded) for the headline: what
    each shares with the side's ``last`` (not known: left out), their heads, and the
    proxy's own breakpoints when it added any."""
    out: dict[str, list[Any]] = {"head": [prompts[0].head, prompts[1].head]}
    if last is not None:
        out["shared"] = [prompts[0].shared(last[0]), prompts[1].shared(last[1])]
    if prompts[0].marks or prompts[1].marks:
        out["marks"] = [list(prompts[0].marks), list(prompts[1].marks)]
    return out


def marks_of(value: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A point's breakpoints the proxy added, on each side (none when it has none)."""
    if isinstance(value, (list, tuple)) and len(value) == 2 \
            and all(isinstance(v, list) for v in value):
        a, b = value
        return (tuple(int(x) for x in a if isinstance(x, int)),
                tuple(int(x) for x in b if isinstance(x, int)))
    return (), ()


def _pair(value: Any) -> tuple[int, int] | None:
    """A point's pair of counts (client, forwarded); None when it has none."""
    if isinstance(value, (list, tuple)) and len(value) == 2 \
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return int(value[0]), int(value[1])
    return None
