"""`runloop-proxy serve | check-config | inspect | replay`.

Every ``serve`` option can also come from the environment as ``RUNLOOP_<NAME>``
(``--redis-url`` also from ``REDIS_URL``); the command line wins.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import orjson

from . import __version__
from .config import Settings, describe, load_config
from .errors import ConfigError

ENV_PREFIX = "RUNLOOP_"


def _env(name: str, default: Any = None) -> Any:
    return os.environ.get(ENV_PREFIX + name.upper(), default)


def settings_from_env() -> Settings:
    """Settings for a worker process started by uvicorn (``--workers N``)."""
    port = _env("port")
    cw = _env("context_window")
    cache = _env("cache_mb")
    return Settings(host=_env("host"), port=int(port) if port else None,
                    upstream=_env("upstream"), config_dir=_env("config"),
                    redis_url=_env("redis_url") or os.environ.get("REDIS_URL"),
                    data_dir=_env("data_dir", ".runloop"), log_level=_env("log_level", "info"),
                    log_format=_env("log_format", "json"),
                    context_window=int(cw) if cw else None, admin_key=_env("admin_key"),
                    cache_mb=int(cache) if cache else None,
                    summary_model=_env("summary_model"),
                    workers=int(_env("workers", "1")))


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the proxy")
    p.add_argument("--host", default=_env("host"), help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=_env("port"), help="listen port (default 8080)")
    p.add_argument("--upstream", default=_env("upstream"),
                   help="upstream base URL, e.g. https://api.openai.com/v1 (pass-through mode)")
    p.add_argument("--config", default=_env("config"), metavar="DIR",
                   help="config directory (runloop.toml + tenants/*.toml)")
    p.add_argument("--redis-url", default=_env("redis_url") or os.environ.get("REDIS_URL"),
                   help="Redis URL (redis://, rediss://, unix://, redis+cluster://); "
                        "none: an embedded redis-server under --data-dir")
    p.add_argument("--data-dir", default=_env("data_dir", ".runloop"),
                   help="where the embedded Redis keeps its data (default .runloop)")
    p.add_argument("--log-level", default=_env("log_level", "info"),
                   choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default=_env("log_format", "json"), choices=["json", "text"])
    p.add_argument("--default-context-window", "--context-window", dest="context_window",
                   type=int, default=_env("context_window"),
                   help="context window assumed for models neither the config nor the proxy "
                        "knows (known models keep their own); --context-window is the old "
                        "spelling")
    p.add_argument("--summary-model", default=_env("summary_model"),
                   help='pass-through mode: "extractive" or a model that summarises the loops '
                        "an omission leaves out (tenant files set policy.summary_model)")
    p.add_argument("--cache-mb", type=int, default=_env("cache_mb"),
                   help="memory the per-process caches may use in all (default 512)")
    p.add_argument("--workers", type=int, default=int(_env("workers", "1")),
                   help="uvicorn worker processes (default 1)")


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .history.embedded import EmbeddedRedis
    from .ops import logs

    logs.configure(args.log_level, args.log_format)
    settings = Settings(host=args.host, port=args.port, upstream=args.upstream,
                        config_dir=args.config, redis_url=args.redis_url,
                        data_dir=args.data_dir, log_level=args.log_level,
                        log_format=args.log_format,
                        context_window=args.context_window, workers=args.workers,
                        admin_key=_env("admin_key"),
                        cache_mb=int(args.cache_mb) if args.cache_mb else None,
                        summary_model=args.summary_model)
    try:
        config = load_config(settings)
    except ConfigError as exc:
        print(f"runloop-proxy: config error: {exc}", file=sys.stderr)
        return 2
    embedded = None
    if not config.store.redis_url:
        # Started here, not per worker: every worker shares the one private server.
        embedded = EmbeddedRedis(settings.data_dir)
        try:
            url = embedded.start()
        except RuntimeError as exc:
            print(f"runloop-proxy: {exc}", file=sys.stderr)
            return 2
        settings = Settings(**{**settings.__dict__, "redis_url": url})
        config = load_config(settings)
    host, port = config.server.host, config.server.port
    try:
        if settings.workers > 1:
            for field, value in settings.__dict__.items():
                if value is not None:
                    os.environ[ENV_PREFIX + field.upper().replace("CONFIG_DIR", "CONFIG")] = \
                        str(value)
            uvicorn.run("runloop_proxy.app:app_from_env", factory=True, host=host, port=port,
                        workers=settings.workers, log_level="warning", access_log=False,
                        timeout_graceful_shutdown=30)
        else:
            app = create_app(settings, config)
            uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False,
                        timeout_graceful_shutdown=30)
    finally:
        if embedded is not None:
            embedded.stop()
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    settings = Settings(config_dir=args.dir, upstream=args.upstream)
    try:
        config = load_config(settings)
    except ConfigError as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(orjson.dumps(describe(config), option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    import httpx

    key = args.admin_key or _env("admin_key")
    if not key:
        print("inspect needs the admin key: --admin-key or RUNLOOP_ADMIN_KEY", file=sys.stderr)
        return 2
    params = {"tenant": args.tenant} if args.tenant else {}
    try:
        resp = httpx.get(f"{args.url.rstrip('/')}/admin/sessions/{args.session_id}",
                         params=params, headers={"Authorization": f"Bearer {key}"}, timeout=10)
    except httpx.HTTPError as exc:
        print(f"cannot reach the proxy at {args.url}: {exc}", file=sys.stderr)
        return 2
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text
        if resp.status_code == 409 or "?tenant=" in message:
            message = message.replace("give ?tenant=NAME", "give --tenant NAME")
        print(f"{resp.status_code}: {message}", file=sys.stderr)
        return 1
    data = resp.json()
    if args.json:
        print(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return 0
    shown = data.get("name") or data["session_id"]
    key = f" (stored as {data['session_id']})" if shown != data["session_id"] else ""
    print(f"session {shown}{key}  tenant {data['tenant']}  "
          f"{data['message_count']} messages  head branch {data['head_branch']}")
    for lp in data["run_loops"]:
        ids = ", ".join(lp["tool_call_ids"][:6]) + (" …" if len(lp["tool_call_ids"]) > 6 else "")
        print(f"  loop {lp['index']:>3} [{lp['start']}-{lp['end']}] {lp['status']:<6} "
              f"tools: {len(lp['tool_call_ids'])} {ids}")
        print(f"       user:  {lp['user_preview']}")
        if lp["final_preview"]:
            print(f"       reply: {lp['final_preview']}")
    print(f"  branches: {len(data['branches'])}")
    for bid, b in data["branches"].items():
        print(f"    {bid}: {b.get('length')} messages, forked from {b.get('parent')} "
              f"at {b.get('fork_at')}")
    for summary in data.get("summaries") or []:
        loops = summary["loops"]
        if summary.get("late"):
            print(f"  summary of loops {loops[0]}-{loops[1]}: late (arrived after its event)")
        else:
            print(f"  summary of loops {loops[0]}-{loops[1]} ({summary.get('summarizer')}):")
            for line in str(summary.get("text", "")).splitlines()[:12]:
                print(f"    {line}")
    for asked in data.get("compactions") or []:
        print(f"  compact now: loops 0-{asked['loops'][1]} omitted from message "
              f"{asked['from_message']} on")
    print(f"  compression records: {len(data['compression_records'])}")
    for rec in data["compression_records"][-10:]:
        print(f"    {rec.get('kind')}: {rec.get('tokens_before')} -> {rec.get('tokens_after')} "
              f"tokens ({rec.get('reason')})")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from .ops.replay import run_replay

    return run_replay(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="runloop-proxy", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"runloop-proxy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    c = sub.add_parser("check-config", help="validate a config dir and print the effective config")
    c.add_argument("dir")
    c.add_argument("--upstream", default=None, help="as for serve (pass-through mode)")
    i = sub.add_parser("inspect", help="show a stored session")
    i.add_argument("session_id")
    i.add_argument("--tenant", default=None)
    i.add_argument("--url", default=f"http://127.0.0.1:{_env('port', '8080')}")
    i.add_argument("--admin-key", default=None)
    i.add_argument("--json", action="store_true")
    r = sub.add_parser("replay", help="measure the window on recorded conversations")
    r.add_argument("file")
    r.add_argument("--context", type=int, default=None,
                   help="model context window for the run (default: the model's or 128k)")
    r.add_argument("--model", default="gpt-4o")
    r.add_argument("--config", default=None, metavar="DIR", help="take the policy from a tenant")
    r.add_argument("--tenant", default=None)
    r.add_argument("--proxy", default=None, metavar="URL",
                   help="send every request through a running proxy instead of building offline")
    r.add_argument("--api-key", default=os.environ.get("RUNLOOP_REPLAY_KEY"),
                   help="with --proxy: the tenant's proxy key (default: $RUNLOOP_REPLAY_KEY)")
    r.add_argument("--direct-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="with --direct: the upstream's key (default: $OPENAI_API_KEY)")
    r.add_argument("--direct", default=None, metavar="URL",
                   help="with --proxy: send every request straight to this upstream as well, "
                        "and measure both sides by the upstream's usage (cached tokens too)")
    r.add_argument("--limit", type=int, default=None, help="only the first N conversations")
    r.add_argument("--summary-cost", type=int, default=0, metavar="TOKENS",
                   help="with an LLM summary_model: the tokens one summary call costs (counted "
                        "as forwarded, so savings are net); offline the extractive digest "
                        "stands in for its text")
    r.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="override a policy field for this run (repeatable)")
    r.add_argument("--json", action="store_true")
    r.add_argument("--no-progress", action="store_true")
    d = sub.add_parser("demo", help="start a scripted upstream and the proxy, replay a sample "
                                    "agent session through them, print the savings and the "
                                    "inspector's address (no API key needed)")
    d.add_argument("--port", type=int, default=8080)
    d.add_argument("--redis-url", default=None, help="default: an embedded redis-server")
    d.add_argument("--data-dir", default=".runloop-demo")
    d.add_argument("--admin-key", default=None, help="default: a random one, printed")
    d.add_argument("--once", action="store_true", help="stop after printing")
    return parser


def cmd_demo(args: argparse.Namespace) -> int:
    from .ops.demo import run_demo

    return run_demo(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"serve": cmd_serve, "check-config": cmd_check_config, "inspect": cmd_inspect,
                "replay": cmd_replay, "demo": cmd_demo}
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
