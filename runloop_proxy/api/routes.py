"""The route table, and the endpoints that are not a conversation: health, readiness, metrics,
and every other ``/v1`` endpoint passed through untouched."""

from __future__ import annotations

import re
import urllib.parse
import zlib
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute

from ..errors import InvalidRequest, NotFound, PermissionDenied
from ..ops.admin import admin_routes
from ..ops.inspector import inspector_routes
from ..pipeline.accounting import CLIENT_CLOSED, LARGE_WORK
from ..pipeline.offload import is_large_body, offload
from ..pipeline.references import stored_references
from ..pipeline.relay import refuse_held_key, refuse_stored
from ..pipeline.shares import Held
from ..pipeline.upstream import UpstreamResponse
from ..pipeline.values import Caller
from ..state import state_of
from .chat import PATH as CHAT_PATH
from .chat import chat_completions
from .http import (
    ASGIResponse,
    ClientGone,
    LiveStreamResponse,
    anthropic_path,
    authenticate,
    json_response,
    read_body,
    shaped_errors,
    until_disconnect,
)
from .messages import COUNT_PATH, count_tokens, messages
from .messages import PATH as MESSAGES_PATH
from .responses import PATH as RESPONSES_PATH
from .responses import responses
from .responses_ws import responses_socket

ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
PREFIX = "/v1/"
# what a path segment may carry unencoded on the way upstream (RFC 3986 pchar, less "%")
_SEGMENT_SAFE = "/:@!$&'()*+,;=-._~"


def v1_subpath(raw_path: bytes) -> str:
    """The path a pass-through request asks for below ``/v1``, percent-encoded for the
    upstream URL — or InvalidRequest when, decoded, it would leave ``/v1/``: a dot segment
    (``%2e%2e``, ``..%2f``), a backslash, an empty segment or a control character. Decoded
    once, as the router does; whatever is left encoded (``%252e``) is sent re-encoded, so
    the upstream's one decoding cannot make it a dot segment either."""
    try:
        path = urllib.parse.unquote_to_bytes(raw_path).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest("the request path is not UTF-8 once percent-decoded") from exc
    segments = path[len(PREFIX):].split("/")
    if not path.startswith(PREFIX) or "\\" in path \
            or any(ord(c) < 0x20 or ord(c) == 0x7F for c in path) \
            or any(seg in ("", ".", "..") for seg in segments[:-1]) \
            or segments[-1] in (".", ".."):
        raise InvalidRequest(f"the request path must stay below {PREFIX} once percent-decoded "
                             f"(no '.' or '..' segments, empty segments or backslashes)")
    return urllib.parse.quote(path[len(PREFIX) - 1:], safe=_SEGMENT_SAFE)


# What a caller may reach through a key other tenants use too: endpoints whose answer is
# made from the request alone, never from what the upstream account stores (files, batches,
# stored completions and responses, conversations, vector stores, fine-tunes ...), which
# would be every such tenant's. A list of what is allowed, so an endpoint the upstream adds
# is refused until it is known to keep nothing.
_STATELESS = re.compile(
    r"POST /(embeddings|moderations|completions|audio/(speech|transcriptions|translations)"
    r"|images/(generations|edits|variations)|responses/input_tokens|messages/count_tokens)"
    r"|GET /models(/[^/]+)?")


def stateless(method: str, path: str) -> bool:
    """Whether ``method path`` (below /v1, as ``v1_subpath`` gives it) keeps nothing in
    the upstream's account that another caller could read."""
    return bool(_STATELESS.fullmatch(f"{method.upper()} {path}"))


_FORM_NAME = re.compile(rb'(?im)^content-disposition:[^\r\n]*?\bname="([^"]*)"')
_KEY_PART = re.compile(r"[^\[\]]+")


def body_references(content_type: str, encoding: str, raw: bytes, limit: int) -> list[str]:
    """What a pass-through body names of an account's stored objects (``references``), as
    the upstream would read it: JSON, a form (its fields' names: ``images[0][file_id]``
    is a ``file_id``) or multipart (its parts' names), inflated first when it comes gzip-
    or deflate-encoded (at most ``limit`` bytes); another encoding cannot be read, and what
    cannot be read is refused (["an encoded body"]), never sent unread."""
    encoding = encoding.strip().lower()
    if encoding not in ("", "identity"):
        if encoding not in ("gzip", "x-gzip", "deflate"):
            return [f"a body in {encoding[:32]}"]
        inflater = zlib.decompressobj(wbits=47)  # gzip or zlib, by the header
        try:
            raw = inflater.decompress(raw, limit + 1)
        except zlib.error:
            return ["an encoded body"]
        if len(raw) > limit or inflater.unconsumed_tail:
            return ["an encoded body"]
    kind = content_type.split(";")[0].strip().lower()
    if kind == "multipart/form-data":  # a part's value may be a file: only names read
        fields = [(m.decode("utf-8", "replace"), "named") for m in _FORM_NAME.findall(raw)]
    elif kind == "application/x-www-form-urlencoded":
        fields = urllib.parse.parse_qsl(raw.decode("latin-1"), keep_blank_values=True)
    else:
        try:
            return stored_references(orjson.loads(raw))
        except orjson.JSONDecodeError:
            return []  # not JSON (audio, an image): names nothing by a field
    return [ref for name, value in fields
            for ref in stored_references({(_KEY_PART.findall(name) or [name])[-1]: value})]


def base_url_hint(path: str) -> str:
    """What a client that asked for ``path`` likely has wrong in its base URL (a known API
    path without ``/v1``: an OpenAI SDK's base URL without it; ``/v1/v1/`` left after the
    front took one doubled ``/v1`` off (``app.once_v1``): a base URL with ``/v1`` twice),
    said after a 404; "" when nothing."""
    if path.startswith("/v1/v1/"):
        return (" (the base URL ends in /v1 twice: the Anthropic SDKs add /v1 themselves, "
                "so theirs is http://HOST:PORT without it)")
    if "/v1" + path in CONVERSATIONS or path.startswith(("/models", "/embeddings")):
        return f" (did you mean /v1{path}? An OpenAI SDK's base URL ends in /v1)"
    return ""


@shaped_errors
async def passthrough(request: Request) -> ASGIResponse:
    """Any other /v1 endpoint (models, embeddings, files, …) goes through untouched both ways:
    bodies and their Content-Encoding, the query string; the path only when it stays below
    /v1/."""
    state = state_of(request)
    if request.url.path.startswith("/v1/v1/"):  # never the upstream's: a doubled base URL
        raise NotFound(f"{request.method} {request.url.path}: no such endpoint"
                       f"{base_url_hint(request.url.path)}")
    caller = authenticate(state, request)
    path = v1_subpath(request.scope.get("raw_path") or request.scope["path"].encode())
    if caller.shared_key and not stateless(request.method, path):
        raise PermissionDenied(
            f"{request.method} {request.url.path}: this tenant's upstream key is other tenants' "
            f"too, so the proxy forwards only endpoints that keep nothing upstream (models, "
            f"embeddings, moderations, audio, images); files, batches and stored responses "
            f"need the tenant's own upstream_key")
    if anthropic_path(request.url.path) \
            and caller.client(state.upstreams).spec.format == "chat":
        raise NotFound(f"{request.url.path}: the upstream speaks chat completions, which have "
                       f"no such endpoint (the proxy answers /v1/messages and "
                       f"/v1/messages/count_tokens itself)")
    raw = await read_body(request, state.config.server.max_body_bytes)
    # a large body the proxy walks (what it names, for a key other tenants share) is worked
    # on in a worker thread: it holds one of its tenant's large requests until it ends, as a
    # conversation's does (a body relayed unread holds none: no work is done on it)
    walked = caller.shared_key and bool(raw)
    held = Held(state.large if walked and is_large_body(raw) else None, caller.holder)
    held.take(1, LARGE_WORK)
    try:
        return await _relayed(request, caller, path, raw, walked, held)
    except BaseException:
        held.release()
        raise


async def _relayed(request: Request, caller: Caller, path: str, raw: bytes, walked: bool,
                   held: Held) -> ASGIResponse:
    """The pass-through request sent and its answer relayed as it comes; ``held`` given
    back once the answer is done."""
    state = state_of(request)
    if walked:  # what the body names, as the conversation endpoints
        refuse_stored(await offload(held.amount > 0, lambda: body_references(
            request.headers.get("content-type", ""),
            request.headers.get("content-encoding", ""), raw,
            state.config.server.max_body_bytes)))
    headers = caller.upstream_headers(request.headers.items(), body_as_sent=True)
    # the answer comes back as the upstream encodes it, so only in what the client accepts
    headers["Accept-Encoding"] = request.headers.get("accept-encoding", "identity")
    client = caller.client(state.upstreams)
    try:  # a client gone before the answer cancels the upstream call (and gives back all)
        resp = await until_disconnect(request, client.request(
            request.method, path, headers, raw or None, query=request.url.query, raw=True,
            holder=caller.holder))
    except ClientGone:
        held.release()
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it
    try:
        state.metrics.passthrough_requests.labels(caller.label, str(resp.status)).inc()
        refuse_held_key(caller, resp)
    except BaseException:
        resp.close()
        raise

    # relayed as it arrives, as the upstream encoded it: never held whole, never inflated
    sse = resp.headers.get("content-type", "").startswith("text/event-stream")
    return LiveStreamResponse(_Relay(resp, held), resp.status, dict(caller.answer_headers(resp)),
                              sse=sse)


class _Relay:
    """A pass-through answer's chunks as they come; closed (the upstream's answer, and what
    the request held given back) when the response is done with it, whether or not it read
    a chunk — a client gone before the first one included."""

    def __init__(self, resp: UpstreamResponse, held: Held) -> None:
        self._resp, self._held = resp, held
        self._chunks = resp.iter_chunks()

    def __aiter__(self) -> _Relay:
        return self

    async def __anext__(self) -> bytes:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        try:
            aclose = getattr(self._chunks, "aclose", None)  # an async generator's
            if aclose is not None:
                await aclose()
        finally:
            self._resp.close()
            self._held.release()


async def healthz(request: Request) -> Response:
    return json_response({"status": "ok"})


async def readyz(request: Request) -> Response:
    state = state_of(request)
    config = state.config
    checks: dict[str, Any] = {"config": bool(state.upstreams),
                              "tenants": bool(config.tenants) or config.passthrough is not None}
    if state.store is not None:
        checks["store"] = await state.store.ping()
    ok = all(checks.values())
    return json_response({"status": "ready" if ok else "not ready", "checks": checks},
                         200 if ok else 503)


async def metrics_endpoint(request: Request) -> Response:
    body, content_type = state_of(request).metrics.render()
    return Response(body, headers={"Content-Type": content_type})


# the conversation endpoints: served straight from the ASGI front (app.FastPath), past
# Starlette's routing and middleware, which cost a measurable share of a pass-through request
CONVERSATIONS = {CHAT_PATH: chat_completions, RESPONSES_PATH: responses,
                 MESSAGES_PATH: messages, COUNT_PATH: count_tokens}


def routes() -> list[BaseRoute]:
    return [
        Route(CHAT_PATH, chat_completions, methods=["POST"]),
        Route(RESPONSES_PATH, responses, methods=["POST"]),
        WebSocketRoute(RESPONSES_PATH, responses_socket),
        Route(MESSAGES_PATH, messages, methods=["POST"]),
        Route(COUNT_PATH, count_tokens, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        *admin_routes(),
        *inspector_routes(),
        Route("/v1/{path:path}", passthrough, methods=ALL_METHODS),
    ]
