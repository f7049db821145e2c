"""Shared fixtures: a real Redis, a scripted upstream and the proxy, each a real server."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from runloop_proxy.app import create_app
from runloop_proxy.config import Policy, ProxyConfig, Settings, load_config
from runloop_proxy.history.embedded import find_redis_server
from runloop_proxy.ops import logs
from runloop_proxy.ops.metrics import Metrics
from runloop_proxy.scripted import ScriptedUpstream, ThreadedServer


@pytest.fixture(autouse=True)
def _tracer_put_back() -> Iterator[None]:
    """Every test leaves the tracer as it found it (this thread's and the one new threads
    get): coverage measures through it, and a test that sets its own and then
    ``sys.settrace(None)`` switches coverage off for every test after it, so the floor
    measures less than what runs. Count lines with ``tests.work.lines``, which puts the
    previous tracer back."""
    before = sys.gettrace(), threading.gettrace()
    yield
    after = sys.gettrace(), threading.gettrace()
    assert after[0] is before[0], f"the test left sys.settrace at {after[0]!r}, not {before[0]!r}"
    assert after[1] is before[1], \
        f"the test left threading.settrace at {after[1]!r}, not {before[1]!r}"


@pytest.fixture(autouse=True)
def _logging_put_back() -> Iterator[None]:
    """Every test leaves the ``runloop`` loggers as it found them: a test that runs
    ``serve`` in this process configures them (info, to stderr), and every in-process proxy
    after it then logged a line per window step, which the event-loop bounds counted."""
    root = logging.getLogger(logs.LOGGER)
    was = root.level, list(root.handlers), root.propagate
    yield
    logs.flush()
    root.level, root.handlers[:], root.propagate = was


@contextlib.contextmanager
def logged_as_served(stream: Any, fmt: str = "json") -> Iterator[None]:
    """The ``runloop`` loggers as ``serve`` sets them (info, ``fmt`` lines through their
    writer thread), written to ``stream``; every line written when the block ends."""
    logs.configure("info", fmt)
    handler = logs.stream_handler()
    assert handler is not None
    handler.setStream(stream)
    try:
        yield
    finally:
        logs.flush()


def until(cond: Any, timeout: float = 10, what: str = "the condition") -> float:
    """Poll ``cond`` until it holds; the seconds it took. At the deadline the test fails,
    saying what did not happen (a wait never passes silently)."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} did not happen within {timeout}s")
        time.sleep(0.02)
    return time.monotonic() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve_command(upstream_url: str, redis_url: str, data_dir: Path, flags: list[str],
                  env: dict[str, str]) -> Iterator[tuple[str, list[str], subprocess.Popen[bytes]]]:
    """``runloop-proxy serve`` as a user starts it, in a process of its own, once it answers
    /healthz: its base URL, the arguments it was started with and the process (a test may
    kill it). Stopped with Ctrl-C (SIGINT) after, unless it has ended."""
    port = free_port()
    args = ["serve", "--upstream", upstream_url, "--redis-url", redis_url, "--port", str(port),
            "--data-dir", str(data_dir), "--log-level", "warning", *flags]
    proc = subprocess.Popen([sys.executable, "-m", "runloop_proxy", *args],
                            env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(base + "/healthz").status_code == 200
        except httpx.HTTPError:
            return False
    try:
        until(up, timeout=60, what="serve to answer")
        yield base, args, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        proc.wait(30)


def free_cluster_port() -> int:
    """A port whose cluster bus port (port + 10000) is free and valid too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """A private redis-server on a free loopback port (tests that restart or kill it)."""

    def __init__(self, *extra: str, port: int | None = None, data_dir: str | None = None):
        binary = find_redis_server()
        if binary is None:
            pytest.skip("no redis-server binary on this machine")
        self.binary = binary
        self.port = port or free_port()
        self.dir = data_dir or tempfile.mkdtemp(prefix="rl-redis-")
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """REDIS_URL when given, else a redis-server the tests start themselves."""
    given = os.environ.get("REDIS_URL")
    if given:
        yield given
        return
    server = RedisServer().start()
    yield server.url
    server.cleanup()


@pytest.fixture(scope="session")
def upstream_server() -> Iterator[ScriptedUpstream]:
    up = ScriptedUpstream().start()
    yield up
    up.stop()


@pytest.fixture
def upstream(upstream_server: ScriptedUpstream) -> ScriptedUpstream:
    upstream_server.reset()
    return upstream_server


class ProxyServer:
    """runloop-proxy under a real uvicorn server on a loopback port, in a thread."""

    def __init__(self, settings: Settings, config: ProxyConfig | None = None):
        self.settings = settings
        self.config = config
        self.metrics = Metrics()
        self.app = create_app(settings, config, metrics=self.metrics)
        self.server: ThreadedServer | None = None
        self.port = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return self.base + "/v1"

    @property
    def state(self) -> Any:
        return self.app.state.runloop

    def run(self, coro: Any, timeout: float = 10) -> Any:
        """Run a coroutine on the proxy's own event loop (its store lives there)."""
        return asyncio.run_coroutine_threadsafe(coro, self.state.loop).result(timeout=timeout)

    def settle(self, timeout: float = 10) -> None:
        """Wait until the write-behind queue has reached Redis; fail if it does not."""
        assert self.run(self.state.store.drain(timeout), timeout + 5), \
            "the write-behind queue did not drain"

    def quiet(self, timeout: float = 30) -> None:
        """Wait until what the proxy runs behind its answers (summaries, their records,
        dates) has ended and the write-behind queue has reached Redis."""
        until(lambda: not self.state.background, timeout, "the background work's end")
        self.settle()

    def start(self) -> ProxyServer:
        config = self.config or load_config(self.settings)
        self.server = ThreadedServer(self.app, server=config.server)
        self.port = self.server.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def unique_config(settings: Settings, server: dict[str, Any] | None = None,
                  policy: dict[str, Any] | None = None, **store: Any) -> ProxyConfig:
    """``settings``' config on a key prefix of its own; ``policy``'s fields over the
    pass-through tenant's (``tests.policies.MECHANISM`` for a test of a lever's mechanics)."""
    config = load_config(settings)
    prefix = "t" + uuid.uuid4().hex[:10]
    passthrough = config.passthrough
    if policy and passthrough is not None:
        passthrough = passthrough.model_copy(update={"policy": Policy.model_validate(
            {**passthrough.policy.model_dump(), **policy})})
    return dataclasses.replace(
        config, store=config.store.model_copy(update={"key_prefix": prefix, **store}),
        server=config.server.model_copy(update=server or {}), passthrough=passthrough)


@pytest.fixture
def make_proxy(upstream: ScriptedUpstream, redis_url: str, tmp_path: Path) -> Iterator[Any]:
    started: list[ProxyServer] = []

    def make(config_dir: str | None = None, redis: str | None = None, **kw: Any) -> ProxyServer:
        store_kw = kw.pop("store", {})
        server_kw = kw.pop("server", {})
        policy = kw.pop("policy", None)
        url = kw.pop("upstream_url", None)  # another upstream than the scripted one
        settings = Settings(upstream=None if config_dir else url or upstream.url,
                            config_dir=config_dir, redis_url=redis or redis_url,
                            data_dir=str(tmp_path / "data"), **kw)
        proxy = ProxyServer(settings,
                            unique_config(settings, server_kw, policy, **store_kw)).start()
        started.append(proxy)
        return proxy

    yield make
    for p in started:
        p.stop()


@pytest.fixture
def proxy(make_proxy: Any) -> ProxyServer:
    return make_proxy()  # type: ignore[no-any-return]
