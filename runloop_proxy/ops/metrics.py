"""Prometheus metrics. Labels are bounded: tenant names and model names only, never keys,
session ids or prompt text. Several uvicorn workers: set PROMETHEUS_MULTIPROC_DIR (README)."""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    generate_latest,
    multiprocess,
)

from ..pricing import Price, PriceTable

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_OVERHEAD = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
MAX_MODEL_LABELS = 64  # per tenant label: one tenant's clients cannot use up another's
OTHER_MODEL = "other"  # models past MAX_MODEL_LABELS; and the series every tenant starts with
# The label values panels and alerts select on, exported at 0 from startup (a series that does
# not exist yet reads as "no data", and an alert on it never fires).
APIS = ("chat", "responses", "responses_chained", "responses_ws", "responses_warmup", "messages",
        "messages_count")
COMPACTION_KINDS = ("past_loop_reduction", "in_loop_elision", "in_loop_drop", "loop_omission",
                    "summary", "hard_truncation", "rejection")
RECALL_OUTCOMES = {"recall_tool_call": ("hit", "not_found", "bad_arguments", "store_error"),
                   "search_history": ("hit", "miss", "bad_arguments")}
SUMMARY_OUTCOMES = ("ok", "error", "timeout", "backoff", "late", "deferred", "store")
COST_KINDS = ("input", "cached_input", "cache_write", "output")
# the levers a shadow comparison is counted under (pipeline/shadow.py LEVERS, and "any")
SHADOW_LEVERS = ("past_loops", "elided", "dropped", "omission", "summary", "hard_limit",
                 "other", "any", "baseline")
STORE_OPS = ("sync", "read", "ping", "record", "internal", "anchor", "recall", "search",
             "list", "write_lost", "too_large", "summary")


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.prices: PriceTable | None = None  # what upstream usage is priced with
        self._models: dict[str, set[str]] = {}  # tenant label -> its model labels
        self._bound: dict[tuple[str, str], BoundMetrics] = {}
        r = self.registry
        # the process's garbage collections by generation (a full one stops every thread)
        GCCollector(registry=r)
        tm = ("tenant", "model")
        self.requests = Counter("runloop_requests_total", "Conversation requests by outcome",
                                [*tm, "status", "stream", "api"], registry=r)
        self.passthrough_requests = Counter("runloop_passthrough_requests_total",
                                            "Other /v1 requests passed through",
                                            ["tenant", "status"], registry=r)
        self.share_refusals = Counter(
            "runloop_share_refusals_total", "Requests refused for a bounded resource: "
            "reason=tenant (its share held: 429) or process (all of it held: 503)",
            ["resource", "reason"], registry=r)
        self.in_flight = Gauge("runloop_in_flight_requests", "Requests being served",
                               registry=r, multiprocess_mode="livesum")
        self.websockets = Gauge("runloop_websocket_connections",
                                "Responses API WebSocket connections open", registry=r,
                                multiprocess_mode="livesum")
        self.upstream_latency = Histogram("runloop_upstream_latency_seconds",
                                          "Upstream time per request (all upstream calls)", tm,
                                          buckets=_LATENCY, registry=r)
        self.ttft = Histogram("runloop_time_to_first_token_seconds",
                              "Time from request to first streamed byte", tm,
                              buckets=_LATENCY, registry=r)
        self.overhead = Histogram("runloop_proxy_overhead_seconds",
                                  "Time spent in the proxy excluding the upstream", tm,
                                  buckets=_OVERHEAD, registry=r)
        self.client_tokens = Counter("runloop_prompt_tokens_client_total",
                                     "Prompt tokens as the client sent them", tm, registry=r)
        self.forwarded_tokens = Counter("runloop_prompt_tokens_forwarded_total",
                                        "Prompt tokens as forwarded upstream", tm, registry=r)
        self.saved_tokens = Counter("runloop_prompt_tokens_saved_total",
                                    "Prompt tokens saved by the window", tm, registry=r)
        self.usage_tokens = Counter("runloop_upstream_usage_tokens_total",
                                    "Upstream-reported usage", [*tm, "kind"], registry=r)
        self.cost = Counter("runloop_upstream_cost_usd_total",
                            "Upstream-reported usage priced as the provider bills it (USD; "
                            "the price table, prices.toml)", [*tm, "kind"], registry=r)
        self.prompt_bill = Counter(
            "runloop_prompt_bill_usd_total", "Each request's prompt priced at the provider's "
            "prices with its prompt cache, side=client (as sent) or forwarded: the headline "
            "'bill saved' is 1 - forwarded / client (savings.py)", [*tm, "side"], registry=r)
        self.compactions = Counter("runloop_compaction_events_total",
                                   "Window compaction events", [*tm, "kind"], registry=r)
        self.recalls = Counter("runloop_recalls_total", "Proxy-owned tool calls answered",
                               ["tenant", "tool", "outcome"], registry=r)
        self.memory = Counter(
            "runloop_memory_total", "Long-term memory's work: segments indexed after answers "
            "and searches by meaning, by outcome (a failed or slow one leaves words alone)",
            ["tenant", "op", "outcome"], registry=r)
        self.memory_tokens = Counter(
            "runloop_memory_embedding_tokens_total", "Tokens a tenant's embedding model "
            "used through its upstream (memory = upstream), as the upstream's usage says, by "
            "op (index, search)", ["tenant", "op"], registry=r)
        self.summaries = Counter("runloop_summaries_total", "Summaries by outcome",
                                 ["tenant", "outcome"], registry=r)
        self.summary_seconds = Histogram("runloop_summary_latency_seconds",
                                         "Summary generation latency", ["tenant"],
                                         buckets=_LATENCY, registry=r)
        self.summary_tokens = Counter("runloop_summary_tokens_total",
                                      "Tokens the summary model's calls used",
                                      ["tenant", "kind"], registry=r)
        self.truncations = Counter("runloop_truncations_total",
                                   "Hard-limit truncations", tm, registry=r)
        self.rejections = Counter("runloop_context_rejections_total",
                                  "Requests refused as context_length_exceeded", tm, registry=r)
        self.store_errors = Counter("runloop_store_errors_total", "Store operation failures",
                                    ["op"], registry=r)
        self.degraded = Counter("runloop_degraded_requests_total",
                                "Requests served in degraded mode", ["tenant", "reason"],
                                registry=r)
        self.store_up = Gauge("runloop_store_up", "1 when the store answered last time",
                              registry=r, multiprocess_mode="max")
        self.write_queue = Gauge("runloop_write_queue_jobs",
                                 "History writes waiting for Redis (write-behind)",
                                 registry=r, multiprocess_mode="livesum")
        self.background_failures = Counter(
            "runloop_background_failures_total",
            "Background tasks that raised (logged with a traceback; a long-lived one started "
            "again)", ["task"], registry=r)
        self.branches_pruned = Counter("runloop_branches_pruned_total",
                                       "Least recently used branches pruned past max_branches",
                                       registry=r)
        self.config_reloads = Counter("runloop_config_reloads_total", "Config reloads",
                                      ["outcome"], registry=r)
        self.shadow_comparisons = Counter(
            "runloop_shadow_comparisons_total", "Shadow comparisons of a compressed request's "
            "next step with the full one's, by lever active on the window (lever=any: every "
            "comparison once) and outcome (agree, differ, error)",
            ["tenant", "lever", "outcome"], registry=r)
        self.shadow_tokens = Counter("runloop_shadow_tokens_total",
                                     "Tokens (input and output) the shadow calls used",
                                     ["tenant"], registry=r)
        self.shadow_cost = Counter("runloop_shadow_cost_usd_total",
                                   "What the shadow calls cost (USD, the price table)",
                                   ["tenant"], registry=r)
        self.shadow_skipped = Counter(
            "runloop_shadow_skipped_total", "Requests sampled for a shadow call and not "
            "shadowed: reason=cap (the daily cap reached), busy (the tenant holds half its "
            "upstream connections), store (Redis, which keeps the spend every replica's cap reads, "
            "unavailable: no shadow call goes)",
            ["tenant", "reason"], registry=r)
        self.store_latency = Histogram("runloop_store_latency_seconds",
                                       "Store round-trips on the request path", ["op"],
                                       buckets=_OVERHEAD, registry=r)

    def init_tenants(self, tenants: list[str]) -> None:
        """Export every series the dashboard and the alerts read, at 0, for these tenants."""
        for op in STORE_OPS:
            self.store_errors.labels(op)
        for outcome in ("ok", "error"):
            self.config_reloads.labels(outcome)
        for tenant in tenants:
            b = self.bound(tenant, OTHER_MODEL)
            for status in (200, 500):
                for stream in ("true", "false"):
                    for api in APIS:
                        b.request_child(status, stream, api)
            for kind in COMPACTION_KINDS:
                self.compactions.labels(tenant, OTHER_MODEL, kind)
            for kind in COST_KINDS:
                self.cost.labels(tenant, OTHER_MODEL, kind)
            for tool, outcomes in RECALL_OUTCOMES.items():
                for outcome in outcomes:
                    self.recalls.labels(tenant, tool, outcome)
            for outcome in SUMMARY_OUTCOMES:
                self.summaries.labels(tenant, outcome)
            self.summary_seconds.labels(tenant)
            for kind in ("prompt", "completion"):
                self.summary_tokens.labels(tenant, kind)
            self.truncations.labels(tenant, OTHER_MODEL)
            self.rejections.labels(tenant, OTHER_MODEL)
            for reason in ("store", "window"):
                self.degraded.labels(tenant, reason)
            for lever in SHADOW_LEVERS:
                for outcome in ("agree", "differ", "error"):
                    self.shadow_comparisons.labels(tenant, lever, outcome)
            self.shadow_tokens.labels(tenant)
            self.shadow_cost.labels(tenant)
            for reason in ("cap", "busy", "store"):
                self.shadow_skipped.labels(tenant, reason)

    def bound(self, tenant: str, model: str) -> BoundMetrics:
        """The per-(tenant, model) children, resolved once (labels() is not free)."""
        key = (tenant, model)
        hit = self._bound.get(key)
        if hit is None:
            hit = self._bound[key] = BoundMetrics(self, tenant, model)
        return hit

    def price(self, model: str) -> Price | None:
        """A model's price in the table, whichever provider lists it."""
        if self.prices is None:
            return None
        return next((p for prov in self.prices.providers.values()
                     if (p := prov.price(model)) is not None), None)

    def model_label(self, tenant: str, model: str) -> str:
        """Model names come from clients: cap how many distinct ones become labels, per
        tenant (its clients' junk names never turn another tenant's models into "other")."""
        seen = self._models.setdefault(tenant, set())
        if model in seen:
            return model
        if len(seen) < MAX_MODEL_LABELS and len(model) <= 64:
            seen.add(model)
            return model
        return OTHER_MODEL

    def render(self) -> tuple[bytes, str]:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class BoundMetrics:
    def __init__(self, m: Metrics, tenant: str, model: str):
        tm = (tenant, model)
        self.upstream_latency = m.upstream_latency.labels(*tm)
        self.ttft = m.ttft.labels(*tm)
        self.overhead = m.overhead.labels(*tm)
        self.client_tokens = m.client_tokens.labels(*tm)
        self.forwarded_tokens = m.forwarded_tokens.labels(*tm)
        self.saved_tokens = m.saved_tokens.labels(*tm)
        self.usage_prompt = m.usage_tokens.labels(*tm, "prompt")
        self.usage_completion = m.usage_tokens.labels(*tm, "completion")
        self.usage_cached = m.usage_tokens.labels(*tm, "cached_prompt")
        self.cost = {kind: m.cost.labels(*tm, kind) for kind in COST_KINDS}
        self.bill_client = m.prompt_bill.labels(*tm, "client")
        self.bill_forwarded = m.prompt_bill.labels(*tm, "forwarded")
        self.requests: dict[tuple[int, str, str], Any] = {}
        self._requests = m.requests
        self._tm = tm

    def request(self, status: int, stream: bool, api: str) -> None:
        self.request_child(status, "true" if stream else "false", api).inc()

    def request_child(self, status: int, stream: str, api: str) -> Any:
        key = (status, stream, api)
        child = self.requests.get(key)
        if child is None:
            child = self.requests[key] = self._requests.labels(*self._tm, str(status), stream,
                                                               api)
        return child
