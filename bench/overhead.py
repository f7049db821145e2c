"""Proxy overhead benchmark: the proxy and, in the same run, the upstream directly.

    python bench/overhead.py [--requests 1000] [--duration 10] [--workers 1] [--api chat|responses]
                             [--json]

Starts the scripted upstream and `runloop-proxy serve` (embedded Redis) as separate processes,
then prints the latency the proxy adds at concurrency 1 (p50/p99, requests alternating between
direct and proxied) and its throughput at concurrency 32 as a ratio of direct (wrk when
installed, else an aiohttp load generator). Ratios, not absolute times: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

BODIES = {
    "chat": ("chat/completions", {"model": "gpt-4o-mini", "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Say hello in one short sentence, please."}]}),
    "responses": ("responses", {"model": "gpt-4o-mini", "instructions":
                                "You are a helpful assistant.", "store": False, "input": [
        {"role": "user", "content": [{"type": "input_text",
                                      "text": "Say hello in one short sentence, please."}]}]}),
}
PATH, BODY = BODIES["chat"]
HEADERS = {"Authorization": "Bearer sk-bench", "Content-Type": "application/json",
           # every answer differs, as a real model's do: no reply is ever counted from a cache
           "X-Scripted-Unique-Replies": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, timeout: float = 30) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def start_servers(workers: int, data_dir: str, extra_env: dict[str, str]
                  ) -> tuple[list[subprocess.Popen[bytes]], str, str, str]:
    up_port, proxy_port, mini_port = free_port(), free_port(), free_port()
    env = {**os.environ, **extra_env}
    upstream = subprocess.Popen([sys.executable, "-m", "runloop_proxy.scripted", "--port",
                                 str(up_port)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env)
    wait_ready(f"http://127.0.0.1:{up_port}/v1/models")
    proxy = subprocess.Popen([sys.executable, "-m", "runloop_proxy.cli", "serve", "--upstream",
                              f"http://127.0.0.1:{up_port}/v1", "--port", str(proxy_port),
                              "--data-dir", data_dir, "--workers", str(workers)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wait_ready(f"http://127.0.0.1:{proxy_port}/readyz")
    up_chat = f"http://127.0.0.1:{up_port}/v1/{PATH}"
    mini = subprocess.Popen([sys.executable, str(Path(__file__).with_name(
        "minimal_passthrough.py")), up_chat, str(mini_port)], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, env=env)
    wait_ready(f"http://127.0.0.1:{mini_port}/")
    return ([upstream, proxy, mini], up_chat,
            f"http://127.0.0.1:{proxy_port}/v1/{PATH}",
            f"http://127.0.0.1:{mini_port}/v1/chat/completions")  # relays to up_chat's path


async def latency(direct: str, proxied: str, n: int) -> dict[str, list[float]]:
    payload = json.dumps(BODY).encode()
    out: dict[str, list[float]] = {"direct": [], "proxy": []}
    async with aiohttp.ClientSession() as s:
        async def one(url: str) -> float:
            t = time.perf_counter()
            async with s.post(url, data=payload, headers=HEADERS) as r:
                await r.read()
                assert r.status == 200, r.status
            return time.perf_counter() - t

        for _ in range(50):  # warm-up: connections, caches
            await one(direct)
            await one(proxied)
        for i in range(n):
            # alternate the order so drift on a noisy machine hits both sides alike
            pair = (("direct", direct), ("proxy", proxied)) if i % 2 else \
                (("proxy", proxied), ("direct", direct))
            for name, url in pair:
                out[name].append(await one(url))
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def wrk_throughput(url: str, duration: int, conns: int, delay_ms: float) -> float:
    script = Path(tempfile.mkstemp(suffix=".lua")[1])
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(json.dumps(BODY))}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        'wrk.headers["Authorization"] = "Bearer sk-bench"\n'
        'wrk.headers["X-Scripted-Unique-Replies"] = "1"\n'
        f'wrk.headers["X-Scripted-Delay-Ms"] = "{delay_ms}"\n')
    try:
        out = subprocess.run(["wrk", "-t1", f"-c{conns}", f"-d{duration}s", "-s", str(script),
                              url], capture_output=True, text=True, check=True).stdout
    finally:
        script.unlink()
    errors = [ln for ln in out.splitlines() if "Non-2xx" in ln or "Socket errors" in ln]
    if errors:
        print(f"  wrk reported: {'; '.join(errors)}", file=sys.stderr)
    line = next(ln for ln in out.splitlines() if ln.startswith("Requests/sec"))
    return float(line.split()[1])


async def aiohttp_throughput(url: str, duration: int, conns: int, delay_ms: float) -> float:
    payload = json.dumps(BODY).encode()
    headers = {**HEADERS, "X-Scripted-Delay-Ms": str(delay_ms)}
    done = 0
    stop = time.monotonic() + duration
    connector = aiohttp.TCPConnector(limit=conns)
    async with aiohttp.ClientSession(connector=connector) as s:
        async def worker() -> None:
            nonlocal done
            while time.monotonic() < stop:
                async with s.post(url, data=payload, headers=headers) as r:
                    await r.read()
                done += 1
        await asyncio.gather(*[worker() for _ in range(conns)])
    return done / duration


def throughput(url: str, duration: int, conns: int, generator: str, delay_ms: float) -> float:
    if generator == "wrk":
        return wrk_throughput(url, duration, conns, delay_ms)
    return asyncio.run(aiohttp_throughput(url, duration, conns, delay_ms))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="per side at concurrency 1")
    parser.add_argument("--duration", type=int, default=10, help="seconds per throughput run")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="throughput runs per side")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--load-generator", choices=["aiohttp", "wrk"], default="aiohttp",
                        help="aiohttp (a Python client, as the targets were measured) or wrk "
                             "(C: a much faster direct baseline, so a harsher ratio)")
    parser.add_argument("--upstream-delay-ms", type=float, default=10.0,
                        help="the scripted LLM's think time per answer in the second "
                             "throughput run (the first uses an instant upstream)")
    parser.add_argument("--api", choices=sorted(BODIES), default="chat",
                        help="the endpoint measured: chat completions or the Responses API")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    global PATH, BODY
    PATH, BODY = BODIES[args.api]
    if args.load_generator == "wrk" and not shutil.which("wrk"):
        parser.error("wrk is not installed (apt-get install wrk)")
    data_dir = tempfile.mkdtemp(prefix="rl-bench-")
    procs, direct, proxied, minimal = start_servers(args.workers, data_dir, {})
    try:
        cpu_before = cpu_seconds(procs[1].pid)
        lat = asyncio.run(latency(direct, proxied, args.requests))
        # the proxy's own CPU per request (its process only: the upstream's and the load
        # generator's work excluded), over the warm-up and the measured requests
        cpu_per_request = (cpu_seconds(procs[1].pid) - cpu_before) / (args.requests + 50)
        runs: dict[float, dict[str, list[float]]] = {}
        for delay in sorted({0.0, args.upstream_delay_ms}):
            tputs: dict[str, list[float]] = {"direct": [], "proxy": [], "minimal": []}
            for _ in range(args.rounds):
                for name, url in (("direct", direct), ("proxy", proxied),
                                  ("minimal", minimal)):
                    tputs[name].append(throughput(url, args.duration, args.concurrency,
                                                  args.load_generator, delay))
            runs[delay] = tputs
    finally:
        for p in procs[::-1]:
            p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(data_dir, ignore_errors=True)
    d50, p50 = pct(lat["direct"], 0.5), pct(lat["proxy"], 0.5)
    d99, p99 = pct(lat["direct"], 0.99), pct(lat["proxy"], 0.99)
    result: dict[str, object] = {
        "api": args.api, "workers": args.workers, "requests_per_side": args.requests,
        "load_generator": args.load_generator, "concurrency": args.concurrency,
        "direct_p50_ms": round(d50 * 1000, 3), "proxy_p50_ms": round(p50 * 1000, 3),
        "added_p50_ms": round((p50 - d50) * 1000, 3),
        "direct_p99_ms": round(d99 * 1000, 3), "proxy_p99_ms": round(p99 * 1000, 3),
        "added_p99_ms": round((p99 - d99) * 1000, 3),
        "proxy_cpu_ms_per_request": round(cpu_per_request * 1000, 3), "throughput": []}
    for delay, tputs in runs.items():
        td, tp = statistics.mean(tputs["direct"]), statistics.mean(tputs["proxy"])
        tm = statistics.mean(tputs["minimal"])
        result["throughput"].append({  # type: ignore[attr-defined]
            "upstream_delay_ms": delay, "direct_rps": round(td, 1), "proxy_rps": round(tp, 1),
            "ratio": round(tp / td, 3), "minimal_relay_rps": round(tm, 1),
            "minimal_ratio": round(tm / td, 3)})
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"/v1/{PATH}, concurrency 1, {args.requests} requests per side (alternating), "
          f"instant upstream:")
    print(f"  direct p50 {d50 * 1000:.3f} ms  p99 {d99 * 1000:.3f} ms")
    print(f"  proxy  p50 {p50 * 1000:.3f} ms  p99 {p99 * 1000:.3f} ms")
    print(f"  added  p50 {(p50 - d50) * 1000:.3f} ms  p99 {(p99 - d99) * 1000:.3f} ms")
    print(f"  the proxy's CPU per request {cpu_per_request * 1000:.3f} ms (its process alone)")
    for run in result["throughput"]:  # type: ignore[attr-defined]
        print(f"concurrency {args.concurrency}, {args.rounds}x{args.duration}s per side "
              f"({args.load_generator}), {args.workers} proxy worker(s), upstream think time "
              f"{run['upstream_delay_ms']:g} ms:")
        print(f"  direct {run['direct_rps']:.0f} req/s  proxy {run['proxy_rps']:.0f} req/s  "
              f"ratio {run['ratio']:.1%}")
        print(f"  reference: bare Starlette+aiohttp relay {run['minimal_relay_rps']:.0f} req/s "
              f"({run['minimal_ratio']:.1%} of direct); the proxy reaches "
              f"{run['proxy_rps'] / run['minimal_relay_rps']:.1%} of it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
