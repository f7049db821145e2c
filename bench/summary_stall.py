"""What the proxy's background work costs everyone else: the worst /healthz stall while the
summaries of a session's omitted loops are made, after the answers went out.

    python bench/summary_stall.py [--loops 14] [--result-ids 12000]

A proxy with extractive summaries and a named session whose every loop reads a large tool
result (``--result-ids`` identifiers, about 40 bytes each): each request is answered, then
the summary the next omission needs is made beside the other requests. A second process polls
/healthz throughout (bench/hostile.py's poller); the worst answer within a second of each
request is printed (goal: under 100 ms, as for any request).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from hostile import Poller, start_proxy, wait_ready  # noqa: E402

from runloop_proxy.scripted import ScriptedUpstream  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


def loop(k: int, ids: int) -> list[dict[str, Any]]:
    result = " ".join(f"id_{k}_{i}/path{i}.py:{i} AB{i}C{k}" for i in range(ids))
    return [{"role": "user", "content": f"task {k}"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"c{k}", "type": "function",
                "function": {"name": "read", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": f"c{k}", "content": result},
            {"role": "assistant", "content": f"done {k}"}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loops", type=int, default=14)
    ap.add_argument("--result-ids", type=int, default=12_000)
    args = ap.parse_args()
    upstream = ScriptedUpstream().start()
    upstream.keep_requests = False
    proxy, base = start_proxy(upstream.url, "summary-stall-", "--summary-model", "extractive")
    worst = (0.0, 0)
    try:
        wait_ready(base)
        poller = Poller(base)
        time.sleep(0.5)
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."}]
        print(f"{'loops':>5} {'status':>6} {'body bytes':>11} {'worst /healthz ms':>18}")
        with httpx.Client(timeout=120, headers={"Authorization": "Bearer sk-summary-stall",
                                                "X-Session-Id": "stall"}) as c:
            for k in range(args.loops):
                messages += loop(k, args.result_ids)
                start = time.monotonic()
                r = c.post(base + "/v1/chat/completions", json={
                    "model": "gpt-4o", "tools": TOOLS,
                    "messages": [*messages, {"role": "user", "content": "next"}]})
                time.sleep(1.0)  # the summary is made after the answer
                stall = poller.worst(start, time.monotonic())
                worst = max(worst, (stall, k + 1))
                print(f"{k + 1:>5} {r.status_code:>6} {len(r.request.content):>11,} "
                      f"{stall * 1000:>18.1f}")
        poller.close()
    finally:
        proxy.terminate()
        proxy.wait(10)
        upstream.stop()
    print(f"worst stall: {worst[0] * 1000:.1f} ms (after the request with {worst[1]} loops)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
