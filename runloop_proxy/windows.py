"""Models' context windows: what the proxy knows, what it only guesses, and what an upstream
told it (pure).

A window comes from a table by family (``FAMILIES``): a model's name is matched by its
longest listed prefix, so dated snapshots (``claude-haiku-4-5-20251001``, ``gpt-4o-2024-08-06``)
and the ``-latest`` spelling share their family's row. A row is *known* (the provider
documents that window for every model of the family) or a *guess* (a family the proxy has
seen, a newer model of which it does not know: ``claude-opus-6``, ``gpt-6``).

Some Claude models have a 1M-token window only when a request asks for it: Anthropic's
``context-1m-…`` beta in the ``anthropic-beta`` header (what Claude Code sends for a model
chosen as ``claude-sonnet-4-6[1m]``; it takes the suffix off the name it sends), or that
suffix on the name itself. For those (``LONG_CONTEXT``) a request that asks has the 1M window
and any other the row's 200k; a model whose window is 1M anyway has it either way.

A limit the proxy guessed is never enforced as if it knew it: where the window is a guess
the proxy compresses toward the budget it can justify and forwards what it has, and learns
the real limit from the upstream's own overflow error (``overflow_limit`` reads Anthropic's,
OpenAI's and other servers' wordings), which it then remembers for that model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelWindow:
    tokens: int
    known: bool  # False: a guess (a newer model of a known family, or nothing known)
    source: str  # "config", "table", "family", "learned", "default"


# (prefix, window): the models whose window the provider documents. A name is its row's
# when what follows the prefix is a snapshot or a variant (``SNAPSHOT``); a name that goes
# on with another version (``claude-opus-4-9``, ``gpt-5.7``) is a later model of the family:
# its window is the row's, as a guess.
KNOWN: tuple[tuple[str, int], ...] = (
    # Anthropic: 200k since Claude 3 (1M for some under a beta: LONG_CONTEXT), 1M from
    # Opus 4.7, Sonnet 5 and Haiku 5.5 (as Claude Code 2.1.332's model catalog has them)
    ("claude-3-haiku", 200_000), ("claude-3-sonnet", 200_000), ("claude-3-opus", 200_000),
    ("claude-3-5-sonnet", 200_000), ("claude-3-5-haiku", 200_000),
    ("claude-3-7-sonnet", 200_000),
    ("claude-opus-4", 200_000), ("claude-opus-4-0", 200_000), ("claude-opus-4-1", 200_000),
    ("claude-opus-4-5", 200_000), ("claude-opus-4-6", 200_000),
    ("claude-sonnet-4", 200_000), ("claude-sonnet-4-0", 200_000),
    ("claude-sonnet-4-5", 200_000), ("claude-sonnet-4-6", 200_000),
    ("claude-haiku-4-5", 200_000),
    ("claude-opus-4-7", 1_000_000), ("claude-opus-4-8", 1_000_000),
    ("claude-opus-5", 1_000_000), ("claude-opus-5-5", 1_000_000),
    ("claude-sonnet-5", 1_000_000), ("claude-sonnet-5-5", 1_000_000),
    ("claude-haiku-5-5", 1_000_000),
    ("claude-2", 100_000), ("claude-2.0", 100_000), ("claude-2.1", 200_000),
    ("claude-instant-1", 100_000), ("claude-instant-1.2", 100_000),
    # OpenAI
    ("gpt-3.5-turbo", 16_385), ("gpt-3.5-turbo-instruct", 4_096),
    ("gpt-4", 8_192), ("gpt-4-32k", 32_768), ("gpt-4-turbo", 128_000),
    ("gpt-4-1106-preview", 128_000), ("gpt-4-0125-preview", 128_000),
    ("gpt-4o", 128_000), ("gpt-4o-mini", 128_000), ("chatgpt-4o", 128_000),
    ("gpt-4.1", 1_047_576), ("gpt-4.5", 128_000),
    ("gpt-5", 400_000), ("gpt-5-chat", 128_000), ("gpt-5.1", 400_000),
    ("gpt-5.1-chat", 128_000), ("gpt-5.2", 400_000),
    ("gpt-oss-20b", 131_072), ("gpt-oss-120b", 131_072),
    ("o1", 200_000), ("o1-mini", 128_000), ("o1-preview", 128_000),
    ("o3", 200_000), ("o3-mini", 200_000), ("o4-mini", 200_000), ("codex-mini", 200_000),
    # others seen behind OpenAI-compatible gateways
    ("deepseek-chat", 128_000), ("deepseek-reasoner", 128_000),
)
# the rows whose models have a 1M window when a request asks for it (the beta or the suffix)
LONG_CONTEXT = frozenset({
    "claude-3-5-sonnet", "claude-3-7-sonnet", "claude-sonnet-4", "claude-sonnet-4-0",
    "claude-sonnet-4-5", "claude-sonnet-4-6", "claude-opus-4-6"})
LONG_WINDOW = 1_000_000
LONG_BETA = "context-1m"  # the beta's name before its date: context-1m-2025-08-07
LONG_SUFFIX = "[1m]"
# families whose later models the proxy may not know yet, and what it guesses for them
FAMILIES: tuple[tuple[str, int], ...] = (
    ("claude-", 200_000), ("gpt-", 128_000), ("o", 200_000), ("deepseek-", 128_000),
)
SNAPSHOT = re.compile(r"(?:-(?:\d{8}|\d{4}-\d{2}-\d{2}|\d{4}|latest|preview|mini|nano|pro|"
                      r"codex|instruct|high|low|medium|thinking|v\d[\w.]*))*(?:@\S*|:\S*)?")
_KNOWN = dict(KNOWN)
_SUFFIX = re.compile(r"\[[^\]]*\]$")  # Claude Code's "claude-sonnet-4-6[1m]"
_BOUNDARY = "-.:@_"


def asks_long_context(betas: Iterable[str]) -> bool:
    """Whether ``anthropic-beta`` header values (each a comma-separated list) ask for the 1M
    window: ``context-1m-2025-08-07``, the beta's name with any date."""
    return any(b == LONG_BETA or b.startswith(LONG_BETA + "-")
               for value in betas for b in (part.strip().lower() for part in value.split(",")))


def window_name(model: str, long_context: bool) -> str:
    """The name a window the upstream reported is remembered under: a request that asked
    for the 1M window learns apart from the model's others (one limit does not say the
    other's)."""
    asked = long_context and not model.strip().lower().endswith(LONG_SUFFIX)
    return model + LONG_SUFFIX if asked else model


def lookup(model: str, long_context: bool = False) -> ModelWindow | None:
    """The table's window for ``model``: its longest listed prefix's, known when the rest is
    a snapshot or variant, else its family's as a guess; None for a name of no family.
    ``long_context``: the request asked for the 1M window (so does a ``[1m]`` suffix), which
    the models in ``LONG_CONTEXT`` then have."""
    lowered = model.strip().lower()
    long_context = long_context or lowered.endswith(LONG_SUFFIX)
    name = _SUFFIX.sub("", lowered).rsplit("/", 1)[-1]  # gateways: "openai/…"
    best = max((p for p in _KNOWN if name == p or name.startswith(p)
                and name[len(p)] in _BOUNDARY), key=len, default=None)
    if best is not None:
        tokens = LONG_WINDOW if long_context and best in LONG_CONTEXT else _KNOWN[best]
        if SNAPSHOT.fullmatch(name, len(best)):
            return ModelWindow(tokens, True, "table")
        return ModelWindow(tokens, False, "family")
    for prefix, tokens in FAMILIES:
        if name.startswith(prefix) and (prefix != "o" or name[1:2].isdigit()):
            return ModelWindow(tokens, False, "family")
    return None


# -- what an upstream says when a prompt does not fit ------------------------------------------

# Each: a pattern and the group holding the limit. Anthropic: "prompt is too long: 213456
# tokens > 200000 maximum", "input length and `max_tokens` exceed context limit: 188240 +
# 21333 > 200000"; OpenAI, Azure, vLLM, DeepSeek: "maximum context length is 128000 tokens";
# Mistral: "too large for model with 32768 maximum context length"; Gemini's compatible API:
# "exceeds the maximum number of tokens allowed (1048576)"; llama.cpp: "n_ctx": 4096 beside
# "exceed_context_size_error"; LM Studio and others: "context length of only 8192 tokens".
_OVERFLOWS: tuple[re.Pattern[str], ...] = (
    re.compile(r"prompt is too long:\s*\d+\s*tokens?\s*>\s*(\d+)\s*maximum", re.I),
    re.compile(r"exceed context limit:\s*\d+\s*\+\s*\d+\s*>\s*(\d+)", re.I),
    re.compile(r"maximum context length is\s*(\d+)\s*tokens", re.I),
    re.compile(r"too large for model with\s*(\d+)\s*maximum context length", re.I),
    re.compile(r"maximum number of tokens allowed\s*\(\s*(\d+)\s*\)", re.I),
    re.compile(r"context (?:length|window) of (?:only )?(\d+) tokens", re.I),
    re.compile(r'"n_ctx"\s*:\s*(\d+)'),
    re.compile(r"context[_ ]length[_ ]exceeded.{0,200}?\b(?:limit|maximum|max)\D{0,20}(\d{4,})",
               re.I | re.S),
)
MIN_LEARNED, MAX_LEARNED = 1_024, 100_000_000  # a limit outside these is not a window
OVERFLOW_READ = 64 << 10  # an error body is read this far for its limit
OVERFLOW_STATUSES = frozenset({400, 413, 422})


def overflow_limit(status: int, body: bytes) -> int | None:
    """The context window an upstream's error says the model has, or None when the error is
    not an overflow (or says no number). Bounded: the first ``OVERFLOW_READ`` bytes."""
    if status not in OVERFLOW_STATUSES:
        return None
    text = body[:OVERFLOW_READ].decode("utf-8", "replace")
    for pattern in _OVERFLOWS:
        found = pattern.search(text)
        if found is not None:
            n = int(found.group(1))
            if MIN_LEARNED <= n <= MAX_LEARNED:
                return n
    return None
