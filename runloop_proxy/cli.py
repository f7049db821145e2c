"""The ``runloop-proxy`` command: serve, check-config, inspect, replay, demo, wrap.

Every ``serve`` option can also come from the environment as ``RUNLOOP_<NAME>``
(``--redis-url`` also from ``REDIS_URL``); the command line wins.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.parse
from typing import Any

import orjson

from . import __version__
from .config import Settings, describe, load_config, url_hints
from .environment import SERVE_OPTIONS, env_name, env_value, port_number, settings_to_env
from .errors import ConfigError
from .ops.views import branch_origin, loop_span, record_line

DESCRIPTION = ("An OpenAI-compatible reverse proxy that keeps long LLM agent sessions inside "
               "the context window and cheap.")


def _serve_parser(sub: Any) -> None:
    names = ", ".join(env_name(o) for o in SERVE_OPTIONS)
    p = sub.add_parser(
        "serve", help="run the proxy",
        description="Run the proxy. Every option can also be set in the environment: "
                    f"{names} (REDIS_URL too); the command line wins.")
    for o in SERVE_OPTIONS:
        extra: dict[str, Any] = {"choices": o.choices} if o.choices else {"metavar": o.metavar}
        env = env_name(o) + (f" or {o.fallback_env}" if o.fallback_env else "")
        raw = env_value(o)
        p.add_argument(*o.flags, dest=o.field, type=o.kind,
                       default=o.default if raw is None else raw,
                       help=f"{o.help}; env {env}", **extra)


def cmd_serve(args: argparse.Namespace) -> int:
    from . import serving
    from .app import create_app
    from .history.embedded import EmbeddedRedis
    from .ops import logs

    logs.configure(args.log_level, args.log_format)
    settings = Settings(**{o.field: getattr(args, o.field) for o in SERVE_OPTIONS})
    problem = _not_a_directory(settings.config_dir)
    if problem:
        print(f"runloop-proxy: config error: {problem}", file=sys.stderr)
        return 2
    try:
        config = load_config(settings)
    except ConfigError as exc:
        print(f"runloop-proxy: config error: {exc}", file=sys.stderr)
        return 2
    for hint in url_hints(config):
        logs.get("serve").warning(hint)
    host, port = config.server.host, config.server.port
    try:
        sock = serving.listen(host, port)
    except OSError as exc:
        print(serving.cannot_listen(host, port, exc), file=sys.stderr)
        return 1
    embedded = None
    advertised: str | None = None
    try:
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
            # the data directory is this proxy's: said there, for `wrap` to find it
            advertised = advertise(settings.data_dir, serving.address(sock), settings.upstream)
        logs.get("serve").info(f"listening on {serving.address(sock)}")
        serving.announce_when_ready(serving.address(sock), serving.ready_lines(
            serving.address(sock), bool(config.server.admin_key)))
        if settings.workers > 1:
            os.environ.update(settings_to_env(settings))
            serving.run(serving.server_config(
                "runloop_proxy.app:app_from_env", config.server, factory=True,
                workers=settings.workers, timeout_graceful_shutdown=30), sock)
        else:
            serving.run(serving.server_config(create_app(settings, config), config.server,
                                              timeout_graceful_shutdown=30), sock)
    finally:
        sock.close()
        if advertised is not None:
            withdraw(advertised)
        if embedded is not None:
            embedded.stop()
    return 0


def advertise(data_dir: str, url: str, upstream: str | None) -> str:
    """``serving.json`` in the data directory: who serves on it (``wrap`` reuses it)."""
    from .ops.wrap import SERVING

    path = os.path.join(data_dir, SERVING)
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(orjson.dumps({"url": url, "pid": os.getpid(), "upstream": upstream}))
    os.replace(tmp, path)
    return path


def withdraw(path: str) -> None:
    """``serving.json`` taken back, if it is still this process's."""
    try:
        with open(path, "rb") as f:
            mine = orjson.loads(f.read()).get("pid") == os.getpid()
        if mine:
            os.unlink(path)
    except (OSError, orjson.JSONDecodeError, AttributeError):
        pass


def _not_a_directory(path: str | None) -> str | None:
    """Why ``path`` cannot be a config directory when it is something else (a file)."""
    if path and os.path.exists(path) and not os.path.isdir(path):
        return f"{path}: not a directory (the config directory holds runloop.toml and tenants/)"
    return None


def cmd_check_config(args: argparse.Namespace) -> int:
    problem = _not_a_directory(args.dir)
    if problem:
        print(f"invalid config: {problem}", file=sys.stderr)
        return 1
    settings = Settings(config_dir=args.dir, upstream=args.upstream)
    try:
        config = load_config(settings)
    except ConfigError as exc:
        problems = str(exc).splitlines()
        print(f"invalid config: {problems[0]}" if len(problems) == 1 else
              f"invalid config, {len(problems)} problems:\n  " + "\n  ".join(problems),
              file=sys.stderr)
        return 1
    for hint in url_hints(config):
        print(f"hint: {hint}", file=sys.stderr)
    sys.stdout.write(orjson.dumps(describe(config), option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


DEMO_PORT = 8090  # not serve's 8080: a user runs the demo, then serve, both up
RECORDS_SHOWN = 10  # inspect's text: the last ones; --json has all


def cmd_inspect(args: argparse.Namespace) -> int:
    import httpx

    key = args.admin_key or os.environ.get("RUNLOOP_ADMIN_KEY")
    if not key:
        print("inspect needs the admin key: --admin-key or RUNLOOP_ADMIN_KEY", file=sys.stderr)
        return 2
    params = {"tenant": args.tenant} if args.tenant else {}
    try:
        # the id as one path segment, whatever it holds ('%41', '../x', '?', a tab)
        sid = urllib.parse.quote(args.session_id, safe="")
        resp = httpx.get(f"{args.url.rstrip('/')}/admin/sessions/{sid}",
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
        print(f"    {bid}: {b.get('length')} messages, {branch_origin(b)}")
    for summary in data.get("summaries") or []:
        span = loop_span(summary["covers"])
        if summary.get("late"):
            print(f"  summary of {span}: late (arrived after its event)")
        else:
            print(f"  summary of {span} ({summary.get('summarizer')}):")
            for line in str(summary.get("text", "")).splitlines()[:12]:
                print(f"    {line}")
    for asked in data.get("compactions") or []:
        print(f"  compact now: loops 0-{asked['loops'][1]} omitted from message "
              f"{asked['from_message']} on")
    print("\n".join(records_lines(data["compression_records"])))
    return 0


def records_lines(records: list[dict[str, Any]], shown: int = RECORDS_SHOWN) -> list[str]:
    """inspect's compression records: the last ``shown``, saying so when some are not."""
    last = records[-shown:] if shown else []
    head = f"  compression records: {len(records)}" + (
        f" (the last {len(last)} of {len(records)} shown; --json lists them all)"
        if len(last) < len(records) else "")
    return [head, *(f"    {record_line(rec)}" for rec in last)]


def cmd_replay(args: argparse.Namespace) -> int:
    from .ops.replay import run_replay

    return run_replay(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="runloop-proxy", description=DESCRIPTION,
        epilog="runloop-proxy COMMAND --help tells a command's options.")
    parser.add_argument("--version", action="version", version=f"runloop-proxy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    c = sub.add_parser(
        "check-config", help="validate a config dir and print the effective config",
        description="Validate a config directory (runloop.toml + tenants/*.toml) as serve "
                    "would load it: every problem found is listed (exit 1); a valid one is "
                    "printed as JSON, secrets redacted.")
    c.add_argument("dir", help="the config directory, as for serve --config")
    c.add_argument("--upstream", default=None, help="as for serve (pass-through mode)")
    i = sub.add_parser("inspect", help="show a stored session",
                       description="Show a session a running proxy stored: its run loops, "
                                   "branches, summaries and compression records (the admin "
                                   "API, so the proxy's admin key).")
    i.add_argument("session_id", help="the session's name (its X-Session-Id) or its stored id")
    i.add_argument("--tenant", default=None,
                   help="the tenant whose session it is, when more than one has one by "
                        "that name")
    i.add_argument("--url", default=f"http://127.0.0.1:{os.environ.get('RUNLOOP_PORT', '8080')}",
                   help="the proxy's address (default http://127.0.0.1:$RUNLOOP_PORT or 8080)")
    i.add_argument("--admin-key", default=None, help="default: $RUNLOOP_ADMIN_KEY")
    i.add_argument("--json", action="store_true", help="print the admin API's JSON")
    r = sub.add_parser("replay", help="measure the window on recorded conversations",
                       description="Measure what the window saves on recorded conversations: "
                                   "offline, or through a running proxy (--proxy).")
    r.add_argument("file", nargs="?", default=None,
                   help="the conversations, one JSON object a line: chat (messages), "
                        "Responses (input) or Anthropic Messages")
    r.add_argument("--sample", action="store_true",
                   help="replay the sample session the demo sends (shipped with the package), "
                        "with the demo's model and policy: the same figures the demo prints")
    r.add_argument("--context", type=int, default=None,
                   help="model context window for the run (default: the model's or 128k)")
    r.add_argument("--model", default=None,
                   help="the model counted and priced (default gpt-4o; with --provider "
                        "anthropic, claude-sonnet-4)")
    r.add_argument("--provider", choices=("openai", "anthropic"), default=None,
                   help="bill both sides as this provider does: OpenAI's automatic prefix "
                        "cache, or Anthropic's cache_control breakpoints (default: the one "
                        "whose price table has the model)")
    r.add_argument("--prices", default=None, metavar="FILE",
                   help="a price table merged over the built-in one (TOML, see "
                        "runloop_proxy/prices.toml)")
    r.add_argument("--half", choices=("tune", "holdout"), default=None,
                   help="only one half of the conversations, by a fixed hash of their ids")
    r.add_argument("--worst", type=int, default=5, metavar="N",
                   help="list the N conversations that save least (default 5)")
    r.add_argument("--config", default=None, metavar="DIR", help="take the policy from a tenant")
    r.add_argument("--tenant", default=None,
                   help="with --config: the tenant whose policy (default: the pass-through "
                        "one, else the first)")
    r.add_argument("--proxy", default=None, metavar="URL",
                   help="send every request through a running proxy instead of building offline")
    r.add_argument("--api-key", default=os.environ.get("RUNLOOP_REPLAY_KEY"),
                   help="with --proxy: the tenant's proxy key (default: $RUNLOOP_REPLAY_KEY)")
    r.add_argument("--admin-key", default=os.environ.get("RUNLOOP_ADMIN_KEY"),
                   help="with --proxy: the proxy's admin key, to price the headline from the "
                        "points the proxy stored (default: $RUNLOOP_ADMIN_KEY)")
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
    r.add_argument("--judge-upstream", default=None, metavar="URL",
                   help="ask a real model (an OpenAI-compatible server's base URL, e.g. "
                        "https://api.openai.com/v1 or a local vLLM / llama.cpp, or Anthropic's "
                        "https://api.anthropic.com/v1) the next step "
                        "with the full and the compressed window, and print agreement by lever")
    r.add_argument("--judge-model", default=None, metavar="M", help="with --judge-upstream")
    r.add_argument("--judge-format", choices=("chat", "messages"), default=None,
                   help="the judge's API: chat completions, or Anthropic's Messages (default: "
                        "messages for an anthropic.com URL, chat otherwise)")
    r.add_argument("--judge-sample", type=int, default=50, metavar="N",
                   help="with --judge-upstream: request points judged (default 50)")
    r.add_argument("--judge-seed", type=int, default=0, help="the sample's seed (default 0)")
    r.add_argument("--judge-baseline", type=int, default=0, metavar="N",
                   help="with --judge-upstream: for N of the judged points, ask the full "
                        "window a second time and report the model's own agreement beside "
                        "the figure (default 0)")
    r.add_argument("--judge-key", default=os.environ.get("RUNLOOP_JUDGE_KEY"),
                   help="the judge's key (default: $RUNLOOP_JUDGE_KEY)")
    r.add_argument("--judge-output", default=None, metavar="FILE",
                   help="judged points, one JSON line each, appended as judged; a run given "
                        "the same file again skips what it holds (resumable)")
    r.add_argument("--json", action="store_true", help="print the report as JSON")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    demo = ("start a scripted upstream and the proxy, replay a sample agent session through "
            "them, print the savings and the inspector's address (no API key needed)")
    d = sub.add_parser("demo", help=demo, description=demo[:1].upper() + demo[1:] + ".")
    d.add_argument("--port", type=port_number, default=DEMO_PORT,
                   help=f"the proxy's port (default {DEMO_PORT}: serve's 8080 stays free for "
                        f"the proxy you start next)")
    d.add_argument("--redis-url", default=None, help="default: an embedded redis-server")
    d.add_argument("--data-dir", default=".runloop-demo",
                   help="where the embedded Redis keeps its data (default .runloop-demo)")
    d.add_argument("--admin-key", default=None, help="default: a random one, printed")
    d.add_argument("--once", action="store_true", help="stop after printing")
    from .ops.doctor import add_parser as doctor_parser
    from .ops.export import add_parser as export_parser
    from .ops.init import add_parser as init_parser
    from .ops.wrap import add_parser as wrap_parser

    wrap_parser(sub)
    init_parser(sub)
    export_parser(sub)
    doctor_parser(sub)
    return parser


def cmd_wrap(args: argparse.Namespace) -> int:
    from .ops.wrap import run_wrap

    return run_wrap(args)


def cmd_doctor(args: argparse.Namespace) -> int:
    from .ops.doctor import run_doctor

    return run_doctor(args)


def cmd_export(args: argparse.Namespace) -> int:
    from .ops.export import run_export

    return run_export(args)


def cmd_init(args: argparse.Namespace) -> int:
    from .ops.init import run_init

    return run_init(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from .ops.demo import run_demo

    return run_demo(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"serve": cmd_serve, "check-config": cmd_check_config, "inspect": cmd_inspect,
                "replay": cmd_replay, "demo": cmd_demo, "wrap": cmd_wrap,
                "init": cmd_init, "export": cmd_export,
                "doctor": cmd_doctor}
    try:
        return handlers[args.command](args)
    except BrokenPipeError:
        # the reader went away (``| head``): stop quietly, as other tools do; stdout is
        # pointed at nothing so that flushing it at exit does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
