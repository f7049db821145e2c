"""The policy the mechanism tests run under, said once.

The built-in defaults are tuned for what a short-turn agent's next reply needs (every turn
omits the one before it, a past question or answer is cut to 16 tokens, the extractive digest
stands in for what is left out). A test of a lever's mechanics — a reduction's ledger, an
omission batch, a marker, the inspector's rendering of a reduced loop — needs past loops kept
in view, long enough messages and no summary unless it turns one on: it states that by running
under ``MECHANISM`` (``mechanism()`` for a ``Policy``, ``mechanism_toml()`` for a tenant file,
``make_proxy(policy=MECHANISM)`` for a proxy, ``mechanism_set()`` for ``runloop-proxy
replay``), and says its own fields on top. Tests of what the defaults do for a user run on
``Policy()`` itself."""

from __future__ import annotations

from typing import Any

from runloop_proxy.config import Policy

# the defaults these tests were written against, before the tuned ones
MECHANISM: dict[str, Any] = {
    "max_run_loops": 10,
    "max_message_length": 125,
    "summary_model": None,
    "summary_lines": True,
}


def mechanism(**fields: Any) -> Policy:
    """``MECHANISM`` with a test's own fields on top."""
    return Policy(**{**MECHANISM, **fields})


def _toml_value(value: Any) -> str:
    if value is None:
        return '""'  # summary_model: a file cannot say null, "" turns summaries off
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def mechanism_toml(**fields: Any) -> str:
    """``MECHANISM`` with a test's own fields on top, as the lines of a [policy] table."""
    return "".join(f"{k} = {_toml_value(v)}\n" for k, v in {**MECHANISM, **fields}.items())


def mechanism_set(**fields: Any) -> list[str]:
    """``MECHANISM`` with a test's own fields on top, as ``runloop-proxy replay`` options
    (``--set FIELD=VALUE`` each; ``summary_model=`` with nothing after it: no summaries)."""
    def value(v: Any) -> str:
        return "" if v is None else _toml_value(v) if isinstance(v, bool) else str(v)
    return [arg for k, v in {**MECHANISM, **fields}.items()
            for arg in ("--set", f"{k}={value(v)}")]
