"""``serve``'s options, each also a ``RUNLOOP_<NAME>`` environment variable: one table read by
the command line (``cli``) and by the worker processes ``serve --workers N`` starts
(``app.app_from_env``), so neither imports the other."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from .config import Settings

ENV_PREFIX = "RUNLOOP_"
LOG_LEVELS = ("debug", "info", "warning", "error")


class BadValue(argparse.ArgumentTypeError, ValueError):
    """An option's value that is none of its kind: argparse says why in one line; the
    environment's reader (a worker's) sees a ValueError like any other bad number."""


class NotAPort(BadValue):
    """A port that is none."""


def port_number(text: str) -> int:
    """A TCP port (0: any free one), from the command line or the environment."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 65535:
        raise NotAPort(f"{text!r} is not a port number (0-65535)")
    return n


def at_least(low: int) -> Callable[[str], int]:
    """A whole number no less than ``low``, from the command line or the environment."""
    def whole(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = low - 1
        if n < low:
            raise BadValue(f"{text!r} is not a whole number of at least {low}")
        return n
    return whole


def one_of(*choices: str) -> Callable[[str], str]:
    """One of ``choices``: checked for a value from the environment too (argparse checks its
    choices only on the command line)."""
    def choice(text: str) -> str:
        if text not in choices:
            raise BadValue(f"{text!r} is not one of {', '.join(choices)}")
        return text
    return choice


class Option(NamedTuple):
    flags: tuple[str, ...]  # the first is the option's name; the rest are old spellings
    field: str  # the Settings field
    env: str  # RUNLOOP_<env>
    kind: Callable[[str], Any]  # str, port_number, at_least(n), one_of(...)
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    fallback_env: str | None = None  # a variable read when RUNLOOP_<env> is unset


SERVE_OPTIONS: tuple[Option, ...] = (
    Option(("--host",), "host", "HOST", str, None, "listen address (default 127.0.0.1)"),
    Option(("--port",), "port", "PORT", port_number, None, "listen port (default 8080)",
           metavar="N"),
    Option(("--upstream",), "upstream", "UPSTREAM", str, None,
           "upstream base URL, e.g. https://api.openai.com/v1 (pass-through mode)",
           metavar="URL"),
    Option(("--upstream-format",), "upstream_format", "UPSTREAM_FORMAT",
           one_of("any", "anthropic", "chat"), None,
           "what --upstream speaks: any (every API goes as it came, the default), anthropic "
           "(Anthropic's API), chat (chat completions only: a /v1/messages client, Claude "
           "Code, is translated to and from them)", choices=("any", "anthropic", "chat")),
    Option(("--config",), "config_dir", "CONFIG", str, None,
           "config directory (runloop.toml + tenants/*.toml)", metavar="DIR"),
    Option(("--redis-url",), "redis_url", "REDIS_URL", str, None,
           "Redis URL (redis://, rediss://, unix://, redis+cluster://); none: an embedded "
           "redis-server under --data-dir", metavar="URL", fallback_env="REDIS_URL"),
    Option(("--data-dir",), "data_dir", "DATA_DIR", str, ".runloop",
           "where the embedded Redis keeps its data (default .runloop)", metavar="DIR"),
    Option(("--admin-key",), "admin_key", "ADMIN_KEY", str, None,
           "the key of the admin API and the session inspector (/admin/ui); none: both are "
           "off unless the config file sets server.admin_key", metavar="KEY"),
    Option(("--log-level",), "log_level", "LOG_LEVEL", one_of(*LOG_LEVELS), "info",
           "default info", choices=LOG_LEVELS),
    Option(("--log-format",), "log_format", "LOG_FORMAT", one_of("json", "text"), "json",
           "default json", choices=("json", "text")),
    Option(("--default-context-window", "--context-window"), "context_window",
           "CONTEXT_WINDOW", at_least(1024), None,
           "context window assumed for models neither the config nor the proxy knows (known "
           "models keep their own); --context-window is the old spelling", metavar="N"),
    Option(("--summary-model",), "summary_model", "SUMMARY_MODEL", str, None,
           'pass-through mode: "extractive" or a model that summarises the loops an omission '
           "leaves out (tenant files set policy.summary_model)", metavar="M"),
    Option(("--cache-mb",), "cache_mb", "CACHE_MB", at_least(1), None,
           "memory the per-process caches may use in all (default 128)", metavar="N"),
    Option(("--workers",), "workers", "WORKERS", at_least(1), 1,
           "uvicorn worker processes (default 1)", metavar="N"),
)


def env_name(option: Option) -> str:
    return ENV_PREFIX + option.env


def env_value(option: Option, environ: Mapping[str, str] | None = None) -> str | None:
    """The option's value in the environment, as a string (None: unset)."""
    environ = os.environ if environ is None else environ
    value = environ.get(env_name(option))
    if value is None and option.fallback_env:
        value = environ.get(option.fallback_env)
    return value


def settings_from_env(environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from ``RUNLOOP_*`` alone: what a worker process started by uvicorn
    (``--workers N``) reads. Raises ValueError on a value that is not a number."""
    values: dict[str, Any] = {}
    for option in SERVE_OPTIONS:
        raw = env_value(option, environ)
        values[option.field] = option.default if raw is None else option.kind(raw)
    return Settings(**values)


def settings_to_env(settings: Settings) -> dict[str, str]:
    """The variables that give a worker process these settings."""
    return {env_name(o): str(getattr(settings, o.field)) for o in SERVE_OPTIONS
            if getattr(settings, o.field) is not None}
