"""Structured logging: JSON lines for machines, plain text for a terminal."""

from __future__ import annotations

import atexit
import json
import logging
import logging.handlers
import queue
import sys
import threading
import time
import traceback
from typing import Any

import orjson

from ..conversation.identity import log_name

LOGGER = "runloop"
SESSION_FIELDS = ("session",)  # a log line's fields that name a session: written by log_name
_RESERVED = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
TRACE_FRAMES = 12  # the innermost frames of a traceback a log line shows
TRACE_CHARS = 4000  # and at most this much of it: a recursion 900 deep was 131 KB a line
# what a field's text may hold: a name a client gives (a model's) 64 characters, any other
# 600 (an error's text, an upstream's redacted URL) — so no line writes more of what a
# request carried, whichever call logs it (the compaction line wrote a model whole)
CLIENT_NAMED = {"model": 64}
FIELD_CHARS = 600
OWN = ("ts", "level", "logger", "msg", "exc")  # a formatter's own: a field never replaces one


def bounded_trace(exc_info: Any) -> str:
    """A traceback as a log line carries it: its innermost frames, within a size (every
    formatter's, so no exception logged anywhere writes more)."""
    kind, value, tb = exc_info
    text = "".join(traceback.format_exception(kind, value, tb, limit=-TRACE_FRAMES))
    return text if len(text) <= TRACE_CHARS else "…" + text[-TRACE_CHARS:]


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """A record's own fields as every formatter writes them: a session by ``log_name``."""
    out = {k: v for k, v in record.__dict__.items()
           if k not in _RESERVED and not k.startswith("_")}
    for k in SESSION_FIELDS:
        if isinstance(out.get(k), str):
            out[k] = log_name(out[k])
    for k, v in out.items():
        limit = CLIENT_NAMED.get(k, FIELD_CHARS)
        if isinstance(v, (list, tuple, dict)):  # what it holds, as it will be written
            text = orjson.dumps(v, default=str)
            if len(text) > limit:
                out[k] = text[:limit - 1].decode("utf-8", "ignore") + "…"
        elif isinstance(v, str) and len(v) > limit:
            out[k] = v[:limit - 1] + "…"
    return {f"{k}_field" if k in OWN else k: v for k, v in out.items()}


class _Bounded(logging.Formatter):
    def formatException(self, ei: Any) -> str:  # noqa: N802 - logging's name
        return bounded_trace(ei)


class JsonFormatter(_Bounded):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def _plain(value: Any) -> str:
    """A field's value as a text line writes it: quoted and escaped (as JSON) when it holds a
    control character or a space, so a client's model name of ``"m\nforged line"`` cannot
    write a second line nor pass for another field."""
    text = str(value)
    if any(c == " " or not c.isprintable() for c in text):  # controls, line separators
        return json.dumps(text)  # ASCII: every character past it escaped, U+2028 too
    return text


class TextFormatter(_Bounded):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={_plain(v)}" for k, v in fields(record).items())
        base = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname:<7} {record.getMessage()}"
        text = f"{base} {extra}" if extra else base
        return text + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


class _Enqueue(logging.handlers.QueueHandler):
    """What a logging call does in the caller's thread (the event loop's, most often): its
    message rendered, the record queued. Formatting and the write to stderr are the
    listener thread's, so a request that logs a line per window step, or a stderr pipe
    that is full, costs the event loop no more than the queueing."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        record.msg, record.args = record.getMessage(), None  # its arguments, as they are now
        return record  # exc_info kept: the writer's formatter bounds its traceback


class _Writer(logging.handlers.QueueListener):
    def handle(self, record: Any) -> None:
        if isinstance(record, threading.Event):  # flush(): all before it is written
            record.set()
            return
        super().handle(record)


_writer: _Writer | None = None
FLUSH_WAIT_S = 5.0


def configure(level: str = "info", fmt: str = "json") -> None:
    """The ``runloop`` loggers at ``level``, written as ``fmt`` to stderr by a thread of
    their own (``_Enqueue``); a later call replaces the earlier one's writer."""
    global _writer
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    lines: queue.SimpleQueue[Any] = queue.SimpleQueue()
    writer = _Writer(lines, handler)
    writer.start()
    root = logging.getLogger(LOGGER)
    root.handlers[:] = [_Enqueue(lines)]
    root.setLevel(level.upper())
    root.propagate = False
    if _writer is not None:
        _writer.stop()
    else:
        atexit.register(flush)
    _writer = writer


def stream_handler() -> logging.StreamHandler | None:  # type: ignore[type-arg]
    """The handler ``configure``'s writer writes through (its stream can be set)."""
    return None if _writer is None else _writer.handlers[0]  # type: ignore[return-value]


def flush() -> None:
    """Every line logged before this call written (a server's shutdown, a test's read)."""
    if _writer is not None and _writer._thread is not None:
        done = threading.Event()
        _writer.queue.put_nowait(done)
        done.wait(FLUSH_WAIT_S)


class _Named(logging.LoggerAdapter):  # type: ignore[type-arg]
    """The project's loggers: a record's session is its digest from the moment it is made
    (``log_name``), so no handler an operator adds — not only these formatters — writes a
    session's id."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = kwargs.get("extra")
        if extra and any(isinstance(extra.get(k), str) for k in SESSION_FIELDS):
            kwargs["extra"] = {**extra, **{k: log_name(extra[k]) for k in SESSION_FIELDS
                                           if isinstance(extra.get(k), str)}}
        return msg, kwargs


def get(name: str) -> logging.LoggerAdapter:  # type: ignore[type-arg]
    return _Named(logging.getLogger(f"{LOGGER}.{name}"), {})
