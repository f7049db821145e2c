"""Token accounting: tiktoken offline, per-message cache, calibration from upstream usage.

``o200k_base`` and ``cl100k_base`` are built from ranks files shipped in a wheel
(``encodings``): nothing is downloaded. Any other encoding a config names is fetched once at
startup, bounded in time, never on a request. A model whose own encoding is not loaded is
counted with cl100k and a per-model factor learned from the upstream's ``usage.prompt_tokens``
(an exponential average).
Messages are counted the way the API bills them: a fixed overhead per message and per name, the
content, the tool calls, plus a few tokens priming the reply. Tool schemas are counted as the
API renders them for the model (a TypeScript-like ``namespace functions`` block), not as JSON,
which would count every brace and quote of the schema.
Every count goes through ``encode``, which gives tiktoken at most ``PIECE_CHARS`` characters at
a time: tiktoken up to 0.12 merges one piece of its pattern (a run it does not split) in time
quadratic in the piece's length, so the work of a count is linear in the text whatever the
text holds, and whichever tiktoken is installed.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections.abc import Iterable, Iterator, MutableMapping
from typing import Any, Protocol

import orjson
import regex  # tiktoken's own dependency: the Unicode classes (\p{L}) re does not have
import tiktoken

from ..caches import ByteLRU
from ..conversation.messages import Message, content_hash, message_hash, text_of
from ..ops import logs
from ..window.forms import Cut
from . import encodings
from .schemas import render_tools

log = logs.get("tokens")
FALLBACK_ENCODING = "cl100k_base"
PER_MESSAGE = 3
PER_NAME = 1
REPLY_PRIMING = 3
PER_TOOL_CALL = 4
IMAGE_PART_TOKENS = 765
# a fixed price per part; "image" and "document" are the Messages API's
MEDIA_PARTS = ("image_url", "input_image", "input_audio", "image", "document")
FRAME = 100_264  # stands for the chat format's framing tokens (cl100k's <|im_start|>)
TOOLS_OVERHEAD = 6  # the system turn the tools section rides in
MODEL_ENTRY_BYTES = 300  # a resolved model: the key tuple, its box, the (encoding, exact) pair
COUNT_ENTRY_BYTES = 260  # a cached count: the key tuple, two strings, an int, a slot
EXACT_CHARS = 65_536  # texts up to this long are counted exactly
SAMPLE_CHARS = 16_384  # longer ones: estimated from this much of their head and of their tail
CUT_SCAN_CHARS = 32  # characters a cut reads per token it keeps (cl100k tokens are shorter)
# the most characters tiktoken is given at a time (see ``encode``): its merge is quadratic in
# a piece's length up to 0.12 (40,000 CJK characters: 4.5 s); 128 at a time, 65,536 emoji
# take 49 ms there, and a text of ordinary pieces is cut where they end (counted exactly)
PIECE_CHARS = 128
# where both encodings' patterns end a piece: after a letter or a digit, before a character
# no piece goes on with (not a letter, digit, mark or apostrophe: "don't", "é" are one piece);
# searched backwards ((?r)) for the last one in a span
_PIECE_END = regex.compile(r"(?r)[\p{L}\p{N}](?=[^\p{L}\p{N}\p{M}'])")
CALIBRATION_WEIGHT = 0.2
FETCH_TIMEOUT_S = 3.0
# the encodings of current OpenAI models, loaded at startup (shipped: no download)
WARM_ENCODINGS = ("o200k_base", "cl100k_base")



class Encoder(Protocol):
    """What counting needs of an encoding: tiktoken's (or, in the tests, a pure-Python one
    whose merge loop can be counted)."""

    def encode_ordinary(self, text: str) -> list[int]: ...


class TokenCounter:
    """Counts tokens of messages for a model; thread-safe, with an LRU per encoding."""

    def __init__(self, cache_bytes: int = 64 << 20):
        self._encodings: dict[str, tiktoken.Encoding | None] = {}
        # (model, override) -> its encoding (one of the few the process loads: ``_shipped``,
        # the fallback) and whether it is exact; bounded in bytes, model names are clients'
        self._by_model: ByteLRU[tuple[str, str | None], tuple[tiktoken.Encoding, bool]] = \
            ByteLRU(1 << 20, lambda k, v: MODEL_ENTRY_BYTES + len(k[0]) + len(k[1] or ""))
        # (encoding, content hash) -> count: entries of one size, so bytes bound the count
        self._cache: ByteLRU[tuple[str, str], int] = ByteLRU(
            cache_bytes, lambda k, v: COUNT_ENTRY_BYTES)
        # (scope, model) -> factor: a scope is one tenant (a pass-through key's namespace),
        # so no tenant's traffic moves another's counts; bounded, model names are clients'
        self._factors: ByteLRU[tuple[str, str], float] = ByteLRU(
            4 << 20, lambda k, v: 200 + len(k[0]) + len(k[1]))

    def resize(self, cache_bytes: int, factor_bytes: int | None = None,
               model_bytes: int | None = None) -> None:
        self._cache.resize(cache_bytes)
        if factor_bytes is not None:
            self._factors.resize(factor_bytes)
        if model_bytes is not None:
            self._by_model.resize(model_bytes)

    def encoding(self, model: str, override: str | None = None) -> tuple[tiktoken.Encoding, bool]:
        """The model's encoding and whether it is exact (else: fallback + calibration)."""
        key = (model, override)
        hit = self._by_model.get(key)
        if hit is None:
            hit = self._by_model[key] = self._resolve(model, override)
        return hit

    def _resolve(self, model: str, override: str | None) -> tuple[tiktoken.Encoding, bool]:
        name = override or encoding_name_for(model)
        enc = self._load(name) if name else None
        if enc is not None:
            return enc, True
        fallback = self._load(FALLBACK_ENCODING)
        assert fallback is not None, f"{encodings.RANKS_PACKAGE} is not installed"
        return fallback, False

    def warm(self, names: Iterable[str] = (), timeout: float = FETCH_TIMEOUT_S) -> None:
        """Load encodings off the request path: those shipped (``encodings.SHIPPED``) from
        local files, then any other of ``names`` that tiktoken must fetch or read from its
        cache, each in a daemon thread, waiting at most ``timeout`` in all. tiktoken downloads
        without a timeout and holds its registry lock meanwhile: a black-holed network must
        cost a few seconds once, never a hung request. What did not load counts with the
        fallback."""
        todo = [n for n in dict.fromkeys(names) if n and n not in self._encodings]
        for name in [n for n in todo if n in encodings.SHIPPED]:
            self._encodings[name] = _shipped(name)
        todo = [n for n in todo if n not in encodings.SHIPPED]
        if not todo:
            return
        loaded: dict[str, tiktoken.Encoding] = {}

        def fetch(name: str) -> None:
            try:
                loaded[name] = tiktoken.get_encoding(name)
            except Exception as exc:  # tiktoken raises whatever its download raised
                log.info("encoding unavailable", extra={"encoding": name,
                                                        "error": type(exc).__name__})

        threads = [threading.Thread(target=fetch, args=(n,), daemon=True) for n in todo]
        deadline = time.monotonic() + timeout
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for name in todo:
            self._encodings[name] = loaded.get(name)
            if name not in loaded:
                log.warning("encoding not loaded: counting with the fallback and calibrating",
                            extra={"encoding": name, "timeout_s": timeout})

    def _load(self, name: str) -> tiktoken.Encoding | None:
        """An encoding loaded, or shipped (never tiktoken's registry: see ``warm``)."""
        if name in encodings.SHIPPED and name not in self._encodings:
            self.warm([name])
        return self._encodings.get(name)

    def encoding_names(self) -> list[str]:
        """The encodings loaded, for the log and the replay's report."""
        return [n for n, e in self._encodings.items() if e is not None]

    def text(self, enc: tiktoken.Encoding, text: str) -> int:
        return count_text(enc, text)

    def message(self, enc: tiktoken.Encoding, msg: Message, key: str | None = None) -> int:
        ck = (enc.name, key or message_hash(msg))
        hit = self._cache.get(ck)
        if hit is not None:
            return int(hit)
        n = self._count(enc, msg)
        self._cache[ck] = n
        return n

    def prime(self, enc: tiktoken.Encoding, counts: dict[str, int]) -> None:
        """Seed the cache with counts made elsewhere (the store), keyed by content hash."""
        for key, n in counts.items():
            self._cache[(enc.name, key)] = n

    def _count(self, enc: tiktoken.Encoding, msg: Message) -> int:
        return billed_count(enc, msg)

    def tools(self, enc: tiktoken.Encoding, tools: list[dict[str, Any]] | None) -> int:
        """Tokens the tool schemas add to the prompt (cached by their content)."""
        return self._rendered(enc, tools) if tools else 0

    def tools_frame(self, enc: tiktoken.Encoding) -> int:
        """What a tools section costs with nothing in it: what tools added to a prompt that
        already has some do not pay again."""
        return self._rendered(enc, [])

    def _rendered(self, enc: tiktoken.Encoding, tools: list[dict[str, Any]]) -> int:
        raw = orjson.dumps(tools)
        ck = (enc.name, "tools:" + content_hash(raw))
        hit = self._cache.get(ck)
        if hit is None:
            hit = self.text(enc, render_tools(tools, len(raw))) + TOOLS_OVERHEAD
            self._cache[ck] = hit
        return int(hit)

    # -- calibration ----------------------------------------------------------------------

    def factor(self, model: str, scope: str) -> float:
        """The correction learned for ``model`` from the upstream answers of one caller
        (``scope``: ``Caller.scope``); 1.0 before any."""
        hit = self._factors.get((scope, model))
        return 1.0 if hit is None else float(hit)

    def calibrate(self, model: str, estimated: int, reported: int, scope: str) -> None:
        """Fold an upstream-reported prompt size into the model's correction factor."""
        if estimated <= 0 or reported <= 0:
            return
        ratio = max(0.5, min(2.0, reported / estimated))
        old = self._factors.get((scope, model))
        self._factors[(scope, model)] = ratio if old is None else \
            old * (1 - CALIBRATION_WEIGHT) + ratio * CALIBRATION_WEIGHT


@functools.cache
def _shipped(name: str) -> tiktoken.Encoding | None:
    """A shipped encoding, built once per process (its ranks are ~200k entries)."""
    try:
        return encodings.load(name)
    except encodings.EncodingUnavailable as exc:
        log.warning("encoding not loaded: counting with the fallback and calibrating",
                    extra={"encoding": name, "error": str(exc)})
        return None


def encoding_name_for(model: str) -> str | None:
    """tiktoken's encoding for a model name, if it knows the model (a table, no I/O)."""
    try:
        return tiktoken.encoding_name_for_model(model)
    except KeyError:
        return None


def billed_parts(msg: Message) -> list[int | str]:
    """A message as the API bills it, in order: runs of framing tokens (ints, each stands for
    that many ``FRAME`` tokens) and texts to tokenize — the framing, the role, the content (a
    fixed price per image or audio part), the name, each tool call's name and arguments."""
    out: list[int | str] = [PER_MESSAGE, str(msg.get("role", ""))]
    content = msg.get("content")
    if isinstance(content, list):
        out += [IMAGE_PART_TOKENS for part in content
                if isinstance(part, dict) and part.get("type") in MEDIA_PARTS]
    out.append(text_of(content))
    if msg.get("name"):
        out += [PER_NAME, str(msg["name"])]
    calls = [c.get("function") or {} for c in msg.get("tool_calls") or []]
    if msg.get("function_call"):
        calls.append(msg["function_call"])
    for fn in calls:
        out += [PER_TOOL_CALL, str(fn.get("name") or ""), str(fn.get("arguments") or "")]
    if msg.get("refusal"):
        out.append(str(msg["refusal"]))
    return out


def billed_tokens(enc: tiktoken.Encoding, msg: Message) -> list[int]:
    """The message's tokens as the API bills them, exactly (the scripted upstream's prompt
    cache compares them)."""
    out: list[int] = []
    for part in billed_parts(msg):
        out += [FRAME] * part if isinstance(part, int) else enc.encode_ordinary(part)
    return out


def billed_count(enc: tiktoken.Encoding, msg: Message) -> int:
    """How many tokens the message is billed, in bounded time (see ``count_text``)."""
    return sum(p if isinstance(p, int) else count_text(enc, p) for p in billed_parts(msg))


def count_text(enc: Encoder, text: str) -> int:
    """The tokens of ``text``: exact up to ``EXACT_CHARS`` (where its pieces end where
    ``spans`` cuts); beyond, estimated from its head and tail, so that a request never costs
    seconds of CPU; the upstream's usage calibrates what estimates miss."""
    if len(text) <= EXACT_CHARS:
        return sum(len(enc.encode_ordinary(span)) for span in spans(text))
    sample = text[:SAMPLE_CHARS] + text[-SAMPLE_CHARS:]
    return round(sum(len(enc.encode_ordinary(span)) for span in spans(sample))
                 * len(text) / len(sample))


def encode(enc: Encoder, text: str) -> list[int]:
    """The tokens of ``text``, in work linear in its length (see ``spans``)."""
    out: list[int] = []
    for span in spans(text):
        out += enc.encode_ordinary(span)
    return out


def spans(text: str) -> Iterator[str]:
    """``text`` in spans of at most ``PIECE_CHARS`` characters, the only way the proxy hands
    text to tiktoken. tiktoken splits a text into pieces with its pattern and merges each
    piece's bytes, before 0.13 in time quadratic in the piece's length: a run the pattern
    does not split (one script without spaces, one letter repeated, a line of dashes) cost
    seconds in a body small enough to stay on the event loop. A span ends where the pattern
    ends a piece anyway (the last ``_PIECE_END`` in it), so ordinary text counts exactly as a
    whole; a span with no such place is cut at its length (a token or so more). The bound
    holds whatever the characters' classes: it is a length (and two spans in a row cover at
    least ``PIECE_CHARS``: what follows a span's last such place holds none)."""
    start, n = 0, len(text)
    while n - start > PIECE_CHARS:
        end = start + PIECE_CHARS
        found = _PIECE_END.search(text, start, end)
        cut = found.end() if found else end
        yield text[start:cut]
        start = cut
    if start < n:
        yield text[start:]


class WindowTokens:
    """The window's TokenOps for one encoding: counts through the shared counter, and cuts
    long texts to head + tail (cached by text and size)."""

    def __init__(self, counter: TokenCounter, enc: tiktoken.Encoding,
                 cuts: MutableMapping[tuple[str, int], Any]):
        self.counter = counter
        self.enc = enc
        self.name = enc.name
        self._cuts = cuts

    def count(self, msg: Message) -> int:
        return self.counter.message(self.enc, msg)

    def cut(self, text: str, max_tokens: int) -> Cut | None:
        if len(text) <= max_tokens:  # a token is at least one character
            return None
        # by encoding too: the cache is the process's, and another encoding cuts elsewhere
        digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        key = (f"{self.name}:{digest}", max_tokens)
        hit = self._cuts.get(key)
        if hit is not None:
            return hit or None
        total = count_text(self.enc, text)
        out: Cut | None = None
        if total > max_tokens:
            # only the head and the tail it keeps are tokenized: bounded work, whatever the size
            head = max_tokens * 2 // 3
            tail = max_tokens - head
            window = (max_tokens + 1) * CUT_SCAN_CHARS
            head_ids = encode(self.enc, text[:window])[:head]
            tail_ids = encode(self.enc, text[-window:])[-tail:] if tail else []
            out = Cut(self.enc.decode(head_ids), self.enc.decode(tail_ids), total - max_tokens)
        self._cuts[key] = out or False  # False: it fits (None would read as a miss)
        return out
