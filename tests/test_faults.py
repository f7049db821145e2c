"""Faults while traffic flows: clients keep sending while Redis goes away and comes back, and
afterwards what the proxy's bookkeeping says (its metrics, its stored histories) equals what
happened — how Redis's and etcd's suites inject partitions under load, not into a quiet
process. The upstream takes a model's time per call (``Latency``), so requests overlap the
fault; the fault is timed by requests counted, never by the clock."""

from __future__ import annotations

import collections
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from runloop_proxy.scripted import ScriptedUpstream
from runloop_proxy.scripted_world import Latency

from .conftest import ProxyServer, RedisServer, until
from .keys import OPENAI_MODEL, openai_project_key

KEY = openai_project_key(404)
TENANT = "pt-" + hashlib.sha256(KEY.encode()).hexdigest()[:16]
ADMIN = "admin-" + hashlib.sha256(b"faults").hexdigest()[:34]


@dataclass
class Sent:
    session: str
    status: int
    degraded: str | None
    phase: str


@dataclass
class Traffic:
    """Clients, one session each, each sending its whole conversation again and again (as
    agents do) until told to stop; every answer recorded with the phase it was sent in."""

    proxy: ProxyServer
    sessions: int
    phase: str = "before"
    sent: list[Sent] = field(default_factory=list)
    conversations: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    threads: list[threading.Thread] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    keep_going: bool = False  # after an answer that is not a 200, ask again

    def start(self) -> Traffic:
        for k in range(self.sessions):
            name = f"fault-session-{k}"
            self.conversations[name] = []
            t = threading.Thread(target=self._client, args=(name,), daemon=True)
            t.start()
            self.threads.append(t)
        return self

    def _client(self, session: str) -> None:
        convo = self.conversations[session]
        try:
            with httpx.Client(timeout=60) as c:
                turn = 0
                while not self.stop.is_set():
                    phase = self.phase
                    convo.append({"role": "user", "content": f"{session} turn {turn}"})
                    r = c.post(self.proxy.url + "/chat/completions",
                               headers={"Authorization": f"Bearer {KEY}",
                                        "X-Session-Id": session},
                               json={"model": OPENAI_MODEL, "messages": convo})
                    with self.lock:
                        self.sent.append(Sent(session, r.status_code,
                                              r.headers.get("x-runloop-degraded"), phase))
                    if r.status_code != 200:
                        if not self.keep_going:
                            return
                        convo.pop()  # the turn failed: the agent asks again
                        continue
                    convo.append({"role": "assistant",
                                  "content": r.json()["choices"][0]["message"]["content"]})
                    turn += 1
        except BaseException as exc:  # the test says what went wrong, not a silent thread
            self.errors.append(exc)

    def count(self, phase: str) -> int:
        with self.lock:
            return sum(s.phase == phase for s in self.sent)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)
        assert not self.errors, self.errors


def metric(proxy: ProxyServer, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(proxy.base + "/metrics").text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) \
                and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_redis_stopped_and_restarted_under_traffic_loses_and_miscounts_nothing(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Three clients keep their sessions going while Redis is killed and started again
    (persisted, as a production Redis is): every request is answered (fail open), each one
    the proxy served without its store says so in its header, the degraded metric counts
    exactly those, the requests metric counts every one, and once Redis is back each stored
    history is the whole conversation its client sent, in order, nothing twice. Bug class:
    bookkeeping that is right in a quiet process and wrong under load. Planted, each red:
    the degraded metric counted once per outage instead of per request; second: the
    requests metric skipping the requests served degraded. (A third, the write-behind
    queue dropping a batch whose flush failed, stays green: each client's next request
    carries its whole conversation and the proxy's sync heals the store — the stored
    histories hold the end state, not the queue's path.)"""
    redis = RedisServer("--appendonly", "yes", "--appendfsync", "always").start()
    try:
        proxy: ProxyServer = make_proxy(redis=redis.url, admin_key=ADMIN)
        upstream.latency = Latency(first_byte=0.023, between_events=0.0017)
        traffic = Traffic(proxy, sessions=3).start()
        until(lambda: traffic.count("before") >= 9, timeout=120, what="traffic before")
        redis.stop()
        traffic.phase = "outage"
        until(lambda: traffic.count("outage") >= 9, timeout=120, what="traffic in the outage")
        redis.start()
        traffic.phase = "after"
        # until every session has been served with its store twice more (the proxy sees
        # Redis back at its next health check: what comes before is still degraded)
        until(lambda: all(sum(s.session == name and s.phase == "after" and not s.degraded
                              for s in list(traffic.sent)) >= 2
                          for name in traffic.conversations),
              timeout=120, what="traffic served with its store after the outage")
        traffic.finish()
        proxy.settle(timeout=30)

        assert [s for s in traffic.sent if s.status != 200] == []
        degraded = [s for s in traffic.sent if s.degraded == "store"]
        assert {s.phase for s in degraded} <= {"outage", "after"}
        assert sum(s.phase == "outage" for s in degraded) >= 1
        assert metric(proxy, "runloop_degraded_requests_total", reason="store") == \
            len(degraded)
        assert metric(proxy, "runloop_requests_total", status="200") == len(traffic.sent)
        assert metric(proxy, "runloop_store_up") == 1
        for name, convo in traffic.conversations.items():
            view = httpx.get(f"{proxy.base}/admin/sessions/{name}",
                             params={"tenant": TENANT, "messages": "1"},
                             headers={"Authorization": f"Bearer {ADMIN}"})
            assert view.status_code == 200, view.text
            stored = [(m["role"], m["content"]) for m in view.json()["messages"]]
            assert stored == [(m["role"], m["content"]) for m in convo], name
    finally:
        redis.cleanup()


def test_an_upstream_cutting_answers_under_traffic_is_counted_as_the_clients_saw_it(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """While clients keep going, the upstream cuts every third answer part-way (its headers
    promised the whole body) and is slow on the rest: each client gets a 502 for a cut
    answer and asks again, the requests metric by status equals what the clients saw, and
    no cut answer is stored (each history is what its client kept). Bug class as above, for
    the upstream's faults. Planted, each red: a cut answer's 502 counted as a 200;
    second: a failed request counted twice (the 5xx counts above the clients')."""
    answered = [0]
    lock = threading.Lock()

    def model(body: dict[str, Any]) -> dict[str, Any]:
        with lock:
            answered[0] += 1
            n = answered[0]
        last = body["messages"][-1]["content"]
        if n % 3 == 0:
            whole = orjson.dumps({"id": "chatcmpl-cut", "object": "chat.completion",
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant",
                                                           "content": "never whole"}}]})
            return {"raw_body": whole, "cut_after": len(whole) // 2, "hang": 0.011}
        return {"content": f"echo: {last}"}

    proxy: ProxyServer = make_proxy(admin_key=ADMIN)
    upstream.responder = model
    upstream.latency = Latency(first_byte=0.019)
    traffic = Traffic(proxy, sessions=3, keep_going=True).start()
    until(lambda: traffic.count("before") >= 24, timeout=120, what="traffic")
    traffic.finish()
    proxy.settle(timeout=30)
    statuses = collections.Counter(s.status for s in traffic.sent)
    assert statuses[200] >= 12 and set(statuses) - {200} != set()
    for status, n in statuses.items():
        assert metric(proxy, "runloop_requests_total", status=str(status)) == n, status
    for name, convo in traffic.conversations.items():
        view = httpx.get(f"{proxy.base}/admin/sessions/{name}",
                         params={"tenant": TENANT, "messages": "1"},
                         headers={"Authorization": f"Bearer {ADMIN}"})
        assert view.status_code == 200, view.text
        stored = [(m["role"], m["content"]) for m in view.json()["messages"]]
        assert ("assistant", "never whole") not in stored
        kept = [(m["role"], m["content"]) for m in convo]
        # the client's last question may still be unanswered when the traffic stopped
        assert stored == kept or stored == kept[:-1], name
