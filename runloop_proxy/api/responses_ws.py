"""``/v1/responses`` over a WebSocket: the Responses API as OpenAI serves it on a socket, which
Codex tries first (its built-in provider, ``openai_base_url``). Each ``response.create`` is the
request it amounts to over HTTP (``responses_ws_wire``: expanded from what the connection
keeps when it goes on from a response of its own), served by the same stages — identified,
windowed, recorded, the proxy's rounds hidden — and its response streamed back as the socket's
messages. Upstream it goes over HTTP, streamed: the window the proxy sends is its own (cut at
its events, with rounds the client never sees), so an upstream's memory of the last response
on a socket of its own would not be what the proxy sends next; and every Responses upstream
(OpenAI, Azure, gateways, vLLM) speaks HTTP.

Refused at the door in HTTP, as a client reads a refused upgrade: a bad key (401, OpenAI's
error body), and every upgrade while the operator has turned the socket off
(``server.websocket = false``): 426, which Codex reads as "use HTTP" at once (any other
refusal it retries five times first, 6.8 s). A connection with no event for
``server.websocket_idle_s`` is closed (what it keeps of its responses goes with it; the
client reconnects and sends the whole conversation, as after any close).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import orjson
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..errors import (
    ClientError,
    InvalidRequest,
    PayloadTooLarge,
    UpstreamBadReply,
    UpstreamError,
    error_body,
)
from ..ops import logs
from ..pipeline.accounting import RequestLog
from ..pipeline.offload import events, is_large, offload
from ..pipeline.sse import SSEDecoder, encode_event
from ..pipeline.turn import serve
from ..pipeline.values import Answer, Caller, Turn
from ..state import AppState, state_of
from .http import (
    INTERNAL_ERROR,
    ClientGone,
    admit_large,
    authenticate,
    json_response,
    openai_shape,
    outcome,
)
from .responses import PATH, checked, turn_of
from .responses_ws_wire import (
    Chains,
    Create,
    SocketRelay,
    answer_error,
    client_event,
    create_request,
    error_event,
    http_headers,
    steer_failed,
    warmup_events,
)

log = logs.get("websocket")
API = "responses_ws"
WARMUP_API = "responses_warmup"
INBOX = 4  # events read ahead of the one being answered (a client past it waits: TCP)
T = TypeVar("T")

__all__ = ["PATH", "responses_socket"]


async def responses_socket(websocket: WebSocket) -> None:
    state = state_of(websocket)
    if not state.config.server.websocket:
        await _refuse(websocket, 426, error_body(
            "this proxy serves /v1/responses over HTTP only (server.websocket = false): "
            "POST the request", "invalid_request_error", None, "websocket_not_served"))
        return
    try:
        authenticate(state, websocket)
    except ClientError as exc:
        await _refuse(websocket, exc.status, exc.body())
        return
    await websocket.accept()
    await Connection(state, websocket).run()


async def _refuse(websocket: WebSocket, status: int, body: dict[str, Any]) -> None:
    """The upgrade refused with an HTTP answer (the error in OpenAI's shape)."""
    try:
        await websocket.send_denial_response(json_response(body, status))
    except RuntimeError:  # a server without the denial response: a close says less
        await websocket.close(1008)


class Connection:
    """One client's socket: its events answered one at a time, in the order they came
    (OpenAI's socket answers one response at a time too); a ``stream_id`` is echoed, its
    lane served in that order. A client that goes away cancels the response in flight."""

    def __init__(self, state: AppState, websocket: WebSocket):
        self.state = state
        self.ws = websocket
        self.chains = Chains()
        self.inbox: asyncio.Queue[str | None] = asyncio.Queue(INBOX)
        self.gone = asyncio.Event()
        self.headers = http_headers(websocket.headers.items())

    async def run(self) -> None:
        reader = asyncio.ensure_future(self._read())
        gauge = self.state.metrics.websockets
        gauge.inc()
        try:
            while not self.gone.is_set():
                try:
                    async with asyncio.timeout(self.state.config.server.websocket_idle_s):
                        text = await self.inbox.get()
                except TimeoutError:
                    await self._close(1000, "idle")
                    return
                if text is None:
                    return
                with contextlib.suppress(ClientGone):
                    await self._serve(text)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            gauge.dec()

    async def _read(self) -> None:
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                text = message.get("text")
                if text is None:
                    text = (message.get("bytes") or b"").decode("utf-8", "replace")
                await self.inbox.put(text)
        finally:
            self.gone.set()
            with contextlib.suppress(asyncio.QueueFull):
                self.inbox.put_nowait(None)

    async def _serve(self, text: str) -> None:
        try:
            event = client_event(text)
        except InvalidRequest as exc:
            await self._send(error_event(exc.status, exc.body()["error"]))
            return
        try:
            await self._answer(event, len(text))
        except ClientGone:
            raise
        except Exception:  # the socket goes on: this event is answered, and the next
            log.exception("unexpected error")
            await self._send(error_event(500, INTERNAL_ERROR["error"]))

    async def _answer(self, event: dict[str, Any], size: int) -> None:
        kind = event["type"]
        if kind == "response.create":
            await self._create(event, size)
        elif kind == "response.steer":
            await self._send(steer_failed(event))
        elif kind != "response.processed":  # Codex's acknowledgement: nothing to do
            await self._send(error_event(400, {
                "message": f"unknown event type {kind[:64]!r}: this proxy serves "
                           f"response.create", "code": "unknown_event_type", "param": "type"}))

    async def _create(self, event: dict[str, Any], size: int) -> None:
        """One ``response.create``: served as its HTTP request is (``outcome``), its answer
        streamed back as events, what it ended with kept for the next turn."""
        state = self.state
        rlog = RequestLog(state.metrics, API)
        made: list[Create] = []

        async def make_turn() -> Turn:
            caller = authenticate(state, self.ws)  # at each event: a reload, a revoked key
            rlog.authenticated(caller.tenant.name, caller.label)
            create, raw, (body, messages) = await self._expanded(event, size, caller, rlog)
            made.append(create)
            if not create.generate:
                rlog.api = WARMUP_API
            return turn_of(caller, body, raw, messages, self.headers, rlog)

        async def stages(state: AppState, turn: Turn, rlog: RequestLog) -> Answer:
            if made[0].generate:
                return await serve(state, turn, rlog)
            return _warmup(made[0], rlog)

        lane = event.get("stream_id") if isinstance(event.get("stream_id"), str) else None
        in_flight = state.metrics.in_flight
        in_flight.inc()
        try:
            answer = await outcome(state, rlog, openai_shape, make_turn, stages,
                                   self._unless_gone)
            if answer.stream is not None:
                await self._unless_gone(self._relay(answer.stream, made[0]))
            else:
                await self._send(answer_error(answer.status if answer.status >= 400 else 502,
                                              answer.body, answer.headers, lane))
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # aborted at shutdown: answered
                await self._close(1012, "the proxy is shutting down")
        except ClientGone:
            return
        finally:
            in_flight.dec()

    async def _expanded(self, event: dict[str, Any], size: int, caller: Caller,
                        rlog: RequestLog) -> tuple[Create, bytes, Any]:
        """The event as its HTTP request, checked as one (off the event loop when the
        conversation is large, holding one of its tenant's large requests as an HTTP
        request's large body does)."""
        previous = event.get("previous_response_id")
        kept = self.chains.get(previous) if isinstance(previous, str) else None
        large = is_large(size + (kept.size if kept else 0), len(kept.items) if kept else 0)
        if large:
            admit_large(self.state, caller, rlog)
        limit = self.state.config.server.max_body_bytes

        def expand() -> tuple[Create, bytes, Any]:
            create = create_request(event, self.chains, size)
            raw = orjson.dumps(create.body)
            if len(raw) > limit:
                raise PayloadTooLarge(f"the request, with the conversation it goes on from, "
                                      f"is {len(raw)} bytes: over the limit of {limit} "
                                      f"(server.max_body_bytes)")
            return create, raw, checked(create.body)

        return await offload(large, expand)

    async def _relay(self, stream: AsyncIterator[bytes], create: Create) -> None:
        """A response's stream as the socket's messages; the response kept once it ended."""
        relay = SocketRelay(create.lane, create.continued)
        decoder = SSEDecoder(self.state.config.server.max_answer_bytes)
        size = 0
        try:
            async for chunk in stream:
                size += len(chunk)
                for text in await events(decoder, chunk, relay.feed):
                    await self._send(text)
            for ev in decoder.flush():
                for text in relay.feed(ev):
                    await self._send(text)
            if not relay.ended:  # every response ends, or the client waits for good
                raise UpstreamBadReply("the upstream's stream ended before the response did")
        except UpstreamError as exc:
            relay.failed = True
            log.warning("response cut: the upstream failed part-way",
                        extra={"error": exc.log_text})
            await self._send(error_event(exc.status, exc.body()["error"], lane=create.lane))
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        kept = relay.kept(create, size)
        if kept is not None:
            self.chains.keep(*kept)

    async def _unless_gone(self, work: Awaitable[T]) -> T:
        """``work``, cancelled (and ClientGone raised) if the client goes away first."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(self.gone.wait())
        try:
            try:
                await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the connection itself cancelled (shutdown):
                task.cancel()               # its work goes with it
                raise
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise ClientGone()
            return task.result()
        finally:
            gone.cancel()

    async def _send(self, message: str | dict[str, Any]) -> None:
        text = message if isinstance(message, str) else orjson.dumps(message).decode()
        try:
            await self.ws.send_text(text)
        except (WebSocketDisconnect, OSError, RuntimeError) as exc:
            self.gone.set()  # closed under us: nobody to answer
            raise ClientGone() from exc

    async def _close(self, code: int, reason: str) -> None:
        self.gone.set()
        with contextlib.suppress(WebSocketDisconnect, OSError, RuntimeError):
            await self.ws.close(code, reason)


def _warmup(create: Create, rlog: RequestLog) -> Answer:
    """A warmup's answer, made here (nothing goes upstream): a response with no output."""
    made = warmup_events(create, "resp_" + secrets.token_hex(24), int(time.time()))
    rlog.finish(200)

    async def stream() -> AsyncIterator[bytes]:
        for event in made:
            yield encode_event(orjson.dumps(event), event["type"])

    return Answer(200, {}, stream=stream())
