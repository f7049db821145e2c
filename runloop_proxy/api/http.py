"""HTTP plumbing the endpoints share: who is calling, reading a body, errors in each API's
shape, a client that goes away, and a streaming response that notices that at once.

Starlette's StreamingResponse, under ASGI spec 2.4, learns of a disconnect only when its next
``send`` fails — which, while the model is thinking, can be minutes. ``LiveStreamResponse`` has a
listener wait on ``receive`` beside the pump and cancel it on ``http.disconnect``, so the
upstream request is closed (the generator's ``finally``) the moment the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeAlias, TypeVar

import orjson
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..config import KEY_NAMESPACE
from ..errors import (
    ABORTED,
    AuthenticationFailed,
    ClientError,
    CredentialTooLong,
    InvalidRequest,
    PayloadTooLarge,
    ShuttingDown,
    Unavailable,
    UpstreamError,
    error_body,
)
from ..ops import logs
from ..pipeline.accounting import CLIENT_CLOSED, RequestLog
from ..pipeline.masking import credentials_sent
from ..pipeline.offload import is_large_body, offload
from ..pipeline.turn import serve
from ..pipeline.upstream import PROXY_KEY_HEADERS, names_caller
from ..pipeline.values import Answer, Caller, Turn
from ..state import AppState, state_of
from .messages_wire import error_shape as anthropic_shape

log = logs.get("http")
Handler = Callable[[Request], Awaitable[Any]]
ASGIResponse: TypeAlias = "Response | LiveStreamResponse"
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the answer: there is nobody to answer."""


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status, headers=headers, media_type="application/json")


# An API's error shape: the status, the OpenAI-shaped body every error has, and the error
ErrorShape = Callable[[int, dict[str, Any], Exception | None], dict[str, Any]]
MESSAGES_PATHS = "/v1/messages"  # Anthropic's API: this path and every path below it


def openai_shape(status: int, body: dict[str, Any], exc: Exception | None) -> dict[str, Any]:
    return body


def anthropic_path(path: str) -> bool:
    """Whether ``path`` is Anthropic's API: ``/v1/messages`` and any path below it."""
    return path == MESSAGES_PATHS or path.startswith(MESSAGES_PATHS + "/")


def error_shape(path: str) -> ErrorShape:
    """The one rule for the shape of an error the proxy answers: Anthropic's for Anthropic's
    API (the proxy's own routes and those it passes through alike), OpenAI's elsewhere."""
    while path.startswith("/v1/v1/"):  # a base URL off by a /v1 (told in a 404): the
        path = path[3:]                   # client still reads the error in its API's shape
    return anthropic_shape if anthropic_path(path) else openai_shape


def error_response(path: str, status: int, body: dict[str, Any], exc: Exception | None,
                   headers: dict[str, str] | None = None) -> Response:
    """An error of the proxy's own, in the shape the path's API has."""
    return json_response(error_shape(path)(status, body, exc), status, headers)


def shaped_errors(handler: Handler) -> Handler:
    """Turn the proxy's errors into bodies of the path's API's shape with the right status."""
    @functools.wraps(handler)
    async def wrapped(request: Request) -> Any:
        try:
            return await handler(request)
        except ClientError as exc:
            return error_response(request.url.path, exc.status, exc.body(), exc)
        except UpstreamError as exc:
            log.warning("upstream error", extra={"error": exc.log_text, "status": exc.status})
            return error_response(request.url.path, exc.status, exc.body(), exc)
        except Unavailable as exc:
            log.warning("request refused: unavailable", extra={"error": exc.log_text})
            return error_response(request.url.path, exc.status, exc.body(), exc,
                                  {"Retry-After": str(max(1, round(exc.retry_after)))})
    return wrapped


# what an upstream of chat completions never gets: a client's key in any header but the
# bearer token the proxy sets, and Anthropic's own headers
CHAT_DROP = PROXY_KEY_HEADERS | {"anthropic-version", "anthropic-beta"}
CREDENTIAL_HEADERS = ("authorization", "api-key", "x-api-key")  # a key alone: as it was
INTERNAL_ERROR = error_body("internal error in runloop-proxy", "server_error", None,
                            "internal_error")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit}")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_request(state: AppState, request: Request, check: Callable[[Any], T],
                       caller: Caller, rlog: RequestLog) -> tuple[bytes, T]:
    """The body, read within the size bound, parsed and checked by ``check`` (which may also
    convert it) — off the event loop when it is large: a check walks every message and item,
    and a large body's walk must not hold up the other requests."""
    raw = await read_body(request, state.config.server.max_body_bytes)
    large = is_large_body(raw)
    if large:
        admit_large(state, caller, rlog)
    return raw, await offload(large, lambda: check(parse_json(raw)))


def admit_large(state: AppState, caller: Caller, rlog: RequestLog) -> None:
    """A request whose large body is worked on in worker threads holds one of its tenant's
    share of them (``server.large_requests``) until it ends: past the share a 429, past
    the whole a 503 (both with Retry-After), before any of that work is done."""
    rlog.hold(state.large, caller.holder)


def parse_json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc


def bearer(request: HTTPConnection) -> str | None:
    """The key a client sends: ``Authorization: Bearer``, else ``api-key`` (Azure's SDKs) or
    ``x-api-key``."""
    auth = request.headers.get("authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("api-key") or request.headers.get("x-api-key")


def credentials(request: HTTPConnection) -> list[str]:
    """Everything the client sends that may tell the upstream who it is, in a fixed order:
    the value of every header named like a credential (``IDENTITY``: a key, a token, an
    authorization, an organization or project, a gateway's own — every value of each),
    a bearer token as its key alone. A pass-through namespace is all of them: two callers
    the upstream tells apart by any of them are apart here too."""
    out: set[str] = set()
    for raw_name, raw_value in request.headers.raw:  # each header once: no lookup by name,
        name = raw_name.decode("latin-1").lower()   # which scans them all (quadratic)
        if not names_caller(name):
            continue
        value = raw_value.decode("latin-1")
        if name == "authorization" and value[:7].lower() == "bearer ":
            value = value[7:].strip()
        if value:
            out.add(value if name in CREDENTIAL_HEADERS else f"{name}:{value}")
    return sorted(out)


def namespace_of(keys: list[str]) -> str | None:
    """A pass-through caller's namespace: the hash of its key (of its keys, when it sends
    more than one); None without one (nothing is kept)."""
    if not keys:
        return None
    return "pt-" + hashlib.sha256("\0".join(keys).encode()).hexdigest()[:16]


def authenticate(state: AppState, request: HTTPConnection) -> Caller:
    """Who is calling (``_caller``), with the client of its upstream as the config had it:
    in-flight requests finish on the config they started with."""
    caller = _caller(state, request)
    return dataclasses.replace(caller, upstream=state.upstreams.get(caller.tenant.upstream))


def _caller(state: AppState, request: HTTPConnection) -> Caller:
    """Who is calling, and how the upstream is to know it: an upstream of Anthropic's format
    takes its key as ``x-api-key``; one of chat completions only (the bridge's) as a bearer
    token, whichever header the client sent its key in, and none of Anthropic's headers.

    One caller, one identity, both sides: where the client's own credentials go upstream
    (pass-through, ``forward_client_key``), its namespace is all of them (``credentials``),
    so two callers the upstream tells apart by any of them are apart here too; where the
    proxy's key goes, no client header that names a caller goes with it."""
    cfg = state.config
    key = bearer(request)
    if cfg.passthrough is not None:
        # Single-tenant pass-through: the client's own credentials go upstream, and without
        # any nothing is kept
        _bounded(request)
        ns = namespace_of(credentials(request))
        if cfg.upstreams[cfg.passthrough.upstream].format == "chat":
            return Caller(cfg.passthrough, "passthrough", ns,
                          f"Bearer {key}" if key else None, CHAT_DROP)
        return Caller(cfg.passthrough, "passthrough", ns, request.headers.get("authorization"))
    if key is None:
        raise AuthenticationFailed(
            "Missing API key: send a proxy key of your tenant as 'Authorization: Bearer <key>' "
            "(or 'x-api-key: <key>', as Anthropic's clients do).")
    tenant = cfg.tenant_for_key(key)
    if tenant is None:
        raise AuthenticationFailed(
            "Incorrect API key provided: not a proxy key of any tenant of this proxy (its "
            "tenants' keys are in its config; a provider's own key is not one).")
    fmt = cfg.upstreams[tenant.upstream].format
    drop = CHAT_DROP if fmt == "chat" else PROXY_KEY_HEADERS
    if tenant.forward_client_key:  # each caller's own key: its own namespace in the tenant
        _bounded(request)
        ns = f"{tenant.name}{KEY_NAMESPACE}{(namespace_of(credentials(request)) or '')[3:]}"
        if fmt == "chat":
            return Caller(tenant, tenant.name, ns, f"Bearer {key}", drop)
        return Caller(tenant, tenant.name, ns, request.headers.get("authorization"),
                      drop - {"x-api-key"} if fmt == "anthropic" else drop)
    secret = cfg.upstream_secret(tenant)
    shared = cfg.shares_key(tenant)
    if fmt == "anthropic":  # its key goes as x-api-key
        return Caller(tenant, tenant.name, tenant.name, None, drop, secret, True, shared)
    upstream_auth = f"Bearer {secret}" if secret else None
    return Caller(tenant, tenant.name, tenant.name, upstream_auth, drop, None, True, shared)


def _bounded(request: HTTPConnection) -> None:
    """A client whose own credentials go upstream sends none longer than the proxy masks
    (``masking.MAX_CREDENTIAL_BYTES``): refused at the door, before its body is read."""
    try:
        credentials_sent(request.headers)
    except ValueError as exc:
        raise CredentialTooLong(str(exc), param="headers") from exc


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; a client that disconnects before it is done cancels it (the upstream call
    with it) and raises ClientGone. Once the body is read, the next thing a client can send
    is a disconnect; a stream has its own listener (LiveStreamResponse)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(request.receive())
    try:
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the request itself cancelled (the proxy stopping):
            task.cancel()               # its work goes with it, never left running alone
            raise
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientGone()
        return task.result()
    finally:
        watcher.cancel()


TurnMaker = Callable[[AppState, Request, RequestLog], Awaitable[Turn]]
Stages = Callable[[AppState, Turn, RequestLog], Awaitable[Answer]]
Guard = Callable[[Awaitable[Answer]], Awaitable[Answer]]  # runs the stages (a disconnect
# cancels them there)


async def answer_turn(request: Request, api: str, make_turn: TurnMaker,
                      run: Stages = serve) -> ASGIResponse:
    """The frame every HTTP API adapter runs in (``outcome``): the adapter reads and checks
    the request into a Turn, the pipeline serves it, a client that goes away cancels the
    work; the answer or the error as an HTTP response. ``run``: the stages it goes
    through."""
    state = state_of(request)
    rlog = RequestLog(state.metrics, api)
    answer = await outcome(state, rlog, error_shape(request.url.path),
                           lambda: make_turn(state, request, rlog), run,
                           lambda work: until_disconnect(request, work))
    if answer.stream is not None:
        return LiveStreamResponse(answer.stream, answer.status, answer.headers)
    return Response(answer.body, answer.status, headers=answer.headers)


def error_answer(shape: ErrorShape, exc: ClientError | UpstreamError | Unavailable,
                 headers: dict[str, str] | None = None) -> Answer:
    return Answer(exc.status, {"Content-Type": "application/json", **(headers or {})},
                  orjson.dumps(shape(exc.status, exc.body(), exc)))


async def outcome(state: AppState, rlog: RequestLog, shape: ErrorShape,
                  make_turn: Callable[[], Awaitable[Turn]], run: Stages,
                  guard: Guard) -> Answer:
    """One request's answer, whatever the transport (HTTP, a WebSocket's ``response.create``):
    the turn made, the stages run under ``guard``; every error the proxy answers as an
    Answer in the API's shape (``shape``) with its status, and the request counted once
    whatever happens. A client gone (``ClientGone``) is counted and raised: nobody to
    answer."""
    try:
        turn = await make_turn()
        return await guard(run(state, turn, rlog))
    except ClientGone:
        rlog.finish(CLIENT_CLOSED, "client disconnected")
        raise
    except asyncio.CancelledError as exc:
        if ABORTED not in exc.args:
            raise
        stop = ShuttingDown("the proxy is shutting down: this request was aborted; "
                            "send it again", retry_after=5)
        log.warning("request aborted at shutdown", extra={"api": rlog.api})
        rlog.finish(stop.status, "aborted at shutdown")
        return error_answer(shape, stop, {"Retry-After": "5"})
    except ClientError as exc:
        rlog.finish(exc.status, exc.log_text)
        return error_answer(shape, exc)
    except UpstreamError as exc:
        log.warning("upstream error", extra={"error": exc.log_text, "status": exc.status})
        rlog.finish(exc.status, exc.log_text)
        return error_answer(shape, exc)
    except Unavailable as exc:
        log.warning("request refused: unavailable", extra={"error": exc.log_text})
        rlog.finish(exc.status, exc.log_text)
        return error_answer(shape, exc, {"Retry-After": str(max(1, round(exc.retry_after)))})
    except Exception as exc:
        log.exception("unexpected error")
        rlog.finish(500, "internal error")
        return Answer(500, {"Content-Type": "application/json"},
                      orjson.dumps(shape(500, INTERNAL_ERROR, exc)))
    finally:  # what the request held while it was answered (an answer read whole) goes
        rlog.ended()  # back however it ended, cancelled too (a stream's later work: its own)


class LiveStreamResponse:
    """A body relayed as it arrives. An event stream (``sse``) gets the headers that keep
    proxies from buffering it. A body whose source fails part-way (``UpstreamError``) is left
    unfinished: the connection is closed before the body's end, so the client sees an
    incomplete answer, never a short one that looks whole."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], status_code: int = 200,
                 headers: Mapping[str, str] | None = None, sse: bool = True):
        self.body = body
        self.status_code = status_code
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1"))
               for k, v in (headers or {}).items() if not sse or k.lower() != "content-length"]
        if sse:
            if not any(k == b"content-type" for k, _ in raw):
                raw.append((b"content-type", b"text/event-stream; charset=utf-8"))
            raw.append((b"cache-control", b"no-cache"))
            raw.append((b"x-accel-buffering", b"no"))
        self.raw_headers = raw

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        listener = asyncio.ensure_future(self._listen(receive))
        try:
            await asyncio.wait({pump, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, listener):
                if not task.done():
                    task.cancel()
            for task in (pump, listener):
                with contextlib.suppress(asyncio.CancelledError, OSError, UpstreamError):
                    await task
            aclose = getattr(self.body, "aclose", None)
            if aclose is not None:
                await aclose()
        if pump.done() and not pump.cancelled() and isinstance(pump.exception(), UpstreamError):
            # returning with the body unfinished: the server closes the connection mid-body
            log.warning("answer cut: the upstream failed part-way",
                        extra={"error": pump.exception().log_text})  # type: ignore[union-attr]

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for chunk in self.body:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _listen(receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
