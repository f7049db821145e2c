"""How providers bill a prompt (pure): their prompt caches, and the prices in an editable table.

A prompt is priced as a sequence of *blocks* in the order the provider renders it (a message,
the tool schemas), each with a content key and its tokens. Two cache models:

- ``PrefixCache``, OpenAI's automatic prompt cache: the longest token prefix a prompt shares
  with an earlier one is served from the cache, from ``minimum`` tokens (1,024) in whole
  ``step``-token blocks (128), the rest read at the input price. Nothing is asked for and
  nothing costs extra to write.
- ``BreakpointCache``, Anthropic's explicit ``cache_control`` breakpoints: a prompt names at
  most ``max_breakpoints`` (4) places; the prefix up to each is written to the cache (billed
  at ``write`` x the input price, 1.25), and a later prompt reads at ``read`` x (0.1) the
  longest prefix cached at one of its own block boundaries up to ``lookback`` (20) blocks
  before one of its breakpoints. Entries live ``ttl`` seconds (300) from their last use.

Both keep their entries per conversation (an instance is one conversation's cache): what
conversations share (the same system prompt) is not counted. ``at`` (seconds) says when a
prompt is sent; without it every entry is assumed alive.

Prices are USD per million tokens in a TOML table (``prices.toml`` beside this module; an
operator's file adds models or overrides them field by field): per provider the cache's
parameters, per model its input, cached-input, cache-write and output prices.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

from .errors import ConfigError

PROVIDERS = ("openai", "anthropic")
PRICES_FILE = "prices.toml"  # in the proxy's config directory: an operator's prices
MILLION = 1_000_000


class Block(NamedTuple):
    """One rendered part of a prompt: a message or the tool schemas."""

    key: str  # its content's identity
    tokens: int
    text: str = ""  # a message's text: a block whose text only grew still shares its tokens
    role: str = ""


@dataclass(frozen=True)
class Bill:
    """A prompt's tokens by how they are billed."""

    uncached: int  # read at the input price
    cached: int = 0  # served from the cache
    written: int = 0  # written to the cache (breakpoint caches bill these apart)

    @property
    def total(self) -> int:
        return self.uncached + self.cached + self.written

    def tokens_cost(self, cached_price: float = 0.1, write_price: float = 1.0) -> float:
        """The bill in input-token equivalents: cached tokens at ``cached_price`` of one."""
        return self.uncached + cached_price * self.cached + write_price * self.written


def _chain(prev: int, key: str) -> int:
    return hash((prev, key))


def _extends(a: Block, b: Block) -> bool:
    return bool(a.role == b.role and a.text and b.text
                and (a.text.startswith(b.text) or b.text.startswith(a.text)))


@dataclass
class PrefixCache:
    """OpenAI's automatic prefix cache over one conversation's prompts."""

    minimum: int = 1024
    step: int = 128
    ttl: float | None = None
    # chain hash of a prefix -> (its tokens, last used)
    _seen: dict[int, tuple[int, float]] = field(default_factory=dict)
    # chain hash of a prefix (0: the empty one) -> every block that followed it in a prompt,
    # with when: an earlier branch's block is cached as long as that prompt's prefix is
    _after: dict[int, dict[Block, float]] = field(default_factory=dict)

    def bill(self, blocks: Sequence[Block], at: float | None = None) -> Bill:
        """Bill ``blocks`` against the prompts billed before, then remember them."""
        chains, ends = [], []
        c, t = 0, 0
        for b in blocks:
            c, t = _chain(c, b.key), t + b.tokens
            chains.append(c)
            ends.append(t)
        k = self._longest(chains, at)  # blocks shared whole
        shared = ends[k - 1] if k else 0
        if k < len(blocks):  # a block that only grew shares its tokens but the last
            after = self._after.get(chains[k - 1] if k else 0, {})
            shared += max((min(a.tokens, blocks[k].tokens) - 1 for a, t in after.items()
                           if self._live(t, at) and _extends(a, blocks[k])), default=0)
        total = ends[-1] if ends else 0
        cached = (shared // self.step) * self.step if shared >= self.minimum else 0
        now = at if at is not None else 0.0
        for j, ch in enumerate(chains):
            self._seen[ch] = (ends[j], now)
            self._after.setdefault(chains[j - 1] if j else 0, {})[blocks[j]] = now
        return Bill(total - cached, cached)

    def _live(self, used: float, at: float | None) -> bool:
        return self.ttl is None or at is None or at - used <= self.ttl

    def _alive(self, chain: int, at: float | None) -> bool:
        hit = self._seen.get(chain)
        return hit is not None and self._live(hit[1], at)

    def _longest(self, chains: list[int], at: float | None) -> int:
        """How many leading blocks an earlier prompt shared: a prompt remembers every prefix
        of itself with one time, so a live prefix's shorter prefixes are live too."""
        lo, hi = 0, len(chains)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._alive(chains[mid - 1], at):
                lo = mid
            else:
                hi = mid - 1
        return lo


@dataclass
class BreakpointCache:
    """Anthropic's ``cache_control`` breakpoints over one conversation's prompts."""

    minimum: int = 1024
    max_breakpoints: int = 4
    ttl: float | None = 300.0
    lookback: int = 20
    _entries: dict[int, float] = field(default_factory=dict)  # chain hash -> last used

    def bill(self, blocks: Sequence[Block], breakpoints: Sequence[int],
             at: float | None = None) -> Bill:
        """Bill ``blocks`` whose breakpoints sit after the blocks at ``breakpoints`` (a
        breakpoint at k caches blocks[:k]); the last ``max_breakpoints`` of them count."""
        chains, ends = [0], [0]
        for b in blocks:
            chains.append(_chain(chains[-1], b.key))
            ends.append(ends[-1] + b.tokens)
        marks = sorted({k for k in breakpoints if 0 < k <= len(blocks)})
        marks = marks[-self.max_breakpoints:] if self.max_breakpoints else []
        read_at = 0
        for k in marks:
            for j in range(k, max(0, k - self.lookback) - 1, -1):
                if j > read_at and self._alive(chains[j], at):
                    read_at = j
                    break
        now = at if at is not None else 0.0
        if read_at:
            self._entries[chains[read_at]] = now
        written = 0
        last = marks[-1] if marks else 0
        if last > read_at and ends[last] >= self.minimum:
            written = ends[last] - ends[read_at]
            for k in marks:
                if ends[k] >= self.minimum:
                    self._entries[chains[k]] = now
        cached = ends[read_at]
        return Bill(ends[-1] - cached - written, cached, written)

    def _alive(self, chain: int, at: float | None) -> bool:
        t = self._entries.get(chain)
        return t is not None and (self.ttl is None or at is None or at - t <= self.ttl)


@dataclass(frozen=True)
class Price:
    """One model's prices, USD per million tokens."""

    input: float
    cached_input: float
    output: float = 0.0
    cache_write: float | None = None  # a breakpoint cache's writes; None: the input price

    def cost(self, bill: Bill, output_tokens: int = 0) -> float:
        write = self.input if self.cache_write is None else self.cache_write
        return (bill.uncached * self.input + bill.cached * self.cached_input
                + bill.written * write + output_tokens * self.output) / MILLION

    def usage_cost(self, usage: dict[str, Any]) -> dict[str, float]:
        """What an upstream's reported ``usage`` costs, by kind: OpenAI's (``prompt_tokens``
        including ``cached_tokens``; the Responses API's ``input_tokens``) and Anthropic's
        (``input_tokens`` beside ``cache_read_input_tokens`` and
        ``cache_creation_input_tokens``)."""
        def n(v: Any) -> int:
            return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        cached = n(details.get("cached_tokens")) if isinstance(details, dict) else 0
        if "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage:
            read, written = n(usage.get("cache_read_input_tokens")), \
                n(usage.get("cache_creation_input_tokens"))
            uncached = n(usage.get("input_tokens"))
        else:
            read, written = cached, 0
            uncached = max(0, n(usage.get("prompt_tokens", usage.get("input_tokens"))) - cached)
        out = n(usage.get("completion_tokens", usage.get("output_tokens")))
        write = self.input if self.cache_write is None else self.cache_write
        return {"input": uncached * self.input / MILLION,
                "cached_input": read * self.cached_input / MILLION,
                "cache_write": written * write / MILLION,
                "output": out * self.output / MILLION}


@dataclass(frozen=True)
class Provider:
    """A provider's cache and its models' prices."""

    name: str
    cache: str  # "prefix" | "breakpoints"
    cache_min: int
    cache_step: int
    max_breakpoints: int
    ttl_s: float | None
    models: dict[str, Price]

    def price(self, model: str) -> Price | None:
        """A model's price; a dated snapshot (``gpt-4o-2024-08-06``) takes its family's."""
        if model in self.models:
            return self.models[model]
        best = max((m for m in self.models if model.startswith(m + "-")), key=len, default=None)
        return self.models[best] if best else None

    def new_cache(self) -> PrefixCache | BreakpointCache:
        if self.cache == "breakpoints":
            return BreakpointCache(self.cache_min, self.max_breakpoints, self.ttl_s)
        return PrefixCache(self.cache_min, self.cache_step, self.ttl_s)


@dataclass(frozen=True)
class PriceTable:
    providers: dict[str, Provider]

    @classmethod
    def load(cls, path: str | Path | None = None) -> PriceTable:
        """The built-in table, with ``path``'s providers and models merged over it."""
        raw = tomllib.loads(resources.files(__package__).joinpath("prices.toml")
                            .read_text(encoding="utf-8"))
        if path is not None:
            try:
                over = tomllib.loads(Path(path).read_text(encoding="utf-8"))
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise ConfigError(str(path), "", f"cannot read prices: {exc}") from exc
            _unknown(over, PROVIDERS, str(path), "")
            raw = _merge(raw, over)
        return cls({name: _provider(name, spec, str(path or "prices.toml"))
                    for name, spec in raw.items()})

    @classmethod
    def in_config(cls, config_dir: str | None) -> PriceTable:
        """The built-in table with the config directory's ``prices.toml`` over it."""
        path = Path(config_dir) / PRICES_FILE if config_dir else None
        return cls.load(path if path is not None and path.is_file() else None)

    def provider(self, name: str) -> Provider:
        if name not in self.providers:
            raise ConfigError("prices", name, f"unknown provider (known: "
                                              f"{', '.join(sorted(self.providers))})")
        return self.providers[name]


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) \
            else v
    return out


PROVIDER_FIELDS = ("cache", "cache_min", "cache_step", "max_breakpoints", "cache_ttl_s",
                   "cache_read", "cache_write", "models")
MODEL_FIELDS = ("input", "cached_input", "cache_write", "output")


def _unknown(given: Any, known: Sequence[str], file: str, where: str) -> None:
    """A misspelled name in a price table is an error naming it (a typo would otherwise leave
    a model unpriced, or priced by the built-in table, and the cost metrics wrong)."""
    for key in given if isinstance(given, dict) else ():
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            raise ConfigError(file, f"{where}{key}", "unknown name" + (
                f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})"))


def _provider(name: str, spec: Any, file: str) -> Provider:
    if not isinstance(spec, dict):
        raise ConfigError(file, name, "expected a table")
    _unknown(spec, PROVIDER_FIELDS, file, f"{name}.")
    for model, p in (spec.get("models") or {}).items():
        _unknown(p, MODEL_FIELDS, file, f"{name}.models.{model}.")
    try:
        cache = str(spec.get("cache", "prefix"))
        if cache not in ("prefix", "breakpoints"):
            raise ValueError(f"cache must be prefix or breakpoints, not {cache!r}")
        read, write = spec.get("cache_read"), spec.get("cache_write")
        models = {}
        for model, p in (spec.get("models") or {}).items():
            inp = float(p["input"])
            cached = p.get("cached_input", inp * read if read is not None else inp)
            cw = p.get("cache_write", inp * write if write is not None else None)
            price = Price(inp, float(cached), float(p.get("output", 0.0)),
                          None if cw is None else float(cw))
            if min(price.input, price.cached_input, price.output) < 0:
                raise ValueError(f"{model}: a price is negative")
            models[str(model)] = price
        ttl = spec.get("cache_ttl_s")
        return Provider(name, cache, int(spec.get("cache_min", 1024)),
                        int(spec.get("cache_step", 1)), int(spec.get("max_breakpoints", 4)),
                        None if ttl is None else float(ttl), models)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(file, name, f"bad price table: {exc}") from exc
