"""The inspector's session list (pure): a session's row, the filters and orders a user asks
for, and the totals per tenant and overall. Every money figure is ``savings``' own: a row's
is ``savings.of_points`` of its stored points, a total the sum of its rows' (``Savings``
adds), so a total always equals the sessions it counts."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..conversation.identity import log_name, name_of
from ..savings import Savings

ALL = "*"  # the tenant value that lists every tenant's sessions (no tenant's name has one)
WITHIN_MS = {"1h": 3_600_000, "1d": 86_400_000, "7d": 7 * 86_400_000,
             "30d": 30 * 86_400_000}
WITHIN_WORDS = {"": "any time", "1h": "the last hour", "1d": "the last day",
                "7d": "the last 7 days", "30d": "the last 30 days"}


@dataclass(frozen=True)
class Row:
    """One stored session as the list shows it."""

    tenant: str  # its namespace
    session_id: str  # its stored key
    last_ms: int  # last used
    first_ms: int  # first seen (0: not known)
    messages: int
    models: tuple[str, ...]  # the models its requests named, each once, the last used last
    bill: Savings

    @property
    def model(self) -> str:
        return self.models[-1] if self.models else ""


def models_of(points: Iterable[dict[str, Any]]) -> tuple[str, ...]:
    """The models a session's points name, each once, in the order each was last used."""
    last: dict[str, None] = {}
    for p in points:
        model = p.get("model")
        if isinstance(model, str) and model:
            last.pop(model, None)
            last[model] = None
    return tuple(last)


# each order's key; ties are broken by the last use, then the id (a stable order)
SORTS: dict[str, Callable[[Row], Any]] = {
    "last": lambda r: r.last_ms,
    "first": lambda r: r.first_ms,
    "saved": lambda r: r.bill.money_saved,
    "requests": lambda r: r.bill.requests,
    "messages": lambda r: r.messages,
    "model": lambda r: r.model.casefold(),
    "tenant": lambda r: r.tenant.casefold(),
}
SORT_WORDS = {"last": "last used", "first": "first seen", "saved": "money saved",
              "requests": "requests", "messages": "messages", "model": "model",
              "tenant": "tenant"}
ORDERS = ("desc", "asc")


@dataclass(frozen=True)
class Query:
    """What the user asked the list for (each value already checked by ``params``)."""

    tenant: str
    model: str = ""  # "": any model
    within: str = ""  # "": any time, else a key of WITHIN_MS (last used within it)
    search: str = ""  # a part of the session's id, or a log line's digest of it
    sort: str = "last"
    order: str = "desc"
    page: int = 0


def matching(rows: Iterable[Row], query: Query, now_ms: int) -> list[Row]:
    """The rows the query's filters keep, in the order they came."""
    since = now_ms - WITHIN_MS[query.within] if query.within else None
    needle = query.search.lower()
    return [r for r in rows
            if (not query.model or query.model in r.models)
            and (since is None or r.last_ms >= since)
            and (not needle or needle in name_of(r.session_id).lower()
                 or query.search == log_name(r.session_id))]


def ordered(rows: Sequence[Row], sort: str, order: str) -> list[Row]:
    """The rows by the chosen key, descending or ascending; ties by last use (newest
    first), then by id, whichever the direction."""
    key = SORTS[sort]
    by_tie = sorted(rows, key=lambda r: (-r.last_ms, r.tenant, r.session_id))
    return sorted(by_tie, key=key, reverse=order == "desc")  # stable: the ties stay put


@dataclass(frozen=True)
class Total:
    """Some sessions together: how many, and their requests, tokens and bills summed."""

    sessions: int = 0
    bill: Savings = Savings()

    def __add__(self, other: Total) -> Total:
        return Total(self.sessions + other.sessions, self.bill + other.bill)


def total(rows: Iterable[Row]) -> Total:
    return sum((Total(1, r.bill) for r in rows), Total())


def per_tenant(rows: Iterable[Row]) -> dict[str, Total]:
    """Each tenant's total, in the order the tenants first appear."""
    out: dict[str, Total] = {}
    for r in rows:
        out[r.tenant] = out.get(r.tenant, Total()) + Total(1, r.bill)
    return out


def models_in(rows: Iterable[Row]) -> list[str]:
    """Every model the rows name, sorted: the choices of the model filter."""
    return sorted({m for r in rows for m in r.models}, key=str.casefold)
