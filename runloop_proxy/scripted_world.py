"""What makes the scripted upstream's world a provider's: a latency per call kind, and ids
shaped like the ones OpenAI and Anthropic hand out.

A real API is never instant and never uniform: the first byte of an answer comes after the
prompt is read, a stream's events come a model's step apart, a summary call (a long prompt,
a long answer) takes seconds, ``count_tokens`` answers in tens of milliseconds. Tests set a
``Latency`` on the scripted upstream so that background work is slower than the gap between
requests, and a deadline armed from the wrong setting shows. Every pause the upstream makes
is recorded (``Pauses``), so a test can check which kind of call waited how long without
timing anything.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import itertools
import math
import os
import re
import string
import threading
from typing import Any, Literal

CallKind = Literal["first_byte", "between_events", "summary", "count_tokens", "embeddings"]
KINDS: tuple[CallKind, ...] = ("first_byte", "between_events", "summary", "count_tokens",
                               "embeddings")

BASE62 = string.digits + string.ascii_letters
HEX = "0123456789abcdef"
_serial = itertools.count(1)
# set by an upstream whose ids follow from the request they answer (ids_by_request): the
# request's digest and a count of the ids drawn for it
_request_ids: contextvars.ContextVar[tuple[str, itertools.count[int]] | None] = \
    contextvars.ContextVar("scripted_request_ids", default=None)


def ids_follow(raw: bytes) -> None:
    """From here on in this task, the ids drawn follow from ``raw`` alone: the same request
    gets the same ids, whatever else the process answered before it."""
    _request_ids.set((hashlib.blake2b(raw, digest_size=16).hexdigest(), itertools.count(1)))


@dataclasses.dataclass(frozen=True)
class Latency:
    """Seconds the scripted upstream waits, by call kind.

    - ``first_byte``: before an answer's status line (JSON or stream) — the model reading
      the prompt and thinking;
    - ``between_events``: between two events of a stream (chat chunks, Responses events,
      Messages events), added to a reply's own ``chunk_delay``;
    - ``summary``: instead of ``first_byte``, for a call the proxy's summariser makes (its
      prompt is the summariser's; see ``is_summary_call``);
    - ``count_tokens``: before ``/v1/messages/count_tokens`` answers;
    - ``embeddings``: before ``/v1/embeddings`` answers.

    A reply's ``delay`` (or the ``X-Scripted-Delay-Ms`` header) still overrides the wait
    before that one answer."""

    first_byte: float = 0.0
    between_events: float = 0.0
    summary: float = 0.0
    count_tokens: float = 0.0
    embeddings: float = 0.0

    def __post_init__(self) -> None:
        for kind in KINDS:
            value = getattr(self, kind)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"latency {kind} must be seconds >= 0, not {value!r}")


class Pauses:
    """Every pause the scripted upstream made: (kind, seconds), in order (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made: list[tuple[CallKind, float]] = []

    def add(self, kind: CallKind, seconds: float) -> None:
        with self._lock:
            self._made.append((kind, seconds))

    def of(self, kind: CallKind) -> list[float]:
        with self._lock:
            return [s for k, s in self._made if k == kind]

    def clear(self) -> None:
        with self._lock:
            self._made.clear()


def _summary_openings() -> tuple[str, ...]:
    # the summariser's two prompts open alike; the shared opening names a summary call
    from .history.summaries import APPEND, MERGE

    return (os.path.commonprefix([APPEND, MERGE]),)


def is_summary_call(body: dict[str, Any]) -> bool:
    """Whether a chat request is one the proxy's summariser makes: one user message whose
    text opens as the summariser's prompts do."""
    messages = body.get("messages")
    if not isinstance(messages, list) or len(messages) != 1 or \
            not isinstance(messages[0], dict):
        return False
    text = messages[0].get("content")
    return isinstance(text, str) and text.startswith(_summary_openings())


def provider_id(prefix: str, length: int, alphabet: str = BASE62) -> str:
    """``prefix`` + ``length`` characters of ``alphabet``: distinct on every call, the same
    sequence on every run (drawn from a counter's hash, not from the clock); under
    ``ids_follow``, from the request's digest and the ids drawn for it."""
    seeded = _request_ids.get()
    n: int | str = next(_serial) if seeded is None else f"{seeded[0]}.{next(seeded[1])}"
    out = ""
    block = 0
    while len(out) < length:
        digest = hashlib.blake2b(f"{prefix}{n}:{block}".encode(), digest_size=64).digest()
        out += "".join(alphabet[b % len(alphabet)] for b in digest)
        block += 1
    return prefix + out[:length]


# the shapes the providers' ids have (documented examples and real answers):
def chat_completion_id() -> str:
    """``chatcmpl-`` + 29 base62 characters (38 in all), as OpenAI's chat completions."""
    return provider_id("chatcmpl-", 29)


def openai_call_id() -> str:
    """``call_`` + 24 base62 characters: a chat-completions tool call's id."""
    return provider_id("call_", 24)


def responses_id(prefix: str) -> str:
    """A Responses API object's id: ``resp_``, ``msg_``, ``fc_``, ``rs_``, ``ctc_`` + 48
    hex digits."""
    return provider_id(prefix, 48, HEX)


def system_fingerprint() -> str:
    """``fp_`` + 10 hex digits."""
    return provider_id("fp_", 10, HEX)


def anthropic_message_id() -> str:
    """``msg_01`` + 22 base62 characters (28 in all), as Anthropic's messages."""
    return provider_id("msg_01", 22)


def anthropic_tool_use_id() -> str:
    """``toolu_01`` + 22 base62 characters: a ``tool_use`` block's id."""
    return provider_id("toolu_01", 22)


# The scripted embedding model: a text's vector is its bag of words, each word hashed to a
# dimension and a sign, and the words of one meaning (``SAME_MEANING``) on the same one — so
# that "refund" finds "reimbursement" as a real model would, and a test can compute the
# cosine the proxy should report (``scripted_embedding``).
EMBEDDING_DIM = 1536  # text-embedding-3-small's
SAME_MEANING = {w: "<money back>" for w in (
    "refund", "refunds", "refunded", "reimbursement", "reimbursed", "reimburse", "repaid")}
_WORD = re.compile(r"[a-z0-9]+")


def scripted_embedding(text: str, dim: int = EMBEDDING_DIM) -> list[float]:
    """``text``'s unit vector of ``dim`` numbers (a text of no word: zeros)."""
    out = [0.0] * dim
    for word in _WORD.findall(text.lower()):
        h = hashlib.blake2b(SAME_MEANING.get(word, word).encode(), digest_size=8).digest()
        n = int.from_bytes(h, "little")
        out[n % dim] += 1.0 if n >> 63 else -1.0
    norm = math.sqrt(sum(x * x for x in out))
    return [round(x / norm, 6) for x in out] if norm else out
