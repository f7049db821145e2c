"""Replicas syncing one session, whatever they last saw: a property over drawn histories.

Several replicas (one RedisStore each, one Redis) take turns syncing conversations of one
session — each growing what it sent last, forking it at any point (an edit, a regenerated
reply), or resending an older prefix — so each replica's idea of the session (its cached
length and chain, the hint it sends) is as stale as the interleaving makes it. After every
sync the head branch holds exactly the conversation just sent, or, when that was a prefix of
the head, the head as it was; and at the end every conversation ever sent is a prefix of some
branch, whole: nothing lost, nothing duplicated, no replica's messages grafted onto another's
conversation. Planted, each red: SYNC trusting a hint of the right length whatever its chain;
SYNC appending after a head longer than the hint without checking the chain there."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import orjson
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runloop_proxy.config import StoreSection
from runloop_proxy.history.store import RedisStore, prepare
from runloop_proxy.ops.metrics import Metrics

Conversation = list[dict[str, str]]


def msg(i: int, tag: str) -> dict[str, str]:
    return {"role": "user" if i % 2 == 0 else "assistant", "content": f"{tag}-{i}"}


@st.composite
def histories(draw: Any) -> list[tuple[int, Conversation]]:
    """(replica, conversation) in the order they are synced."""
    replicas = draw(st.integers(2, 3))
    last: dict[int, Conversation] = {}
    out: list[tuple[int, Conversation]] = []
    for step in range(draw(st.integers(2, 9))):
        r = draw(st.integers(0, replicas - 1))
        base = last.get(r) or (out[-1][1] if out and draw(st.booleans()) else [])
        how = draw(st.sampled_from(["grow", "fork", "prefix"])) if base else "grow"
        if how == "grow":
            conv = base + [msg(len(base) + k, f"s{step}") for k in range(draw(st.integers(1, 3)))]
        elif how == "fork":
            at = draw(st.integers(0, len(base) - 1))
            conv = base[:at] + [msg(at + k, f"f{step}") for k in range(draw(st.integers(1, 3)))]
        else:
            conv = base[:draw(st.integers(1, len(base)))]
        last[r] = conv
        out.append((r, conv))
    return out


def branches(client: redis.Redis, p: str) -> tuple[Conversation, list[Conversation]]:
    """The head branch and every branch, as messages."""
    def read(b: str) -> Conversation:
        hashes = client.lrange(f"{p}:b:{b}", 0, -1)
        return [orjson.loads(v) for v in client.hmget(p + ":msg", hashes)] if hashes else []
    head = (client.hget(p + ":meta", "head") or b"0").decode()
    live = [b.decode() for b in client.zrange(p + ":bused", 0, -1)] or [head]
    return read(head), [read(b) for b in live]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(histories())
def test_replicas_syncing_one_session_lose_and_graft_nothing(
        redis_url: str, history: list[tuple[int, Conversation]]) -> None:
    cfg = StoreSection(key_prefix=f"t-rep-{uuid.uuid4().hex[:8]}", max_branches=64)
    client = redis.Redis.from_url(redis_url)

    async def go() -> None:
        stores = [RedisStore(redis_url, cfg, Metrics()) for _ in range(3)]
        p = stores[0].prefix("t", "s")
        head: Conversation = []
        try:
            for step, (r, conv) in enumerate(history):
                await stores[r].sync("t", "s", [prepare(m) for m in conv])  # type: ignore[arg-type]
                now, _ = branches(client, p)
                where = f"step {step}: replica {r} sent {[m['content'] for m in conv]}, " \
                        f"the head holds {[m['content'] for m in now]}"
                assert now[:len(conv)] == conv, where
                assert now == conv or now == head, where
                head = now
            _, every = branches(client, p)
            for _, conv in history:
                assert any(b[:len(conv)] == conv for b in every), \
                    f"{[m['content'] for m in conv]} lost: {every}"
        finally:
            for store in stores:
                await store.close()

    asyncio.run(go())
