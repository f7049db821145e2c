"""The HTTP server the proxy runs under: uvicorn, with deadlines on what a client sends.

uvicorn times out only idle keep-alive connections: a client that opens a connection and
sends its headers (or its body) a byte at a time holds a connection, a parser and a task
forever, and a few hundred of them exhaust a process. ``GuardedHttpTools`` gives every
request a deadline for its headers (from its first byte, or from the connection's opening)
and one for its body (from the end of the headers), and bounds the bytes of its headers; a
request past a deadline gets a 408 (431 for headers too large) and its connection closed.
The CLI, the worker processes and the tests all build their server with ``server_config``.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import socket
import threading
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .config import ServerSection
from .errors import ABORTED
from .ops import logs


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with header and body deadlines and a header size bound.
    The limits are read from the uvicorn config (``server_config`` puts them there), so the
    class itself is picklable for ``--workers``."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)
        self.header_timeout: float = getattr(config, "runloop_header_timeout", 10.0)
        self.body_timeout: float = getattr(config, "runloop_body_timeout", 60.0)
        self.max_header_bytes: int = getattr(config, "runloop_max_header_bytes", 65_536)
        self._deadline: asyncio.TimerHandle | None = None
        self._header_bytes = 0  # of the request being read: its URL and header lines
        self._target = b""  # the request's URL, as far as read (what its refusal is shaped by)
        self._refused = False  # the request being read was answered before the app saw it

    # -- deadlines ------------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        self._refuse(408, "request timeout: the request was not received in time")

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` if nothing was answered on this request yet, then close."""
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:
            reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
            kind, body = self._refusal(status, message)
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                % (status, reason, kind, len(body), body))
            if cycle is not None and not cycle.response_complete:
                cycle.response_complete = True  # the app's answer, if any, has no one to go to
                cycle.disconnected = True
                cycle.message_event.set()
        self.transport.close()

    def _refusal(self, status: int, message: str) -> tuple[bytes, bytes]:
        """A refusal's content type and body: in the shape of the API the request's path
        is (JSON, as every other error a client of it gets) when the app says how
        (``refusal(path, status, message)``, on it or an app it wraps), else text."""
        app = self.app
        for _ in range(4):  # uvicorn wraps the app (its proxy-headers middleware)
            render = getattr(app, "refusal", None)
            if callable(render):
                path = self._target.split(b"?", 1)[0].decode("latin-1")
                return b"application/json", render(path, status, message)
            app = getattr(app, "app", None)
        return b"text/plain; charset=utf-8", message.encode()

    # -- uvicorn's callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_bytes > self.max_header_bytes:
            self._refuse(431, "request headers too large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._target = b""
        self._refused = False
        if self._deadline is None:
            self._arm(self.header_timeout)

    def on_url(self, url: bytes) -> None:
        self._header_bytes += len(url)
        if len(self._target) < 4096:
            self._target += url[:4096 - len(self._target)]
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value) + 4
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._header_bytes > self.max_header_bytes:
            # refused before the app is given the request: a header block that came in one
            # read would otherwise be served (its work done) and only then answered 431
            self._refused = True
            self._refuse(431, "request headers too large")
            return
        self._arm(self.body_timeout)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()  # a WebSocket's upgrade too: the connection is no request's after it
        if not self._refused:
            super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timeout for an idle wait


class _DenialIsAnAnswer(logging.Filter):
    """uvicorn's WebSocket protocol logs an error for every upgrade the app refused with an
    HTTP answer (``websocket.http.response``: a bad key, the socket turned off), the
    handshake never being complete: an answer given, not an app that failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing handshake."


_DENIAL_FILTER = _DenialIsAnAnswer()


def server_config(app: Any, server: ServerSection, host: str | None = None,
                  port: int | None = None, **kwargs: Any) -> uvicorn.Config:
    """The uvicorn config every runloop-proxy server runs with (the CLI, its workers, the
    tests): the guarded protocol and its limits from ``server``."""
    logging.getLogger("uvicorn.error").addFilter(_DENIAL_FILTER)  # once: a set of filters
    config = uvicorn.Config(app, host=host if host is not None else server.host,
                            port=port if port is not None else server.port,
                            http=GuardedHttpTools, timeout_keep_alive=server.keep_alive_s,
                            ws_max_size=server.max_body_bytes,
                            log_level=kwargs.pop("log_level", "warning"),
                            access_log=False, **kwargs)
    config.runloop_header_timeout = server.header_timeout_s  # type: ignore[attr-defined]
    config.runloop_body_timeout = server.body_timeout_s  # type: ignore[attr-defined]
    config.runloop_max_header_bytes = server.max_header_bytes  # type: ignore[attr-defined]
    return config


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening, as uvicorn binds one (``OSError`` when it
    cannot be): bound before the server starts, so that a busy port is said before anything
    else happens, and the address is known when the server says it is ready."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)  # for the worker processes
    return sock


def address(sock: socket.socket) -> str:
    """The ``http://`` address a listening socket answers on."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


READY_POLL_S = 0.2  # how often serve asks its own /healthz until it answers


def ready_lines(url: str, admin: bool) -> list[str]:
    """What ``serve`` prints once it answers: the base URLs to give clients (an address on
    every interface is given as the loopback one, with a note), and the inspector's."""
    base = loopback(url)
    note = " (listening on every interface: from elsewhere, this machine's address)" \
        if base != url else ""
    inspector = f"{base}/admin/ui  (log in with the admin key)" if admin else \
        "off: no admin key (--admin-key, RUNLOOP_ADMIN_KEY or server.admin_key)"
    return [f"runloop-proxy is ready at {base}{note}",
            f"  OpenAI clients:    base URL {base}/v1",
            f"  Anthropic clients: base URL {base}",
            f"  inspector:         {inspector}"]


def loopback(url: str) -> str:
    """An address on every interface as the loopback one (what a local client dials)."""
    for anywhere in ("http://0.0.0.0:", "http://[::]:"):
        if url.startswith(anywhere):
            return "http://127.0.0.1:" + url[len(anywhere):]
    return url


def announce_when_ready(url: str, lines: list[str]) -> threading.Thread:
    """Print ``lines`` to stdout once ``url``/healthz answers (every worker started, the app's
    startup done), from a daemon thread; nothing if the server stops first."""
    def wait() -> None:
        import httpx

        while True:
            try:
                if httpx.get(loopback(url) + "/healthz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(READY_POLL_S)
        print("\n".join(lines), flush=True)

    thread = threading.Thread(target=wait, name="announce-ready", daemon=True)
    thread.start()
    return thread


def cannot_listen(host: str, port: int, exc: OSError) -> str:
    """What to tell a user whose server could not listen (one line)."""
    if exc.errno == errno.EADDRINUSE:
        return f"port {port} is in use (try --port N)"
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}"


# A large request keeps some 10^5 objects alive while a worker thread works on it. With
# CPython's default thresholds (700, 10, 10) its allocations start full collections, each
# scanning every live object while holding the GIL: the event loop stood still 30 to 50 ms
# at a time (bench/hostile.py), whichever thread allocated. What the process holds once
# started (modules, config, encodings) is frozen out of every collection, and collections
# run less often: young ones every 10,000 allocations, a full one at most every 20 x 10
# young ones (CPython also waits for the long-lived objects to grow by a quarter). Nothing
# the proxy makes per request relies on the collector: its garbage is freed by reference
# counts; cycles (an exception's traceback) are still collected.
GC_THRESHOLDS = (10_000, 20, 10)


def tune_gc() -> None:
    """The collector set for a server process (above): called once it has loaded."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class StoppingServer(uvicorn.Server):
    """uvicorn's server, saying what a stop does. A first Ctrl-C (or SIGTERM) stops taking
    requests and waits for those in flight, saying how many; a second Ctrl-C aborts them:
    each is answered a 503 in its API's shape (a stream already started is cut), one log line
    says so, and the app still closes what it holds — where uvicorn alone cancelled them into
    tracebacks and a plain-text 500."""

    _loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        busy = len(self.server_state.tasks)
        if first:
            logs.get("serve").info(f"shutting down: {busy} request(s) in flight"
                        + (" (Ctrl-C again to abort them)" if busy else ""))
        elif self.force_exit and self._loop is not None:
            logs.get("serve").warning(f"aborting {busy} request(s) in flight")
            for task in list(self.server_state.tasks):
                self._loop.call_soon_threadsafe(task.cancel, ABORTED)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:  # uvicorn skips the app's own shutdown then: it closes its
            await self.lifespan.shutdown()  # clients and its history writes all the same


def run(config: uvicorn.Config, sock: socket.socket) -> None:
    """``uvicorn.run`` for a config built here, on a socket from ``listen``, with its worker
    processes when it has them (each tunes its collector: ``tune_gc``)."""
    tune_gc()
    server = StoppingServer(config)
    try:
        if config.workers > 1:
            from uvicorn.supervisors import Multiprocess

            Multiprocess(config, sockets=[sock]).run()
        else:
            server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
