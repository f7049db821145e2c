"""``runloop-proxy export``: stored sessions written as ``replay`` input.

One session by its name, or every session of a tenant updated since a time, read through a
running proxy's admin API and written one JSON object a line — ``{"id", "messages",
"meta"}`` — the format ``runloop-proxy replay FILE`` reads: a user records a day of traffic
and tries policies on it. The conversation is the one the proxy stored (what the client sent,
and the answers); the client's tool schemas are not stored, so a replay counts prompts
without them (``meta.tools_tokens`` says how many tokens they were).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import urllib.parse
from datetime import UTC, datetime
from typing import IO, Any

import orjson

PAGE = 200  # sessions listed a request


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export", help="write stored sessions as replay input",
        description="Write sessions a running proxy stored as replay input (one JSON object "
                    "a line): one session by name, or a tenant's sessions updated since a "
                    "time. Then: runloop-proxy replay FILE.",
        epilog="examples: runloop-proxy export my-session -o s.jsonl   "
               "runloop-proxy export --tenant acme --since 24h -o day.jsonl")
    p.add_argument("session_id", nargs="?", default=None,
                   help="the session's name (its X-Session-Id) or stored id; without it, "
                        "every session of --tenant updated since --since")
    p.add_argument("--tenant", default=None,
                   help="the tenant whose sessions (default: every tenant's)")
    p.add_argument("--since", default=None, metavar="TIME",
                   help="sessions updated since: an ISO time (2026-12-01T09:00, UTC unless "
                        "it says) or an age (90m, 24h, 7d); default: all")
    p.add_argument("-o", "--output", default="-", metavar="FILE",
                   help="where to write (default: standard output)")
    p.add_argument("--url", default=f"http://127.0.0.1:{os.environ.get('RUNLOOP_PORT', '8080')}",
                   help="the proxy's address (default http://127.0.0.1:$RUNLOOP_PORT or 8080)")
    p.add_argument("--admin-key", default=None, help="default: $RUNLOOP_ADMIN_KEY")


AGE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def since_ms(text: str, now: float) -> int:
    """``--since`` as epoch milliseconds: an age before ``now`` or an ISO time (UTC unless
    it carries an offset). ValueError says what it expected."""
    age = AGE.fullmatch(text.strip())
    if age:
        return int((now - float(age.group(1)) * UNITS[age.group(2)]) * 1000)
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--since {text!r}: expected an age (90m, 24h, 7d) or an ISO time "
                         f"(2026-12-01T09:00)") from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return int(at.timestamp() * 1000)


def replay_line(data: dict[str, Any]) -> dict[str, Any]:
    """An admin API session (with ``messages`` and ``points``) as a line replay reads."""
    points = [p for p in data.get("points") or [] if isinstance(p, dict)]
    models = sorted({str(p["model"]) for p in points if isinstance(p.get("model"), str)})
    tools = max((p["tools_tokens"] for p in points if isinstance(p.get("tools_tokens"), int)),
                default=0)
    return {"id": data.get("name") or data["session_id"], "messages": data["messages"],
            "meta": {"tenant": data.get("tenant"), "session_id": data["session_id"],
                     "models": models, "tools_tokens": tools, "requests": len(points),
                     "updated_ms": data.get("updated_ms")}}


class ExportError(Exception):
    pass


def _get(client: Any, path: str, params: dict[str, Any]) -> Any:
    import httpx

    try:
        r = client.get(path, params=params)
    except httpx.HTTPError as exc:
        raise ExportError(f"cannot reach the proxy at {client.base_url}: {exc}") from exc
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:300]
        message = message.replace("give ?tenant=NAME", "give --tenant NAME")
        raise ExportError(f"{r.status_code}: {message}")
    return r.json()


def _session(client: Any, sid: str, tenant: str | None) -> dict[str, Any]:
    quoted = urllib.parse.quote(sid, safe="")  # one path segment, whatever it holds
    params = {"messages": "1", "points": "1", **({"tenant": tenant} if tenant else {})}
    return _get(client, f"/admin/sessions/{quoted}", params)  # type: ignore[no-any-return]


def _listed(client: Any, tenant: str, since: int | None) -> list[tuple[str, str]]:
    """(tenant, stored id) of the sessions updated since ``since``, newest first."""
    out: list[tuple[str, str]] = []
    offset = 0
    while True:
        page = _get(client, "/admin/sessions", {"tenant": tenant, "offset": offset,
                                                "limit": PAGE})
        rows = page["sessions"]
        for row in rows:
            if since is not None and row["updated_ms"] < since:
                return out  # newest first: the rest are older
            out.append((page["tenant"], row["session_id"]))
        offset += len(rows)
        if not rows or offset >= page["total"]:
            return out


def run_export(args: argparse.Namespace) -> int:
    import httpx

    key = args.admin_key or os.environ.get("RUNLOOP_ADMIN_KEY")
    if not key:
        print("export needs the admin key: --admin-key or RUNLOOP_ADMIN_KEY", file=sys.stderr)
        return 2
    try:
        since = since_ms(args.since, time.time()) if args.since else None
    except ValueError as exc:
        print(f"export: {exc}", file=sys.stderr)
        return 2
    if args.session_id and args.since:
        print("export: a session by name, or --since: not both", file=sys.stderr)
        return 2
    out: IO[bytes] = sys.stdout.buffer if args.output == "-" else open(args.output, "wb")
    written = 0
    try:
        with httpx.Client(base_url=args.url.rstrip("/"), timeout=60,
                          headers={"Authorization": f"Bearer {key}"}) as client:
            if args.session_id:
                wanted = [(args.tenant, args.session_id)]
            else:
                tenants = [args.tenant] if args.tenant else [
                    t["tenant"] for t in _get(client, "/admin/tenants", {})["tenants"]]
                wanted = [w for t in tenants for w in _listed(client, t, since)]
            for tenant, sid in wanted:
                out.write(orjson.dumps(replay_line(_session(client, sid, tenant))) + b"\n")
                written += 1
    except ExportError as exc:
        print(f"export: {exc}", file=sys.stderr)
        return 1
    finally:
        if out is not sys.stdout.buffer:
            out.close()
    where = "" if args.output == "-" else f" to {args.output}"
    print(f"exported {written} session{'s' if written != 1 else ''}{where}"
          + (f"; try: runloop-proxy replay {args.output}" if written and where else ""),
          file=sys.stderr)
    return 0
