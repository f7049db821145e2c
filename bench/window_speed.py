"""Time building the window for a long session at steady state (warm token cache).

    python bench/window_speed.py [--messages 300] [--repeat 200]

Steady state is what the proxy does on every request of a long session: the client resends
the conversation with one or two new messages; counts of old messages come from the cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from synthetic import agent_session  # noqa: E402

from runloop_proxy.config import Policy  # noqa: E402
from runloop_proxy.conversation.messages import message_hash  # noqa: E402
from runloop_proxy.pipeline.tokens import TokenCounter, WindowTokens  # noqa: E402
from runloop_proxy.window.builder import build_window  # noqa: E402
from runloop_proxy.window.forms import Budget  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    msgs = agent_session(args.messages)
    counter = TokenCounter()
    enc, _ = counter.encoding("gpt-4o-mini")
    ops = WindowTokens(counter, enc, OrderedDict())
    policy = Policy()
    budget = Budget(hard=120_000, working=24_000)
    memo: dict = {}  # type: ignore[type-arg]

    window_only: list[float] = []

    def one(prefix: list[dict]) -> float:  # type: ignore[type-arg]
        t = time.perf_counter()
        keys = [message_hash(m) for m in prefix]  # type: ignore[arg-type]
        counts = [counter.message(enc, m, k) for m, k in zip(prefix, keys, strict=True)]  # type: ignore[arg-type]
        t1 = time.perf_counter()
        build_window(prefix, keys, counts, policy, budget, ops, memo=memo)  # type: ignore[arg-type]
        t2 = time.perf_counter()
        window_only.append(t2 - t1)
        return t2 - t

    # warm up: the session grows request by request, as the proxy would see it
    for n in range(2, len(msgs) + 1):
        if msgs[n - 1]["role"] != "assistant":
            one(msgs[:n])
    window_only.clear()
    times = [one(msgs) for _ in range(args.repeat)]
    total = sum(counter.message(enc, m) for m in msgs)  # type: ignore[arg-type]
    print(f"window for a {len(msgs)}-message session ({total} tokens), steady state, "
          f"{args.repeat} builds:")
    for label, ts in (("with hashing and counting", times),
                      ("the window alone (keys and counts given)", window_only)):
        print(f"  {label}: p50 {statistics.median(ts) * 1000:.3f} ms  "
              f"p99 {sorted(ts)[int(0.99 * len(ts)) - 1] * 1000:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
