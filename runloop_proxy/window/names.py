"""Names: what a reviewer reads as an identifier in a text, and whether a text shows one
(pure). One vocabulary for the careful reference reader (``retention``), for what the window
keeps of an agent's own words when it trims or drops them (``forms``), and for ranking what
``search_history`` returns (a message that holds the query as a whole token first).
"""

from __future__ import annotations

import re
from typing import Any

from ..conversation.messages import NOT_JSON, Message, embedded_json, text_of, tool_calls_of
from .digest import leaves

# runs of identifier characters, then what inside them names something
_RUN = re.compile(r"[A-Za-z0-9_./\-$@~+]+")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_PRICE = re.compile(r"\$(\d{1,3}(?:,\d{3})+(?:\.\d+)?)")
_CAMEL = re.compile(r"[a-z][A-Z]|[A-Z][a-z]+[A-Z]")
_EDGE = "./-:~+"
_WORD_CHAR = re.compile(r"\w")
_FRACTION = re.compile(r"\.(\d+)")


def names(text: str) -> list[str]:
    """The names a reviewer reads in a text, in order: paths and dotted names whole,
    snake_case and camelCase names, names mixing letters and digits, and the numbers in it
    (of three characters or more) — a price as its number (``$1,250.00`` is ``1250``). What
    the careful reference reader counts, and what the window keeps of the agent's own words
    when it trims or drops them."""
    out = []
    text = _PRICE.sub(lambda m: m.group(1).replace(",", ""), text)
    for run in _RUN.findall(text):
        run = run.strip(_EDGE).removeprefix("$").strip(_EDGE)
        if len(run) < 3:
            continue
        named = "/" in run or "_" in run or _CAMEL.search(run) is not None \
            or ("." in run and not _NUMBER.fullmatch(run))
        if named or (any(ch.isdigit() for ch in run) and any(ch.isalpha() for ch in run)):
            out.append(run)
        out += [_whole(n) for n in _NUMBER.findall(run) if len(_whole(n)) >= 3]
    return out


def _whole(number: str) -> str:
    """A number without a fraction of zeros (``594.00`` is the price ``594``)."""
    whole, _, fraction = number.partition(".")
    return whole if fraction and not fraction.strip("0") else number


def holds(text: str, ref: str) -> bool:
    """Whether ``text`` shows ``ref`` as a whole token: not inside a longer word or number
    (``594`` is not in ``6594``; ``separable.py`` is in ``astropy/modeling/separable.py``)."""
    start = text.find(ref)
    word_start, word_end = bool(_WORD_CHAR.match(ref[:1])), bool(_WORD_CHAR.match(ref[-1:]))
    # each find of an overlapping occurrence compares the whole ref again: a periodic ref
    # ("a" * 1000 in "a" * 900_000) would cost len(text) * len(ref); what one call may
    # compare is bounded by the text instead (past it, the text reads as not holding it)
    budget = 4 * len(text) + 4096
    while start >= 0:
        budget -= len(ref)
        if budget < 0:
            return False
        end = start + len(ref)
        before = text[start - 1] if start else ""
        after = text[end] if end < len(text) else ""
        fraction = _FRACTION.match(text, end) if ref[-1:].isdigit() else None
        if not (word_start and before and _WORD_CHAR.match(before)) \
                and not (word_end and after and _WORD_CHAR.match(after)) \
                and not (fraction and fraction.group(1).strip("0")) \
                and not (ref[:1].isdigit() and before == "."
                         and text[start - 2:start - 1].isdigit()):
            return True
        start = text.find(ref, start + 1)
    return False


def decoded(m: Message) -> str:
    """What a message shows, as its reader reads it: its text, its calls' ids and names, their
    arguments as sent, and their argument values decoded (``"import shutil\\nshutil.rmtree"``
    holds ``shutil.rmtree`` once the JSON escape is read as the newline it is)."""
    parts = [text_of(m.get("content"))]
    for c in tool_calls_of(m):
        fn: Any = c.get("function") or c.get("custom") or {}
        args = fn.get("arguments") or fn.get("input") or ""
        parts += [str(c.get("id") or ""), str(fn.get("name") or ""), str(args)]
        value = embedded_json(args) if isinstance(args, str) and args else NOT_JSON
        if value is not NOT_JSON:
            parts += leaves(value)
    return "\n".join(parts)
