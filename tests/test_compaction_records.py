"""What a request's window did, recorded and counted, for every API, through real servers: a
request that brings several turns at once records the steps the window took at each of them
(an omission is a ``loop_omission``, wherever it happened), exactly as the same conversation
sent turn by turn records them, and no step twice — also on a replica that has not seen the
session before."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import httpx
import openai
import orjson
import pytest

from runloop_proxy.scripted import ScriptedUpstream
from runloop_proxy.window.builder import CompactionKind

from .conftest import ProxyServer
from .policies import MECHANISM
from .test_responses import recalling

ADMIN = "admin-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
KEY = "sk-records"
TENANT = "pt-" + hashlib.sha256(KEY.encode()).hexdigest()[:16]
WINDOW_KINDS = {k.value for k in CompactionKind} - {"summary"}  # the store records more
BIG = "\n".join(f"row {{k}}-{i}: value {i * 7}" for i in range(300))
CHAT_TOOLS = [{"type": "function", "function": {"name": "shell", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "shell", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}}}]


def chat_turns(n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "You look at files."}]
    for k in range(n):
        args = orjson.dumps({"cmd": f"cat f{k}"}).decode()
        out += [{"role": "user", "content": f"task {k}: look at f{k}"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": f"call_{k}", "type": "function",
                     "function": {"name": "shell", "arguments": args}}]},
                {"role": "tool", "tool_call_id": f"call_{k}", "content": BIG.format(k=k)},
                {"role": "assistant", "content": f"f{k} looks fine"}]
    return out


def responses_turns(n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for k in range(n):
        out += [{"type": "message", "role": "user", "content": f"task {k}: look at f{k}"},
                {"type": "reasoning", "id": f"rs_{k}", "summary": [],
                 "encrypted_content": f"opaque-{k}"},
                {"type": "function_call", "id": f"fc_{k}", "call_id": f"call_{k}",
                 "name": "shell", "arguments": orjson.dumps({"cmd": f"cat f{k}"}).decode()},
                {"type": "function_call_output", "call_id": f"call_{k}",
                 "output": BIG.format(k=k)},
                {"type": "message", "role": "assistant", "id": f"msg_{k}",
                 "content": [{"type": "output_text", "text": f"f{k} looks fine",
                              "annotations": []}]}]
    return out


def answers(item: dict[str, Any]) -> bool:
    """Whether an item opens the model's answer (a request point comes before it)."""
    return item.get("role") == "assistant" or item.get("type") == "reasoning"


class Client:
    """The same conversation through either API (the request's list and how it is sent)."""

    def __init__(self, proxy: ProxyServer, api: str, session: str, model: str = "gpt-4o-mini"):
        self.api, self.model = api, model
        self.sdk = openai.OpenAI(base_url=proxy.url, api_key=KEY, max_retries=0,
                                 default_headers={"X-Session-Id": session})

    def conversation(self, n: int) -> list[dict[str, Any]]:
        ask = [{"role": "user", "content": "and now?"}]
        return (chat_turns(n) if self.api == "chat" else responses_turns(n)) + ask

    def send(self, items: list[dict[str, Any]], **extra: Any) -> Any:
        """The answer, its ``X-Runloop-Tokens`` header kept as ``answer.runloop_tokens``."""
        if self.api == "chat":
            raw: Any = self.sdk.chat.completions.with_raw_response.create(
                model=self.model, messages=items, tools=CHAT_TOOLS, **extra)  # type: ignore[arg-type]
        else:
            raw = self.sdk.responses.with_raw_response.create(
                model=self.model, input=items, tools=RESPONSES_TOOLS, **extra)  # type: ignore[arg-type]
        answer = raw.parse()
        answer.runloop_tokens = raw.headers.get("x-runloop-tokens")
        return answer

    def reply(self, answer: Any) -> list[dict[str, Any]]:
        if self.api == "chat":
            return [answer.choices[0].message.model_dump(exclude_none=True)]
        return [o.model_dump(exclude_none=True) for o in answer.output]


def records(proxy: ProxyServer, session: str) -> list[tuple[Any, ...]]:
    proxy.settle()
    view = httpx.get(f"{proxy.base}/admin/sessions/{session}", headers=AUTH,
                     params={"tenant": TENANT}).json()
    return [(r["kind"], r["at_message"], r["tokens_before"], r["tokens_after"], r["reason"])
            for r in view["compression_records"] if r["kind"] in WINDOW_KINDS]


def counted(proxy: ProxyServer, kind: str) -> float:
    found = re.search(rf'runloop_compaction_events_total\{{kind="{kind}",model="gpt-4o-mini"'
                      r'[^}]*\} (\S+)', httpx.get(proxy.base + "/metrics").text)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_request_that_brings_many_turns_records_each_step(
        make_proxy: Any, upstream: ScriptedUpstream, api: str) -> None:
    proxy: ProxyServer = make_proxy(admin_key=ADMIN, policy=MECHANISM)
    at_once = Client(proxy, api, "at-once")
    conversation = at_once.conversation(12)
    answer = at_once.send(conversation)
    whole = records(proxy, "at-once")
    kinds = [r[0] for r in whole]
    # the loops the window omits were omitted at an earlier point of this one request
    assert "loop_omission" in kinds and "past_loop_reduction" in kinds
    assert len({r[1] for r in whole}) > 1  # taken at several of its points
    assert counted(proxy, "loop_omission") == kinds.count("loop_omission")
    assert counted(proxy, "past_loop_reduction") == kinds.count("past_loop_reduction")

    # the same conversation turn by turn records the same steps, each once
    one_by_one = Client(proxy, api, "turn-by-turn")
    for cut in [i for i, item in enumerate(conversation) if answers(item)]:
        one_by_one.send(conversation[:cut])
    one_by_one.send(conversation)
    assert records(proxy, "turn-by-turn") == whole
    assert counted(proxy, "loop_omission") == 2 * kinds.count("loop_omission")

    # a replica that has not seen the session records only what the next request adds
    fresh = ProxyServer(proxy.settings, proxy.config).start()
    try:
        later = Client(fresh, api, "at-once")
        later.send([*conversation, *at_once.reply(answer), {"role": "user", "content": "ok"}])
        after = records(fresh, "at-once")
        assert after[:len(whole)] == whole
        assert all(r[1] > max(r[1] for r in whole) for r in after[len(whole):])
    finally:
        fresh.stop()


def test_with_the_proxys_rounds_spliced_in_no_step_is_recorded_twice(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """After the model recalled a result, every later request has the proxy's round spliced
    back into it: where what it brings begins is found in that spliced conversation."""
    proxy: ProxyServer = make_proxy(admin_key=ADMIN, policy=MECHANISM)
    upstream.responder = recalling("call_11", 11)
    client = Client(proxy, "responses", "spliced")
    conversation = client.conversation(14)
    for cut in [i for i, item in enumerate(conversation) if answers(item)]:
        client.send(conversation[:cut])
    answer = client.send(conversation)
    assert answer.output_text.startswith("recalled")
    # the client goes on from the reply it got: the round behind it is spliced back in
    for k in range(3):
        conversation += [*client.reply(answer), {"role": "user", "content": f"more {k}"}]
        answer = client.send(conversation)
    proxy.settle()
    view = httpx.get(f"{proxy.base}/admin/sessions/spliced", headers=AUTH,
                     params={"tenant": TENANT, "messages": "1"}).json()
    assert view["proxy_tool_exchanges"] >= 1  # the model recalled: a round was kept
    steps = [(kind, at) for kind, at, *_ in records(proxy, "spliced")]
    assert steps and len(steps) == len(set(steps))


def test_a_request_of_very_many_turns_writes_a_bounded_number_of_records(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Each step is counted in the metric, but what one request writes (and logs) is bounded:
    its last STEPS_KEPT steps one by one and the earlier ones in one record that counts them
    by kind — 120 turns at once took some 120 steps and wrote as many records, one round trip
    each, before."""
    from runloop_proxy.pipeline.shaping import STEPS_KEPT

    proxy: ProxyServer = make_proxy(admin_key=ADMIN, policy=MECHANISM)
    Client(proxy, "chat", "very-many").send(Client(proxy, "chat", "x").conversation(120))
    proxy.settle()
    view = httpx.get(f"{proxy.base}/admin/sessions/very-many", headers=AUTH,
                     params={"tenant": TENANT}).json()
    recs = view["compression_records"]
    steps = [r for r in recs if r["kind"] in WINDOW_KINDS]
    earlier = [r for r in recs if r["kind"] == "steps"]
    assert len(steps) == STEPS_KEPT and len(earlier) == 1
    total = sum(counted(proxy, k) for k in WINDOW_KINDS)
    assert earlier[0]["count"] + len(steps) == total > STEPS_KEPT
    assert sum(earlier[0]["kinds"].values()) == earlier[0]["count"]
    assert earlier[0]["until_message"] < steps[0]["at_message"]
