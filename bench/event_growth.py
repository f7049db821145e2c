"""Every compaction event of recorded conversations, and the ones that left the window larger.

    python bench/event_growth.py FILE.jsonl [FILE.jsonl ...] [--context N ...] [--soft N]
                                 [--smoke]

Each conversation is windowed as the proxy windows it, every request point recorded (the
default policy, the model's encoding, its tools and the proxy's counted in the budget), at
each ``--context`` (default 32,000 and 128,000: a small window compacts often; ``--soft``
sets the policy's soft budget, so the model's window bounds it as in a Claude Code tenant's
``soft_budget_tokens = 150000``). It prints, per
file and context, the events by kind and those whose window was not smaller after than
before; a lever that fires must take tokens out (the hard limit's last resort may only keep
it as it was). Exits 1 when any event grew the window. ``--smoke``: the first 5 of each file.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any

import orjson

from runloop_proxy.config import TenantSpec
from runloop_proxy.conversation.messages import message_hash
from runloop_proxy.ops.replay_offline import Replayer
from runloop_proxy.window.builder import build_window
from runloop_proxy.window.plan import CompactionKind

LAST_RESORT = {CompactionKind.TRUNCATION, CompactionKind.REJECTION}


def events_of(replayer: Replayer, conv: dict[str, Any]) -> list[Any]:
    messages = conv["messages"]
    tools = conv.get("tools") or None
    keys = [message_hash(m) for m in messages]
    counts = [replayer.counter.message(replayer.enc, m, k) for m, k in zip(messages, keys,
                                                                        strict=True)]
    window = build_window(messages, keys, counts, replayer.tenant.policy,
                          replayer.budget(tools), replayer.ops, record_from=0,
                          client_tools=bool(tools))
    return list(window.events)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--context", type=int, action="append")
    parser.add_argument("--model", default="gpt-4o")
    parser.add_argument("--soft", type=int)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    grown_total = 0
    for path in args.files:
        convs = [orjson.loads(line) for line in open(path, "rb") if line.strip()]
        if args.smoke:
            convs = convs[:5]
        for context in args.context or [32_000, 128_000]:
            policy = {"soft_budget_tokens": args.soft} if args.soft else {}
            replayer = Replayer(TenantSpec(name="bench", policy=policy), args.model, context)
            kinds: Counter[str] = Counter()
            grown: list[tuple[str, str, int, int]] = []
            for conv in convs:
                for e in events_of(replayer, conv):
                    kinds[e.kind.value] += 1
                    larger = e.tokens_after > e.tokens_before if e.kind in LAST_RESORT \
                        else e.tokens_after >= e.tokens_before
                    if larger:
                        grown.append((str(conv.get("id", "?"))[:48], e.kind.value,
                                      e.tokens_before, e.tokens_after))
            by_kind = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
            print(f"{path} context {context:,}: {len(convs)} conversations, "
                  f"{sum(kinds.values())} events ({by_kind}); not smaller after: {len(grown)}")
            for row in grown[:10]:
                print(f"  {row[0]}: {row[1]} {row[2]} -> {row[3]}")
            grown_total += len(grown)
    return 1 if grown_total else 0


if __name__ == "__main__":
    sys.exit(main())
