"""App factory and lifespan: clients, store and config are created once and shared via state."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from . import logs
from .config import ProxyConfig, Settings, config_mtimes, load_config
from .embedded import EmbeddedRedis
from .errors import ConfigError, error_bytes
from .metrics import Metrics
from .routes import CHAT_PATH, ClientGone, chat_completions, routes
from .store import RedisStore
from .tokens import WARM_ENCODINGS, TokenCounter, encoding_name_for
from .upstream import UpstreamClient

log = logs.get("app")
RELOAD_POLL_S = 2.0


@dataclass
class AppState:
    settings: Settings
    config: ProxyConfig
    metrics: Metrics
    tokens: TokenCounter
    upstreams: dict[str, UpstreamClient] = field(default_factory=dict)
    store: RedisStore | None = None
    embedded: EmbeddedRedis | None = None
    background: set[asyncio.Task[object]] = field(default_factory=set)
    truncations: OrderedDict[tuple[str, int], str] = field(default_factory=OrderedDict)
    first_seen: OrderedDict[str, int] = field(default_factory=OrderedDict)
    window_memo: dict[tuple[str, ...], Any] = field(default_factory=dict)

    def spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        """Run work off the request path; keep a reference so it is not collected mid-flight."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def sync_upstreams(self) -> None:
        old = self.upstreams
        new: dict[str, UpstreamClient] = {}
        for name, spec in self.config.upstreams.items():
            client = old.get(name)
            if client is None or client.spec != spec:
                client = UpstreamClient(name, spec)
                await client.start()
            new[name] = client
        self.upstreams = new
        stale = [c for n, c in old.items() if new.get(n) is not c]
        if stale:
            # In-flight requests still hold the old clients: close them once those are done.
            self.spawn(_close_later(stale))

    async def warm_encodings(self, config: ProxyConfig) -> None:
        """Load the encodings the config's models use now, bounded in time, never on a
        request (tiktoken fetches what is not shipped offline)."""
        await asyncio.get_running_loop().run_in_executor(
            None, self.tokens.warm, [*WARM_ENCODINGS, *_configured_encodings(config)])

    async def reload(self, reason: str) -> bool:
        try:
            config = load_config(self.settings)
        except ConfigError as exc:
            self.metrics.config_reloads.labels("error").inc()
            log.error("config reload failed; keeping the last good config",
                      extra={"reason": reason, "error": str(exc)})
            return False
        await self.warm_encodings(config)
        self.config = config
        await self.sync_upstreams()
        self.metrics.config_reloads.labels("ok").inc()
        log.info("config reloaded", extra={"reason": reason, "tenants": len(config.tenants)})
        return True


async def _close_later(clients: list[UpstreamClient], delay: float = 60.0) -> None:
    await asyncio.sleep(delay)
    for c in clients:
        await c.close()


def _configured_encodings(config: ProxyConfig) -> list[str]:
    tenants = [*config.tenants.values(), *([config.passthrough] if config.passthrough else [])]
    names = (spec.encoding or encoding_name_for(model)
             for t in tenants for model, spec in t.models.items())
    return sorted({n for n in names if n})


async def _watch_config(state: AppState) -> None:
    seen = config_mtimes(state.settings.config_dir)
    while True:
        await asyncio.sleep(RELOAD_POLL_S)
        now = config_mtimes(state.settings.config_dir)
        if now != seen:
            seen = now
            await state.reload("file change")


def create_app(settings: Settings, config: ProxyConfig | None = None,
               metrics: Metrics | None = None) -> FastChatPath:
    """Build the ASGI app. ``config`` is loaded from ``settings`` when not given."""
    config = config or load_config(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state = AppState(settings=settings, config=config, metrics=metrics or Metrics(),
                         tokens=TokenCounter())
        app.state.runloop = state
        await state.warm_encodings(config)
        await state.sync_upstreams()
        redis_url = config.store.redis_url
        if not redis_url:
            state.embedded = EmbeddedRedis(settings.data_dir)
            # in this thread, not a worker's: the server is tied to its parent thread's life
            redis_url = state.embedded.start()
        state.store = RedisStore(redis_url, config.store, state.metrics)
        await state.store.start()
        await state.store.ping()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP,
                                    lambda: state.spawn(state.reload("SIGHUP")))
        watcher = asyncio.create_task(_watch_config(state)) if settings.config_dir else None
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

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        body = error_bytes(f"{request.method} {request.url.path}: {exc.detail}",
                           "invalid_request_error", None,
                           "not_found" if exc.status_code == 404 else None)
        return Response(body, exc.status_code, media_type="application/json")

    return FastChatPath(Starlette(routes=routes(), lifespan=lifespan,
                                  exception_handlers={HTTPException: http_error}))


class FastChatPath:
    """ASGI front: chat completions go straight to their handler, everything else (and the
    lifespan) through Starlette. Starlette's middleware stack costs a measurable share of a
    pass-through request; this route handles its own errors (routes.openai_errors)."""

    def __init__(self, app: Starlette):
        self.app = app
        self.state = app.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == CHAT_PATH \
                and scope["method"] == "POST":
            scope["app"] = self.app
            try:
                response = await chat_completions(Request(scope, receive))
            except ClientGone:
                return  # the upstream call was cancelled with the client; nothing to send
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def app_from_env() -> FastChatPath:
    """Factory for uvicorn worker processes (``serve --workers N``)."""
    from .cli import settings_from_env

    settings = settings_from_env()
    logs.configure(settings.log_level, settings.log_format)
    return create_app(settings)
