"""What the inspector's landing page costs as a tenant's sessions grow (totals, sorting and
filtering read each tenant's most recently used sessions, up to ``inspector_list.TALLIED``).

    python bench/inspector_list.py [--sessions 25 100 500] [--points 50] [--repeat 5]

Stores N sessions of P request points each (as the proxy writes them) in an embedded
redis-server of its own, serves the proxy, logs in, and times
``GET /admin/ui`` for the tenant: its first view (every session read and priced), then
sorted by last use, and by money saved with a model filter (sessions unchanged: their rows
kept, ``state.listed``) — printing the median and its ratio to the smallest N in one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import httpx
import orjson
import redis

from runloop_proxy.app import create_app
from runloop_proxy.config import Settings, load_config
from runloop_proxy.history.embedded import EmbeddedRedis
from runloop_proxy.ops import inspector_list
from runloop_proxy.scripted import ThreadedServer

ADMIN_KEY = "admin-bench-0123456789abcdef"


def seed(client: redis.Redis, store: object, tenant: str, sessions: int, points: int) -> None:
    now = int(time.time() * 1000)
    index = store._index_key(tenant)  # type: ignore[attr-defined]
    pipe = client.pipeline(transaction=False)
    for s in range(sessions):
        sid = f"n:bench-{s:05d}"
        prefix = store.prefix(tenant, sid)  # type: ignore[attr-defined]
        at = now - (sessions - s) * 60_000
        pipe.zadd(index, {sid: at})
        pipe.hset(prefix + ":meta", mapping={"len": 2 * points, "created": at - 3_600_000,
                                             "updated": at})
        model = "gpt-4o-mini" if s % 3 else "gpt-4o-2024-08-06"
        pipe.rpush(prefix + ":req", *(orjson.dumps({
            "ts": at - (points - k) * 20_000, "client": 2_000 + 900 * k,
            "forwarded": 2_000 + 900 * k - (400 * k if k % 7 else 0), "model": model,
            "messages": 2 * k + 1}) for k in range(points)))
        if s % 200 == 199:
            pipe.execute()
    pipe.execute()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[25, 100, 500])
    parser.add_argument("--points", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data:
        embedded = EmbeddedRedis(data)  # a Redis of its own: what it stores goes with it
        url = embedded.start()
        settings = Settings(upstream="http://127.0.0.1:9/v1", redis_url=url, data_dir=data,
                            admin_key=ADMIN_KEY)
        config = load_config(settings)
        app = create_app(settings, config)
        server = ThreadedServer(app, server=config.server)
        port = server.start()
        client = redis.Redis.from_url(url)
        try:
            base = f"http://127.0.0.1:{port}"
            http = httpx.Client(base_url=base, timeout=120)
            http.post("/admin/ui/login", data={"key": ADMIN_KEY})
            store = app.state.runloop.store
            rows: list[tuple[int, float, float, float]] = []
            for n in args.sessions:
                tenant = f"pt-bench{n:08d}"
                seed(client, store, tenant, n, args.points)
                times: dict[str, list[float]] = {"last": [], "saved": []}
                t = time.perf_counter()  # the first view: every session priced
                assert http.get("/admin/ui", params={"tenant": tenant}).status_code == 200
                first_view = (time.perf_counter() - t) * 1000
                for _ in range(args.repeat):
                    for sort, extra in (("last", {}), ("saved", {"model": "gpt-4o-mini"})):
                        t = time.perf_counter()
                        r = http.get("/admin/ui", params={"tenant": tenant, "sort": sort,
                                                          **extra})
                        times[sort].append(time.perf_counter() - t)
                        assert r.status_code == 200, r.text[:300]
                        assert f"{min(n, inspector_list.TALLIED):,}" in r.text
                rows.append((n, first_view, statistics.median(times["last"]) * 1000,
                             statistics.median(times["saved"]) * 1000))
                # the next size alone: the page would read every tenant's sessions
                client.delete(store._index_key(tenant), *(
                    store.prefix(tenant, f"n:bench-{s:05d}") + part
                    for s in range(n) for part in (":meta", ":req")))
            first = rows[0]
            print(f"landing page, {args.points} request points a session "
                  f"(median of {args.repeat}):")
            for n, cold, last, saved in rows:
                print(f"  {n:>6,} sessions: first view {cold:8.1f} ms, then by last use "
                      f"{last:8.1f} ms ({last / first[2]:5.1f}x), by money saved, one model "
                      f"{saved:8.1f} ms ({saved / first[3]:5.1f}x)")
        finally:
            client.close()
            server.stop()
            embedded.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
