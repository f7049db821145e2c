"""Noninterference, through real servers: what one conversation did never changes what another
conversation's model reads.

A session nobody named is found by guessing (a fingerprint of its opening, a reply it echoes,
a trimmed history lining up with a stored one), and a guess can join strangers. So the rule is
not "find the right session" but: **every body the upstream receives for a conversation is the
same, byte for byte, whether or not another conversation ran before it** in the same tenant —
one that opened alike, got the same long reply, reused the same low-entropy call id, or whose
transcript the stranger partly knows. Each case runs the stranger twice, on two fresh proxies
(each with its own scripted upstream and store namespace): once alone, once after the victim;
the two runs' upstream bodies must be equal, and none may hold the victim's secret. The
stranger's model searches the history for the secret and recalls every call id it knows before
each answer, so every reach the proxy's tools have is exercised. Swept over the ways to line
up, every API (chat JSON and streamed, Responses, Messages) and the policies that keep state
between requests (summaries, omissions, elisions, the proxy's tools always on).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pytest

from runloop_proxy.conversation.blocks import to_messages as blocks_to_messages
from runloop_proxy.conversation.items import to_messages as items_to_messages
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer
from .test_config import ACME_KEY, write_config

SECRET = "ACCT-ALICE-77120931"
CARD = "CARD-ALICE-4111"
GREETING = ("Hello! I am the account assistant of Example Bank. I can look up balances, "
            "explain recent transactions, order replacement cards, update your address and "
            "walk you through any form you need. Tell me what you would like to do today, and "
            "give me a moment while I open your file; it usually takes a few seconds.")
SYSTEM = "Bank bot. Be brief."
POLICIES = {
    # the proxy's tools on every request, past loops reduced, results elided early
    "default": 'proxy_tools = "always"\n'
               'soft_budget_tokens = 1500\nclear_at_least = 200\nmax_run_loops = 2\n'
               'omit_batch = 1\n',
    # every turn omits the one before behind an extractive summary
    "summaries": 'proxy_tools = "always"\nsummary_model = "extractive"\nmax_run_loops = 0\n'
                 'omit_batch = 1\n',
}
Turn = dict[str, Any]


def conversation_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Whatever API the body speaks, its conversation as chat messages."""
    if "input" in body:
        return items_to_messages(body.get("input"), body.get("instructions"))
    if "system" in body:  # the Messages clients here always send one
        return blocks_to_messages(body.get("messages"), body.get("system"))
    return list(body.get("messages") or [])


def tool_names(body: dict[str, Any]) -> list[str]:
    out = []
    for t in body.get("tools") or []:
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        out.append(str(fn.get("name")))
    return out


def model(body: dict[str, Any]) -> dict[str, Any]:
    """The fake LLM: a pure function of what it is shown. Before it answers a user it asks the
    proxy's tools for everything a curious model would (a search for the secret's words, a
    recall of every call id and ref it can see or guess); then "Hello" gets the long greeting,
    a user who says "look" gets a client lookup under the low-entropy id ``call_0``, and
    anything else an answer quoting what the model was shown last."""
    msgs = conversation_of(body)
    names = tool_names(body)
    search = next((n for n in names if n.endswith("search_history")), None)
    recall = next((n for n in names if n.endswith("recall_tool_call")), None)
    last = msgs[-1]
    asked = next((m for m in reversed(msgs) if m.get("role") == "user"), {})
    text = str(asked.get("content"))
    if last.get("role") == "user" and search and recall:
        seen = " ".join(str(m.get("content")) for m in msgs)
        refs = sorted(set(re.findall(r'call_id="([^"]+)"', seen)) | {"call_0", "call_1"})
        return {"tool_calls": [
            {"id": f"probe_s{len(msgs)}", "name": search, "arguments": {"query": "ACCT ALICE"}},
            *({"id": f"probe_r{len(msgs)}_{k}", "name": recall, "arguments": {"call_id": r}}
              for k, r in enumerate(refs[:4]))]}
    if text == "Hello":
        return {"content": GREETING}
    if text.startswith("look") and not any(m.get("role") == "tool"
                                           and m.get("tool_call_id") == "call_0"
                                           for m in msgs[msgs.index(asked):]):
        return {"tool_calls": [{"id": "call_0", "name": "lookup", "arguments": {"q": text}}]}
    return {"content": f"Noted ({len(msgs)} messages): {text[:80]}"}


LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}


@dataclass
class Client:
    """One end user's client in one API: sends its conversation, keeps the replies as its SDK
    hands them back, answers its own tool's calls with ``results``."""

    api: str
    proxy: ProxyServer
    results: Callable[[str], str]
    messages: list[dict[str, Any]] = field(default_factory=list)

    def say(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        for _ in range(4):
            reply = self._send()
            self.messages.append(reply)
            calls = reply.get("tool_calls") or []
            if not calls:
                return
            for c in calls:
                q = orjson.loads(c["function"]["arguments"]).get("q", "")
                self.messages.append({"role": "tool", "tool_call_id": c["id"],
                                      "content": self.results(q)})
        raise AssertionError("the conversation did not settle")

    def _send(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"max_retries": 0, "timeout": 30}
        if self.api in ("chat", "stream"):
            c = openai.OpenAI(base_url=self.proxy.url, api_key=ACME_KEY, **kw)
            if self.api == "chat":
                msg = c.chat.completions.create(model="gpt-4o-mini", messages=self.messages,  # type: ignore[arg-type]
                                                tools=[LOOKUP]).choices[0].message  # type: ignore[list-item]
                return msg.model_dump(exclude_none=True)
            text, calls = "", []
            with c.chat.completions.create(model="gpt-4o-mini", messages=self.messages,  # type: ignore[arg-type]
                                           tools=[LOOKUP], stream=True) as s:  # type: ignore[list-item]
                for chunk in s:
                    d = chunk.choices[0].delta if chunk.choices else None
                    if d is None:
                        continue
                    text += d.content or ""
                    for tc in d.tool_calls or []:
                        if tc.index >= len(calls):
                            calls.append({"id": tc.id, "type": "function",
                                          "function": {"name": "", "arguments": ""}})
                        fn = calls[tc.index]["function"]
                        fn["name"] += (tc.function.name or "") if tc.function else ""
                        fn["arguments"] += (tc.function.arguments or "") if tc.function else ""
            out: dict[str, Any] = {"role": "assistant", "content": text or None}
            return {**out, "tool_calls": calls} if calls else out
        if self.api == "responses":
            c = openai.OpenAI(base_url=self.proxy.url, api_key=ACME_KEY, **kw)
            r = c.responses.create(model="gpt-4o-mini", input=_items(self.messages),  # type: ignore[arg-type]
                                   tools=[{"type": "function", "name": "lookup",
                                           "parameters": LOOKUP["function"]["parameters"]}])
            calls = [{"id": o.call_id, "type": "function",
                      "function": {"name": o.name, "arguments": o.arguments}}
                     for o in r.output if o.type == "function_call"]
            out = {"role": "assistant", "content": r.output_text or None}
            return {**out, "tool_calls": calls} if calls else out
        a = anthropic.Anthropic(base_url=self.proxy.base, api_key=ACME_KEY, **kw)
        m = a.messages.create(model="claude-sonnet-4-6", max_tokens=256, system=SYSTEM,
                              messages=_blocks(self.messages),  # type: ignore[arg-type]
                              tools=[{"name": "lookup", "input_schema":
                                      LOOKUP["function"]["parameters"]}])  # type: ignore[list-item]
        text = "".join(b.text for b in m.content if b.type == "text")
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": orjson.dumps(b.input).decode()}}
                 for b in m.content if b.type == "tool_use"]
        out = {"role": "assistant", "content": text or None}
        return {**out, "tool_calls": calls} if calls else out


def _items(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                        "output": m["content"]})
            continue
        if m.get("content"):
            out.append({"role": m["role"], "content": m["content"]})
        for c in m.get("tool_calls") or []:
            out.append({"type": "function_call", "call_id": c["id"],
                        "name": c["function"]["name"], "arguments": c["function"]["arguments"]})
    return out


def _blocks(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "system":
            continue
        if m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"],
                     "content": m["content"]}
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
            continue
        if m["role"] == "assistant":
            content: list[dict[str, Any]] = []
            if m.get("content"):
                content.append({"type": "text", "text": m["content"]})
            for c in m.get("tool_calls") or []:
                content.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                                "input": orjson.loads(c["function"]["arguments"])})
            out.append({"role": "assistant", "content": content})
        else:
            out.append({"role": "user", "content": m["content"]})
    return out


@dataclass(frozen=True)
class LineUp:
    """A way a stranger's conversation lines up with the victim's: what she said (each a user
    turn, answered and recorded), and what he sends before his own turns (his opening)."""

    victim: tuple[str, ...]
    opening: tuple[Turn, ...]
    turns: tuple[str, ...] = ("what is my account number?", "look mine", "and my card?")


LINE_UPS = {
    # both open alike: one fingerprint
    "same-opening": LineUp(("Hello", f"My account number is {SECRET}", "look it up",
                            f"and card {CARD}"), ({"role": "user", "content": "Hello"},)),
    # she got the long greeting after her secrets; he opens with it (a trimmed history)
    "long-greeting": LineUp((f"My account number is {SECRET}", "look it up", "Hello"),
                            ({"role": "user", "content": "Hello"},
                             {"role": "assistant", "content": GREETING})),
    # the greeting echoed as his first assistant turn, after an opening of his own
    "echoed-greeting": LineUp((f"My account number is {SECRET}", "Hello"),
                              ({"role": "user", "content": "Hi there"},
                               {"role": "assistant", "content": GREETING})),
    # her lookup's low-entropy call id, his own result under it
    "reused-call-id": LineUp((f"look {SECRET}",),
                             ({"role": "user", "content": "look mine"},
                              {"role": "assistant", "content": None, "tool_calls": [
                                  {"id": "call_0", "type": "function", "function": {
                                      "name": "lookup", "arguments": '{"q": "look mine"}'}}]},
                              {"role": "tool", "tool_call_id": "call_0",
                               "content": "nothing on file"})),
}


def victim_results(q: str) -> str:
    return f"record for {q}: account {SECRET}, card {CARD}, balance 9,120.44 " + "row " * 60


def stranger_results(q: str) -> str:
    return f"record for {q}: nothing on file " + "row " * 60


def run(tmp: Path, name: str, make_proxy: Any, policy: str, api: str,
        line_up: LineUp, with_victim: bool) -> list[bytes]:
    """Fresh upstream and proxy; the victim's turns (if any), then the stranger's: the bodies
    the upstream received for the stranger."""
    upstream = ScriptedUpstream(prompt_cache=True)
    upstream.ids_by_request = True  # the same request answered with the same ids either way
    upstream.start()
    try:
        upstream.responder = model
        root = write_config(tmp / name, upstream.url, acme_policy=policy)
        proxy: ProxyServer = make_proxy(config_dir=str(root))
        if with_victim:
            her = Client(api, proxy, victim_results,
                         [{"role": "system", "content": SYSTEM}])
            for said in line_up.victim:
                her.say(said)
                proxy.settle()
            assert any(SECRET.encode() in b for b in upstream.raw_bodies), \
                "the victim's own model saw her secret"
        seen = len(upstream.raw_bodies)
        him = Client(api, proxy, stranger_results,
                     [{"role": "system", "content": SYSTEM}, *map(dict, line_up.opening)])
        for said in line_up.turns:
            him.say(said)
            proxy.settle()
        return list(upstream.raw_bodies[seen:])
    finally:
        upstream.stop()


def interleaved(tmp: Path, name: str, make_proxy: Any, policy: str, api: str,
                with_stranger: bool) -> list[bytes]:
    """Fresh upstream and proxy; the victim's turns, each followed (if ``with_stranger``) by a
    turn of a stranger who opens alike (one fingerprint, one stored session): the bodies the
    upstream received for the victim."""
    upstream = ScriptedUpstream(prompt_cache=True)
    upstream.ids_by_request = True  # the same request answered with the same ids either way
    upstream.start()
    try:
        upstream.responder = model
        root = write_config(tmp / name, upstream.url, acme_policy=policy)
        proxy: ProxyServer = make_proxy(config_dir=str(root))
        opening = [{"role": "system", "content": SYSTEM}]
        her = Client(api, proxy, victim_results, list(opening))
        him = Client(api, proxy, stranger_results, list(opening))
        mine: list[bytes] = []
        for said, his in zip(("Hello", f"My account number is {SECRET}", "look it up",
                              "and my card?", "thanks"),
                             ("Hello", "look mine", "what is my account number?", "ok", "bye"),
                             strict=True):
            seen = len(upstream.raw_bodies)
            her.say(said)
            proxy.settle()
            mine += upstream.raw_bodies[seen:]
            if with_stranger:
                him.say(his)
                proxy.settle()
        return mine
    finally:
        upstream.stop()


@pytest.mark.parametrize("api", ["chat", "stream", "responses", "messages"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_stranger_in_her_session_changes_nothing_she_is_sent(
        tmp_path: Path, make_proxy: Any, monkeypatch: pytest.MonkeyPatch,
        policy: str, api: str) -> None:
    """The other way round: a stranger who opens as she did shares her stored session, turn
    for turn. What her model reads is what it would read had he never come (nothing of his,
    and nothing the session keeps between requests — a window carried, a summary pending, a
    request remembered — taken from his turns)."""
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-up")
    monkeypatch.setenv("TEST_ACME_KEY", ACME_KEY)
    alone = interleaved(tmp_path, "alone", make_proxy, POLICIES[policy], api, False)
    shared = interleaved(tmp_path, "shared", make_proxy, POLICIES[policy], api, True)
    for body in shared:
        assert b"nothing on file" not in body and b"look mine" not in body, \
            "her model was shown his turns"
    assert len(shared) == len(alone), "the same rounds either way"
    for k, (a, b) in enumerate(zip(alone, shared, strict=True)):
        assert _normal(a) == _normal(b), (
            f"request {k} of hers differs with the stranger beside her:\n"
            f"alone: {a[:3000]!r}\nshared: {b[:3000]!r}")


_IDS = re.compile(rb'"(?:id|call_id|tool_use_id)"\s*:\s*'
                  rb'"(?:chatcmpl|resp|msg|rs|fc|ctc|toolu)-?_?[0-9A-Za-z]+"')


def _normal(body: bytes) -> bytes:
    """A body with the ids a scripted answer numbers from a process-wide counter blanked (a
    Responses or Messages client echoes them back): they differ between any two runs."""
    return _IDS.sub(b'"id":"#"', body)


# what the proxy writes behind its answers reaches Redis this late (as on a busy machine):
# the proxy's tool exchanges and the summaries (the summariser's result later than the next
# request): a window must read the same whatever that timing. Not the conversation's
# write-behind ("sync"): late too, it leaves the session cold for the next request in both
# runs alike, and the planted bug below then reads alike either way (checked: green)
INTERNAL_WRITE_DELAY_S = 0.45
LATE_OPS = frozenset({"internal", "summary"})


@pytest.mark.parametrize("api", ["chat", "stream", "responses", "messages"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("line_up", sorted(LINE_UPS))
def test_a_stranger_reads_the_same_whether_or_not_the_victim_came_first(
        tmp_path: Path, make_proxy: Any, monkeypatch: pytest.MonkeyPatch,
        line_up: str, policy: str, api: str) -> None:
    """The writes behind an answer in LATE_OPS (the proxy's tool exchanges, the summaries a
    summariser stores) are INTERNAL_WRITE_DELAY_S late (injected), longer than the gap
    between the requests.
    This failed once in four whole-suite runs on a busy machine
    (same-opening-summaries-chat) — the stranger's next request, alone, read Redis before
    his own exchange had landed, so his window lacked it (other loops, no omission), while
    after the victim it had it. Bug class: a window shaped by when a background write
    landed (a replica now splices the exchanges it is still writing: ``with_writing``).
    Planted: ``with_writing`` returning only what was read — red in reused-call-id-default
    (2 of its 4 APIs, with the summaries late too); with the delay the same in both runs,
    the flaky case itself reads alike either way, so its own red needs the timing to differ
    between runs: that is what the fix takes away."""
    import asyncio

    from runloop_proxy.history.store import RedisStore

    call = RedisStore._call

    async def late(self: RedisStore, op: str, make: Any) -> Any:
        if op in LATE_OPS:
            await asyncio.sleep(INTERNAL_WRITE_DELAY_S)
        return await call(self, op, make)

    monkeypatch.setattr(RedisStore, "_call", late)
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-up")
    monkeypatch.setenv("TEST_ACME_KEY", ACME_KEY)
    lu, pol = LINE_UPS[line_up], POLICIES[policy]
    alone = run(tmp_path, "alone", make_proxy, pol, api, lu, with_victim=False)
    after = run(tmp_path, "after", make_proxy, pol, api, lu, with_victim=True)
    for body in after:
        for secret in (SECRET, CARD, "9,120.44"):
            assert secret.encode() not in body, f"the stranger's model was shown {secret}"
    assert len(after) == len(alone), "the same rounds either way"
    for k, (a, b) in enumerate(zip(alone, after, strict=True)):
        assert _normal(a) == _normal(b), (
            f"request {k} of the stranger's differs with the victim before him:\n"
            f"alone: {a[:3000]!r}\nafter: {b[:3000]!r}")
