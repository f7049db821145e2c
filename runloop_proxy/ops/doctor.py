"""``runloop-proxy doctor``: is this setup ready? One request through, each step a line.

The config is loaded as ``serve`` would load it; the token encodings the proxy counts with
are loaded from the package; the store is written to and read back (a key of its own that
expires); then a proxy is started on a free loopback port with that config and one small
chat completion goes through it to the upstream — reachable, and the key accepted. Each
check prints ``ok`` or ``FAIL`` with what to do; the exit code is 1 when one fails.
"""

from __future__ import annotations

import argparse
import os
import secrets
import time
from typing import Any

from ..config import ProxyConfig, Settings, load_config, redact_url, url_hints
from ..errors import ConfigError

DOCTOR_MODEL = "gpt-4o-mini"
STORE_KEY_TTL_S = 60


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor", help="check a setup: config, encodings, store, one request upstream",
        description="Check that a setup works: the config loads, the token encodings load, "
                    "the store is writable, and one request goes through a proxy to the "
                    "upstream with the key accepted. One line per check; exit 1 on a "
                    "failure.")
    p.add_argument("--config", default=None, metavar="DIR", help="as for serve --config")
    p.add_argument("--upstream", default=None, help="as for serve --upstream (pass-through)")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                   help="as for serve (default $REDIS_URL; none: the embedded redis-server)")
    p.add_argument("--data-dir", default=".runloop",
                   help="the embedded Redis's directory, as for serve (default .runloop)")
    p.add_argument("--key", default=None,
                   help="the key the test request sends: a tenant's proxy key (default "
                        "$RUNLOOP_DOCTOR_KEY), or in pass-through the upstream's own "
                        "(default $OPENAI_API_KEY)")
    p.add_argument("--model", default=DOCTOR_MODEL,
                   help=f"the model the test request asks for (default {DOCTOR_MODEL})")


class Report:
    def __init__(self) -> None:
        self.failed = 0

    def ok(self, what: str, detail: str) -> None:
        print(f"ok    {what}: {detail}", flush=True)

    def fail(self, what: str, detail: str) -> None:
        self.failed += 1
        print(f"FAIL  {what}: {detail}", flush=True)


def run_doctor(args: argparse.Namespace) -> int:
    report = Report()
    settings = Settings(config_dir=args.config, upstream=args.upstream,
                        redis_url=args.redis_url, data_dir=args.data_dir)
    try:
        config = load_config(settings)
    except ConfigError as exc:
        report.fail("config", str(exc).splitlines()[0])
        return 1
    where = args.config or f"pass-through to {redact_url(args.upstream)}"
    report.ok("config", f"{where}: {len(config.tenants)} tenant(s), "
                        f"{len(config.upstreams)} upstream(s)")
    for hint in url_hints(config):
        report.fail("upstream URL", hint)
    _encodings(report)
    embedded: list[Any] = []  # an embedded Redis started for the checks
    try:
        redis_url = _store(report, config, settings, embedded)
        if redis_url is not None:
            _request(report, settings, redis_url, args)
    finally:
        for e in embedded:
            e.stop()
    if report.failed:
        print(f"{report.failed} check{'s' if report.failed != 1 else ''} failed", flush=True)
    return 1 if report.failed else 0


def _encodings(report: Report) -> None:
    from ..pipeline import encodings
    from ..pipeline.tokens import WARM_ENCODINGS

    for name in WARM_ENCODINGS:
        try:
            enc = encodings.load(name)
        except Exception as exc:  # noqa: BLE001 - said as the check's failure
            report.fail("encodings", f"{name} does not load: {exc} (reinstall the package)")
            return
        span = "runloop doctor"  # what the proxy hands tiktoken: a span (tokens.spans)
        if enc.encode_ordinary(span) == []:
            report.fail("encodings", f"{name} counts nothing")
            return
    report.ok("encodings", ", ".join(WARM_ENCODINGS) + " loaded from the package")


def _store(report: Report, config: ProxyConfig, settings: Settings, embedded: list[Any]
           ) -> str | None:
    """The store written and read back; the Redis URL the request check uses (an embedded
    one started for the check), or None when there is none to use."""
    import redis

    url = config.store.redis_url
    started = None
    if not url:
        from ..history.embedded import EmbeddedRedis

        started = EmbeddedRedis(settings.data_dir)
        try:
            url = started.start()
        except RuntimeError as exc:
            report.fail("store", f"no redis_url, and the embedded redis-server does not "
                                 f"start: {exc}")
            return None
        embedded.append(started)
    key = f"{config.store.key_prefix}:doctor:{secrets.token_hex(8)}"
    try:
        client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        try:
            value = secrets.token_hex(8)
            client.set(key, value, ex=STORE_KEY_TTL_S)
            back = client.get(key)
            client.delete(key)
        finally:
            client.close()
    except redis.RedisError as exc:
        report.fail("store", f"{redact_url(url)}: {exc} (is Redis running there? a "
                             f"password in the URL?)")
        return None
    if back != value.encode():
        report.fail("store", f"{redact_url(url)}: a key written did not read back")
        return None
    report.ok("store", f"{redact_url(url)}{' (embedded)' if started else ''}: written and "
                       f"read back")
    return url


def _request(report: Report, settings: Settings, redis_url: str,
             args: argparse.Namespace) -> None:
    import httpx

    from ..app import create_app
    from ..scripted import ThreadedServer

    key = args.key or (os.environ.get("RUNLOOP_DOCTOR_KEY") if args.config
                       else os.environ.get("OPENAI_API_KEY"))
    if not key:
        report.fail("request", "no key to send: --key (a tenant's proxy key, or in "
                               "pass-through the upstream's)" +
                    ("" if args.config else ", or OPENAI_API_KEY"))
        return
    run = Settings(**{**settings.__dict__, "redis_url": redis_url, "port": 0,
                      "host": "127.0.0.1"})
    server = None
    try:
        config = load_config(run)
        server = ThreadedServer(create_app(run, config), server=config.server)
        port = server.start()
        started = time.monotonic()
        try:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                           headers={"Authorization": f"Bearer {key}",
                                    "X-Session-Id": f"doctor-{secrets.token_hex(4)}"},
                           json={"model": args.model, "max_tokens": 1, "messages": [
                               {"role": "user", "content": "Reply with one word: ok"}]})
        except httpx.HTTPError as exc:
            report.fail("request", f"the proxy did not answer: {exc}")
            return
        took = time.monotonic() - started
        _said(report, r, args.model, took)
    finally:
        if server is not None:
            server.stop()


def _said(report: Report, r: Any, model: str, took: float) -> None:
    try:
        error = r.json().get("error") or {}
    except ValueError:
        error = {}
    message = str(error.get("message") or r.text[:200]) if isinstance(error, dict) else ""
    if r.status_code == 200:
        tokens = r.headers.get("x-runloop-tokens", "")
        report.ok("upstream", f"reachable: {model} answered in {took:.1f} s")
        report.ok("key", "accepted" + (f" (prompt tokens sent;forwarded {tokens})"
                                       if tokens else ""))
    elif r.status_code in (502, 503, 504):
        report.fail("upstream", f"not reachable ({r.status_code}): {message}")
    elif r.status_code in (401, 403):
        report.fail("key", f"refused ({r.status_code}): {message}")
    elif r.status_code == 404:
        report.fail("upstream", f"404 from the upstream: {message} (an URL without /v1, or "
                                f"a model it has not?)")
    else:
        report.fail("request", f"{r.status_code}: {message}")
