"""Time building the window for a long session at steady state (warm caches).

    python bench/window_speed.py [--messages 300] [--repeat 200] [--summary-model extractive]

Steady state is what the proxy does on every request of a long session: the client resends
the conversation with a new message or two. The proxy hashes and counts only what is new (its
memory of the session's last request hands the window the same keys as last time) and grows
the last window's carried state by the new messages. Printed: the window alone, as the proxy
builds it; and a cold request, hashing and counting every message and building the window
from scratch (what a replica that has not seen the session pays once).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from synthetic import agent_session  # noqa: E402

from runloop_proxy.caches import ByteLRU  # noqa: E402
from runloop_proxy.config import Policy  # noqa: E402
from runloop_proxy.conversation.messages import message_hash  # noqa: E402
from runloop_proxy.pipeline.tokens import TokenCounter, WindowTokens  # noqa: E402
from runloop_proxy.window.builder import build_window  # noqa: E402
from runloop_proxy.window.forms import Budget  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--no-names", action="store_true",
                        help="names_kept = 0: what keeping the agent's names costs")
    parser.add_argument("--summary-model", default=None,
                        help="a policy with summaries (the window then digests what it drops)")
    args = parser.parse_args()
    msgs = agent_session(args.messages)
    counter = TokenCounter()
    enc, _ = counter.encoding("gpt-4o-mini")
    ops = WindowTokens(counter, enc, ByteLRU(256 << 20))
    policy = Policy(summary_model=args.summary_model,
                    names_kept=0 if args.no_names else Policy().names_kept)
    budget = Budget(hard=120_000, working=24_000)
    memo: ByteLRU[tuple[str, ...], object] = ByteLRU(64 << 20)
    keys: list[str] = []
    counts: list[int] = []
    carry = None  # the last window's, as the proxy keeps it per session

    def grow(n: int) -> float:
        """The request holding msgs[:n], the one before it held a prefix: only the new
        messages are hashed and counted, the window grows from the carry."""
        nonlocal carry
        for m in msgs[len(keys):n]:
            keys.append(message_hash(m))  # type: ignore[arg-type]
            counts.append(counter.message(enc, m, keys[-1]))  # type: ignore[arg-type]
        t = time.perf_counter()
        w = build_window(msgs[:n], keys[:n], counts[:n], policy, budget, ops,  # type: ignore[arg-type]
                         memo=memo, carry=carry)
        carry = w.carry
        return time.perf_counter() - t

    def cold() -> float:
        t = time.perf_counter()
        ks = [message_hash(m) for m in msgs]  # type: ignore[arg-type]
        cs = [counter.message(enc, m, k) for m, k in zip(msgs, ks, strict=True)]  # type: ignore[arg-type]
        build_window(msgs, ks, cs, policy, budget, ops)  # type: ignore[arg-type]
        return time.perf_counter() - t

    # the session grows request by request, as the proxy sees it
    for n in range(2, len(msgs) + 1):
        if msgs[n - 1]["role"] != "assistant":
            grow(n)
    steady = [grow(len(msgs)) for _ in range(args.repeat)]
    colds = [cold() for _ in range(max(3, args.repeat // 20))]
    total = sum(counts)
    print(f"window for a {len(msgs)}-message session ({total} tokens), steady state, "
          f"{args.repeat} builds:")
    for label, ts in (("the window alone", steady),
                      ("a cold request (hash, count and build it all)", colds)):
        print(f"  {label}: p50 {statistics.median(ts) * 1000:.3f} ms  "
              f"p99 {sorted(ts)[max(0, int(0.99 * len(ts)) - 1)] * 1000:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
