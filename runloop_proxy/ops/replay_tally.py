"""What a replay adds up: tokens, the cost models, money, retention — per conversation and in all.

Every conversation gets a ``Tally`` of its own; the run adds them into one and keeps, per
conversation, what it cost on each side under each cache model, so that a report can say how
many conversations cost more through the proxy than without it, and which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..savings import Savings
from ..window.retention import Retention

# the cost models a replay prices both sides with (input-token equivalents, cached at 10%)
SEPARATE = "cache_aware"  # tool schemas and the message prefix cached apart
STRICT = "strict"  # tools rendered first: a changed tool list re-reads everything after it
MODELS = (SEPARATE, STRICT)


@dataclass
class Tally:
    requests: int = 0
    client: int = 0
    forwarded: int = 0
    # per cost model: (client, forwarded), in input-token equivalents
    costs: dict[str, list[float]] = field(default_factory=lambda: {m: [0.0, 0.0]
                                                                   for m in MODELS})
    money: list[float] = field(default_factory=lambda: [0.0, 0.0])  # USD, the provider's
    output_money: float = 0.0  # the recorded replies' output, USD (the same on both sides)
    bound: int = 0  # keeping only the system prompt, the tools and the current loop
    bound_cost: float = 0.0
    over_client: int = 0
    over_forwarded: int = 0
    rejected: int = 0
    events: dict[str, int] = field(default_factory=dict)
    retention: Retention = field(default_factory=Retention)
    retention_passthrough: Retention = field(default_factory=Retention)
    careful: Retention = field(default_factory=Retention)  # the careful reader's
    summaries: int = 0  # summaries made
    summary_tokens: int = 0  # what the summary calls cost (--summary-cost each)
    reasoning_client: int = 0  # Responses reasoning items sent, summed over requests
    reasoning_forwarded: int = 0
    rows: list[Row] = field(default_factory=list)  # one per conversation added
    savings: Savings = Savings()  # the headline's (``savings``): both sides priced alike

    @property
    def client_cost(self) -> float:
        return self.costs[SEPARATE][0]

    @property
    def forwarded_cost(self) -> float:
        return self.costs[SEPARATE][1]

    def charge(self, model: str, client: float, forwarded: float) -> None:
        pair = self.costs[model]
        pair[0] += client
        pair[1] += forwarded

    def spend(self, tokens: int) -> None:
        """Tokens the proxy spent besides its windows (summary calls), at full price."""
        self.forwarded += tokens
        for pair in self.costs.values():
            pair[1] += tokens

    @staticmethod
    def saving(a: float, b: float) -> float:
        return 1 - b / a if a else 0.0

    def add(self, other: Tally, conv_id: str = "", domain: str = "") -> None:
        """Fold one conversation's tally into this one, and keep its row."""
        for name in ("requests", "client", "forwarded", "bound", "bound_cost", "over_client",
                     "over_forwarded", "rejected", "summaries", "summary_tokens",
                     "reasoning_client", "reasoning_forwarded", "output_money"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for m, (c, f) in other.costs.items():
            self.charge(m, c, f)
        self.money[0] += other.money[0]
        self.money[1] += other.money[1]
        self.savings = self.savings + other.savings
        for k, v in other.events.items():
            self.events[k] = self.events.get(k, 0) + v
        self.retention.add(other.retention)
        self.retention_passthrough.add(other.retention_passthrough)
        self.careful.add(other.careful)
        self.rows.append(Row(conv_id, domain, other.requests,
                             {m: (c, f) for m, (c, f) in other.costs.items()},
                             (other.money[0], other.money[1]), dict(other.events)))
        self.rows.extend(other.rows)

    def costing_more(self) -> dict[str, int]:
        """How many conversations cost more through the proxy, per model (and in money)."""
        out = {m: sum(r.costs[m][1] > r.costs[m][0] for r in self.rows) for m in MODELS}
        if any(r.money[0] for r in self.rows):
            out["money"] = sum(r.money[1] > r.money[0] for r in self.rows)
        return out

    def worst(self, n: int = 5, model: str = STRICT) -> list[Row]:
        return sorted(self.rows, key=lambda r: (r.saving(model), r.conv_id))[:n]

    def by_domain(self) -> dict[str, dict[str, float]]:
        """Savings per domain (a conversation's ``meta.domain``), per model."""
        sums: dict[str, dict[str, list[float]]] = {}
        for r in self.rows:
            d = sums.setdefault(r.domain or "-", {m: [0.0, 0.0] for m in MODELS})
            for m in MODELS:
                d[m][0] += r.costs[m][0]
                d[m][1] += r.costs[m][1]
        return {dom: {m: round(self.saving(*d[m]), 4) for m in MODELS}
                | {"conversations": sum(r.domain == dom or (dom == "-" and not r.domain)
                                        for r in self.rows)}
                for dom, d in sorted(sums.items())}

    def as_dict(self) -> dict[str, Any]:
        c, f = self.costs[SEPARATE]
        sc, sf = self.costs[STRICT]
        return {"headline": self.savings.as_dict(),
                "requests": self.requests, "client_tokens": self.client,
                "forwarded_tokens": self.forwarded,
                "raw_saving": round(self.saving(self.client, self.forwarded), 4),
                "client_cost": round(c), "forwarded_cost": round(f),
                "cache_aware_saving": round(self.saving(c, f), 4),
                "client_cost_strict": round(sc), "forwarded_cost_strict": round(sf),
                "cache_aware_saving_strict": round(self.saving(sc, sf), 4),
                "bound_raw_saving": round(self.saving(self.client, self.bound), 4),
                "bound_cache_aware_saving": round(self.saving(c, self.bound_cost), 4),
                "over_context_passthrough": self.over_client,
                "over_context_proxy": self.over_forwarded, "rejected": self.rejected,
                "compaction_events": self.events, "retention": self.retention.as_dict(),
                "retention_careful": self.careful.as_dict(),
                "retention_passthrough": self.retention_passthrough.as_dict(),
                "summaries": self.summaries, "summary_tokens": self.summary_tokens,
                "reasoning_items": {"client": self.reasoning_client,
                                    "forwarded": self.reasoning_forwarded},
                "costing_more": self.costing_more(),
                "worst": [r.as_dict() for r in self.worst()],
                "by_domain": self.by_domain()}


@dataclass(frozen=True)
class Row:
    """One conversation's costs: per model (client, forwarded), and in money."""

    conv_id: str
    domain: str
    requests: int
    costs: dict[str, tuple[float, float]]
    money: tuple[float, float]
    events: dict[str, int]

    def saving(self, model: str) -> float:
        c, f = self.costs[model]
        return 1 - f / c if c else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.conv_id, "domain": self.domain, "requests": self.requests,
                **{f"{m}_saving": round(self.saving(m), 4) for m in MODELS},
                "client_cost_strict": round(self.costs[STRICT][0]),
                "forwarded_cost_strict": round(self.costs[STRICT][1]),
                "money": [round(x, 6) for x in self.money], "events": self.events}
