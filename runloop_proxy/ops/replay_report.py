"""What `runloop-proxy replay` prints: the tally as text or as JSON (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Policy
from ..pricing import Provider
from .replay_offline import Replayer
from .replay_tally import MODELS, SEPARATE, STRICT, Tally

# what a run through a proxy cannot measure (no windows offline, one cost model)
_OFFLINE_ONLY = ("client_cost_strict", "forwarded_cost_strict", "cache_aware_saving_strict",
                 "bound_raw_saving", "bound_cache_aware_saving", "retention",
                 "retention_careful", "retention_passthrough")


@dataclass(frozen=True)
class Run:
    """What a replay ran on and with."""

    path: Path
    conversations: int
    model: str
    replayer: Replayer
    policy: Policy
    provider: Provider | None
    half: str | None
    through_proxy: bool
    cache_measured: bool
    seconds: float


def as_json(run: Run, tally: Tally) -> dict[str, Any]:
    out = tally.as_dict()
    if run.through_proxy:
        for key in _OFFLINE_ONLY:
            out.pop(key)
        if not run.cache_measured:
            for key in ("client_cost", "forwarded_cost", "cache_aware_saving"):
                out[key] = None
        # neither the strict model nor the compaction events are seen through a proxy
        measured = _measured(run)
        out["compaction_events"] = None
        out["costing_more"] = {m: n if m in measured or m == "money" else None
                               for m, n in out["costing_more"].items()}
        out["by_domain"] = {d: {k: v if k not in MODELS or k in measured else None
                                for k, v in row.items()} for d, row in out["by_domain"].items()}
        out["worst"] = [{k: v for k, v in row.as_dict().items() if k != "events"
                         and STRICT not in k} for row in tally.worst(5, SEPARATE)] \
            if SEPARATE in measured else None
    price = run.replayer.price
    out["money"] = None if price is None or run.provider is None else {
        "provider": run.provider.name, "client": round(tally.money[0], 6),
        "forwarded": round(tally.money[1], 6),
        "saving": round(tally.saving(*tally.money), 4),
        "output": round(tally.output_money, 6),
        "prices_per_million": {"input": price.input, "cached_input": price.cached_input,
                               "cache_write": price.cache_write, "output": price.output}}
    out.update({"file": str(run.path), "half": run.half, "conversations": run.conversations,
                "model": run.model, "encoding": run.replayer.encoding,
                "context": run.replayer.context, "seconds": run.seconds})
    return out


def report(run: Run, tally: Tally, worst: int = 5) -> list[str]:
    """The text report, line by line."""
    out = tally.as_dict()
    half = f" ({run.half} half)" if run.half else ""
    lines = [f"{run.path.name}{half}: {run.conversations} conversations, {tally.requests} "
             f"requests, model {run.model} (counted with {run.replayer.encoding}), context "
             f"{run.replayer.context}",
             f"  {headline(run, tally)}",
             f"  prompt tokens   client {tally.client:>12,}  forwarded {tally.forwarded:>12,}  "
             f"saving {out['raw_saving']:.1%}"]
    c, f = tally.costs[SEPARATE]
    if not run.cache_measured:
        lines.append("  cache-aware     not measured: through a proxy it takes --direct "
                     "UPSTREAM_URL and an upstream that reports cached tokens")
    else:
        lines.append(f"  cache-aware     client {c:>12,.0f}  forwarded {f:>12,.0f}  saving "
                     f"{out['cache_aware_saving']:.1%}"
                     + ("  (the upstream's cached tokens)" if run.through_proxy else
                        "  (tool schemas and messages cached apart)"))
    if not run.through_proxy:
        sc, sf = tally.costs[STRICT]
        lines.append(f"  strict          client {sc:>12,.0f}  forwarded {sf:>12,.0f}  saving "
                     f"{out['cache_aware_saving_strict']:.1%}  (tools rendered first: a "
                     f"changed tool list re-reads all)")
    lines += _money(run, tally)
    if not run.through_proxy and tally.bound < tally.client:  # else one run loop each
        lines.append(f"  bound (system prompt, tools and the current run loop only, nothing "
                     f"else): raw {out['bound_raw_saving']:.1%}, cache-aware "
                     f"{out['bound_cache_aware_saving']:.1%}")
    lines.append(f"  over {run.replayer.context} tokens: pass-through {tally.over_client} "
                 f"({tally.over_client / max(tally.requests, 1):.0%}), through the proxy "
                 f"{tally.over_forwarded} (rejected {tally.rejected})")
    if not run.through_proxy:
        lines += _retention(out)
    if tally.summaries:
        lines.append(f"  summaries ({run.policy.summary_model}): {tally.summaries:,} made ahead "
                     f"of their omission event" + (f", {tally.summary_tokens:,} tokens counted "
                                                   f"as forwarded" if tally.summary_tokens
                                                   else ""))
    elif tally.summary_tokens:
        lines.append(f"  summary calls made by the proxy: {tally.summary_tokens:,} tokens (its "
                     f"upstream's usage), counted as forwarded")
    if tally.reasoning_client:
        lines.append(f"  reasoning items sent: client {tally.reasoning_client:,}, forwarded "
                     f"{tally.reasoning_forwarded:,} (past loops' reasoning is left out)")
    if tally.events:
        lines.append("  compaction events: " + ", ".join(f"{k} {v}" for k, v in
                                                         sorted(tally.events.items())))
    lines += _losers(run, tally, worst)
    return lines


def _money(run: Run, tally: Tally) -> list[str]:
    price = run.replayer.price
    if price is None or run.provider is None or not tally.money[0]:
        return []
    cache = "automatic prefix cache" if run.provider.cache == "prefix" else \
        "cache_control breakpoints after the system prompt and at the end"
    write = f", cache writes ${price.cache_write:.2f}" if price.cache_write is not None else ""
    return [f"  money, block by block ({run.provider.name}, {cache}; per million: input "
            f"${price.input:.2f}, cached ${price.cached_input:.3f}{write})",
            f"                  client ${tally.money[0]:>11,.2f}  forwarded "
            f"${tally.money[1]:>11,.2f}  saving {tally.saving(*tally.money):.1%}"
            + (f"; with the recorded replies' output (${tally.output_money:,.2f} either way) "
               f"{tally.saving(tally.money[0] + tally.output_money, tally.money[1] + tally.output_money):.1%}"  # noqa: E501
               if tally.output_money else "")]


def headline(run: Run, tally: Tally) -> str:
    """The headline figure (``savings``), and whose prices it is at."""
    said = tally.savings.headline()
    if run.provider is None or tally.savings.bill_saved is None:
        return said + (f" (no provider prices {run.model}: --provider, --prices)"
                       if run.provider is None else "")
    return f"{said}: {run.model} at {run.provider.name}'s prices, its prompt cache on both sides"


def _retention(out: dict[str, Any]) -> list[str]:
    lines = []
    r, rp, rc = out["retention"], out["retention_passthrough"], out["retention_careful"]
    if r["references"]:
        lines.append(f"  references kept window {_pct(r['retained'])} (current loop "
                     f"{_pct(r['current_loop'])}, past loops {_pct(r['past_loops'])}; "
                     f"{r['references']:,} references: {r['current_references']:,} current, "
                     f"{r['past_references']:,} past), pass-through {_pct(rp['retained'])}")
        lines.append(f"  references hidden {r['hidden']:,}: recallable by a ref the window "
                     f"shows {r['recallable_by_ref']:,}, found by search_history "
                     f"{r['found_by_search']:,}, lost {r['lost']:,}")
    if rc["references"]:
        lines.append(f"  careful reader (identifiers inside arguments, whole tokens): kept "
                     f"{_pct(rc['retained'])} (current {_pct(rc['current_loop'])}, past "
                     f"{_pct(rc['past_loops'])}; {rc['references']:,} references); hidden "
                     f"{rc['hidden']:,}: by a ref {rc['recallable_by_ref']:,}, by search "
                     f"{rc['found_by_search']:,}, lost {rc['lost']:,}")
    return lines


def _measured(run: Run) -> tuple[str, ...]:
    """The cost models a run measured: offline both; through a proxy the cache-aware one,
    and only with the upstream's cached tokens (``--direct``)."""
    if not run.through_proxy:
        return MODELS
    return (SEPARATE,) if run.cache_measured else ()


def _losers(run: Run, tally: Tally, worst: int) -> list[str]:
    measured = _measured(run)
    more = tally.costing_more()
    lines = ["  conversations costing more than pass-through: " + ", ".join(
        f"{_name(m)} {n if m in measured or m == 'money' else 'n/a'}" for m, n in more.items())
        + f" (of {len(tally.rows)})"]
    domains = tally.by_domain()
    if len(domains) > 1:
        lines.append("  by domain (cache-aware / strict): " + "; ".join(
            f"{d} {_pct(v[SEPARATE] if SEPARATE in measured else None)} / "
            f"{_pct(v[STRICT] if STRICT in measured else None)} ({v['conversations']:.0f})"
            for d, v in domains.items()))
    model = SEPARATE if run.through_proxy else STRICT
    if worst and tally.rows and model in measured:
        lines.append(f"  worst conversations ({_name(model)}):")
        for row in tally.worst(worst, model):
            c, f = row.costs[model]
            # through a proxy its compaction events are not seen: none are listed
            events = "" if run.through_proxy else "; events: " + (", ".join(
                f"{k} {v}" for k, v in sorted(row.events.items())) or "none")
            lines.append(f"    {row.saving(model):7.1%}  {row.conv_id}  {row.requests} "
                         f"requests, {c:,.0f} → {f:,.0f}{events}")
    return lines


def _name(model: str) -> str:
    return "cache-aware" if model == SEPARATE else model


def _pct(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.1%}"
