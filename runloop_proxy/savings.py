"""The headline savings figure, defined once (pure): **bill saved**.

*Bill saved* is the share of the provider's bill for prompts that the proxy saved: each
request's prompt priced at the provider's prices with its prompt cache (cached reads and cache
writes at their own prices, ``pricing``), as forwarded, against the same requests sent
uncompressed, priced the same way. *Money saved* is that difference in USD. Output tokens are
left out: an answer costs the same either way.

Both sides are priced from what every place that shows the figure has — each request's model,
its whole prompt's tokens as the client sent it and as it was forwarded, and its time — so the
demo, ``replay``, the inspector and the dashboard say the same for the same session. Each side
is a chain of prompts: a prompt that grew extends the previous one (its prefix was sent before
and is in the cache, if still alive); one that shrank (a compaction, a new conversation) starts
a new chain, cached nothing. The raw token saving (``raw_saved``) is shown beside it, labelled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .pricing import Bill, Block, BreakpointCache, PrefixCache, Price, PriceTable, Provider

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


@dataclass
class Chain:
    """One side's prompts in a provider's cache: each prompt that grew extends the last.

    What the next prompt is billed depends on the last prompt alone (its tokens and when it
    was sent: its prefix is the one entry the cache can serve), so a chain keeps just that,
    and each bill is the provider's cache (``pricing``) seeded with the last prompt."""

    new_cache: Callable[[], PrefixCache | BreakpointCache]
    last: int = 0
    at: float | None = None
    started: bool = False

    def bill(self, tokens: int, price: Price, at: float | None) -> float:
        cache = self.new_cache()
        blocks = [Block("next", tokens)]
        if self.started and tokens >= self.last:
            prev = Block("last", self.last)
            _bill(cache, [prev], self.at)  # the cache as the last prompt left it
            blocks = [prev, Block("next", tokens - self.last)]
        bill = _bill(cache, blocks, at)
        self.last, self.at, self.started = tokens, at, True
        return price.cost(bill)


def _bill(cache: PrefixCache | BreakpointCache, blocks: list[Block], at: float | None) -> Bill:
    """A prompt billed with a breakpoint at its end (where agents put it) or by its prefix."""
    if isinstance(cache, BreakpointCache):
        return cache.bill(blocks, [len(blocks)], at)
    return cache.bill(blocks, at)


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

    def add(self, model: str, client: int, forwarded: int, at: float | None = None
            ) -> Savings:
        """One request (its whole prompt's tokens on each side, its time in seconds); what
        it cost and saved."""
        found = self._find(model)
        if found is None:
            one = Savings(1, client, forwarded, unpriced=frozenset({model or "(none)"}))
        else:
            spec, price = found
            chains = self._chains.get(spec.name)
            if chains is None:
                chains = self._chains[spec.name] = (Chain(spec.new_cache),
                                                    Chain(spec.new_cache))
            one = Savings(1, client, forwarded, chains[0].bill(client, price, at),
                          chains[1].bill(forwarded, price, at))
        self.total = self.total + one
        return one


def providers(prices: PriceTable, provider: str | None = None) -> list[Provider]:
    """The table's providers, ``provider``'s alone when it is named."""
    return [prices.provider(provider)] if provider else list(prices.providers.values())


def of_points(points: Iterable[Mapping[str, Any]], prices: PriceTable,
              provider: str | None = None) -> Savings:
    """A session's savings from its stored points (the proxy's per-request records: ``ts``
    in ms, ``client``, ``forwarded``, ``model``); points without token counts are skipped."""
    meter = Meter(providers(prices, provider))
    for p in points:
        client, forwarded = p.get("client"), p.get("forwarded")
        if not isinstance(client, int) or not isinstance(forwarded, int):
            continue
        ts = p.get("ts")
        meter.add(str(p.get("model") or ""), client, forwarded,
                  ts / 1000 if isinstance(ts, (int, float)) else None)
    return meter.total
