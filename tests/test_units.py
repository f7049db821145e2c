"""Units and signs checked against the world, not against the code's own arithmetic: the TTL
Redis reports (in seconds, the unit it speaks) on every key a session writes equals the
tenant's retention; the saved-tokens counter moves by what an independent count of the two
prompts says was saved, and never when the proxy makes a request larger; a tenant's own
setting beats every built-in for every field a tenant may set (the table is generated from
the config model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from runloop_proxy.pipeline.reconcile import WRITTEN_WAIT_S
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer, until
from .test_config import ACME_KEY, GLOBEX_KEY, write_config

DAY_S = 86_400
SLACK_S = 600  # the test's own duration, in seconds of TTL: far below any unit slip


def retention_config(tmp_path: Path, upstream: ScriptedUpstream) -> str:
    """acme keeps its history 2 days (its own setting), globex the store's 3 (global)."""
    root = write_config(tmp_path / "cfg", upstream.url, acme_policy=(
        'max_run_loops = 1\nomit_batch = 1\n'  # coincide: one loop omitted a turn
        'summary_model = "extractive"\nreduce_at_least = 0\n'))
    acme = root / "tenants" / "acme.toml"
    acme.write_text("retention_days = 2\n" + acme.read_text())
    return str(root)


def agent_turns(proxy: ProxyServer, upstream: ScriptedUpstream, key: str, session: str | None,
                turns: int) -> list[dict[str, Any]]:
    """An agent session: each turn a call of the client's tool, its result, a reply long
    enough to anchor a trimmed history; the model recalls a result on the last turn."""
    headers = {"X-Session-Id": session} if session else {}
    c = openai.OpenAI(base_url=proxy.url, api_key=key, max_retries=0, default_headers=headers)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {}}}}]
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You track orders."}]
    for k in range(turns):
        msgs.append({"role": "user", "content": f"where is order {k}"})
        upstream.push({"tool_calls": [{"id": f"call_{k}", "name": "lookup", "arguments": {}}]})
        r = c.chat.completions.create(model="gpt-4o-mini", messages=msgs,  # type: ignore[arg-type]
                                      tools=tools)  # type: ignore[arg-type]
        msgs.append(r.choices[0].message.model_dump(exclude_none=True))
        msgs.append({"role": "tool", "tool_call_id": f"call_{k}",
                     "content": f"order {k}: " + "shipped by carrier " * 60})
        if k == turns - 1:
            upstream.push({"tool_calls": [{"id": "rc", "name": "recall_tool_call",
                                           "arguments": {"call_id": "call_0"}}]})
        upstream.push({"content": f"order {k} is on its way " + "and well " * 60})
        r = c.chat.completions.create(model="gpt-4o-mini", messages=msgs,  # type: ignore[arg-type]
                                      tools=tools)  # type: ignore[arg-type]
        msgs.append(r.choices[0].message.model_dump(exclude_none=True))
        proxy.settle()
    return msgs


def test_every_key_a_session_writes_expires_with_its_tenants_retention(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream, redis_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What Redis says, key by key: every key a session leaves — written by the sync and
    append scripts, the compaction records, the proxy's tool rounds, summaries, request
    points, forks, anchors of trimmed histories and of Responses answers, the sessions'
    listing — expires after its tenant's retention (acme's own 2 days; globex the store's 3)."""
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-up")
    monkeypatch.setenv("TEST_ACME_KEY", ACME_KEY)
    proxy = make_proxy(config_dir=retention_config(tmp_path, upstream),
                       store={"retention_days": 3})
    msgs = agent_turns(proxy, upstream, ACME_KEY, "kept", 4)
    # a fork: the conversation edited at its second question
    edited = [*msgs[:4], {"role": "user", "content": "where is order 9"}]
    openai.OpenAI(base_url=proxy.url, api_key=ACME_KEY, max_retries=0, default_headers={
        "X-Session-Id": "kept"}).chat.completions.create(model="gpt-4o-mini",
                                                         messages=edited)  # type: ignore[arg-type]
    agent_turns(proxy, upstream, ACME_KEY, None, 2)  # fingerprinted: anchors
    agent_turns(proxy, upstream, GLOBEX_KEY, "global", 2)
    openai.OpenAI(base_url=proxy.url, api_key=GLOBEX_KEY, max_retries=0).responses.create(
        model="gpt-4o-mini", input="hello")  # a stored response: its anchor
    sh = openai.OpenAI(base_url=proxy.url, api_key=GLOBEX_KEY, max_retries=0, default_headers={
        "X-Session-Id": "server-kept", "X-Runloop-History": "server"})
    for q in ("first", "second"):
        sh.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": q}])
    proxy.settle()
    prefix = proxy.state.store.cfg.key_prefix
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    expected = ("meta", "msg", "ts", "tok", "tool", "branches", "bused", "rec", "int", "sum",
                "req", "b:0", "c:0", "b:1", "c:1")
    kept = f"{prefix}:{{acme:n:kept}}:"

    def written() -> list[str]:
        return sorted(r.scan_iter(match=f"{prefix}:*", count=1000))
    until(lambda: all(kept + k in written() for k in expected) and
          any(":a:acme:" in k for k in written()) and any(":a:globex:" in k for k in written()),
          timeout=30, what="every kind of key written")
    wrong = []
    for key in written():
        if key.endswith(":sumlock"):
            continue  # one summary in flight: expires with the summary's timeout
        if key.endswith(":announced"):
            # a write on its way (another replica waits for it): gone within WRITTEN_WAIT_S
            ttl = r.ttl(key)  # -2: gone already; -1 (no TTL) would be wrong
            assert ttl == -2 or 0 < ttl <= WRITTEN_WAIT_S, (key, ttl)
            continue
        days = 2 if "{acme:" in key or ":acme:" in key else 3
        ttl = r.ttl(key)
        if not days * DAY_S - SLACK_S < ttl <= days * DAY_S:
            wrong.append(f"{key}: TTL {ttl} s, expected {days} days ({days * DAY_S} s)")
    assert not wrong, "keys that do not expire with the retention:\n" + "\n".join(wrong)
    r.close()


def metric_sums(proxy: ProxyServer) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(proxy.base + "/metrics").text):
        for sample in family.samples:
            if sample.name.startswith("runloop_prompt_tokens_") and \
                    sample.name.endswith("_total"):
                out[sample.name] = out.get(sample.name, 0) + sample.value
    return out


@pytest.fixture
def counted(redis_url: str, tmp_path: Path) -> Any:
    """A proxy in front of a scripted upstream that counts each prompt it receives as the API
    bills it (its own tokenisation of the body, not the proxy's numbers)."""
    from runloop_proxy.config import Settings

    from .conftest import unique_config

    up = ScriptedUpstream(prompt_cache=True).start()
    settings = Settings(upstream=up.url, redis_url=redis_url, data_dir=str(tmp_path / "d"))
    proxy = ProxyServer(settings, unique_config(settings)).start()
    yield proxy, up
    proxy.stop()
    up.stop()


def billed(up: ScriptedUpstream, body: dict[str, Any]) -> int:
    """A prompt's tokens as the upstream bills them (the scripted upstream's own count)."""
    from runloop_proxy.scripted import _as_chat

    assert up.prompt_cache is not None
    return len(up.prompt_cache.tokens(_as_chat(body)))


def test_saved_tokens_move_by_what_the_proxy_saved_and_never_when_it_adds(
        counted: Any) -> None:
    """Three requests, each counted by the upstream's own tokenisation on both sides: one the
    proxy makes larger (its tools added: chat, streamed chat, Responses), one it leaves alone,
    one it makes smaller (a past loop reduced). The counters move by exactly those counts,
    and the saved-tokens counter only by what was saved."""
    proxy, up = counted
    client = openai.OpenAI(base_url=proxy.url, api_key="sk-counted", max_retries=0)
    lookup: dict[str, Any] = {"name": "lookup", "description": "Find it.", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}
    tools = [{"type": "function", "function": lookup}]
    big = "the shipment left the depot and " * 120
    reduced = [{"role": "system", "content": "You track orders."},
               {"role": "user", "content": "where is order 1"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "lookup", "arguments": "{\"q\": \"1\"}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": big},
               {"role": "assistant", "content": "order 1 " + big},
               {"role": "user", "content": "and order 2?"}]
    cases: list[tuple[str, Any, dict[str, Any], int]] = [  # the sign of forwarded - client
        ("larger", client.chat.completions.with_raw_response.create,
         {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}], "tools": tools},
         1),
        ("larger, streamed", client.chat.completions.with_raw_response.create,
         {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
          "stream": True}, 1),
        ("larger, Responses", client.responses.with_raw_response.create,
         {"model": "gpt-4", "input": "hi", "tools": [{"type": "function", **lookup}]},
         1),
        ("the same", client.chat.completions.with_raw_response.create,
         {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]},
         0),
        ("smaller", client.chat.completions.with_raw_response.create,
         {"model": "gpt-4", "messages": reduced, "tools": tools}, -1),
    ]
    for name, create, body, sign in cases:
        before = metric_sums(proxy)
        raw = create(**body)
        if body.get("stream"):
            list(raw.parse())  # the stream read to its end: the request is over
        sent = (billed(up, body), billed(up, up.requests[-1]))
        shown = tuple(int(n) for n in raw.headers["x-runloop-tokens"].split(";"))
        assert shown == sent, f"{name}: the proxy counted {shown}, the upstream bills {sent}"
        c, f = sent
        assert (f > c) - (f < c) == sign, f"{name}: {sent}"
        after = metric_sums(proxy)
        moved = {k.removeprefix("runloop_prompt_tokens_").removesuffix("_total"):
                 after.get(k, 0) - before.get(k, 0) for k in after}
        assert moved == {"client": c, "forwarded": f, "saved": max(0, c - f)}, \
            f"{name} ({c} sent, {f} forwarded): the counters moved {moved}"


# -- a tenant's own settings beat the built-ins, for every field a tenant may set -------------

NOT_SETTINGS = {"name": "who the tenant is (its file's name)",
                "keys": "who may call (a key belongs to one tenant only)",
                "models": "per model: the table below, over every built-in model",
                "policy": "its fields are swept one by one"}
UPSTREAMS = ("main", "other")  # configured by tenant_config, besides "default"
CANDIDATE_TEXT = ["extractive", "gpt-4o-mini", "main", "other", "user", "prompt_cache_key",
                  "header:x-conv", "metadata.thread"]


def _candidates(field: Any, default: Any) -> list[Any]:
    """Values of a field's type, none of them its default, in a stable order."""
    import enum
    import types
    import typing

    kinds = typing.get_args(field.annotation) if isinstance(
        field.annotation, types.UnionType) else (field.annotation,)
    low = next((getattr(m, a) for m in field.metadata for a in ("ge", "gt")
                if hasattr(m, a)), None)
    high = next((m.le for m in field.metadata if hasattr(m, "le")), None)
    out: list[Any] = []
    for kind in kinds:
        if kind is bool:
            out += [not default]
        elif kind is int:
            base = default if isinstance(default, int) else (low or 0) + 1
            out += [v for v in (base + 1, base + 2, base - 1, base - 2)
                    if (low is None or v >= low) and (high is None or v <= high)]
        elif kind is float:
            base = float(default) if isinstance(default, (int, float)) else 1.0
            step = 0.05 if high is not None and high <= 1 else 1.0
            out += [round(v, 4) for v in (base - step, base - 2 * step, base + step,
                                          base + 2 * step)
                    if v > (low or 0) and (high is None or v <= high)]
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            out += [m for m in kind if m != default]
        elif typing.get_origin(kind) is typing.Literal:
            out += [v for v in typing.get_args(kind) if v != default]
        elif kind is str:
            out += [v for v in CANDIDATE_TEXT if v != default]
        elif typing.get_origin(kind) is tuple:
            out += [(v,) for v in CANDIDATE_TEXT]
    # the default last: a field of two values (a flag) sets it back over the global one
    return [v for v in out if v != default] + ([default] if default is not None else [])


def settable() -> list[tuple[str, Any, Any, Any]]:
    """(field, built-in default, global value, tenant value) for every field a tenant file
    may set — the tenant's own and its policy's — generated from the config model. The
    global value differs from the built-in default, the tenant's from the global one."""
    from runloop_proxy.config import Policy, TenantSpec

    rows = []
    fields = {**{n: f for n, f in TenantSpec.model_fields.items() if n not in NOT_SETTINGS},
              **{f"policy.{n}": f for n, f in Policy.model_fields.items()}}
    for name, field in fields.items():
        default = field.default
        valid = [v for v in _candidates(field, default) if _valid(name, v)]
        assert len(valid) >= 2 and valid[0] != default, \
            f"{name}: no two values to set it to: teach _candidates its type"
        rows.append((name, default, valid[0], valid[1]))
    return rows


def _valid(name: str, value: Any) -> bool:
    """Whether a tenant may set the field so (the model's validation, and the loader's: an
    upstream it names is configured)."""
    from pydantic import ValidationError

    from runloop_proxy.config import Policy, TenantSpec

    if name in ("upstream", "policy.summary_upstream", "policy.embedding_upstream") \
            and value not in UPSTREAMS:
        return False
    try:
        if name.startswith("policy."):
            Policy.model_validate({name[7:]: value})
        else:
            TenantSpec.model_validate({"name": "t", name: value})
        return True
    except ValidationError:
        return False


def _toml(value: Any) -> str:
    import enum
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return json.dumps(value.value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def tenant_config(root: Path, glob: dict[str, Any], tenant: dict[str, Any]) -> Any:
    """A config whose [defaults] set ``glob`` and whose one tenant sets ``tenant`` (dotted
    names: ``policy.x``, ``models``); the tenant as loaded."""
    from runloop_proxy.config import Settings, load_config

    def section(values: dict[str, Any], table: str) -> str:
        top = "".join(f"{k} = {_toml(v)}\n" for k, v in values.items() if "." not in k)
        policy = "".join(f"{k[7:]} = {_toml(v)}\n" for k, v in values.items()
                         if k.startswith("policy."))
        head = f"[{table}]\n" if table else ""
        return f"{head}{top}\n[{table + '.' if table else ''}policy]\n{policy}"
    (root / "tenants").mkdir(parents=True, exist_ok=True)
    (root / "runloop.toml").write_text(
        "".join(f'[upstreams.{u}]\nurl = "http://127.0.0.1:9/v1"\napi_key = "sk-{u}"\n'
                for u in ("default", *UPSTREAMS)) + section(glob, "defaults"))
    (root / "tenants" / "t.toml").write_text(
        section({"keys": ["tenant-key-0123456789"], **tenant}, ""))
    return load_config(Settings(config_dir=str(root))).tenants["t"]


def effective(spec: Any, name: str) -> Any:
    return getattr(spec.policy, name[7:]) if name.startswith("policy.") else \
        getattr(spec, name)


@pytest.mark.parametrize(("name", "default", "glob", "tenant"), settable(),
                         ids=[row[0] for row in settable()])
def test_a_tenants_own_setting_beats_the_builtins(tmp_path: Path, name: str, default: Any,
                                                   glob: Any, tenant: Any) -> None:
    """Set by the tenant alone it beats the built-in default; set by the global [defaults]
    too, the tenant's still wins; set by [defaults] alone, that applies."""
    own = tenant if tenant != default else glob  # a flag: the value that is not the default
    assert effective(tenant_config(tmp_path / "a", {}, {name: own}), name) == own
    assert effective(tenant_config(tmp_path / "b", {name: glob}, {name: tenant}), name) == tenant
    assert effective(tenant_config(tmp_path / "c", {name: glob}, {}), name) == glob
    assert effective(tenant_config(tmp_path / "d", {}, {}), name) == default


def _models() -> list[str]:
    from runloop_proxy.config import BUILTIN_CONTEXT_WINDOWS

    # every model the proxy knows, a dated snapshot of each family, and one it does not
    return [*BUILTIN_CONTEXT_WINDOWS, "gpt-4o-2024-08-06", "gpt-4.1-mini-2025-04-14",
            "someones-local-model"]


@pytest.mark.parametrize("model", _models())
def test_a_tenants_model_window_and_encoding_beat_the_builtin(tmp_path: Path,
                                                              model: str) -> None:
    from runloop_proxy.config import BUILTIN_CONTEXT_WINDOWS, TenantSpec

    builtin = TenantSpec(name="t").context_window(model)
    glob = {"models": {model: {"context_window": builtin + 1000, "encoding": "cl100k_base"}}}
    own = {"models": {model: {"context_window": builtin // 3, "encoding": "o200k_base"}}}
    alone = tenant_config(tmp_path / "a", {}, own)
    assert (alone.context_window(model), alone.encoding_for(model)) == \
        (builtin // 3, "o200k_base")
    both = tenant_config(tmp_path / "b", glob, own)
    assert (both.context_window(model), both.encoding_for(model)) == (builtin // 3, "o200k_base")
    assert tenant_config(tmp_path / "c", glob, {}).context_window(model) == builtin + 1000
    # the tenant's default window is for models nobody knows: a known model keeps its own
    default = tenant_config(tmp_path / "d", {}, {"default_context_window": 5000})
    known = model in BUILTIN_CONTEXT_WINDOWS or model.startswith(("gpt-4o-", "gpt-4.1-"))
    assert default.context_window(model) == (builtin if known else 5000)


def test_a_tenants_window_for_a_known_model_is_the_one_its_requests_get(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the proxy: acme says gpt-4 (8,192 built in) has 3,000 tokens, globex leaves
    it; a 2,900-token request is refused for acme, naming acme's window, and passes for
    globex. The [defaults] say 6,000 for gpt-4o-mini (128,000 built in): a request of 5,800
    tokens for it is refused."""
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-up")
    monkeypatch.setenv("TEST_ACME_KEY", ACME_KEY)
    root = write_config(tmp_path / "cfg", upstream.url, extra_global="")
    acme = root / "tenants" / "acme.toml"
    acme.write_text(acme.read_text() + '\n[models."gpt-4"]\ncontext_window = 3000\n')
    glob = root / "runloop.toml"
    glob.write_text(glob.read_text().replace(
        "[defaults.policy]", '[defaults.models."gpt-4o-mini"]\ncontext_window = 6000\n'
                             "[defaults.policy]"))
    proxy = make_proxy(config_dir=str(root))
    words = [{"role": "user", "content": "word " * 2900}]

    def ask(key: str, model: str, messages: list[dict[str, Any]]) -> str:
        try:
            openai.OpenAI(base_url=proxy.url, api_key=key, max_retries=0).chat.completions.create(
                model=model, messages=messages, max_tokens=100)  # type: ignore[arg-type]
        except openai.BadRequestError as exc:
            return str(exc)
        return "answered"

    assert "3000-token context" in ask(ACME_KEY, "gpt-4", words)
    assert ask(GLOBEX_KEY, "gpt-4", words) == "answered"
    assert "6000-token context" in ask(GLOBEX_KEY, "gpt-4o-mini", words * 2)


def test_the_command_lines_window_is_a_default_a_tenants_own_beats(tmp_path: Path) -> None:
    """``--default-context-window`` sets every tenant's default — except one that sets its
    own; and it never overrides a known model's window, nor a tenant's model entry."""
    from runloop_proxy.config import Settings, load_config

    tenant_config(tmp_path, {}, {"default_context_window": 7000,
                                 "models": {"gpt-4": {"context_window": 3000}}})
    (tmp_path / "tenants" / "u.toml").write_text('keys = ["other-key-0123456789"]\n')
    config = load_config(Settings(config_dir=str(tmp_path), context_window=5000))
    own, plain = config.tenants["t"], config.tenants["u"]
    assert (own.context_window("my-model"), plain.context_window("my-model")) == (7000, 5000)
    assert (own.context_window("gpt-4"), plain.context_window("gpt-4")) == (3000, 8192)


def test_summary_tokens_are_what_the_summary_model_reported(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The summary-token counters move by the usage the summary calls' answers reported,
    prompt and completion apart; the summary itself is the model's text, whole."""
    from .test_summaries import config, converse, is_summary_call, model

    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-up")
    monkeypatch.setenv("TEST_ACME_KEY", ACME_KEY)
    text = "Goals: track orders #W1000 and #W2000 to their doors."
    upstream.responder = model(lambda body: {"content": text, "prompt_tokens": 1234})
    proxy = make_proxy(config_dir=config(tmp_path, upstream, model="gpt-4o-mini"))
    converse(proxy, "counted-summary", 7, after=lambda k: proxy.settle())
    calls = [b for b in upstream.requests if is_summary_call(b)]

    def sums() -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for f in text_string_to_metric_families(httpx.get(proxy.base + "/metrics").text):
            for s in f.samples:
                if s.name == "runloop_summary_tokens_total" and s.labels["tenant"] == "acme":
                    out[s.labels["kind"]] = s.value
        return out
    def made() -> int:
        return len([b for b in upstream.requests if is_summary_call(b)])

    # every call the upstream answered, counted (one may still be on its way back)
    until(lambda: made() >= 1 and sums() == {"prompt": 1234 * made(),
                                               "completion": (len(text) // 4) * made()},
          timeout=30, what="the summary calls counted as reported")
    assert len(calls) <= made()


def test_times_are_told_in_their_units(make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """A session used now: the admin API's times are milliseconds of now, the inspector's
    dates are today's (UTC), every one of them — and a session without proxy tool rounds
    says so. Under the defaults the extractive digest of the loop is made ahead (the next
    request would omit it): its compression record is dated too, and today."""
    import re
    import time

    admin = "admin-0123456789abcdef"
    proxy: ProxyServer = make_proxy(admin_key=admin)
    start = time.time()
    openai.OpenAI(base_url=proxy.url, api_key="sk-timed", max_retries=0, default_headers={
        "X-Session-Id": "timed"}).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "what time is it"}])
    proxy.settle()

    def viewed() -> dict[str, Any]:
        return httpx.get(proxy.base + "/admin/sessions/timed",  # type: ignore[no-any-return]
                         headers={"Authorization": f"Bearer {admin}"}).json()

    # the digest is made in the background, behind the answer
    until(lambda: viewed()["compression_records"], what="the loop's digest recorded")
    end = time.time()
    view = viewed()
    for field in ("created_ms", "updated_ms"):
        assert start * 1000 - 1000 <= view[field] <= end * 1000 + 1000, (field, view[field])
    records = view["compression_records"]
    assert [r["kind"] for r in records] == ["summary"], records
    for r in records:
        assert start * 1000 - 1000 <= r["ts"] <= end * 1000 + 1000, r
    days = {time.strftime("%Y-%m-%d", time.gmtime(t)) for t in (start, end)}
    c = httpx.Client(base_url=proxy.base)
    assert c.post("/admin/ui/login", data={"key": admin}).status_code == 303
    # the list: the session first seen and last used; its page: created and last used, and
    # each compression record's time
    for page, shown in (("/admin/ui", 2), ("/admin/ui/session?id=timed", 2 + len(records))):
        html = c.get(page).text
        dates = re.findall(r"\b\d{4}-\d{2}-\d{2} ", html)
        assert len(dates) == shown and {d.strip() for d in dates} <= days, (page, dates, days)
    assert "The model has not called recall_tool_call or search_history in this session" in \
        c.get("/admin/ui/session?id=timed").text


def test_requests_are_counted_once_by_what_happened(make_proxy: Any,
                                                    upstream: ScriptedUpstream) -> None:
    """Three answered requests and one refused for its size, each counted once, under its
    model and status (the refusal too: it knew its tenant and model by then)."""
    from prometheus_client.parser import text_string_to_metric_families

    proxy: ProxyServer = make_proxy(context_window=4096)
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-counted", max_retries=0)
    for k in range(3):
        c.chat.completions.create(model="gpt-4o-mini",
                                  messages=[{"role": "user", "content": f"q{k}"}])
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="my-local-model",
                                  messages=[{"role": "user", "content": "word " * 5000}])
    counted = {}
    for f in text_string_to_metric_families(httpx.get(proxy.base + "/metrics").text):
        for s in f.samples:
            if s.name == "runloop_requests_total" and s.value:
                counted[(s.labels["model"], s.labels["status"])] = s.value
    assert counted == {("gpt-4o-mini", "200"): 3, ("my-local-model", "400"): 1}


@pytest.mark.parametrize(("total", "prefix", "cost"), [
    (2000, 1023, 2000),  # a prefix under 1,024 tokens is not cached
    (2000, 1024, 2000 - 1024 + 102.4),  # from 1,024 on, in whole 128-token blocks
    (2000, 1151, 2000 - 1024 + 102.4),
    (2000, 1152, 2000 - 1152 + 115.2),
    (5000, 0, 5000),
])
def test_the_replay_prices_a_cached_prefix_in_the_providers_units(
        total: int, prefix: int, cost: float) -> None:
    from runloop_proxy.ops.replay_offline import cached_cost

    assert cached_cost(total, prefix) == pytest.approx(cost)


# Where each API's request names the output it reserves (the proxy keeps that much of the
# model's window for the answer): (api, path, the field)
RESERVE_FIELDS = [("chat", "/v1/chat/completions", "max_tokens"),
                  ("chat", "/v1/chat/completions", "max_completion_tokens"),
                  ("responses", "/v1/responses", "max_output_tokens"),
                  ("messages", "/v1/messages", "max_tokens"),
                  ("bridge", "/v1/messages", "max_tokens")]


@pytest.mark.parametrize(("api", "path", "field"), RESERVE_FIELDS,
                         ids=[f"{a}-{f}" for a, _, f in RESERVE_FIELDS])
def test_each_api_reserves_the_output_its_request_asks_for(
        make_proxy: Any, upstream: ScriptedUpstream, api: str, path: str, field: str) -> None:
    """A request's own output reserve is what the budget keeps for the answer, in every
    API's spelling of it: a one-question conversation of ~3,000 tokens fits an 8,000-token
    window beside a 100-token answer and is answered, and is refused beside a 6,000-token
    one, the refusal naming that reserve (and 500 more for 6,500). Planted, passed every
    other test: the Responses API's max_output_tokens not read (its requests got the
    policy's reserve, whatever they asked)."""
    proxy = make_proxy(context_window=8_000, upstream_format="chat" if api == "bridge" else None)
    question = "word " * 3_000
    upstream.responder = lambda body: {"content": "fine"}

    def ask(reserve: int) -> httpx.Response:
        body: dict[str, Any] = {"model": "house-model", field: reserve}
        if api == "responses":
            body["input"] = question
        else:
            body["messages"] = [{"role": "user", "content": question}]
        return httpx.post(proxy.base + path, json=body, timeout=30,
                          headers={"Authorization": "Bearer sk-reserve",
                                   "anthropic-version": "2023-06-01"})

    answered = ask(100)
    assert answered.status_code == 200, answered.text
    for reserve in (6_000, 6_500):
        refused = ask(reserve)
        assert refused.status_code == 400, (reserve, refused.text)
        message = refused.json()["error"]["message"]
        assert f"less {reserve} reserved for the output" in message, message
