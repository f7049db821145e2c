"""The embedded Redis as proxies on one data dir meet it: each real ``serve`` processes, with
no Redis URL, sharing the server the first one started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from runloop_proxy.history.embedded import find_redis_server
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import free_port, until

ADMIN = "admin-0123456789abcdef"


class Serve:
    """``runloop-proxy serve`` on the embedded Redis, in a process of its own."""

    def __init__(self, upstream: ScriptedUpstream, data_dir: Path):
        self.port = free_port()
        env = {k: v for k, v in os.environ.items()
               if k != "REDIS_URL" and not k.startswith("RUNLOOP_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runloop_proxy", "serve", "--upstream", upstream.url,
             "--port", str(self.port), "--data-dir", str(data_dir), "--admin-key", ADMIN,
             "--log-format", "text"], env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        until(self.ready, timeout=60, what="serve to be ready")

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        assert self.proc.poll() is None, self.proc.communicate()[1]
        try:
            return httpx.get(self.base + "/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.communicate(timeout=30)[1]


@pytest.fixture
def serve(upstream: ScriptedUpstream, tmp_path: Path) -> Iterator[list[Serve]]:
    if find_redis_server() is None:
        pytest.skip("no redis-server binary on this machine")
    started: list[Serve] = []
    yield started
    for s in started:
        s.stop()


def test_a_proxy_keeps_the_embedded_redis_another_one_started(
        serve: list[Serve], upstream: ScriptedUpstream, tmp_path: Path) -> None:
    first = Serve(upstream, tmp_path)
    serve.append(first)
    second = Serve(upstream, tmp_path)
    serve.append(second)
    c = httpx.Client(base_url=second.base + "/v1", headers={"Authorization": "Bearer sk-t",
                                                            "X-Session-Id": "kept"})
    msgs = [{"role": "user", "content": "first"}]
    reply = c.post("/chat/completions", json={"model": "m", "messages": msgs}).json()
    admin = {"Authorization": f"Bearer {ADMIN}"}

    def stored() -> list[str]:
        view = httpx.get(second.base + "/admin/sessions/kept", headers=admin,
                         params={"messages": "1"})
        return [m["content"] for m in view.json().get("messages", [])] \
            if view.status_code == 200 else []
    until(lambda: stored() == ["first", "echo: first"], what="the first turn stored")

    assert "embedded redis started" in first.stop()  # it started the server, and stopped it
    until(second.ready, timeout=10, what="the second proxy ready again")
    # the server it started again reads the same data: the turn is still there, in Redis
    sock = tmp_path.resolve() / "redis" / "redis.sock"
    keys = redis.Redis(unix_socket_path=str(sock)).keys("*kept*")
    assert keys, "the stored session is gone from Redis"
    msgs += [reply["choices"][0]["message"], {"role": "user", "content": "second"}]
    r = c.post("/chat/completions", json={"model": "m", "messages": msgs})
    assert r.status_code == 200 and "x-runloop-degraded" not in r.headers
    until(lambda: stored() == ["first", "echo: first", "second", "echo: second"],
          what="the second turn stored")
    # and it keeps doing so: the server it started is its own to stop
    log = second.stop()
    assert "started it again" in log, log
    assert not sock.exists()
