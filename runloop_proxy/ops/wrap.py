"""``runloop-proxy wrap claude|codex [-- AGENT ARGS…]``: an agent run through the proxy with
one command.

A proxy already serving on the data directory (``serve`` says so in ``serving.json`` there,
its embedded Redis being that directory's) is used; else one is started for the run —
``runloop-proxy serve`` in a process of its own (its own session: the terminal's Ctrl-C is the
agent's), pass-through to the agent's provider (``--upstream`` overrides), on a free port,
with an admin key made for it. Each wrap holds a lease on the directory while its agent
runs; the last one out stops a proxy a wrap started (never one the user started).

Only the agent's process is pointed at the proxy: Claude Code by ``ANTHROPIC_BASE_URL`` in its
environment, Codex by a ``-c openai_base_url=…`` on its command line; the user's files are
not touched, and the agent's own login or API key goes upstream as it would directly. The
agent's exit code is wrap's. After it exits, what its sessions saved is printed (to stderr:
the agent's output stays the agent's): the headline, *bill saved* (``savings``), from the
sessions' stored points as the inspector makes it, the same name and value; the prompt tokens
as sent and as forwarded beside it, labelled; the upstream's bill for the run as it reported
it; and each session's address in the inspector.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import orjson

from ..pricing import PriceTable
from ..savings import Savings, of_points

SERVING = "serving.json"  # written by `serve` in its data directory while it serves there
STARTED = "wrap-started.json"  # the proxy a wrap started (the last wrap out stops it)
ADMIN_KEY_FILE = "wrap-admin-key"  # that proxy's admin key, readable by its user only
LEASES = "wrap-leases"
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0
# what the proxy started here must not take from the user's environment
_SERVE_ENV = ("RUNLOOP_", "REDIS_URL")


@dataclass(frozen=True)
class Agent:
    name: str
    command: str
    package: str  # npm's
    upstream: str
    provider: str  # whose prices (prices.toml)


AGENTS = {
    "claude": Agent("claude", "claude", "@anthropic-ai/claude-code",
                    "https://api.anthropic.com/v1", "anthropic"),
    "codex": Agent("codex", "codex", "@openai/codex", "https://api.openai.com/v1", "openai"),
}


class WrapError(Exception):
    """What stops a wrap before its agent runs: one line for the user."""


# what Claude Code keeps for Anthropic's own URL, switched on for the proxy (the user's own
# setting wins); what differs beside is in the docs (Claude Code through the proxy)
CLAUDE_FIRST_PARTY = {"ENABLE_TOOL_SEARCH": "true"}


@dataclass(frozen=True)
class Proxy:
    url: str  # http://127.0.0.1:PORT, no /v1
    pid: int
    upstream: str
    admin_key: str | None
    started: bool  # by this wrap


def default_data_dir(agent: str) -> str:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "runloop-proxy" / agent)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "wrap", help="run Claude Code or Codex through the proxy",
        description="Run an agent through runloop-proxy: a proxy already serving on the data "
                    "directory, or one started for the run (embedded Redis, a free port), "
                    "and only the agent's own environment pointed at it. Prints what the "
                    "session cost and saved when the agent exits; the exit code is the "
                    "agent's.",
        epilog="examples: runloop-proxy wrap claude -- -p 'fix the tests'   "
               "runloop-proxy wrap codex exec 'fix the tests'")
    p.add_argument("agent", choices=sorted(AGENTS), help="the agent to run")
    p.add_argument("--upstream", default=None,
                   help="where the proxy forwards (default: Anthropic's API for claude, "
                        "OpenAI's for codex)")
    p.add_argument("--data-dir", default=None,
                   help="the proxy's data directory (default: "
                        "$XDG_DATA_HOME/runloop-proxy/AGENT, ~/.local/share/… without it)")
    p.add_argument("--port", type=int, default=0,
                   help="the port of a proxy started here (default: a free one)")
    p.add_argument("agent_args", nargs=argparse.REMAINDER, metavar="-- AGENT ARGS",
                   help="passed to the agent as they are")


OWN_OPTIONS = ("--upstream", "--data-dir", "--port")


def own_options(args: argparse.Namespace) -> list[str]:
    """wrap's own options given after the agent's name (``wrap codex --upstream U exec …``)
    taken off the front of the agent's arguments, into ``args``; the agent's arguments after
    them, less a ``--`` that ends them."""
    rest = list(args.agent_args)
    while rest:
        name, eq, value = rest[0].partition("=")
        if name not in OWN_OPTIONS:
            break
        if not eq:
            if len(rest) < 2:
                raise WrapError(f"{name} needs a value")
            value = rest[1]
        rest = rest[1 if eq else 2:]
        field = name[2:].replace("-", "_")
        try:
            setattr(args, field, int(value) if field == "port" else value)
        except ValueError as exc:
            raise WrapError(f"{name} must be a number, not {value!r}") from exc
    return rest[1:] if rest[:1] == ["--"] else rest


def run_wrap(args: argparse.Namespace) -> int:
    agent = AGENTS[args.agent]
    try:
        agent_args = own_options(args)
    except WrapError as exc:
        print(f"runloop-proxy wrap: {exc}", file=sys.stderr)
        return 2
    # the agent on PATH, as npm install -g puts it; RUNLOOP_WRAP_CLAUDE / _CODEX: elsewhere
    binary = os.environ.get(f"RUNLOOP_WRAP_{agent.name.upper()}") or \
        shutil.which(agent.command)
    if binary is None:
        print(f"runloop-proxy wrap: {agent.command} is not installed (install it with "
              f"`npm install -g {agent.package}`, then run this again)", file=sys.stderr)
        return 127
    upstream = (args.upstream or agent.upstream).rstrip("/")
    data_dir = Path(args.data_dir or default_data_dir(agent.name)).expanduser().resolve()
    try:
        proxy = acquire(data_dir, upstream, args.port)
    except WrapError as exc:
        print(f"runloop-proxy wrap: {exc}", file=sys.stderr)
        return 2
    since_ms = int(time.time() * 1000)
    if agent.name == "codex" and (warning := codex_elsewhere(agent_args)) is not None:
        print(f"runloop-proxy wrap: {warning}", file=sys.stderr)
    try:
        code = run_agent(binary, *launch(agent, proxy, agent_args))
        for line in report(proxy, since_ms, agent):
            print(line, file=sys.stderr)
        return code
    finally:
        release(data_dir, proxy)


def launch(agent: Agent, proxy: Proxy, agent_args: list[str]
           ) -> tuple[list[str], dict[str, str]]:
    """The agent's arguments and environment: the user's, pointed at the proxy."""
    env = dict(os.environ)
    if agent.name == "claude":
        env["ANTHROPIC_BASE_URL"] = proxy.url  # Claude Code adds /v1/messages itself
        # Claude Code turns tool search off for a base URL not Anthropic's own unless this
        # is set (2.1.332); through the proxy its requests reach Anthropic as it sent them
        # (the beta header, deferred tools, the search's blocks), so it keeps what it had
        for name, value in CLAUDE_FIRST_PARTY.items():
            env.setdefault(name, value)
        return agent_args, env
    # Codex: its built-in provider's base URL for this run only (its login is kept)
    return ["-c", f'openai_base_url="{proxy.url}/v1"', *agent_args], env


def codex_elsewhere(agent_args: list[str]) -> str | None:
    """Why Codex would not go through the proxy: its config (read, never written) or its
    arguments choose a model provider other than its built-in one, whose base URL is the
    one wrap points at the proxy; None when it goes through."""
    import tomllib

    home = Path(os.environ.get("CODEX_HOME") or Path.home() / ".codex")
    try:
        chosen = tomllib.loads((home / "config.toml").read_text()).get("model_provider")
    except (OSError, tomllib.TOMLDecodeError):
        chosen = None
    for i, arg in enumerate(agent_args[:-1]):
        if arg in ("-c", "--config") and agent_args[i + 1].startswith("model_provider="):
            chosen = agent_args[i + 1].partition("=")[2].strip("\"'")
    if chosen in (None, "openai"):
        return None
    return (f"Codex is set to the model provider {chosen!r}, so its requests go where that "
            f"provider says, not through the proxy (wrap points the built-in OpenAI "
            f"provider at it): pass -c model_provider=openai to go through it")


# -- the agent ------------------------------------------------------------------------------

def run_agent(binary: str, agent_args: list[str], env: dict[str, str]) -> int:
    """Run the agent in the foreground; its exit code (128 + N for a signal N). A Ctrl-C at
    the terminal reaches it (it is in the terminal's process group) and is its to handle:
    wrap only waits, and a SIGTERM or SIGHUP to wrap is passed on to it."""
    try:
        proc = subprocess.Popen([binary, *agent_args], env=env)
    except OSError as exc:
        raise SystemExit(f"runloop-proxy wrap: cannot run {binary}: {exc.strerror or exc}"
                         ) from exc

    def forward(signum: int, frame: FrameType | None) -> None:
        if signum != signal.SIGINT:  # the terminal sent Ctrl-C to the agent already
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

    # handlers, not SIG_IGN: an ignored signal would be ignored by the agent too (exec keeps
    # it), a handled one is reset to the default in the agent
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM,
                                                       signal.SIGHUP)}
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code


# -- the proxy ------------------------------------------------------------------------------

@contextlib.contextmanager
def locked(data_dir: Path) -> Iterator[None]:
    """One wrap at a time decides about the directory's proxy (start, reuse, stop)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "wrap.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def serving(data_dir: Path) -> dict[str, Any] | None:
    """What serves on the directory now: ``serving.json`` of a live process that answers."""
    try:
        info = orjson.loads((data_dir / SERVING).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    if not isinstance(info, dict) or not _alive(info.get("pid")):
        return None
    try:
        up = httpx.get(f"{info['url']}/healthz", timeout=5).status_code == 200
    except (httpx.HTTPError, KeyError):
        up = False
    return info if up else None


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire(data_dir: Path, upstream: str, port: int = 0) -> Proxy:
    """The proxy serving on ``data_dir`` (started when none is), with a lease on it."""
    with locked(data_dir):
        info = serving(data_dir)
        if info is None:
            proxy = _start(data_dir, upstream, port)
        else:
            if str(info.get("upstream") or "").rstrip("/") != upstream:
                raise WrapError(
                    f"the proxy serving on {data_dir} forwards to {info.get('upstream')}, "
                    f"not {upstream}: give this run another --data-dir")
            started = _read_json(data_dir / STARTED)
            by_wrap = isinstance(started, dict) and started.get("pid") == info["pid"]
            key = _read_key(data_dir) if by_wrap else os.environ.get("RUNLOOP_ADMIN_KEY")
            proxy = Proxy(str(info["url"]), int(info["pid"]), upstream, key, False)
        leases = data_dir / LEASES
        leases.mkdir(exist_ok=True)
        (leases / str(os.getpid())).write_text(str(proxy.pid))
        return proxy


def _read_json(path: Path) -> Any:
    try:
        return orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None


def _read_key(data_dir: Path) -> str | None:
    try:
        return (data_dir / ADMIN_KEY_FILE).read_text().strip() or None
    except OSError:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(data_dir: Path, upstream: str, port: int) -> Proxy:
    """``runloop-proxy serve`` on ``data_dir``, pass-through to ``upstream``, in a session
    of its own (the terminal's signals are the agent's); its output in ``proxy.log``."""
    key = "wrap-" + secrets.token_hex(16)
    key_file = data_dir / ADMIN_KEY_FILE
    key_file.touch(mode=0o600)
    os.chmod(key_file, 0o600)
    key_file.write_text(key)
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SERVE_ENV)}
    env["RUNLOOP_ADMIN_KEY"] = key
    log_path = data_dir / "proxy.log"
    with contextlib.suppress(FileNotFoundError):
        (data_dir / SERVING).unlink()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runloop_proxy", "serve", "--upstream", upstream,
             "--host", "127.0.0.1", "--port", str(port or _free_port()),
             "--data-dir", str(data_dir), "--log-level", "warning", "--log-format", "text"],
            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        info = serving(data_dir)
        if info is not None and info.get("pid") == proc.pid:
            (data_dir / STARTED).write_bytes(orjson.dumps({"pid": proc.pid}))
            return Proxy(str(info["url"]), proc.pid, upstream, key, True)
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
            raise WrapError(f"the proxy did not start ({tail[0][:300]}); its log: {log_path}")
        time.sleep(0.1)
    proc.terminate()
    raise WrapError(f"the proxy did not answer within {START_TIMEOUT_S:.0f} s; its log: "
                    f"{log_path}")


def release(data_dir: Path, proxy: Proxy) -> None:
    """This wrap's lease given back; the last one out stops a proxy a wrap started."""
    with locked(data_dir):
        leases = data_dir / LEASES
        with contextlib.suppress(FileNotFoundError):
            (leases / str(os.getpid())).unlink()
        for lease in list(leases.iterdir()) if leases.is_dir() else []:
            if not (lease.name.isdigit() and _alive(int(lease.name))):
                lease.unlink(missing_ok=True)  # a wrap that died without giving it back
        if any(leases.iterdir()):
            return
        started = _read_json(data_dir / STARTED)
        if not isinstance(started, dict) or started.get("pid") != proxy.pid:
            return  # the user's own proxy, or one started since: not this wrap's to stop
        with contextlib.suppress(ProcessLookupError):  # its Ctrl-C: a graceful stop (after
            os.kill(proxy.pid, signal.SIGINT)          # a SIGTERM uvicorn re-raises it, and
            # the process ends before it has taken its serving.json back)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while _alive(proxy.pid) and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(proxy.pid, os.WNOHANG)[0]:
                    break
            time.sleep(0.1)
        (data_dir / STARTED).unlink(missing_ok=True)


# -- what it cost and saved -------------------------------------------------------------------

def billed(points: list[dict[str, Any]], prices: PriceTable, provider: str
           ) -> tuple[float, int, set[str]]:
    """What the upstream billed for ``points`` as it reported it (each request's usage:
    cached and written tokens as it billed them, output included) at ``provider``'s prices;
    with the requests it reported no usage of, and the models it has no price for."""
    spec = prices.provider(provider)
    cost, unbilled = 0.0, 0
    unpriced: set[str] = set()
    for p in points:
        price = spec.price(str(p.get("model") or ""))
        usage = p.get("usage")
        if price is None:
            unpriced.add(str(p.get("model")))
        elif not isinstance(usage, dict):
            unbilled += 1
        else:
            cost += sum(price.usage_cost(usage).values())
    return cost, unbilled, unpriced


def report(proxy: Proxy, since_ms: int, agent: Agent,
           prices: PriceTable | None = None) -> list[str]:
    """What the sessions the proxy served since ``since_ms`` saved, in lines: the headline
    of those sessions as the inspector shows them (all their requests, ``savings``), the raw
    tokens beside it, and the upstream's bill for this run's requests."""
    if proxy.admin_key is None:
        return [f"runloop-proxy: the proxy at {proxy.url} is not one wrap started: set "
                f"RUNLOOP_ADMIN_KEY to its admin key to see what this session saved"]
    auth = {"Authorization": f"Bearer {proxy.admin_key}"}
    try:
        with httpx.Client(base_url=proxy.url, headers=auth, timeout=30) as c:
            sessions = _sessions_since(c, since_ms)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return [f"runloop-proxy: could not read the session's figures from {proxy.url}: {exc}"]
    if not sessions:
        return [f"runloop-proxy: {agent.name} sent the proxy no request "
                f"(inspector: {proxy.url}/admin/ui)"]
    table = prices or PriceTable.load()
    total = Savings()
    cost, unbilled, run = 0.0, 0, 0
    unpriced: set[str] = set()
    lines = []
    for tenant, sid, points in sessions:
        one = of_points(points, table)
        total = total + one
        these = [p for p in points if p.get("ts", 0) >= since_ms]
        run += len(these)
        usd, none, missing = billed(these, table, agent.provider)
        cost, unbilled, unpriced = cost + usd, unbilled + none, unpriced | missing
        query = urllib.parse.urlencode({"tenant": tenant, "id": sid})
        lines.append(f"  inspector: {proxy.url}/admin/ui/session?{query}  ({one.headline()})")
    plural = "s" if run != 1 else ""
    n = len(sessions)
    head = [f"runloop-proxy: {agent.name} sent {run} request{plural} in {n} "
            f"session{'s' if n != 1 else ''}: {total.headline()}",
            f"  {total.secondary()}"]
    if unpriced:
        head.append(f"  upstream's bill: not priced: no price for {', '.join(sorted(unpriced))} "
                    f"in {agent.provider}'s table (add it to prices.toml)")
    elif unbilled:
        head.append(f"  upstream's bill: not priced: the upstream reported no usage of "
                    f"{unbilled} request{'s' if unbilled != 1 else ''}")
    else:
        head.append(f"  upstream's bill for this run ${cost:.4f} at {agent.provider}'s prices "
                    f"(its usage, output included)")
    return [*head, *lines, f"  (admin key: {proxy.admin_key})"]


def _sessions_since(c: httpx.Client, since_ms: int
                    ) -> list[tuple[str, str, list[dict[str, Any]]]]:
    """Every session a request updated since ``since_ms``, in every namespace."""
    tenants = [t["tenant"] for t in c.get("/admin/tenants").raise_for_status().json()["tenants"]]
    out = []
    for tenant in tenants:
        listed = c.get("/admin/sessions", params={"tenant": tenant, "limit": 20}
                       ).raise_for_status().json()["sessions"]
        for row in listed:
            if row["updated_ms"] < since_ms:
                break  # newest first
            view = c.get(f"/admin/sessions/{row['session_id']}",
                         params={"tenant": tenant, "points": "1"}).raise_for_status().json()
            out.append((tenant, str(row.get("name") or row["session_id"]),
                        list(view.get("points") or [])))
    return out
