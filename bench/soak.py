"""Memory under a long run: the proxy's RSS, sampled while it serves many requests — it must
level off (every cache is bounded in bytes: ``serve --cache-mb``).

    python bench/soak.py [--requests 200000] [--concurrency 16] [--cache-mb N]

Starts the scripted upstream and the proxy (their own processes, embedded Redis unless
REDIS_URL) and sends a mix that fills every cache: short conversations under many distinct
session ids, sessions that grow turn by turn, and agent sessions long enough to be
compressed (derived forms, cuts, carried windows). Prints RSS as it goes, and how much it grew
over the last half of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}}}}]


class Mix:
    """The requests of the run, drawn at random (seeded)."""

    def __init__(self, seed: int = 1):
        self.rng = random.Random(seed)
        self.growing: dict[int, list[dict[str, Any]]] = {}

    def words(self, n: int) -> str:
        return " ".join(f"w{self.rng.randrange(50_000)}" for _ in range(n))

    def next(self, k: int) -> tuple[dict[str, Any], dict[str, str]]:
        kind = self.rng.random()
        if kind < 0.7:  # short, many sessions
            sid = f"short-{self.rng.randrange(100_000)}"
            return ({"model": "gpt-4o-mini", "messages": [
                {"role": "system", "content": "You help."},
                {"role": "user", "content": self.words(20)}]}, {"X-Session-Id": sid})
        if kind < 0.9:  # sessions that grow turn by turn, then start over
            slot = self.rng.randrange(500)
            msgs = self.growing.setdefault(slot, [{"role": "system", "content": "Chat."}])
            msgs.append({"role": "user", "content": self.words(30)})
            if len(msgs) > 60:
                del self.growing[slot]
            return ({"model": "gpt-4o-mini", "messages": list(msgs)},
                    {"X-Session-Id": f"grow-{slot}-{k // 20_000}"})
        steps = []  # an agent session long enough to be compressed
        for s in range(12):
            cid = f"c{k}_{s}"
            steps += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": cid, "type": "function",
                 "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]},
                {"role": "tool", "tool_call_id": cid, "content": self.words(700)}]
        return ({"model": "gpt-4o-mini", "tools": TOOLS, "messages": [
            {"role": "system", "content": "Agent."},
            {"role": "user", "content": self.words(10)}, *steps]},
            {"X-Session-Id": f"agent-{k}"})

    def answered(self, body: dict[str, Any], reply: dict[str, Any]) -> None:
        for msgs in self.growing.values():
            if msgs and body["messages"] and msgs[-1] is body["messages"][-1]:
                msgs.append(reply)


async def run(base: str, pid: int, total: int, concurrency: int, every: int) -> list[float]:
    mix = Mix()
    samples: list[float] = []
    done = 0
    failures = 0
    issued = 0
    started = time.monotonic()

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done, failures, issued
        while issued < total:
            k = issued
            issued += 1
            body, headers = mix.next(k)
            async with session.post(base + "/v1/chat/completions", data=orjson.dumps(body),
                                    headers={**headers, "Authorization": "Bearer sk-soak",
                                             "Content-Type": "application/json"}) as r:
                data = await r.read()
                if r.status != 200:
                    failures += 1
                else:
                    mix.answered(body, orjson.loads(data)["choices"][0]["message"])
            done += 1
            if done % every == 0:
                samples.append(rss_mb(pid))
                rate = done / (time.monotonic() - started)
                print(f"{done:>8} requests  RSS {samples[-1]:7.1f} MB  ({rate:.0f}/s, "
                      f"{failures} failed)", flush=True)

    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    if failures:
        raise SystemExit(f"{failures} requests failed")
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--cache-mb", type=int, default=None,
                        help="the proxy's cache budget (default: the proxy's own, 128)")
    parser.add_argument("--sample-every", type=int, default=None)
    args = parser.parse_args()
    every = args.sample_every or max(100, args.requests // 40)
    up_port, proxy_port = free_port(), free_port()
    upstream = subprocess.Popen([sys.executable, "-m", "runloop_proxy.scripted", "--port",
                                 str(up_port)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    proxy = subprocess.Popen(
        [sys.executable, "-m", "runloop_proxy", "serve", "--upstream",
         f"http://127.0.0.1:{up_port}/v1", "--port", str(proxy_port),
         *(["--cache-mb", str(args.cache_mb)] if args.cache_mb else []),
         "--data-dir", tempfile.mkdtemp(prefix="rl-soak-"),
         "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{proxy_port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", proxy_port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("the proxy did not start") from None
                time.sleep(0.1)
        time.sleep(0.5)
        print(f"RSS at start {rss_mb(proxy.pid):.1f} MB; caches "
              f"{args.cache_mb or 'the default'} MB")
        samples = asyncio.run(run(base, proxy.pid, args.requests, args.concurrency, every))
    finally:
        proxy.terminate()
        upstream.terminate()
        proxy.wait(timeout=30)
        upstream.wait(timeout=10)
    half = samples[len(samples) // 2:]
    if len(half) >= 2:
        print(f"over the last half of the run RSS went {half[0]:.1f} -> {half[-1]:.1f} MB "
              f"({(half[-1] - half[0]) / half[0]:+.1%}); peak {max(samples):.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
