"""Why conversations cost more through the proxy than without it, by cause.

    python bench/loss_sources.py ../shared/traces/support_agent.jsonl --half holdout \
        --config config --tenant globex

Replays the conversations offline three times under the strict token model (tools rendered
first, cached tokens at 10%):

1. as a provider bills: a cached prefix counts from 1,024 tokens in 128-token steps;
2. in 1-token steps: what the steps add or take away is gone, on both sides;
3. in 1-token steps with the proxy's own tools free: what their schemas cost is gone too.

A conversation that costs more in (1) but not in (2) lost to where the provider's steps fell
(either side may lose up to 127 tokens at full price per request); one that costs more in (2)
but not in (3) lost to the proxy's tools riding in every request; one that still costs more
in (3) lost to the window's own changes (an omission's marker and summary read at full price,
not paid back before the conversation ended). Each is printed with its requests and events.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from runloop_proxy.ops.replay import _read, _tenant, half_of
from runloop_proxy.ops.replay_offline import Replayer
from runloop_proxy.ops.replay_tally import STRICT, Tally


def saving(client: float, forwarded: float) -> float:
    return 1 - forwarded / client if client else 0.0

VARIANTS = ("provider steps", "1-token steps", "1-token steps, proxy tools free")


class FreeTools(Replayer):
    """The replay with the proxy's tool schemas costing nothing."""

    def proxy_tools_tokens(self, tools: list[dict[str, Any]] | None) -> int:
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--half", choices=("tune", "holdout"))
    ap.add_argument("--config")
    ap.add_argument("--tenant")
    ap.add_argument("--context", type=int)
    ap.add_argument("--model", default="gpt-4o")
    ap.add_argument("--set", action="append", metavar="FIELD=VALUE")
    args = ap.parse_args()
    read = _read(Path(args.file))
    if isinstance(read, str):
        print(read, file=sys.stderr)
        return 2
    convs = [conv for _, conv in read]
    if args.half:
        convs = [c for c in convs if half_of(c) == args.half]
    tenant = _tenant(args)
    replayers = [Replayer(tenant, args.model, args.context),
                 Replayer(tenant, args.model, args.context, cache_step=1),
                 FreeTools(tenant, args.model, args.context, cache_step=1)]
    losing: list[list[str]] = [[] for _ in VARIANTS]
    totals = [Tally() for _ in VARIANTS]
    rows: dict[str, str] = {}
    for k, conv in enumerate(convs):
        ident = str(conv.get("id") or k)
        for v, replayer in enumerate(replayers):
            one = Tally()
            replayer.conversation(conv, one)
            totals[v].add(one, ident)
            client, forwarded = one.costs[STRICT]
            if forwarded > client:
                losing[v].append(ident)
                if v == 0:
                    events = ", ".join(f"{n} {c}" for n, c in sorted(one.events.items()))
                    rows[ident] = (f"{(client - forwarded) / client:+.1%}  {ident}  "
                                   f"{one.requests} requests; events: {events or 'none'}")
    print(f"{Path(args.file).name}{f' ({args.half} half)' if args.half else ''}: "
          f"{len(convs)} conversations, strict token model")
    for v, name in enumerate(VARIANTS):
        print(f"  {name:<34} saving {saving(*totals[v].costs[STRICT]):5.1%}, "
              f"costing more {len(losing[v])}")
    causes = {
        "where the provider's steps fell": [c for c in losing[0] if c not in losing[1]],
        "the proxy's tools": [c for c in losing[0] if c in losing[1] and c not in losing[2]],
        "the window's changes, not paid back": [c for c in losing[0] if c in losing[2]],
    }
    for cause, idents in causes.items():
        print(f"  lost to {cause}: {len(idents)}")
        for ident in idents:
            print(f"      {rows[ident]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
