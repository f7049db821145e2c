"""Config files, tenants, validation errors, reload — and tenant isolation through the proxy."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from runloop_proxy.config import Settings, load_config
from runloop_proxy.errors import ConfigError
from runloop_proxy.pipeline.tools import definitions_tokens
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer, until
from .policies import mechanism_toml

ACME_KEY = "acme-proxy-key-0123456789"
GLOBEX_KEY = "globex-proxy-key-0123456789"


def write_config(root: Path, upstream_url: str, extra_global: str = "",
                 acme_policy: str = "") -> Path:
    (root / "tenants").mkdir(parents=True, exist_ok=True)
    (root / "runloop.toml").write_text(f"""
[server]
admin_key = "admin-0123456789abcdef"
{extra_global}
[upstreams.main]
url = "{upstream_url}"
api_key = "${{TEST_UPSTREAM_KEY}}"
max_retries = 0

[defaults]
upstream = "main"
[defaults.policy]
{mechanism_toml(max_run_loops=7)}""")
    (root / "tenants" / "acme.toml").write_text(f"""
keys = ["${{TEST_ACME_KEY}}"]
upstream_key = "sk-acme-upstream"
[policy]
keep_recent_tool_results = 5
{acme_policy}
""")
    digest = hashlib.sha256(GLOBEX_KEY.encode()).hexdigest()
    (root / "tenants" / "globex.toml").write_text(f"""
name = "globex"
keys = ["sha256:{digest}"]
""")
    return root


@pytest.fixture(autouse=True)
def env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-shared-upstream")
    monkeypatch.setenv("TEST_ACME_KEY", ACME_KEY)


def test_tenant_files_override_defaults_field_by_field(tmp_path: Path) -> None:
    cfg = load_config(Settings(config_dir=str(write_config(tmp_path, "http://x/v1"))))
    acme, globex = cfg.tenants["acme"], cfg.tenants["globex"]
    assert acme.policy.keep_recent_tool_results == 5 and acme.policy.max_run_loops == 7
    assert globex.policy.keep_recent_tool_results == 3 and globex.policy.max_run_loops == 7
    assert cfg.tenant_for_key(ACME_KEY) is acme and cfg.tenant_for_key(GLOBEX_KEY) is globex
    assert cfg.tenant_for_key("nope") is None and cfg.passthrough is None
    assert cfg.upstreams["main"].api_key == "sk-shared-upstream"


@pytest.mark.parametrize("mutate,where", [
    (lambda r: (r / "tenants" / "acme.toml").write_text('keys = ["short"]'), "keys[0]"),
    (lambda r: (r / "tenants" / "acme.toml").write_text(
        'keys = ["a-long-enough-key-123"]\nupstream = "nowhere"'), "upstream"),
    (lambda r: (r / "tenants" / "acme.toml").write_text(
        'keys = ["a-long-enough-key-123"]\n[policy]\nthreshold = 2'), "policy.threshold"),
    (lambda r: (r / "tenants" / "acme.toml").write_text(
        'keys = ["a-long-enough-key-123"]\n[policy]\ntarget = 0.9'), "policy.target"),
    (lambda r: (r / "tenants" / "acme.toml").write_text(
        'keys = ["a-long-enough-key-123"]\n[policy]\nmax_run_loopz = 3'), "policy.max_run_loopz"),
    (lambda r: (r / "tenants" / "acme.toml").write_text("keys = [unquoted"), ""),
    (lambda r: (r / "tenants" / "acme.toml").write_text(
        'keys = ["${NOT_SET_ANYWHERE}"]'), "keys[0]"),
    (lambda r: (r / "tenants" / "acme.toml").write_text(
        f'keys = ["sha256:{hashlib.sha256(GLOBEX_KEY.encode()).hexdigest()}"]'), "keys"),
])
def test_validation_errors_name_file_and_field(tmp_path: Path, mutate: Any, where: str) -> None:
    root = write_config(tmp_path, "http://x/v1")
    mutate(root)
    with pytest.raises(ConfigError) as info:
        load_config(Settings(config_dir=str(root)))
    assert info.value.file.endswith(".toml")
    assert info.value.field == where and info.value.why


def test_passthrough_needs_an_upstream() -> None:
    with pytest.raises(ConfigError):
        load_config(Settings())
    for bad in ("ftp://api.openai.com/v1", "api.openai.com/v1", "unix:///tmp/s"):
        with pytest.raises(ConfigError, match="must start with http:// or https://"):
            load_config(Settings(upstream=bad))
    cfg = load_config(Settings(upstream="https://api.openai.com/v1", context_window=32000))
    assert cfg.passthrough is not None
    assert cfg.passthrough.context_window("some-unknown-model") == 32000
    assert cfg.passthrough.context_window("gpt-4o-2024-08-06") == 128_000


def test_check_config_cli(tmp_path: Path) -> None:
    root = write_config(tmp_path, "http://x/v1")
    ok = subprocess.run([sys.executable, "-m", "runloop_proxy.cli", "check-config", str(root)],
                        capture_output=True, text=True, env=os.environ)
    assert ok.returncode == 0, ok.stderr
    assert '"acme"' in ok.stdout and ACME_KEY not in ok.stdout and "sk-acme" not in ok.stdout
    (root / "tenants" / "acme.toml").write_text('keys = ["short"]')
    bad = subprocess.run([sys.executable, "-m", "runloop_proxy.cli", "check-config", str(root)],
                         capture_output=True, text=True, env=os.environ)
    assert bad.returncode == 1 and "acme.toml: keys[0]:" in bad.stderr


def test_version_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "runloop_proxy.cli", "--version"],
                         capture_output=True, text=True)
    assert out.stdout.startswith("runloop-proxy ")


def test_tenants_are_isolated_through_the_proxy(tmp_path: Path, make_proxy: Any,
                                                upstream: ScriptedUpstream) -> None:
    proxy: ProxyServer = make_proxy(config_dir=str(write_config(tmp_path, upstream.url)))
    acme = openai.OpenAI(base_url=proxy.url, api_key=ACME_KEY, max_retries=0)
    globex = openai.OpenAI(base_url=proxy.url, api_key=GLOBEX_KEY, max_retries=0)
    acme.chat.completions.create(model="m", messages=[{"role": "user", "content": "acme"}],
                                 extra_headers={"X-Session-Id": "shared-name"})
    assert upstream.headers[-1]["authorization"] == "Bearer sk-acme-upstream"
    globex.chat.completions.create(model="m", messages=[{"role": "user", "content": "globex"}],
                                   extra_headers={"X-Session-Id": "shared-name"})
    assert upstream.headers[-1]["authorization"] == "Bearer sk-shared-upstream"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=proxy.url, api_key="wrong-key-000000000",
                      max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}])
    proxy.settle()
    admin = {"Authorization": "Bearer admin-0123456789abcdef"}
    a = httpx.get(proxy.base + "/admin/sessions/shared-name", params={"tenant": "acme"},
                  headers=admin).json()
    g = httpx.get(proxy.base + "/admin/sessions/shared-name", params={"tenant": "globex"},
                  headers=admin).json()
    assert a["run_loops"][0]["user_preview"] == "acme"
    assert g["run_loops"][0]["user_preview"] == "globex"
    # keys never reach the logs or the metrics
    metrics = httpx.get(proxy.base + "/metrics").text
    assert ACME_KEY not in metrics and "sk-acme-upstream" not in metrics


def test_reload_on_file_change_keeps_last_good(tmp_path: Path, make_proxy: Any,
                                               upstream: ScriptedUpstream) -> None:
    root = write_config(tmp_path, upstream.url)
    proxy: ProxyServer = make_proxy(config_dir=str(root))
    assert proxy.state.config.tenants["acme"].policy.keep_recent_tool_results == 5
    # a broken edit: the last good config stays
    (root / "tenants" / "acme.toml").write_text("keys = [broken")
    _bump(root / "tenants" / "acme.toml")
    failed = proxy.metrics.config_reloads.labels("error")
    until(lambda: failed._value.get() == 1, what="the broken edit tried")
    assert proxy.state.config.tenants["acme"].policy.keep_recent_tool_results == 5
    assert proxy.run(proxy.state.reload("test")) is False  # a reload says it failed
    assert proxy.state.config.tenants["acme"].policy.keep_recent_tool_results == 5
    # a good edit is picked up without a restart
    (root / "tenants" / "acme.toml").write_text(
        f'keys = ["{ACME_KEY}"]\nupstream_key = "k2"\n[policy]\nkeep_recent_tool_results = 9')
    _bump(root / "tenants" / "acme.toml")
    until(lambda: proxy.state.config.tenants["acme"].policy.keep_recent_tool_results == 9,
          what="the good edit applied")
    text = httpx.get(proxy.base + "/metrics").text
    assert 'runloop_config_reloads_total{outcome="error"}' in text
    assert 'runloop_config_reloads_total{outcome="ok"}' in text
    # a tenant a reload adds has its series at 0 before its first request (an alert on a
    # series that does not exist never fires)
    (root / "tenants" / "initech.toml").write_text('keys = ["initech-key-0123456789"]\n')
    _bump(root / "tenants" / "initech.toml")
    until(lambda: "initech" in proxy.state.config.tenants, what="the new tenant loaded")
    text = httpx.get(proxy.base + "/metrics").text
    assert 'runloop_recalls_total{outcome="miss",tenant="initech",tool="search_history"} 0.0' \
        in text, [line for line in text.splitlines() if "initech" in line][:5]


def test_a_reload_that_changes_an_upstream_takes_effect(tmp_path: Path, make_proxy: Any,
                                                        upstream: ScriptedUpstream) -> None:
    """An operator rotating an upstream's key (or moving its URL) reloads and the next
    request goes with the new one (a planted-bug survivor: a reload that kept the old
    client of an upstream whose spec changed went on with the old key)."""
    root = write_config(tmp_path, upstream.url)
    proxy: ProxyServer = make_proxy(config_dir=str(root))
    globex = openai.OpenAI(base_url=proxy.url, api_key=GLOBEX_KEY, max_retries=0)

    moved = ScriptedUpstream().start()
    try:
        def ask(where: ScriptedUpstream) -> str:
            before = len(where.headers)
            globex.chat.completions.create(model="m",
                                           messages=[{"role": "user", "content": "x"}])
            assert len(where.headers) == before + 1
            return where.headers[-1]["authorization"]

        assert ask(upstream) == "Bearer sk-shared-upstream"
        text = (root / "runloop.toml").read_text()
        (root / "runloop.toml").write_text(
            text.replace('api_key = "${TEST_UPSTREAM_KEY}"', 'api_key = "sk-rotated"')
            .replace(upstream.url, moved.url))
        assert proxy.run(proxy.state.reload("test")) is True
        assert ask(moved) == "Bearer sk-rotated"
    finally:
        moved.stop()


def test_a_request_in_flight_finishes_on_the_config_it_started_with(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """A reload while a request is in flight that moves its upstream (a new URL, a rotated
    key) and takes the tool rounds from its tenant's policy: the request's later upstream
    calls — the proxy's tool rounds — go where and with what its first went, as many as
    its policy allowed (the README: in-flight requests finish on the old config), and the
    next request goes to the new upstream with its new key. Found by a planted-bug search:
    each round looked the upstream up by name in the config of the moment, so a round after
    the reload went to the new URL with the old key (a key sent to an upstream it was not
    given for). Also red with the rounds' limit read from the config of the moment."""
    from .test_tools import CLIENT_TOOLS, recall_name

    root = write_config(tmp_path, upstream.url)
    proxy: ProxyServer = make_proxy(config_dir=str(root))
    moved = ScriptedUpstream().start()
    reloaded: list[bool] = []
    files = {path: path.read_text() for path in (root / "runloop.toml",
                                                 root / "tenants" / "globex.toml")}

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        last = body["messages"][-1]
        if last.get("role") == "tool" and last["tool_call_id"] == "sh_1":
            return {"content": "found it"}
        if not reloaded:  # the reload lands while the request waits for its first answer:
            # the upstream moved, its key rotated, globex's policy without the tool rounds
            (root / "runloop.toml").write_text(
                files[root / "runloop.toml"].replace(
                    'api_key = "${TEST_UPSTREAM_KEY}"', 'api_key = "sk-rotated"')
                .replace(upstream.url, moved.url))
            (root / "tenants" / "globex.toml").write_text(
                files[root / "tenants" / "globex.toml"] + "[policy]\nmax_tool_rounds = 0\n")
            reloaded.append(proxy.run(proxy.state.reload("test")))
        return {"tool_calls": [{"id": "sh_1", "name": recall_name(body, "search_history"),
                                "arguments": {"query": "anything"}}]}

    upstream.responder = respond
    moved.responder = lambda body: {"content": "the new upstream"}
    globex = openai.OpenAI(base_url=proxy.url, api_key=GLOBEX_KEY, max_retries=0)
    try:
        for stream in (False, True):
            reloaded.clear()
            for path, text in files.items():
                path.write_text(text)
            assert proxy.run(proxy.state.reload("back")) is True
            before_old, before_new = len(upstream.headers), len(moved.headers)
            kw: dict[str, Any] = {"model": "m", "tools": CLIENT_TOOLS,
                                  "messages": [{"role": "user", "content": "find it"}]}
            if stream:
                said = "".join(c.choices[0].delta.content or "" for c in
                               globex.chat.completions.create(stream=True, **kw) if c.choices)
            else:
                said = globex.chat.completions.create(**kw).choices[0].message.content or ""
            assert reloaded == [True]
            assert said == "found it", stream
            assert len(moved.headers) == before_new, stream  # no round went to the new one
            assert [h["authorization"] for h in upstream.headers[before_old:]] == \
                ["Bearer sk-shared-upstream"] * 2, stream
            after = globex.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "next"}])
            assert after.choices[0].message.content == "the new upstream"
            assert moved.headers[-1]["authorization"] == "Bearer sk-rotated"
    finally:
        moved.stop()


def test_a_summary_asked_before_a_reload_never_takes_its_key_to_the_moved_upstream(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """A summary is made after the request it is for (in the background, or when the next
    request closes its loop): the key it carries was taken for the upstream of that moment.
    A reload in between that moves the upstream (a new URL) sends that key nowhere — the
    summary fails open, to be made from a later request — while a summary asked after the
    reload goes to the new upstream. Red with the upstream looked up by name alone (the
    same class as a tool round: a key from one config, a URL from the next)."""
    from runloop_proxy.config import Policy
    from runloop_proxy.history.summaries import Job

    root = write_config(tmp_path, upstream.url)
    proxy: ProxyServer = make_proxy(config_dir=str(root))
    moved = ScriptedUpstream().start()
    moved.responder = lambda body: {"content": "a summary"}
    policy = Policy(summary_model="m-sum")

    def job() -> Job:
        return Job(policy, "ns", "acme", "acme", "m", "main", "Bearer sk-shared-upstream",
                   spec=proxy.state.config.upstreams["main"])

    try:
        before = job()
        glob = root / "runloop.toml"
        glob.write_text(glob.read_text().replace(upstream.url, moved.url))
        assert proxy.run(proxy.state.reload("test")) is True
        with pytest.raises(RuntimeError, match="changed since"):
            proxy.run(proxy.state.summaries._llm(before, None, "turns", len))
        assert moved.headers == [] and upstream.headers == []
        text, _ = proxy.run(proxy.state.summaries._llm(job(), None, "turns", len))
        assert text == "a summary" and len(moved.headers) == 1
    finally:
        moved.stop()


def test_a_replaced_upstream_client_closes_only_once_no_request_is_on_it(
        upstream: ScriptedUpstream) -> None:
    """A request carries the upstream's client it began on (every round goes through it),
    so a client a reload replaced is closed only once idle: not while an answer of it is
    open, however long past the idle time, nor just after one closed (a tool round follows
    its answer); then it is. Red with the client closed a fixed time after the reload (a
    long first round's later rounds met a closed session)."""
    import asyncio

    from runloop_proxy.config import UpstreamSpec
    from runloop_proxy.pipeline.upstream import UpstreamClient

    upstream.responder = lambda body: {"content": "hi"}
    body = b'{"model": "m", "messages": [{"role": "user", "content": "q"}]}'
    headers = {"Content-Type": "application/json"}

    async def run() -> None:
        client = UpstreamClient("main", UpstreamSpec(url=upstream.url))
        await client.start()
        first = await client.request("POST", "/chat/completions", headers, body)
        closing = asyncio.create_task(client.close_when_idle(0.3, poll_s=0.02))
        await asyncio.sleep(0.8)
        assert not closing.done()  # an answer is open: a request is on it
        assert b'"hi"' in await first.read(1 << 20)  # read whole: closed
        await asyncio.sleep(0.1)
        assert not closing.done()  # answered 0.1 s ago: its next round may follow
        second = await client.request("POST", "/chat/completions", headers, body)
        assert b'"hi"' in await second.read(1 << 20)
        await asyncio.wait_for(closing, 3)
        assert client._session is None

    asyncio.run(run())


def test_a_reload_leaves_the_state_a_fresh_start_on_the_new_files_would_have(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Everything the running state takes from the config — the config itself, the price
    table the metrics price usage with, the upstreams' clients, the series every tenant
    is exported with from the start — is after a reload what a proxy started on the new
    files has, whichever file the edit was in (the global file, a tenant's, the prices).
    Planted, each passed every other test: the reload left the metrics on the old price
    table (usage priced at the old prices until a restart); the new tenants' series not
    exported (an alert on them could not fire)."""
    root = write_config(tmp_path, upstream.url)
    proxy: ProxyServer = make_proxy(config_dir=str(root))
    (root / "prices.toml").write_text(
        '[openai.models."gpt-4o-mini"]\ncached_input = 0.05\n'
        '[openai.models."house-model"]\ninput = 1.0\ncached_input = 0.1\noutput = 2.0\n')
    glob = root / "runloop.toml"
    glob.write_text(glob.read_text().replace("max_retries = 0", "max_retries = 1")
                    + f'\n[upstreams.second]\nurl = "{upstream.url}"\napi_key = "sk-second"\n')
    (root / "tenants" / "initech.toml").write_text(
        'keys = ["initech-key-0123456789"]\nupstream = "second"\n'
        '[models."house-model"]\ncontext_window = 9000\n[policy]\nmax_run_loops = 2\n')
    assert proxy.run(proxy.state.reload("test")) is True
    fresh: ProxyServer = make_proxy(config_dir=str(root))
    old, new = proxy.state, fresh.state
    for part in ("server", "upstreams", "tenants", "passthrough", "key_index", "shared_keys",
                 "sources", "prices"):  # the store's key prefix is each test proxy's own
        assert getattr(old.config, part) == getattr(new.config, part), part
    assert old.metrics.prices == new.metrics.prices
    assert {n: c.spec for n, c in old.upstreams.items()} == \
        {n: c.spec for n, c in new.upstreams.items()}

    def series(p: ProxyServer) -> set[str]:
        return {line.rsplit(" ", 1)[0] for line in httpx.get(p.base + "/metrics").text
                .splitlines() if line.startswith("runloop_") and 'tenant="' in line}
    assert series(fresh) <= series(proxy), sorted(series(fresh) - series(proxy))[:5]


def _bump(path: Path) -> None:
    t = time.time() + 1
    os.utime(path, (t, t))


def test_sighup_reloads(tmp_path: Path, upstream: ScriptedUpstream, redis_url: str) -> None:
    root = write_config(tmp_path, upstream.url)
    env = {**os.environ, "RUNLOOP_REDIS_URL": redis_url}
    port = __import__("tests.conftest", fromlist=["free_port"]).free_port()
    proc = subprocess.Popen([sys.executable, "-m", "runloop_proxy.cli", "serve", "--config",
                             str(root), "--port", str(port), "--log-format", "json"],
                            env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}/healthz")
        (root / "tenants" / "acme.toml").write_text(
            f'keys = ["{ACME_KEY}"]\nupstream_key = "k3"\n[policy]\nmax_run_loops = 3')
        proc.send_signal(signal.SIGHUP)
        reloads = f"http://127.0.0.1:{port}/metrics"
        until(lambda: 'runloop_config_reloads_total{outcome="ok"} 1.0' in
              httpx.get(reloads).text, what="the SIGHUP reload")
        assert 'runloop_config_reloads_total{outcome="error"} 0.0' in httpx.get(reloads).text
        # the reloaded tenant answers with its new upstream key
        httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                   headers={"Authorization": f"Bearer {ACME_KEY}"},
                   json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert upstream.headers[-1]["authorization"] == "Bearer k3"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert '"reason": "SIGHUP"' in err or '"reason":"SIGHUP"' in err
    assert "config reload failed" not in err and ACME_KEY not in err


def _wait_http(url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered")


def test_tenant_may_forward_the_client_key(tmp_path: Path, make_proxy: Any,
                                           upstream: ScriptedUpstream) -> None:
    root = write_config(tmp_path, upstream.url)
    (root / "tenants" / "byok.toml").write_text(
        'keys = ["byok-proxy-key-0123456789"]\nforward_client_key = true')
    proxy: ProxyServer = make_proxy(config_dir=str(root))
    c = openai.OpenAI(base_url=proxy.url, api_key="byok-proxy-key-0123456789", max_retries=0)
    c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert upstream.headers[-1]["authorization"] == "Bearer byok-proxy-key-0123456789"


def test_proxy_tools_always_keeps_the_tool_list_stable_for_agents(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    root = write_config(tmp_path, upstream.url, acme_policy='proxy_tools = "always"')
    (root / "tenants" / "globex.toml").write_text(  # globex opts out: when_needed
        (root / "tenants" / "globex.toml").read_text()
        + '[policy]\nproxy_tools = "when_needed"\n')
    proxy: ProxyServer = make_proxy(config_dir=str(root))
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
    short = [{"role": "user", "content": "hi"}]
    acme = openai.OpenAI(base_url=proxy.url, api_key=ACME_KEY, max_retries=0)
    globex = openai.OpenAI(base_url=proxy.url, api_key=GLOBEX_KEY, max_retries=0)
    # nothing to compress, but an agent with tools: the proxy's tools ride along from the start
    r = acme.chat.completions.with_raw_response.create(
        model="m", messages=short, tools=tools)  # type: ignore[arg-type]
    names = [t["function"]["name"] for t in upstream.requests[-1]["tools"]]
    assert names == ["lookup", "recall_tool_call", "search_history"]
    assert upstream.requests[-1]["messages"] == short
    # the prompt as the proxy counts it: the forwarded one pays for the proxy's tools
    client, forwarded = map(int, r.headers["x-runloop-tokens"].split(";"))
    assert forwarded - client == definitions_tokens(
        proxy.state.tokens, proxy.state.tokens.encoding("m")[0])
    # no tools: nothing added, the body goes out as sent
    acme.chat.completions.create(model="m", messages=short)  # type: ignore[arg-type]
    assert "tools" not in upstream.requests[-1]
    # when_needed: an uncompressed agent request is passed through untouched
    r = globex.chat.completions.with_raw_response.create(
        model="m", messages=short, tools=tools)  # type: ignore[arg-type]
    assert [t["function"]["name"] for t in upstream.requests[-1]["tools"]] == ["lookup"]
    client, forwarded = map(int, r.headers["x-runloop-tokens"].split(";"))
    assert client == forwarded > 0


def test_what_one_tenants_upstream_reports_moves_no_other_tenants_counts(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Finding (red team): the token counter's calibration (a model without its own
    encoding, corrected by what the upstream reports) was one factor per model name for the
    whole process: 12 of acme's requests whose upstream reported ten times the proxy's count
    doubled globex's count_tokens (and halved its working budget). The class: what is
    learned from a caller's upstream answers is that caller's (``Caller.scope``)."""
    proxy: ProxyServer = make_proxy(config_dir=str(write_config(tmp_path, upstream.url)))
    model = "claude-sonnet-4-6"  # counted with a fallback encoding: calibrated
    body = {"model": model, "messages": [{"role": "user", "content": "how many? " * 50}]}

    def count(key: str) -> int:
        r = httpx.post(proxy.url + "/messages/count_tokens", json=body,
                       headers={"x-api-key": key})
        assert r.status_code == 200, r.text
        return int(r.json()["input_tokens"])

    globex_before, acme_before = count(GLOBEX_KEY), count(ACME_KEY)
    acme = openai.OpenAI(base_url=proxy.url, api_key=ACME_KEY, max_retries=0)
    for _ in range(12):
        upstream.push({"content": "ok", "prompt_tokens": 10 * acme_before})
        acme.chat.completions.create(model=model, messages=body["messages"])  # type: ignore[arg-type]
    assert count(ACME_KEY) > 1.5 * acme_before  # acme's own counts learned its upstream
    assert count(GLOBEX_KEY) == globex_before


def test_compact_now_calls_the_summary_model_with_the_tenants_own_key(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Finding (red team): "compact now" sent a tenant's conversation to the summary model
    under the upstream's shared key, not the tenant's own ``upstream_key`` its requests go
    with (another organisation's account, billing and data terms). One rule gives the key
    a tenant's upstream is called with (``ProxyConfig.upstream_secret``), for its requests
    and for what the proxy sends on its behalf."""
    root = write_config(tmp_path, upstream.url, acme_policy='summary_model = "m-sum"\n'
                                                          'max_run_loops = 1')
    proxy: ProxyServer = make_proxy(config_dir=str(root))
    acme = openai.OpenAI(base_url=proxy.url, api_key=ACME_KEY, max_retries=0,
                         default_headers={"X-Session-Id": "to-compact"})
    msgs: list[Any] = []
    for k in range(3):
        msgs.append({"role": "user", "content": f"question {k}"})
        reply = acme.chat.completions.create(model="m", messages=msgs)
        msgs.append({"role": "assistant", "content": reply.choices[0].message.content})
    proxy.settle()
    upstream.headers.clear()
    r = httpx.post(proxy.base + "/admin/sessions/to-compact/compact",
                   params={"tenant": "acme"},
                   headers={"Authorization": "Bearer admin-0123456789abcdef"})
    assert r.status_code == 200, r.text
    calls = [h["authorization"] for h in upstream.headers]
    assert calls and set(calls) == {"Bearer sk-acme-upstream"}, calls


def test_a_mistake_is_blamed_on_the_file_it_is_in_with_every_other_one(tmp_path: Path) -> None:
    """Found by a newcomer: a mistake in ``[defaults.policy]`` was blamed on a tenant file
    (the defaults were checked only once merged into it), only the first mistake was told,
    and a misspelled field was "Extra inputs are not permitted". The defaults are checked
    where they are written, every mistake of a file is told, and a misspelled field is
    named with the field it is likely to be."""
    root = write_config(tmp_path, "http://up/v1")
    text = (root / "runloop.toml").read_text()
    (root / "runloop.toml").write_text(text.replace(
        "max_run_loops = 7", 'max_run_loops = 7\nthreshold = "high"\nclear_at_leest = 6000'))
    with pytest.raises(ConfigError) as err:
        load_config(Settings(config_dir=str(root)))
    lines = str(err.value).splitlines()
    assert [line.split(": ")[:2] for line in lines] == [
        [str(root / "runloop.toml"), "defaults.policy.threshold"],
        [str(root / "runloop.toml"), "defaults.policy.clear_at_leest"]]
    assert lines[1].endswith("unknown field (did you mean 'clear_at_least'?)")
    (root / "runloop.toml").write_text(text)
    (root / "tenants" / "acme.toml").write_text(
        (root / "tenants" / "acme.toml").read_text() + "keep_recent_tool_result = 2\n")
    with pytest.raises(ConfigError, match=r"acme.toml: policy.keep_recent_tool_result: unknown "
                                          r"field \(did you mean 'keep_recent_tool_results'\?\)"):
        load_config(Settings(config_dir=str(root)))


def test_every_file_the_config_reads_is_watched_for_a_reload(tmp_path: Path) -> None:
    """A reload is picked up from every file the config is made of: whatever ``load_config``
    reads (its ``sources``) is among what the watcher looks at (planted: the price table left
    out of the watch, so an operator's new prices never applied until a restart)."""
    from runloop_proxy.config import PRICES_FILE, config_mtimes

    root = write_config(tmp_path, "http://up/v1")
    (root / PRICES_FILE).write_text('[openai.models."house"]\ninput = 1.0\n')
    config = load_config(Settings(config_dir=str(root)))
    watched = {path for path, _ in config_mtimes(str(root))}
    assert len(config.sources) == 4  # runloop.toml, two tenants, the prices
    assert {str(p) for p in config.sources} <= watched, (config.sources, watched)


@pytest.mark.parametrize("suffix", ["", "-2024-08-06", "-20250929", "-latest"])
def test_a_dated_snapshot_takes_its_own_familys_window_and_price(suffix: str) -> None:
    """Providers name a model's snapshots by a date (``gpt-4o-2024-08-06``,
    ``claude-sonnet-4-5-20250929``): for every family the built-in windows and the price
    table list, a snapshot of it gets that family's window and price — also where another
    family's name is a prefix of it (``gpt-4`` of ``gpt-4-turbo``, ``claude-sonnet-4`` of
    ``claude-sonnet-4-5``). Planted, passed every other test: the shortest matching family
    taken (a dated gpt-4-turbo got gpt-4's 8,192-token window)."""
    from runloop_proxy.config import BUILTIN_CONTEXT_WINDOWS, TenantSpec
    from runloop_proxy.pricing import PriceTable

    tenant = TenantSpec(name="t", default_context_window=1234)
    for family, window in BUILTIN_CONTEXT_WINDOWS.items():
        assert tenant.context_window(family + suffix) == window, family + suffix
    for provider in PriceTable.load().providers.values():
        for family, price in provider.models.items():
            assert provider.price(family + suffix) == price, (provider.name, family + suffix)
    # a name only extending a family's is no snapshot of it
    assert tenant.context_window("gpt-4o" + suffix.replace("-", "x")) == \
        (128_000 if not suffix else 1234)


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("word", ["test", "changeme", "password", "", "YOUR_KEY"])
@pytest.mark.parametrize("where", ["tenant", "admin"])
def test_the_hash_of_a_word_anyone_can_guess_is_refused_where_it_is_read(
        tmp_path: Path, word: str, where: str) -> None:
    """Bug class: a config that accepts a key anyone can guess (the examples shipped the hash
    of "test"). Planted: the check on tenants' keys only (the admin rows red), the digest
    compared as written, not lowercased (the upper-case hashes here went through: every row
    red)."""
    root = write_config(tmp_path, "http://127.0.0.1:9/v1")
    digest = hashlib.sha256(word.encode()).hexdigest()
    if where == "tenant":
        (root / "tenants" / "globex.toml").write_text(
            f'name = "globex"\nkeys = ["sha256:{digest.upper()}"]\n')
        field = "keys[0]"
    else:
        text = (root / "runloop.toml").read_text()
        (root / "runloop.toml").write_text(text.replace(
            'admin_key = "admin-0123456789abcdef"', f'admin_key = "sha256:{digest.upper()}"'))
        field = "server.admin_key"
    with pytest.raises(ConfigError) as caught:
        load_config(Settings(config_dir=str(root)))
    assert caught.value.field == field, str(caught.value)
    assert f"the hash of {word!r}, a key anyone can guess" in str(caught.value)
    assert "runloop-proxy init" in str(caught.value)


def test_a_made_key_s_hash_loads_for_tenants_and_the_admin(tmp_path: Path) -> None:
    root = write_config(tmp_path, "http://127.0.0.1:9/v1")
    admin = hashlib.sha256(b"rla-Qm9vW2x5c2VjcmV0LWFkbWluLWtleS0xMjM0NTY3OA").hexdigest()
    text = (root / "runloop.toml").read_text()
    (root / "runloop.toml").write_text(text.replace('admin_key = "admin-0123456789abcdef"',
                                                    f'admin_key = "sha256:{admin}"'))
    config = load_config(Settings(config_dir=str(root)))
    assert config.server.admin_key == f"sha256:{admin}"
    assert hashlib.sha256(GLOBEX_KEY.encode()).hexdigest() in config.key_index


def test_no_shipped_config_holds_a_guessable_key_hash() -> None:
    """Every sha256: in the example configs and the deploy files (a user copies them)."""
    import re

    from runloop_proxy.config import guessable

    found = []
    for path in [*(ROOT / "config").rglob("*.toml"), *(ROOT / "deploy").rglob("*")]:
        if path.is_file():
            for digest in re.findall(r"sha256:([0-9a-fA-F]{64})", path.read_text(errors="replace")):
                found.append((path.name, digest, guessable(digest)))
    assert [f for f in found if f[2] is not None] == []


@pytest.mark.parametrize(("url", "hinted"), [
    ("http://127.0.0.1:11434", True), ("https://api.openai.com/", True),
    ("https://api.openai.com/v1", False), ("http://localhost:8000/v1/", False),
    ("https://my-res.openai.azure.com/openai", False),
    ("https://gw.example.net/proxy/v1", False),
])
def test_an_upstream_url_without_a_path_gets_the_v1_hint(tmp_path: Path, url: str,
                                                          hinted: bool) -> None:
    from runloop_proxy.config import url_hints

    config = load_config(Settings(upstream=url))
    hints = url_hints(config)
    if hinted:
        assert hints == [f"upstream 'default': {url.rstrip('/')} has no /v1 — OpenAI-compatible "
                         f"servers (and Anthropic's API) answer under /v1: did you mean "
                         f"{url.rstrip('/')}/v1?"]
    else:
        assert hints == []
    out = subprocess.run([sys.executable, "-m", "runloop_proxy", "check-config",
                          str(write_config(tmp_path, url))], capture_output=True, text=True,
                         timeout=120, env={**os.environ})
    assert out.returncode == 0 and ("hint: upstream 'main'" in out.stderr) == hinted, out.stderr
