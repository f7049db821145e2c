"""A TCP relay that makes a real server slow: every chunk a client sends reaches the server
``delay`` seconds after it arrived, and each connection carries at most ``bytes_per_s``
towards it, in order (a Redis an ocean away, on a thin link: a large pipeline arrives after
a small command sent after it on another connection, as it does over a real network); the
answers are relayed as they come. Run on a thread of its own, so the process under test
sees it as a remote server."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from .conftest import free_port


class SlowLink:
    def __init__(self, host: str, port: int, delay: float = 0.0, bytes_per_s: float = 0.0):
        self.target = (host, port)
        # read at each chunk: may change while traffic flows (0: no bound)
        self.delay = delay
        self.bytes_per_s = bytes_per_s
        self.port = free_port()
        self.chunks = 0  # chunks held on their way to the server
        self.url = ""  # the server's URL through the relay, as its user sets it
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="slow-link")

    def start(self) -> SlowLink:
        self._thread.start()
        assert self._ready.wait(10), "the relay never listened"
        return self

    def stop(self) -> None:
        """Every connection closed, then the relay's loop ended."""
        self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self._ready.set()
        await self._stopping.wait()
        server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer, held=True),
                             self._pipe(up_reader, writer, held=False),
                             return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    held: bool) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                at, data = await queue.get()
                if not data:
                    return
                wait = at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(send())
        free_at = 0.0  # when this connection's link has sent what it was given
        try:
            while data := await reader.read(65536):
                at = loop.time()
                if held:
                    self.chunks += 1
                    rate = self.bytes_per_s
                    free_at = max(free_at, at) + (len(data) / rate if rate else 0.0)
                    at = free_at + self.delay
                queue.put_nowait((at, data))
        except OSError:
            pass
        finally:
            queue.put_nowait((0.0, b""))
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await sender
            sender.cancel()
            writer.close()
