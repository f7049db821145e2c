"""Every parameter the admin API and the inspector read — query, path or form — parsed here
and only here, each by its declared kind and bounds. A value that does not parse, or lies out
of bounds, is an ``InvalidRequest`` (400) naming the parameter, never a 500; a name not
declared below is a programming error. ``tests/test_params.py`` sends hostile values of every
declared parameter to every admin route and inspector page (a page added later is swept too).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

from starlette.requests import Request

from ..errors import InvalidRequest
from .listing import ORDERS, SORTS, WITHIN_MS

_DIGITS = re.compile(r"[0-9]{1,12}")  # ASCII digits only: str.isdigit() takes "²" and "٣"


class Field(NamedTuple):
    kind: str  # "int", "text", "flag" or "choice" (one of CHOICES[name])
    low: int = 0  # int: the least value; text: the least length
    high: int = 0  # int: the greatest value; text: the greatest length


FIELDS: dict[str, Field] = {
    # query parameters
    "tenant": Field("text", 0, 256),
    "id": Field("text", 0, 4096),
    "q": Field("text", 0, 256),
    "page": Field("int", 0, 100_000),
    "offset": Field("int", 0, 10_000_000),
    "limit": Field("int", 1, 500),
    "pos": Field("int", 0, 10_000_000),
    "messages": Field("flag"),
    "points": Field("flag"),
    "model": Field("text", 0, 256),
    "sort": Field("choice"),
    "order": Field("choice"),
    "within": Field("choice"),
    # path parameters
    "session_id": Field("text", 1, 4096),
    # form fields
    "key": Field("text", 0, 1024),
    "csrf": Field("text", 0, 128),
}
CHOICES: dict[str, tuple[str, ...]] = {
    "sort": tuple(SORTS), "order": ORDERS, "within": ("", *WITHIN_MS)}
FLAGS = {"1": True, "true": True, "0": False, "false": False, "": False}


def _field(name: str) -> Field:
    field = FIELDS.get(name)
    if field is None:
        raise KeyError(f"parameter {name!r} is not declared in ops.params.FIELDS")
    return field


def _text(name: str, raw: str) -> str:
    field = _field(name)
    if field.kind != "text":
        raise KeyError(f"parameter {name!r} is not text")
    if not field.low <= len(raw) <= field.high:
        raise InvalidRequest(f"{name} must be {field.low} to {field.high} characters",
                             param=name)
    if "\x00" in raw:
        raise InvalidRequest(f"{name} must not contain NUL", param=name)
    return raw


def _int(name: str, raw: str) -> int:
    field = _field(name)
    if field.kind != "int":
        raise KeyError(f"parameter {name!r} is not an integer")
    if not _DIGITS.fullmatch(raw) or not field.low <= int(raw) <= field.high:
        raise InvalidRequest(f"{name} must be a whole number from {field.low} to {field.high}",
                             param=name)
    return int(raw)


def text(request: Request, name: str, default: str = "") -> str:
    """A query parameter that is text (``default`` when absent)."""
    raw = request.query_params.get(name)
    return default if raw is None else _text(name, raw)


def integer(request: Request, name: str, default: int) -> int:
    """A query parameter that is a whole number within its bounds (``default`` when absent
    or empty)."""
    raw = request.query_params.get(name)
    return default if raw in (None, "") else _int(name, str(raw))


def flag(request: Request, name: str) -> bool:
    raw = request.query_params.get(name, "")
    if _field(name).kind != "flag":
        raise KeyError(f"parameter {name!r} is not a flag")
    if raw not in FLAGS:
        raise InvalidRequest(f"{name} must be one of 1, true, 0, false", param=name)
    return FLAGS[raw]


def choice(request: Request, name: str, default: str) -> str:
    """A query parameter that is one of its declared choices (``default`` when absent)."""
    if _field(name).kind != "choice":
        raise KeyError(f"parameter {name!r} is not a choice")
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if raw not in CHOICES[name]:
        shown = ", ".join(c or "(empty)" for c in CHOICES[name])
        raise InvalidRequest(f"{name} must be one of {shown}", param=name)
    return raw


def path(request: Request, name: str) -> str:
    """A path parameter (always text)."""
    return _text(name, str(request.path_params.get(name, "")))


def form_text(form: Mapping[str, str], name: str) -> str:
    """A field of a form already read (``inspector``'s small urlencoded forms)."""
    return _text(name, form.get(name, ""))
