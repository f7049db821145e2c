"""CPU the proxy spends per request of a long session, whole request path, as a ratio between
session sizes (the machine is shared: read the ratio, not the milliseconds).

    python bench/session_cost.py [--sizes 300 3000] [--requests 40]

Starts the scripted upstream and the proxy (its own process, embedded Redis unless REDIS_URL),
grows a synthetic agent session to each size, then sends ``--requests`` more requests, each
the conversation so far plus the reply it got and a new user message — what a client does.
The proxy's CPU time (user + system, from /proc) over those requests, per request, is what the
request path costs there: reading and parsing the body, reconciling, the window, the write
behind. Reading and parsing are linear in the body by nature; the rest should grow with what
is new.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).parent))

from synthetic import agent_session  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """The process's CPU time. Its threads' scheduler clocks (nanoseconds) where the kernel
    keeps them: /proc's user + system time counts in 10 ms ticks, and a short smoke run of a
    few 2 ms requests can read 0 there."""
    try:
        return sum(int((t / "schedstat").read_text().split()[0])
                   for t in Path(f"/proc/{pid}/task").iterdir()) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_up(url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit(f"{url} did not come up")


def send(http: httpx.Client, base: str, headers: dict[str, str],
         msgs: list[dict[str, Any]]) -> dict[str, Any]:
    """One request of the session; the reply it got, as the client keeps it."""
    r = http.post(base + "/v1/chat/completions", headers=headers,
                  content=orjson.dumps({"model": "gpt-4o-mini", "messages": msgs}))
    r.raise_for_status()
    return r.json()["choices"][0]["message"]  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[300, 3000])
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    up_port, proxy_port = free_port(), free_port()
    data = tempfile.mkdtemp(prefix="rl-cost-")
    upstream = subprocess.Popen([sys.executable, "-m", "runloop_proxy.scripted", "--port",
                                 str(up_port)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    cmd = [sys.executable, "-m", "runloop_proxy", "serve", "--upstream",
           f"http://127.0.0.1:{up_port}/v1", "--port", str(proxy_port), "--data-dir", data,
           "--log-level", "warning"]
    proxy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{proxy_port}"
    results: dict[int, float] = {}
    try:
        wait_up(base + "/healthz")
        with httpx.Client(timeout=120, headers={"Authorization": "Bearer sk-bench"}) as http:
            for size in args.sizes:
                msgs: list[dict[str, Any]] = agent_session(size)
                sid = {"X-Session-Id": f"cost-{size}-{time.time_ns()}"}

                for _ in range(3):  # the session as a replica first sees it, then warm
                    msgs += [send(http, base, sid, msgs),
                             {"role": "user", "content": "and then?"}]
                start = cpu_seconds(proxy.pid)
                for k in range(args.requests):
                    msgs += [send(http, base, sid, msgs),
                             {"role": "user", "content": f"next step {k}"}]
                results[size] = (cpu_seconds(proxy.pid) - start) / args.requests
                body = len(orjson.dumps(msgs))
                print(f"{len(msgs)}-message session ({body / 1e6:.1f} MB body): proxy CPU "
                      f"{results[size] * 1000:.2f} ms per request")
    finally:
        proxy.terminate()
        upstream.terminate()
        proxy.wait(timeout=20)
        upstream.wait(timeout=10)
    if len(results) > 1:
        small, large = min(results), max(results)
        if results[small] > 0:
            print(f"ratio {large} vs {small} messages: {results[large] / results[small]:.1f}x "
                  f"(body {large / small:.0f}x larger)")
        else:
            print(f"ratio {large} vs {small} messages: not measured (no CPU time read for the "
                  f"small session: give more --requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
