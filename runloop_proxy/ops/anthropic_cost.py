"""Anthropic's prompt cache, priced (pure): the replay's third cost model.

Anthropic caches only what a request marks (``cache_control``): a mark makes the prefix up to
it an entry (written at 1.25× the input price); a later request reads the longest entry its
own prompt repeats, found at or up to 20 blocks before one of its marks (at 0.1×); whatever
follows its last mark is read at the full price. Prefixes below 1,024 tokens are not cached.
The replay marks what Claude Code marks — the end of the system prompt and the end of each
request — on both sides, and for the proxy with ``cache_breakpoints = "auto"`` the end of the
window's stable prefix too. Blocks are counted as messages here (a message's blocks change
together)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

WRITE_PRICE = 1.25
READ_PRICE = 0.1
CACHE_MIN = 1024
LOOKBACK = 20


@dataclass
class CacheTally:
    """What one side's requests cost in Anthropic's model, in input-token units."""

    tokens: int = 0
    read: int = 0
    written: int = 0
    cost: float = 0.0


class Conversation:
    """One side of one conversation, request by request: the entries its marks wrote."""

    def __init__(self, tally: CacheTally):
        self.tally = tally
        self.entries: set[bytes] = set()

    def request(self, keys: list[str], counts: list[int], marks: list[int], extra: int = 0
                ) -> float:
        """Price a prompt whose parts (tools, system, messages) are ``keys`` with ``counts``,
        marked at the positions ``marks``; ``extra`` tokens follow it uncached."""
        chains: list[bytes] = []
        ends: list[int] = []
        h = hashlib.blake2b(digest_size=16)
        total = 0
        for key, n in zip(keys, counts, strict=True):
            h.update(key.encode())
            total += n
            chains.append(h.copy().digest())
            ends.append(total)
        marked = sorted({m for m in marks if 0 <= m < len(keys) and ends[m] >= CACHE_MIN})
        read = max((ends[q] for m in marked for q in range(max(0, m - LOOKBACK), m + 1)
                    if chains[q] in self.entries), default=0)
        upto = ends[marked[-1]] if marked else 0
        written = max(0, upto - read)
        self.entries.update(chains[m] for m in marked)
        total += extra
        cost = READ_PRICE * read + WRITE_PRICE * written + (total - read - written)
        t = self.tally
        t.tokens += total
        t.read += read
        t.written += written
        t.cost += cost
        return cost
