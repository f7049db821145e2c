"""Rolling summaries through real servers: made in the background ahead of the omission event,
shown inside the marker from that event on, stored per session in Redis, one call across
replicas, failures counted and backed off, and never a wait on the request path."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from runloop_proxy.config import Policy
from runloop_proxy.scripted import ScriptedUpstream
from runloop_proxy.window.builder import batch_omission
from runloop_proxy.window.digest import VERSION as EXTRACTIVE

from .conftest import ProxyServer, RedisServer, serve_command, until
from .test_config import ACME_KEY, write_config

ADMIN = {"Authorization": "Bearer admin-0123456789abcdef"}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"order": {"type": "string"}}}}}]
POLICY = 'max_run_loops = 4\nomit_batch = 2\nsummary_model = "{model}"\n' \
         'summary_timeout_s = {timeout}\nsummary_backoff_s = 60\n'


@pytest.fixture(autouse=True)
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-up")
    monkeypatch.setenv("TEST_ACME_KEY", ACME_KEY)


def config(tmp_path: Path, upstream: ScriptedUpstream, model: str = "extractive",
           timeout: float = 30, extra: str = "") -> str:
    root = write_config(tmp_path / "cfg", upstream.url,
                        acme_policy=POLICY.format(model=model, timeout=timeout) + extra)
    return str(root)


def is_summary_call(body: dict[str, Any]) -> bool:
    return "running summary of an agent conversation" in str(body.get("messages"))


def model(summary: Any = None) -> Any:
    """A fake model: looks an order up once per question, then answers; summary calls are
    answered by ``summary`` (the prompt's request) when given."""
    def respond(body: dict[str, Any]) -> dict[str, Any]:
        if is_summary_call(body):
            return summary(body) if summary else {"content": "SUMMARY"}
        last = body["messages"][-1]
        if last["role"] == "user":
            k = last["content"].split()[-1]
            return {"tool_calls": [{"id": f"call_{k}", "name": "lookup",
                                    "arguments": {"order": f"#W{k}000"}}]}
        return {"content": f"order {last['content'][:9]} is on its way"}
    return respond


def converse(proxy: ProxyServer, session: str, turns: int,
             after: Any = None, edit: Any = None) -> list[dict[str, Any]]:
    c = openai.OpenAI(base_url=proxy.url, api_key=ACME_KEY, max_retries=0,
                      default_headers={"X-Session-Id": session})
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You track orders."}]
    for k in range(1, turns + 1):
        msgs.append({"role": "user", "content": f"where is order {k}"})
        while True:
            r = c.chat.completions.create(model="gpt-4o-mini", messages=msgs,  # type: ignore[arg-type]
                                          tools=TOOLS)  # type: ignore[arg-type]
            m = r.choices[0].message
            msgs.append(m.model_dump(exclude_none=True))
            if not m.tool_calls:
                if edit is not None:
                    msgs[-1] = edit(msgs[-1])
                break
            for call in m.tool_calls:
                msgs.append({"role": "tool", "tool_call_id": call.id,
                             "content": f"#W{k}000 shipped via carrier-{k}7 " + "x " * 200})
        if after is not None:
            after(k)
    return msgs


def marker(body: dict[str, Any]) -> str | None:
    """The omission marker and, after it, the summary the window shows (None: no marker)."""
    texts = [str(m.get("content")) for m in body["messages"]]
    shown = [t for t in texts if "Earlier turns are not shown" in t
             or t.startswith("[runloop-proxy] Summary of the turns not shown")]
    return "\n".join(shown) or None


def test_an_extractive_summary_enters_at_the_omission_event_and_stays_put(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    upstream.responder = model()
    proxy = make_proxy(config_dir=config(tmp_path, upstream))
    converse(proxy, "sum-1", 9, after=lambda k: proxy.settle())
    asked = [b for b in upstream.requests if not is_summary_call(b)]
    markers = [marker(b) for b in asked]
    first = next(i for i, m in enumerate(markers) if m)
    # from the first omission on, a summary of the loops left out, with their identifiers
    text = markers[first]
    assert text is not None and "Summary of the turns not shown" in text
    assert "#W1000" in text and "carrier-17" in text and "where is order 1" in text
    # between events the marker is the same text: the cached prefix holds
    changes = sum(1 for a, b in zip(markers[first:], markers[first + 1:], strict=False)
                  if a != b)
    omitted = {b["messages"][2]["content"] for b in asked[first:] if marker(b)}
    assert changes <= len(omitted)
    # stored in Redis per session, keyed by what it covers; shown by the admin API
    view = httpx.get(proxy.base + "/admin/sessions/sum-1", params={"tenant": "acme"},
                     headers=ADMIN).json()
    shown = view["summaries"]
    assert shown and shown[0]["loops"] == [0, 2] and "#W1000" in shown[0]["text"]
    (rec, *_) = [r for r in view["compression_records"] if r.get("kind") == "summary"]
    assert rec["text"] == shown[0]["text"] and rec["loops"] == [0, 2] and rec["in_time"]
    assert rec["summarizer"] == EXTRACTIVE and rec["latency_ms"] >= 0
    metrics = httpx.get(proxy.base + "/metrics").text
    assert 'runloop_summaries_total{outcome="ok",tenant="acme"}' in metrics
    assert 'runloop_summaries_total{outcome="ok",tenant="acme"} 0.0' not in metrics


def test_an_extractive_summary_without_lines_keeps_the_identifiers_alone(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """``summary_lines = false``: the marker's digest lists what the omitted loops produced
    and no question → answer line (what costs a short-turn agent most)."""
    upstream.responder = model()
    proxy = make_proxy(config_dir=config(tmp_path, upstream, extra="summary_lines = false\n"))
    converse(proxy, "ids-only", 9, after=lambda k: proxy.settle())
    asked = [b for b in upstream.requests if not is_summary_call(b)]
    text = next(m for m in map(marker, asked) if m)
    assert "#W1000" in text and "carrier-17" in text and "#W2000" in text
    assert "- Q:" not in text and "where is order 1" not in text


def omitted_orders(body: dict[str, Any]) -> list[int]:
    """The questions (order numbers) a window leaves out: those before the first one shown
    after the omission marker (the opening question stays before it)."""
    msgs = body["messages"]
    at = next((i for i, m in enumerate(msgs) if "Earlier turns are not shown"
               in str(m.get("content"))), None)
    if at is None:
        return []
    asked = [int(str(m["content"]).split()[-1]) for m in msgs[at:]
             if m["role"] == "user" and str(m["content"]).startswith("where is order")]
    return list(range(1, asked[0])) if asked else []


def test_a_model_slower_than_the_session_never_leaves_an_omission_bare(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """A summary model held (a gate: slower than any gap between requests, whatever the
    machine's speed) never holds a request, and every window that omits loops says
    something about every loop it omits from the first omission on: the digest of the
    loops under a label naming them, until the model's summary is in; then the model's
    summary for what it covers and the digest for the rest, from the next omission event
    on (the window stays the same between events). One summary call per session in flight;
    the one made after it is for the newest cover, rolled from the model's last summary.

    Bug class: background work that falls behind and nothing stands in for it. Red with
    the window's inline stand-in made for the extractive summariser only (bare markers from
    the first event), and with the newest cover wanted while a call is in flight dropped
    (no call after the first: the summariser never catches up)."""
    calls: list[dict[str, Any]] = []
    over: list[bool] = []  # the test is over: the gate stays open

    def summary(body: dict[str, Any]) -> dict[str, Any]:
        calls.append(body)
        if not over:
            gate.clear()  # each call is let through on its own: the model stays behind
        turns = body["messages"][0]["content"].rsplit("Turns to add:", 1)[1]
        orders = sorted({w for w in turns.split() if w.startswith("#W") and w[2:].isdigit()},
                        key=lambda w: int(w[2:]))
        return {"content": f"MODEL: orders tracked {' '.join(orders)}"}

    upstream.responder = model(summary)
    upstream.summary_gate = gate = threading.Event()
    proxy = make_proxy(config_dir=config(tmp_path, upstream, model="gpt-4o-mini"))
    try:
        _slow_model_session(proxy, upstream, gate, calls)
    finally:
        over.append(True)
        gate.set()  # the calls still held answer (the server stops without waiting)


def _slow_model_session(proxy: ProxyServer, upstream: ScriptedUpstream,
                        gate: threading.Event, calls: list[dict[str, Any]]) -> None:

    def step(k: int) -> None:
        proxy.settle()
        if k == 9:  # four omission-worthy batches went by with the model still thinking
            assert upstream.summary_calls == 1  # one call in flight, none queued beside it
            gate.set()
            # the first is stored and the next call, for the newest cover, is held
            until(lambda: stored_models() >= 1 and upstream.summary_calls == 2, timeout=30,
                  what="the model's first summary stored")

    def stored_models() -> int:
        view = httpx.get(proxy.base + "/admin/sessions/sum-slow", headers=ADMIN,
                         params={"tenant": "acme"}).json()
        return sum(1 for s in view["summaries"] if s.get("model_summary"))

    converse(proxy, "sum-slow", 14, after=step)
    asked = [b for b in upstream.requests if not is_summary_call(b)]
    windows = [(b, omitted_orders(b)) for b in asked if omitted_orders(b)]
    assert len(windows) >= 10
    for body, orders in windows:  # every omitted loop said something about, never bare
        text = marker(body)
        assert text is not None and "Summary of the turns not shown" in text, orders
        for k in orders:
            assert f"#W{k}000" in text, (k, text)
    # before the model answered: the digest, labelled with exactly the turns it covers
    first = marker(windows[0][0])
    assert first is not None and "Turns 1–2, not yet summarised:" in first and "MODEL" not in first
    # after: the model's summary of the loops it covers, the digest of the rest
    later = [marker(b) or "" for b, _ in windows[-3:]]
    assert all("MODEL: orders tracked #W1000 #W2000\nTurns 3–" in t for t in later), later
    # between events the window's summary is the same text (append-only)
    texts = [marker(b) for b, _ in windows]
    events = {tuple(o) for _, o in windows}
    assert sum(1 for a, b in zip(texts, texts[1:], strict=False) if a != b) < len(events)
    # the first call: turns 1-2 only; the next (after the gate opened) for the newest cover,
    # from the model's summary and the loops after it: never the whole session
    prompt = calls[0]["messages"][0]["content"]
    assert "where is order 1\n" in prompt and "where is order 3\n" not in prompt
    assert upstream.summary_calls == 2 and len(calls) == 1  # the next one is held
    gate.set()
    until(lambda: len(calls) >= 2, timeout=30, what="the summary after the first")
    second = calls[1]["messages"][0]["content"]
    assert "MODEL: orders tracked #W1000 #W2000" in second  # rolled from the model's
    assert "where is order 2\n" not in second and "where is order 6\n" in second
    assert len(second) < 2.5 * len(prompt)
    metrics = httpx.get(proxy.base + "/metrics").text
    assert 'runloop_degraded_requests_total{reason="summary"' not in metrics  # late: no fault


def test_failures_are_counted_and_back_off(tmp_path: Path, make_proxy: Any,
                                          upstream: ScriptedUpstream) -> None:
    upstream.responder = model(lambda body: {"content": ""})  # no text: a failed summary
    proxy = make_proxy(config_dir=config(tmp_path, upstream, model="gpt-4o-mini"))
    msgs = converse(proxy, "sum-fail", 12, after=lambda k: proxy.settle())
    assert msgs[-1]["content"].startswith("order")  # every request answered

    def count(outcome: str) -> float:
        for line in httpx.get(proxy.base + "/metrics").text.splitlines():
            if line.startswith(f'runloop_summaries_total{{outcome="{outcome}",tenant="acme"}}'):
                return float(line.split()[-1])
        return 0.0

    until(lambda: count("error") >= 3, what="three failed summaries")
    assert count("error") == 3 and count("ok") == 0
    assert count("backoff") >= 1  # paused after three in a row


def test_two_replicas_make_one_summary(tmp_path: Path, make_proxy: Any,
                                       upstream: ScriptedUpstream) -> None:
    calls: list[dict[str, Any]] = []

    def summary(body: dict[str, Any]) -> dict[str, Any]:
        calls.append(body)  # thinks 6 s: both replicas see the loops close meanwhile
        return {"content": "one summary", "delay": 6}

    upstream.responder = model(summary)
    cfg = config(tmp_path, upstream, model="gpt-4o-mini")
    a = make_proxy(config_dir=cfg)
    b = ProxyServer(a.settings, a.config).start()  # same Redis, same prefix
    try:
        # made one loop before its event: loops 1-2 when four have closed (turn 5)
        msgs = converse(a, "sum-two", 5, after=lambda k: a.settle())
        until(lambda: len(calls) >= 1, what="a summary call")
        c = openai.OpenAI(base_url=b.url, api_key=ACME_KEY, max_retries=0,
                          default_headers={"X-Session-Id": "sum-two"})
        msgs.append({"role": "user", "content": "and order 6"})
        c.chat.completions.create(model="gpt-4o-mini", messages=msgs,  # type: ignore[arg-type]
                                  tools=TOOLS)  # type: ignore[arg-type]
        b.settle()
        until(lambda: httpx.get(a.base + "/admin/sessions/sum-two", headers=ADMIN, params={
            "tenant": "acme"}).json()["summaries"], timeout=15, what="the summary stored")
        assert len(calls) == 1  # replica b found the lock taken and made none

        def stored() -> list[dict[str, Any]]:
            return list(httpx.get(b.base + "/admin/sessions/sum-two", headers=ADMIN,
                                  params={"tenant": "acme"}).json()["summaries"])

        until(lambda: any(s.get("model_summary") for s in stored()), timeout=15,
              what="the model's summary stored")
        # one window entry for loops 0-2, whoever stored it (the digest standing in here:
        # the model thinks past its event), and the model's one summary of them
        shown = [s for s in stored() if not s.get("model_summary")]
        assert [s["loops"] for s in shown] == [[0, 2]], shown
        assert shown[0]["text"] == "one summary" or shown[0]["digest_loops"] == [0, 2]
        assert [s["text"] for s in stored() if s.get("model_summary")] == ["one summary"]
    finally:
        b.stop()


def test_two_serve_processes_on_one_redis_make_one_summary(
        tmp_path: Path, upstream: ScriptedUpstream, redis_url: str) -> None:
    """Two ``runloop-proxy serve`` processes on one Redis (two replicas, as deployed), one
    session's turns sent to both while its summary's model call thinks 6 s: the summary
    model is called once, and the one summary is stored. The lock is Redis's (a token with
    a TTL), not a process's. Planted, red: the lock taken whatever is held (nx off: two
    summary calls). Its token: test_store.py's summary lock test."""
    calls: list[dict[str, Any]] = []

    def summary(body: dict[str, Any]) -> dict[str, Any]:
        calls.append(body)
        return {"content": "one summary", "delay": 6}

    upstream.responder = model(summary)
    root = Path(config(tmp_path, upstream, model="gpt-4o-mini-2024-07-18"))
    with (root / "runloop.toml").open("a") as f:
        f.write(f'\n[store]\nkey_prefix = "tsum{time.time_ns() % 10**9}-"\n')
    flags = ["--config", str(root)]
    with serve_command(upstream.url, redis_url, tmp_path / "a", flags, {}) as (a, _, _), \
            serve_command(upstream.url, redis_url, tmp_path / "b", flags, {}) as (b, _, _):
        def client(base: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=base + "/v1", api_key=ACME_KEY, max_retries=0,
                                 default_headers={"X-Session-Id": "sum-procs"})

        ca, cb = client(a), client(b)
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "You track orders."}]
        for k in range(1, 6):  # turn 5's question starts the summary of loops 1-2
            msgs.append({"role": "user", "content": f"where is order {k}"})
            while True:
                asked = list(msgs)
                r = ca.chat.completions.create(model="gpt-4o-mini-2024-07-18", messages=msgs,  # type: ignore[arg-type]
                                               tools=TOOLS)  # type: ignore[arg-type]
                if k == 5 and len(asked) == len(msgs) and msgs[-1]["role"] == "user":
                    # the same request to replica b while a's summary call thinks: b
                    # wants the same summary, and finds it being made
                    until(lambda: len(calls) >= 1, what="replica a's summary call")
                    cb.chat.completions.create(model="gpt-4o-mini-2024-07-18", messages=asked,  # type: ignore[arg-type]
                                               tools=TOOLS)  # type: ignore[arg-type]
                m = r.choices[0].message
                msgs.append(m.model_dump(exclude_none=True))
                if not m.tool_calls:
                    break
                for call in m.tool_calls:
                    msgs.append({"role": "tool", "tool_call_id": call.id,
                                 "content": f"#W{k}000 shipped via carrier-{k}7 " + "x " * 200})
        ca.close()
        cb.close()

        def stored() -> list[dict[str, Any]]:
            return list(httpx.get(b + "/admin/sessions/sum-procs", headers=ADMIN, params={
                "tenant": "acme"}).json()["summaries"])

        until(lambda: any(s.get("model_summary") for s in stored()), timeout=20,
              what="the model's summary stored")
        time.sleep(1.0)  # a second call, had replica b made one, would have come by now
        assert len(calls) == 1, f"{len(calls)} summary calls for one session's loops"
        assert [s["text"] for s in stored() if s.get("model_summary")] == ["one summary"]


@pytest.mark.parametrize("policy", ["", 'summary_model = "extractive"'])
def test_unset_summaries_change_nothing(tmp_path: Path, make_proxy: Any,
                                        upstream: ScriptedUpstream, policy: str) -> None:
    """Without summary_model the window is today's: no digest anywhere."""
    upstream.responder = model()
    root = write_config(tmp_path / "c", upstream.url,
                        acme_policy="max_run_loops = 4\nomit_batch = 2\n" + policy)
    proxy = make_proxy(config_dir=str(root))
    converse(proxy, "plain", 8, after=lambda k: proxy.settle())
    text = orjson.dumps(upstream.requests[-1]).decode()
    assert ("Summary of the turns not shown" in text or "ids:" in text) == bool(policy)


def test_pass_through_mode_takes_the_summary_model_from_serve() -> None:
    from runloop_proxy.config import Settings, load_config

    config = load_config(Settings(upstream="http://127.0.0.1:9/v1",
                                  summary_model="gpt-4o-mini-2024-07-18"))
    assert config.passthrough is not None
    assert config.passthrough.policy.summary_model == "gpt-4o-mini-2024-07-18"
    plain = load_config(Settings(upstream="http://127.0.0.1:9/v1")).passthrough
    # unset, the built-in default: the extractive digest's identifiers, no lines
    assert plain is not None and plain.policy.summary_model == "extractive"
    assert not plain.policy.summary_lines


def test_a_summary_slower_than_its_timeout_is_counted_and_left_out(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    upstream.responder = model(lambda body: {"content": "too late", "delay": 3})
    proxy = make_proxy(config_dir=config(tmp_path, upstream, model="gpt-4o-mini", timeout=1))
    converse(proxy, "sum-timeout", 5, after=lambda k: proxy.settle())

    def timeouts() -> float:
        for line in httpx.get(proxy.base + "/metrics").text.splitlines():
            if line.startswith('runloop_summaries_total{outcome="timeout",tenant="acme"}'):
                return float(line.split()[-1])
        return 0.0

    until(lambda: timeouts() >= 1, what="a summary timed out")
    view = httpx.get(proxy.base + "/admin/sessions/sum-timeout", headers=ADMIN,
                     params={"tenant": "acme"}).json()
    assert not [s for s in view["summaries"] if not s.get("late")]  # nothing stored


def test_rolling_summary_input_stays_bounded_over_40_turns(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Each summary call carries the previous summary and the loops of one omission batch,
    never the session: its size does not grow with the session's length. Rolling appends to
    the previous summary while the budget has room (the marker's text only grows, so the
    provider's cache keeps it), and merges into half the budget when it has not."""
    prompts: list[str] = []

    def summary(body: dict[str, Any]) -> dict[str, Any]:
        prompts.append(body["messages"][0]["content"])
        return {"content": f"Goals: orders. Identifiers: #W{len(prompts)}000"}

    upstream.responder = model(summary)
    root = write_config(tmp_path / "cfg", upstream.url, acme_policy=POLICY.format(
        model="gpt-4o-mini", timeout=30) + "summary_max_tokens = 64\n")
    proxy = make_proxy(config_dir=str(root))
    def settled(k: int) -> None:  # each batch's summary made before the next turn (a
        # loaded machine otherwise lets one call take two batches, which is not what is tested)
        until(lambda: not proxy.state.background, what="the background summaries")
        proxy.settle()

    converse(proxy, "sum-40", 40, after=settled)
    try:
        until(lambda: len(prompts) >= 15, timeout=20, what="a summary per omission batch")
    except AssertionError as exc:  # what the proxy says of its summaries, to find why
        outcomes = [line for line in httpx.get(proxy.base + "/metrics").text.splitlines()
                    if line.startswith("runloop_summaries_total")]
        raise AssertionError(f"{exc}: {len(prompts)} calls; {outcomes}") from exc
    turns = [p.split("Turns to add:\n", 1)[1] for p in prompts]
    previous = [p.split("Turns to add:\n", 1)[0].rsplit(":\n", 2)[-2] for p in prompts]
    assert max(len(t) for t in turns) < 1.2 * min(len(t) for t in turns)  # one batch each
    assert max(len(p) for p in previous) < 64 * 6  # the previous summary within its budget
    assert "Identifiers: #W1000" in prompts[1]  # rolled from the one before
    assert "where is order 1\n" not in prompts[-1] and "where is order 36\n" in "".join(prompts)
    kinds = ["append" if "Do not repeat the summary" in p else "merge" for p in prompts]
    assert kinds[0] == "merge" and "append" in kinds and "merge" in kinds[1:]
    view = httpx.get(proxy.base + "/admin/sessions/sum-40", headers=ADMIN,
                     params={"tenant": "acme"}).json()
    stored = [s for s in view["summaries"] if not s.get("late")]
    appended = [s for s in stored if s.get("appended")]
    assert appended and all("Later turns:" in s["text"] for s in appended)
    by_end = {s["loops"][1]: s["text"] for s in stored}
    assert all(s["text"].startswith(by_end[s["loops"][0]] + "\n") for s in appended)
    from runloop_proxy.window.digest import identifiers

    # a merge that condensed the summary before it says what it no longer holds, within
    # the budget (planted: the merge stored as the model wrote it — red here)
    merged = [s for s in stored if not s.get("appended") and s["loops"][0] in by_end]
    assert merged
    for s in merged:
        answer = s["text"].split("\nNot held in this summary")[0]
        kept = set(identifiers(answer))
        lost = [i for i in dict.fromkeys(identifiers(by_end[s["loops"][0]])) if i not in kept]
        assert lost and s["not_held"]["identifiers_lost"] == len(lost), s
        assert s["not_held"]["identifiers"] == lost and s["not_held"]["loops"] is None
        note = s["text"].split("\n")[-1]
        assert note.startswith("Not held in this summary (search_history finds them")
        named = [i for i in identifiers(note) if i in lost]
        assert named == lost[:len(named)] and (len(named) == len(lost) or "more" in note)
    # and the manual trigger has nothing left to make
    made = httpx.post(proxy.base + "/admin/sessions/sum-40/compact", headers=ADMIN).json()
    # (the last two batches were not due yet: they would be made one loop before their event)
    assert all(m["ok"] for m in made["made"]) and len(made["made"]) <= 2


def test_a_summary_redis_would_not_take_stops_no_later_summary(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Redis pausing writes (CLIENT PAUSE, past the store's timeout) while a summary is made
    loses that summary alone: counted as `store`, and the next batches' summaries are made
    and reach the window. Planted, red: the session's summary lock left held when the write
    failed (every later summary skipped, silently, for the lock's 35 s), as the whole suite
    once saw on a loaded machine; and the lock released but not taken over (Redis, paused,
    also refused the release: the same)."""
    import redis

    server = RedisServer().start()
    paused: list[float] = []

    def summary(body: dict[str, Any]) -> dict[str, Any]:
        if not paused:  # the first summary's answer comes back to a Redis pausing writes
            paused.append(time.monotonic())
            redis.Redis(port=server.port).execute_command("CLIENT", "PAUSE", "1800", "WRITE")
        return {"content": f"Goals: orders. Identifiers: #S{len(paused)}{time.time_ns()}"}

    try:
        upstream.responder = model(summary)
        proxy = make_proxy(config_dir=config(tmp_path, upstream, model="gpt-4o-mini"),
                           redis=server.url)

        def quiet(k: int) -> None:
            if paused and time.monotonic() - paused[0] < 3:
                time.sleep(3 - (time.monotonic() - paused[0]))  # Redis back (a probe)
            until(lambda: proxy.state.store.available, what="the store back")
            proxy.quiet()
        converse(proxy, "paused-sum", 14, after=quiet)
        text = httpx.get(proxy.base + "/metrics").text
        outcomes = {line.split('outcome="')[1].split('"')[0]: float(line.split()[-1])
                    for line in text.splitlines()
                    if line.startswith("runloop_summaries_total{") and 'tenant="acme"' in line}
        assert outcomes["store"] == 1, outcomes  # the summary Redis did not take
        assert outcomes["ok"] >= 3, outcomes  # and the later batches' made
        calls = [b for b in upstream.requests if is_summary_call(b)]
        assert len(calls) >= 4, len(calls)
        # the last window carries a summary made after the pause
        last = marker([b for b in upstream.requests if not is_summary_call(b)][-1]) or ""
        assert "Identifiers: #S1" in last, last
    finally:
        server.cleanup()


def test_compact_now_summarises_and_omits_from_the_next_request(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """POST /admin/sessions/{id}/compact: summaries made now, and the closed loops they cover
    omitted from the next request on (no wait for max_run_loops), the summary inside the
    marker; the window is append-only again after it. The session holds a proxy recall round
    (stored apart from the client's messages): the compaction is keyed as the request path
    sees the conversation, spliced, or the next request would not find it."""
    recalled: list[bool] = []

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        last = body["messages"][-1]
        if last["role"] == "user" and last["content"].endswith(" 2") and not recalled:
            recalled.append(True)  # the model asks the proxy for turn 1's lookup
            return {"tool_calls": [{"id": "rc_1", "name": "recall_tool_call",
                                    "arguments": {"call_id": "call_1"}}]}
        return model()(body)

    upstream.responder = respond
    root = write_config(tmp_path / "c", upstream.url, acme_policy=(
        'max_run_loops = 10\nomit_batch = 2\nsummary_model = "extractive"\n'))
    proxy = make_proxy(config_dir=str(root))
    msgs = converse(proxy, "compact-me", 5, after=lambda k: proxy.settle())
    assert recalled and not marker(upstream.requests[-1])  # 5 loops: nothing omitted yet
    done = httpx.post(proxy.base + "/admin/sessions/compact-me/compact", headers=ADMIN).json()
    # none was due yet (one loop before max_run_loops omits them): both are made now
    assert done["omitted_loops"] == 4
    assert done["made"] == [{"loops": [0, 2], "ok": True}, {"loops": [0, 4], "ok": True}]
    c = openai.OpenAI(base_url=proxy.url, api_key=ACME_KEY, max_retries=0,
                      default_headers={"X-Session-Id": "compact-me"})
    sent: list[list[dict[str, Any]]] = []
    for k in (6, 7):
        msgs.append({"role": "user", "content": f"where is order {k}"})
        while True:
            r = c.chat.completions.create(model="gpt-4o-mini", messages=msgs,  # type: ignore[arg-type]
                                          tools=TOOLS)  # type: ignore[arg-type]
            sent.append(upstream.requests[-1]["messages"])
            m = r.choices[0].message
            msgs.append(m.model_dump(exclude_none=True))
            if not m.tool_calls:
                break
            for call in m.tool_calls:
                msgs.append({"role": "tool", "tool_call_id": call.id, "content": f"#W{k}000"})
        proxy.settle()
    text = marker({"messages": sent[0]})
    assert text is not None and "Summary of the turns not shown" in text and "#W4000" in text
    users = [m["content"] for m in sent[0] if m["role"] == "user"]
    # the opening task stays in view, then the turns after the omitted ones
    assert users == ["where is order 1", "where is order 5", "where is order 6"]
    for before, after in zip(sent, sent[1:], strict=False):
        assert after[:len(before)] == before  # append-only after the compaction
    view = httpx.get(proxy.base + "/admin/sessions/compact-me", headers=ADMIN).json()
    assert [a["loops"] for a in view["compactions"]] == [[0, 4]]


@pytest.mark.parametrize(("max_run_loops", "batch", "e", "closed", "pressed", "made"), [
    (10, 5, 5, 5, False, False),  # loops 1-5 closed, but the event is six loops away
    (10, 5, 5, 9, False, False),
    (10, 5, 5, 10, False, True),  # one loop before the event (it omits at 11 closed)
    (10, 5, 10, 14, False, False),
    (10, 5, 10, 15, False, True),  # the second event comes at 16 closed
    (10, 5, 5, 5, True, True),  # past its target: an omission may come with any request
    (10, 5, 5, 4, True, False),  # never before its loops have closed
    (2, 3, 3, 3, False, True),  # max_run_loops below the batch: as soon as they close
])
def test_a_summary_is_made_one_loop_before_its_event(
        max_run_loops: int, batch: int, e: int, closed: int, pressed: bool, made: bool) -> None:
    from runloop_proxy.history.summaries import due

    policy = Policy(max_run_loops=max_run_loops, omit_batch=batch)
    assert due(policy, e, closed, pressed) is made


def test_with_max_run_loops_below_the_batch_the_summary_is_ready_at_its_event(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """globex's shape (max_run_loops 2, omit_batch 3): the request that closes the third loop
    is answered, and the very next one omits all three. The summary starts when that reply is
    recorded, so it is in the marker at the event — not late."""
    upstream.responder = model()
    root = write_config(tmp_path / "c", upstream.url, acme_policy=(
        'max_run_loops = 2\nomit_batch = 3\nsummary_model = "extractive"\n'))
    proxy = make_proxy(config_dir=str(root))
    converse(proxy, "short-turns", 7, after=lambda k: proxy.settle())
    asked = [b for b in upstream.requests if not is_summary_call(b)]
    markers = [marker(b) for b in asked]
    first = next(i for i, m in enumerate(markers) if m)
    assert asked[first]["messages"][-1]["content"] == "where is order 4"  # the event
    assert "Summary of the turns not shown" in str(markers[first])
    assert "#W3000" in str(markers[first])
    later = next(m for m in markers if m and "#W6000" in m)  # the second event, appended
    assert later.startswith(str(markers[first]))
    metrics = httpx.get(proxy.base + "/metrics").text
    assert 'runloop_summaries_total{outcome="late",tenant="acme"} 0.0' in metrics


@pytest.mark.parametrize(("max_run_loops", "batch"), [(1, 2), (0, 1)])
def test_an_extractive_summary_is_never_late_for_a_client_that_does_not_pause(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream, max_run_loops: int,
        batch: int) -> None:
    """Omissions with no loop of time ahead (max_run_loops 1, omit_batch 2; and globex's
    shape, 0 and 1: every turn omits the one before): the request after the reply that
    closes a batch omits it, so a background summary can only start on that reply — and this
    client sends the next request at once, with the reply as it keeps it (reformatted: not the
    message the proxy recorded, so a summary started on the recorded one covers another
    conversation). The extractive digest, pure and bounded, is made inline then: every
    omission shows the identifiers of every loop it left out, and none is late."""
    upstream.responder = model()
    root = write_config(tmp_path / "c", upstream.url, acme_policy=(
        f'max_run_loops = {max_run_loops}\nomit_batch = {batch}\n'
        'summary_model = "extractive"\nsummary_lines = false\n'))
    proxy = make_proxy(config_dir=str(root))
    converse(proxy, "no-pause", 8, edit=lambda m: {**m, "content": m["content"].capitalize()})
    asked = [b for b in upstream.requests if not is_summary_call(b)]
    events = 0
    for b in asked:
        text = marker(b)
        if text is None:
            continue
        opened = int(b["messages"][-1]["content"].split()[-1]) \
            if b["messages"][-1]["role"] == "user" else None
        assert "Identifiers:" in text and "- Q:" not in text
        if opened is not None:  # an event: the loops before this one, a batch at a time
            events += 1
            omitted = batch_omission(Policy(max_run_loops=max_run_loops, omit_batch=batch),
                                     opened - 1)
            for k in range(1, omitted + 1):
                assert f"#W{k}000" in text, (opened, text)
    assert events >= 3
    proxy.settle()
    until(lambda: 'runloop_summaries_total{outcome="ok",tenant="acme"} 0.0'
          not in httpx.get(proxy.base + "/metrics").text, timeout=10, what="stored summaries")
    metrics = httpx.get(proxy.base + "/metrics").text
    assert 'runloop_summaries_total{outcome="late",tenant="acme"} 0.0' in metrics


def test_an_omission_by_age_shows_the_digest_of_what_it_left_out(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Loops older than ``max_time_range`` leave where the clock says, off the batches the
    summaries are planned for (here 1, then 2, with a batch of 4): the digest of what each
    such omission left out is made inline and shown with it, stays put while nothing more
    ages, and the next omission by age appends to it (before: no summary at all)."""
    upstream.responder = model()
    root = write_config(tmp_path / "c", upstream.url, acme_policy=(
        'max_run_loops = 8\nomit_batch = 4\nsummary_model = "extractive"\n'
        'summary_lines = false\nmax_time_range_s = 3.8\n'))
    proxy = make_proxy(config_dir=str(root))

    def shown(turn: int) -> list[str | None]:
        """The summaries the requests of turn ``turn`` showed (None: no marker)."""
        return [marker(b) for b in upstream.requests if not is_summary_call(b)
                and any(m.get("content") == f"where is order {turn}" for m in b["messages"]
                        if m["role"] == "user")
                and not any(m.get("content") == f"where is order {turn + 1}"
                            for m in b["messages"] if m["role"] == "user")]

    converse(proxy, "aging", 1)  # a loop is dated by the request that opens it
    time.sleep(4.2)  # loop 1 is old now; the session resumes from its start
    converse(proxy, "aging", 2)
    second = shown(2)
    assert len(second) == 2 and second[0] == second[1]  # stays put within the turn
    assert second[0] is not None and "#W1000" in second[0] and "carrier-17" in second[0]
    assert "Summary of the turns not shown" in second[0] and "#W2000" not in second[0]
    upstream.requests.clear()
    time.sleep(4.2)  # loop 2 is old too (each turn takes far less than the range)
    converse(proxy, "aging", 3)
    third = shown(3)
    assert third[0] is not None and "#W2000" in third[0]
    # rolled on from the first, a block appended (not the two loops digested afresh)
    assert third[0].startswith(second[0]) and third[0].count("Identifiers:") == 2
    last = [b for b in upstream.requests if not is_summary_call(b)][-1]
    users = [m["content"] for m in last["messages"] if m["role"] == "user"]
    # 1 and 2 omitted, by age; the opening task stays in view
    assert users == ["where is order 1", "where is order 3"]


def test_a_loop_is_dated_in_its_own_conversation_not_by_the_same_words_elsewhere(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Another session (here: the same tenant, the same words) that said "where is order 1"
    long ago does not make this session's new loop old: it is not omitted by age."""
    upstream.responder = model()
    root = write_config(tmp_path / "c", upstream.url, acme_policy=(
        'max_run_loops = 8\nomit_batch = 4\nmax_time_range_s = 3.8\n'))
    proxy = make_proxy(config_dir=str(root))
    converse(proxy, "first-session", 2)
    time.sleep(4.2)
    upstream.requests.clear()
    converse(proxy, "second-session", 2)
    assert all(marker(b) is None for b in upstream.requests)  # nothing omitted
    upstream.requests.clear()
    converse(proxy, "first-session", 2)  # its own loop 1 is old: omitted there
    assert marker(upstream.requests[-1]) is not None


def test_a_loops_date_survives_a_restart(tmp_path: Path, make_proxy: Any,
                                        upstream: ScriptedUpstream) -> None:
    """Bug class: what decides a window kept in one process only. A loop's first-seen date
    lived in the process: a restart dated every loop anew, and loops omitted by age came
    back into view (212 -> 814 tokens forwarded). Red with the dates never written to
    Redis (``_store_dates`` not spawned); a second bug of the class planted: the dates
    written but not read back on load (``_known_dates`` not called)."""
    upstream.responder = model()
    root = write_config(tmp_path / "c", upstream.url, acme_policy=(
        'max_run_loops = 8\nomit_batch = 4\nmax_time_range_s = 3.3\n'))
    before = make_proxy(config_dir=str(root))
    converse(before, "restarted", 2)  # dates loops 1 and 2
    assert all(marker(b) is None for b in upstream.requests)
    before.settle()
    until(lambda: not before.state.background, what="the dates written behind the answers")
    before.stop()
    time.sleep(3.6)  # loop 1 is old now
    # a new process on the same Redis (the same key prefix)
    after = make_proxy(config_dir=str(root),
                       store={"key_prefix": before.state.config.store.key_prefix})
    upstream.requests.clear()
    converse(after, "restarted", 3)
    last = upstream.requests[-1]
    assert marker(last) is not None, "the restart brought the aged loop back"
    users = [m["content"] for m in last["messages"] if m["role"] == "user"]
    assert "where is order 2" not in users and users[-1] == "where is order 3"


def test_after_an_omission_by_age_a_model_summary_is_still_made_ahead(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """An omission by age stops off the batch (2 loops, batch 3); the next batch's summary is
    still planned from there (the next multiple, 3) and made on the reply that closes it, so
    the model's summary is in the window at its event, not late."""
    upstream.responder = model()
    root = write_config(tmp_path / "c", upstream.url, acme_policy=(
        'max_run_loops = 2\nomit_batch = 3\nsummary_model = "gpt-4o-mini"\n'
        'max_time_range_s = 6\n'))
    proxy = make_proxy(config_dir=str(root))
    converse(proxy, "aging-llm", 2)  # dates loops 1 and 2
    # past the range for them, and a range the next four turns take far less than, even on
    # a loaded machine (at 1.5 s a slow run aged the next turns' loops too: a flake)
    time.sleep(6.2)
    converse(proxy, "aging-llm", 4, after=lambda k: proxy.settle())
    asked = [b for b in upstream.requests if not is_summary_call(b)]
    assert "SUMMARY" in str(marker(asked[-1]))  # the event that omits loops 1-3
    metrics = httpx.get(proxy.base + "/metrics").text
    assert 'runloop_summaries_total{outcome="late",tenant="acme"} 0.0' in metrics


def test_a_failure_planning_a_summary_never_costs_the_call(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever goes wrong deciding which summary to make next, the request is answered and
    the failure is counted (``runloop_summaries_total{outcome="error"}``)."""
    from runloop_proxy.history.summaries import SummaryService

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("planted")
    monkeypatch.setattr(SummaryService, "after", broken)
    upstream.responder = model()
    proxy = make_proxy(config_dir=config(tmp_path, upstream))
    msgs = converse(proxy, "broken-plan", 2)
    assert msgs[-1]["content"].startswith("order ")  # both turns answered
    metrics = httpx.get(proxy.base + "/metrics").text
    assert 'runloop_summaries_total{outcome="error",tenant="acme"} 4.0' in metrics


@pytest.mark.parametrize(("max_run_loops", "batch", "e", "at"), [
    (10, 5, 5, 11), (10, 5, 10, 16), (4, 2, 2, 5), (2, 3, 3, 3), (2, 3, 6, 6), (1, 1, 1, 2),
    (0, 1, 1, 1), (0, 1, 3, 3), (0, 2, 2, 2), (0, 2, 4, 4)])
def test_the_event_that_omits_e_loops(max_run_loops: int, batch: int, e: int, at: int) -> None:
    """Where the window's batch omission reaches e loops (the closed loops at that request):
    what decides whether a summary can wait for the next request or must start on the reply."""
    from runloop_proxy.history.summaries import event_at

    # (without the opening task kept: omitting the first loop alone would then take out only
    # what the opening and the kept reply do not show)
    policy = Policy(max_run_loops=max_run_loops, omit_batch=batch, keep_opening=False)
    assert event_at(policy, e) == at
    # the window agrees: with at-1 closed loops nothing reaches e, with at it does
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "s"}]
    for k in range(at + 1):  # questions long enough that omitting one takes tokens out
        msgs += [{"role": "user", "content": f"q{k} " + "word " * 40},
                 {"role": "assistant", "content": f"a{k}"}]
    from runloop_proxy.conversation.messages import message_hash
    from runloop_proxy.window.builder import build_window
    from runloop_proxy.window.forms import Budget

    from .test_window import OPS

    def omitted(closed: int) -> int:
        part = msgs[:1 + 2 * closed + 1]  # the request that opens loop closed+1
        return build_window(part, [message_hash(m) for m in part],  # type: ignore[arg-type]
                            [OPS.count(m) for m in part], policy,  # type: ignore[arg-type]
                            Budget(100_000, 50_000), OPS).omitted_loops
    assert omitted(at - 1) < e <= omitted(at)


def test_a_summary_upstream_is_called_with_its_own_key(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """``summary_upstream`` sends the summary calls to another configured upstream, with
    that upstream's own key — never the tenant's, never the client's (a line no test ran,
    the CI mutation smoke's survivor)."""
    summariser = ScriptedUpstream().start()
    try:
        summariser.responder = lambda body: {"content": "Goals: track orders."}
        upstream.responder = model()
        root = write_config(tmp_path / "cfg", upstream.url, extra_global=(
            f'[upstreams.summaries]\nurl = "{summariser.url}"\napi_key = "sk-summaries"\n'
            f'max_retries = 0\n'), acme_policy=POLICY.format(model="m-sum", timeout=30)
            + 'summary_upstream = "summaries"\n')
        proxy = make_proxy(config_dir=str(root))
        converse(proxy, "sum-elsewhere", 5, after=lambda k: proxy.settle())
        until(lambda: summariser.requests, what="a summary call to the summary upstream")
        assert {h["authorization"] for h in summariser.headers} == {"Bearer sk-summaries"}
        assert not [b for b in upstream.requests if is_summary_call(b)]
    finally:
        summariser.stop()


def test_the_scripted_upstream_knows_the_proxys_summary_calls() -> None:
    """The scripted summary model (its latency and gate apply to summary calls only) finds
    them by the words both prompts open with; its default answer lists the turns it was
    asked to add and their identifiers, within the tokens it was allowed. Red with the
    default answer's turn lines read from the wrong section (the previous summary's)."""
    from runloop_proxy.history.summaries import APPEND, MERGE, SECTIONS
    from runloop_proxy.scripted import is_summary_call, scripted_summary

    for prompt in (APPEND, MERGE):
        text = prompt.format(max_tokens=40, sections=SECTIONS, previous="(none)",
                             turns="[turn 3]\nuser: where is order 3\nassistant: #W3000 ok")
        body = {"model": "gpt-4o-mini-2024-07-18", "max_tokens": 40,
                "messages": [{"role": "user", "content": text}]}
        assert is_summary_call(body)
        answer = scripted_summary(body)["content"]
        assert "- turn 3: where is order 3" in answer and "#W3000" in answer
        assert len(answer) <= 40 * 4
    assert not is_summary_call({"messages": [{"role": "user", "content": "where is order 3"}]})


def test_summary_calls_are_bounded_per_tenant_and_never_hold_its_requests(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Ten sessions each due a model summary while the model is held (a gate): at most the
    tenant's share of ``server.summary_calls`` (4 x 0.5 = 2) are in flight, the other eight
    wait their turn (counted as deferred and as share refusals, never failures) and are all
    made once calls end; and the tenant's own requests go on being answered while its
    summaries hold connections to an upstream of max_connections = 2 (summaries get
    connections of their own beside those).

    Bug class: background calls unbounded by tenant and sharing the user's pool. Red with
    the connector's room for summaries removed (the probe request waits behind the held
    summaries and times out), and with no share taken for a summary call (ten in flight
    fill the upstream's connections: the probe times out too)."""
    in_flight: list[int] = []

    def summary(body: dict[str, Any]) -> dict[str, Any]:
        in_flight.append(upstream.summary_calls - upstream.summaries_answered)
        return {"content": "MODEL: orders tracked"}

    upstream.responder = model(summary)
    upstream.summary_gate = gate = threading.Event()
    root = write_config(tmp_path / "cfg", upstream.url, extra_global="summary_calls = 4\n",
                        acme_policy='max_run_loops = 0\nomit_batch = 1\n'
                                    'summary_model = "gpt-4o-mini-2024-07-18"\n'
                                    'summary_timeout_s = 120\n')
    runloop = root / "runloop.toml"
    runloop.write_text(runloop.read_text().replace("max_retries = 0\n",
                                                   "max_retries = 0\nmax_connections = 2\n"))
    proxy = make_proxy(config_dir=str(root))
    try:
        def turn(session: str, k: int) -> str:
            c = openai.OpenAI(base_url=proxy.url, api_key=ACME_KEY, max_retries=0,
                              timeout=45, default_headers={"X-Session-Id": session})
            msgs: list[Any] = [{"role": "system", "content": "You track orders."},
                               {"role": "user", "content": f"where is order {k}"}]
            while True:
                m = c.chat.completions.create(model="gpt-4o-mini-2024-07-18", messages=msgs,
                                              tools=TOOLS).choices[0].message  # type: ignore[arg-type]
                msgs.append(m.model_dump(exclude_none=True))
                if not m.tool_calls:
                    return str(m.content)
                msgs += [{"role": "tool", "tool_call_id": call.id,
                          "content": f"#W{k}000 shipped via carrier-{k}7"}
                         for call in m.tool_calls]

        for k in range(1, 11):
            assert turn(f"bounded-{k}", k).startswith("order")
            proxy.settle()
        until(lambda: upstream.summary_calls == 2, what="the tenant's share of calls held")
        # the tenant's own request, with two summaries holding connections: answered
        assert turn("bounded-probe", 11).startswith("order")
        assert upstream.summary_calls == 2  # the others wait their turn

        def count(name: str, labels: str) -> float:
            for line in httpx.get(proxy.base + "/metrics").text.splitlines():
                if line.startswith(f"{name}{{{labels}}}"):
                    return float(line.split()[-1])
            return 0.0

        assert count("runloop_summaries_total", 'outcome="deferred",tenant="acme"') >= 8
        assert count("runloop_share_refusals_total",
                     'reason="tenant",resource="summary calls"') >= 8
        assert count("runloop_summaries_total", 'outcome="error",tenant="acme"') == 0
        gate.set()
        until(lambda: upstream.summaries_answered >= 11, timeout=60,
              what="every waiting session's summary made")
        assert max(in_flight) <= 2, in_flight
    finally:
        gate.set()


def test_the_built_in_defaults_keep_what_the_next_reply_needs(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Pass-through on the built-in policy (no tenant file, no flag): every turn omits the
    one before it, and what the window keeps of it is its final reply (what the user is
    answering) and, after the marker, the identifiers its tools brought (order ids,
    carriers) with no question → answer line, while the open turn stays whole. Bug class: a
    default that hides what the next reply quotes. Planted, each red: max_run_loops back at
    10 (no marker), summary_lines back on (a question line), summary_model unset (no
    identifiers after the marker)."""
    upstream.responder = model()
    proxy = make_proxy()
    converse(proxy, "built-in", 4, after=lambda k: proxy.settle())
    last = [b for b in upstream.requests if not is_summary_call(b)][-1]
    text = marker(last)
    assert text is not None, [m.get("content") for m in last["messages"]]
    assert all(f"#W{k}000" in text for k in (1, 2)) and "carrier-17" in text, text
    assert "where is order" not in text and "Q:" not in text, text
    contents = [str(m.get("content")) for m in last["messages"]]
    # the turns before are omitted (the opening task stays), the last one's reply kept
    assert "where is order 1" in contents and "order #W3000 sh is on its way" in contents
    assert "where is order 2" not in contents and "where is order 3" not in contents
    assert not any("#W2000 sh is on its way" in c for c in contents)
    # the open turn whole: its question and its tool's result
    assert "where is order 4" in contents
    assert any(c.startswith("#W4000 shipped via carrier-47") for c in contents)
