"""A prompt that does not fit, in every server's words (pure).

Claude Code compacts its conversation when the Messages API says "prompt is too long"; the
bridge serves it from chat-completions servers, and each of those says it differently:
OpenAI and Azure ("maximum context length is N tokens. However, your messages resulted in M
tokens", code ``context_length_exceeded``), vLLM ("your request has M input tokens", code
400, older versions with the error's fields at the top level), llama.cpp ("request (M tokens)
exceeds the available context size (N tokens)", type ``exceed_context_size_error`` with
``n_prompt_tokens`` and ``n_ctx``), Ollama ("the prompt is longer than the context length"),
LiteLLM (``ContextWindowExceededError`` wrapping its provider's words, Anthropic's among
them), OpenRouter ("requested about M tokens"), Mistral ("Prompt contains M tokens ... too
large for model with N maximum context length"), Gemini's OpenAI endpoint ("The input token
count (M) exceeds the maximum number of tokens allowed (N)", in a list), TGI (a 422:
"`inputs` tokens + `max_new_tokens` must be <= N"), Groq (only the code), Bedrock behind a
gateway ("Input is too long for requested model"). ``tests/dialects.py`` holds them all.
The model's window is read as the proxy learns it (``windows.overflow_limit``), so both
read one error alike; this module adds what the prompt took and whether it is one at all."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from ..windows import overflow_limit

# a status a server may answer an overflow with: 400 (most), 413 (some gateways), 422 (TGI)
STATUSES = frozenset({400, 413, 422})
CODES = frozenset({"context_length_exceeded", "exceed_context_size_error",
                   "context_window_exceeded", "contextwindowexceedederror",
                   "string_above_max_length_of_context", "request_too_large_for_context"})
WORDINGS = re.compile("|".join([
    r"context length", r"context size", r"context window", r"context limit",
    r"prompt is too long", r"input is too long", r"prompt \(\d+ tokens\) is too long",
    r"input token count .{0,40}exceeds the maximum", r"`inputs` tokens \+ `max_new_tokens`",
    r"reduce the length of the (?:input )?messages",
]), re.IGNORECASE)
_NUMBER = r"(\d[\d,]*)"
NEEDED = [re.compile(p, re.IGNORECASE) for p in (
    rf"(?:resulted in|requested|requested about) {_NUMBER} tokens",
    rf"your request has {_NUMBER} input tokens",
    rf"request \({_NUMBER} tokens\)",
    rf"prompt contains {_NUMBER} tokens",
    rf"input token count \({_NUMBER}\)",
    rf"prompt is too long: {_NUMBER} tokens",
)]
SUMMED = re.compile(rf"{_NUMBER} \+ {_NUMBER} > \d")  # Anthropic's input + max_tokens


class Overflow(NamedTuple):
    """A prompt too long for the upstream: its words, and the sizes when they say them (the
    prompt's tokens, the model's context; both or neither)."""

    message: str
    needed: int | None
    allowed: int | None

    def anthropic_message(self) -> str:
        """In Anthropic's words, which Claude Code compacts on."""
        if self.message.lower().startswith("prompt is too long"):
            return self.message
        if self.needed is not None and self.allowed is not None:
            return f"prompt is too long: {self.needed} tokens > {self.allowed} maximum. " \
                f"{self.message}"
        return f"prompt is too long: {self.message}"


def error_fields(data: Any, raw: bytes) -> tuple[str, dict[str, Any]]:
    """An error body's message and its fields, in whichever shape the server nests them:
    ``{"error": {...}}`` (OpenAI's), the fields at the top level (vLLM before 0.6, Mistral),
    a one-item list of those (Gemini's OpenAI endpoint), ``{"error": "words"}`` (TGI); else
    the body's text."""
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            return str(err.get("message") or ""), err
        if isinstance(err, str) and err:
            return err, data
        if isinstance(data.get("message"), str) and data.get("object") == "error":
            return str(data["message"]), data
    return raw[:2000].decode(errors="replace"), {}


def _int(text: str | None) -> int | None:
    return int(text.replace(",", "")) if text else None


def _first(patterns: list[re.Pattern[str]], text: str) -> int | None:
    for p in patterns:
        found = p.search(text)
        if found:
            return _int(found.group(1))
    return None


def _field(fields: dict[str, Any], name: str) -> int | None:
    value = fields.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


def overflow(status: int, raw: bytes, message: str, fields: dict[str, Any]
             ) -> Overflow | None:
    """The error (its body, and the message and fields ``error_fields`` read from it) as an
    overflow, if it is one (by its code or type, else by its words); the model's window as
    ``windows.overflow_limit`` reads it (what the proxy learns from the same error)."""
    if status not in STATUSES:
        return None
    names = {str(fields.get(k) or "").lower() for k in ("code", "type")}
    if not names & CODES and not WORDINGS.search(message):
        return None
    needed = _field(fields, "n_prompt_tokens") or _first(NEEDED, message)
    allowed = overflow_limit(status, raw)
    summed = SUMMED.search(message)
    if summed:
        needed = (_int(summed.group(1)) or 0) + (_int(summed.group(2)) or 0)
    if needed is None or allowed is None or needed <= allowed:
        # a count that says nothing of the prompt (``max_tokens`` too large for what is
        # left): the words alone
        needed = allowed = None
    return Overflow(message, needed, allowed)
