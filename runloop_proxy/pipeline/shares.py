"""Shares of what one tenant's traffic can hold — an upstream's connections, the bytes of
answers read whole — so that no tenant's load becomes another's latency.

A ``Shares`` has a process bound and a share of it each holder (a tenant; in pass-through
mode a caller's namespace) may hold at once. Taking past one's share is the holder's own
excess: ``TenantOverShare`` (429); taking past the process bound while within one's share
is ``ProxyFull`` (503); both say when to try again. Nothing waits: a request refused is
answered at once, and one admitted never queues behind another tenant's."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

from ..errors import ProxyFull, TenantOverShare

RETRY_AFTER_S = 1.0


class Shares:
    """``total`` units (connections, bytes), at most ``share`` of them per holder (one unit
    at least). ``refused``: told (resource, reason, holder) at each refusal, to count it."""

    def __init__(self, resource: str, total: int, share: float,
                 refused: Callable[[str, str], None] | None = None):
        self.resource = resource
        self.in_use = 0
        self._held: dict[str, int] = {}  # only holders holding something: bounded by total
        self._refused = refused
        self._lock = threading.Lock()
        self.total = self.per_holder = 0
        self.resize(total, share)

    def resize(self, total: int, share: float) -> None:
        """A new bound and share (a reload), for what is taken next: what is held past them
        stays held until it is given back, and nothing more is taken until then."""
        with self._lock:
            self.total = total
            self.per_holder = max(1, math.floor(total * share))

    def held(self, holder: str) -> int:
        return self._held.get(holder, 0)

    def take(self, holder: str, amount: int = 1, what: str = "") -> None:
        """Hold ``amount`` more for ``holder``, or raise without holding anything."""
        with self._lock:
            mine = self._held.get(holder, 0)
            if mine + amount > self.per_holder:
                reason = "tenant"
            elif self.in_use + amount > self.total:
                reason = "process"
            else:
                self._held[holder] = mine + amount
                self.in_use += amount
                return
        if self._refused is not None:
            self._refused(self.resource, reason)
        said = what or self.resource
        if reason == "tenant":
            raise TenantOverShare(
                f"this caller holds its share of the proxy's {said} ({self.per_holder} of "
                f"{self.total}); retry when some of its requests are done",
                retry_after=RETRY_AFTER_S)
        raise ProxyFull(f"the proxy's {said} are all in use ({self.total}); retry shortly",
                        retry_after=RETRY_AFTER_S)

    def give(self, holder: str, amount: int = 1) -> None:
        """Give back what ``take`` held (never more than is held)."""
        with self._lock:
            mine = self._held.get(holder, 0)
            amount = min(amount, mine)
            if mine - amount > 0:
                self._held[holder] = mine - amount
            else:
                self._held.pop(holder, None)
            self.in_use -= amount


class Held:
    """Units of a ``Shares`` one piece of work holds, given back once (``release``)."""

    def __init__(self, shares: Shares | None, holder: str):
        self.shares = shares
        self.holder = holder
        self.amount = 0

    def take(self, amount: int, what: str = "") -> None:
        if self.shares is not None:
            self.shares.take(self.holder, amount, what)
            self.amount += amount

    def release(self) -> None:
        if self.shares is not None and self.amount:
            self.shares.give(self.holder, self.amount)
        self.amount = 0
