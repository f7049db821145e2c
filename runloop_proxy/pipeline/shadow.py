"""Shadow comparisons (pure): did the compressed request lead the model to the same next step
as the request the client sent?

A step is what a model's answer decides: the tool calls it makes (each a name and its
arguments in canonical JSON), whether it refused, and its final text. Two steps are compared
on the strongest basis either of them offers, in this order:

- ``tools``: either answer calls a tool. They agree only when both call the same tools with
  the same arguments (canonical JSON: keys sorted, no spaces, ``1.0`` written ``1``), as a
  multiset: parallel calls in another order are the same step.
- ``refusal``: either answer refuses. They agree only when both do.
- ``text``: the final texts, normalised (Unicode NFKC, case-folded, punctuation dropped,
  whitespace collapsed), alike by at least the threshold (``TEXT_THRESHOLD`` unless the
  tenant sets ``policy.shadow_text_threshold``): a word-level ``difflib`` ratio, bounded to
  the first ``MAX_WORDS`` words of each so a long answer costs linear work at most.

Nothing here touches a socket, a clock or Redis; the online call (after the client's answer)
and the offline replay both feed it answers they parsed."""

from __future__ import annotations

import difflib
import json
import math
import re
import threading
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

TEXT_THRESHOLD = 0.8
MAX_WORDS = 2_000


class Outcome(StrEnum):
    AGREE = "agree"
    DIFFER = "differ"
    ERROR = "error"  # the shadow call (or its answer) failed: no comparison


class Basis(StrEnum):
    TOOLS = "tools"
    REFUSAL = "refusal"
    TEXT = "text"


@dataclass(frozen=True)
class ToolStep:
    name: str
    arguments: str  # canonical JSON (or the raw text, stripped, when it is not JSON)


@dataclass(frozen=True)
class Step:
    tools: tuple[ToolStep, ...] = ()
    refusal: bool = False
    text: str = ""


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    basis: Basis
    similarity: float | None = None  # the text basis's ratio, 0..1
    threshold: float | None = None  # the text basis's threshold


def _integral(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


def canonical_args(arguments: str | Mapping[str, Any] | None) -> str:
    """A tool call's arguments as canonical JSON: the same object however it was spelt
    (key order, spacing, escapes, ``2.0`` for ``2``) gives the same string. Arguments that are
    not JSON (a model's broken output) stay their own text, stripped."""
    if arguments is None:
        return "{}"
    if isinstance(arguments, str):
        if not arguments.strip():
            return "{}"
        try:
            value: Any = json.loads(arguments)
        except ValueError:
            return arguments.strip()
    else:
        value = arguments
    return json.dumps(_integral(value), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, allow_nan=True)


_NOT_WORD = re.compile(r"[^\w\s]+")


def normalise(text: str) -> list[str]:
    """A text's words, normalised: NFKC, case-folded, punctuation dropped."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    return _NOT_WORD.sub(" ", folded).split()


def similarity(a: str, b: str) -> float:
    """How alike two final texts are, 0..1 (1 for the same words in the same order)."""
    wa, wb = normalise(a)[:MAX_WORDS], normalise(b)[:MAX_WORDS]
    if not wa and not wb:
        return 1.0
    if wb < wa:  # difflib's ratio depends on the order of its arguments: one order always
        wa, wb = wb, wa
    return difflib.SequenceMatcher(None, wa, wb, autojunk=False).ratio()


def _tool_key(tools: Iterable[ToolStep]) -> list[tuple[str, str]]:
    return sorted((t.name, t.arguments) for t in tools)


def compare(compressed: Step, full: Step, threshold: float = TEXT_THRESHOLD) -> Verdict:
    """The verdict on two answers' steps (the compressed request's, the full one's)."""
    if compressed.tools or full.tools:
        same = _tool_key(compressed.tools) == _tool_key(full.tools)
        return Verdict(Outcome.AGREE if same else Outcome.DIFFER, Basis.TOOLS)
    if compressed.refusal or full.refusal:
        same = compressed.refusal and full.refusal
        return Verdict(Outcome.AGREE if same else Outcome.DIFFER, Basis.REFUSAL)
    ratio = similarity(compressed.text, full.text)
    return Verdict(Outcome.AGREE if ratio >= threshold else Outcome.DIFFER, Basis.TEXT,
                   round(ratio, 4), threshold)


# --- steps out of the three APIs' answers (parsed JSON) ---------------------------------

def _chat_step(body: Mapping[str, Any]) -> Step:
    choices = body.get("choices") or [{}]
    message = choices[0].get("message") or {}
    tools = tuple(
        ToolStep(str((c.get("function") or {}).get("name", "")),
                 canonical_args((c.get("function") or {}).get("arguments")))
        for c in message.get("tool_calls") or [])
    content = message.get("content")
    text = content if isinstance(content, str) else "".join(
        str(p.get("text", "")) for p in content or [] if isinstance(p, dict))
    return Step(tools, bool(message.get("refusal")), text)


def _responses_step(body: Mapping[str, Any]) -> Step:
    tools: list[ToolStep] = []
    texts: list[str] = []
    refusal = False
    for item in body.get("output") or []:
        kind = item.get("type")
        if kind == "function_call":
            tools.append(ToolStep(str(item.get("name", "")),
                                  canonical_args(item.get("arguments"))))
        elif kind == "custom_tool_call":
            tools.append(ToolStep(str(item.get("name", "")), str(item.get("input", "")).strip()))
        elif kind == "message":
            for part in item.get("content") or []:
                if part.get("type") == "refusal":
                    refusal = True
                elif part.get("type") == "output_text":
                    texts.append(str(part.get("text", "")))
    return Step(tuple(tools), refusal, "".join(texts))


def _messages_step(body: Mapping[str, Any]) -> Step:
    tools: list[ToolStep] = []
    texts: list[str] = []
    for block in body.get("content") or []:
        if block.get("type") == "tool_use":
            tools.append(ToolStep(str(block.get("name", "")), canonical_args(block.get("input"))))
        elif block.get("type") == "text":
            texts.append(str(block.get("text", "")))
    return Step(tuple(tools), body.get("stop_reason") == "refusal", "".join(texts))


def step_of_message(message: Mapping[str, Any]) -> Step:
    """The step an answer in the conversation model takes (what every API's reply maps to,
    conversation/messages.py): its calls, its refusal, its text."""
    return _chat_step({"choices": [{"message": message}]})


def step_of(api: str, body: Mapping[str, Any]) -> Step:
    """The step an answer of ``api`` ("chat", "responses", "messages") takes."""
    if api == "chat":
        return _chat_step(body)
    if api == "responses":
        return _responses_step(body)
    if api == "messages":
        return _messages_step(body)
    raise ValueError(f"unknown api {api!r}")


# --- the tenant's spend cap -----------------------------------------------------------------

MICRO = 1_000_000  # the ledger keeps money in millionths of a dollar (integers add exactly)


@dataclass(frozen=True)
class Spend:
    """What a tenant's shadow calls cost on one UTC day."""

    day: str  # YYYY-MM-DD (UTC)
    tokens: int = 0
    usd: float = 0.0

    def add(self, tokens: int, usd: float | None) -> Spend:
        return Spend(self.day, self.tokens + tokens, self.usd + (usd or 0.0))

    @classmethod
    def of_ledger(cls, day: str, tokens: int, micro_usd: int) -> Spend:
        return cls(day, tokens, micro_usd / MICRO)


def micro_usd(usd: float | None) -> int:
    """A call's cost as the ledger adds it: rounded up, so many small calls never add up
    to less than they cost."""
    return math.ceil(round(usd * MICRO, 6)) if usd else 0


def within_cap(spend: Spend, today: str, daily_tokens: int | None,
               daily_usd: float | None) -> bool:
    """Whether another shadow call may go today: a new day starts at zero; a cap unset is no
    cap; a cap reached (not only passed) stops the calls."""
    if spend.day != today:
        return True
    if daily_tokens is not None and spend.tokens >= daily_tokens:
        return False
    return not (daily_usd is not None and spend.usd >= daily_usd)


# --- levers, and what the process keeps of its comparisons ----------------------------------

LEVERS = ("past_loops", "elided", "dropped", "omission", "summary", "hard_limit", "other")
ANY = "any"  # the lever label every comparison is counted under besides its own levers
# two uncompressed answers to one request compared: the model's own agreement, counted
# under this label alone (never under ``any``: it is no comparison of a compressed window)
BASELINE = "baseline"
RECENT = 50  # comparisons kept per tenant for the admin API (the differing ones first to go last)


def levers_of(reduced_loops: int, elided: int, omitted_loops: int,
              kinds: Iterable[str], changed: bool = True) -> tuple[str, ...]:
    """The levers active on a request's window, in ``LEVERS`` order: past loops reduced,
    tool results elided, whole exchanges dropped, loops omitted, a summary in view, the hard
    limit (from the window's counts and the kinds of its compaction events); ``other`` for
    a window changed by none of them (a tool result cut to its share of the budget)."""
    kinds = set(kinds)
    on = {"past_loops": reduced_loops > 0 or "past_loop_reduction" in kinds,
          "elided": elided > 0 or "in_loop_elision" in kinds,
          "dropped": "in_loop_drop" in kinds,
          "omission": omitted_loops > 0 or "loop_omission" in kinds,
          "summary": "summary" in kinds,
          "hard_limit": "hard_truncation" in kinds}
    on["other"] = changed and not any(on.values())
    return tuple(lever for lever in LEVERS if on[lever])


def sampled(rate: float, draw: float) -> bool:
    """Whether a request with a uniform ``draw`` in [0, 1) is shadowed at ``rate``."""
    return draw < rate


@dataclass(frozen=True)
class Record:
    """One shadow comparison, as the admin API and the log line tell it."""

    tenant: str
    session: str | None
    model: str
    levers: tuple[str, ...]
    outcome: Outcome
    basis: Basis | None
    similarity: float | None
    tokens: int
    usd: float | None
    error: str | None = None
    compressed: Step | None = None  # kept only for a disagreement: the two side by side
    full: Step | None = None


def counted_under(record: Record) -> tuple[str, ...]:
    """The lever labels a comparison is counted under: its levers and ``any``; a
    baseline's under ``baseline`` alone."""
    return record.levers if BASELINE in record.levers else (*record.levers, ANY)


@dataclass
class _Tenant:
    counts: dict[tuple[str, str], int]  # (lever, outcome) -> comparisons
    skipped: dict[str, int]  # reason -> requests sampled and not shadowed
    recent: list[Record]


class ShadowBook:
    """What this process keeps of its shadow comparisons: each tenant's by lever and
    outcome, its skips by reason, the last ``RECENT``. Bounded: one entry per configured
    tenant that shadows. The spend the cap reads is every replica's, kept in Redis
    (``RedisStore.shadow_spend``), not here."""

    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant] = {}
        self._lock = threading.Lock()

    def _of(self, tenant: str) -> _Tenant:
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant({}, {}, [])
        return t

    def skip(self, tenant: str, reason: str) -> None:
        with self._lock:
            skipped = self._of(tenant).skipped
            skipped[reason] = skipped.get(reason, 0) + 1

    def add(self, record: Record) -> None:
        with self._lock:
            t = self._of(record.tenant)
            for lever in counted_under(record):
                key = (lever, record.outcome.value)
                t.counts[key] = t.counts.get(key, 0) + 1
            t.recent.append(record)
            del t.recent[:-RECENT]

    def of_session(self, tenant: str, session: str) -> list[Record]:
        """The recent comparisons of one session, oldest first."""
        with self._lock:
            t = self._tenants.get(tenant)
            return [r for r in t.recent if r.session == session] if t is not None else []

    def report(self, tenant: str) -> dict[str, Any]:
        """A tenant's figures: agreement by lever, skips, the recent comparisons."""
        with self._lock:
            t = self._of(tenant)
            by_lever: dict[str, dict[str, int]] = {}
            for (lever, outcome), n in sorted(t.counts.items()):
                by_lever.setdefault(lever, {o.value: 0 for o in Outcome})[outcome] = n
            return {"by_lever": by_lever, "skipped": dict(t.skipped),
                    "recent": [_record_json(r) for r in reversed(t.recent)]}


def _step_json(step: Step | None) -> dict[str, Any] | None:
    if step is None:
        return None
    return {"tools": [{"name": t.name, "arguments": t.arguments} for t in step.tools],
            "refusal": step.refusal, "text": step.text}


def _record_json(r: Record) -> dict[str, Any]:
    return {"session": r.session, "model": r.model, "levers": list(r.levers),
            "outcome": r.outcome.value, "basis": r.basis.value if r.basis else None,
            "similarity": r.similarity, "tokens": r.tokens, "usd": r.usd, "error": r.error,
            "compressed": _step_json(r.compressed), "full": _step_json(r.full)}
