"""Background work is supervised, and anything the store raises is a store failure.

Every task the proxy starts off a request's path runs under ``runloop_proxy.tasks``: an
exception is logged with its traceback and counted (``runloop_background_failures_total``),
a long-lived task (the write-behind flusher) is started again. Whatever the store's client
library raises (redis-py's cluster client raises ``RuntimeError`` and ``AttributeError``
while it reconnects after a master died) is a ``StoreError``: the request fails open, never
a 500, and the write waits to be sent again. The last test kills the masters of a real
3-master Redis Cluster while traffic flows and checks the bookkeeping after it recovers.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
import uuid
from typing import Any

import httpx
import pytest
import redis

from runloop_proxy.config import StoreSection
from runloop_proxy.history.store import RedisStore, prepare
from runloop_proxy.history.writes import Job, WriteBehind
from runloop_proxy.ops.metrics import Metrics
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer, RedisServer, free_cluster_port, until
from .keys import openai_project_key

KEY = openai_project_key(41)
TENANT = "pt-" + hashlib.sha256(KEY.encode()).hexdigest()[:16]
ADMIN = "admin-supervised-7d41c0a9e3"
MODEL = "gpt-4.1-mini-2025-04-14"


def failures(metrics: Metrics, task: str) -> float:
    return metrics.background_failures.labels(task)._value.get()  # type: ignore[no-any-return]


def test_a_flusher_that_raises_is_logged_counted_and_started_again(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Bug class: background work that dies silently. The write-behind flusher raised
    outside any handler (redis-py's RuntimeError in a cluster reconnect): the task died,
    nothing was logged until shutdown, and every later write stayed queued — the session
    outstanding for good. Red with the flusher started bare (``create_task`` without
    ``tasks.forever``); a second bug of the class planted: ``AppState.spawn`` without
    ``tasks.once`` (a record's exception left to "Task exception was never retrieved",
    counted nowhere: the next test)."""
    async def go() -> None:
        metrics = Metrics()
        store = RedisStore(redis_url, StoreSection(key_prefix="sv" + uuid.uuid4().hex[:8]),
                           metrics)
        real = store.writes._available_in
        raised = []

        def once_broken() -> float:
            if not raised:
                raised.append(1)
                raise RuntimeError("Cannot send a command while the cluster reinitializes")
            return real()

        store.writes._available_in = once_broken  # type: ignore[method-assign]
        await store.start()
        try:
            store.submit("t", "s-flusher", [prepare({"role": "user", "content": "turn 1"})])
            assert await store.written("t", "s-flusher", 20), "the write never went out"
            head = await store.head("t", "s-flusher")
            assert [m["content"] for _, m in head] == ["turn 1"]
            assert raised and failures(metrics, "write_behind") == 1
            assert store.writes._task is not None and not store.writes._task.done()
            # and it keeps working after its restart
            store.submit("t", "s-flusher", [prepare({"role": "user", "content": "turn 1"}),
                                            prepare({"role": "user", "content": "turn 2"})])
            assert await store.written("t", "s-flusher", 20)
            assert [m["content"] for _, m in await store.head("t", "s-flusher")] == \
                ["turn 1", "turn 2"]
        finally:
            await store.close()

    with caplog.at_level(logging.ERROR):
        asyncio.run(go())
    logged = [r for r in caplog.records if "starting it again" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None  # with its traceback
    assert logged[0].exc_info[0] is RuntimeError


def test_spawned_work_that_raises_is_logged_and_counted(
        proxy: ProxyServer, caplog: pytest.LogCaptureFixture) -> None:
    """A one-shot task's exception (a record, an anchor, a summary) is logged with its
    traceback and counted by the task's name. Red with ``spawn`` creating the task bare."""
    async def broken_record() -> None:
        raise AttributeError("'NoneType' object has no attribute 'send_command'")

    with caplog.at_level(logging.ERROR):
        proxy.run(_spawn_and_wait(proxy, broken_record()))
    name = "test_spawned_work_that_raises_is_logged_and_counted.<locals>.broken_record"
    assert failures(proxy.metrics, name) == 1
    logged = [r for r in caplog.records if r.getMessage() == "background task failed"]
    assert logged and logged[0].exc_info is not None \
        and logged[0].exc_info[0] is AttributeError


async def _spawn_and_wait(proxy: ProxyServer, coro: Any) -> None:
    before = set(proxy.state.background)
    proxy.state.spawn(coro)
    new = set(proxy.state.background) - before
    await asyncio.wait(new, timeout=5)


class _Raising:
    """Every command a Redis client sends raises what redis-py's cluster client raises
    while it reconnects."""

    def __init__(self, exc: type[Exception]):
        self.exc = exc
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        raise self.exc("'NoneType' object has no attribute 'connection'")


@pytest.mark.parametrize("exc", [RuntimeError, AttributeError, KeyError])
def test_whatever_the_store_client_raises_fails_open_never_500(
        make_proxy: Any, upstream: ScriptedUpstream, exc: type[Exception]) -> None:
    """Any exception from the store is a store failure: the request is answered (200,
    ``X-Runloop-Degraded: store``), and once the client works again the session is stored.
    Red with ``RedisStore._call`` converting only redis-py's own errors (RuntimeError and
    AttributeError reached the client as 500s)."""
    proxy = make_proxy(admin_key=ADMIN, store={"retry_after_s": 0.3})
    client = proxy.state.store.client
    raising = _Raising(exc)
    history = [{"role": "user", "content": "list the failing tests"}]
    headers = {"Authorization": f"Bearer {KEY}", "X-Session-Id": f"sv-open-{exc.__name__}"}
    client.execute_command = raising
    client.pipeline = raising
    try:
        r = httpx.post(proxy.url + "/chat/completions", headers=headers, timeout=30,
                       json={"model": MODEL, "messages": history})
    finally:
        del client.execute_command, client.pipeline
    assert r.status_code == 200, r.text
    assert r.headers["x-runloop-degraded"] == "store" and raising.calls >= 1
    assert r.json()["choices"][0]["message"]["content"] == "echo: list the failing tests"
    history += [r.json()["choices"][0]["message"],
                {"role": "user", "content": "and the flaky ones"}]
    until(lambda: proxy.state.store.available, what="the store back up")
    r = httpx.post(proxy.url + "/chat/completions", headers=headers, timeout=30,
                   json={"model": MODEL, "messages": history})
    assert r.status_code == 200 and "x-runloop-degraded" not in r.headers
    proxy.settle()
    view = httpx.get(f"{proxy.base}/admin/sessions/sv-open-{exc.__name__}",
                     headers={"Authorization": f"Bearer {ADMIN}"},
                     params={"messages": "1", "tenant": TENANT}).json()
    assert [m["content"] for m in view["messages"]] == [
        "list the failing tests", "echo: list the failing tests", "and the flaky ones",
        "echo: and the flaky ones"]


# -- a real Redis Cluster whose masters die while traffic flows ----------------------------

def _cluster(n: int = 3) -> list[RedisServer]:
    nodes = [RedisServer("--cluster-enabled", "yes", "--cluster-config-file",
                         f"nodes-{i}.conf", "--appendonly", "yes", "--appendfsync", "always",
                         port=free_cluster_port()).start() for i in range(n)]
    clients = [redis.Redis(port=node.port) for node in nodes]
    per = 16384 // n
    for i, cl in enumerate(clients):
        cl.execute_command("CLUSTER ADDSLOTS", *range(i * per, 16384 if i == n - 1
                                                      else (i + 1) * per))
    for cl in clients[1:]:
        cl.execute_command("CLUSTER MEET", "127.0.0.1", nodes[0].port)
    _converged(nodes)
    return nodes


def _converged(nodes: list[RedisServer], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            infos = [redis.Redis(port=n.port).cluster("INFO") for n in nodes]
            if all(str(i.get("cluster_state")) in ("ok", "b'ok'") for i in infos):
                return
        except redis.RedisError:
            pass
        time.sleep(0.2)
    pytest.fail("cluster did not converge")


def test_masters_killed_while_traffic_flows(make_proxy: Any,
                                            upstream: ScriptedUpstream) -> None:
    """Kill each master of a real 3-master cluster (no replicas) in turn, SIGKILL, while
    six sessions send turns and one server-history session sends its own; bring each back
    (its append-only file kept). Then: no 500 ever; every turn answered without
    ``X-Runloop-Degraded`` is stored once the cluster is back, in order, on one branch;
    the flusher is alive and a server-history turn is served (a dead flusher held its
    session outstanding: 503 for the life of the process); the outage was counted."""
    nodes = _cluster()
    stop = threading.Event()
    statuses: list[tuple[str, int]] = []
    histories: dict[str, list[dict[str, Any]]] = {}
    acked: dict[str, int] = {}  # session -> messages stored by its last undegraded answer
    server_turns: list[str] = []  # server-history turns answered 200, in order
    try:
        proxy = make_proxy(redis=f"redis+cluster://127.0.0.1:{nodes[0].port}",
                           admin_key=ADMIN, store={"timeout_s": 0.4, "retry_after_s": 0.7,
                                                   "write_retry_s": 90.0})

        def post(session: str, messages: list[dict[str, Any]],
                 **headers: str) -> httpx.Response:
            return httpx.post(proxy.url + "/chat/completions", timeout=60, headers={
                "Authorization": f"Bearer {KEY}", "X-Session-Id": session, **headers},
                json={"model": MODEL, "messages": messages})

        def client_history(session: str) -> None:
            history = histories.setdefault(session, [])
            k = 0
            while not stop.is_set():
                asked = [*history, {"role": "user", "content": f"{session} step {k}"}]
                r = post(session, asked)
                statuses.append((session, r.status_code))
                if r.status_code == 200:
                    history[:] = [*asked, r.json()["choices"][0]["message"]]
                    if "x-runloop-degraded" not in r.headers:
                        acked[session] = len(history)
                k += 1

        def server_history() -> None:
            k = 0
            while not stop.is_set():
                text = f"server step {k}"
                r = post("sv-server", [{"role": "user", "content": text}],
                         **{"X-Runloop-History": "server"})
                statuses.append(("sv-server", r.status_code))
                if r.status_code == 200:
                    server_turns.append(text)
                k += 1

        threads = [threading.Thread(target=client_history, args=(f"sv-c{s}",))
                   for s in range(6)] + [threading.Thread(target=server_history)]
        for t in threads:
            t.start()
        def answered(n: int) -> None:
            """Wait for ``n`` more requests to be answered (the traffic's own pace, however
            loaded the machine: no step is timed)."""
            target = len(statuses) + n
            until(lambda: len(statuses) >= target, timeout=120, what=f"{n} more answers")

        try:
            answered(7)
            for node in (nodes[1], nodes[2], nodes[0]):
                node.stop()  # SIGKILL, while the traffic goes on
                answered(7)
                node.start()
                _converged(nodes)
                answered(7)
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        assert all(not t.is_alive() for t in threads)
        codes = {code for _, code in statuses}
        assert 500 not in codes and codes <= {200, 503}, statuses
        assert all(code == 200 for s, code in statuses if s != "sv-server"), \
            f"a client-history request failed instead of failing open: {statuses}"
        assert sum(s.value for m in proxy.metrics.store_errors.collect() for s in m.samples
                   if s.name.endswith("_total")) > 0, "the outage was not counted"

        until(lambda: proxy.state.store.available, timeout=30, what="the store back up")
        proxy.settle(60)
        task = proxy.state.store.writes._task
        assert task is not None and not task.done(), "the write-behind flusher died"

        def view(session: str) -> dict[str, Any]:
            r = httpx.get(f"{proxy.base}/admin/sessions/{session}",
                          headers={"Authorization": f"Bearer {ADMIN}"},
                          params={"messages": "1", "tenant": TENANT})
            assert r.status_code == 200, r.text
            return r.json()  # type: ignore[no-any-return]

        for session, history in histories.items():
            got = [m["content"] for m in view(session)["messages"]]
            want = [m["content"] for m in history[:acked.get(session, 0)]]
            assert got[:len(want)] == want, (session, len(got), len(want))
        # server history: every turn answered is stored, in order, each with its answer
        got = [m["content"] for m in view("sv-server")["messages"]]
        assert got == [x for t in server_turns for x in (t, f"echo: {t}")]
        # and the session is served: nothing of it stays outstanding
        r = post("sv-server", [{"role": "user", "content": "after the outage"}],
                 **{"X-Runloop-History": "server"})
        assert r.status_code == 200, (r.status_code, r.text)
        # the next turn of every session brings what degraded turns left out: all stored
        for session, history in histories.items():
            asked = [*history, {"role": "user", "content": "after the outage"}]
            r = post(session, asked)
            assert r.status_code == 200 and "x-runloop-degraded" not in r.headers
            history[:] = [*asked, r.json()["choices"][0]["message"]]
        proxy.settle(60)
        for session, history in histories.items():
            v = view(session)
            assert [m["content"] for m in v["messages"]] == [m["content"] for m in history]
            assert len(v["branches"]) == 1
    finally:
        stop.set()
        for n in nodes:
            n.cleanup()


def test_a_stop_while_redis_refuses_writes_logs_and_counts_what_is_lost(
        caplog: pytest.LogCaptureFixture) -> None:
    """Acknowledged but lost, said: a stop while Redis refuses every write (out of memory)
    gives up the queued turns — each one logged and counted
    (``runloop_store_errors_total{op="write_lost"}``) and one line with the totals. Red with
    the stop dropping the queue silently (10 queued turns gone, no log line, no metric); a
    second bug of the class planted: the batch being sent when the stop came left out of
    the count."""
    server = RedisServer().start()
    try:
        client = redis.Redis.from_url(server.url)

        async def go() -> Metrics:
            metrics = Metrics()
            store = RedisStore(server.url, StoreSection(key_prefix="sv-stop-",
                                                        write_retry_s=75.0), metrics)
            await store.start()
            await store.sync("t", "s-warm", [prepare({"role": "user", "content": "warm"})])
            client.config_set("maxmemory", "1")  # every write now answers OOM
            for k in range(10):
                store.submit("t", f"s-lost-{k}", [
                    prepare({"role": "user", "content": f"turn {k}"}),
                    prepare({"role": "assistant", "content": f"answer {k}"}, reply=True)])
            until_refused = time.monotonic() + 10
            while metrics.store_errors.labels("sync")._value.get() < 1 \
                    and time.monotonic() < until_refused:
                await asyncio.sleep(0.02)
            await store.close()  # drain gives up after its 5 s, then the stop
            return metrics

        with caplog.at_level(logging.WARNING):
            metrics = asyncio.run(go())
        assert metrics.store_errors.labels("write_lost")._value.get() == 10
        totals = [r for r in caplog.records if "not stored" in r.getMessage()
                  and r.levelno == logging.ERROR]
        assert len(totals) == 1 and "10 jobs, 20 messages lost" in totals[0].getMessage()
        assert sum(r.getMessage() == "history not stored" for r in caplog.records) == 10
        assert metrics.write_queue._value.get() == 0
    finally:
        server.cleanup()

    async def cut_short() -> list[str]:  # a stop while a batch is being sent
        lost: list[str] = []
        hang = asyncio.Event()

        async def run(batch: list[Job]) -> list[Any]:
            await hang.wait()  # Redis never answers
            return []

        wb = WriteBehind(run, lambda job, reply: True, lambda: 0.0, 75.0,
                         lambda job, why: lost.append(job.session_id))
        wb.start()
        wb.submit(Job("t", "s-in-flight", [prepare({"role": "user", "content": "x"})], None))
        while not wb.pending or wb._queue:
            await asyncio.sleep(0.01)
        await wb.stop()
        return lost

    assert asyncio.run(cut_short()) == ["s-in-flight"]
