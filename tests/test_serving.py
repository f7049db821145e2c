"""The server's deadlines on what a client sends (serving.py), through a real proxy: a client
that dribbles its headers or its body, or sends headers without end, loses its connection
with a 408 (431), while everyone else is served."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from .distinct import Distinct

pytestmark = pytest.mark.slow



@pytest.fixture
def limits(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The server's limits for one test, drawn apart (``tests/distinct.py``): a header and a
    body deadline of one value could not show one armed in the other's place."""
    draw = Distinct(request.node.nodeid)
    return {"header_timeout_s": draw.seconds(0.4, 1.2), "body_timeout_s": draw.seconds(0.4, 1.2),
            "max_header_bytes": draw.size(4096, 6000)}


def _dribble(port: int, parts: list[bytes], gap: float, until: float) -> tuple[bytes, float]:
    """Send ``parts`` one every ``gap`` seconds (no longer than ``until``); what the server
    answered and when the connection closed (seconds after opening)."""
    started = time.monotonic()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(0.05)
    got = b""
    try:
        for part in parts:
            if time.monotonic() - started > until:
                break
            try:
                sock.sendall(part)
            except OSError:
                break
            deadline = time.monotonic() + gap
            while time.monotonic() < deadline:
                try:
                    chunk = sock.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    chunk = b""
                if not chunk:
                    return got, time.monotonic() - started
                got += chunk
        sock.settimeout(max(0.1, until - (time.monotonic() - started)))
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except (TimeoutError, OSError):
            pass
        return got, time.monotonic() - started
    finally:
        sock.close()


HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer sk-test\r\n")


@pytest.mark.parametrize("name, parts", [
    ("silent", [b""]),
    ("headers a byte at a time", [bytes([b]) for b in HEAD]),
    ("body a byte at a time", [HEAD + b"Content-Length: 500\r\n\r\n"] + [b"{"] * 500),
])
def test_a_slow_client_is_cut_off_and_told_why(make_proxy: Any, name: str,
                                                parts: list[bytes],
                                                limits: dict[str, Any]) -> None:
    proxy = make_proxy(server=limits)
    got, took = _dribble(proxy.port, parts, gap=0.1, until=6.0)
    assert took < 4.0, f"{name}: the connection was still open after {took:.1f} s"
    if name != "silent":
        assert got.startswith(b"HTTP/1.1 408 "), got[:200]
        assert b"request timeout" in got


def test_headers_without_end_are_refused(make_proxy: Any, limits: dict[str, Any]) -> None:
    proxy = make_proxy(server=limits)
    flood = [HEAD] + [b"X-Filler: " + b"a" * 1000 + b"\r\n"] * 20
    got, _ = _dribble(proxy.port, flood, gap=0.0, until=3.0)
    assert got.startswith(b"HTTP/1.1 431 "), got[:200]


def test_slow_clients_do_not_hold_up_the_others(make_proxy: Any, upstream: Any,
                                                 limits: dict[str, Any]) -> None:
    """Forty dribbling connections at once; a normal client is answered meanwhile, and once
    the deadline has passed none of the dribblers is still connected."""
    proxy = make_proxy(server=limits)
    results: list[float] = []

    def slow() -> None:
        results.append(_dribble(proxy.port, [bytes([b]) for b in HEAD], 0.2, 8.0)[1])

    threads = [threading.Thread(target=slow) for _ in range(40)]
    for t in threads:
        t.start()
    r = httpx.post(proxy.url + "/chat/completions", headers={"Authorization": "Bearer sk-a"},
                   json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
                   timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    for t in threads:
        t.join(15)
    assert len(results) == 40 and max(results) < 4.0, sorted(results)[-3:]


def test_a_kept_alive_connection_serves_its_next_request(make_proxy: Any,
                                                         limits: dict[str, Any]) -> None:
    """The deadlines are per request: a client that sends its requests promptly on one
    connection is served each time, however long the connection lives."""
    proxy = make_proxy(server=limits)
    with httpx.Client(base_url=proxy.base, timeout=5) as client:
        for _ in range(4):
            assert client.get("/healthz").json() == {"status": "ok"}
            time.sleep(0.3)  # under keep_alive_s, above nothing: the deadline is re-armed


def test_a_header_block_too_large_is_refused_before_the_app_sees_it(
        limits: dict[str, Any]) -> None:
    """A header block over the limit that arrives in one read was parsed whole, handed to the
    app (its work done: 5,000 credential headers stalled every request for a second) and only
    then answered 431. The refusal comes before the request is dispatched: under the
    proxy's server, an app that notes every request it is given never sees it, and the
    connection's next bytes are not read as a request."""
    from runloop_proxy.config import ServerSection
    from runloop_proxy.scripted import ThreadedServer

    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    server = ThreadedServer(app, lifespan="off", server=ServerSection(**limits))
    port = server.start()
    try:
        body = b'{"model": "m"}'
        block = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 + b"".join(b"X-Api-Key-%d: k%d\r\n" % (i, i) for i in range(400))
                 + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert len(block) > limits["max_header_bytes"]
        got, _ = _dribble(port, [block], gap=0.0, until=3.0)
        assert got.startswith(b"HTTP/1.1 431 "), got[:200]
        assert got.count(b"HTTP/1.1") == 1
        time.sleep(0.2)
        assert seen == []
        assert httpx.get(f"http://127.0.0.1:{port}/next", timeout=10).text == "ok"
        assert seen == ["/next"]
    finally:
        server.stop()


def _refusal_json(got: bytes) -> tuple[int, dict[str, str], Any]:
    """A raw HTTP answer's status, headers and JSON body."""
    import orjson

    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, orjson.loads(body)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages",
                                  "/v1/messages/count_tokens", "/v1/embeddings"])
@pytest.mark.parametrize("refusal", ["headers too large", "too slow"])
def test_a_refusal_is_an_error_in_the_paths_api_shape(make_proxy: Any, path: str,
                                                      refusal: str,
                                                      limits: dict[str, Any]) -> None:
    """Finding (red team): a request refused before the app saw it (431: headers over the
    limit; 408: too slow to arrive) was answered in plain text on every path, where every
    other error a client of that API gets is its API's JSON (OpenAI's, or Anthropic's on
    /v1/messages), which its SDK reads. One rule for both: the app's (``FastPath.refusal``,
    the path's shape as ``api.http.error_shape`` has it)."""
    proxy = make_proxy(server=limits)
    head = HEAD.replace(b"/v1/chat/completions", path.encode())
    if refusal == "headers too large":
        got, _ = _dribble(proxy.port, [head] + [b"X-Filler: " + b"a" * 1000 + b"\r\n"] * 20,
                          gap=0.0, until=3.0)
        status = 431
    else:
        got, _ = _dribble(proxy.port, [head + b"Content-Length: 50\r\n\r\n"] + [b"{"] * 50,
                          gap=0.1, until=6.0)
        status = 408
    code, headers, body = _refusal_json(got)
    assert code == status and headers["content-type"] == "application/json", got[:300]
    if path.startswith("/v1/messages"):
        assert body["type"] == "error", body
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    else:
        assert body["error"]["type"] == "invalid_request_error", body
        assert body["error"]["code"] == {431: "request_headers_too_large",
                                         408: "request_timeout"}[status]


class _Transport(asyncio.Transport):
    """What the protocol writes, and whether it closed: a connection without a socket."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50_123), "sockname": ("127.0.0.1", 8_123)}.get(
            name, default)

    def write(self, data: Any) -> None:
        self.written += bytes(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _Timers:
    """The event loop, with every timer the protocol arms written down (its delay, in order)
    and never started by the clock: a test fires one when it chooses."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.armed: list[tuple[float, asyncio.TimerHandle]] = []

    def call_later(self, delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        handle = asyncio.TimerHandle(self.loop.time() + 3600, callback, args, self.loop)
        self.armed.append((delay, handle))
        return handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loop, name)


def _protocol(limits: dict[str, Any], seen: list[str]) -> tuple[Any, _Timers, _Transport]:
    """The proxy's protocol on one connection, its app noting every request it is given."""
    from uvicorn.server import ServerState

    from runloop_proxy.config import ServerSection
    from runloop_proxy.serving import GuardedHttpTools, server_config

    class App:
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            seen.append(scope["path"])
            while (await receive())["more_body"] if scope["method"] == "POST" else False:
                pass
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        @staticmethod
        def refusal(path: str, status: int, message: str) -> bytes:
            return b'{"path": "%s", "status": %d}' % (path.encode(), status)

    config = server_config(App(), ServerSection(**limits), lifespan="off")
    timers = _Timers(asyncio.get_running_loop())
    proto = GuardedHttpTools(config, ServerState(), {}, _loop=timers)
    transport = _Transport()
    proto.connection_made(transport)
    return proto, timers, transport


def _live(timers: _Timers) -> list[float]:
    """The delays of the timers armed and not cancelled, in the order they were armed."""
    return [delay for delay, handle in timers.armed if not handle.cancelled()]


def test_each_deadline_is_armed_with_its_own_setting(limits: dict[str, Any]) -> None:
    """The header deadline is armed with ``header_timeout_s`` when the connection opens and
    again when a kept-alive connection's next request begins, the body deadline with
    ``body_timeout_s`` when the headers end, and the one that fires answers 408. Timers are
    written down, not waited for: the values are asserted exactly, on any machine.

    Bug class: a deadline armed from the wrong setting (invisible while both settings were
    0.6). Planted: the body deadline armed with ``header_timeout``; the header deadline of a
    kept-alive connection's next request armed with ``body_timeout``."""
    header, body = limits["header_timeout_s"], limits["body_timeout_s"]

    async def main() -> None:
        seen: list[str] = []
        proto, timers, transport = _protocol(limits, seen)
        assert _live(timers) == [header]
        proto.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                            b"Content-Length: 11\r\n\r\n")
        assert _live(timers) == [body]  # the header deadline gone, the body's armed
        proto.data_received(b'{"model": 1')
        assert _live(timers) == []
        for _ in range(50):
            await asyncio.sleep(0)
        assert seen == ["/v1/chat/completions"] and transport.written.startswith(
            b"HTTP/1.1 200 ")
        proto.data_received(b"GET /healthz HTTP/1.1\r\n")  # the next request, half sent
        assert _live(timers)[-1:] == [header]
        timers.armed[-1][1]._run()  # its deadline passes
        got = transport.written.split(b"HTTP/1.1 ")[-1]
        assert got.startswith(b"408 ") and transport.closed, got
        assert seen == ["/v1/chat/completions"]
        proto.connection_lost(None)

    asyncio.run(main())


@pytest.mark.parametrize("over", [0, 1])
def test_the_header_bound_holds_at_its_exact_value(limits: dict[str, Any], over: int) -> None:
    """A header block of exactly ``max_header_bytes`` (the URL and each header's name, value
    and its 4 bytes of framing) is served; one byte more is a 431 before the app sees it.

    Bug class: a bound off at its boundary. Planted: ``>=`` for ``>`` in
    ``on_headers_complete`` (the exact size refused); the framing counted as 2 bytes a header
    (a block 2 bytes a header over the bound served)."""
    bound = limits["max_header_bytes"]

    async def main() -> None:
        seen: list[str] = []
        proto, timers, transport = _protocol(limits, seen)
        url = b"/v1/models"
        fixed = [(b"Host", b"proxy.internal"), (b"Authorization", b"Bearer " + b"k" * 164)]
        used = len(url) + sum(len(n) + len(v) + 4 for n, v in fixed)
        filler = bound + over - used - len(b"X-Filler") - 4
        headers = fixed + [(b"X-Filler", b"f" * filler)]
        assert len(url) + sum(len(n) + len(v) + 4 for n, v in headers) == bound + over
        proto.data_received(b"GET " + url + b" HTTP/1.1\r\n" + b"".join(
            n + b": " + v + b"\r\n" for n, v in headers) + b"\r\n")
        for _ in range(50):
            await asyncio.sleep(0)
        if over:
            assert transport.written.startswith(b"HTTP/1.1 431 ") and seen == []
        else:
            assert transport.written.startswith(b"HTTP/1.1 200 ") and seen == ["/v1/models"]
        proto.connection_lost(None)

    asyncio.run(main())


def test_each_request_on_a_kept_alive_connection_has_the_whole_header_bound(
        limits: dict[str, Any]) -> None:
    """The header bound is per request: on one kept-alive connection, three requests whose
    header blocks each take 60% of ``max_header_bytes`` are all served (their sizes do not
    add up), and a fourth over the bound alone is refused.

    Bug class: per-request state carried across a connection's requests. Planted: the
    header count not reset when a request begins (the second one refused); the target
    (the path a refusal is shaped by) not reset (the refusal shaped by the earlier
    requests' paths run together)."""
    bound = limits["max_header_bytes"]

    async def main() -> None:
        seen: list[str] = []
        proto, _, transport = _protocol(limits, seen)
        for k in range(3):
            url = f"/v1/models/gpt-4o-2024-08-06-{k}".encode()
            filler = int(bound * 0.6) - len(url) - len(b"X-Filler") - 4
            proto.data_received(b"GET " + url + b" HTTP/1.1\r\nX-Filler: " + b"f" * filler
                                + b"\r\n\r\n")
            for _ in range(50):
                await asyncio.sleep(0)
            assert len(seen) == k + 1, (k, transport.written[-300:])
        assert transport.written.count(b"HTTP/1.1 200 ") == 3 and not transport.closed
        proto.data_received(b"GET /v1/messages HTTP/1.1\r\nX-Filler: " + b"f" * bound
                            + b"\r\n\r\n")
        for _ in range(50):
            await asyncio.sleep(0)
        refusal = transport.written.split(b"HTTP/1.1 ")[-1]
        assert refusal.startswith(b"431 ") and len(seen) == 3
        assert refusal.endswith(b'{"path": "/v1/messages", "status": 431}'), refusal[-200:]
        proto.connection_lost(None)

    asyncio.run(main())
