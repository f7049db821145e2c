"""Claude Code's habits through the proxy, with the anthropic SDK sending what Claude Code
2.1.332 sends (checked against the CLI's requests to a scripted upstream): a main session whose
model thinks before every call (thinking blocks with signatures the upstream checks when they
come back), a subagent (the Task tool) whose requests carry the main session's id beside its
own ``X-Claude-Code-Agent-Id`` and a system prompt of its own, interleaved with the main
session's, and ``/context``'s storm of ``count_tokens`` while a turn is in flight."""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson

from runloop_proxy.scripted import ScriptedUpstream
from runloop_proxy.scripted_messages import signature

from .conftest import ProxyServer
from .keys import anthropic_key

ADMIN = "admin-habits-0123456789abcdef"
KEY = anthropic_key(21)
TENANT = "pt-" + hashlib.sha256(KEY.encode()).hexdigest()[:16]
MODEL = "claude-sonnet-4-6"
SESSION = "5f0c9b8e-1d2a-4e3f-9a7b-6c5d4e3f2a1b"
AGENT = "a99fa87e13d6a2af1"
MAX_TOKENS = 32_000  # Claude Code's for Sonnet 4.6 (64,000 and 128,000 for others)
BETAS = "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27"
TOOLS = [{"name": n, "description": f"the {n} tool", "input_schema": {
    "type": "object", "properties": {"arg": {"type": "string"}}}}
    for n in ("Bash", "Read", "Grep", "Task")]
MAIN_SYSTEM = "x-anthropic-billing-header: cc_version=2.1.332.c53; cc_entrypoint=sdk-cli;"
SUB_SYSTEM = MAIN_SYSTEM + " cc_is_subagent=true;"
TASK_PROMPT = "find which log names the failing job"
STEPS = 6  # the main session's Bash calls, each reading a log of ~2,500 tokens


def log(k: int) -> str:
    return "\n".join(f"build-{k} step {i}: compiled module_{k}_{i}.o in {i % 7}.{i}s"
                     for i in range(160))


def model(body: dict[str, Any]) -> dict[str, Any]:
    """The scripted model: thinks before each call. The main session reads ``STEPS`` logs
    with Bash (the last result says which it read: the window cuts older ones), then hands
    a Task to a subagent and answers with what it says; the subagent greps once and
    answers."""
    system = "".join(b["text"] for b in body["system"])
    results = [b for m in body["messages"] if m["role"] == "user" and isinstance(
        m["content"], list) for b in m["content"] if b.get("type") == "tool_result"]
    if "cc_is_subagent=true" in system:
        if not results:
            return {"reasoning": "grep the logs for FAILED", "content": "Searching.",
                    "tool_calls": [{"id": "toolu_01SubGrep", "name": "Grep",
                                    "arguments": {"arg": "FAILED"}}]}
        return {"reasoning": "the grep found it", "content": "build-3 names the failing job"}
    last = results[-1]["tool_use_id"] if results else None  # (older ones may be cut)
    if last == "toolu_01Task":
        return {"reasoning": "the subagent answered", "content": "the failing job: build-3"}
    k = int(last.removeprefix("toolu_01Main")) + 1 if last else 0
    if k < STEPS:
        return {"reasoning": f"read log {k} next", "content": f"Reading log {k}.",
                "tool_calls": [{"id": f"toolu_01Main{k:02d}", "name": "Bash",
                                "arguments": {"arg": f"cat build-{k}.log"}}]}
    return {"reasoning": "hand the search to a subagent", "content": "Delegating.",
            "tool_calls": [{"id": "toolu_01Task", "name": "Task",
                            "arguments": {"arg": TASK_PROMPT}}]}


def turn(client: anthropic.Anthropic, system: str, messages: list[dict[str, Any]],
         agent: str | None = None) -> list[dict[str, Any]]:
    """One streamed request as Claude Code makes it; the answer's blocks appended to
    ``messages`` as Claude Code sends them back (the SDK's blocks as JSON), and returned."""
    headers = {"X-Claude-Code-Session-Id": SESSION, "anthropic-beta": BETAS,
               **({"X-Claude-Code-Agent-Id": agent} if agent else {})}
    with client.messages.stream(
            model=MODEL, max_tokens=MAX_TOKENS, tools=TOOLS, messages=messages,
            system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
            thinking={"type": "enabled", "budget_tokens": 8_000},
            metadata={"user_id": orjson.dumps({"device_id": "4fac8bcc5dc01d92f851dc2f0e8",
                                               "account_uuid": "",
                                               "session_id": SESSION}).decode()},
            extra_headers=headers) as stream:
        final = stream.get_final_message()
    blocks = [b.model_dump(exclude_none=True) for b in final.content]
    messages.append({"role": "assistant", "content": blocks})
    return blocks


def result(call: dict[str, Any], text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                         "content": text}]}


def test_a_subagent_is_a_session_beside_the_main_one_and_every_signature_comes_back(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """The main session (six Bash reads, compressed past the default working budget) hands
    a Task to a subagent, whose two requests come between the main session's. Every request
    is answered: every thinking block the upstream gets back is one it answered, byte for
    byte (it refuses any other, as Anthropic does); the main session is stored as one
    branch holding none of the subagent's conversation, the subagent as a session of its
    own. Red with the agent id left out of the session (the subagent's requests a second
    branch of the main session) and with a thought's text changed on the way back (the
    upstream's 400)."""
    proxy: ProxyServer = make_proxy(admin_key=ADMIN)
    upstream.responder = model
    client = anthropic.Anthropic(base_url=proxy.base, api_key=KEY, max_retries=0)
    main: list[dict[str, Any]] = [{"role": "user", "content": "why does the build fail?"}]
    while True:
        blocks = turn(client, MAIN_SYSTEM, main)
        call = next((b for b in blocks if b["type"] == "tool_use"), None)
        if call is None:
            break
        if call["name"] != "Task":
            main.append(result(call, log(len(main) // 2)))
            continue
        sub: list[dict[str, Any]] = [{"role": "user", "content": TASK_PROMPT}]
        grep = next(b for b in turn(client, SUB_SYSTEM, sub, AGENT) if b["type"] == "tool_use")
        sub.append(result(grep, "build-3.log:41: FAILED job=integration-7"))
        said = turn(client, SUB_SYSTEM, sub, AGENT)[-1]["text"]
        main.append(result(call, said))
    assert main[-1]["content"][-1]["text"] == "the failing job: build-3"
    # every thought came back as it was answered (the upstream would have refused it)
    sent_back = [b for body in upstream.requests for m in body["messages"]
                 if m["role"] == "assistant" for b in m["content"] if b["type"] == "thinking"]
    assert sent_back and all(b["signature"] == signature(b["thinking"]) for b in sent_back)
    metrics = proxy.metrics.registry
    labels = {"tenant": "passthrough", "model": MODEL}
    assert metrics.get_sample_value("runloop_prompt_tokens_forwarded_total", labels) < \
        metrics.get_sample_value("runloop_prompt_tokens_client_total", labels)  # compressed
    proxy.settle()
    auth = {"Authorization": f"Bearer {ADMIN}"}
    listed = httpx.get(f"{proxy.base}/admin/sessions", headers=auth,
                       params={"tenant": TENANT}).json()["sessions"]
    assert sorted(s["session_id"] for s in listed) == [f"n:{SESSION}",
                                                       f"n:{SESSION}.agent-{AGENT}"]
    views = {s["session_id"]: httpx.get(
        f"{proxy.base}/admin/sessions/{s['session_id']}", headers=auth,
        params={"tenant": TENANT, "messages": "1"}).json() for s in listed}
    assert [len(v["branches"]) for v in views.values()] == [1, 1]
    stored_main = orjson.dumps(views[f"n:{SESSION}"]["messages"]).decode()
    assert "FAILED job=integration-7" not in stored_main and "grep the logs" not in stored_main
    assert "FAILED job=integration-7" in orjson.dumps(
        views[f"n:{SESSION}.agent-{AGENT}"]["messages"]).decode()


def test_a_count_tokens_storm_is_answered_while_a_turn_is_in_flight(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """``/context`` sends many ``count_tokens`` at once, for the session whose turn is still
    waiting on the model. All 32 are answered while the turn's answer is held upstream, each
    with the count the same request got alone (the answer recalibrates the model's counts
    after), none sent upstream (the proxy counts its
    window); then the turn is answered in full. Red with the count sent upstream (the storm
    waits behind the held turn)."""
    proxy: ProxyServer = make_proxy(admin_key=ADMIN)
    client = anthropic.Anthropic(base_url=proxy.base, api_key=KEY, max_retries=0)
    held, storm_done = threading.Event(), threading.Event()

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        held.set()
        storm_done.wait(30)  # the model "thinks" until the storm has been answered
        return {"reasoning": "answer the question", "content": "the build is green"}

    upstream.responder = respond
    messages: list[dict[str, Any]] = [{"role": "user", "content": "is the build green?"}]
    for k in range(3):
        messages += [{"role": "assistant", "content": [{
            "type": "tool_use", "id": f"toolu_01Ctx{k:02d}", "name": "Bash",
            "input": {"arg": f"cat build-{k}.log"}}]}, result({"id": f"toolu_01Ctx{k:02d}"},
                                                              log(k))]
    messages.append({"role": "user", "content": "and now?"})
    answered: list[str] = []
    main = threading.Thread(target=lambda: answered.append(
        turn(client, MAIN_SYSTEM, list(messages))[-1]["text"]))
    main.start()
    assert held.wait(30), "the turn did not reach the upstream"

    def count() -> int:
        return client.messages.count_tokens(
            model=MODEL, messages=messages, tools=TOOLS, system=MAIN_SYSTEM,
            extra_headers={"X-Claude-Code-Session-Id": SESSION, "anthropic-beta": BETAS},
        ).input_tokens

    alone = count()
    with ThreadPoolExecutor(8) as pool:
        counts = list(pool.map(lambda _: count(), range(32)))
    assert not answered  # all answered while the turn was held
    storm_done.set()
    main.join(30)
    assert answered == ["the build is green"]
    assert counts == [alone] * 32 and alone > 0
    assert not [o for o in upstream.other if o[1].endswith("/count_tokens")]


def test_a_recalled_result_is_cut_to_the_room_a_known_window_leaves(
        make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """A 12,000-token window (the tenant's ``[models]``): the window cuts a ~9k-token log,
    the model recalls it whole by its call's id, and the proxy's round that carries the
    recall goes to the same window. The recalled result is cut where the window's room
    ends, and says so (with the search tool to find the rest); the round fits the window
    and the client gets the model's answer. Red with the result recalled whole (the round
    22,805 tokens on a 12k window)."""
    window = 12_000
    cfg = tmp_path / "cfg"
    (cfg / "tenants").mkdir(parents=True)
    (cfg / "runloop.toml").write_text(
        f'[upstreams.claude]\nurl = "{upstream.url}"\nformat = "anthropic"\n'
        f'api_key = "{anthropic_key(22)}"\n')
    (cfg / "tenants" / "dev.toml").write_text(
        f'keys = ["{KEY}"]\nupstream = "claude"\n[policy]\nsoft_budget_tokens = 100000\n'
        f'[models."{MODEL}"]\ncontext_window = {window}\n')
    proxy: ProxyServer = make_proxy(config_dir=str(cfg))
    big = "\n".join(f"build-0 step {i}: linked target_{i} with {i * 7} symbols, "
                    f"checksum {i * 7919:08x}" for i in range(600))

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        recalled = [b for b in results_of_messages(body) if b["tool_use_id"] == "toolu_01Rc"]
        if recalled:
            return {"content": "recalled " + ("cut" if "[runloop-proxy] cut here" in
                                              orjson.dumps(recalled).decode() else "whole")}
        return {"content": "Checking build 0 again.", "tool_calls": [{
            "id": "toolu_01Rc", "name": "recall_tool_call",
            "arguments": {"call_id": "toolu_01Big0"}}]}

    upstream.responder = respond
    messages: list[dict[str, Any]] = [{"role": "user", "content": "why does linking fail?"}]
    for k in range(4):
        messages += [{"role": "assistant", "content": [{
            "type": "tool_use", "id": f"toolu_01Big{k}", "name": "Bash",
            "input": {"arg": f"cat link-{k}.log"}}]},
            result({"id": f"toolu_01Big{k}"}, big if k == 0 else log(k))]
    client = anthropic.Anthropic(base_url=proxy.base, api_key=KEY, max_retries=0)
    answer = client.messages.create(model=MODEL, max_tokens=1_000, tools=TOOLS,
                                    messages=messages)
    first, second = upstream.requests[-2:]
    assert big not in orjson.dumps(first).decode()  # the window cut it
    sizes = [upstream.anthropic.tokens(b) for b in (first, second)]
    assert max(sizes) <= window, sizes
    assert answer.content[0].text == "recalled cut"  # type: ignore[union-attr]


def results_of_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [b for m in body["messages"] if m["role"] == "user" and isinstance(
        m["content"], list) for b in m["content"] if b.get("type") == "tool_result"]
