"""Observability: a real Prometheus scrapes a real proxy under traffic; every dashboard panel
and alert expression is evaluated against it. Plus the deploy files' own checks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from runloop_proxy.ops.metrics import MAX_MODEL_LABELS, Metrics
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer, free_port
from .test_tools import CLIENT_TOOLS, long_session, recalling_responder

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
BILL = "runloop_prompt_bill_usd_total"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "runloop-proxy.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"


def dashboard_exprs() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] if p["type"] != "row"
            for t in p["targets"]]


def alert_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [(r["alert"], r["expr"]) for g in rules["groups"] for r in g["rules"]]


def concrete(expr: str) -> str:
    return expr.replace("$__rate_interval", "1m").replace("$__range", "10m") \
        .replace('"$tenant"', '".*"')


def drive_traffic(proxy: ProxyServer, upstream: ScriptedUpstream) -> int:
    """One wave of known traffic: 5 requests answered 200 (one streamed, one compressed with a
    recall answered by the proxy), one 500. Returns the prompt tokens the window saved."""
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-metrics", max_retries=0)
    for i in range(3):
        c.chat.completions.create(model="gpt-4o-mini",
                                  messages=[{"role": "user", "content": f"hello {i}"}])
    for _chunk in c.chat.completions.create(model="gpt-4o-mini", stream=True,
                                           messages=[{"role": "user", "content": "stream"}]):
        pass
    upstream.responder = recalling_responder()
    r = c.chat.completions.with_raw_response.create(model="gpt-4o-mini",
                                                    messages=long_session(),  # type: ignore[arg-type]
                                                    tools=CLIENT_TOOLS)  # type: ignore[arg-type]
    client, forwarded = map(int, r.headers["x-runloop-tokens"].split(";"))
    upstream.responder = None
    upstream.push(*[{"status": 500}] * 3)
    with pytest.raises(openai.InternalServerError):
        c.chat.completions.create(model="gpt-4o-mini",
                                  messages=[{"role": "user", "content": "fail"}])
    assert client > forwarded
    return client - forwarded


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="no prometheus binary (apt-get install prometheus)")
def test_every_panel_and_alert_evaluates_against_a_live_proxy(
        proxy: ProxyServer, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": "runloop-proxy",
                            "static_configs": [{"targets": [f"127.0.0.1:{proxy.port}"]}]}]}))
    prom = subprocess.Popen(["prometheus", f"--config.file={cfg}",
                             f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    api = f"http://127.0.0.1:{port}/api/v1"

    def value(query: str) -> float:
        result = httpx.get(f"{api}/query", params={"query": query}, timeout=10
                           ).json()["data"]["result"]
        if not result:
            raise IndexError(f"{query}: no result yet")  # _wait retries, an assert does not
        assert len(result) == 1, f"{query}: {result}"
        return float(result[0]["value"][1])

    try:
        _wait(lambda: httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=1)
              .status_code == 200)
        # before any traffic, every series the panels read already exists (at 0)
        _wait(lambda: value('sum(runloop_requests_total{status="500"})') == 0)
        assert value('sum(runloop_degraded_requests_total{reason="store"})') == 0
        # idle: the shares say "no data", not 100% (1 - 0 / a clamped 0): once a rate exists
        _wait(lambda: value("sum(rate(runloop_prompt_tokens_client_total[1m]))") == 0)
        _wait(lambda: value(f"sum(increase({BILL}[10m]))") == 0)
        idle = dict(dashboard_exprs())
        for title in ("Savings", "Bill saved", "Prompt tokens saved (secondary)"):
            r = httpx.get(f"{api}/query", params={"query": concrete(idle[title])}).json()
            assert r["status"] == "success" and r["data"]["result"] == [], (title, r)
        # traffic in two waves, so rates over the last minute see changes between scrapes
        saved = drive_traffic(proxy, upstream)
        time.sleep(2.5)
        saved += drive_traffic(proxy, upstream)
        _wait(lambda: value('sum(runloop_requests_total{status="500"})') == 2, timeout=20)
        time.sleep(2.5)
        # the counters say what was sent
        assert value('sum(runloop_requests_total{status="200"})') == 10
        assert value('sum(runloop_requests_total{stream="true"})') == 2
        assert value("sum(runloop_prompt_tokens_saved_total)") == saved
        assert value("sum(runloop_prompt_tokens_client_total) - "
                     "sum(runloop_prompt_tokens_forwarded_total)") == saved
        assert value('sum(runloop_recalls_total{tool="recall_tool_call",outcome="hit"})') == 2
        assert value("min(runloop_store_up)") == 1
        failures = []
        for title, expr in [*dashboard_exprs(), *alert_exprs()]:
            r = httpx.get(f"{api}/query", params={"query": concrete(expr)}, timeout=10)
            body = r.json()
            if body.get("status") != "success":
                failures.append(f"{title}: does not parse: {body.get('error')}")
            elif (title, expr) in dashboard_exprs() and not body["data"]["result"]:
                failures.append(f"{title}: no data for {expr}")
        assert not failures, "\n".join(failures)
        by_title = dict(dashboard_exprs())
        error_rate = value(concrete(by_title["Error rate"]))
        assert 0 < error_rate < 1, error_rate
        assert 0 < value(concrete(by_title["Savings"])) < 1
        rules = httpx.get(f"{api}/rules").json()["data"]["groups"][0]["rules"]
        assert {r["name"] for r in rules} == {a for a, _ in alert_exprs()}
        assert all(r["health"] == "ok" for r in rules), rules
    finally:
        prom.terminate()
        prom.wait(timeout=10)


def _scraped(api: str) -> bool:
    r = httpx.get(f"{api}/query", params={
        "query": 'sum(runloop_requests_total{status="500"})'}, timeout=5).json()
    return bool(r["data"]["result"]) and float(r["data"]["result"][0]["value"][1]) >= 2


def _wait(cond: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except (httpx.HTTPError, KeyError, IndexError) as exc:
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"condition not met in {timeout}s ({last!r})")


def test_saved_tokens_are_what_the_window_removed(proxy: ProxyServer,
                                                  upstream: ScriptedUpstream) -> None:
    """On /metrics (no Prometheus needed): saved = client - forwarded, as the response's
    X-Runloop-Tokens header reports them, summed over requests."""
    upstream.responder = lambda body: {"content": "ok"}
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-saving", max_retries=0)
    saved = 0
    for _ in range(2):
        r = c.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=long_session(), tools=CLIENT_TOOLS)  # type: ignore[arg-type]
        client, forwarded = map(int, r.headers["x-runloop-tokens"].split(";"))
        saved += client - forwarded
    assert saved > 1000
    text = httpx.get(proxy.base + "/metrics").text

    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{"))

    assert total("runloop_prompt_tokens_saved_total") == saved
    assert total("runloop_prompt_tokens_client_total") - \
        total("runloop_prompt_tokens_forwarded_total") == saved


def test_metrics_never_carry_keys_or_prompts(proxy: ProxyServer,
                                             upstream: ScriptedUpstream) -> None:
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-secret-key-in-test", max_retries=0)
    c.chat.completions.create(model="gpt-4o-mini", messages=[
        {"role": "user", "content": "very private prompt text"}],
        extra_headers={"X-Session-Id": "session-name-private"})
    text = httpx.get(proxy.base + "/metrics").text
    for secret in ("sk-secret-key-in-test", "very private", "session-name-private"):
        assert secret not in text
    assert 'tenant="passthrough"' in text


def test_model_label_cardinality_is_bounded_per_tenant() -> None:
    """Model names are the clients' to choose: a tenant's junk names fill its own labels
    (bounded), never another tenant's, whose real model keeps its label."""
    m = Metrics()
    labels = {m.model_label("acme", f"model-{i}") for i in range(200)}
    assert len(labels) <= MAX_MODEL_LABELS + 1 and "other" in labels
    assert m.model_label("globex", "gpt-4o") == "gpt-4o"
    assert m.model_label("acme", "gpt-4o") == "other"


def test_dashboard_file_is_generated_from_its_source() -> None:
    out = subprocess.run([sys.executable, "-c",
                          "import json,sys; sys.path.insert(0, 'deploy'); "
                          "import make_dashboard as m; print(json.dumps(m.build()))"],
                         capture_output=True, text=True, cwd=DEPLOY.parent, check=True)
    assert json.loads(out.stdout) == json.loads(DASHBOARD.read_text()), \
        "run python deploy/make_dashboard.py"


def test_grafana_provisioning_points_at_the_dashboard() -> None:
    prov = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/runloop.yml").read_text())
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    path = prov["providers"][0]["options"]["path"]
    assert any(m.endswith(":" + path + ":ro") for m in mounts)
    assert set(compose["services"]) == {"proxy", "redis", "prometheus", "grafana"}
    assert "--appendonly" in compose["services"]["redis"]["command"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool")
def test_alert_rules_pass_promtool() -> None:
    out = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_kubernetes_manifests_validate() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    files = sorted((DEPLOY / "k8s").glob("*.yaml"))
    assert {f.name for f in files} >= {"deployment.yaml", "service.yaml", "hpa.yaml",
                                       "configmap.yaml", "redis.yaml"}
    kinds = set()
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            if doc.get("kind") == "Kustomization":
                continue
            kv.validate(doc, "1.30.0", strict=True)
            kinds.add(doc["kind"])
    assert kinds >= {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap",
                     "Secret", "StatefulSet"}
    deployment = yaml.safe_load((DEPLOY / "k8s/deployment.yaml").read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["envFrom"][0]["secretRef"]["name"] == "runloop-secrets"


def test_several_workers_add_up_their_metrics(upstream: ScriptedUpstream, redis_url: str,
                                              tmp_path: Path) -> None:
    port = free_port()
    mp = tmp_path / "prom-mp"
    mp.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp), "RUNLOOP_REDIS_URL": redis_url}
    proc = subprocess.Popen([sys.executable, "-m", "runloop_proxy.cli", "serve", "--upstream",
                             upstream.url, "--port", str(port), "--workers", "2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        # ready when serve says so (it asked its own /healthz), however long two workers take
        # to start on a loaded machine: no fixed wait (30 s was too short under load)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        while line and "is ready at" not in line:
            line = proc.stdout.readline()
        assert line, "serve ended before it was ready"
        with httpx.Client(timeout=10) as http:  # new connections: both workers get some
            for i in range(12):
                http.post(base + "/v1/chat/completions", headers={"Connection": "close"},
                          json={"model": "m", "messages": [{"role": "user", "content": f"{i}"}]})
        text = httpx.get(base + "/metrics").text
        served = sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                     if ln.startswith("runloop_requests_total{") and 'status="200"' in ln)
        assert served == 12.0
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)


def test_upstream_usage_is_priced_as_the_provider_bills_it(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """runloop_upstream_cost_usd_total: the upstream's reported usage, cached tokens at the
    cached price, from the built-in table and an operator's prices.toml over it."""
    upstream.responder = lambda body: {"content": "x" * 400, "prompt_tokens": 1_000_000,
                                       "cached_tokens": 400_000}
    (tmp_path / "runloop.toml").write_text(f'[upstreams.default]\nurl = "{upstream.url}"\n')
    (tmp_path / "prices.toml").write_text(
        '[openai.models."gpt-4o-mini"]\ncached_input = 0.05\n'  # one field changed
        '[openai.models."house-model"]\ninput = 1.0\ncached_input = 0.1\noutput = 2.0\n')
    proxy = make_proxy(config_dir=str(tmp_path))
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-cost", max_retries=0)
    for model in ("gpt-4o-mini", "house-model", "unpriced-model"):
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    text = httpx.get(proxy.base + "/metrics").text

    def cost(model: str, kind: str) -> float:
        want = f'runloop_upstream_cost_usd_total{{kind="{kind}",model="{model}",'
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(want))
    # gpt-4o-mini: 600k afresh at $0.15, 400k cached at the operator's $0.05, 100 out at $0.60
    assert cost("gpt-4o-mini", "input") == pytest.approx(0.09)
    assert cost("gpt-4o-mini", "cached_input") == pytest.approx(0.02)
    assert cost("gpt-4o-mini", "output") == pytest.approx(100 * 0.6 / 1e6)
    assert cost("gpt-4o-mini", "cache_write") == 0
    assert cost("house-model", "input") == pytest.approx(0.6)
    assert cost("house-model", "cached_input") == pytest.approx(0.04)
    assert not any(line.startswith("runloop_upstream_cost_usd_total")
                   and 'model="unpriced-model"' in line and not line.endswith(" 0.0")
                   for line in text.splitlines())


def _first_tokens(proxy: ProxyServer) -> float:
    text = httpx.get(proxy.base + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("runloop_time_to_first_token_seconds_count{"))


@pytest.mark.parametrize("tools", [False, True], ids=["relayed", "through the proxy's rounds"])
def test_a_stream_records_its_time_to_first_token_once(
        proxy: ProxyServer, upstream: ScriptedUpstream, tools: bool) -> None:
    """A streamed answer's first byte is timed, whether it is relayed as it came or comes
    through the proxy's tool rounds (the proxy's tools went out with it), once a stream."""
    client = openai.OpenAI(base_url=proxy.url, api_key="k", max_retries=0)
    before = _first_tokens(proxy)
    extra: dict[str, Any] = {"tools": CLIENT_TOOLS} if tools else {}
    stream = client.chat.completions.create(
        model="gpt-4o", stream=True, messages=[{"role": "user", "content": "hi"}], **extra)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    if tools:
        assert any(t["function"]["name"] == "search_history"
                   for t in upstream.requests[-1].get("tools") or [])
    assert _first_tokens(proxy) == before + 1


# How each API reports a prompt's usage, told here from the APIs' documentation (not from
# the proxy's reading of it): (the whole prompt, what its cache served, what was written to
# the cache, the completion)
def _usage_as_billed(api: str, usage: dict[str, Any]) -> tuple[int, int, int, int]:
    if api == "chat":  # prompt_tokens hold the cached ones
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return usage["prompt_tokens"], cached, 0, usage["completion_tokens"]
    if api == "responses":  # input_tokens hold the cached ones
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
        return usage["input_tokens"], cached, 0, usage["output_tokens"]
    # Anthropic's input_tokens leave out what the cache read and what it wrote
    read = usage.get("cache_read_input_tokens") or 0
    written = usage.get("cache_creation_input_tokens") or 0
    return usage["input_tokens"] + read + written, read, written, usage["output_tokens"]


def _answer_usage(proxy: ProxyServer, api: str, stream: bool, model: str,
                  text: str) -> dict[str, Any]:
    """One request of ``api`` through the proxy, and the usage its client was shown."""
    import anthropic

    if api == "messages":
        mc = anthropic.Anthropic(base_url=proxy.base, api_key="sk-usage", max_retries=0)
        kw: dict[str, Any] = {"model": model, "max_tokens": 50, "messages": [
            {"role": "user", "content": [{"type": "text", "text": text,
                                          "cache_control": {"type": "ephemeral"}}]}]}
        if stream:
            with mc.messages.stream(**kw) as s:
                return s.get_final_message().usage.model_dump()
        return mc.messages.create(**kw).usage.model_dump()
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-usage", max_retries=0)
    if api == "responses":
        if stream:
            done = [e for e in c.responses.create(model=model, input=text, stream=True)
                    if e.type == "response.completed"]
            return done[0].response.usage.model_dump()  # type: ignore[union-attr]
        return c.responses.create(model=model, input=text).usage.model_dump()  # type: ignore[union-attr]
    messages: Any = [{"role": "user", "content": text}]
    if stream:
        chunks = list(c.chat.completions.create(model=model, messages=messages, stream=True,
                                                stream_options={"include_usage": True}))
        return chunks[-1].usage.model_dump()  # type: ignore[union-attr]
    return c.chat.completions.create(model=model, messages=messages).usage.model_dump()  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_every_apis_usage_is_counted_and_priced_as_that_api_bills_it(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream, stream: bool) -> None:
    """Every API reports usage its own way — chat's prompt_tokens and the Responses API's
    input_tokens hold what the cache served, Anthropic's input_tokens leave out what its
    cache read and wrote, and the completion is completion_tokens or output_tokens. Over
    every API, JSON and streamed, each request moves runloop_upstream_usage_tokens_total
    (prompt, cached_prompt, completion) and runloop_upstream_cost_usd_total (input,
    cached_input, cache_write, output) by exactly what the usage its client was shown says,
    read by each API's documented rule, with cached tokens served in each. Planted, each
    passed every other test (they priced chat only): the completion read from
    completion_tokens alone (zero for the Responses and Messages APIs); the Responses API's
    cached tokens priced at the full input price."""
    upstream.responder = lambda body: {"content": "x" * 400, "prompt_tokens": 1_800,
                                       "cached_tokens": 1_024}
    (tmp_path / "runloop.toml").write_text(f'[upstreams.default]\nurl = "{upstream.url}"\n')
    (tmp_path / "prices.toml").write_text(
        '[openai.models."house-gpt"]\ninput = 2.0\ncached_input = 0.5\noutput = 8.0\n'
        '[anthropic.models."house-claude"]\ninput = 3.0\ncached_input = 0.3\n'
        'cache_write = 3.75\noutput = 15.0\n')
    proxy = make_proxy(config_dir=str(tmp_path))
    prices = {"house-gpt": (2.0, 0.5, 2.0, 8.0), "house-claude": (3.0, 0.3, 3.75, 15.0)}
    # past Anthropic's 1,024 cached tokens, and new to the upstream's cache: first written
    text = f"{uuid.uuid4()} " + "a long and stable prompt " * 300
    seen = {"cached": 0, "written": 0, "completion": 0}
    for api, model in (("chat", "house-gpt"), ("responses", "house-gpt"),
                       ("messages", "house-claude")):
        for _ in range(2):  # the second of Anthropic's reads what the first wrote
            before = {kind: metric_sum(proxy, "runloop_upstream_usage_tokens_total",
                                       model=model, kind=kind)
                      for kind in ("prompt", "cached_prompt", "completion")}
            cost_before = {kind: metric_sum(proxy, "runloop_upstream_cost_usd_total",
                                            model=model, kind=kind)
                           for kind in ("input", "cached_input", "cache_write", "output")}
            usage = _answer_usage(proxy, api, stream, model, text)
            prompt, cached, written, completion = _usage_as_billed(api, usage)
            assert prompt > 0 and completion > 0, (api, usage)
            moved = {kind: metric_sum(proxy, "runloop_upstream_usage_tokens_total",
                                      model=model, kind=kind) - before[kind]
                     for kind in before}
            assert moved == {"prompt": prompt, "cached_prompt": cached,
                             "completion": completion}, (api, usage)
            p_in, p_cached, p_write, p_out = prices[model]
            want = {"input": (prompt - cached - written) * p_in,
                    "cached_input": cached * p_cached, "cache_write": written * p_write,
                    "output": completion * p_out}
            for kind, usd in want.items():
                got = metric_sum(proxy, "runloop_upstream_cost_usd_total", model=model,
                                 kind=kind) - cost_before[kind]
                assert got * 1e6 == pytest.approx(usd), (api, kind, usage)
            seen["cached"] += cached
            seen["written"] += written
            seen["completion"] += completion
    assert all(seen.values()), seen  # each way a prompt is billed was exercised


def metric_sum(proxy: ProxyServer, name: str, **labels: str) -> float:
    """The sum of a metric's series whose labels include ``labels``."""
    total = 0.0
    for line in httpx.get(proxy.base + "/metrics").text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _samples(text: str, name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith((name + "{", name + " ")) and all(w in ln for w in want))


def test_requests_refused_as_invalid_are_counted_and_logged(
        make_proxy: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Bug class: a refused request that leaves no trace (the error rate read 0 with 59 400s
    behind it). Planted: finish returning early again for a request never identified (every
    count red), the tenant not noted before the body is read (the tenant's label red)."""
    proxy = make_proxy()
    key = {"Authorization": "Bearer sk-invalid-4093" + "x" * 40}
    bad = [("/v1/chat/completions", b"{not json"), ("/v1/chat/completions", b'{"messages": []}'),
           ("/v1/responses", b'{"input": "no model"}'),
           ("/v1/messages", b'{"model": "claude-sonnet-4-5", "max_tokens": 5}')]
    with caplog.at_level("INFO", logger="runloop.request"), httpx.Client(base_url=proxy.base) as c:
        statuses = [c.post(path, content=body, headers={**key, "Content-Type":
                                                        "application/json"}).status_code
                    for path, body in bad]
    assert statuses == [400, 400, 400, 400]
    text = httpx.get(proxy.base + "/metrics").text
    assert _samples(text, "runloop_requests_total", status="400") == 4
    assert _samples(text, "runloop_requests_total", status="400", api="chat") == 2
    assert _samples(text, "runloop_requests_total", status="400", model="other") == 4
    tenants = {ln.split('tenant="')[1].split('"')[0] for ln in text.splitlines()
               if ln.startswith("runloop_requests_total{") and 'status="400"' in ln}
    assert len(tenants) == 1 and tenants != {"unauthenticated"}, tenants
    logged = [r for r in caplog.records if getattr(r, "status", None) == 400]
    assert len(logged) == 4 and all(getattr(r, "error", None) for r in logged)


def test_the_in_flight_gauge_does_not_count_the_scrape_reading_it(make_proxy: Any) -> None:
    """Planted: the probes counted again (red: the scrape read 1)."""
    proxy = make_proxy()
    for _ in range(3):
        text = httpx.get(proxy.base + "/metrics").text
        assert _samples(text, "runloop_in_flight_requests") == 0, text


def test_the_dashboard_s_bill_saved_is_the_inspector_s_for_the_same_session(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """The headline's counters add up to what ``savings`` makes of the session's stored points
    (the inspector's figure), to the cent's millionth. Bug class: the live figure priced
    apart from the stored one. Planted: a session's chains not kept between its requests
    (each billed as a new chain: red), the forwarded side billed with the client's tokens
    (red)."""
    from runloop_proxy import savings
    from runloop_proxy.ops.demo import TOOLS, sample_conversation
    from runloop_proxy.pricing import PriceTable

    admin = "admin-" + "5e3a" * 8
    proxy = make_proxy(admin_key=admin, summary_model="extractive")
    conversation = sample_conversation(4)
    answers = iter([m for m in conversation if m.get("role") == "assistant"])

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        m = next(answers, {"content": "done"})
        return {"content": m.get("content"), "tool_calls": [
            {"id": c["id"], "name": c["function"]["name"],
             "arguments": c["function"]["arguments"]} for c in m.get("tool_calls") or []]}
    upstream.responder = respond
    sid = "support-demo-2026-12-02"
    with httpx.Client(base_url=proxy.base, timeout=60, headers={
            "Authorization": "Bearer sk-proj-bill" + "q" * 40, "X-Session-Id": sid}) as c:
        for i, m in enumerate(conversation):
            if m.get("role") == "assistant":
                r = c.post("/v1/chat/completions", json={
                    "model": "gpt-4o-mini", "messages": conversation[:i], "tools": TOOLS})
                assert r.status_code == 200, r.text
    proxy.settle()
    view = httpx.get(f"{proxy.base}/admin/sessions/{sid}", params={"points": "1"},
                     headers={"Authorization": f"Bearer {admin}"}).json()
    stored = savings.of_points(view["points"], PriceTable.load())
    assert stored.requests == 12 and stored.bill_saved is not None and stored.bill_saved > 0.3
    text = httpx.get(proxy.base + "/metrics").text
    live = (_samples(text, BILL, side="client"), _samples(text, BILL, side="forwarded"))
    assert live == (pytest.approx(stored.client_usd, rel=1e-9),
                    pytest.approx(stored.forwarded_usd, rel=1e-9))
