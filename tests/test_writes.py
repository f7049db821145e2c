"""The write-behind queue against a real Redis: jobs queued together — a conversation that
grows, a reply regenerated, an earlier message edited — are all stored: merging a queued job
into a later one happens only when the later one carries it whole."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runloop_proxy.config import StoreSection
from runloop_proxy.conversation.identity import named_key
from runloop_proxy.conversation.messages import Message
from runloop_proxy.history.store import RedisStore, prepare
from runloop_proxy.ops.metrics import Metrics
from runloop_proxy.scripted import ScriptedUpstream

from .keys import openai_project_key
from .slow_link import SlowLink

# what a client does next: say more, regenerate the last reply, or edit an earlier message
STEPS = st.lists(st.sampled_from(["grow", "grow", "regenerate", "edit"]), min_size=1,
                 max_size=12)


def conversations(steps: list[str]) -> list[list[Message]]:
    convo: list[Message] = [{"role": "user", "content": "start"}]
    out = [list(convo)]
    for k, step in enumerate(steps):
        if step == "grow":
            convo = [*convo, {"role": "assistant", "content": f"reply {k}"},
                     {"role": "user", "content": f"more {k}"}]
        elif step == "regenerate" and len(convo) > 1:
            convo = [*convo[:-1], {"role": convo[-1]["role"], "content": f"again {k}"}]
        else:
            at = len(convo) // 2
            convo = [*convo[:at], {"role": convo[at]["role"], "content": f"edit {k}"}]
        out.append(list(convo))
    return out


async def branches(store: RedisStore, session: str) -> list[list[str]]:
    p = store.prefix("t", session)
    out = []
    for b in await store.client.zrange(p + ":bused", 0, -1):
        hashes = await store.client.lrange(f"{p}:b:{b.decode()}", 0, -1)
        bodies = await store.client.hmget(p + ":msg", hashes) if hashes else []
        out.append([orjson.loads(x)["content"] for x in bodies])
    return out


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=STEPS)
def test_every_conversation_queued_together_is_stored(redis_url: str, steps: list[str]) -> None:
    convos = conversations(steps)

    async def go() -> tuple[list[list[str]], list[dict[str, int]]]:
        store = RedisStore(redis_url, StoreSection(key_prefix="w" + uuid.uuid4().hex[:8]),
                           Metrics())
        await store.start()
        try:
            for k, c in enumerate(convos):  # no await in between: all queued together
                store.submit("t", "s", [prepare(m) for m in c],
                             point={"ts": k, "client": k, "forwarded": k})
                # the queue's byte count (its bound: write_queue_mb) is what it holds
                assert store.writes.bytes == sum(j.size for j in store.writes._queue)
            assert await store.drain(10)
            assert store.writes.bytes == 0
            return await branches(store, "s"), await store.points("t", "s")
        finally:
            await store.close()

    stored, points = asyncio.run(go())
    # each request's token point kept once and in order, however its job was merged
    assert [p["ts"] for p in points] == list(range(len(convos)))
    for c in convos:
        texts = [m["content"] for m in c]
        assert any(b[:len(texts)] == texts for b in stored), (texts, stored)


def test_a_growing_conversation_queued_together_is_one_write_and_sessions_stay_apart(
        redis_url: str) -> None:
    """Ten requests of one growing conversation queued together become one write carrying
    all ten points; two sessions whose conversations are the very same stay two writes
    (chains name content only: only the session's own queued job may absorb another)."""
    turns: list[list[Message]] = [[{"role": "user", "content": f"q{j}"} for j in range(k + 1)]
                                  for k in range(10)]

    async def go() -> tuple[int, list[list[str]], list[list[str]], int]:
        store = RedisStore(redis_url, StoreSection(key_prefix="w" + uuid.uuid4().hex[:8]),
                           Metrics())
        await store.start()
        try:
            for k, c in enumerate(turns):
                store.submit("t", "grows", [prepare(m) for m in c],
                             point={"ts": k, "client": k, "forwarded": k})
            queued = len(store.writes._queue)
            for session in ("twin-a", "twin-b"):
                store.submit("t", session, [prepare(m) for m in turns[3]])
            assert await store.drain(10)
            return (queued, await branches(store, "twin-a"), await branches(store, "twin-b"),
                    len(await store.points("t", "grows")))
        finally:
            await store.close()

    queued, a, b, points = asyncio.run(go())
    assert queued == 1 and points == 10
    assert a == b == [["q0", "q1", "q2", "q3"]]


def test_a_write_redis_refuses_waits_and_is_counted() -> None:
    """Finding (red team): a write Redis refused (out of memory, read-only after a failover,
    busy, loading) was sent again at once, for write_retry_s: one request during an
    out-of-memory spell made 54,889 commands in 3 s, with nothing logged or counted. A
    refused job waits, doubling each time, is counted (``runloop_store_errors_total{op=
    "sync"}``), and is written once Redis takes it."""
    import time

    import redis

    from .conftest import RedisServer

    server = RedisServer().start()
    try:
        client = redis.Redis.from_url(server.url)

        async def go() -> None:
            metrics = Metrics()
            store = RedisStore(server.url, StoreSection(key_prefix="t-oom-"), metrics)
            await store.start()
            await store.sync("t", "s", [prepare({"role": "user", "content": "warm"})])
            client.config_set("maxmemory", "1")  # every write now answers OOM
            client.config_resetstat()
            store.submit("t", "s", [prepare({"role": "user", "content": f"m{k}"})
                                    for k in range(3)])
            await asyncio.sleep(1.5)
            calls = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
            assert calls <= 12, calls  # a few tries a second, not thousands
            refused = metrics.store_errors.labels("sync")._value.get()
            assert refused == calls and refused >= 2
            client.config_set("maxmemory", "0")
            assert await store.drain(10)
            head = await store.head("t", "s")
            assert [m["content"] for _, m in head] == ["m0", "m1", "m2"]
            # a session's turns keep their order: one refused longer is not overtaken by a
            # later one that waited less (server-history appends, a second red-team pass)
            client.config_set("maxmemory", "1")
            store.submit_append("t", "s", [prepare({"role": "user", "content": "turn 1"})])
            await asyncio.sleep(1.2)  # turn 1 has backed off a few times
            store.submit_append("t", "s", [prepare({"role": "user", "content": "turn 2"})])
            await asyncio.sleep(0.2)
            client.config_set("maxmemory", "0")
            assert await store.drain(10)
            head = await store.head("t", "s")
            assert [m["content"] for _, m in head][-2:] == ["turn 1", "turn 2"]
            await store.close()

        started = time.monotonic()
        asyncio.run(go())
        assert time.monotonic() - started < 15
    finally:
        server.cleanup()


def test_a_session_waiting_on_a_refusal_holds_its_later_jobs() -> None:
    """The batch a flush sends: jobs in the order queued, none waiting on a refusal, and
    none of a session behind one of its own that waits (turn 2 must not be stored before
    turn 1 because turn 1 was refused longer); other sessions go on."""
    import time

    from runloop_proxy.history.writes import Job, WriteBehind

    async def nothing(batch: list[Job]) -> list[object]:
        return []

    queue = WriteBehind(nothing, lambda job, reply: True, lambda: 0.0, 60.0,
                        lambda job, why: None)
    now = time.monotonic()
    waiting = Job("t", "s", [], None, append=True, not_before=now + 5)
    behind = Job("t", "s", [], None, append=True)
    other = Job("t", "other", [], None, append=True)
    queue._queue = [waiting, behind, other]
    batch, rest = queue._ready(now)
    assert batch == [other] and rest == [waiting, behind]
    batch, rest = queue._ready(now + 6)
    assert batch == [waiting, behind, other] and rest == []


def test_a_queue_held_by_refusals_is_walked_at_a_bounded_rate_and_stops_on_cancel() -> None:
    """Finding (red team): while Redis refused every write, each request woke the flusher,
    which walked the whole queue (11,700 held jobs: 2.3 -> 6.9 ms of CPU a request, 247 -> 85
    requests a second), and a stop could be lost (3.11's ``wait_for`` swallowing a cancel
    that came as the wake did: the proxy ran on 300 s after SIGTERM). The queue is walked at
    most every ``REWALK_S`` however many jobs arrive, a Redis that refuses everything is
    probed by one job, and the flusher stops when cancelled."""
    import time

    from runloop_proxy.history.writes import REWALK_S, Job, WriteBehind

    refused = [0]

    async def refuse(batch: list[Job]) -> list[object]:
        refused[0] += len(batch)
        return [RuntimeError("OOM command not allowed") for _ in batch]

    async def go() -> tuple[int, float, bool]:
        queue = WriteBehind(refuse, lambda job, reply: True, lambda: 0.0, 60.0,
                            lambda job, why: None)
        walks = [0]
        ready = queue._ready

        def counted(now: float, size: int = 256) -> tuple[list[Job], list[Job]]:
            walks[0] += 1
            return ready(now, size)

        queue._ready = counted  # type: ignore[method-assign]
        queue.start()
        started = time.monotonic()
        for k in range(2_000):  # requests keep coming: each submits and wakes the flusher
            queue.submit(Job("t", f"s{k % 50}", [], None, append=True))
            await asyncio.sleep(0.0005)
        spent = time.monotonic() - started
        refused[0] = 0
        await asyncio.sleep(2.0)  # no requests: what the held queue costs by itself
        quiet = refused[0]
        await queue.stop()
        task = queue._task
        assert task is not None
        return walks[0], spent, quiet, task.done()

    walks, spent, quiet, stopped = asyncio.run(go())
    assert walks <= spent / REWALK_S + 40, (walks, spent)  # not one a submitted job (2,000)
    # Redis refusing every write is probed by one job at a doubling interval, not the
    # queue's every job resent as its own wait ends (6.5 s of CPU every 10 s at 11,700)
    assert quiet <= 4, quiet
    assert stopped


def test_a_full_queue_drops_its_oldest_jobs_and_keeps_its_count_of_bytes() -> None:
    """Past its bound in bytes the queue drops its oldest jobs, each told as lost, and what
    it counts as held stays what it holds (no test ran this path: the cut that replaced one
    pop(0) per job could have left the count wrong)."""
    from runloop_proxy.history.writes import Job, WriteBehind

    lost: list[tuple[str, str]] = []

    async def nothing(batch: list[Job]) -> list[object]:
        return []

    async def go() -> tuple[int, int, list[str]]:
        queue = WriteBehind(nothing, lambda job, reply: True, lambda: 60.0, 60.0,
                            lambda job, why: lost.append((job.session_id, why)),
                            max_bytes=1000)
        for k in range(10):  # never flushed: the store is "away" for 60 s
            queue.submit(Job("t", f"s{k}", [], None, append=True, size=300))
        return queue.bytes, sum(j.size for j in queue._queue), \
            [j.session_id for j in queue._queue]

    held, counted, left = asyncio.run(go())
    assert left == ["s7", "s8", "s9"] and held == counted == 900
    assert lost == [(f"s{k}", "write-behind queue full") for k in range(7)]


def test_a_sessions_writes_are_outstanding_until_written_given_up_or_carried() -> None:
    """What server-history mode waits on (``WriteBehind.holds``): a session's writes are
    outstanding while queued, refused and waiting, or being sent, and only until each is
    written, given up (the queue full, past its deadline, refused for good) or carried by a
    newer sync of the session — every way a job leaves, or a session would wait for good."""
    from runloop_proxy.history.writes import Job, WriteBehind, chain_hashes

    replies: dict[str, object] = {}

    async def run(batch: list[Job]) -> list[object]:
        return [replies.get(job.session_id, "ok") for job in batch]

    def sync(session: str, n: int) -> Job:
        items = [prepare({"role": "user", "content": f"m{k}"}) for k in range(n)]
        return Job("t", session, items, None, chains=chain_hashes([i.match for i in items],
                                                                   None))

    async def go() -> None:
        lost: list[str] = []
        queue = WriteBehind(run, lambda job, reply: True, lambda: 0.0, 60.0,
                            lambda job, why: lost.append(job.session_id), max_bytes=10_000)
        queue.start()
        # written
        queue.submit(sync("a", 1))
        assert queue.holds(("t", "a"))
        assert await queue.written(("t", "a"), 2) and not queue.holds(("t", "a"))
        # carried: a sync extended by a newer one of the session is one write
        queue.submit(sync("b", 1))
        queue.submit(sync("b", 2))
        assert await queue.written(("t", "b"), 2)
        # refused, waiting: outstanding; refused for good: given up
        replies["c"] = RuntimeError("OOM command not allowed")
        queue.submit(sync("c", 1))
        assert not await queue.written(("t", "c"), 0.3) and queue.refusing
        replies["c"] = RuntimeError("WRONGTYPE Operation against a key")
        assert await queue.written(("t", "c"), 10) and "c" in lost
        assert queue.lost(("t", "c")) and not queue.lost(("t", "a"))  # a gap, remembered
        # a turn on its way (still being counted): outstanding from its reservation
        queue.reserve(("t", "f"))
        assert not await queue.written(("t", "f"), 0.1)
        queue.submit(sync("f", 1))
        queue.release(("t", "f"))
        assert await queue.written(("t", "f"), 2)
        # given up when the queue is full: the oldest go, and are no longer outstanding
        replies["d"] = RuntimeError("OOM command not allowed")
        queue.submit(Job("t", "d", [], None, append=True, size=6_000))
        queue.submit(Job("t", "e", [], None, append=True, size=6_000))
        assert not queue.holds(("t", "d")) and "d" in lost
        replies.clear()
        assert await queue.written(("t", "e"), 10)
        assert not queue._open, queue._open  # nothing left counted
        await queue.stop()

    asyncio.run(go())


def test_a_refused_jobs_wait_doubles_at_each_refusal_up_to_its_bound() -> None:
    """What one job waits after each refusal, exactly: ``BACKOFF_S`` x 2^n after its n-th,
    never past ``BACKOFF_MAX_S``, and its attempts counted — twelve refusals in a row, the
    wait read from the job (the clock read around each call bounds it; nothing waits).
    The rate test above cannot see this: while every write is refused one probe a
    doubling interval stands in for each job's own wait.

    Bug class: a retry's state that does not advance (found by a planted bug the suite let
    through: the attempt not counted, the wait never doubling). Planted too: the doubling
    from attempts - 1 past the first (each wait half what it says)."""
    import time

    from runloop_proxy.history.writes import BACKOFF_MAX_S, BACKOFF_S, Job, WriteBehind

    queue = WriteBehind(_never_run, lambda job, reply: True, lambda: 0.0, 3_600.0,
                        lambda job, why: None)
    job = Job("t", "sess-refused", [], None, append=True, deadline=time.monotonic() + 3_600)
    waits = []
    for n in range(1, 13):
        queue._queue.clear()
        before = time.monotonic()
        queue._requeue(job, "OOM command not allowed", backoff=True)
        after = time.monotonic()
        want = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** n)
        assert before + want <= job.not_before <= after + want, (n, job.not_before - before)
        assert job.attempts == n and queue._queue == [job]
        waits.append(want)
    assert waits[:3] == [BACKOFF_S * 2, BACKOFF_S * 4, BACKOFF_S * 8]
    assert waits[-1] == BACKOFF_MAX_S


async def _never_run(batch: list[object]) -> list[object]:
    raise AssertionError("nothing is sent in this test")


SLOW_REDIS_S = 0.12  # each command reaches Redis this late: longer than a turn's gap here
SLOW_LINK_BPS = 100_000  # and each connection carries this much a second towards it
PT_KEY = openai_project_key(7)  # a pass-through caller's own key, 164 characters


def _log(turn: int) -> str:
    """16 KB of a build's log, as an agent pastes it into a turn (distinct each turn)."""
    return "\n".join(f"[{turn:02d}:{n:04d}] ci-runner-7f3a: step {n} ok in {n * 37 % 997} ms "
                     f"sha256:{hashlib.sha256(f'{turn}.{n}'.encode()).hexdigest()[:32]}"
                     for n in range(180))[:16_384]


@pytest.fixture
def slow_redis(redis_url: str) -> Iterator[SlowLink]:
    """The suite's Redis behind a relay that can make it slow (set up before the proxy
    that uses it, so it ends after it)."""
    host, _, rest = redis_url.removeprefix("redis://").partition(":")
    port, _, db = rest.partition("/")
    link = SlowLink(host, int(port)).start()
    link.url = f"redis://127.0.0.1:{link.port}/{db or 0}"
    yield link
    link.stop()


def test_turns_sent_faster_than_a_slow_redis_writes_them_are_stored_whole_and_in_order(
        slow_redis: SlowLink, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """A real slow Redis while traffic flows (a relay: every command 120 ms late, each
    connection carrying 100 KB/s, so a large pipeline reaches Redis after a small read
    sent after it on another connection). Six agents send eight turns each, each the moment
    its previous answer came, so a session's next turn arrives while the write-behind is
    still sending its previous one; a server-history session sends six turns of 16 KB logs.
    Once the queue has drained, each agent's stored conversation is its last request's
    messages and the reply, in the order sent, on one branch (nothing lost, reordered or
    forked); every request upstream of the server-history session held every earlier turn
    in order (compression off: the conversation as the proxy read it), and its stored one
    all six with their answers. Planted, red: a job being sent left as its session's queued
    one (the next turn merged into the batch already on the wire: an agent's stored
    conversation ends at its first turn — no other test in this file sees it); a write
    counted done when its batch is sent, not when Redis answered (the server-history
    answer ends before its turn is in Redis and the next turn reads without it: entries
    0, 2 for 0, 1, 2) — green twice with the relay not slowing anything, which is why this
    test runs slow."""
    link = slow_redis
    # compression off: each request upstream is the conversation the proxy read, whole
    proxy = make_proxy(redis=link.url, store={"timeout_s": 3.0}, policy={"enabled": False})
    link.delay, link.bytes_per_s = SLOW_REDIS_S, SLOW_LINK_BPS
    ns = "pt-" + hashlib.sha256(PT_KEY.encode()).hexdigest()[:16]
    headers = {"Authorization": f"Bearer {PT_KEY}", "x-scripted-unique-replies": "1"}
    sent: dict[str, list[dict[str, Any]]] = {}

    async def agent(c: httpx.AsyncClient, k: int) -> None:
        session = f"agent-{k}-{uuid.uuid4().hex[:12]}"
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": f"You are build agent {k}."}]
        for turn in range(8):
            messages.append({"role": "user", "content": f"agent {k} step {turn}: go on"})
            r = await c.post("/chat/completions", json={
                "model": "gpt-5.1", "messages": messages},
                headers={**headers, "X-Session-Id": session})
            assert r.status_code == 200, r.text
            assert "x-runloop-degraded" not in r.headers, r.headers
            messages.append({"role": "assistant",
                             "content": r.json()["choices"][0]["message"]["content"]})
        sent[session] = messages

    async def server_history(c: httpx.AsyncClient) -> str:
        session = f"ledger-{uuid.uuid4().hex[:12]}"
        for turn in range(6):
            r = await c.post("/chat/completions", json={
                "model": "gpt-5.1", "messages": [
                    {"role": "user", "content": f"ledger entry {turn}\n{_log(turn)}"}]},
                headers={**headers, "X-Session-Id": session,
                         "X-Runloop-History": "server"})
            assert r.status_code == 200, r.text
        return session

    async def traffic() -> str:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=120) as c:
            *_, ledger = await asyncio.gather(*(agent(c, k) for k in range(6)),
                                              server_history(c))
            return str(ledger)

    ledger = asyncio.run(traffic())
    assert link.chunks > 50  # the traffic went through the slow relay
    proxy.settle(30)
    store = proxy.state.store
    for session, messages in sent.items():
        stored = [{"role": m["role"], "content": m["content"]}
                  for _, m in proxy.run(store.head(ns, named_key(session)))]
        assert stored == messages, session
        assert proxy.run(store.client.zcard(store.prefix(ns, named_key(session)) + ":bused")) == 1
    # the server-history session: each request upstream held every earlier turn
    asked = [[m["content"] for m in body["messages"]] for body in upstream.requests
             if any("ledger entry" in str(m.get("content")) for m in body["messages"])]
    assert len(asked) == 6
    for turn, contents in enumerate(asked):
        entries = [str(c).split("\n")[0] for c in contents
                   if str(c).startswith("ledger entry")]
        assert entries == [f"ledger entry {t}" for t in range(turn + 1)], entries
    stored = [m["content"] for _, m in proxy.run(store.head(ns, named_key(ledger)))]
    assert [c.split("\n")[0] for c in stored if c.startswith("ledger entry")] == \
        [f"ledger entry {t}" for t in range(6)]
    assert len(stored) == 12  # each entry and its answer
    link.delay = 0.0
