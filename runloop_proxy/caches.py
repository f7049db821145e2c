"""Caches bounded in bytes: every per-process cache the proxy keeps (window carries, derived
forms, cuts, token counts, chains) evicts its least recently used entries once its share of
``server.cache_mb`` is used, so memory levels off however long it runs."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")
ENTRY_OVERHEAD = 120  # a dict slot, the key tuple, the value's box: roughly, in CPython
MESSAGE_OVERHEAD = 400  # a parsed message's dict, its role and keys (tracemalloc: ~370 B)

# each cache's share of server.cache_mb (they add up to the whole, no more)
SHARES = {"carries": 0.135, "listed": 0.005, "recent": 0.145, "prompts": 0.02, "bills": 0.005,
          "memo": 0.095, "exchanges": 0.005,
          "cuts": 0.075, "tokens": 0.095, "chains": 0.09, "first_seen": 0.02, "sessions": 0.05,
          "masks": 0.03, "factors": 0.015, "windows": 0.005, "summaries": 0.06,
          "anchors": 0.005, "indexed": 0.01, "models": 0.005,
          # long-term memory's sessions as matrices: 10,000 segments in the default 128 MB
          # (vectors), and their segments as the last request cut them (segment_cuts)
          "vectors": 0.08, "segment_cuts": 0.05}


# the caches the history store keeps (RedisStore), by their names in SHARES
STORE_CACHES = ("sessions", "chains", "anchors", "indexed", "exchanges")


def approx_size(obj: Any, budget: int = 1 << 16) -> int:
    """Roughly the bytes ``obj`` holds (strings by length, containers by entry), walking at
    most ``budget`` objects: an estimate, cheap enough for every insertion."""
    total = 0
    stack = [obj]
    while stack and budget > 0:
        o = stack.pop()
        budget -= 1
        if isinstance(o, (str, bytes)):
            total += 49 + len(o)
        elif isinstance(o, dict):
            total += 64 + 100 * len(o)
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            total += 56 + 8 * len(o)
            stack.extend(o)
        else:
            total += 28
    return total


def message_bytes(m: Mapping[str, Any]) -> int:
    """The bytes a message's texts take in memory (1 a character for ASCII, else up to 4)."""
    content = m.get("content")
    texts = [content] if isinstance(content, str) else [
        p.get("text") for p in content if isinstance(p, dict)] if isinstance(content, list) \
        else []
    texts += [(c.get("function") or {}).get("arguments") for c in m.get("tool_calls") or []
              if isinstance(c, dict)]
    return sum(len(t) * (1 if t.isascii() else 4) for t in texts if isinstance(t, str))


def messages_bytes(messages: Iterable[Mapping[str, Any]]) -> int:
    """What a list of messages holds: their texts, and a few hundred bytes of dicts each."""
    n, held = 0, 0
    for m in messages:
        n += 1
        held += message_bytes(m)
    return held + n * MESSAGE_OVERHEAD


class ByteLRU(MutableMapping[K, V], Generic[K, V]):
    """A mapping that keeps at most ``max_bytes`` of entries (as ``size`` estimates them),
    dropping the least recently used first. Thread-safe (windows are built in worker threads
    for large requests)."""

    def __init__(self, max_bytes: int, size: Callable[[K, V], int] | None = None):
        self.max_bytes = max_bytes
        self._size = size or (lambda k, v: approx_size(v) + ENTRY_OVERHEAD)
        self._data: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.bytes = 0
        self._lock = threading.Lock()

    def __getitem__(self, key: K) -> V:
        with self._lock:
            value, _ = self._data[key]
            self._data.move_to_end(key)
            return value

    def get(self, key: K, default: V | None = None) -> V | None:  # type: ignore[override]
        try:
            return self[key]
        except KeyError:
            return default

    def __setitem__(self, key: K, value: V) -> None:
        n = self._size(key, value)
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if n > self.max_bytes:
                return  # larger than the whole cache: not kept
            self._data[key] = (value, n)
            self.bytes += n
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._data.popitem(last=False)
                self.bytes -= dropped

    def resize(self, max_bytes: int) -> None:
        """Keep at most ``max_bytes`` from now on: what a smaller bound leaves over goes now,
        least recently used first (a reload that shrinks ``cache_mb``)."""
        with self._lock:
            self.max_bytes = max_bytes
            while self.bytes > max_bytes:
                _, (_, dropped) = self._data.popitem(last=False)
                self.bytes -= dropped

    def __delitem__(self, key: K) -> None:
        with self._lock:
            _, n = self._data.pop(key)
            self.bytes -= n

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._data))

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.bytes = 0
