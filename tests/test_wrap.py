"""``runloop-proxy wrap claude|codex``, end to end as a user runs it: the command in a process of
its own, the agents real (npm's, the versions test_codex.py and test_claude_code.py pin) and on
PATH, the scripted upstream behind the proxy wrap starts (or a ``serve`` it finds on the data
directory). The agent's answer, its exit code, what it cost and saved, the proxy stopped by
the last wrap out (and a user's own left running), nothing of the user's edited."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from runloop_proxy.ops.wrap import LEASES, SERVING, billed
from runloop_proxy.pricing import PriceTable
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import free_port, until
from .npm import npm_bin
from .test_claude_code import VERSION as CLAUDE_VERSION
from .test_codex import CODEX_VERSION
from .test_codex import KEY as OPENAI_KEY

# an Anthropic API key as long as a real one (108 characters)
ANTHROPIC_KEY = "sk-ant-api03-" + ("Zq8RvT2wXk5Nm7Pb3Yc9Ld4Hs6Fj1Ga0-" * 3)[:93] + "AA"
assert len(ANTHROPIC_KEY) == 108, len(ANTHROPIC_KEY)
CODEX_MODEL = "gpt-5-mini-2025-08-07"  # a priced model (prices.toml: gpt-5-mini)
CLAUDE_MODEL = "claude-sonnet-4-6"


@pytest.fixture(scope="session")
def codex_bin() -> str:
    return npm_bin("@openai/codex", CODEX_VERSION, "codex")


@pytest.fixture(scope="session")
def claude_bin() -> str:
    return npm_bin("@anthropic-ai/claude-code", CLAUDE_VERSION, "claude")


def user_env(tmp_path: Path, *bins: str) -> dict[str, str]:
    """A user's environment: the agents on PATH (as ``npm install -g`` puts them), HOME
    and CODEX_HOME of their own, no proxy settings of the test run's."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    path = os.pathsep.join([*(str(Path(b).parent) for b in bins),
                            str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin",
                            "/bin"])
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RUNLOOP_", "OPENAI_", "CODEX_", "ANTHROPIC_", "REDIS_URL"))}
    return {**env, "PATH": path, "HOME": str(home), "CODEX_HOME": str(home / ".codex"),
            "XDG_DATA_HOME": str(tmp_path / "xdg"),
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1", "IS_SANDBOX": "1"}


def codex_login(codex: str, env: dict[str, str]) -> Path:
    """The user's Codex: a config of their own (a model), an API key login."""
    home = Path(env["CODEX_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(f'model = "{CODEX_MODEL}"\n')
    r = subprocess.run([codex, "login", "--with-api-key"], input=OPENAI_KEY, text=True,
                       capture_output=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return home


def wrap(env: dict[str, str], *args: str, cwd: Path,
         timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runloop_proxy", "wrap", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and "sessions" not in p.parts
            and p.suffix not in (".lock", ".sqlite", ".db", ".log")
            and not p.name.endswith(("-wal", "-shm"))}


def summary(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("runloop-proxy: "))
    return lines[start:]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_wrap_codex_exec_runs_through_a_proxy_it_starts_and_prints_the_savings(
        codex_bin: str, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """``wrap codex exec "…"``: Codex answers through a proxy wrap started (over its socket),
    with the user's login; the savings and the inspector's address are printed; the proxy
    is stopped when wrap exits; the user's Codex files are as they were. A Ctrl-C at the
    terminal while Codex waits for the model is Codex's: it stops its turn and exits, the
    proxy serves on until wrap has read the figures, and wrap passes Codex's code on. Red
    with the summary left out, with the proxy left running after the last wrap, with the
    proxy in the terminal's process group (the Ctrl-C stops it under the agent), and with
    wrap's own SIGINT left to interrupt it (it stops the proxy while the agent runs)."""
    env = user_env(tmp_path, codex_bin)
    home = codex_login(codex_bin, env)
    before = digest(home)
    work = tmp_path / "work"
    work.mkdir()
    data = tmp_path / "data"
    upstream.responder = lambda body: {"content": "wrapped hello"}
    r = wrap(env, "codex", "--upstream", upstream.url, "--data-dir", str(data), "exec",
             "--skip-git-repo-check", "say hello", cwd=work)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "wrapped hello" in r.stdout
    head, raw, cost, inspector, *_ = summary(r.stderr)
    # one request (Codex's warmup is the proxy's to answer, nothing upstream)
    assert head.startswith("runloop-proxy: codex sent 1 request in 1 session: bill saved ")
    assert raw.startswith("  prompt tokens saved ") and " forwarded)" in raw
    assert cost.startswith("  upstream's bill for this run $") and "openai's prices" in cost
    assert inspector.startswith("  inspector: http://127.0.0.1:") and "/admin/ui/session?" in \
        inspector
    # the agent's key went upstream as it would directly; the socket was Codex's first try
    assert upstream.headers[-1]["authorization"] == f"Bearer {OPENAI_KEY}"
    assert "Reconnecting" not in r.stderr and "Falling back" not in r.stderr
    # Ctrl-C at a terminal: SIGINT to its foreground process group (wrap and Codex; the
    # proxy wrap started is in a session of its own)
    upstream.reset()
    upstream.delay = 5.0  # the model thinks; the scripted one notices its caller gone after
    term = subprocess.Popen(
        [sys.executable, "-m", "runloop_proxy", "wrap", "codex", "--upstream", upstream.url,
         "--data-dir", str(data), "exec", "--skip-git-repo-check", "think hard"], cwd=work,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    until(lambda: len(upstream.requests) >= 1, timeout=90,
          what="Codex's turn to reach the upstream")
    os.killpg(term.pid, signal.SIGINT)
    out, err = term.communicate(timeout=60)
    assert term.returncode != 0, err[-2000:]
    # the proxy outlived the Ctrl-C: wrap read the session's figures from it after Codex
    # (the turn was cut: nothing recorded, "no request"; a proxy gone would be "could not")
    assert summary(err)[0].startswith("runloop-proxy: codex sent "), err[-2000:]
    until(lambda: upstream.abandoned == 1, timeout=40,
          what="the interrupted turn to be cancelled upstream")
    # the proxy wrap started is gone with it, and nothing of the user's changed
    info = orjson.loads((data / SERVING).read_bytes()) if (data / SERVING).exists() else None
    assert info is None or gone(info["pid"])
    assert not list((data / LEASES).iterdir())
    after = digest(home)  # (Codex adds files of its own on a first run: not the user's)
    assert {k: after.get(k) for k in before} == before
    assert "openai_base_url" not in (home / "config.toml").read_text()


def test_wrap_claude_runs_claude_code_headless_and_prints_its_cost(
        claude_bin: str, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """``wrap claude -- -p "…"``: Claude Code (its API key from the environment, as a user
    has it) answers through the proxy and wrap prints the session's cost. Red with
    ANTHROPIC_BASE_URL left unset (Claude Code goes to Anthropic), and with the summary
    priced by the wrong provider."""
    env = {**user_env(tmp_path, claude_bin), "ANTHROPIC_API_KEY": ANTHROPIC_KEY}
    work = tmp_path / "work"
    work.mkdir()
    data = tmp_path / "data"
    upstream.responder = lambda body: {"content": "claude via the proxy"}
    args = ["claude", "--upstream", upstream.url, "--data-dir", str(data), "--", "-p",
            "say hello", "--model", CLAUDE_MODEL]
    r = wrap(env, *args, cwd=work)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    assert "claude via the proxy" in r.stdout
    head, raw, cost, *_ = summary(r.stderr)
    assert head.startswith("runloop-proxy: claude sent ") and "bill saved" in head
    assert raw.startswith("  prompt tokens saved ")
    assert cost.startswith("  upstream's bill for this run $") and "anthropic's prices" in cost
    assert any(h.get("x-api-key") == ANTHROPIC_KEY for h in upstream.headers)


def test_an_agent_that_is_not_installed_is_one_line(tmp_path: Path) -> None:
    """No ``claude`` on PATH: one line saying so and how to install it, exit 127, and no
    proxy started. Red with the proxy started first."""
    env = user_env(tmp_path)
    r = wrap(env, "claude", "--data-dir", str(tmp_path / "data"), "--", "-p", "hi",
             cwd=tmp_path, timeout=60)
    assert r.returncode == 127
    assert r.stderr.strip().splitlines() == [
        "runloop-proxy wrap: claude is not installed (install it with `npm install -g "
        "@anthropic-ai/claude-code`, then run this again)"]
    assert not (tmp_path / "data").exists()


def test_wrap_reuses_a_serve_on_the_data_dir_and_passes_the_agents_exit_code_on(
        codex_bin: str, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """A user's own ``runloop-proxy serve`` on the data directory: wrap uses it (its admin
    key from RUNLOOP_ADMIN_KEY for the figures) and leaves it running. Codex's exit code is
    wrap's: an upstream that refuses the request makes Codex exit 1, and wrap too. Red
    with wrap stopping a proxy it did not start, and with the exit code taken as wrap's
    own (0)."""
    env = user_env(tmp_path, codex_bin)
    codex_login(codex_bin, env)
    data = tmp_path / "data"
    admin = "admin-user-serve-0123456789"
    port = free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "runloop_proxy", "serve", "--upstream", upstream.url,
         "--port", str(port), "--data-dir", str(data), "--admin-key", admin,
         "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, start_new_session=True)
    try:
        until(lambda: (data / SERVING).exists(), timeout=90, what="serve to say it serves")
        work = tmp_path / "work"
        work.mkdir()
        upstream.responder = lambda body: {"content": "first answer"}
        r = wrap({**env, "RUNLOOP_ADMIN_KEY": admin}, "codex", "--upstream", upstream.url,
                 "--data-dir", str(data), "exec", "--skip-git-repo-check", "hi", cwd=work)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"inspector: http://127.0.0.1:{port}/admin/ui/session?" in r.stderr
        assert serve.poll() is None  # the user's proxy: still serving
        upstream.responder = lambda body: {"status": 400, "body": {"error": {
            "message": "this model is not available to you", "type": "invalid_request_error",
            "param": "model", "code": "model_not_found"}}}
        r = wrap({**env, "RUNLOOP_ADMIN_KEY": admin}, "codex", "--upstream", upstream.url,
                 "--data-dir", str(data), "exec", "--skip-git-repo-check", "hi", cwd=work)
        assert r.returncode == 1, r.stderr[-3000:]
        assert serve.poll() is None and httpx.get(
            f"http://127.0.0.1:{port}/healthz").status_code == 200
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(30)


def test_the_upstream_s_bill_is_priced_from_its_usage() -> None:
    """The run's bill as the upstream reported it (pure): each request's usage, its cached
    tokens at the cached price, the output included. Red with the cached tokens priced as
    read afresh, and with a request without usage priced as nothing."""
    prices = PriceTable.load()
    points = [{"ts": 1_764_650_000_000 + 1_000 * i, "client": c, "forwarded": f,
               "model": "gpt-5-mini", "usage": {"input_tokens": f, "output_tokens": 100,
                                                "input_tokens_details": {"cached_tokens": n}}}
              for i, (c, f, n) in enumerate([(3_000, 3_000, 0), (6_000, 4_000, 2_944),
                                             (9_000, 4_500, 3_968)])]
    price = prices.provider("openai").price("gpt-5-mini")
    assert price is not None
    through = ((3_000 + 1_056 + 532) * price.input + (2_944 + 3_968) * price.cached_input
               + 300 * price.output) / 1_000_000
    assert billed(points, prices, "openai") == (pytest.approx(through), 0, set())
    bare = {k: v for k, v in points[0].items() if k != "usage"}
    assert billed([bare, {**points[0], "model": "house-model-7b"}], prices, "openai") == \
        (0.0, 1, {"house-model-7b"})


@pytest.mark.parametrize(("given", "options", "agent_args"), [
    (["exec", "hi"], {}, ["exec", "hi"]),
    (["--", "-p", "hi"], {}, ["-p", "hi"]),
    (["--upstream", "http://u/v1", "--data-dir=/d", "exec", "--upstream", "x"],
     {"upstream": "http://u/v1", "data_dir": "/d"}, ["exec", "--upstream", "x"]),
    (["--port", "9123", "--", "--port", "1"], {"port": 9123}, ["--port", "1"]),
])
def test_wraps_own_options_come_before_the_agents(given: list[str], options: dict[str, Any],
                                                  agent_args: list[str]) -> None:
    """What follows the agent's name is the agent's, but for wrap's own options in front of
    it (``wrap codex --upstream U exec …``) and a ``--`` that ends them."""
    import argparse

    from runloop_proxy.ops.wrap import own_options

    args = argparse.Namespace(agent_args=given, upstream=None, data_dir=None, port=0)
    assert own_options(args) == agent_args
    assert {k: getattr(args, k) for k in options} == options


def test_codex_set_to_another_provider_is_said(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A Codex whose config (read, never written) or arguments choose another model
    provider would not go through the proxy: wrap says so, and how to."""
    from runloop_proxy.ops.wrap import codex_elsewhere

    monkeypatch.setenv("CODEX_HOME", str(tmp_path))
    assert codex_elsewhere(["exec", "hi"]) is None  # no config: the built-in provider
    (tmp_path / "config.toml").write_text('model_provider = "azure"\n')
    said = codex_elsewhere(["exec", "hi"])
    assert said is not None and "'azure'" in said and "-c model_provider=openai" in said
    assert codex_elsewhere(["-c", "model_provider=openai", "exec", "hi"]) is None
    assert (tmp_path / "config.toml").read_text() == 'model_provider = "azure"\n'


def test_claude_code_keeps_tool_search_through_the_proxy(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Claude Code turns tool search off for a base URL that is not Anthropic's unless
    ENABLE_TOOL_SEARCH is set: wrap sets it for the agent's process, the user's own value
    first; Codex's environment is left alone. Red with the switch not set."""
    from runloop_proxy.ops.wrap import AGENTS, Proxy, launch

    proxy = Proxy("http://127.0.0.1:48123", 4242, "https://api.anthropic.com", None, True)
    monkeypatch.delenv("ENABLE_TOOL_SEARCH", raising=False)
    args, env = launch(AGENTS["claude"], proxy, ["-p", "hi"])
    assert args == ["-p", "hi"] and env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:48123"
    assert env["ENABLE_TOOL_SEARCH"] == "true"
    monkeypatch.setenv("ENABLE_TOOL_SEARCH", "auto:5")
    assert launch(AGENTS["claude"], proxy, [])[1]["ENABLE_TOOL_SEARCH"] == "auto:5"
    monkeypatch.delenv("ENABLE_TOOL_SEARCH")
    assert "ENABLE_TOOL_SEARCH" not in launch(AGENTS["codex"], proxy, [])[1]
