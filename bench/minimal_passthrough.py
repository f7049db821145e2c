"""The floor for this architecture: a bare Starlette route relaying to the upstream with one
shared aiohttp session, nothing else. overhead.py measures it beside the proxy so the cost of
the proxy's own work (auth, sessions, window, store, metrics, logs) reads as a ratio.

    python bench/minimal_passthrough.py UPSTREAM_CHAT_URL PORT
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


def build(upstream: str) -> Starlette:
    session: list[aiohttp.ClientSession] = []

    async def chat(request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items()
                   if k not in ("host", "content-length", "connection")}
        async with session[0].post(upstream, data=body, headers=headers) as r:
            data = await r.read()
        return Response(data, r.status, media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        session.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512)))
        yield
        await session[0].close()

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])],
                     lifespan=lifespan)


if __name__ == "__main__":
    uvicorn.run(build(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), log_level="error",
                access_log=False)
