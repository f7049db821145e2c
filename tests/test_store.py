"""Sessions and the full history in a real Redis, through the real proxy."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import threading
import time
import uuid
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis

from runloop_proxy.config import Settings, StoreSection
from runloop_proxy.conversation.identity import named_key
from runloop_proxy.conversation.messages import canonical_json
from runloop_proxy.history.store import RedisStore, prepare
from runloop_proxy.ops.metrics import Metrics
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer, RedisServer, free_cluster_port, until
from .keys import openai_project_key

ADMIN = "admin-key-for-tests-0123456789"
KEY = "sk-store-tests"
TENANT = "pt-" + hashlib.sha256(KEY.encode()).hexdigest()[:16]
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}}}}]


def sdk(proxy: ProxyServer, session: str | None = None, **headers: str) -> openai.OpenAI:
    h = {"X-Session-Id": session} if session else {}
    return openai.OpenAI(base_url=proxy.url, api_key=KEY, max_retries=0,
                         default_headers={**h, **headers})


def admin(proxy: ProxyServer, path: str, **params: str) -> httpx.Response:
    return httpx.get(proxy.base + path, params={"tenant": TENANT, **params},
                     headers={"Authorization": f"Bearer {ADMIN}"})


def settle(proxy: ProxyServer) -> None:
    proxy.settle()


def run_tool_conversation(c: openai.OpenAI, upstream: ScriptedUpstream, turns: int
                          ) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"task {t}"})
        upstream.push({"tool_calls": [{"id": f"call_{t}_a", "name": "bash",
                                       "arguments": {"cmd": f"ls {t}"}}]},
                      {"content": f"done {t}"})
        r = c.chat.completions.create(model="gpt-4o-mini", messages=msgs, tools=TOOLS)
        msgs.append(r.choices[0].message.model_dump(exclude_none=True))
        msgs.append({"role": "tool", "tool_call_id": f"call_{t}_a", "content": f"out {t}"})
        r = c.chat.completions.create(model="gpt-4o-mini", messages=msgs, tools=TOOLS)
        msgs.append(r.choices[0].message.model_dump(exclude_none=True))
    return msgs


@pytest.fixture
def aproxy(make_proxy: Any) -> ProxyServer:
    return make_proxy(admin_key=ADMIN)  # type: ignore[no-any-return]


def test_three_turn_tool_conversation_stored_and_segmented(aproxy: ProxyServer,
                                                           upstream: ScriptedUpstream) -> None:
    r = sdk(aproxy, "s-three").chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "warm-up"}])
    assert r.headers["x-session-id"] == "s-three"
    msgs = run_tool_conversation(sdk(aproxy, "s-three2"), upstream, 3)
    settle(aproxy)
    view = admin(aproxy, "/admin/sessions/s-three2").json()
    assert view["message_count"] == len(msgs) == 13
    assert view["session_id"] == named_key("s-three2") and view["tenant"] == TENANT
    loops = view["run_loops"]
    assert [(lp["status"], lp["tool_call_ids"]) for lp in loops] == \
        [("closed", [f"call_{t}_a"]) for t in range(3)]
    assert loops[0]["user_preview"] == "task 0" and loops[2]["final_preview"] == "done 2"
    assert loops[1]["start"] == 5 and loops[1]["end"] == 8
    full = admin(aproxy, "/admin/sessions/s-three2", messages="1").json()["messages"]
    # stored exactly, in the canonical form the client's echo matches
    assert [canonical_json(m) for m in full] == [canonical_json(m) for m in msgs]  # type: ignore[arg-type]
    listing = admin(aproxy, "/admin/sessions").json()
    assert {"s-three", "s-three2"} <= {s["name"] for s in listing["sessions"]}
    assert {named_key("s-three")} <= {s["session_id"] for s in listing["sessions"]}


def test_regenerated_answer_forks_and_keeps_old_branch(aproxy: ProxyServer,
                                                       upstream: ScriptedUpstream) -> None:
    c = sdk(aproxy, "s-fork")
    msgs = [{"role": "user", "content": "tell me a joke"}]
    upstream.push({"content": "first joke"}, {"content": "second joke"})
    c.chat.completions.create(model="m", messages=msgs)
    settle(aproxy)
    c.chat.completions.create(model="m", messages=msgs)  # regenerate: same request again
    settle(aproxy)
    view = admin(aproxy, "/admin/sessions/s-fork", messages="1").json()
    assert [m.get("content") for m in view["messages"]] == ["tell me a joke", "second joke"]
    assert len(view["branches"]) == 2
    old = view["branches"]["0"]
    assert old["length"] == 2 and view["branches"]["1"]["fork_at"] == 1
    # an edited earlier message forks too; both earlier branches stay
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "edited"}])
    settle(aproxy)
    view = admin(aproxy, "/admin/sessions/s-fork").json()
    assert len(view["branches"]) == 3 and view["message_count"] == 2


def test_resent_reply_with_sdk_noise_does_not_fork(aproxy: ProxyServer,
                                                   upstream: ScriptedUpstream) -> None:
    c = sdk(aproxy, "s-echo")
    upstream.push({"content": "reply"})
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
    echoed = r.choices[0].message.model_dump()  # refusal: None, annotations: [], etc.
    c.chat.completions.create(model="m", messages=[
        {"role": "user", "content": "q"}, echoed, {"role": "user", "content": "more"}])
    settle(aproxy)
    view = admin(aproxy, "/admin/sessions/s-echo").json()
    assert len(view["branches"]) == 1 and view["message_count"] == 4


def test_server_history_mode(aproxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    c = sdk(aproxy, "s-server", **{"X-Runloop-History": "server"})
    c.chat.completions.create(model="m", messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "one"}])
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "two"}])
    sent = upstream.requests[-1]["messages"]
    assert [m["content"] for m in sent] == ["be brief", "one", "echo: one", "two"]
    # a new system prompt replaces the stored one for this turn
    c.chat.completions.create(model="m", messages=[
        {"role": "system", "content": "be verbose"}, {"role": "user", "content": "three"}])
    sent = upstream.requests[-1]["messages"]
    assert sent[0]["content"] == "be verbose" and sent[-1]["content"] == "three"
    assert len(sent) == 6


def test_fifty_concurrent_requests_lose_nothing(aproxy: ProxyServer,
                                               upstream: ScriptedUpstream) -> None:
    async def go() -> None:
        c = openai.AsyncOpenAI(base_url=aproxy.url, api_key=KEY, max_retries=0,
                               default_headers={"X-Session-Id": "s-50",
                                                "X-Runloop-History": "server"})
        await asyncio.gather(*[c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"msg {i}"}]) for i in range(50)])
        await c.close()

    asyncio.run(go())
    settle(aproxy)  # the replies, appended write-behind too
    view = admin(aproxy, "/admin/sessions/s-50", messages="1").json()
    contents = [m["content"] for m in view["messages"]]
    assert sorted(c for c in contents if c.startswith("msg ")) == \
        sorted(f"msg {i}" for i in range(50))
    assert len(contents) == 100  # 50 questions, 50 replies, none twice


def test_concurrent_full_resends_keep_every_message(aproxy: ProxyServer,
                                                    upstream: ScriptedUpstream) -> None:
    base = [{"role": "user", "content": "base"}, {"role": "assistant", "content": "ok"}]

    async def go() -> None:
        c = openai.AsyncOpenAI(base_url=aproxy.url, api_key=KEY, max_retries=0,
                               default_headers={"X-Session-Id": "s-par"})
        await asyncio.gather(*[c.chat.completions.create(
            model="m", messages=[*base, {"role": "user", "content": f"v{i}"}])
            for i in range(20)])
        await c.close()

    asyncio.run(go())
    settle(aproxy)
    r = redis.Redis.from_url(aproxy.state.store.client.connection_pool.connection_kwargs
                             and _url(aproxy))
    prefix = aproxy.state.store.prefix(TENANT, named_key("s-par"))
    bodies = [v.decode() for v in r.hvals(prefix + ":msg")]
    for i in range(20):
        assert sum(f'"v{i}"' in b for b in bodies) == 1
    # every variant lives on some branch, whole
    view = admin(aproxy, "/admin/sessions/s-par").json()
    total = sum(b["length"] for b in view["branches"].values())
    assert total >= 20


def _url(proxy: ProxyServer) -> str:
    return str(proxy.settings.redis_url)


class ReplyCutter:
    """A TCP relay in front of a redis-server that, once armed, lets a command holding
    ``marker`` reach Redis and cuts the connection instead of relaying Redis's reply (a
    master that died after the write, a network that dropped the answer): the write is
    applied, and its sender cannot know."""

    def __init__(self, port: int, marker: bytes):
        import socket

        self.target, self.marker = port, marker
        self.armed = threading.Event()
        self.cut = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            doomed = threading.Event()
            threading.Thread(target=self._pump, args=(client, server, doomed, True),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, doomed, False),
                             daemon=True).start()

    def _pump(self, src: Any, dst: Any, doomed: threading.Event, to_redis: bool) -> None:
        try:
            while data := src.recv(65536):
                if to_redis and self.armed.is_set() and self.marker in data:
                    self.armed.clear()
                    doomed.set()
                elif not to_redis and doomed.is_set():
                    self.cut += 1
                    break  # Redis answered: the answer goes nowhere
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.close()

    def close(self) -> None:
        self.sock.close()


def test_an_append_redis_applied_but_whose_reply_was_lost_is_stored_once(
        redis_url: str) -> None:
    """Server history appends what the turn adds to the stored conversation. A write Redis
    applied whose reply never came back (the connection cut after the command, as when a
    Redis Cluster master dies) is sent again on a fresh connection: it must be applied
    once. Found by the cluster test under load (a server-history turn stored twice); here
    the reply is cut by a relay in front of a real redis-server, every time (planted, red:
    the append's token not checked — the answer stored twice)."""
    import hashlib

    from runloop_proxy.history.scripts import APPEND_LUA

    server = RedisServer().start()
    cutter = ReplyCutter(server.port, hashlib.sha1(APPEND_LUA.encode()).hexdigest().encode())

    async def go() -> list[str]:
        store = RedisStore(f"redis://127.0.0.1:{cutter.port}/0",
                           StoreSection(key_prefix=f"t-once-{uuid.uuid4().hex[:8]}-"), Metrics())
        await store.start()
        session = "n:sess_01JDQ8Y7X2K4M6P9R3T5V7W9YB"
        turn = [{"role": "user", "content": "where is order #W5102934?"},
                {"role": "assistant", "content": "It left the depot at 09:14."}]
        store.submit_append("acme", session, [prepare(turn[0])])
        assert await store.drain(10)
        cutter.armed.set()
        store.submit_append("acme", session, [prepare(turn[1], reply=True)])
        assert await store.drain(10)
        got = [str(m.get("content")) for _, m in await store.head("acme", session)]
        await store.close()
        return got
    try:
        got = asyncio.run(go())
        assert cutter.cut == 1  # the reply was cut, and the write sent again
        assert got == ["where is order #W5102934?", "It left the depot at 09:14."]
    finally:
        cutter.close()
        server.cleanup()


def test_an_announced_write_ends_when_it_lands_and_a_newer_one_stays(
        make_proxy: Any, upstream: ScriptedUpstream, redis_url: str) -> None:
    """An answer announces its session's write (a request to another replica that does not
    line up with the session waits while it is announced); once the write is in Redis the
    announcement is gone, not left to expire WRITTEN_WAIT_S later (planted, red: no
    ``_landed``: every request in those 2 s that did not line up waited them out). A landing
    ends only its own announcement: a newer one, from any replica, stays (planted, red: the
    announcement deleted whatever its token)."""
    upstream.responder = lambda body: {"content": "Your order #W81723 left the depot. " * 12}
    proxy = make_proxy()
    c = openai.OpenAI(base_url=proxy.url, api_key=openai_project_key(45), max_retries=0)
    c.chat.completions.create(model="gpt-4o-mini-2024-07-18", messages=[
        {"role": "user", "content": "where is my order?"}])
    proxy.quiet()
    r = redis.Redis.from_url(redis_url)
    prefix = proxy.state.store.cfg.key_prefix
    assert any(True for _ in r.scan_iter(match=f"{prefix}*", count=1000))  # it was recorded
    assert not list(r.scan_iter(match=f"{prefix}*:announced", count=1000))

    async def go() -> None:
        store = RedisStore(redis_url, StoreSection(key_prefix=f"t-ann-{uuid.uuid4().hex[:8]}-"),
                           Metrics())
        session = "fp-4f1c2b7e9d0a8e6c5b3a1f2e4d6c8b0a"
        await store.announce("acme", session, [], None, 2_000, "a" * 16)
        await store.announce("acme", session, [], None, 2_000, "b" * 16)  # a newer answer
        await store.unannounce("acme", session, "a" * 16)
        assert await store.announced("acme", session)
        await store.unannounce("acme", session, "b" * 16)
        assert not await store.announced("acme", session)
        await store.close()
    asyncio.run(go())


def test_a_summary_lock_is_released_only_by_its_holder(redis_url: str) -> None:
    """One summary in flight per session across replicas: the lock is a token with a TTL.
    A holder whose lock expired (a summary slower than its TTL) and was taken by another
    replica must not release the other's when it ends, or a third replica makes the same
    summary again. Two stores on one Redis (two replicas). Planted, red: the unlock
    deleting the key whoever holds it (the third replica got the lock); the lock taken
    without NX (the second replica got it while the first held it)."""
    async def go() -> None:
        cfg = StoreSection(key_prefix=f"t-lock-{uuid.uuid4().hex[:10]}-")
        a, b = RedisStore(redis_url, cfg, Metrics()), RedisStore(redis_url, cfg, Metrics())
        session = "n:sess_01JDKX4Q8W2M9T7H3C5B6N0PZR"
        first = await a.lock_summary("acme", session, 0.35)
        assert first and await b.lock_summary("acme", session, 30) is None
        await asyncio.sleep(0.5)  # a's summary outlived its lock: b takes it
        second = await b.lock_summary("acme", session, 30)
        assert second and second != first
        await a.unlock_summary("acme", session, first)  # a ends late: b's lock stays
        assert await a.lock_summary("acme", session, 30) is None
        await b.unlock_summary("acme", session, second)
        third = await a.lock_summary("acme", session, 30)
        assert third and third not in (first, second)
        # a lock its holder could not release is that holder's to take over, never another's
        # (planted, red: the takeover whatever the lock's token)
        assert await b.lock_summary("acme", session, 30, unreleased=second) is None
        fourth = await a.lock_summary("acme", session, 30, unreleased=third)
        assert fourth and fourth != third
        assert await b.lock_summary("acme", session, 30) is None
        assert await a.unlock_summary("acme", session, fourth)
        await a.close()
        await b.close()

    asyncio.run(go())


def test_tool_call_ids_reused_are_kept_apart(redis_url: str) -> None:
    async def go() -> None:
        store = RedisStore(redis_url, StoreSection(key_prefix="t-reuse-" + str(time.time())),
                           Metrics())
        msgs: list[dict[str, Any]] = []
        for k in range(2):
            msgs += [{"role": "user", "content": f"q{k}"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_same", "type": "function",
                          "function": {"name": "f", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "call_same", "content": f"result {k}"},
                     {"role": "assistant", "content": f"a{k}"}]
        await store.sync("t", "s", [prepare(m) for m in msgs])  # type: ignore[arg-type]
        results = await store.tool_results("t", "s", "call_same")
        assert [m["content"] for m in results] == ["result 0", "result 1"]
        await store.close()

    asyncio.run(go())


def test_results_under_one_call_id_are_stored_in_work_linear_in_them() -> None:
    """Finding (red team): each result of a reused call id re-read, searched and re-wrote
    the id's whole list inside the sync script — quadratic, with Redis blocked for every
    tenant (9,999 results: 5 s). Counted, not timed: the script's HSETs of result lists do
    not grow with the results (one per id and sync), and every result is kept, in order."""
    server = RedisServer().start()
    try:
        client = redis.Redis.from_url(server.url)

        def sync(n: int) -> int:
            async def go() -> list[Any]:
                store = RedisStore(server.url, StoreSection(key_prefix=f"t-one-{n}-"),
                                   Metrics())
                msgs: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
                for k in range(n):
                    msgs += [{"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_0", "type": "function",
                         "function": {"name": "f", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "call_0", "content": f"r{k}"}]
                await store.sync("t", "s", [prepare(m) for m in msgs])  # type: ignore[arg-type]
                results = await store.tool_results("t", "s", "call_0")
                await store.close()
                return [m["content"] for m in results]

            before = client.info("commandstats").get("cmdstat_hset", {}).get("calls", 0)
            kept = asyncio.run(go())
            assert kept == [f"r{k}" for k in range(n)]
            return int(client.info("commandstats")["cmdstat_hset"]["calls"] - before)

        small, large = sync(200), sync(400)
        assert large <= small + 2, (small, large)  # was one per result
    finally:
        server.cleanup()


def test_a_sync_reads_the_proxys_exchanges_it_has_not_read() -> None:
    """Finding (red team): every sync read the session's proxy exchanges back whole (a
    session recalling a 50 KB result: 1.96 MB a request at turn 40). Counted in the bytes
    Redis sends: a replica's sync reads only the exchanges written since its last read,
    another replica's as well as its own; a replica that held none reads them all once; a
    session stored before the exchange log had one gets it from its first sync.

    And (a second red-team pass) what a replica holds is never a stale or partial set it
    takes for the whole: the log is lost apart from the hash, or the session expires and
    another replica makes it again — each replica's next sync holds what Redis holds."""
    server = RedisServer().start()
    try:
        client = redis.Redis.from_url(server.url)
        cfg = StoreSection(key_prefix="t-int-")
        big = "x" * 20_000

        def sent() -> int:
            return int(client.info("stats")["total_net_output_bytes"])

        async def go() -> None:
            a = RedisStore(server.url, cfg, Metrics())
            b = RedisStore(server.url, cfg, Metrics())
            msgs: list[dict[str, Any]] = [{"role": "user", "content": "q0"}]
            p = a.prefix("t", "s")

            def held() -> dict[str, Any]:
                return {k.decode(): orjson.loads(v)
                        for k, v in client.hgetall(p + ":int").items()}

            async def sync(store: RedisStore, more: bool = True) -> tuple[int, dict[str, Any]]:
                if more:
                    msgs.append({"role": "assistant" if len(msgs) % 2 else "user",
                                 "content": f"m{len(msgs)}"})
                before = sent()
                result = await store.sync("t", "s", [prepare(m) for m in msgs])  # type: ignore[arg-type]
                return sent() - before, result.internal

            await sync(a, more=False)
            await sync(b, more=False)
            for k in range(10):
                await a.add_internal("t", "s", f"anchor{k}", {"before": [big + str(k)]})
            cost, mine = await sync(a)
            assert cost < 2_000 and len(mine) == 10, cost  # a wrote them: nothing to read
            cost, mine = await sync(b)
            assert 200_000 < cost < 210_000 and mine == held(), cost  # b reads the ten once
            cost, _ = await sync(b)
            assert cost < 2_000, cost
            await a.add_internal("t", "s", "anchor3", {"before": ["rewritten"]})
            cost, mine = await sync(b)
            assert cost < 2_000 and mine["anchor3"] == {"before": ["rewritten"]}, cost
            assert mine == held() == a.cached_internal("t", "s")
            cold = RedisStore(server.url, cfg, Metrics())
            cost, mine = await sync(cold)
            assert cost > 180_000 and mine == held()  # nine of 20 KB
            # the log lost apart from the hash (evicted, deleted): made again, read again
            client.delete(p + ":intk")
            await a.add_internal("t", "s", "anchor10", {"before": ["after the loss"]})
            assert len(held()) == 11
            for store in (a, b, cold):
                _, mine = await sync(store)
                assert mine == held(), sorted(mine)
            # the session gone (expired, Redis restarted empty) and made again by another
            # replica with other exchanges: no replica goes on with the old ones
            client.delete(*client.keys(p + "*"))
            msgs[:] = [{"role": "user", "content": "q0"}]
            fresh = RedisStore(server.url, cfg, Metrics())
            await sync(fresh, more=False)
            for k in range(3):
                await fresh.add_internal("t", "s", f"new{k}", {"before": [f"new {k}"]})
            for store in (a, b, cold):
                _, mine = await sync(store)
                assert mine == held() and sorted(mine) == ["new0", "new1", "new2"]
            # a failover that lost writes: both keys back to an earlier state of the same
            # log, grown again by another replica to the length this one had read
            snapshot = {k: client.dump(p + k) for k in (":int", ":intk")}
            for k in range(2):
                await fresh.add_internal("t", "s", f"lost{k}", {"before": [f"lost {k}"]})
            for store in (a, b):
                _, mine = await sync(store)
                assert "lost1" in mine
            for k, v in snapshot.items():
                client.restore(p + k, 0, v, replace=True)
            for k in range(2):
                await fresh.add_internal("t", "s", f"again{k}", {"before": [f"again {k}"]})
            for store in (a, b):
                _, mine = await sync(store)
                assert mine == held() and "lost1" not in mine and "again1" in mine
            # a replica of an earlier version (a rolling upgrade) writes the hash alone
            client.hset(p + ":int", "legacy", orjson.dumps({"before": ["from v1"]}))
            for store in (a, fresh):
                _, mine = await sync(store)
                assert mine == held() and "legacy" in mine
            # a session stored before the log had generations: its first sync makes one
            client.delete(p + ":intk")
            client.rpush(p + ":intk", "new0", "new1", "new2", "legacy")  # the first version's
            old = RedisStore(server.url, cfg, Metrics())
            _, mine = await sync(old)
            assert mine == held() and client.lindex(p + ":intk", 0).startswith(b"g:")
            cost, mine = await sync(old)
            assert cost < 2_000 and mine == held()
            assert 0 < client.pttl(p + ":intk") <= client.pttl(p + ":meta") + 1000
            for s in (a, b, cold, fresh, old):
                await s.close()

        asyncio.run(go())
    finally:
        server.cleanup()


def test_an_exchange_kept_while_a_sync_is_out_is_never_forgotten() -> None:
    """The proxy's exchange written while a sync of the session is out (the sync's script
    ran first, its reply came back after the exchange landed: the write-behind's order
    under load): what this replica then knows of the session holds the exchange, or is
    read again — never the sync's reply without it (issue 40: the session's next request
    spliced nothing, its window shaped by that timing)."""
    server = RedisServer().start()
    try:
        cfg = StoreSection(key_prefix="t-race-")

        async def go() -> None:
            a = RedisStore(server.url, cfg, Metrics())
            msgs = [prepare({"role": "user", "content": "q0"}),  # type: ignore[arg-type]
                    prepare({"role": "assistant", "content": "a0"})]  # type: ignore[arg-type]
            await a.sync("t", "s", msgs[:1])
            run_one = a._run_one

            async def late_reply(job: Any) -> Any:
                reply = await run_one(job)
                await a.add_internal("t", "s", "anchor", {"before": ["kept"]})
                return reply
            a._run_one = late_reply  # type: ignore[method-assign]
            await a.sync("t", "s", msgs)
            known = a.cached_internal("t", "s")
            assert known is None or "anchor" in known, known
            await a.close()

        asyncio.run(go())
    finally:
        server.cleanup()


def test_limits_degrade_instead_of_failing(make_proxy: Any, upstream: ScriptedUpstream) -> None:
    proxy = make_proxy(admin_key=ADMIN, store={"max_messages_per_session": 10})
    c = sdk(proxy, "s-big")
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
            for i in range(13)]
    r = c.chat.completions.with_raw_response.create(model="m", messages=msgs)
    assert r.http_response.status_code == 200
    assert r.headers.get("x-runloop-degraded") == "store"


def test_admin_needs_key_and_is_tenant_scoped(aproxy: ProxyServer, make_proxy: Any,
                                              upstream: ScriptedUpstream) -> None:
    sdk(aproxy, "s-secret").chat.completions.create(
        model="m", messages=[{"role": "user", "content": "private"}])
    settle(aproxy)
    url = aproxy.base + "/admin/sessions/s-secret"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(url, params={"tenant": TENANT, "messages": "1"}, headers=headers)
        assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key")
        assert "private" not in r.text
    # the control: the admin key and the session's tenant show it, with its messages
    shown = admin(aproxy, "/admin/sessions/s-secret", tenant=TENANT, messages="1")
    assert shown.status_code == 200 and shown.json()["tenant"] == TENANT
    assert [m["content"] for m in shown.json()["messages"]][0] == "private"
    # another key's tenant cannot see it
    other = "pt-" + hashlib.sha256(b"sk-other").hexdigest()[:16]
    hidden = admin(aproxy, "/admin/sessions/s-secret", tenant=other, messages="1")
    assert hidden.status_code == 404 and "private" not in hidden.text
    # as the client named it
    assert hidden.json()["error"]["message"] == f"no session 's-secret' for tenant '{other}'"
    # no admin key configured: the admin API does not exist
    plain = make_proxy()
    off = httpx.get(plain.base + "/admin/sessions/s-secret",
                    headers={"Authorization": f"Bearer {ADMIN}"})
    assert off.status_code == 404 and "admin endpoints are disabled" in off.text


def test_sessions_listing_pages(aproxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    for i in range(5):
        sdk(aproxy, f"s-page-{i}").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}])
    settle(aproxy)
    page = admin(aproxy, "/admin/sessions", limit="2", offset="1").json()
    assert page["total"] >= 5 and len(page["sessions"]) == 2


def test_restart_with_embedded_redis_keeps_history(upstream: ScriptedUpstream,
                                                   tmp_path: Any) -> None:
    settings = Settings(upstream=upstream.url, data_dir=str(tmp_path / "d"), admin_key=ADMIN)
    for round_ in range(2):
        proxy = ProxyServer(settings).start()
        try:
            if round_ == 0:
                run_tool_conversation(sdk(proxy, "s-restart"), upstream, 2)
                settle(proxy)
            else:
                view = admin(proxy, "/admin/sessions/s-restart").json()
                assert view["message_count"] == 9 and len(view["run_loops"]) == 2
        finally:
            proxy.stop()
    assert (tmp_path / "d" / "redis" / "appendonlydir").exists() or \
        list((tmp_path / "d" / "redis").glob("*.aof*"))


@pytest.mark.parametrize(("path", "body"), [
    ("/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("/chat/completions", {"model": "m", "stream": True,
                           "messages": [{"role": "user", "content": "hi"}]}),
    ("/responses", {"model": "m", "input": "hi"}),
    ("/responses", {"model": "m", "input": "hi", "stream": True}),
    ("/messages", {"model": "m", "max_tokens": 16,
                   "messages": [{"role": "user", "content": "hi"}]}),
    ("/messages", {"model": "m", "max_tokens": 16, "stream": True,
                   "messages": [{"role": "user", "content": "hi"}]}),
    ("/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
])
def test_every_api_served_without_redis_says_so(make_proxy: Any, upstream: ScriptedUpstream,
                                                path: str, body: dict[str, Any]) -> None:
    """With Redis gone, every API answers, and says it served degraded, in the header every
    answer of the proxy's goes through (``relay.proxy_headers``): count_tokens left it out
    (a red-team pass)."""
    server = RedisServer().start()
    proxy = make_proxy(redis=server.url, store={"retry_after_s": 0.3, "timeout_s": 0.2})
    server.stop()
    try:
        r = httpx.post(proxy.url + path, json=body, timeout=30,
                       headers={"Authorization": f"Bearer {KEY}", "X-Session-Id": "gone"})
        assert r.status_code == 200, r.text
        assert r.headers.get("x-runloop-degraded") == "store", dict(r.headers)
    finally:
        server.cleanup()


def test_redis_killed_mid_traffic_no_client_failures(make_proxy: Any,
                                                     upstream: ScriptedUpstream) -> None:
    server = RedisServer().start()
    try:
        proxy = make_proxy(redis=server.url, admin_key=ADMIN,
                           store={"retry_after_s": 0.3, "timeout_s": 0.2})
        c = sdk(proxy)
        failures = 0
        degraded = 0
        stop_at = time.monotonic() + 4.0
        killer = threading.Timer(1.0, server.stop)
        restarter = threading.Timer(2.0, server.start)
        killer.start()
        restarter.start()
        i = 0
        while time.monotonic() < stop_at:
            i += 1
            try:
                r = c.chat.completions.with_raw_response.create(
                    model="m", messages=[{"role": "user", "content": f"req {i}"}],
                    extra_headers={"X-Session-Id": f"s-kill-{i}"})
                degraded += r.headers.get("x-runloop-degraded") == "store"
            except openai.APIError:
                failures += 1
        killer.join()
        restarter.join()
        assert failures == 0 and i > 20
        assert degraded > 0
        text = httpx.get(proxy.base + "/metrics").text
        # each degraded answer counted once, by its reason, and no other request counted
        counted = {reason: float(n) for reason, n in re.findall(
            r'^runloop_degraded_requests_total\{reason="(\w*)",tenant="[^"]*"\} (\S+)$',
            text, re.M)}
        assert counted.get("store") == degraded, (counted, degraded)
        assert all(n == 0 for reason, n in counted.items() if reason != "store"), counted
        # recovered: a fresh request is served with the store again
        until(lambda: c.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "after"}],
            extra_headers={"X-Session-Id": "s-after"}).headers.get("x-runloop-degraded")
            is None, what="the store back")
        assert re.search(r"^runloop_store_up 1\.0$", httpx.get(proxy.base + "/metrics").text,
                         re.M), "the store is said to be up again"
    finally:
        server.cleanup()


def test_a_store_that_lost_its_scripts_is_not_down(make_proxy: Any,
                                                   upstream: ScriptedUpstream) -> None:
    """Redis forgets the proxy's scripts (SCRIPT FLUSH, a failover to a replica without them):
    the next write loads them again and retries, once — not a degraded request, not a lost
    turn, and the store stays up."""
    server = RedisServer().start()
    try:
        proxy = make_proxy(redis=server.url, admin_key=ADMIN)
        c = sdk(proxy, "s-scripts")
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": "one"}])
        proxy.settle()
        redis.Redis.from_url(server.url).script_flush()
        r = c.chat.completions.with_raw_response.create(model="m", messages=[
            {"role": "user", "content": "one"}, {"role": "assistant", "content": "echo: one"},
            {"role": "user", "content": "two"}])
        assert r.headers.get("x-runloop-degraded") is None
        proxy.settle()
        view = httpx.get(proxy.base + "/admin/sessions/s-scripts",
                         headers={"Authorization": f"Bearer {ADMIN}"},
                         params={"tenant": TENANT, "messages": "1"}).json()
        assert [m["content"] for m in view["messages"]] == [
            "one", "echo: one", "two", "echo: two"]
        # nothing took the store for down meanwhile: the next request is served with it
        r = c.chat.completions.with_raw_response.create(model="m", messages=[
            {"role": "user", "content": "three"}])
        assert r.headers.get("x-runloop-degraded") is None
        metrics = httpx.get(proxy.base + "/metrics").text
        assert re.search(r"^runloop_store_up 1\.0$", metrics, re.M)
        assert not re.search(r'^runloop_degraded_requests_total\{[^}]*reason="store"[^}]*\} '
                             r'[1-9]', metrics, re.M), metrics
        assert not re.search(r"^runloop_store_errors_total\{[^}]*\} [1-9]", metrics, re.M), \
            "a lost script is reloaded, not counted as the store failing"
        # and loaded only then: later writes run them by their hash, with no SCRIPT LOAD
        stats = redis.Redis.from_url(server.url).info("commandstats")
        loads = stats.get("cmdstat_script|load", {}).get("calls", 0)
        for k in range(4):
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": f"{k}"}])
            proxy.settle()
        stats = redis.Redis.from_url(server.url).info("commandstats")
        assert stats.get("cmdstat_script|load", {}).get("calls", 0) == loads
    finally:
        server.cleanup()


def test_cluster_three_masters(upstream: ScriptedUpstream, make_proxy: Any,
                               tmp_path: Any) -> None:
    nodes = [RedisServer("--cluster-enabled", "yes", "--cluster-config-file",
                         f"nodes-{i}.conf", port=free_cluster_port()).start() for i in range(3)]
    try:
        clients = [redis.Redis(port=n.port) for n in nodes]
        per = 16384 // 3
        ranges = [(0, per - 1), (per, 2 * per - 1), (2 * per, 16383)]
        for cl, (a, b) in zip(clients, ranges, strict=True):
            cl.execute_command("CLUSTER ADDSLOTS", *range(a, b + 1))
        for cl in clients[1:]:
            cl.execute_command("CLUSTER MEET", "127.0.0.1", nodes[0].port)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            infos = [cl.cluster("INFO") for cl in clients]
            if all(str(i.get("cluster_state")) in ("ok", "b'ok'") for i in infos):
                break
            time.sleep(0.2)
        else:
            pytest.fail("cluster did not converge")
        proxy = make_proxy(redis=f"redis+cluster://127.0.0.1:{nodes[0].port}", admin_key=ADMIN)
        for s in range(6):  # several sessions: several slots, several masters
            run_tool_conversation(sdk(proxy, f"s-cluster-{s}"), upstream, 1)
        settle(proxy)
        for s in range(6):
            view = admin(proxy, f"/admin/sessions/s-cluster-{s}").json()
            assert view["message_count"] == 5
        listed = admin(proxy, "/admin/sessions", tenant=view["tenant"]).json()["sessions"]
        assert sorted(s["name"] for s in listed) == [f"s-cluster-{s}" for s in range(6)]
        points = proxy.run(proxy.state.store.points(view["tenant"], "n:s-cluster-0"))
        assert len(points) == 2 and all(p["client"] > 0 for p in points)
        used = [cl.dbsize() for cl in clients]
        assert sum(1 for u in used if u) >= 2
        # what is written beside the scripts expires with its session there too
        store, sid = proxy.state.store, "n:s-cluster-0"
        ns = next(n for n, _ in proxy.run(store.namespaces()))
        proxy.run(store.add_record(ns, sid, {"kind": "x"}))
        proxy.run(store.add_internal(ns, sid, "anchor", {"before": []}))
        proxy.run(store.put_summary(ns, sid, "1:c", "late"))
        cluster = redis.RedisCluster(host="127.0.0.1", port=nodes[0].port)
        p = store.prefix(ns, sid)
        ttls = {k: cluster.pttl(p + k) for k in (":meta", ":rec", ":int", ":sum")}
        assert all(0 < t <= ttls[":meta"] + 1000 for t in ttls.values()), ttls
        cluster.close()
    finally:
        for n in nodes:
            n.cleanup()



def test_inspect_prints_a_session(aproxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    import subprocess
    import sys

    run_tool_conversation(sdk(aproxy, "s-inspect"), upstream, 2)
    settle(aproxy)
    out = subprocess.run([sys.executable, "-m", "runloop_proxy.cli", "inspect", "s-inspect",
                          "--tenant", TENANT, "--url", aproxy.base, "--admin-key", ADMIN],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "9 messages" in out.stdout and "loop   1" in out.stdout and "call_1_a" in out.stdout
    missing = subprocess.run([sys.executable, "-m", "runloop_proxy.cli", "inspect", "nope",
                              "--tenant", TENANT, "--url", aproxy.base, "--admin-key", ADMIN],
                             capture_output=True, text=True)
    assert missing.returncode == 1 and "404" in missing.stderr


def test_token_counts_are_stored_with_messages(aproxy: ProxyServer,
                                               upstream: ScriptedUpstream) -> None:
    sdk(aproxy, "s-tok").chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "count my tokens"}])
    settle(aproxy)
    r = redis.Redis.from_url(_url(aproxy))
    counts = r.hvals(aproxy.state.store.prefix(TENANT, named_key("s-tok")) + ":tok")
    # "<encoding>:<count>": a count is only reused with the encoding it was made with
    assert counts and all(c.decode().startswith("o200k_base") and int(c.split(b":")[1]) > 0
                          for c in counts)


def test_cold_replica_reads_token_counts_from_the_store(aproxy: ProxyServer,
                                                         upstream: ScriptedUpstream) -> None:
    msgs = run_tool_conversation(sdk(aproxy, "s-cold"), upstream, 3)
    settle(aproxy)
    replica = ProxyServer(aproxy.settings, aproxy.config).start()  # same Redis, same prefix
    try:
        counted: list[str] = []
        original = replica.state.tokens._count

        def spy(enc: Any, msg: Any) -> int:
            if "[runloop-proxy]" not in str(msg.get("content")):  # not a window's own form
                counted.append(msg.get("role"))
            return original(enc, msg)  # type: ignore[no-any-return]

        replica.state.tokens._count = spy
        msgs.append({"role": "user", "content": "one more question"})
        upstream.push({"content": "answer"})
        sdk(replica, "s-cold").chat.completions.create(model="gpt-4o-mini", messages=msgs,
                                                       tools=TOOLS)
        # only what the store had never seen was tokenized: the new question and the reply
        assert sorted(counted) == ["assistant", "user"]
    finally:
        replica.stop()
