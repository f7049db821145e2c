"""What the history store adds per request on a long session, at steady state.

    python bench/store_latency.py [--messages 300] [--requests 200] [--redis-url URL]

Replays a session request by request against a real Redis (REDIS_URL or an embedded
redis-server) and prints, per request: the time the store adds on the request path (hashing,
the session cache, queueing the write-behind sync) and the time of the sync round trip itself
(a cold replica's path), for the session at its full length and at a tenth of it — equal
numbers mean the cost follows the new messages, not the history.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from synthetic import agent_session  # noqa: E402

from runloop_proxy.config import StoreSection  # noqa: E402
from runloop_proxy.history.embedded import EmbeddedRedis  # noqa: E402
from runloop_proxy.history.store import RedisStore, prepare  # noqa: E402
from runloop_proxy.ops.metrics import Metrics  # noqa: E402


async def measure(url: str, n: int, requests: int) -> dict[str, float]:
    store = RedisStore(url, StoreSection(key_prefix=f"bench{time.time_ns()}"), Metrics())
    await store.start()
    msgs = agent_session(n + requests * 2)
    hashing: list[float] = []
    path: list[float] = []
    trip: list[float] = []
    for j in range(requests):
        # each request on its own session of n messages, grown first (not measured), then
        # the steady-state step: the client resends it with 2 new messages
        session = f"s{j}"
        await store.sync("bench", session, [prepare(m) for m in msgs[:n]])  # type: ignore[arg-type]
        conv = msgs[:n + 2]
        t = time.perf_counter()
        prepared = [prepare(m) for m in conv]  # type: ignore[arg-type]
        hashing.append(time.perf_counter() - t)
        t = time.perf_counter()
        store.cached_internal("bench", session)
        store.submit("bench", session, prepared)
        path.append(time.perf_counter() - t)
        await store.drain()
        conv = msgs[:n + 4]
        prepared = [prepare(m) for m in conv]  # type: ignore[arg-type]
        t = time.perf_counter()
        await store.sync("bench", session, prepared)  # an awaited sync of 2 new messages
        trip.append(time.perf_counter() - t)
    await store.close()
    return {"hash_p50_ms": statistics.median(hashing) * 1000,
            "path_p50_ms": statistics.median(path) * 1000,
            "trip_p50_ms": statistics.median(trip) * 1000}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    args = parser.parse_args()
    embedded = None
    url = args.redis_url
    if not url:
        embedded = EmbeddedRedis(tempfile.mkdtemp(prefix="rl-store-bench-"))
        url = embedded.start()
    try:
        for n in (max(10, args.messages // 10), args.messages):
            r = asyncio.run(measure(url, n, args.requests))
            print(f"session of {n:>4} messages: store on the request path p50 "
                  f"{r['path_p50_ms']:.3f} ms (cache + write-behind queue); awaited sync of 2 "
                  f"new messages p50 {r['trip_p50_ms']:.3f} ms; hashing the request p50 "
                  f"{r['hash_p50_ms']:.3f} ms")
    finally:
        if embedded is not None:
            embedded.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
