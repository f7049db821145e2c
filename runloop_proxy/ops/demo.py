"""``runloop-proxy demo``: the product working, with no API key.

Starts the scripted upstream and the proxy (embedded Redis unless ``--redis-url``), replays a
bundled support-agent conversation through it — twelve customer questions, each answered
after order lookups whose results are long JSON — request by request as an agent would send
them, prints what the window saved and the inspector's address, and keeps both servers up
until Ctrl-C. ``--once`` stops after printing the savings: it prints no inspector address,
since that would be gone when the command returns.
"""

from __future__ import annotations

import argparse
import json
import secrets
import signal
import socket
import sys
import time
from typing import Any

import httpx

from ..config import Settings, load_config
from ..conversation.messages import Message
from ..pricing import PriceTable
from ..savings import of_points
from ..scripted import ScriptedUpstream, ThreadedServer

MODEL = "gpt-4o-mini"

SYSTEM = ("You are the support agent of an online shop. Look orders up with get_order before "
          "answering; quote order ids and tracking numbers exactly.")
TOOLS = [{"type": "function", "function": {
    "name": "get_order", "description": "Look an order up by id",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                   "required": ["order_id"]}}}]


def _stored(base: str, admin_key: str, session: str, requests: int,
            wait_s: float = 15.0) -> list[dict[str, Any]]:
    """The session's points as the proxy stored them (the admin API), once all
    ``requests`` are in (they are written behind the answers), or what is in by
    ``wait_s``."""
    deadline = time.monotonic() + wait_s
    points: list[dict[str, Any]] = []
    with httpx.Client(base_url=base, timeout=30,
                      headers={"Authorization": f"Bearer {admin_key}"}) as c:
        while len(points) < requests and time.monotonic() < deadline:
            r = c.get(f"/admin/sessions/{session}", params={"points": "1"})
            if r.status_code == 200:
                points = list(r.json().get("points") or [])
            if len(points) < requests:
                time.sleep(0.05)
    return points


def sample_conversation(questions: int = 12) -> list[Message]:
    """A deterministic support session: per question two lookups, then the answer."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for q in range(1, questions + 1):
        ids = [f"#W{q}{k}4{q}7{k}" for k in (1, 2)]
        tracking = [f"1Z{q:02d}{k}9{q * 7919 % 100000:05d}" for k in (0, 1)]
        msgs.append({"role": "user", "content": f"Hi, where are my orders {ids[0]} and "
                                                f"{ids[1]}? (question {q})"})
        for k, oid in enumerate(ids):
            cid = f"call_{q}_{k}"
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": cid, "type": "function", "function": {
                    "name": "get_order", "arguments": json.dumps({"order_id": oid})}}]})
            order = {"order_id": oid, "status": "shipped", "carrier": f"carrier-{q}{k}",
                     "tracking": tracking[k],
                     "items": [{"sku": f"SKU-{q}-{i}", "name": f"item {i} of order {oid}",
                                "price": round(9.99 + i * q, 2), "options": {
                                    "color": "blue", "size": "M", "gift": i % 2 == 0}}
                               for i in range(24)],
                     "history": [{"at": f"2026-11-{(i % 28) + 1:02d}T10:00:00Z",
                                  "event": "scanned at hub", "hub": f"HUB-{i}"}
                                 for i in range(16)]}
            msgs.append({"role": "tool", "tool_call_id": cid, "content": json.dumps(order)})
        msgs.append({"role": "assistant", "content": f"Both orders ({ids[0]}, {ids[1]}) have "
                                                     f"shipped; tracking {tracking[0]} and "
                                                     f"{tracking[1]}."})
    return msgs  # type: ignore[return-value]


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(args: argparse.Namespace) -> int:
    from .. import serving

    try:  # first: a busy port is said before anything is started
        sock = serving.listen("127.0.0.1", args.port)
    except OSError as exc:
        print(serving.cannot_listen("127.0.0.1", args.port, exc), file=sys.stderr)
        return 1
    with sock:
        return _demo(args, sock)


def _demo(args: argparse.Namespace, sock: socket.socket) -> int:
    from ..app import create_app
    from ..history.embedded import EmbeddedRedis

    conversation = sample_conversation()
    points = [i for i, m in enumerate(conversation) if m.get("role") == "assistant"]
    answers = iter([conversation[i] for i in points])

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        if "running summary" in json.dumps(body.get("messages"))[:400]:
            return {"content": "(summary)"}
        m: dict[str, Any] = dict(next(answers, {"content": "done"}))
        calls = [{"id": c["id"], "name": c["function"]["name"],
                  "arguments": c["function"]["arguments"]} for c in m.get("tool_calls") or []]
        return {"content": m.get("content"), "tool_calls": calls}

    upstream = ScriptedUpstream()
    upstream.responder = respond
    upstream.keep_requests = False
    upstream.start()
    embedded = None
    redis_url = args.redis_url
    if not redis_url:
        embedded = EmbeddedRedis(args.data_dir)
        try:
            redis_url = embedded.start()
        except RuntimeError as exc:
            upstream.stop()
            print(f"runloop-proxy: {exc}", file=sys.stderr)
            return 2
    admin_key = args.admin_key or "demo-" + secrets.token_hex(12)
    settings = Settings(upstream=upstream.url, redis_url=redis_url, data_dir=args.data_dir,
                        admin_key=admin_key, summary_model="extractive", port=args.port)
    config = load_config(settings)
    server = ThreadedServer(create_app(settings, config), server=config.server)
    try:
        port = server.start(sock=sock)
        base = f"http://127.0.0.1:{port}"
        session = f"demo-{int(time.time())}"
        with httpx.Client(base_url=base, timeout=60, headers={
                "Authorization": "Bearer sk-demo", "X-Session-Id": session}) as c:
            for i in points:
                r = c.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": conversation[:i], "tools": TOOLS})
                if r.status_code != 200:
                    print(f"the proxy answered {r.status_code}: {r.text[:300]}",
                          file=sys.stderr)
                    return 1
                sent, forwarded = map(int, r.headers["x-runloop-tokens"].split(";"))
        # the figure from the session's stored points, as the inspector makes it
        total = of_points(_stored(base, admin_key, session, len(points)), PriceTable.load())
        print(f"replayed a support agent's session: {len(points)} requests through the proxy")
        print(f"  {total.headline()}: {MODEL} at openai's prices, its prompt cache on "
              f"both sides")
        print(f"  {total.secondary()}")
        print(f"  last request: {sent:,} tokens sent, {forwarded:,} forwarded")
        if args.once:
            print("stopped (--once): run `runloop-proxy demo` without --once to browse the "
                  "session in the inspector")
            return 0
        print(f"inspector: {base}/admin/ui  (admin key: {admin_key})")
        print(f"  this session: {base}/admin/ui/session?id={session}")
        print(f"the proxy stays up at {base}/v1 (scripted upstream at {upstream.url}); "
              f"Ctrl-C stops both", flush=True)
        # Ctrl-C (or a plain kill) stops it, whatever the shell that started it left set: a
        # script's background job starts with SIGINT ignored, and Python then keeps it so
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        return 0
    finally:
        server.stop()
        upstream.stop()
        if embedded is not None:
            embedded.stop()
