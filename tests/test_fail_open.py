"""Fail open, swept: a store that is gone or hangs never costs a caller the call, and each
such answer says so three ways — the X-Runloop-Degraded header, a log line naming the
tenant and why, and one count of runloop_degraded_requests_total{reason="store"} — on every
API, JSON and streamed, count_tokens too. Checked per request, so a path that answers but
forgets one of the three (a stream's metric, a log line gone) fails here naming it.
Planted, each red: the degraded log line removed; the degraded metric not counted for
streams; the header left out of a streamed answer.

And a summariser that fails, whichever way (an error status, an answer that is not JSON or
not a completion, no text, too slow, unreachable), never costs a call either, and each
failure is a log line and a count by its outcome. Planted, red: the summary's failure handler
narrowed to the errors it raises itself (a garbage answer then killed the task unseen)."""

from __future__ import annotations

import hashlib
import logging
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer, RedisServer, free_port, until
from .test_config import ACME_KEY

KEY = "sk-fail-open-tests"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi there"}]}
RESPONSES = {"model": "m", "input": "hi there"}
MESSAGES = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi there"}]}
CASES: list[tuple[str, dict[str, Any]]] = [
    ("/chat/completions", CHAT), ("/chat/completions", {**CHAT, "stream": True}),
    ("/responses", RESPONSES), ("/responses", {**RESPONSES, "stream": True}),
    ("/messages", MESSAGES), ("/messages", {**MESSAGES, "stream": True}),
    ("/messages/count_tokens", {"model": "m", "messages": MESSAGES["messages"]}),
]


class Hung:
    """A Redis that accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture(params=["gone", "hung"])
def degraded_proxy(request: pytest.FixtureRequest, make_proxy: Any) -> Iterator[ProxyServer]:
    store = {"retry_after_s": 0.3, "timeout_s": 0.2}
    if request.param == "gone":
        server = RedisServer().start()
        proxy = make_proxy(redis=server.url, store=store)
        server.stop()
        yield proxy
        server.cleanup()
    else:
        hung = Hung()
        yield make_proxy(redis=hung.url, store=store)
        hung.close()


def streamed_text(raw: str) -> str:
    """The text a stream of any of the APIs carries, its deltas joined."""
    out = []
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        data = orjson.loads(line[6:])
        for choice in data.get("choices") or []:
            out.append((choice.get("delta") or {}).get("content") or "")
        if data.get("type") == "response.output_text.delta":
            out.append(data["delta"])
        if data.get("type") == "content_block_delta":
            out.append(data["delta"].get("text") or "")
    return "".join(out)


def degraded_count(proxy: ProxyServer) -> float:
    text = httpx.get(proxy.base + "/metrics").text
    found = re.search(r'^runloop_degraded_requests_total\{reason="store",'
                      r'tenant="passthrough"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_every_api_answers_without_its_store_and_says_so_three_ways(
        degraded_proxy: ProxyServer, caplog: pytest.LogCaptureFixture) -> None:
    proxy = degraded_proxy
    with caplog.at_level(logging.INFO):
        for path, body in CASES:
            where = f"{path} {'stream' if body.get('stream') else 'json'}"
            counted, seen = degraded_count(proxy), len(caplog.records)
            r = httpx.post(proxy.url + path, json=body, timeout=30, headers={
                "Authorization": f"Bearer {KEY}", "X-Session-Id": "fail-open"})
            # answered, and whole: the upstream's answer as it made it
            assert r.status_code == 200, (where, r.text)
            if path.endswith("count_tokens"):
                assert r.json()["input_tokens"] > 0, where
            else:
                text = streamed_text(r.text) if body.get("stream") else r.text
                assert "echo: hi there" in text, (where, r.text[:300])
            if body.get("stream"):
                assert r.headers["content-type"].startswith("text/event-stream"), where
            # said three ways
            assert r.headers.get("x-runloop-degraded") == "store", (where, dict(r.headers))
            assert degraded_count(proxy) == counted + 1, f"{where}: not counted once"
            said = [rec for rec in caplog.records[seen:] if rec.levelno >= logging.WARNING
                    and "store" in rec.getMessage() and "uncompressed" in rec.getMessage()]
            assert len(said) == 1, (where, [rec.getMessage() for rec in caplog.records[seen:]])
            assert getattr(said[0], "tenant", None) == "passthrough" and \
                getattr(said[0], "error", None), (where, said[0].__dict__)


SUMMARY_FAILURES: dict[str, dict[str, Any]] = {
    "an error status": {"status": 500},
    "not JSON": {"raw_body": b"<html>busy, try later</html>"},
    "not a completion": {"raw_body": b'{"choices": []}'},
    "no text": {"content": ""},
    "too slow": {"content": "late", "delay": 3.0},
}


@pytest.mark.parametrize("how", [*SUMMARY_FAILURES, "unreachable"])
def test_a_failing_summariser_never_costs_a_call_and_is_counted_and_logged(
        how: str, tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from .test_summaries import TOOLS, config, converse, model
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-up")
    monkeypatch.setenv("TEST_ACME_KEY", ACME_KEY)
    extra = ""
    if how == "unreachable":
        extra = 'summary_upstream = "gone"\n'
        upstream.responder = model()
    else:
        upstream.responder = model(lambda body: SUMMARY_FAILURES[how])
    root = Path(config(tmp_path, upstream, model="gpt-4o-mini", timeout=1.0, extra=extra))
    if how == "unreachable":
        with (root / "runloop.toml").open("a") as f:
            f.write(f'[upstreams.gone]\nurl = "http://127.0.0.1:{free_port()}/v1"\n'
                    f'api_key = "sk-gone"\nmax_retries = 0\nconnect_timeout = 0.5\n')
    proxy = make_proxy(config_dir=str(root))

    def count(outcome: str) -> float:
        found = re.search(rf'^runloop_summaries_total{{outcome="{outcome}",tenant="acme"}} '
                          rf'(\S+)$', httpx.get(proxy.base + "/metrics").text, re.M)
        return float(found.group(1)) if found else 0.0

    with caplog.at_level(logging.INFO):
        msgs = converse(proxy, f"sum-{how}", 8, after=lambda k: proxy.settle())
        assert msgs[-1]["content"].startswith("order"), how  # every request answered

        def said() -> list[logging.LogRecord]:
            return [rec for rec in caplog.records
                    if rec.getMessage().startswith("summary failed")]

        # a later summary may fail while this reads (the one in flight is slow): every failure
        # is counted and logged once, so the two meet once nothing is in flight
        until(lambda: len(said()) == count("error") + count("timeout") >= 1,
              what="each failed summary counted and logged")
    assert count("ok") == 0, how
    if how == "too slow":
        assert count("timeout") >= 1, how
    assert all(getattr(rec, "outcome", None) in ("error", "timeout") for rec in said()), how
    # and a request whose window omits loops without the summary the failing summariser did
    # not make says so: the header, a log line, a count of degraded requests by "summary"
    seen = len(caplog.records)
    with caplog.at_level(logging.INFO):
        r = httpx.post(proxy.url + "/chat/completions", timeout=30, headers={
            "Authorization": f"Bearer {ACME_KEY}", "X-Session-Id": f"sum-{how}"},
            json={"model": "gpt-4o-mini", "tools": TOOLS,
                  "messages": [*msgs, {"role": "user", "content": "where is order 9"}]})
    assert r.status_code == 200, r.text
    assert r.headers.get("x-runloop-degraded") == "summary", (how, dict(r.headers))
    metrics = httpx.get(proxy.base + "/metrics").text
    assert re.search(r'^runloop_degraded_requests_total\{reason="summary",tenant="acme"\} '
                     r'[1-9]', metrics, re.M), how
    assert any(rec.getMessage().startswith("summary unavailable")
               for rec in caplog.records[seen:]), how


def test_redis_refusing_writes_is_said_and_server_history_never_goes_without_a_turn(
        make_proxy: Any, upstream: ScriptedUpstream,
        caplog: pytest.LogCaptureFixture) -> None:
    """Finding (red team): with Redis reading but refusing writes (out of memory, read-only
    after a failover), every request was answered with no word of it (only the sync's error
    count), and server-history mode, whose conversation is what Redis holds, sent turn 3
    upstream without turn 2 — the model answered without its context. Now a request while
    Redis refuses writes says so (X-Runloop-Degraded: history, a log line, the metric) and is
    still answered compressed; a server-history request waits for its session's turns to be
    written and, when they cannot be, fails closed (503, Retry-After) instead."""
    import redis

    server = RedisServer().start()
    try:
        proxy: ProxyServer = make_proxy(redis=server.url)
        client = redis.Redis.from_url(server.url)
        headers = {"Authorization": f"Bearer {KEY}", "X-Session-Id": "remember",
                   "X-Runloop-History": "server"}

        def say(text: str, extra: dict[str, str] | None = None) -> httpx.Response:
            return httpx.post(proxy.url + "/chat/completions", timeout=30,
                              headers={**headers, **(extra or {})},
                              json={"model": "gpt-4o-mini",
                                    "messages": [{"role": "user", "content": text}]})

        assert say("my name is Bob").status_code == 200
        proxy.settle()
        client.config_set("maxmemory", "1")  # reads go on, every write answers OOM
        second = say("I live in Oslo")  # answered: its turn is queued, refused, retried
        assert second.status_code == 200, second.text
        until(lambda: proxy.state.store.refusing_writes, what="Redis refusing writes")
        seen = len(upstream.requests)
        with caplog.at_level(logging.INFO):
            third = say("where do I live?")
            plain = httpx.post(proxy.url + "/chat/completions", timeout=30, headers={
                "Authorization": f"Bearer {KEY}", "X-Session-Id": "plain"}, json={
                "model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi there"}]})
        # server history: never sent without the turn Redis has not taken
        assert third.status_code == 503, third.text
        assert third.json()["error"]["code"] == "store_unavailable"
        assert third.headers.get("retry-after")
        assert all("where do I live" not in str(b.get("messages")) for b in
                   upstream.requests[seen:])
        # a client that sends its conversation: answered, and told its history waits
        assert plain.status_code == 200 and "echo: hi there" in plain.text
        assert plain.headers.get("x-runloop-degraded") == "history", dict(plain.headers)
        assert re.search(r'^runloop_degraded_requests_total\{reason="history",'
                         r'tenant="passthrough"\} [1-9]', httpx.get(
                             proxy.base + "/metrics").text, re.M)
        assert any(rec.getMessage().startswith("history not being stored")
                   for rec in caplog.records)
        client.config_set("maxmemory", "0")  # Redis takes writes again: all is written
        until(lambda: not proxy.state.store.refusing_writes, timeout=15,
              what="the queued turns written")
        proxy.settle()
        fourth = say("where do I live?")
        assert fourth.status_code == 200 and "x-runloop-degraded" not in fourth.headers
        sent = str(upstream.requests[-1]["messages"])
        assert "my name is Bob" in sent and "I live in Oslo" in sent
    finally:
        server.cleanup()


def test_server_history_waits_for_a_large_answers_turn(make_proxy: Any,
                                                       upstream: ScriptedUpstream) -> None:
    """Finding (red team, second pass): an answer over the size that leaves the event loop
    was counted in a thread before its turn was queued, so a server-history request sent the
    moment it arrived read Redis without it (2-3 turns of 10). A turn is outstanding from
    the first step of its recording: each request goes upstream with every turn before it."""
    proxy: ProxyServer = make_proxy()
    big = "x" * 200_000  # over LARGE_BYTES: counted off the event loop
    upstream.responder = lambda body: {"content": f"answer {len(body['messages'])} {big}"}
    headers = {"Authorization": f"Bearer {KEY}", "X-Session-Id": "large-race",
               "X-Runloop-History": "server"}
    with httpx.Client(timeout=60, headers=headers) as c:
        for i in range(8):
            r = c.post(proxy.url + "/chat/completions", json={
                "model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"turn {i}"}]})
            assert r.status_code == 200, r.text[:300]
            sent = [m["role"] for m in upstream.requests[-1]["messages"]]
            assert sent == ["user", "assistant"] * i + ["user"], (i, sent)


def test_server_history_refuses_a_session_whose_turn_was_lost(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Finding (red team, second pass): a turn Redis refused past the retry time was given up
    like one written, and server history went on from what Redis held — the conversation
    without that turn, said nowhere. A session a write was given up for is refused with a
    409 saying what was lost and what to do, not served with a gap."""
    import redis

    server = RedisServer().start()
    try:
        proxy: ProxyServer = make_proxy(redis=server.url, store={"write_retry_s": 0.5})
        client = redis.Redis.from_url(server.url)
        headers = {"Authorization": f"Bearer {KEY}", "X-Session-Id": "gap",
                   "X-Runloop-History": "server"}

        def say(text: str) -> httpx.Response:
            return httpx.post(proxy.url + "/chat/completions", timeout=30, headers=headers,
                              json={"model": "gpt-4o-mini",
                                    "messages": [{"role": "user", "content": text}]})

        assert say("my name is Bob").status_code == 200
        proxy.settle()
        client.config_set("maxmemory", "1")
        assert say("I live in Oslo").status_code == 200  # its turn refused, then given up
        until(lambda: proxy.state.store.lost("pt-" + hashlib.sha256(KEY.encode())
                                             .hexdigest()[:16], "n:gap"),
              what="the refused turn given up")
        client.config_set("maxmemory", "0")
        seen = len(upstream.requests)
        r = say("where do I live?")
        assert r.status_code == 409, r.text
        assert "could not be stored" in r.json()["error"]["message"]
        assert len(upstream.requests) == seen  # nothing went upstream without the turn
        other = httpx.post(proxy.url + "/chat/completions", timeout=30, headers={
            **headers, "X-Session-Id": "fresh"}, json={
            "model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]})
        assert other.status_code == 200  # only that session
    finally:
        server.cleanup()
