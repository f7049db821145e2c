"""CPU work a large request brings (hashing, counting, building the window, parsing a large
answer) runs in a worker thread, so no request stalls the others: tiktoken releases the GIL
while it counts, and the event loop keeps serving. Small work stays inline, where a thread hop
would cost more than it saves."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
LARGE_BYTES = 128 * 1024  # a request or answer this large is worked on off the event loop
# (256 KB left the 30,000-names body of bench/hostile.py 69 ms on the loop: now 28 ms)
LARGE_MESSAGES = 2_000


def is_large(size: int, messages: int = 0) -> bool:
    return size > LARGE_BYTES or messages > LARGE_MESSAGES


async def offload(large: bool, fn: Callable[[], T]) -> T:
    """``fn()``, in a worker thread when ``large``."""
    if not large:
        return fn()
    return await asyncio.to_thread(fn)
