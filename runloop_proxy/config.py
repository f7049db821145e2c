"""Typed configuration: a global file plus one file per tenant, with validation and reload.

Layout of a config directory::

    runloop.toml          global: server, store, upstreams, defaults (model windows, policy)
    tenants/*.toml        one tenant per file; each field overrides the global defaults

Secrets are written as ``${ENV_VAR}`` references and resolved at load time. Proxy keys may be
given as ``sha256:<hex>`` so the plain key never sits in a file.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import tomllib
import urllib.parse
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .conversation.identity import DEFAULT_SOURCES, check_source
from .errors import ConfigError
from .pricing import PRICES_FILE, PriceTable
from .windows import KNOWN, ModelWindow, lookup

GLOBAL_FILE = "runloop.toml"
TENANTS_DIR = "tenants"
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")

BUILTIN_CONTEXT_WINDOWS: dict[str, int] = dict(KNOWN)  # windows.py: the table by family
DEFAULT_CONTEXT_WINDOW = 128_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReducePastLoops(StrEnum):
    ALWAYS = "always"
    OVER_THRESHOLD = "over_threshold"


class ProxyToolsMode(StrEnum):
    WHEN_NEEDED = "when_needed"
    ALWAYS = "always"


class Policy(_Strict):
    """How a tenant's windows are compressed. Token amounts are in the model's tokens."""

    enabled: bool = True
    max_run_loops: int = Field(
        0, ge=0, description="past run loops kept in view before the oldest are omitted (0: "
                             "each new turn omits the one before it, keeping its final reply, "
                             "which the user is answering, after the summary)")
    omit_batch: int | None = Field(
        None, ge=1, description="loops omitted per omission event (default max_run_loops/2)")
    max_message_length: int = Field(
        16, ge=16, description="tokens kept of a past question or answer (the rest is "
                               "recallable; the summary keeps its identifiers)")
    max_time_range_s: float = Field(7 * 86_400, gt=0)
    threshold: float = Field(0.8, gt=0, le=1)
    fit_threshold: float | None = Field(
        0.9, gt=0, le=1, description="where the model's window, not the soft budget, bounds "
                                     "the working budget, an event waits until at least this "
                                     "share of it (compaction then only makes a request fit, "
                                     "and keeps more in view by waiting); unset: threshold "
                                     "everywhere")
    target: float = Field(0.5, gt=0, le=1)
    soft_budget_tokens: int | None = Field(
        16_000, ge=1024, description="working budget below the model window (cost cap)"
    )
    keep_recent_tool_results: int = Field(3, ge=0)
    clear_at_least: int = Field(
        6_000, ge=0, description="tokens an in-loop elision clears (at most the target's "
                                 "share of the working budget)")
    reduce_at_least: int = Field(
        64, ge=0, description="tokens a past-loop reduction must clear to be made")
    payback_requests: int | None = Field(
        None, ge=0, description="a lever that only saves money (a past-loop reduction under "
                                "the threshold, an omission beyond max_run_loops) moves only "
                                "when it takes tokens out; with this set, only when what it "
                                "takes out of later requests pays, within this many of them, "
                                "for what it makes the provider read again")
    keep_opening: bool = Field(
        True, description="the opening task (the first loop's user messages, e.g. Codex's "
                          "environment message and task) stays in view whole when its loop "
                          "is reduced or omitted, unless it alone would break the budget")
    names_kept: int = Field(
        48, ge=0, description="names (paths, dotted, snake_case and camelCase names, numbers) "
                              "of an agent's own message the window trims, kept with it as a "
                              "list; a drop note keeps 8 times as many of what it drops")
    exclude_tools: tuple[str, ...] = ()
    reduce_past_loops: ReducePastLoops = ReducePastLoops.ALWAYS
    ledger_arg_chars: int = Field(32, ge=0)
    reasoning_keep_tokens: int = Field(60, ge=16)
    max_tool_result_share: float = Field(0.25, gt=0, le=1)
    reserved_output_tokens: int = Field(4_096, ge=0)
    safety_margin_tokens: int = Field(512, ge=0)
    proxy_tools: ProxyToolsMode = Field(
        ProxyToolsMode.ALWAYS,
        description="when_needed: only once something is elided; always: from a session's "
                    "first request that carries tools, so the tool list (part of every "
                    "provider's cached prefix) never changes mid-session")
    strict_roles: bool = Field(
        False, description="one system message, first, and a user turn after it: the marker "
                           "joins the client's system prompt (chat templates such as Qwen3's or "
                           "Mistral's reject a second system message or an assistant turn first)")
    max_tool_rounds: int = Field(4, ge=0, le=16)
    search_results: int = Field(5, ge=1, le=50)
    memory: Literal["off", "embedded", "upstream"] = Field(
        "off", description='long-term memory: "embedded" cuts every closed run loop (and '
                           'the finished steps of the one going on) into segments, embeds '
                           'them after the answer with the model the package ships (no '
                           'network, no download) and kept with the session, and '
                           'search_history ranks by meaning as well as by words; "upstream": '
                           'the same with embedding_model through the tenant\'s upstream '
                           '(or embedding_upstream) /v1/embeddings; "off": by words alone')
    embedding_model: str | None = Field(
        None, description='with memory = "upstream": the model the segments and the '
                          'searches are embedded with (e.g. "text-embedding-3-small")')
    embedding_dimensions: int | None = Field(
        None, ge=1, le=16_384, description='with memory = "upstream": how many numbers its '
                                           'vectors have (1536 for text-embedding-3-small); '
                                           'an answer of another size is refused, never kept')
    embedding_upstream: str | None = Field(
        None, description="the configured upstream (by name) the embedding calls go to, "
                          "with its own api_key (default: the tenant's upstream and key)")
    embedding_daily_tokens: int | None = Field(
        None, ge=1, description="tokens the embedding calls (indexing and searches) may "
                                "spend per UTC day, every replica's; reached, they stop "
                                "until the next day and searches answer by words (unset: "
                                "no cap)")
    summary_model: str | None = Field(
        "extractive", description='what summarises the loops an omission leaves out: '
                                  '"extractive" (a deterministic digest, no LLM), a model name '
                                  '(an LLM call through the upstream), or "" (no summaries)')
    summary_upstream: str | None = Field(
        None, description="the configured upstream (by name) the summary model's calls go to, "
                          "with its own api_key (default: the tenant's upstream and key)")
    summary_max_tokens: int = Field(1_000, ge=64, le=16_000)
    summary_lines: bool = Field(
        False, description='with summary_model = "extractive": a question → answer line per loop '
                          'left out besides their identifiers; false: the identifiers alone, '
                          'for short-turn agents, where every token of the past rides in every '
                          'later request')
    count_tokens: Literal["estimate", "upstream"] = Field(
        "estimate", description="Anthropic's count_tokens: the proxy's estimate of the window "
                                "it would send (calibrated from the upstream's reports), or the "
                                "upstream's own count of that window")
    cache_breakpoints: Literal["client", "auto"] = Field(
        "client", description="Anthropic's cache_control: the client's breakpoints only, or "
                              "(auto) one at the end of the window's stable prefix and one at "
                              "the end of the request besides, at most four in all")
    summary_timeout_s: float = Field(30, gt=0)
    summary_backoff_s: float = Field(300, ge=0, description="pause after 3 failures in a row")
    shadow_rate: float = Field(
        0.0, ge=0, le=1, description="share of the requests the proxy compressed that it also "
                                     "sends as the client sent them, after the client's answer, "
                                     "to compare the two next steps (0: shadow mode off)")
    shadow_baseline_share: float = Field(
        0.0, ge=0, le=1, description="share of the shadow calls after which the request "
                                     "goes uncompressed once more, the two uncompressed "
                                     "answers compared: the model's own agreement, counted "
                                     "under lever=baseline (its cost counts against the cap)")
    shadow_daily_tokens: int | None = Field(
        None, ge=1, description="tokens (input and output) the shadow calls may spend per UTC "
                                "day; reached, they stop until the next day (unset: no cap)")
    shadow_daily_usd: float | None = Field(
        None, gt=0, description="money (US dollars, at the price table's rates) the shadow "
                                "calls may spend per UTC day (unset: no cap)")
    shadow_text_threshold: float = Field(
        0.8, gt=0, le=1, description="two final texts (no tool call, no refusal) agree when "
                                     "their normalised word-level similarity is at least this")

    @property
    def omission_batch(self) -> int:
        return self.omit_batch or max(1, self.max_run_loops // 2)

    @field_validator("summary_model")
    @classmethod
    def _empty_is_off(cls, v: str | None) -> str | None:
        return v or None  # a TOML file cannot say null: "" turns summaries off

    @model_validator(mode="after")
    def _upstream_memory_named(self) -> Policy:
        if self.memory == "upstream" and not (self.embedding_model and
                                               self.embedding_dimensions):
            raise ValueError('memory = "upstream" needs embedding_model and '
                             'embedding_dimensions')
        return self

    @field_validator("target")
    @classmethod
    def _target_below_threshold(cls, v: float, info: Any) -> float:
        threshold = info.data.get("threshold", 0.8)
        if v >= threshold:
            raise ValueError(f"target ({v}) must be below threshold ({threshold})")
        return v


class ModelSpec(_Strict):
    context_window: int = Field(gt=0)
    encoding: str | None = None


class UpstreamSpec(_Strict):
    url: str
    api_key: str | None = None
    format: Literal["any", "anthropic", "chat"] = Field(
        "any", description="any: every API goes upstream as it came in; anthropic: Anthropic's "
                           "API (the key is sent as x-api-key); chat: chat completions only "
                           "(a Messages request is translated)")
    connect_timeout: float = Field(10.0, gt=0)
    read_timeout: float = Field(600.0, gt=0)
    total_timeout: float = Field(1800.0, gt=0)
    max_retries: int = Field(2, ge=0, le=10)
    backoff_base: float = Field(0.25, ge=0)
    backoff_max: float = Field(8.0, ge=0)
    max_connections: int = Field(512, ge=1)

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https:// (got {redact_url(v)!r})")
        return v.rstrip("/")


class ServerSection(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    max_answer_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="an upstream answer the proxy must hold whole "
        "(to answer its own tools, or an error), at most, decompressed; larger ones stream")
    header_timeout_s: float = Field(
        10.0, gt=0, description="a request's headers must arrive within this, from its first "
        "byte or the connection's opening")
    body_timeout_s: float = Field(
        60.0, gt=0, description="a request's body must arrive within this, after its headers")
    keep_alive_s: int = Field(5, ge=1, description="an idle keep-alive connection's life (s)")
    max_header_bytes: int = Field(65_536, ge=4096)
    session_header: str = "X-Session-Id"
    websocket: bool = Field(
        True, description="serve the Responses API over a WebSocket at /v1/responses (Codex "
        "connects so first); off: the upgrade is answered 426, which Codex reads as 'use HTTP'")
    websocket_idle_s: float = Field(
        600.0, gt=0, description="a WebSocket with no event for this long is closed (the "
        "client reconnects and sends the whole conversation)")
    admin_key: str | None = None
    cache_mb: int = Field(128, ge=16, description="memory the per-process caches may use "
                                                  "in all (window carries, forms, counts)")
    held_answers_mb: int = Field(
        256, ge=1, description="upstream answers the proxy reads whole (to answer its tools, "
        "or an error), in all, at once; past it a request gets a 503")
    tenant_share: float = Field(
        0.5, gt=0, le=1, description="the share of each bounded resource (an upstream's "
        "max_connections, held_answers_mb, summary_calls, large_requests) one tenant may "
        "hold; past it, a 429")
    large_requests: int = Field(
        8, ge=1, le=1024, description="requests whose large work (a large body, or the "
        "large stored conversation a server-history turn continues, parsed, counted and "
        "windowed; a pass-through body the proxy walks) runs in worker threads, in flight "
        "at once, in all (a tenant_share each tenant; past it a 429, past the whole a 503); "
        "the process's worker threads are this many and a few for background work")
    summary_calls: int = Field(
        32, ge=1, le=4096, description="model summary calls in flight at once, in all (a "
        "tenant_share each tenant); more wait their turn. Each upstream keeps this many "
        "connections beside max_connections for them, so a tenant's own requests never wait "
        "for summaries")

    @model_validator(mode="after")
    def _one_answer_fits_a_share(self) -> ServerSection:
        if (self.held_answers_mb << 20) * self.tenant_share < self.max_answer_bytes:
            raise ValueError(
                f"held_answers_mb x tenant_share ({self.held_answers_mb} x "
                f"{self.tenant_share}) must hold one answer of max_answer_bytes "
                f"({self.max_answer_bytes} bytes), or no tenant can read one that large")
        return self


REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://")


class StoreSection(_Strict):
    redis_url: str | None = None

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(REDIS_SCHEMES):
            raise ValueError(f"must start with {', '.join(REDIS_SCHEMES)} (got {redact_url(v)!r})")
        return v
    key_prefix: str = "rl"
    retention_days: float = Field(30, gt=0)
    max_messages_per_session: int = Field(20_000, ge=10)
    max_message_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    max_branches: int = Field(256, ge=1)
    max_branch_messages: int = Field(
        100_000, ge=10, description="entries a session's branches hold together (every fork "
        "copies its prefix); past it the least recently used branches are pruned")
    max_stored_messages: int = Field(
        200_000, ge=10, description="message bodies a session keeps, every branch's and "
        "pruned ones' together (they stay until it expires); past it its history stops "
        "growing")
    timeout_s: float = Field(0.5, gt=0)
    retry_after_s: float = Field(2.0, ge=0)
    write_retry_s: float = Field(
        120.0, ge=0, description="how long a history write waits for Redis before it is lost")
    write_queue_mb: int = Field(256, ge=1, description="history waiting to be written, at most")


class TenantSpec(_Strict):
    name: str
    keys: tuple[str, ...] = ()
    upstream: str = "default"
    upstream_key: str | None = None
    forward_client_key: bool = False
    models: dict[str, ModelSpec] = {}
    default_context_window: int = Field(DEFAULT_CONTEXT_WINDOW, gt=0)
    retention_days: float | None = Field(None, gt=0)
    session_sources: tuple[str, ...] = Field(
        DEFAULT_SOURCES, description="where a request names its session, in order: header "
        "(the server's session_header), header:<name>, metadata.<key>, prompt_cache_key, user")
    policy: Policy = Policy()

    @field_validator("session_sources")
    @classmethod
    def _sources(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_source(s) for s in v)

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", v):
            raise ValueError("must be 1-63 letters, digits, '.', '_' or '-'")
        return v

    def context_window(self, model: str) -> int:
        return self.window_of(model).tokens

    def window_of(self, model: str, long_context: bool = False) -> ModelWindow:
        """``model``'s window and whether it is known: the tenant's ``models``, the table's
        (windows.py; ``long_context``: the request asked for the 1M window), the tenant's
        own ``default_context_window`` when it sets one, the table's guess for a later model
        of a family it lists, the default (a guess)."""
        spec = self.models.get(model)
        if spec is not None:
            return ModelWindow(spec.context_window, True, "config")
        found = lookup(model, long_context)
        if found is not None and found.known:
            return found
        if "default_context_window" in self.model_fields_set:
            return ModelWindow(self.default_context_window, True, "config")
        return found or ModelWindow(self.default_context_window, False, "default")

    def encoding_for(self, model: str) -> str | None:
        spec = self.models.get(model)
        return spec.encoding if spec is not None else None


class GlobalFile(_Strict):
    server: ServerSection = ServerSection()
    store: StoreSection = StoreSection()
    upstreams: dict[str, UpstreamSpec] = {}
    defaults: dict[str, Any] = {}


@dataclass(frozen=True)
class Settings:
    """What the command line and RUNLOOP_* environment say; overrides the files."""

    host: str | None = None
    port: int | None = None
    upstream: str | None = None
    upstream_format: str | None = None  # --upstream's format (UpstreamSpec.format)
    config_dir: str | None = None
    redis_url: str | None = None
    data_dir: str = ".runloop"
    log_level: str = "info"
    log_format: Literal["json", "text"] = "json"
    context_window: int | None = None
    admin_key: str | None = None
    workers: int = 1
    cache_mb: int | None = None
    summary_model: str | None = None  # pass-through mode's policy.summary_model


KEY_NAMESPACE = "+"  # <tenant>+<hash of a caller's own key>: no tenant's name has one


@dataclass(frozen=True)
class ProxyConfig:
    """The effective, validated configuration shared by every request."""

    server: ServerSection
    store: StoreSection
    upstreams: dict[str, UpstreamSpec]
    tenants: dict[str, TenantSpec]
    passthrough: TenantSpec | None
    key_index: dict[str, str] = field(default_factory=dict)  # sha256(key) -> tenant name
    # tenants whose upstream key another tenant's requests go with too (``shares_key``)
    shared_keys: frozenset[str] = frozenset()
    sources: tuple[Path, ...] = ()
    prices: PriceTable | None = None  # what upstream usage is priced with (metrics)

    def upstream_secret(self, tenant: TenantSpec) -> str | None:
        """The key the proxy calls ``tenant``'s upstream with, for its requests and for
        anything it sends on the tenant's behalf (a summary, "compact now"): the tenant's
        own ``upstream_key``, else its upstream's ``api_key``; None for a tenant whose
        clients' keys go upstream (``forward_client_key``): the proxy holds none of it."""
        return _secret(tenant, self.upstreams)

    def spec_of_namespace(self, namespace: str) -> TenantSpec | None:
        """The tenant whose sessions a namespace holds: a tenant's own, one of its callers'
        own keys (``forward_client_key``: ``<tenant>+<hash>``), else pass-through's."""
        return self.tenants.get(namespace) or self.tenants.get(
            namespace.partition(KEY_NAMESPACE)[0]) or self.passthrough

    def shares_key(self, tenant: TenantSpec) -> bool:
        """Whether the key the proxy calls ``tenant``'s upstream with is another tenant's
        too (the upstream's ``api_key``, or one ``upstream_key`` written twice): then the
        upstream account, and whatever it stores, is not the tenant's alone."""
        return tenant.name in self.shared_keys

    def tenant_for_key(self, key: str | None) -> TenantSpec | None:
        if key is None:
            return None
        name = self.key_index.get(hash_key(key))
        return self.tenants.get(name) if name else None


def _secret(tenant: TenantSpec, upstreams: dict[str, UpstreamSpec]) -> str | None:
    if tenant.forward_client_key:
        return None
    upstream = upstreams.get(tenant.upstream)
    return tenant.upstream_key or (upstream.api_key if upstream is not None else None)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _resolve_env(value: Any, where: str, file: str, unset: list[ConfigError] | None) -> Any:
    """``${NAME}`` from the environment. An unset one becomes a placeholder unique to its
    place, and with ``unset`` given (a config that needs its secrets) the error naming it is
    added there: every missing variable is reported at once, not one per run. ``replay``,
    which reads only the policies, passes None."""
    if isinstance(value, str):
        def sub(m: re.Match[str]) -> str:
            name = m.group(1)
            if name not in os.environ:
                if unset is not None:
                    unset.append(ConfigError(file, where,
                                             f"environment variable {name} is not set"))
                return f"unset-{name}-{hash_key(file + where)[:16]}"
            return os.environ[name]
        return _ENV_REF.sub(sub, value)
    if isinstance(value, dict):
        return {k: _resolve_env(v, f"{where}.{k}" if where else k, file, unset)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve_env(v, f"{where}[{i}]", file, unset) for i, v in enumerate(value)]
    return value


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _deep_merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), "", f"invalid TOML: {exc}") from exc
    except OSError as exc:
        raise ConfigError(str(path), "", f"cannot read: {exc.strerror}") from exc


def _validate(model: type[_Strict], data: dict[str, Any], file: str, prefix: str = "") -> Any:
    """``data`` as ``model``; else a ConfigError naming every problem (file, field, why), a
    misspelled field with the name it is likely to be."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        found = [ConfigError(file, prefix + ".".join(str(p) for p in err["loc"]),
                             _why(model, err)) for err in exc.errors()]
        raise ConfigError(found[0].file, found[0].field, found[0].why, also=found[1:]) from exc


def _why(model: type[BaseModel], err: Any) -> str:
    if err["type"] != "extra_forbidden":
        return str(err["msg"]).removeprefix("Value error, ")
    where: Any = model
    for part in err["loc"][:-1]:  # the model the unknown field sits in
        field_info = getattr(where, "model_fields", {}).get(str(part))
        where = field_info.annotation if field_info is not None else None
    known = list(getattr(where, "model_fields", {}))
    close = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
    return "unknown field" + (f" (did you mean {close[0]!r}?)" if close else "")


# words a config copied from an example or a tutorial may hold the hash of: a key anyone can
# guess (the examples once shipped the hash of "test"), refused where the config is read
GUESSABLE = ("", "test", "testing", "password", "changeme", "change-me", "secret", "admin",
             "key", "apikey", "api-key", "example", "demo", "proxy", "letmein", "1234",
             "12345678", "123456789", "sk-test", "your-key", "YOUR_KEY", "xxx", "default")


def guessable(digest: str) -> str | None:
    """The well-known word ``digest`` (a sha256, hex) is the hash of, if it is one."""
    return next((w for w in GUESSABLE if hash_key(w) == digest.lower()), None)


def check_hash(value: str, file: str, where: str) -> str:
    """A ``sha256:<hex>`` key's digest, or ConfigError: not 64 hex digits, or the hash of a
    word anyone can guess."""
    digest = value.removeprefix("sha256:").lower()
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ConfigError(file, where, "sha256: must be followed by 64 hex digits")
    word = guessable(digest)
    if word is not None:
        raise ConfigError(file, where, f"the hash of {word!r}, a key anyone can guess: make "
                                       f"one (runloop-proxy init prints one) and put its hash "
                                       f"here (printf %s \"$KEY\" | sha256sum)")
    return digest


def url_hints(config: ProxyConfig) -> list[str]:
    """Upstream URLs that look like a mistake, each with its fix: no path at all, where
    OpenAI-compatible servers and Anthropic's API serve under /v1."""
    out = []
    for name, spec in sorted(config.upstreams.items()):
        if urllib.parse.urlsplit(spec.url).path in ("", "/"):
            out.append(f"upstream {name!r}: {redact_url(spec.url)} has no /v1 — OpenAI-"
                       f"compatible servers (and Anthropic's API) answer under /v1: did you "
                       f"mean {redact_url(spec.url)}/v1?")
    return out


def _key_hashes(tenant: TenantSpec, file: str) -> list[str]:
    hashes = []
    for i, key in enumerate(tenant.keys):
        if key.startswith("sha256:"):
            hashes.append(check_hash(key, file, f"keys[{i}]"))
        elif len(key) < 16:
            raise ConfigError(file, f"keys[{i}]", "a proxy key must be at least 16 characters")
        else:
            hashes.append(hash_key(key))
    return hashes


def passthrough_tenant(settings: Settings, defaults: dict[str, Any] | None = None) -> TenantSpec:
    data = _deep_merge(defaults or {}, {"name": "passthrough", "forward_client_key": True})
    if settings.context_window:
        data["default_context_window"] = settings.context_window
    if settings.summary_model:
        data = _deep_merge(data, {"policy": {"summary_model": settings.summary_model}})
    return TenantSpec.model_validate(data)


def load_config(settings: Settings, *, secrets: bool = True) -> ProxyConfig:
    """Build the effective config from the files (if any) and the settings; raise ConfigError.
    ``secrets=False``: unset ``${ENV}`` references are placeholders (policy-only readers)."""
    raw: dict[str, Any] = {}
    sources: list[Path] = []
    tenant_files: list[Path] = []
    unset: list[ConfigError] | None = [] if secrets else None
    if settings.config_dir:
        root = Path(settings.config_dir)
        if not root.is_dir():
            raise ConfigError(str(root), "", "not a directory" if root.exists()
                              else "config directory does not exist")
        gpath = root / GLOBAL_FILE
        if gpath.exists():
            raw = _resolve_env(_read_toml(gpath), "", str(gpath), unset)
            sources.append(gpath)
        tdir = root / TENANTS_DIR
        if tdir.is_dir():
            tenant_files = sorted(tdir.glob("*.toml"))
    tenant_data = [(path, _resolve_env(_read_toml(path), "", str(path), unset))
                   for path in tenant_files]
    if unset:
        first = unset[0]
        raise ConfigError(first.file, first.field, first.why, also=unset[1:])
    gfile: GlobalFile = _validate(GlobalFile, raw, str(sources[0]) if sources else "<defaults>")

    server_over = {k: v for k, v in (("host", settings.host), ("port", settings.port),
                                     ("admin_key", settings.admin_key),
                                     ("cache_mb", settings.cache_mb)) if v is not None}
    over = "the command line or RUNLOOP_*"
    server = _validate(ServerSection, {**gfile.server.model_dump(), **server_over}, over,
                       "server.") if server_over else gfile.server
    if server.admin_key and server.admin_key.startswith("sha256:"):
        check_hash(server.admin_key, str(sources[0]) if sources and not settings.admin_key
                   else over, "server.admin_key")
    store = _validate(StoreSection, {**gfile.store.model_dump(),
                                     "redis_url": settings.redis_url}, over, "store.") \
        if settings.redis_url else gfile.store
    upstreams = dict(gfile.upstreams)
    if settings.upstream:
        # a new URL for the file's default upstream: its other fields stay (timeouts,
        # retries, connections, format), its key does not (written for another URL)
        file_default = gfile.upstreams.get("default")
        kept = file_default.model_dump(exclude={"url", "api_key"}) if file_default else {}
        upstreams["default"] = _validate(UpstreamSpec, {
            **kept, "url": settings.upstream, **({"format": settings.upstream_format}
                                                 if settings.upstream_format else {})},
            "--upstream")
    defaults = dict(gfile.defaults)
    if settings.context_window:
        defaults["default_context_window"] = settings.context_window
    # the defaults checked where they are written: a mistake in them is not a tenant file's
    _validate(TenantSpec, {"name": "defaults", **defaults},
              str(sources[0]) if sources else over, "defaults.")

    tenants: dict[str, TenantSpec] = {}
    key_index: dict[str, str] = {}
    for path, data in tenant_data:
        data.setdefault("name", path.stem)
        tenant: TenantSpec = _validate(TenantSpec, _deep_merge(defaults, data), str(path))
        if tenant.name in tenants:
            raise ConfigError(str(path), "name", f"tenant {tenant.name!r} is defined twice")
        if tenant.upstream not in upstreams:
            raise ConfigError(str(path), "upstream",
                              f"unknown upstream {tenant.upstream!r} "
                              f"(known: {', '.join(sorted(upstreams)) or 'none'})")
        if not tenant.keys:
            raise ConfigError(str(path), "keys", "a tenant needs at least one proxy key")
        if not tenant.upstream_key and not tenant.forward_client_key \
                and not upstreams[tenant.upstream].api_key:
            raise ConfigError(str(path), "upstream_key",
                              "no upstream key (set upstream_key or the upstream's api_key)")
        _check_summary_upstream(tenant, upstreams, str(path))
        for digest in _key_hashes(tenant, str(path)):
            if digest in key_index:
                raise ConfigError(str(path), "keys",
                                  f"a key is already used by tenant {key_index[digest]!r}")
            key_index[digest] = tenant.name
        tenants[tenant.name] = tenant
        sources.append(path)

    # A config directory with a tenants/ folder is tenant mode, even with no tenant in it
    # (every key is refused, and the proxy reports not ready); without one, pass-through.
    tenant_mode = bool(settings.config_dir) and (Path(settings.config_dir or ".") / TENANTS_DIR
                                                 ).is_dir()
    passthrough = None
    if not tenant_mode:
        if "default" not in upstreams:
            raise ConfigError("<settings>", "upstream",
                              "no tenants are configured: give --upstream (pass-through mode)")
        passthrough = passthrough_tenant(settings, defaults)
    if passthrough is not None:
        _check_summary_upstream(passthrough, upstreams, "<settings>")
    prices = PriceTable.in_config(settings.config_dir)
    if settings.config_dir and (Path(settings.config_dir) / PRICES_FILE).is_file():
        sources.append(Path(settings.config_dir) / PRICES_FILE)
    users: dict[tuple[str, str], list[str]] = {}
    for tenant in tenants.values():
        if (secret := _secret(tenant, upstreams)) is not None:
            users.setdefault((tenant.upstream, secret), []).append(tenant.name)
    shared = frozenset(n for names in users.values() if len(names) > 1 for n in names)
    return ProxyConfig(server=server, store=store, upstreams=upstreams, tenants=tenants,
                       passthrough=passthrough, key_index=key_index, shared_keys=shared,
                       sources=tuple(sources), prices=prices)


def _check_summary_upstream(tenant: TenantSpec, upstreams: dict[str, UpstreamSpec],
                            where: str) -> None:
    """A summary (or embedding) upstream is a configured one; another than the tenant's own
    is called with its own ``api_key`` only (a key goes only to the upstream it was given
    for)."""
    for what, name in (("summary", tenant.policy.summary_upstream),
                       ("embedding", tenant.policy.embedding_upstream)):
        if name is None or name == tenant.upstream:
            continue
        if name not in upstreams:
            raise ConfigError(where, f"policy.{what}_upstream",
                              f"unknown upstream {name!r} "
                              f"(known: {', '.join(sorted(upstreams)) or 'none'})")
        if not upstreams[name].api_key:
            raise ConfigError(where, f"policy.{what}_upstream",
                              f"upstream {name!r} has no api_key: the proxy calls a {what} "
                              f"upstream with its own key only, never the tenant's or a "
                              f"client's")


def describe(config: ProxyConfig) -> dict[str, Any]:
    """The effective config as plain data, secrets redacted (for check-config)."""
    def redact_upstream(u: UpstreamSpec) -> dict[str, Any]:
        d = u.model_dump()
        d["api_key"] = "<set>" if u.api_key else None
        d["url"] = redact_url(u.url)
        return d

    tenants = {}
    for name, t in {**config.tenants, **({"passthrough": config.passthrough}
                                          if config.passthrough else {})}.items():
        d = t.model_dump(mode="json")
        d["keys"] = [f"<{len(t.keys)} key(s)>"] if t.keys else []
        d["upstream_key"] = "<set>" if t.upstream_key else None
        tenants[name] = d
    server = config.server.model_dump()
    server["admin_key"] = "<set>" if config.server.admin_key else None
    store = config.store.model_dump()
    store["redis_url"] = redact_url(config.store.redis_url)
    return {"server": server, "store": store,
            "upstreams": {n: redact_upstream(u) for n, u in config.upstreams.items()},
            "tenants": tenants}


# a query parameter named like a credential: ?key=, ?api-key=, ?token=, ?sig=, ?password= ...
_SECRET_PARAM = re.compile(r"(?i)key|token|secret|pass|auth|sig|credential|session")


def redact_url(url: str | None) -> str | None:
    """A URL without the credentials it may carry (user:password@, a query parameter named
    like a key, a token, a password or a signature)."""
    if not url:
        return url
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        creds, host = netloc.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        netloc = f"{user}:<redacted>@{host}" if ":" in creds else f"<redacted>@{host}"
    query = urllib.parse.urlencode(
        [(k, "<redacted>" if _SECRET_PARAM.search(k) else v)
         for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)])
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))


def config_mtimes(config_dir: str | None) -> tuple[tuple[str, float], ...]:
    """A cheap fingerprint of the config files, to notice edits without inotify."""
    if not config_dir:
        return ()
    root = Path(config_dir)
    paths = [root / GLOBAL_FILE, root / PRICES_FILE,
             *sorted((root / TENANTS_DIR).glob("*.toml"))]
    out = []
    for p in paths:
        try:
            out.append((str(p), p.stat().st_mtime))
        except OSError:
            continue
    return tuple(out)
