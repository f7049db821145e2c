"""Generate the Grafana dashboard (deploy/grafana/dashboards/runloop-proxy.json).

    python deploy/make_dashboard.py

Panels are data: a title, a description (what it means) and PromQL targets. The tests run every
expression against a real Prometheus scraping a real proxy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

T = 'tenant=~"$tenant"'
R = "$__rate_interval"


def rate(metric: str, sel: str = T, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}{{{sel}}}[{R}]))"


def quantile(q: float, metric: str, by: str = "", sel: str = T) -> str:
    extra = f", {by}" if by else ""
    return (f"histogram_quantile({q}, sum by (le{extra}) "
            f"(rate({metric}_bucket{{{sel}}}[{R}])))")


def over_range(metric: str, sel: str = T) -> str:
    return f"sum(increase({metric}{{{sel}}}[$__range]))"


BILL = "runloop_prompt_bill_usd_total"
CLIENT_BILL = f'{T},side="client"'
FORWARDED_BILL = f'{T},side="forwarded"'
# "> 0": with nothing sent the share is no data, not 100% (1 - 0 / a clamped 0)
BILL_SAVED = (f"1 - {over_range(BILL, FORWARDED_BILL)} / ({over_range(BILL, CLIENT_BILL)} > 0)")

ROWS: list[tuple[str, list[dict[str, Any]]]] = [
    ("Headline: what the proxy saved (the dashboard's time range)", [
        {"title": "Bill saved", "unit": "percentunit", "type": "stat",
         "description": "The headline: the share of the provider's bill for prompts saved, at "
                        "its prices with its prompt cache, against the same requests sent "
                        "uncompressed (the figure the demo, replay and the inspector show).",
         "targets": [(BILL_SAVED, "bill saved")]},
        {"title": "Money saved", "unit": "currencyUSD", "type": "stat",
         "description": "The same difference in US dollars: the prompts' bill as sent minus "
                        "as forwarded, both at the provider's cache prices.",
         "targets": [(f"{over_range(BILL, CLIENT_BILL)} - {over_range(BILL, FORWARDED_BILL)}",
                      "money saved")]},
        {"title": "Prompt tokens saved (secondary)", "unit": "percentunit", "type": "stat",
         "description": "Raw prompt tokens the window removed, no cache: a secondary figure, "
                        "not the bill.",
         "targets": [(f"1 - {over_range('runloop_prompt_tokens_forwarded_total')} / "
                      f"({over_range('runloop_prompt_tokens_client_total')} > 0)",
                      "prompt tokens saved")]},
        {"title": "Requests answered", "unit": "short", "type": "stat",
         "description": "Conversation requests answered 2xx in the range.",
         "targets": [(f'sum(increase(runloop_requests_total{{{T},status=~"2.."}}[$__range]))',
                      "requests")]},
    ]),
    ("Money", [
        {"title": "Prompt bill: as sent vs as forwarded", "unit": "currencyUSD",
         "description": "USD per hour the prompts cost at the provider's cache prices, as "
                        "the clients sent them and as the proxy forwarded them.",
         "targets": [(f"3600 * sum(rate({BILL}{{{CLIENT_BILL}}}[{R}]))", "as sent (USD/h)"),
                     (f"3600 * sum(rate({BILL}{{{FORWARDED_BILL}}}[{R}]))",
                      "as forwarded (USD/h)")]},
        {"title": "Upstream bill by kind", "unit": "currencyUSD",
         "description": "USD per hour the upstream's reported usage costs, by kind (input, "
                        "cached input, cache writes, output).",
         "targets": [(f"3600 * {rate('runloop_upstream_cost_usd_total', by='kind')}",
                      "{{kind}} (USD/h)")]},
    ]),
    ("Traffic", [
        {"title": "Requests per second by status", "unit": "reqps",
         "description": "Conversation requests (chat completions and Responses) answered, "
                        "by HTTP status.",
         "targets": [(rate("runloop_requests_total", by="status"), "status {{status}}")]},
        {"title": "Error rate", "unit": "percentunit",
         "description": "Share of conversation requests that did not answer 2xx "
                        "(upstream errors passed through included).",
         "targets": [(f'sum(rate(runloop_requests_total{{{T},status!~"2.."}}[{R}])) '
                      f'/ clamp_min({rate("runloop_requests_total")}, 1e-9)',
                      "errors")]},
        {"title": "Streaming vs non-streaming", "unit": "reqps",
         "description": "Requests by stream flag.",
         "targets": [(rate("runloop_requests_total", by="stream"), "stream={{stream}}")]},
        {"title": "In-flight requests", "unit": "short",
         "description": "Requests being served right now (the scrapes and probes reading "
                        "it left out).",
         "targets": [("sum(runloop_in_flight_requests)", "in flight")]},
    ]),
    ("Latency split", [
        {"title": "Upstream latency", "unit": "s",
         "description": "Time spent waiting on the upstream per request (all rounds).",
         "targets": [(quantile(0.5, "runloop_upstream_latency_seconds"), "p50"),
                     (quantile(0.95, "runloop_upstream_latency_seconds"), "p95")]},
        {"title": "Proxy overhead", "unit": "s",
         "description": "Time spent inside the proxy, upstream excluded: what the proxy costs.",
         "targets": [(quantile(0.5, "runloop_proxy_overhead_seconds"), "p50"),
                     (quantile(0.99, "runloop_proxy_overhead_seconds"), "p99")]},
        {"title": "Time to first token (streams)", "unit": "s",
         "description": "From request arrival to the first streamed byte sent to the client.",
         "targets": [(quantile(0.5, "runloop_time_to_first_token_seconds"), "p50"),
                     (quantile(0.95, "runloop_time_to_first_token_seconds"), "p95")]},
    ]),
    ("Tokens and savings", [
        {"title": "Prompt tokens: client vs forwarded", "unit": "short",
         "description": "Prompt tokens per second as clients sent them and as the proxy "
                        "forwarded them.",
         "targets": [(rate("runloop_prompt_tokens_client_total"), "client"),
                     (rate("runloop_prompt_tokens_forwarded_total"), "forwarded")]},
        {"title": "Savings", "unit": "percentunit",
         "description": "Share of prompt tokens the window removed (raw tokens; the bill "
                        "saved is the headline above). No data while nothing is sent.",
         "targets": [(f'1 - {rate("runloop_prompt_tokens_forwarded_total")} / '
                      f'({rate("runloop_prompt_tokens_client_total")} > 0)',
                      "prompt tokens saved")]},
        {"title": "Saved tokens per tenant", "unit": "short",
         "description": "Prompt tokens saved, per tenant, per second.",
         "targets": [(rate("runloop_prompt_tokens_saved_total", by="tenant"), "{{tenant}}")]},
        {"title": "Upstream-reported usage", "unit": "short",
         "description": "Tokens the upstream billed: prompt, completion and cached prompt "
                        "tokens (the provider's prefix cache at work).",
         "targets": [(rate("runloop_upstream_usage_tokens_total", by="kind"), "{{kind}}")]},
        {"title": "Cache hit share", "unit": "percentunit",
         "description": "Cached prompt tokens over prompt tokens, as the upstream reports.",
         "targets": [(f'sum(rate(runloop_upstream_usage_tokens_total{{{T},kind="cached_prompt"}}'
                      f'[{R}])) / clamp_min(sum(rate('
                      f'runloop_upstream_usage_tokens_total{{{T},kind="prompt"}}[{R}])), 1)',
                      "cached")]},
    ]),
    ("Compaction and recall", [
        {"title": "Compaction events by kind", "unit": "short",
         "description": "past_loop_reduction, in_loop_elision, in_loop_drop, loop_omission, "
                        "summary, hard_truncation, rejection.",
         "targets": [(rate("runloop_compaction_events_total", by="kind"),
                      "{{kind}}")]},
        {"title": "Recalls and searches", "unit": "short",
         "description": "Proxy-owned tool calls answered, by tool and outcome.",
         "targets": [(f"sum by (tool, outcome) (rate(runloop_recalls_total{{{T}}}[{R}])) "
                      "", "{{tool}} {{outcome}}")]},
        {"title": "Summaries", "unit": "short",
         "description": "Background summaries by outcome, and their p95 latency.",
         "targets": [(rate("runloop_summaries_total", by="outcome"),
                      "{{outcome}}"),
                     (quantile(0.95, "runloop_summary_latency_seconds"),
                      "p95 latency")]},
        {"title": "Truncations and rejections", "unit": "short",
         "description": "Hard-limit truncations, and requests refused as "
                        "context_length_exceeded.",
         "targets": [(rate("runloop_truncations_total"), "truncated"),
                     (rate("runloop_context_rejections_total"), "rejected")]},
    ]),
    ("Store and config", [
        {"title": "Store up", "unit": "short",
         "description": "1 when Redis answered the last operation; 0 while degraded.",
         "targets": [("min(runloop_store_up)", "store up")]},
        {"title": "Store errors and degraded requests", "unit": "short",
         "description": "Redis failures by operation; requests passed through uncompressed, "
                        "by reason (store: Redis unreachable; window: building it failed).",
         "targets": [('sum by (op) (rate(runloop_store_errors_total[' + R + ']))',
                      "error {{op}}"),
                     (rate("runloop_degraded_requests_total", by="reason"),
                      "degraded {{reason}}")]},
        {"title": "Store latency", "unit": "s",
         "description": "Redis round trips by operation (p99).",
         "targets": [(f"histogram_quantile(0.99, sum by (le, op) "
                      f"(rate(runloop_store_latency_seconds_bucket[{R}])))", "p99 {{op}}")]},
        {"title": "Config reloads", "unit": "short",
         "description": "Reloads by outcome (error: a broken edit, the last good config kept).",
         "targets": [(f"sum by (outcome) (increase(runloop_config_reloads_total[{R}])) "
                      "", "{{outcome}}")]},
        {"title": "Garbage collections", "unit": "short",
         "description": "Collections per second by generation, per process. A full one "
                        "(generation 2) stops every thread while it scans what is alive: "
                        "the server tunes its collector so that a large request starts "
                        "none (serving.tune_gc).",
         "targets": [(f"sum by (instance, generation) "
                      f"(rate(python_gc_collections_total[{R}]))",
                      "{{instance}} gen {{generation}}")]},
    ]),
]


def build() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid = 1
    y = 0
    for row_title, row in ROWS:
        panels.append({"type": "row", "title": row_title, "id": pid, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid += 1
        y += 1
        width = 24 // len(row)
        for k, p in enumerate(row):
            kind = p.get("type", "timeseries")
            options: dict[str, Any] = {"legend": {"displayMode": "list",
                                                  "placement": "bottom"}} \
                if kind == "timeseries" else {
                    "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value", "graphMode": "none", "textMode": "value"}
            panels.append({
                "type": kind, "id": pid, "title": p["title"],
                "description": p["description"],
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": width, "x": k * width, "y": y},
                "fieldConfig": {"defaults": {"unit": p["unit"]}, "overrides": []},
                "options": options,
                "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                             "datasource": {"type": "prometheus", "uid": "${datasource}"},
                             **({"instant": True} if kind == "stat" else {})}
                            for i, (expr, legend) in enumerate(p["targets"])]})
            pid += 1
        y += 8
    return {
        "uid": "runloop-proxy", "title": "runloop-proxy", "tags": ["runloop", "llm"],
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"}, "timezone": "",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus",
             "label": "Data source", "current": {}},
            {"name": "tenant", "type": "query", "label": "Tenant",
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(runloop_requests_total, tenant)",
                       "refId": "tenants"},
             "definition": "label_values(runloop_requests_total, tenant)",
             "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2,
             "current": {"text": "All", "value": "$__all"}}]},
        "panels": panels,
    }


if __name__ == "__main__":
    out = Path(__file__).parent / "grafana" / "dashboards" / "runloop-proxy.json"
    out.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {out}")
