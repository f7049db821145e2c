"""Incremental Server-Sent Events decoding and encoding (pure: bytes in, events out).

The decoder accepts any chunking of the byte stream — a line split across chunks, CRLF split
between two chunks, many events in one chunk — and LF, CR or CRLF line endings, as the SSE
spec allows.
"""

from __future__ import annotations

from typing import NamedTuple

import orjson

from ..errors import UpstreamTooLarge

# What holding one data line costs beyond its bytes (a str object and its slot in the list):
# an event's size is what it holds, so an endless run of empty or tiny data lines, counted by
# their values alone (0 or 2 bytes each), cannot hold gigabytes under a limit of megabytes
LINE_COST = 64


class SSEEvent(NamedTuple):
    data: str
    event: str | None = None
    id: str | None = None

    @property
    def is_done(self) -> bool:
        return self.data.strip() == "[DONE]"


class SSEDecoder:
    """Feed bytes, get complete events; ``flush()`` at end of stream yields a trailing event.
    ``limit``: the most an event (its lines not ended yet, its data so far, each data line
    counted with what holding it costs, ``LINE_COST``) may hold — an upstream that streams
    without ever ending a line or an event raises UpstreamTooLarge there, not after holding
    all it sends."""

    def __init__(self, limit: int | None = None) -> None:
        self._parts: list[bytes] = []  # a line not ended yet, as it arrived (never re-copied)
        self._pending_cr = False
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None
        self._limit = limit
        self._pending = 0  # bytes of the line not ended yet
        self._data_bytes = 0  # bytes of the event's data so far

    @property
    def held(self) -> int:
        """The bytes of the event being read: its line not ended yet and its data so far."""
        return self._pending + self._data_bytes

    def _check(self) -> None:
        if self._limit is not None and self._pending + self._data_bytes > self._limit:
            raise UpstreamTooLarge(f"an event of the upstream's stream exceeds {self._limit} "
                                   f"bytes (server.max_answer_bytes)")

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self._pending_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]  # the LF half of a CRLF split across chunks
        self._pending_cr = False
        if b"\n" not in chunk and b"\r" not in chunk:
            if chunk:
                self._parts.append(chunk)  # no line ends here: wait, in linear time
                self._pending += len(chunk)
                self._check()
            return []
        buf = b"".join([*self._parts, chunk]) if self._parts else chunk
        self._parts, self._pending = [], 0
        events: list[SSEEvent] = []
        start = 0
        n = len(buf)
        lf = -2  # the next LF at or after start (-1: none): found once, not per CR line
        while start < n:
            if lf != -1 and lf < start:
                lf = buf.find(b"\n", start)
            cr = buf.find(b"\r", start, lf if lf != -1 else n)
            if cr != -1:
                end, nxt = cr, cr + 1
                if nxt < n and buf[nxt] == 0x0A:
                    nxt += 1
                elif nxt == n:
                    self._pending_cr = True
            elif lf != -1:
                end, nxt = lf, lf + 1
            else:
                break
            event = self._line(buf[start:end])
            if event is not None:
                events.append(event)
            start = nxt
        if start < n:
            self._parts.append(buf[start:])
            self._pending = n - start
            self._check()
        return events

    def flush(self) -> list[SSEEvent]:
        events = []
        if self._parts:
            line = b"".join(self._parts)
            self._parts, self._pending = [], 0
            event = self._line(line)
            if event is not None:
                events.append(event)
        event = self._line(b"")
        if event is not None:
            events.append(event)
        return events

    def _line(self, raw: bytes) -> SSEEvent | None:
        if not raw:
            if not self._data and self._event is None:
                return None
            event = SSEEvent("\n".join(self._data), self._event, self._id)
            self._data, self._event, self._data_bytes = [], None, 0
            return event
        line = raw.decode("utf-8", errors="replace")
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._data_bytes += len(raw) + LINE_COST
            self._check()
        elif name == "event":
            self._event = value
        elif name == "id":
            self._id = value
        return None


def encode_event(data: bytes | str, event: str | None = None) -> bytes:
    payload = data.encode() if isinstance(data, str) else data
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + payload + b"\n\n"


def encode_json(obj: object) -> bytes:
    return encode_event(orjson.dumps(obj))


DONE = b"data: [DONE]\n\n"
