"""Summaries at a real model's speed: a long recorded session replayed at agent speed through
the real server, the summary model answering after 0, 3, 10 and 30 s.

    python bench/summary_lag.py [--trace ../shared/traces/support_agent.jsonl]
                                [--delays 0 3 10 30] [--gap 1.0] [--smoke]

The proxy runs as ``runloop-proxy serve`` (its own process, embedded Redis) with a tenant
whose policy is ``max_run_loops = 4``, ``omit_batch = 2`` and a model summariser; the
scripted upstream (in this process) answers each request with the recorded reply's tool calls
or text, and the proxy's summary calls after the delay (``Latency.summary``). The client sends
the conversation so far — the answers it got, the recorded tool results and user turns — one
request every ``--gap`` seconds. Printed per delay: of the requests whose window omits loops,
the share whose every omitted loop is covered (a summary or the digest: never a bare marker),
the share that carries a model summary (of all, and of those after the first one landed),
and each summary call's input bytes against the session's length when it was made.
Targets: 100% covered at every delay; >= 80% with a model summary at 10 s; input flat.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import httpx
import orjson

from runloop_proxy.scripted import ScriptedUpstream, is_summary_call, scripted_summary
from runloop_proxy.scripted_world import Latency

KEY = "sk-bench-" + "a1b2c3d4" * 19  # a key of a real project key's length (161 + prefix)
ADMIN = "admin-bench-0123456789abcdef"
HEAD = "Summary of the turns not shown:"
MARK = "Earlier turns are not shown"
MODEL_PART = "Goals and facts:"  # how the scripted summary model's summaries open
ROOT = Path(__file__).resolve().parents[1]
TRACES = (ROOT.parent / "shared" / "traces" / "support_agent.jsonl",
          ROOT.parents[1] / "shared" / "traces" / "support_agent.jsonl")
LOOKUP = {"type": "function", "function": {"name": "get_order_details", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "string"}}}}}


def made_up(loops: int) -> dict[str, Any]:
    """A support session shaped like the recorded ones, when no trace is at hand (CI): a
    question, a lookup, its result, the answer, per loop."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a retail agent."}]
    for k in range(1, loops + 1):
        call = f"call_{k:024d}"
        msgs += [{"role": "user", "content": f"Where is my order #W{k:07d}? It was due on "
                                             f"2024-05-{k % 28 + 1:02d}."},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": call, "type": "function", "function": {
                         "name": "get_order_details",
                         "arguments": json.dumps({"order_id": f"#W{k:07d}"})}}]},
                 {"role": "tool", "tool_call_id": call, "content": json.dumps(
                     {"order_id": f"#W{k:07d}", "status": "shipped",
                      "tracking": f"1Z{k:016d}", "items": [f"item-{k}-{j}" for j in range(8)]})},
                 {"role": "assistant", "content": f"Order #W{k:07d} shipped; tracking "
                                                  f"1Z{k:016d}."}]
    return {"id": f"made-up-{loops}", "messages": msgs, "tools": [LOOKUP]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def longest(trace: Path, chain: int = 1) -> dict[str, Any]:
    """The recorded conversations with the most user turns (run loops), the ``chain``
    longest one after another as one session (the first's system prompt and tools; a
    customer who comes back with another task)."""
    found: list[tuple[int, int, dict[str, Any]]] = []
    with trace.open() as f:
        for n, line in enumerate(f):
            conv = json.loads(line)
            users = sum(1 for m in conv.get("messages") or [] if m.get("role") == "user")
            found.append((users, -n, conv))
    assert found, f"{trace} holds no conversation"
    picked = [c for _, _, c in sorted(found, key=lambda t: t[:2], reverse=True)[:chain]]
    msgs = list(picked[0]["messages"])
    for conv in picked[1:]:
        msgs += [m for m in conv["messages"] if m.get("role") != "system"]
    return {"id": "+".join(str(c.get("id")) for c in picked), "messages": msgs,
            "tools": picked[0].get("tools")}


def as_reply(m: dict[str, Any]) -> dict[str, Any]:
    """A recorded assistant message as the scripted upstream's reply."""
    calls = m.get("tool_calls") or []
    if calls:
        out = []
        for c in calls:
            fn = c.get("function") or {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except json.JSONDecodeError:
                args = {"input": fn.get("arguments")}
            out.append({"id": c.get("id"), "name": fn.get("name"), "arguments": args})
        return {"tool_calls": out, **({"content": m["content"]} if m.get("content") else {})}
    return {"content": str(m.get("content") or "(no answer)")}


def write_config(root: Path, upstream_url: str) -> None:
    (root / "tenants").mkdir(parents=True, exist_ok=True)
    (root / "runloop.toml").write_text(f"""
[server]
admin_key = "{ADMIN}"
[upstreams.main]
url = "{upstream_url}"
api_key = "sk-bench-upstream"
max_retries = 0
[defaults]
upstream = "main"
""")
    (root / "tenants" / "bench.toml").write_text(f"""
keys = ["{KEY}"]
[policy]
max_run_loops = 4
omit_batch = 2
summary_model = "gpt-4o-mini-2024-07-18"
summary_timeout_s = 120
""")


def wait_up(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not come up")


def replay(base: str, up: ScriptedUpstream, conv: dict[str, Any], session: str,
           gap: float) -> tuple[list[dict[str, Any]], list[tuple[int, int, float]], float]:
    """The conversation sent request by request; the window bodies the upstream got, the
    summary calls (input bytes, session messages then, when), and when the run started."""
    recorded = conv["messages"]
    tools = conv.get("tools") or None
    replies: deque[dict[str, Any]] = deque()
    windows: list[dict[str, Any]] = []
    calls: list[tuple[int, int, float]] = []
    sent = [0]

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        if is_summary_call(body):
            calls.append((len(orjson.dumps(body)), sent[0], time.monotonic()))
            return scripted_summary(body)
        windows.append(body)
        return replies.popleft() if replies else {"content": "(no recorded reply)"}

    up.responder = respond
    started = time.monotonic()
    msgs: list[dict[str, Any]] = []
    with httpx.Client(timeout=300, headers={"Authorization": f"Bearer {KEY}",
                                            "X-Session-Id": session}) as http:
        for m in recorded:
            if m.get("role") != "assistant":
                msgs.append({k: v for k, v in m.items() if k in (
                    "role", "content", "tool_call_id", "name")})
                continue
            if not msgs or msgs[-1]["role"] == "assistant":
                continue  # two recorded replies in a row: the second is not asked for
            replies.append(as_reply(m))
            sent[0] = len(msgs)
            body: dict[str, Any] = {"model": "gpt-4o-mini-2024-07-18", "messages": msgs}
            if tools:
                body["tools"] = tools
            r = http.post(base + "/v1/chat/completions", content=orjson.dumps(body))
            r.raise_for_status()
            got = r.json()["choices"][0]["message"]
            msgs.append({k: v for k, v in got.items() if v is not None and k in (
                "role", "content", "tool_calls")})
            time.sleep(gap)
    return windows, calls, started


def shown_summary(body: dict[str, Any]) -> str | None:
    """The summary a window shows after its marker ("" for a bare marker; None: no marker)."""
    for m in body["messages"]:
        text = m.get("content")
        if isinstance(text, list):
            text = " ".join(str(p.get("text", "")) for p in text if isinstance(p, dict))
        if isinstance(text, str) and MARK in text:
            return text.split(HEAD, 1)[1] if HEAD in text else ""
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=next(
        (t for t in TRACES if t.exists()), None), help="a trace (JSONL); without one, a "
        "made-up support session of --loops loops (30 by default)")
    parser.add_argument("--delays", type=float, nargs="+", default=[0, 3, 10, 30])
    parser.add_argument("--gap", type=float, default=1.0,
                        help="seconds between a reply and the next request (agent speed)")
    parser.add_argument("--loops", type=int, default=0, help="replay only the first N loops")
    parser.add_argument("--chain", type=int, default=3,
                        help="the N longest recorded conversations as one session")
    parser.add_argument("--smoke", action="store_true",
                        help="short: 12 loops, delays 0 and 0.5 s, 0.1 s apart")
    args = parser.parse_args()
    if args.smoke:
        args.delays, args.gap, args.loops, args.chain = [0, 0.5], 0.1, 12, 1
    conv = longest(args.trace, args.chain) if args.trace is not None \
        else made_up(args.loops or 30)
    if args.loops:
        users = [i for i, m in enumerate(conv["messages"]) if m.get("role") == "user"]
        if len(users) > args.loops:
            conv = {**conv, "messages": conv["messages"][:users[args.loops]]}
    loops = sum(1 for m in conv["messages"] if m.get("role") == "user")
    print(f"session {conv.get('id')}: {len(conv['messages'])} messages, {loops} loops; a "
          f"request every {args.gap:g} s; max_run_loops 4, omit_batch 2")
    up = ScriptedUpstream().start()
    port = free_port()
    data = tempfile.mkdtemp(prefix="rl-lag-")
    write_config(Path(data) / "cfg", up.url)
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    proxy = subprocess.Popen([sys.executable, "-m", "runloop_proxy", "serve", "--config",
                              str(Path(data) / "cfg"), "--port", str(port), "--data-dir",
                              str(Path(data) / "data"), "--log-level", "warning"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_up(base + "/healthz")
        print(f"{'delay':>6} {'omitting':>9} {'covered':>8} {'by model':>9} "
              f"{'after 1st':>10} {'calls':>6}  input bytes per call (session messages)")
        for delay in args.delays:
            up.latency = Latency(summary=delay)
            windows, calls, started = replay(base, up, conv, f"lag-{delay:g}-{time.time_ns()}",
                                             args.gap)
            # the calls still thinking answer before the next delay's run (theirs else)
            # (and those a finished one starts: quiet for 2 s)
            deadline, quiet = time.monotonic() + delay + 60, 0.0
            while quiet < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
                quiet = quiet + 0.2 if up.summaries_answered == up.summary_calls else 0.0
            shown = [(s, i) for i, b in enumerate(windows)
                     if (s := shown_summary(b)) is not None]
            covered = sum(1 for s, _ in shown if s)
            model = [i for s, i in shown if MODEL_PART in s]
            first = min(model) if model else None
            after = [(s, i) for s, i in shown if first is not None and i >= first]
            by_model_after = sum(1 for s, _ in after if MODEL_PART in s)
            n = max(1, len(shown))
            inputs = ", ".join(f"{b:,} ({m})" for b, m, _ in calls)
            print(f"{delay:>5g}s {len(shown):>9} {covered / n:>8.0%} {len(model) / n:>9.0%} "
                  f"{by_model_after / max(1, len(after)):>10.0%} {len(calls):>6}  {inputs}")
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)
        up.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
