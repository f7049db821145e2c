"""A streaming response that notices a client disconnect at once.

Starlette's StreamingResponse, under ASGI spec 2.4, learns of a disconnect only when its next
``send`` fails — which, while the model is thinking, can be minutes. Here a listener waits on
``receive`` beside the pump and cancels it on ``http.disconnect``, so the upstream request is
closed (the generator's ``finally``) the moment the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping

from starlette.types import Receive, Scope, Send


class LiveStreamResponse:
    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], status_code: int = 200,
                 headers: Mapping[str, str] | None = None):
        self.body = body
        self.status_code = status_code
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1"))
               for k, v in (headers or {}).items() if k.lower() != "content-length"]
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
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task
            aclose = getattr(self.body, "aclose", None)
            if aclose is not None:
                await aclose()

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
