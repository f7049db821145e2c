"""Codex's start-up and whole run, direct and through the proxy, in one run.

    python bench/codex_start.py [--runs 3] [--codex PATH] [--json]

The real Codex CLI (``@openai/codex``; the version tests/test_codex.py pins, from the tests'
npm cache, or ``--codex``) with its built-in provider pointed by ``openai_base_url`` and an
API key login, as its users run it, answering one prompt (``codex exec``) against:

- ``direct``: a scripted upstream that serves the Responses API over a WebSocket as OpenAI
  does (warmups answered, each turn going on from the last) and over HTTP;
- ``proxy``: runloop-proxy (its socket served; upstream the scripted one over HTTP, streamed);
- ``proxy, socket off``: the proxy with ``server.websocket = false`` (426: Codex uses HTTP at
  once);
- ``refused (403)``: an upstream with no socket route, as the proxy was before (Codex retries
  the upgrade, then falls back).

Each mode's servers are started once and warmed by one uncounted run (a user's proxy is up
before Codex starts), then the modes take turns. Printed per mode: the median time from
Codex's start to its first request reaching the model (``first``) and to its exit (``run``),
and each as a ratio of ``direct``. Ratios from one run, not absolute times: the machine is
shared.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runloop_proxy.app import create_app  # noqa: E402
from runloop_proxy.config import Settings, load_config  # noqa: E402
from runloop_proxy.history.embedded import EmbeddedRedis  # noqa: E402
from runloop_proxy.pipeline.sse import SSEDecoder  # noqa: E402
from runloop_proxy.scripted import ScriptedUpstream, ThreadedServer  # noqa: E402

KEY = "sk-proj-" + "bEnChMaRkCoDeXsTaRt0" * 7 + "0123456789abcdef"
MODEL = "gpt-5-mini-2025-08-07"
PROMPT = "say hello"


class Upstream:
    """The scripted upstream, and beside it the same model over a socket (``socket=True``):
    what OpenAI serves. Notes when the first request for an answer arrives."""

    def __init__(self, socket: bool):
        self.scripted = ScriptedUpstream()
        self.scripted.responder = self._answer
        self.first: float | None = None
        self.socket = socket
        self.ids = itertools.count(1)
        app = self.scripted.app()
        if socket:
            app.router.routes.insert(0, WebSocketRoute("/v1/responses", self._ws))
        self.server = ThreadedServer(app, lifespan="off")
        self.port = self.server.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _answer(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.first is None:
            self.first = time.monotonic()
        return {"content": "hello from the model"}

    async def _ws(self, ws: WebSocket) -> None:
        await ws.accept()
        kept: dict[str, list[Any]] = {}
        try:
            while True:
                event = orjson.loads(await ws.receive_text())
                body = {k: v for k, v in event.items() if k not in ("type", "generate")}
                prev = body.pop("previous_response_id", None)
                body["input"] = [*kept.get(prev, []), *(body.get("input") or [])]
                rid = f"resp_direct_{next(self.ids)}"
                if event.get("generate") is False:
                    response = {"id": rid, "object": "response", "status": "completed",
                                "output": [], "model": body.get("model"), "usage": None}
                    for kind in ("response.created", "response.completed"):
                        await ws.send_text(orjson.dumps({"type": kind,
                                                         "response": response}).decode())
                    kept[rid] = body["input"]
                    continue
                reply = self._answer(body)
                decoder = SSEDecoder()
                output: list[Any] = []
                async for chunk in self.scripted._response_events(body, {**reply,
                                                                        "response_id": rid}, ""):
                    for ev in decoder.feed(chunk):
                        await ws.send_text(ev.data)
                        data = orjson.loads(ev.data)
                        if data["type"] == "response.completed":
                            output = data["response"]["output"]
                kept[rid] = [*body["input"], *output]
        except WebSocketDisconnect:
            return

    def stop(self) -> None:
        self.server.stop()


def codex_bin(given: str | None) -> str | None:
    if given:
        return given
    text = (Path(__file__).resolve().parents[1] / "tests" / "test_codex.py").read_text()
    pin = 'CODEX_VERSION = os.environ.get("RUNLOOP_CODEX_VERSION") or "'
    version = text.split(pin)[1].split('"')[0]
    cache = Path(os.environ.get("RUNLOOP_TEST_CACHE", Path.home() / ".cache" / "runloop-tests"))
    exe = cache / f"codex-{version}" / "node_modules" / ".bin" / "codex"
    return str(exe) if exe.exists() else None


def run_codex(codex: str, base_url: str, work: Path) -> tuple[float, float, str]:
    """One ``codex exec`` (a fresh CODEX_HOME, logged in with an API key): its start and
    its exit (monotonic), and its stderr."""
    home = Path(tempfile.mkdtemp(prefix="codex-home-"))
    (home / "config.toml").write_text(f'model = "{MODEL}"\nopenai_base_url = "{base_url}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env["CODEX_HOME"] = str(home)
    subprocess.run([codex, "login", "--with-api-key"], input=KEY, text=True, env=env,
                   capture_output=True, check=True, timeout=60)
    start = time.monotonic()
    r = subprocess.run([codex, "exec", "--skip-git-repo-check", PROMPT], cwd=work, env=env,
                       capture_output=True, text=True, timeout=300)
    end = time.monotonic()
    if r.returncode != 0 or "hello from the model" not in r.stdout:
        raise SystemExit(f"codex failed ({r.returncode}): {r.stderr[-1500:]}")
    return start, end, r.stderr


def proxy_for(upstream: Upstream, data_dir: str, websocket: bool) -> tuple[ThreadedServer, str,
                                                                          EmbeddedRedis]:
    redis = EmbeddedRedis(data_dir)
    settings = Settings(upstream=upstream.url, redis_url=redis.start(), data_dir=data_dir)
    config = load_config(settings)
    config = dataclasses.replace(config, server=config.server.model_copy(
        update={"websocket": websocket}))
    server = ThreadedServer(create_app(settings, config), server=config.server)
    port = server.start()
    return server, f"http://127.0.0.1:{port}/v1", redis


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--codex", default=None, help="the codex binary (default: the "
                                                      "tests' npm cache, pinned version)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    codex = codex_bin(args.codex)
    if codex is None:
        print("codex_start: skipped (no Codex CLI: run tests/test_codex.py once, or --codex)")
        return 0
    work = Path(tempfile.mkdtemp(prefix="codex-work-"))
    results: dict[str, dict[str, list[float]]] = {}
    modes = ["direct", "proxy", "proxy, socket off", "refused (403)"]
    running: dict[str, tuple[Upstream, str]] = {}
    stops: list[Any] = []
    try:
        for mode in modes:  # each served by a process already warm, as a user's proxy is
            upstream = Upstream(socket=mode == "direct")
            stops.append(upstream.stop)
            url = upstream.url
            if mode.startswith("proxy"):
                proxy, url, redis = proxy_for(upstream, tempfile.mkdtemp(prefix="cs-"),
                                              websocket=mode == "proxy")
                stops += [redis.stop, proxy.stop]
            running[mode] = (upstream, url)
            run_codex(codex, url, work)  # warm-up, not counted
        for _ in range(args.runs):
            for mode in modes:  # interleaved: a slow moment of the machine hits every mode
                upstream, url = running[mode]
                upstream.first = None
                start, end, _ = run_codex(codex, url, work)
                assert upstream.first is not None, mode
                got = results.setdefault(mode, {"first": [], "run": []})
                got["first"].append(upstream.first - start)
                got["run"].append(end - start)
    finally:
        for stop in reversed(stops):
            stop()
    medians = {m: {k: statistics.median(v) for k, v in r.items()} for m, r in results.items()}
    if args.json:
        print(json.dumps(medians, indent=2))
        return 0
    base = medians["direct"]
    version = subprocess.run([codex, "--version"], capture_output=True, text=True).stdout
    print(f"{version.strip()}: `codex exec` from its start to its first request reaching the "
          f"model, and to its exit; median of {args.runs} (ratio to direct)")
    for mode in modes:
        m = medians[mode]
        print(f"  {mode:<18} first {m['first']:6.2f} s ({m['first'] / base['first']:5.2f}x)"
              f"   run {m['run']:6.2f} s ({m['run'] / base['run']:5.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
