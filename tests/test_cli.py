"""The command line as a user meets it: help, serve's options and environment, check-config,
inspect, demo — each run as a process, against real servers."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import openai
import pytest

from runloop_proxy.environment import ENV_PREFIX, SERVE_OPTIONS, env_name, settings_from_env
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer, RedisServer, free_port, serve_command, until

ADMIN_KEY = "admin-0123456789abcdef"
CONFIG = Path(__file__).resolve().parent.parent / "config"


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runloop_proxy", *args], capture_output=True,
                          text=True, timeout=timeout, env=env or dict(os.environ))


def test_help_names_every_command_in_plain_words() -> None:
    out = cli("--help")
    assert out.returncode == 0
    assert "`" not in out.stdout
    for command in ("serve", "check-config", "inspect", "replay", "demo", "init"):
        assert re.search(rf"^\s+{command}\s+\w", out.stdout, re.M), command


def test_serve_help_names_each_option_s_environment_variable() -> None:
    out = cli("serve", "--help")
    text = " ".join(out.stdout.split())
    for option in SERVE_OPTIONS:
        assert f"{option.flags[0]}" in text and env_name(option) in text, option.flags[0]
    assert "--admin-key KEY" in text and "REDIS_URL" in text


def test_settings_from_the_environment_are_the_command_line_s() -> None:
    env = {"RUNLOOP_PORT": "9123", "RUNLOOP_ADMIN_KEY": "k" * 20, "REDIS_URL": "redis://r/1",
           "RUNLOOP_CONTEXT_WINDOW": "4096", "RUNLOOP_WORKERS": "3"}
    s = settings_from_env(env)
    assert (s.port, s.admin_key, s.redis_url, s.context_window, s.workers) == \
        (9123, "k" * 20, "redis://r/1", 4096, 3)
    assert s.data_dir == ".runloop" and s.log_format == "json"
    bad = cli("serve", env={**os.environ, "RUNLOOP_PORT": "eighty"})
    assert bad.returncode == 2 and "--port: 'eighty' is not a port number (0-65535)" in bad.stderr


@pytest.mark.parametrize("how", ["flag", "env"])
def test_serve_takes_the_admin_key(how: str, upstream: ScriptedUpstream, redis_url: str,
                                   tmp_path: Path) -> None:
    flags, env = (["--admin-key", ADMIN_KEY], {}) if how == "flag" \
        else ([], {"RUNLOOP_ADMIN_KEY": ADMIN_KEY})
    with serve_command(upstream.url, redis_url, tmp_path, flags, env) as (base, _, _):
        ok = httpx.get(base + "/admin/tenants", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert ok.status_code == 200 and "tenants" in ok.json()
        assert httpx.get(base + "/admin/tenants",
                         headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_check_config_reports_every_missing_variable_at_once() -> None:
    env = {k: v for k, v in os.environ.items() if not k.endswith(("_KEY", "PROXY_KEY"))}
    out = cli("check-config", str(CONFIG), env=env)
    assert out.returncode == 1
    missing = re.findall(r"environment variable (\w+) is not set", out.stderr)
    assert sorted(missing) == sorted({"OPENAI_API_KEY", "ACME_PROXY_KEY", "ACME_OPENAI_KEY",
                                      "GLOBEX_PROXY_KEY", "GLOBEX_OPENAI_KEY"})
    assert "5 problems" in out.stderr and "acme.toml: keys[0]:" in out.stderr
    full = {**env, "OPENAI_API_KEY": "sk-x", "ACME_PROXY_KEY": "acme-key-0123456789",
            "ACME_OPENAI_KEY": "sk-a", "GLOBEX_PROXY_KEY": "globex-key-0123456789",
            "GLOBEX_OPENAI_KEY": "sk-g"}
    assert cli("check-config", str(CONFIG), env=full).returncode == 0


def test_inspect_says_where_each_branch_comes_from(make_proxy: Any,
                                                   upstream: ScriptedUpstream) -> None:
    proxy: ProxyServer = make_proxy(admin_key=ADMIN_KEY)
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-inspect", max_retries=0,
                      default_headers={"X-Session-Id": "forked"})
    upstream.push({"content": "first answer"}, {"content": "second"}, {"content": "again"})
    q = [{"role": "user", "content": "question"}]
    c.chat.completions.create(model="gpt-4o", messages=q)  # type: ignore[arg-type]
    c.chat.completions.create(model="gpt-4o", messages=[  # type: ignore[arg-type]
        *q, {"role": "assistant", "content": "first answer"}, {"role": "user", "content": "more"}])
    c.chat.completions.create(model="gpt-4o", messages=[  # type: ignore[arg-type]
        *q, {"role": "assistant", "content": "an edited answer"},
        {"role": "user", "content": "more"}])
    proxy.settle()
    out = cli("inspect", "forked", "--url", proxy.base, "--admin-key", ADMIN_KEY)
    assert out.returncode == 0, out.stderr
    assert "None" not in out.stdout
    branches = re.findall(r"^    (\S+): (\d+) messages, (.+)$", out.stdout, re.M)
    assert len(branches) == 2
    assert branches[0][2] == "the session's first branch"
    assert branches[1][2] == f"forked from {branches[0][0]} at message 1"
    # each loop of the head branch: its question and its reply
    assert re.findall(r"^       (user|reply): +(.+)$", out.stdout, re.M) == [
        ("user", "question"), ("reply", "an edited answer"), ("user", "more"),
        ("reply", "again")]


def test_inspect_takes_any_session_id_as_one_name(make_proxy: Any,
                                                 upstream: ScriptedUpstream) -> None:
    """The id goes into the admin path as one segment: '%41' is not 'A', '../x' is no path,
    '?' starts no query, and a tab is no error."""
    proxy: ProxyServer = make_proxy(admin_key=ADMIN_KEY)
    ids = ["A", "%41", "x?tenant=y", "../x"]
    for sid in ids:
        c = openai.OpenAI(base_url=proxy.url, api_key="sk-inspect", max_retries=0,
                          default_headers={"X-Session-Id": sid})
        upstream.push({"content": f"answer for {sid}"})
        c.chat.completions.create(model="gpt-4o", messages=[  # type: ignore[arg-type]
            {"role": "user", "content": f"I am {sid}"}])
    proxy.settle()
    for sid in ids:
        out = cli("inspect", sid, "--url", proxy.base, "--admin-key", ADMIN_KEY)
        assert out.returncode == 0, (sid, out.stderr)
        assert f"I am {sid}" in out.stdout and "Traceback" not in out.stderr
        assert not any(f"I am {other}" in out.stdout for other in ids if other != sid)
    out = cli("inspect", "a\tb", "--url", proxy.base, "--admin-key", ADMIN_KEY)
    assert out.returncode != 0 and "no session" in out.stderr and "Traceback" not in out.stderr


def test_demo_once_prints_no_address_it_takes_down(redis_url: str, tmp_path: Path) -> None:
    r = cli("demo", "--once", "--port", "0", "--redis-url", redis_url, "--data-dir",
            str(tmp_path), timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    saved = re.search(r"prompt tokens saved [\d.]+% \(([\d,]+) sent, ([\d,]+) forwarded\)",
                      r.stdout)
    assert saved, r.stdout
    sent, got = (int(saved.group(k).replace(",", "")) for k in (1, 2))
    assert got < sent / 2 and "36 requests" in r.stdout
    assert re.search(HEADLINE, r.stdout), r.stdout
    assert "http://" not in r.stdout and "without --once" in r.stdout


HEADLINE = r"bill saved -?[\d.]+% \(-?\$[\d,.]+ of \$[\d,.]+\)"


def read_until(stream: IO[str], marker: str, what: str) -> str:
    """A process's output up to the line holding ``marker`` (failing if it ends first)."""
    lines: list[str] = []
    while not any(marker in line for line in lines):
        line = stream.readline()
        assert line, f"{what} ended early: {''.join(lines)}"
        lines.append(line)
    return "".join(lines)


@pytest.fixture
def own_redis() -> Iterator[str]:
    """A redis-server of the test's own: what a page lists is what this test stored alone
    (the suite's Redis holds other tests' sessions, under the same pass-through keys)."""
    server = RedisServer().start()
    yield server.url
    server.cleanup()


def test_demo_prints_an_inspector_address_that_answers(own_redis: str, tmp_path: Path) -> None:
    redis_url = own_redis
    log = (tmp_path / "demo.log").open("w")  # read when it fails (a pipe nobody reads fills)
    # started as a script's background job is: SIGINT ignored (Python then keeps it so, and
    # Ctrl-C stopped nothing: CI run from a script hung here), yet Ctrl-C stops it
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "runloop_proxy",
                             "demo", "--port", "0", "--redis-url", redis_url, "--data-dir",
                             str(tmp_path)], stdout=subprocess.PIPE, stderr=log, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert proc.stdout is not None
        text = read_until(proc.stdout, "Ctrl-C", "demo")
        found = re.search(r"inspector: (http://127\.0\.0\.1:\d+/admin/ui)\s+\(admin key: "
                          r"(demo-\w+)\)", text)
        session = re.search(r"this session: (\S+)", text)
        assert found and session, text
        c = httpx.Client(follow_redirects=False)
        login = c.post(found.group(1) + "/login", data={"key": found.group(2)})
        assert login.status_code == 303
        page = c.get(session.group(1))
        assert page.status_code == 200 and "36 requests" in page.text
        # the headline: the same name and value in the demo, the inspector and the replay
        # of the same session (the shipped sample)
        said = re.search(HEADLINE, text)
        assert said, text
        assert said.group(0) in page.text, page.text[:3000]
        listed = c.get(found.group(1))  # the sessions page: its one session's, the same
        assert f"The 1 session listed: <b>{said.group(0)}</b>" in listed.text, listed.text
        replayed = cli("replay", "--sample", "--no-progress", timeout=300)
        assert replayed.returncode == 0, replayed.stderr[-2000:]
        assert f"  {said.group(0)}: gpt-4o-mini at openai's prices" in replayed.stdout, \
            (said.group(0), replayed.stdout)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler: every thread's stack, in the log
            proc.wait(10)
            log.close()
            pytest.fail("demo did not stop on Ctrl-C:\n"
                        + (tmp_path / "demo.log").read_text()[-6000:])
        log.close()
    assert code == 0  # Ctrl-C is how it is meant to stop: a clean exit, both servers down
    with pytest.raises(httpx.HTTPError):
        httpx.get(found.group(1) + "/login", timeout=2)


@pytest.mark.parametrize("command", [["serve", "--upstream", "http://127.0.0.1:9/v1"],
                                     ["demo", "--once"], "scripted"])
def test_a_busy_port_is_said_in_one_line(command: list[str] | str, redis_url: str,
                                         tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        if command == "scripted":
            out = subprocess.run([sys.executable, "-m", "runloop_proxy.scripted", "--port", port],
                                 capture_output=True, text=True, timeout=60)
        else:
            out = cli(*command, "--port", port, "--redis-url", redis_url,
                      "--data-dir", str(tmp_path))
    assert out.returncode == 1
    assert out.stderr == f"port {port} is in use (try --port N)\n"


def spawn_serve(upstream: ScriptedUpstream, redis_url: str, data_dir: Path,
                port: int) -> subprocess.Popen[str]:
    """``runloop-proxy serve`` as a process on ``port``, its log (text) on its stderr."""
    return subprocess.Popen([sys.executable, "-m", "runloop_proxy", "serve", "--upstream",
                             upstream.url, "--redis-url", redis_url, "--port", str(port),
                             "--data-dir", str(data_dir), "--log-format", "text"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_serve_says_where_it_listens_before_it_is_ready(upstream: ScriptedUpstream,
                                                        redis_url: str, tmp_path: Path) -> None:
    port = free_port()
    proc = spawn_serve(upstream, redis_url, tmp_path, port)
    try:
        assert proc.stderr is not None
        lines = read_until(proc.stderr, "runloop-proxy ready", "serve").splitlines(True)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    said = [k for k, line in enumerate(lines) if f"listening on http://127.0.0.1:{port}" in line]
    assert said and said[0] < len(lines) - 1, lines


def test_the_scripted_upstream_says_where_it_listens() -> None:
    usage = subprocess.run([sys.executable, "-m", "runloop_proxy.scripted", "--help"],
                           capture_output=True, text=True, timeout=60)
    assert usage.stdout.startswith("usage: python -m runloop_proxy.scripted ")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "runloop_proxy.scripted", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = f"http://127.0.0.1:{port}/v1"
        assert proc.stdout.readline() == f"scripted upstream listening on {url}\n"
        reply = httpx.post(url + "/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert reply.json()["choices"][0]["message"]["content"] == "echo: hi"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)


def test_every_command_and_every_argument_is_explained() -> None:
    """A sweep of the parser: an argument added later without a help string fails here."""
    import argparse

    from runloop_proxy.cli import build_parser

    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    for name, parser in commands.choices.items():
        assert parser.description, name
        for action in parser._actions:
            assert action.help, (name, action.dest)
    out = cli("check-config", "--help")
    assert "the config directory" in " ".join(out.stdout.split())


@pytest.mark.parametrize("command", ["check-config", "serve --config"])
def test_a_file_given_as_the_config_directory_is_said_to_be_one(command: str) -> None:
    readme = str(CONFIG.parent / "README.md")
    out = cli(*command.split(), readme)
    assert out.returncode != 0
    assert f"{readme}: not a directory" in out.stderr and "does not exist" not in out.stderr
    assert len(out.stderr.splitlines()) == 1


def _collections(metrics: str, generation: int) -> float:
    found = re.search(rf'^python_gc_collections_total\{{generation="{generation}"\}} (\S+)$',
                      metrics, re.M)
    assert found, "the process's collections are not in /metrics"
    return float(found.group(1))


def test_a_large_request_starts_no_full_collection_in_a_served_process(
        upstream: ScriptedUpstream, redis_url: str, tmp_path: Path) -> None:
    """Finding: a request of 15,000 Messages turns held every other request 50 to 75 ms,
    and no profile of the event loop showed why: its allocations started full collections
    (CPython's default thresholds), each scanning every live object with the GIL held, in
    whatever thread. A served process tunes its collector (``serving.tune_gc``): an
    18,000-message request and its write-behind start no full collection (several did
    before), counted from the process's own /metrics."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = spawn_serve(upstream, redis_url, tmp_path, port)
    try:
        assert proc.stderr is not None
        read_until(proc.stderr, "runloop-proxy ready", "serve")
        upstream.keep_requests = False
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"}
                    for i in range(18_001)]

        def send(session: str, n: int) -> None:
            r = httpx.post(url + "/v1/chat/completions", timeout=120,
                           json={"model": "gpt-4o", "messages": messages[:n]},
                           headers={"X-Session-Id": session})
            assert r.status_code == 200, r.text[:300]

        send("warm", 201)
        before = httpx.get(url + "/metrics").text
        for k in range(3):
            send(f"large-{k}", len(messages))
        httpx.get(url + "/healthz")
        import time
        time.sleep(1)  # the write-behind flushes
        after = httpx.get(url + "/metrics").text
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    assert _collections(after, 0) > _collections(before, 0)  # the collector runs
    assert _collections(after, 2) == _collections(before, 2)


def test_every_served_worker_tunes_its_collector(monkeypatch: pytest.MonkeyPatch,
                                                 upstream: ScriptedUpstream) -> None:
    """``serve --workers N`` builds each worker's app with ``app_from_env``: it tunes that
    process's collector as ``serving.run`` does a single process's."""
    import gc

    from runloop_proxy.app import app_from_env
    from runloop_proxy.serving import GC_THRESHOLDS

    monkeypatch.setenv("RUNLOOP_UPSTREAM", upstream.url)
    previous = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        app_from_env()
        assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.get_freeze_count() > 0
    finally:
        gc.set_threshold(*previous)
        gc.unfreeze()


def test_a_reader_that_goes_away_ends_the_output_quietly(tmp_path: Path) -> None:
    """Found by a newcomer: ``runloop-proxy inspect … | head`` ended in a BrokenPipeError
    traceback. Any command whose reader closes the pipe stops quietly (141, as a shell's
    tools do)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"messages": [{"role": "user", "content": "hi"}, '
                     '{"role": "assistant", "content": "hello"}]}\n')
    proc = subprocess.Popen([sys.executable, "-m", "runloop_proxy.cli", "replay",
                             "--json", "--no-progress", str(trace)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141 and "Traceback" not in err, err


def test_a_port_or_data_dir_that_cannot_be_used_is_one_line(tmp_path: Path,
                                                            upstream: ScriptedUpstream) -> None:
    """Found by a newcomer: ``--port 99999`` and a ``--data-dir`` that cannot be one (a file,
    a path under /proc, a directory nobody may write) ended in tracebacks. Each is one line
    naming the option, exit status 2."""
    bad_port = cli("serve", "--upstream", upstream.url, "--port", "99999")
    assert bad_port.returncode == 2 and "'99999' is not a port number" in bad_port.stderr
    a_file = tmp_path / "file"
    a_file.write_text("")
    for where in (a_file, Path("/proc/runloop-nope")):
        out = cli("serve", "--upstream", upstream.url, "--port", "0", "--data-dir", str(where))
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert "cannot use the data directory" in out.stderr and "--data-dir" in out.stderr


# A value of the wrong kind for each serve option that has a kind: every option whose kind is
# not plain text is in this table, or the sweep fails naming it.
BAD_VALUES = {"port": "99999", "upstream_format": "openai", "log_level": "verbose",
              "log_format": "pretty", "context_window": "12", "cache_mb": "-1",
              "workers": "0", "redis_url": "localhost:6379", "upstream": "api.openai.com/v1"}


@pytest.mark.parametrize("where", ["command line", "environment"])
def test_every_serve_option_of_the_wrong_kind_is_one_line_before_anything_starts(
        where: str, tmp_path: Path) -> None:
    """Found by newcomers, one option at a time: ``--port 99999`` (a traceback), then
    ``RUNLOOP_LOG_LEVEL=verbose`` (argparse checks its choices only on the command line),
    ``REDIS_URL=localhost:6379`` (a traceback after "listening on"), ``--workers 0`` and
    ``--cache-mb -1`` (taken without a word). Swept over every option, from the command line
    and from the environment: exit 2, one line naming the option (after argparse's usage, for
    those it reads), nothing started."""
    kinds = {o.field for o in SERVE_OPTIONS if o.kind is not str} | {"redis_url", "upstream"}
    assert kinds == set(BAD_VALUES), "give each option with a kind a bad value here"
    for option in SERVE_OPTIONS:
        if option.field not in BAD_VALUES:
            continue
        value = BAD_VALUES[option.field]
        env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLOOP_")
               and k != "REDIS_URL"}
        args = ["serve", "--data-dir", str(tmp_path / "data")]
        if option.field != "port":  # the command line wins over the environment
            args += ["--port", "0"]
        if option.field != "upstream":
            args += ["--upstream", "http://127.0.0.1:9/v1"]
        if where == "command line":
            args += [option.flags[0], value]
        else:
            env[ENV_PREFIX + option.env] = value
        out = cli(*args, env=env, timeout=60)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2, (option.field, out.returncode, out.stderr[-500:])
        assert "Traceback" not in out.stderr, (option.field, out.stderr)
        assert lines[-1].startswith("runloop-proxy") and value in lines[-1], lines[-1]
        assert all(line.startswith(("usage:", " ")) for line in lines[:-1]), lines  # argparse's
        assert not (tmp_path / "data").exists()  # nothing started: no embedded Redis


def test_a_stop_says_what_it_waits_for_and_a_second_one_aborts_cleanly(
        upstream: ScriptedUpstream, redis_url: str, tmp_path: Path) -> None:
    """Found by newcomers (twice): a first Ctrl-C waited for the request in flight without a
    word; a second one printed two CancelledError tracebacks and gave the client a plain-text
    500. Now the first says how many requests it waits for; the second aborts them: the
    client gets a 503 in its API's shape, the log one line, and no traceback anywhere."""
    import threading

    port = free_port()
    proc = spawn_serve(upstream, redis_url, tmp_path, port)
    answers: list[httpx.Response] = []
    try:
        assert proc.stderr is not None
        read_until(proc.stderr, "runloop-proxy ready", "serve")

        def ask(path: str, body: dict[str, Any]) -> None:
            answers.append(httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=60,
                                      headers={"Authorization": "Bearer sk-a",
                                               "x-api-key": "sk-a",
                                               "X-Scripted-Delay-Ms": "20000"}))
        asking = [threading.Thread(target=ask, args=a) for a in (
            ("/v1/chat/completions", {"model": "m", "messages": [
                {"role": "user", "content": "slow"}]}),
            ("/v1/messages", {"model": "claude-sonnet-4-6", "max_tokens": 5, "messages": [
                {"role": "user", "content": "slow"}]}))]
        for t in asking:
            t.start()
        until(lambda: len(upstream.requests) == 2, what="both requests upstream")
        proc.send_signal(signal.SIGINT)
        said = read_until(proc.stderr, "in flight", "the first stop")
        assert "shutting down: 2 request(s) in flight (Ctrl-C again to abort them)" in said
        proc.send_signal(signal.SIGINT)
        for t in asking:
            t.join(30)
        _, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = said + rest
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert "aborting 2 request(s) in flight" in log
    assert log.count("request aborted at shutdown") == 2
    by_shape = sorted(r.json().get("type", "openai") for r in answers)
    assert [r.status_code for r in answers] == [503, 503] and by_shape == ["error", "openai"]
    assert {r.headers["retry-after"] for r in answers} == {"5"}


# A value other than its default for every serve option, each valid: every option is in this
# table, or the sweep below fails naming it.
GOOD_VALUES = {"host": "0.0.0.0", "port": 9876, "upstream": "http://127.0.0.1:9/v1",
               "upstream_format": "chat", "config_dir": "/etc/runloop",
               "redis_url": "redis://127.0.0.1:6390/2", "data_dir": "/var/lib/runloop",
               "admin_key": "admin-key-0123456789", "log_level": "debug",
               "log_format": "text", "context_window": 32_768, "summary_model": "extractive",
               "cache_mb": 256, "workers": 3}


def test_every_serve_setting_reaches_every_worker_as_the_command_line_gave_it() -> None:
    """``serve --workers N`` hands its settings to the worker processes through the
    environment (``settings_to_env``, read back by ``settings_from_env``): every option,
    each set alone to a value other than its default and all of them at once, reaches a
    worker as it was given on the command line. Planted, each passed every other test: the
    settings whose default is not None left out (a worker forgot --log-level, --data-dir
    and --log-format: it logged JSON at info under .runloop); a variable named from the
    setting's field (CONFIG_DIR, not CONFIG: the workers served without the tenants)."""
    from runloop_proxy.cli import build_parser
    from runloop_proxy.config import Settings
    from runloop_proxy.environment import settings_to_env

    assert set(GOOD_VALUES) == {o.field for o in SERVE_OPTIONS}, "give each option a value"
    for option in SERVE_OPTIONS:
        assert GOOD_VALUES[option.field] != option.default, option.field
    cases = [{o.field: GOOD_VALUES[o.field]} for o in SERVE_OPTIONS] + [GOOD_VALUES]
    for given in cases:
        args = [a for o in SERVE_OPTIONS if o.field in given
                for a in (o.flags[0], str(given[o.field]))]
        parsed = build_parser().parse_args(["serve", *args])
        settings = Settings(**{o.field: getattr(parsed, o.field) for o in SERVE_OPTIONS})
        assert {f: getattr(settings, f) for f in given} == given
        environ = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)
                   and k != "REDIS_URL"}
        assert settings_from_env({**environ, **settings_to_env(settings)}) == settings, given


# Each numeric option's range, as its help and the README give it: (lowest, highest or None)
NUMBER_RANGES = {"port": (0, 65535), "workers": (1, None), "context_window": (1024, None),
                 "cache_mb": (1, None)}


def test_every_numeric_option_takes_its_whole_range_and_nothing_past_it() -> None:
    """The kind of each numeric serve option (``port_number``, ``at_least``) takes the
    edges of its range and refuses one past them, from the command line and from the
    environment alike (the wrong-kind sweep above tries one bad value far outside). Planted,
    each passed every other test: ``at_least`` refusing its own least value (--workers 1
    refused), a port's highest refused."""
    from runloop_proxy.cli import build_parser

    numeric = {o.field for o in SERVE_OPTIONS if o.kind is not str and not o.choices}
    assert numeric == set(NUMBER_RANGES), "give each numeric option its range here"
    environ = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)
               and k != "REDIS_URL"}
    for option in SERVE_OPTIONS:
        if option.field not in NUMBER_RANGES:
            continue
        low, high = NUMBER_RANGES[option.field]
        edges = [(low, True), (low - 1, False)]
        if high is not None:
            edges += [(high, True), (high + 1, False)]
        for value, ok in edges:
            name = ENV_PREFIX + option.env
            if ok:
                parsed = build_parser().parse_args(["serve", option.flags[0], str(value)])
                assert getattr(parsed, option.field) == value, (option.field, value)
                got = settings_from_env({**environ, name: str(value)})
                assert getattr(got, option.field) == value, (option.field, value)
            else:
                with pytest.raises(SystemExit):
                    build_parser().parse_args(["serve", option.flags[0], str(value)])
                with pytest.raises(ValueError):
                    settings_from_env({**environ, name: str(value)})


@pytest.mark.parametrize(("count", "head", "listed"), [
    (0, "  compression records: 0", 0),
    (9, "  compression records: 9", 9),
    (10, "  compression records: 10", 10),
    (13, "  compression records: 13 (the last 10 of 13 shown; --json lists them all)", 10),
])
def test_inspect_says_when_it_shows_the_last_records_of_more(count: int, head: str,
                                                             listed: int) -> None:
    """Bug class: a list cut short without saying so. Planted: the note dropped (the 13 row
    red), and the first ten shown instead of the last (the ids check red)."""
    from runloop_proxy.cli import records_lines

    records = [{"kind": "elision", "at_message": 100 + k, "tokens_before": 5000 + k,
                "tokens_after": 900, "refs": [f"call_{k:02d}"]} for k in range(count)]
    lines = records_lines(records)
    assert lines[0] == head and len(lines) == 1 + listed
    shown = [k for k in range(count) if any(f"call_{k:02d}" in line or f"{100 + k}" in line
                                            for line in lines[1:])]
    assert shown == list(range(count - listed, count)), lines


@pytest.mark.parametrize(("address", "admin", "base", "inspector"), [
    ("http://127.0.0.1:18733", True, "http://127.0.0.1:18733",
     "http://127.0.0.1:18733/admin/ui  (log in with the admin key)"),
    ("http://0.0.0.0:18734", False, "http://127.0.0.1:18734",
     "off: no admin key (--admin-key, RUNLOOP_ADMIN_KEY or server.admin_key)"),
    ("http://[::]:18735", True, "http://127.0.0.1:18735",
     "http://127.0.0.1:18735/admin/ui  (log in with the admin key)"),
])
def test_serve_s_ready_lines_give_the_addresses_a_local_client_dials(
        address: str, admin: bool, base: str, inspector: str) -> None:
    from runloop_proxy.serving import ready_lines

    lines = ready_lines(address, admin)
    assert lines[0].startswith(f"runloop-proxy is ready at {base}")
    assert ("every interface" in lines[0]) == (base != address)
    assert lines[1:] == [f"  OpenAI clients:    base URL {base}/v1",
                         f"  Anthropic clients: base URL {base}",
                         f"  inspector:         {inspector}"]


def test_serve_prints_the_client_base_urls_once_it_answers(
        upstream: ScriptedUpstream, redis_url: str, tmp_path: Path) -> None:
    """Bug class: an address printed that a client cannot use. Planted: the OpenAI base URL
    printed without /v1 (the SDK's call 404: red), the lines printed before the app started
    (the port refused: red)."""
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "runloop_proxy", "serve", "--upstream",
                             upstream.url, "--redis-url", redis_url, "--port", str(port),
                             "--data-dir", str(tmp_path), "--admin-key", ADMIN_KEY],
                            stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert proc.stdout is not None
        text = read_until(proc.stdout, "inspector:", "serve")
        openai_base = re.search(r"OpenAI clients:\s+base URL (\S+)", text)
        inspector = re.search(r"inspector:\s+(\S+)", text)
        assert openai_base and inspector, text
        assert f"ready at http://127.0.0.1:{port}" in text
        client = openai.OpenAI(base_url=openai_base.group(1), api_key="sk-ready-4519" * 4,
                               max_retries=0)
        answer = client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "ready 4519"}])
        assert "ready 4519" in (answer.choices[0].message.content or "")
        assert httpx.get(inspector.group(1) + "/login").status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        log.close()
