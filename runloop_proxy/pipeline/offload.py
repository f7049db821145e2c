"""CPU work a large request brings (hashing, counting, building the window, parsing a large
answer) runs in a worker thread, so no request stalls the others: tiktoken releases the GIL
while it counts, and the event loop keeps serving. Small work stays inline, where a thread hop
would cost more than it saves."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from .sse import SSEDecoder, SSEEvent

T = TypeVar("T")
LARGE_BYTES = 128 * 1024  # a request or answer this large is worked on off the event loop
# (256 KB left the 30,000-names body of bench/hostile.py 69 ms on the loop: now 28 ms)
# ... or this many items (messages, tool calls, content parts, blocks): each costs 80-200 µs of
# walks, so a body of a thousand small items under LARGE_BYTES held the loop 100-430 ms
LARGE_ITEMS = 256


def is_large(size: int, items: int = 0) -> bool:
    return size > LARGE_BYTES or items > LARGE_ITEMS


def items_in(raw: bytes) -> int:
    """How many items a JSON body holds, at most: its objects and arrays (every message,
    call, part and block is one; an argument of 32,000 nested arrays, with ten objects, held
    the loop 141 ms), counted at the speed of a byte scan before anything is parsed."""
    return raw.count(b"{") + raw.count(b"[")


def is_large_body(raw: bytes) -> bool:
    """Whether the work a request body brings leaves the event loop: by its bytes or by its
    items, whichever is more (one rule for every API)."""
    return is_large(len(raw), items_in(raw))


async def offload(large: bool, fn: Callable[[], T]) -> T:
    """``fn()``, in a worker thread when ``large``."""
    if not large:
        return fn()
    return await asyncio.to_thread(fn)


def answer_is_large(message: Mapping[str, Any] | None) -> bool:
    """Whether the work an answer brings (counting it, hashing it for the record) leaves the
    loop: by its text's length and its calls and parts, whatever way it came (JSON or a
    stream: a stream's answer was counted on the loop, 20,000 calls for seconds)."""
    if not message:
        return False
    content, calls = message.get("content"), message.get("tool_calls")
    calls = calls if isinstance(calls, list) else []
    size = len(content) if isinstance(content, str) else 0
    items = 1 + len(calls) + (len(content) if isinstance(content, list) else 0)
    if not is_large(size, items):
        size += sum(len(str((c.get("function") or {}).get("arguments") or ""))
                    for c in calls if isinstance(c, dict))
    return is_large(size, items)


async def events(decoder: SSEDecoder, raw: bytes,
                 handle: Callable[[SSEEvent], Iterable[T]]) -> list[T]:
    """What ``handle`` makes of the events ``raw`` completes: off the loop when the event(s)
    it completes are large (what the decoder held, with this chunk): a stream's events are
    read by their size as a JSON answer is (one event of 20,000 calls held the loop 0.5 s)."""
    large = is_large(decoder.held + len(raw))
    return await offload(large, lambda: [out for ev in decoder.feed(raw) for out in handle(ev)])
