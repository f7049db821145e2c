"""Structured logging: JSON lines for machines, plain text for a terminal."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

LOGGER = "runloop"
_RESERVED = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _RESERVED and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in record.__dict__.items()
                         if k not in _RESERVED and not k.startswith("_"))
        base = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname:<7} {record.getMessage()}"
        text = f"{base} {extra}" if extra else base
        return text + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


def configure(level: str = "info", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger(LOGGER)
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def get(name: str) -> logging.Logger:
    return logging.getLogger(f"{LOGGER}.{name}")
