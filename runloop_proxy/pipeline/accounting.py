"""One request's bookkeeping: its timings, tokens and outcome, counted and logged exactly once,
whatever path the request took (answered, streamed, refused, failed, or abandoned by the client)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..ops import logs
from ..ops.metrics import OTHER_MODEL, BoundMetrics, Metrics
from ..savings import Prompt
from .shares import Shares

log = logs.get("request")
# what a request whose large work runs in worker threads holds (``server.large_requests``)
LARGE_WORK = "large requests (bodies worked on in worker threads)"
UNAUTHENTICATED = "unauthenticated"  # the tenant label of a request refused for its key
CLIENT_CLOSED = 499  # nginx's "client closed request", for logs and metrics

LOGGED_MODEL_CHARS = 64  # of a client's name (a model's, a field's) in a log line


class RequestLog:
    """Created when a request arrives; the stages fill it in; ``finish`` counts it once."""

    def __init__(self, metrics: Metrics, api: str):
        self.metrics = metrics
        self.api = api
        self.started = time.perf_counter()
        self.tenant = ""
        self.label = ""
        self.model = ""
        self.stream = False
        self.session: str | None = None
        self.degraded: str | None = None
        # whole prompts as the proxy counts them (messages, tool schemas, reply priming): the
        # client's, and what went upstream (the proxy's tools included when it added them)
        self.prompt_tokens: tuple[int, int] | None = None
        # those prompts as blocks: what the headline compares with the session's last ones
        self.prompts: tuple[Prompt, Prompt] | None = None
        # the frame the window was built in (framing.Frame.point()), taken when it was built:
        # the answer's usage recalibrates the model before the turn is recorded
        self.frame: dict[str, Any] | None = None
        self.upstream_seconds = 0.0
        self.upstream_called_at: float | None = None
        self.first_byte_seen = False
        self.status: int | None = None
        # the upstream's usage of the request as it billed it (``billed``), kept with its
        # point: what the request cost, priced later by whoever asks (``wrap``)
        self.billed: dict[str, Any] | None = None
        self._bound: BoundMetrics | None = None
        self._at_end: list[Callable[[], None]] = []  # run once the request is done
        self._holds: set[int] = set()  # the Shares this request holds a unit of (``hold``)

    def at_end(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the request is done (``finish``, or its frame's end: a request
        cancelled is not counted, and what it held is given back all the same), or now if
        it is."""
        if self.status is not None:
            fn()
        else:
            self._at_end.append(fn)

    def hold(self, shares: Shares, holder: str, what: str = LARGE_WORK) -> None:
        """One unit of ``shares`` held for ``holder`` until the request ends — once, however
        many of its stages find their work large (the body read, then the stored
        conversation it continues): past the share a 429, past the whole a 503."""
        if id(shares) in self._holds:
            return
        shares.take(holder, 1, what)
        self._holds.add(id(shares))
        self.at_end(lambda: shares.give(holder))

    def ended(self) -> None:
        """What waits for the request's end, run once."""
        told, self._at_end = self._at_end, []
        for fn in told:
            fn()

    def authenticated(self, tenant: str, label: str) -> None:
        """Whose request it is, known before its body is read: a request refused then (a
        400) is counted under its tenant, with the model ``other``."""
        self.tenant, self.label = tenant, label

    def identify(self, tenant: str, label: str, model: str, stream: bool) -> None:
        self.tenant, self.label, self.stream = tenant, label, stream
        self.model = model[:LOGGED_MODEL_CHARS]  # a log line is bounded whatever a client sent
        self._bound = self.metrics.bound(label, self.metrics.model_label(label, model))

    @property
    def identified(self) -> bool:
        return self._bound is not None

    @property
    def bound(self) -> BoundMetrics:
        assert self._bound is not None, "identify() first"
        return self._bound

    def upstream_started(self) -> float:
        now = time.perf_counter()
        if self.upstream_called_at is None:
            self.upstream_called_at = now
        return now

    def upstream_took(self, since: float) -> None:
        self.upstream_seconds += time.perf_counter() - since

    def first_byte(self) -> None:
        if not self.first_byte_seen:
            self.first_byte_seen = True
            self.bound.ttft.observe(time.perf_counter() - self.started)

    def usage(self, usage: dict[str, Any] | None) -> None:
        """Upstream-reported usage (every round of the request summed by the caller)."""
        if not usage or not self.identified:
            return
        self.billed = billed(usage)
        b = self.bound
        prompt, cached = prompt_usage(usage)
        b.usage_prompt.inc(prompt)
        b.usage_completion.inc(_int(usage.get("completion_tokens",
                                              usage.get("output_tokens"))))
        b.usage_cached.inc(cached)
        price = self.metrics.price(self.model)
        if price is not None:  # priced as the provider bills: cached and written apart
            for kind, usd in price.usage_cost(usage).items():
                b.cost[kind].inc(usd)

    def finish(self, status: int, error: str | None = None) -> None:
        """Count and log the request; later calls do nothing (the first outcome stands)."""
        if self.status is not None:
            return
        self.status = status
        self.ended()
        if not self.identified:
            # refused before its body was read (invalid JSON, a missing model: a 400), or
            # before its key was (a 401): counted and logged all the same, under its tenant
            # when known, the model "other"
            self._bound = self.metrics.bound(self.label or UNAUTHENTICATED, OTHER_MODEL)
        b = self.bound
        elapsed = time.perf_counter() - self.started
        if self.stream and self.upstream_called_at is not None:
            # a stream's body time is the upstream's: the proxy's share is what came before it
            overhead = self.upstream_called_at - self.started
            self.upstream_seconds = elapsed - overhead
        else:
            overhead = max(0.0, elapsed - self.upstream_seconds)
        b.request(status, self.stream, self.api)
        if self.upstream_called_at is not None:
            b.upstream_latency.observe(self.upstream_seconds)
        b.overhead.observe(overhead)
        if self.prompt_tokens is not None:
            client, forwarded = self.prompt_tokens
            b.client_tokens.inc(client)
            b.forwarded_tokens.inc(forwarded)
            b.saved_tokens.inc(max(0, client - forwarded))
        log.info("request", extra={
            "api": self.api, "tenant": self.tenant, "model": self.model,
            "session": self.session, "status": status, "stream": self.stream,
            "tokens_client": self.prompt_tokens[0] if self.prompt_tokens else None,
            "tokens_forwarded": self.prompt_tokens[1] if self.prompt_tokens else None,
            "latency_ms": round(elapsed * 1000, 2),
            "upstream_ms": round(self.upstream_seconds * 1000, 2),
            "proxy_ms": round(overhead * 1000, 3),
            "degraded": self.degraded, "error": error})


def prompt_usage(usage: dict[str, Any]) -> tuple[int, int]:
    """The whole prompt an upstream reports, and how much of it its cache served, whatever
    the API: chat's ``prompt_tokens``, Responses' ``input_tokens`` (each with its cached
    details), or Anthropic's, whose ``input_tokens`` leave out what the cache read and wrote
    (``cache_read_input_tokens``, ``cache_creation_input_tokens``)."""
    if "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage:
        read = _int(usage.get("cache_read_input_tokens"))
        return (_int(usage.get("input_tokens")) + read
                + _int(usage.get("cache_creation_input_tokens")), read)
    prompt = _int(usage.get("prompt_tokens", usage.get("input_tokens")))
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    return prompt, _int(details.get("cached_tokens")) if isinstance(details, dict) else 0


BILLED = ("prompt_tokens", "input_tokens", "completion_tokens", "output_tokens",
          "cache_read_input_tokens", "cache_creation_input_tokens")


def billed(usage: dict[str, Any]) -> dict[str, Any]:
    """What of an upstream's usage prices it (``Price.usage_cost`` reads these): its counts,
    and the cached tokens of its details; nothing else it may carry."""
    out: dict[str, Any] = {k: usage[k] for k in BILLED if _int(usage.get(k))}
    for k in ("prompt_tokens_details", "input_tokens_details"):
        details = usage.get(k)
        if isinstance(details, dict) and _int(details.get("cached_tokens")):
            out[k] = {"cached_tokens": details["cached_tokens"]}
    return out


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0
