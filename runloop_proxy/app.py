"""App factory and lifespan: clients, store and config are created once and shared through the
app state (state.py)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from .api.http import ClientGone, error_response, error_shape
from .api.routes import CONVERSATIONS, base_url_hint, routes
from .caches import SHARES, STORE_CACHES
from .config import ProxyConfig, Settings, load_config
from .environment import settings_from_env
from .errors import error_body
from .history.embedded import EmbeddedRedis
from .history.store import RedisStore
from .ops import logs
from .ops.gate import area, refusal
from .ops.metrics import Metrics
from .pipeline.tokens import TokenCounter
from .serving import tune_gc
from .state import AppState
from .tasks import forever

log = logs.get("app")


def create_app(settings: Settings, config: ProxyConfig | None = None,
               metrics: Metrics | None = None) -> FastPath:
    """Build the ASGI app. ``config`` is loaded from ``settings`` when not given."""
    config = config or load_config(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()  # its worker threads are the state's (resize)
        state = AppState(settings=settings, config=config, metrics=metrics or Metrics(),
                         tokens=TokenCounter(), loop=loop)
        app.state.runloop = state
        state.init_metrics()
        await state.warm_encodings(config)
        await state.sync_upstreams()
        redis_url = config.store.redis_url
        if not redis_url:
            state.embedded = EmbeddedRedis(settings.data_dir)
            # in this thread, not a worker's: the server is tied to its parent thread's life
            redis_url = state.embedded.start()
        budget = config.server.cache_mb << 20
        state.store = RedisStore(redis_url, config.store, state.metrics,
                                 {name: int(budget * SHARES[name])
                                  for name in STORE_CACHES})
        await state.store.start()
        await state.store.ping()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP,
                                    lambda: state.spawn(state.reload("SIGHUP")))
        watcher = asyncio.create_task(forever("watch_config", state.watch_config,
                                                state.background_failed)) \
            if settings.config_dir else None
        log.info("runloop-proxy ready", extra={
            "tenants": len(config.tenants), "passthrough": config.passthrough is not None})
        try:
            yield
        finally:
            if watcher:
                watcher.cancel()
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(signal.SIGHUP)
            if state.background:
                await asyncio.wait(set(state.background), timeout=5)
            for client in state.upstreams.values():
                await client.close()
            await state.store.close()
            if state.embedded:
                state.embedded.stop()
            logs.flush()  # a worker process ends without its atexit handlers

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        body = error_body(f"{request.method} {request.url.path}: {exc.detail}"
                          f"{base_url_hint(request.url.path) if exc.status_code == 404 else ''}",
                          "invalid_request_error", None,
                          "not_found" if exc.status_code == 404 else None)
        return error_response(request.url.path, exc.status_code, body, exc)

    return FastPath(Starlette(routes=routes(), lifespan=lifespan,
                              exception_handlers={HTTPException: http_error}))


class FastPath:
    """ASGI front. Every request under /admin passes the admin gate (``ops.gate``) first,
    before any route or handler. The conversation endpoints go straight to their handler
    (each answers its own errors), everything else (and the lifespan) through Starlette, whose
    routing and middleware cost a measurable share of a pass-through request. Every HTTP
    request counts as in flight until its response — a stream included — is over."""

    def __init__(self, app: Starlette):
        self.app = app
        self.state = app.state

    @staticmethod
    def refusal(path: str, status: int, message: str) -> bytes:
        """The body of a request the server refused before the app saw it (headers too
        large, too slow to arrive: ``serving.GuardedHttpTools``), in the path's API's error
        shape."""
        code = {408: "request_timeout", 431: "request_headers_too_large"}.get(status)
        body = error_body(message, "invalid_request_error", None, code)
        return orjson.dumps(error_shape(path)(status, body, None))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            once_v1(scope)
        if scope["type"] != "http":
            if scope["type"] == "websocket" and area(scope) is not None:
                # the admin area serves no websocket: refused before the router sees it
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)
            return
        if scope["path"] in PROBES:  # a scrape or a probe: not a request being served,
            await self.app(scope, receive, send)  # nor counted in the gauge it reads
            return
        in_flight = self.state.runloop.metrics.in_flight
        in_flight.inc()
        if area(scope) is not None:
            send = no_store(send)
        try:
            refused = await refusal(self.state.runloop, scope)
            if refused is not None:
                await refused(scope, receive, send)
                return
            handler = CONVERSATIONS.get(scope["path"]) if scope["method"] == "POST" else None
            if handler is None:
                await self.app(scope, receive, send)
                return
            scope["app"] = self.app
            try:
                response = await handler(Request(scope, receive))
            except ClientGone:
                return  # the upstream call was cancelled with the client; nobody to answer
            await response(scope, receive, send)
        finally:
            in_flight.dec()


DOUBLED = "/v1/v1"


def once_v1(scope: Scope) -> None:
    """A base URL given with ``/v1`` at its end where the client adds its own
    (``ANTHROPIC_BASE_URL=http://host/v1``: Claude Code then asks for ``/v1/v1/messages`` and
    reports an "issue with the selected model"): the path is read with one ``/v1``, for
    every API and route, before anything else sees it."""
    path = scope.get("path", "")
    if path == DOUBLED or path.startswith(DOUBLED + "/"):
        scope["path"] = path[3:]
        raw = scope.get("raw_path")
        if isinstance(raw, bytes) and raw.startswith(DOUBLED.encode()):
            scope["raw_path"] = raw[3:]


def no_store(send: Send) -> Send:
    """``send``, with every answer marked ``Cache-Control: no-store``: what is under /admin
    (whole conversations, tenants' keys' names, the login's pages and refusals) is kept by
    no browser or cache between the admin and the proxy."""
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", [])
                       if k.lower() not in (b"cache-control", b"pragma")]
            message = {**message, "headers": [*headers, (b"cache-control", b"no-store"),
                                              (b"pragma", b"no-cache")]}
        await send(message)
    return sending


PROBES = frozenset({"/metrics", "/healthz", "/readyz"})


def app_from_env() -> FastPath:
    """Factory for uvicorn worker processes (``serve --workers N``)."""
    settings = settings_from_env()
    logs.configure(settings.log_level, settings.log_format)
    app = create_app(settings)
    tune_gc()  # each worker is a server process of its own
    return app
