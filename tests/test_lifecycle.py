"""How the store comes back and what it keeps: a store that is down stays down until Redis
answers its prober, scripts Redis forgot are loaded again, the lists the store caps keep what
they say. Each kills a mutant the sampled mutation run found surviving
(bench/mutation_sample.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import redis

from runloop_proxy.config import ServerSection
from runloop_proxy.history import store as store_mod
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer, RedisServer, until

ADMIN = "admin-0123456789abcdef"
# what a summary service reads of its host's config: the summary calls' bounds
_CONFIG = SimpleNamespace(server=ServerSection())


def errors(proxy: ProxyServer) -> float:
    """Store operations that failed, all kinds."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(proxy.base + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == "runloop_store_errors_total")


def test_a_store_that_is_down_stays_down_until_redis_answers(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    server = RedisServer().start()
    try:
        # marked down for 30 s unless the prober finds Redis answering sooner
        proxy: ProxyServer = make_proxy(redis=server.url, store={"retry_after_s": 30,
                                                                 "timeout_s": 0.2})
        store = proxy.state.store
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        url, auth = proxy.url + "/chat/completions", {"Authorization": "Bearer sk-t"}
        assert "x-runloop-degraded" not in httpx.post(url, json=body, headers=auth).headers
        server.stop()
        until(lambda: httpx.post(url, json=body, headers=auth).status_code == 200
              and not store.available, what="the store marked down")
        failed = errors(proxy)
        probes = 8  # the prober tries every PROBE_EVERY_S; nothing answers it
        time.sleep(probes * store_mod.PROBE_EVERY_S)
        # down means down: no request, no queued write tried Redis meanwhile (a prober that
        # marked it up unasked would let them, and each failure would count)
        assert not store.available and errors(proxy) == failed, (failed, errors(proxy))
        assert 'runloop_store_up 0.0' in httpx.get(proxy.base + "/metrics").text
        ready = httpx.get(proxy.base + "/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["store"] is False
        server.start()
        until(lambda: store.available, timeout=10, what="the store back up, by the prober")
        assert 'runloop_store_up 1.0' in httpx.get(proxy.base + "/metrics").text
        assert httpx.get(proxy.base + "/readyz").json()["checks"]["store"] is True
    finally:
        server.cleanup()


def test_scripts_redis_forgot_are_loaded_again(make_proxy: Any, upstream: ScriptedUpstream,
                                               redis_url: str) -> None:
    """SCRIPT FLUSH (a failover to a replica that never ran them does the same) between two
    turns: the second is still stored, through the write-behind's batch."""
    proxy: ProxyServer = make_proxy(admin_key=ADMIN)
    c = httpx.Client(base_url=proxy.url, headers={"Authorization": "Bearer sk-t",
                                                  "X-Session-Id": "flushed"})
    msgs = [{"role": "user", "content": "first"}]
    reply = c.post("/chat/completions", json={"model": "m", "messages": msgs}).json()
    proxy.settle()
    redis.Redis.from_url(redis_url).script_flush()
    msgs += [reply["choices"][0]["message"], {"role": "user", "content": "second"}]
    c.post("/chat/completions", json={"model": "m", "messages": msgs})
    proxy.settle()
    view = httpx.get(proxy.base + "/admin/sessions/flushed",
                     headers={"Authorization": f"Bearer {ADMIN}"}, params={"messages": "1"})
    assert [m["content"] for m in view.json()["messages"]] == \
        ["first", "echo: first", "second", "echo: second"]


def test_the_store_keeps_the_last_1000_records_and_500_points(
        proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    store, ns, sid = proxy.state.store, "t", "n:capped"
    for k in range(1005):
        proxy.run(store.add_record(ns, sid, {"kind": "x", "k": k}))
    records = proxy.run(store.client.lrange(store.prefix(ns, sid) + ":rec", 0, -1))
    assert len(records) == 1000 and b'"k":5}' in records[0] and b'"k":1004}' in records[-1]
    c = httpx.Client(base_url=proxy.url, headers={"Authorization": "Bearer sk-t",
                                                  "X-Session-Id": "pointed"})
    for k in range(503):
        c.post("/chat/completions", json={"model": "m", "messages": [
            {"role": "user", "content": f"q {k}"}]})
    proxy.settle()
    from hashlib import sha256

    points = proxy.run(store.points("pt-" + sha256(b"sk-t").hexdigest()[:16], "n:pointed"))
    assert len(points) == 500


def test_summaries_back_off_after_three_failures_in_a_row_every_time() -> None:
    """Three failures in a row pause a tenant's summaries; after the pause it takes three
    more, not fewer (the count starts again from nothing)."""
    from types import SimpleNamespace

    from runloop_proxy.history.summaries import FAILURES_BEFORE_BACKOFF, SummaryService
    from runloop_proxy.ops.metrics import Metrics

    service = SummaryService(SimpleNamespace(metrics=Metrics(), config=_CONFIG))  # type: ignore[arg-type]
    pauses = []
    for _ in range(3 * FAILURES_BEFORE_BACKOFF):
        before = service.paused_until.get("acme")
        service._failed("acme", "acme", "error", 0.0)
        pauses.append(service.paused_until.get("acme") != before)
    assert pauses == ([False] * (FAILURES_BEFORE_BACKOFF - 1) + [True]) * 3


def test_one_callers_failing_summaries_pause_no_other_callers() -> None:
    """Finding (red team): summary failures and pauses were kept per tenant name, and every
    pass-through key is the tenant "passthrough": one key that cannot use the summary
    model paused every other key's summaries. They are kept per caller (its namespace)."""
    import asyncio
    from types import SimpleNamespace

    from runloop_proxy.config import Policy
    from runloop_proxy.history.summaries import FAILURES_BEFORE_BACKOFF, Job, SummaryService
    from runloop_proxy.ops.metrics import Metrics

    asked: list[str] = []

    async def lock_summary(ns: str, session_id: str, ttl: float,
                           unreleased: str | None = None) -> bool:
        asked.append(ns)
        return False  # another replica makes it: the call ends there

    service = SummaryService(SimpleNamespace(  # type: ignore[arg-type]
        metrics=Metrics(), store=SimpleNamespace(lock_summary=lock_summary), config=_CONFIG))
    policy = Policy(summary_model="m-sum")
    for _ in range(FAILURES_BEFORE_BACKOFF):
        service._failed("pt-alice", "passthrough", "error", 300.0)

    def job(ns: str) -> Job:
        return Job(policy, ns, "passthrough", "passthrough", "m", "default", None)

    for ns in ("pt-alice", "pt-bob"):
        asyncio.run(service.make(job(ns), "s", [], [], 2, "c", None, {}))
    assert asked == ["pt-bob"]  # alice's are paused, bob's go on


def test_a_summary_made_clears_the_failures_before_it() -> None:
    """Three failures *in a row* pause a caller's summaries: one made in between starts the
    count again (a mutation sample's survivor: without the reset, three failures a day apart
    paused them)."""
    import asyncio
    from types import SimpleNamespace

    from runloop_proxy.config import Policy
    from runloop_proxy.history.summaries import FAILURES_BEFORE_BACKOFF, Job, SummaryService
    from runloop_proxy.ops.metrics import Metrics
    from runloop_proxy.pipeline.tokens import TokenCounter

    async def yes(*args: object) -> bool:
        return True

    store = SimpleNamespace(lock_summary=yes, unlock_summary=yes, put_summary=yes,
                            add_record=yes)
    service = SummaryService(SimpleNamespace(  # type: ignore[arg-type]
        metrics=Metrics(), store=store, tokens=TokenCounter(), config=_CONFIG))
    job = Job(Policy(summary_model="extractive"), "pt-a", "passthrough", "passthrough",
              "gpt-4o", "default", None)
    for _ in range(FAILURES_BEFORE_BACKOFF - 1):
        service._failed("pt-a", "passthrough", "error", 300.0)
    messages = [{"role": "user", "content": "order #W1"}, {"role": "assistant", "content": "ok"}]
    from runloop_proxy.conversation.runloops import segment

    made = asyncio.run(service.make(job, "s", messages, segment(messages), 1, "c", None, {}))
    assert made is not None
    service._failed("pt-a", "passthrough", "error", 300.0)
    assert service.paused_until.get("pt-a") is None  # one failure since the last made


def test_an_undeclared_parameter_is_a_programming_error() -> None:
    """A page reading a parameter ops/params.py does not declare fails loudly in its tests,
    never quietly with a default."""
    from starlette.requests import Request

    from runloop_proxy.ops import params

    request = Request({"type": "http", "query_string": b"sneaky=1", "path_params": {},
                       "headers": []})
    for read in (lambda: params.text(request, "sneaky"),
                 lambda: params.integer(request, "sneaky", 0),
                 lambda: params.flag(request, "sneaky"),
                 lambda: params.form_text({"sneaky": "1"}, "sneaky")):
        with pytest.raises(KeyError, match="not declared in ops.params.FIELDS"):
            read()
    with pytest.raises(KeyError, match="is not an integer"):
        params.integer(Request({"type": "http", "query_string": b"tenant=3",
                                "path_params": {}, "headers": []}), "tenant", 0)
