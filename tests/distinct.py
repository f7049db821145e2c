"""Limits, timeouts, sizes and counts for a test, drawn so that no two coincide.

A test that gives the header and the body timeout the same value cannot see a deadline armed
from the wrong one; a test whose byte limit equals its count limit cannot see one read for the
other. ``Distinct`` hands out values from a generator seeded by the test's name (the same on
every run, different between tests), each one apart from every value it gave before: never
equal, and for values of one kind (seconds, bytes, counts) at least ``apart`` times larger or
smaller than every other of that kind, so a deadline armed with the wrong setting fires at a
time the test can tell apart. ``tests/test_distinct_values.py`` sweeps the suite for limits
written by hand that coincide."""

from __future__ import annotations

import math
import random


class Distinct:
    """Values for one test (see the module's docstring). ``taken`` holds every value drawn."""

    def __init__(self, seed: str, apart: float = 1.3):
        self.rng = random.Random(f"distinct-{seed}")
        self.apart = apart
        self.taken: dict[str, list[float]] = {}  # kind -> values drawn of it

    def _clear(self, kind: str, value: float) -> bool:
        if any(value == v for vs in self.taken.values() for v in vs):
            return False
        return all(max(value, v) >= self.apart * min(value, v) for v in self.taken.get(kind, ()))

    def _draw(self, kind: str, lo: float, hi: float, integral: bool) -> float:
        for _ in range(10_000):
            # log-uniform: as many draws near lo as near hi, whatever the range's width
            value = math.exp(self.rng.uniform(math.log(lo), math.log(hi)))
            value = float(round(value)) if integral else round(value, 3)
            if lo <= value <= hi and self._clear(kind, value):
                self.taken.setdefault(kind, []).append(value)
                return value
        raise ValueError(f"no {kind} in [{lo}, {hi}] apart from {self.taken}")

    def seconds(self, lo: float, hi: float) -> float:
        """A duration in [lo, hi], apart from every other duration drawn."""
        return self._draw("seconds", lo, hi, integral=False)

    def size(self, lo: int, hi: int) -> int:
        """A byte size in [lo, hi], apart from every other size drawn."""
        return int(self._draw("bytes", lo, hi, integral=True))

    def count(self, lo: int, hi: int) -> int:
        """A count in [lo, hi], apart from every other count drawn (and never equal to any
        value drawn of another kind)."""
        return int(self._draw("count", lo, hi, integral=True))
