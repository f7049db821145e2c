"""The extractive summariser (pure): a deterministic digest of run loops, no LLM.

Per loop left out: the question, the answer, and the identifiers the loop produced — ids,
paths, numbers, e-mail addresses, names with digits — taken from the user's words first, then
the calls' arguments (every short value the agent passed a tool, digits or not: a booking code,
an airport, a surname), the agent's replies, then the values of the tool results (not their
field names), strongest first: codes mixing letters and digits, then paths, addresses, dates
and long numbers, then a few amounts (short numbers and prices: they measure a record more
often than they name one, but a later reply quotes a fare or a refund); clock times and row
coordinates are left out.
Deduplicated across the whole summary; an identifier inside a longer one kept (``7091239``
in ``gift_card_7091239``) or in the system prompt, which the model always sees, is not
repeated.

Rolling and append-only: the digest of loops [e, e') is a block (their lines, then the
identifiers they add; none when they add nothing) appended to the summary of [0, e), so while
it fits in ``max_tokens`` the summary's text only grows and a provider's prefix cache keeps
serving what the window already showed. A summary with nothing to say is "" (the window then
shows none: a heading over nothing would ride in every later request). Past ``max_tokens``
it is rewritten once as a single block, condensed to ``CONDENSE_SHARE`` of the budget so that
the next batches append again: the oldest loop lines go first, and the identifiers stay
longest (they are what a later reply quotes).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import orjson

from ..conversation.messages import Message, text_of, tool_calls_of
from .shown import Shown

VERSION = "extractive-6"
IDS_HEADER = "Identifiers:"
_IDS_HEADERS = (IDS_HEADER, "Identifiers from them:")  # and what extractive-3 wrote
QUESTION_CHARS = 80
ANSWER_CHARS = 120
IDS_PER_LOOP = 24  # chosen on the support traces' tuning half (14 → 24: the careful reader's
# past retention 80.3% → 88.5% for the same strict saving, with globex's replies cut to 32)
RESULT_IDS = 4 * IDS_PER_LOOP  # kept of one tool result, per strength: a carried session
# holds these for every result it read, and a digest takes at most IDS_PER_LOOP of a loop
ARG_CHARS = 80  # an argument value longer than this, or with spaces, is read for identifiers
CONDENSE_SHARE = 0.5  # of the budget, after a rewrite: the next batches append again
_TOKEN = re.compile(r"[^\s,;()\[\]{}<>=\"'`|]+")
_TRIM = ".:!?*"
_MARK = re.compile(r"[\d/@]")
_DATE = re.compile(r"\d{4}-\d\d-\d\d")
_CLOCK = re.compile(r"\d:\d\d")
# of a result's short numbers, the amounts (a fare, a refund, a count: ``250``, ``$54.04``),
# not a row's coordinates or a clock (``0-0``, ``11:00``), at most AMOUNTS a result
_AMOUNT = re.compile(r"[$€£]?\d{1,4}(?:\.\d{1,2})?")
AMOUNTS = 8
_OPENS_JSON = re.compile(r"\s*[\[{]")
_TOKEN_OR_KEY = re.compile(r"""([^\s,;()\[\]{}<>="'`|]+)("\s*:)?""")  # a key: ("...":)


def identifiers(text: str) -> list[str]:
    """Identifier-like tokens of ``text``, in order: with a digit, a path separator or an @."""
    return _identifiers(_TOKEN.findall(text))


def _identifiers(tokens: Iterable[str]) -> list[str]:
    out = []
    for t in tokens:
        if _MARK.search(t):  # the trimmed characters are none of these
            t = t.strip(_TRIM)
            if 3 <= len(t) <= 80:
                out.append(t)
    return out


def leaves(value: Any) -> list[str]:
    """The scalar values of parsed JSON, in order (not its keys, nor booleans and nulls).
    Walked with a stack of its own: a tool's output nested a thousand deep is a string the
    request's own bounds never see, and must not exhaust Python's."""
    out: list[str] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(reversed(list(v.values())))
        elif isinstance(v, list):
            stack.extend(reversed(v))
        elif not (isinstance(v, bool) or v is None):
            out.append(str(v))
    return out


def _json(text: str) -> list[str] | None:
    """The values of ``text`` when it is a JSON object or array, else None."""
    if not _OPENS_JSON.match(text):
        return None
    try:
        return leaves(orjson.loads(text))
    except orjson.JSONDecodeError:
        return None


def argument_values(arguments: str) -> list[str]:
    """What a tool call passed: each short value whole (``HXDUBJ``, ``SEA``, ``Smith``, ids),
    and the identifiers of longer or spaced ones (a thought, an expression, a query)."""
    values = _json(arguments)
    if values is None:
        return identifiers(arguments)
    out: list[str] = []
    for v in values:
        v = v.strip()
        if 3 <= len(v) <= ARG_CHARS and not any(ch.isspace() for ch in v):
            out.append(v)
        else:
            out += identifiers(v)
    return out


def result_identifiers(text: str) -> list[str]:
    """A tool result's identifiers, in order, not counting a JSON result's field names
    (``"address1":`` names no record): a token closed by a quote and a colon is a key. Read
    as text, not parsed: a result may be megabytes, and this builds none of its objects."""
    if not _OPENS_JSON.match(text):
        return identifiers(text)
    return _identifiers(t for t, key in _TOKEN_OR_KEY.findall(text) if not key)


def strength(ident: str) -> int:
    """How surely a tool result's identifier names a thing a later turn may come back to,
    0 (surest) to 2: what the agent did not repeat is ranked by its look. Codes mixing letters
    and digits (order ids, user names with numbers, SKUs) come first; then dates, paths,
    addresses and long numbers; then short numbers, prices, clock times and timestamps, which
    measure a record more often than they name one."""
    if _DATE.fullmatch(ident):
        return 1
    if _CLOCK.search(ident):
        return 2
    digits = sum(ch.isdigit() for ch in ident)
    if digits and any(ch.isalpha() for ch in ident):
        return 0
    return 1 if digits >= 5 or "/" in ident or "@" in ident else 2


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


class Found(NamedTuple):
    """The identifiers one message holds, by where they stand in a digest's order."""

    user: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    final: tuple[str, ...] = ()
    results: tuple[tuple[str, ...], ...] = ((), (), ())  # a tool result's, by strength


def found_in(m: Message) -> Found:
    """What ``pick`` needs of a message (the regex runs once per message, so a caller that
    keeps these picks over any span of messages without reading their texts again)."""
    role = m.get("role")
    if role == "user":
        return Found(user=tuple(identifiers(text_of(m.get("content")))))
    if role == "tool":
        ranked: tuple[dict[str, None], dict[str, None], dict[str, None]] = ({}, {}, {})
        for x in result_identifiers(text_of(m.get("content"))):
            s = strength(x)
            if len(ranked[s]) < (RESULT_IDS if s < 2 else AMOUNTS) \
                    and (s < 2 or _AMOUNT.fullmatch(x)):
                ranked[s][x] = None
        return Found(results=tuple(map(tuple, ranked)))
    if role != "assistant":
        return Found()
    calls = tool_calls_of(m)
    if calls:
        return Found(args=tuple(x for c in calls for x in argument_values(
            str((c.get("function") or {}).get("arguments") or ""))))
    return Found(final=tuple(identifiers(text_of(m.get("content")))))


def pick(found: Sequence[Found], results: Iterable[Found] | None = None,
         cap: int = IDS_PER_LOOP, known: str | Shown = "") -> list[str]:
    """Up to ``cap`` identifiers of a span of messages, without repeats: the users' words,
    the calls' arguments and the final replies first, in order; then the tool results',
    strongest first. ``results``, when given, holds the tool results' (``found`` then need
    not): it is read lazily, only as far as the cap needs. What ``known`` holds (the system
    prompt) is skipped, and so is one inside a longer identifier taken: the longer one
    shows it (``7091239`` in ``gift_card_7091239``), whichever came first."""
    out: list[str] = []
    seen: set[str] = set()
    shows = known if isinstance(known, Shown) else Shown(known)

    def full(ids: tuple[str, ...]) -> bool:
        for x in ids:
            if x in seen or x in shows:
                continue
            seen.add(x)
            if any(x in y for y in out):
                continue
            out[:] = [y for y in out if y not in x]  # the shorter ones x shows
            out.append(x)
            if len(out) >= cap:
                return True
        return False

    for field in ("user", "args", "final"):
        if any(full(getattr(f, field)) for f in found):
            return out
    read: list[Found] = []
    for f in found if results is None else results:
        read.append(f)
        if full(f.results[0]):
            return out
    for strength in (1, 2):  # then the weaker kinds, each over every result read
        if any(full(f.results[strength]) for f in read):
            break
    return out


def loop_digest(messages: Sequence[Message], known: str | Shown = ""
                ) -> tuple[str, list[str]]:
    """One loop as a line (question → answer) and the identifiers it produced (none that
    ``known`` holds)."""
    users = [text_of(m.get("content")) for m in messages if m.get("role") == "user"]
    finals = [text_of(m.get("content")) for m in messages
              if m.get("role") == "assistant" and not tool_calls_of(m)]
    calls = [c for m in messages for c in tool_calls_of(m)]
    line = f"- Q: {_clip(' / '.join(users), QUESTION_CHARS)}"
    if calls:
        names = sorted({str((c.get("function") or {}).get("name") or "") for c in calls})
        line += f" [tools: {', '.join(n for n in names if n)}]"
    line += f" → A: {_clip(finals[-1] if finals else '(no answer)', ANSWER_CHARS)}"
    return line, pick([found_in(m) for m in messages], known=known)


def parse(summary: str | None) -> tuple[list[str], list[str]]:
    """A digest's loop lines and identifiers (of all its blocks), to roll it on."""
    if not summary:
        return [], []
    lines: list[str] = []
    ids: list[str] = []
    for ln in summary.splitlines():
        head = next((h for h in _IDS_HEADERS if ln.startswith(h)), None)
        if head is not None:
            ids += ln[len(head):].split()
        elif ln.startswith("- "):
            lines.append(ln)
    return lines, ids


def block(lines: list[str], ids: list[str]) -> str:
    """Loop lines and the identifiers they add, as the lines of one block (the window shows
    a summary under a heading of its own: a digest carries none)."""
    return "\n".join([*lines, *([f"{IDS_HEADER} {' '.join(ids)}"] if ids else [])])


def roll(previous: str | None, loops: Sequence[Sequence[Message]], max_tokens: int,
         count: Callable[[str], int], lines_too: bool = True, known: str = "") -> str:
    """The summary of what ``previous`` covered and ``loops`` after it, within ``max_tokens``
    (``count`` tells a text's tokens): ``previous`` with a block appended while that fits,
    else everything rewritten into ``CONDENSE_SHARE`` of the budget; ``previous`` unchanged
    when the loops add nothing, and "" for a summary with nothing to say. Without
    ``lines_too`` the blocks hold the identifiers alone (no question → answer line per
    loop). An identifier the summary or ``known`` (the system prompt) shows is not added."""
    previous = previous or ""
    new_lines, new_ids = [], []
    # the summary (and the identifiers added) and the prompt: each read into a set once
    # (shown.py); a string grown by each identifier added and searched for each was
    # quadratic in the loops
    shown = Shown(previous)
    prompt = Shown(known)
    for loop in loops:
        line, found = loop_digest(loop, prompt)
        if lines_too:
            new_lines.append(line)
        for x in found:
            if x not in shown:
                new_ids.append(x)
                shown.add(x)
    added = block(new_lines, new_ids)
    if not added:
        return previous
    text = f"{previous}\n{added}" if previous else added
    if count(text) <= max_tokens:
        return text
    lines, ids = parse(previous)
    return condensed([*lines, *new_lines], [*ids, *new_ids],
                     max(1, int(max_tokens * CONDENSE_SHARE)), count)


def condensed(lines: list[str], ids: list[str], max_tokens: int,
              count: Callable[[str], int]) -> str:
    """One block within ``max_tokens``: the oldest loop lines leave first, the identifiers
    stay longest."""
    text = block(lines, ids)
    if count(text) > max_tokens and len(lines) > 1:
        # the oldest loop lines leave first (their identifiers stay): as few as fit, found
        # by halving (counting the block once per line dropped was quadratic)
        low, high = 1, len(lines) - 1  # lines[high:] is one line: the loop below, if not
        while low < high:
            mid = (low + high) // 2
            if count(block(lines[mid:], ids)) <= max_tokens:
                high = mid
            else:
                low = mid + 1
        lines = lines[low:]
        text = block(lines, ids)
    while count(text) > max_tokens and ids:
        ids = ids[len(ids) // 8 + 1:]  # then the oldest identifiers
        text = block(lines, ids)
    while count(text) > max_tokens and lines:
        lines = lines[:-1]  # a newest line longer than the whole budget
        text = block(lines, ids)
    return text
