"""Every key the proxy writes has the session's retention, however its request ends.

A sweep: one proxy on its own key prefix serves sessions over every write path (chat JSON and
streamed, with the proxy's tool rounds and compaction records, the Responses API, the
Messages API, server history, a fingerprinted session) and every way a request can end
(answered, refused by the proxy, refused by the upstream, cut mid-stream, the client gone,
served degraded while the store fails); then every key under the prefix must expire, within
the retention (nothing written is kept for good).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import redis

from runloop_proxy.pipeline.embeddings import EMBEDDED
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer
from .keys import anthropic_key, openai_project_key
from .test_supervised import _Raising
from .test_tools import CLIENT_TOOLS, long_session

OPENAI_KEY = openai_project_key(42)
ANTHROPIC_KEY = anthropic_key(42)
MODEL = "acme-coder-7b-2025-06-01"  # no window of its own: the 2,000 tokens set
CLAUDE = "claude-sonnet-4-6"
RETENTION_DAYS = 3.5


def _post(proxy: ProxyServer, path: str, body: dict[str, Any], session: str | None,
          key: str = OPENAI_KEY, **headers: str) -> httpx.Response:
    h = {"Authorization": f"Bearer {key}", "x-api-key": key, **headers}
    if session:
        h["X-Session-Id"] = session
    return httpx.post(proxy.url + path, headers=h, json=body, timeout=60)


def _every_way(proxy: ProxyServer, upstream: ScriptedUpstream) -> list[tuple[str, int]]:
    """Each way a request ends, over each write path; (what, status) of each."""
    seen: list[tuple[str, int]] = []
    big = long_session()  # compacted in a 2,000-token window: records, tool rounds

    def chat(what: str, session: str | None, messages: list[dict[str, Any]],
             **extra: Any) -> httpx.Response:
        r = _post(proxy, "/chat/completions",
                  {"model": MODEL, "messages": messages, "tools": CLIENT_TOOLS, **extra},
                  session)
        seen.append((what, r.status_code))
        return r

    upstream.push({"content": "the fix is in parse()"})
    chat("answered, JSON", "ttl-ok", big)
    upstream.push({"content": "streamed answer"})
    chat("answered, streamed", "ttl-ok-stream", big, stream=True)
    upstream.push({"content": "fingerprinted"})
    chat("answered, fingerprinted", None, big)
    upstream.push({"tool_calls": [{"name": "recall_tool_call",
                                   "arguments": {"call_id": "call_3"}}]},
                  {"content": "recalled and answered"})
    chat("the proxy's tool round", "ttl-rounds", big)
    tries = 1 + max(u.max_retries for u in proxy.state.config.upstreams.values())
    for status in (400, 429, 500):
        upstream.push(*[{"status": status}] * (1 if status == 400 else tries))  # retries too
        chat(f"refused by the upstream ({status})", f"ttl-up-{status}", big)
    upstream.push(*[{"status": 503}] * tries)
    chat("refused by the upstream, streamed", "ttl-up-stream", big, stream=True)
    for how in ("error", "drop", "end"):
        upstream.push({"content": "half of it " * 6, "cut": {"after": 3, "how": how}})
        chat(f"cut ({how})", f"ttl-cut-{how}", big, stream=True)
    huge = [{"role": "user", "content": " ".join(f"w{i}" for i in range(9000))}]
    chat("refused by the proxy (context)", "ttl-context", huge)
    chat("refused by the proxy (body)", "ttl-bad", [{"role": "nobody", "content": 1}])
    # the client goes away mid-answer
    upstream.push({"content": "slow " * 40, "chunk_delay": 0.05})
    with httpx.stream("POST", proxy.url + "/chat/completions", timeout=60, headers={
            "Authorization": f"Bearer {OPENAI_KEY}", "X-Session-Id": "ttl-gone"},
            json={"model": MODEL, "messages": big, "tools": CLIENT_TOOLS,
                  "stream": True}) as r:
        next(r.iter_bytes())
        seen.append(("client gone", r.status_code))
    # served degraded while every store command fails, then answered once it is back
    client = proxy.state.store.client
    client.execute_command = client.pipeline = _Raising(RuntimeError)
    try:
        upstream.push({"content": "degraded"})
        chat("fail-open", "ttl-degraded", big)
    finally:
        del client.execute_command, client.pipeline
    deadline = time.monotonic() + 20
    while not proxy.state.store.available and time.monotonic() < deadline:
        time.sleep(0.05)
    upstream.push({"content": "back"})
    chat("answered after fail-open", "ttl-degraded", big)
    # server history: appends
    for k in range(2):
        upstream.push({"content": f"server {k}"})
        r = _post(proxy, "/chat/completions", {"model": MODEL, "messages": [
            {"role": "user", "content": f"turn {k}"}]}, "ttl-server",
            **{"X-Runloop-History": "server"})
        seen.append(("server history", r.status_code))
    # the Responses API, and the Messages API
    upstream.push({"content": "responses answer"})
    r = _post(proxy, "/responses", {"model": MODEL, "input": "list the files"}, "ttl-resp")
    seen.append(("responses", r.status_code))
    upstream.push(*[{"status": 500}] * tries)
    r = _post(proxy, "/responses", {"model": MODEL, "input": "again", "stream": True},
              "ttl-resp-up")
    seen.append(("responses refused upstream", r.status_code))
    upstream.push({"content": "messages answer"})
    r = httpx.post(proxy.base + "/v1/messages", timeout=60, headers={
        "x-api-key": ANTHROPIC_KEY, "anthropic-version": "2023-06-01",
        "X-Session-Id": "ttl-msg"}, json={"model": CLAUDE, "max_tokens": 256, "messages": [
            {"role": "user", "content": "hello"}]})
    seen.append(("messages", r.status_code))
    upstream.push({"content": "cut", "cut": {"after": 4, "how": "error"}})
    r = httpx.post(proxy.base + "/v1/messages", timeout=60, headers={
        "x-api-key": ANTHROPIC_KEY, "anthropic-version": "2023-06-01",
        "X-Session-Id": "ttl-msg-cut"}, json={"model": CLAUDE, "max_tokens": 256,
                                              "stream": True, "messages": [
                                                  {"role": "user", "content": "hello"}]})
    seen.append(("messages cut", r.status_code))
    return seen


def test_every_key_the_proxy_writes_expires_whatever_its_request_did(
        make_proxy: Any, upstream: ScriptedUpstream, redis_url: str) -> None:
    """Bug class: a key written before the session's first sync (the proxy's compression
    records, its tool exchanges, summaries) took its time from the session's meta, and a
    request that never syncs (refused by the upstream, cut, refused by the proxy after its
    window was built) left it with none: one key per refused request, forever. Red with
    EXPIRE_WITH_SESSION_LUA leaving keys alone when the meta has no TTL (the compression
    records of every refused and cut request); a second bug of the class planted: the
    proxy's tool exchange (ADD_INTERNAL_LUA) taking the meta's time only."""
    proxy = make_proxy(context_window=2000, summary_model="extractive",
                       store={"retention_days": RETENTION_DAYS})
    seen = _every_way(proxy, upstream)
    statuses = {what: status for what, status in seen}
    assert statuses["answered, JSON"] == 200 and statuses["refused by the upstream (429)"] \
        == 429 and statuses["refused by the proxy (context)"] == 400
    assert statuses["fail-open"] == 200 and statuses["messages"] == 200
    proxy.settle(30)
    time.sleep(0.3)  # the records and anchors spawned after each answer
    prefix = proxy.state.config.store.key_prefix
    r = redis.Redis.from_url(redis_url)
    retention_ms = RETENTION_DAYS * 86_400_000
    # what the background writes beside a turn whose sync has not landed yet (or never
    # will): the proxy's tool exchange, a summary, a record
    store, ns, sid = proxy.state.store, "pt-unsynced", "n:ttl-unsynced"
    proxy.run(store.add_internal(ns, sid, "a" * 40, {"before": [], "after": []},
                                 RETENTION_DAYS))
    proxy.run(store.put_summary(ns, sid, "1:c0ffee", "late", RETENTION_DAYS))
    proxy.run(store.add_record(ns, sid, {"kind": "omission"}, RETENTION_DAYS))
    # long-term memory's segments and vectors, indexed behind an answer (red with the
    # block's key left out of put_vectors' expiry)
    proxy.run(store.put_vectors(ns, sid, EMBEDDED, ["0f3a9c2e71b4d865"], b"\x00" * 1040,
                                (1, "0f3a9c2e71b4d865"), RETENTION_DAYS))
    p = store.prefix(ns, sid)
    assert not r.exists(p + ":meta")
    assert all(0 < r.pttl(p + k) <= retention_ms for k in (":int", ":intk", ":sum", ":rec"))
    memory = [k for k in r.scan_iter(match=f"{p}:mem*")]
    assert len(memory) == 2 and all(0 < r.pttl(k) <= retention_ms for k in memory)
    keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
    assert len(keys) >= 30, keys  # the sweep did write, on many paths
    kinds = {k.decode().rsplit(":", 1)[-1] for k in keys}
    assert {"meta", "msg", "rec"} <= kinds, kinds
    forever = sorted(k.decode() for k in keys if r.pttl(k) == -1)
    assert not forever, f"keys with no TTL: {forever}"
    assert all(0 < r.pttl(k) <= retention_ms + 60_000 for k in keys if r.exists(k))
