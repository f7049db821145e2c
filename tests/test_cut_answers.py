"""A cut answer is never stored as whole, on every path.

An answer is recorded only once the upstream's own end marker arrived whole (``[DONE]``,
``message_stop``, ``response.completed``); a cut — the API's own error event mid-stream
(Anthropic's ``overloaded_error``), the connection breaking, a stream that just stops
before its end marker — reaches the client as an error its SDK raises (the official
``openai`` and ``anthropic`` SDKs; over the socket, an error event with a 5xx status),
nothing is stored for it, and the client's retry of the same turn is the session's next
turn, not a fork. A matrix over every path a stream takes (relayed as it comes when the
client sends no tools, the proxy's rounds when it sends some, the bridge, the Responses
API over HTTP and over the socket, the Messages API) and every fault.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from runloop_proxy.scripted import CUTS, ScriptedUpstream

from .conftest import ProxyServer
from .keys import anthropic_key, openai_project_key
from .test_responses_ws import socket, turn

OPENAI_KEY = openai_project_key(40)
ANTHROPIC_KEY = anthropic_key(40)
ADMIN = "admin-cut-answers-5b0c9e1f2a"
GPT = "gpt-4.1-2025-04-14"
CLAUDE = "claude-sonnet-4-6"
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "read_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}}, "required": ["path"]}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
MESSAGES_TOOLS = [{"name": "read_file", "description": "read a file", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]

FIRST = "The repository holds three modules: api, store and cli."
FRAGMENT = "HALFDONE the failing test is in store because the " * 2
RETRIED = "The failing test is test_expiry in tests/test_store.py: the TTL is unset."
# where a cut falls: a few events into the answer (some text already shown), or (end) just
# before the end marker, every other event of the answer sent
AFTER = {"error": 5, "drop": 5, "end": -1}


class Cut(Exception):
    """What a client's SDK raised for a cut answer."""


History = list[tuple[str, str]]  # (role, text)


def _tenant(key: str) -> str:
    return "pt-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def chat(tools: bool) -> Callable[[ProxyServer, str, History], str]:
    def send(proxy: ProxyServer, session: str, history: History) -> str:
        c = openai.OpenAI(base_url=proxy.url, api_key=OPENAI_KEY, max_retries=0,
                          default_headers={"X-Session-Id": session})
        extra: dict[str, Any] = {"tools": CHAT_TOOLS} if tools else {}
        try:
            stream = c.chat.completions.create(
                model=GPT, stream=True, messages=[{"role": r, "content": t}
                                                  for r, t in history], **extra)
            return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        except openai.APIError as exc:
            raise Cut(str(exc)) from exc
    return send


def responses(tools: bool) -> Callable[[ProxyServer, str, History], str]:
    def send(proxy: ProxyServer, session: str, history: History) -> str:
        c = openai.OpenAI(base_url=proxy.url, api_key=OPENAI_KEY, max_retries=0,
                          default_headers={"X-Session-Id": session})
        extra: dict[str, Any] = {"tools": RESPONSES_TOOLS} if tools else {}
        try:
            with c.responses.stream(model=GPT, store=False, input=[
                    {"role": r, "content": t} for r, t in history], **extra) as stream:
                return stream.get_final_response().output_text
        except (openai.APIError, RuntimeError) as exc:  # no response.completed: raised
            raise Cut(str(exc)) from exc
    return send


def messages(tools: bool) -> Callable[[ProxyServer, str, History], str]:
    def send(proxy: ProxyServer, session: str, history: History) -> str:
        c = anthropic.Anthropic(base_url=proxy.base, api_key=ANTHROPIC_KEY, max_retries=0,
                                default_headers={"X-Session-Id": session})
        extra: dict[str, Any] = {"tools": MESSAGES_TOOLS} if tools else {}
        try:
            with c.messages.stream(model=CLAUDE, max_tokens=1024, messages=[
                    {"role": r, "content": t} for r, t in history], **extra) as stream:
                final = stream.get_final_message()
        except anthropic.APIError as exc:
            raise Cut(str(exc)) from exc
        if final.stop_reason is None:  # what the SDK returns for a stream that stops short
            raise AssertionError("the SDK was given an answer without its end")
        return "".join(b.text for b in final.content if b.type == "text")
    return send


def bridged(proxy: ProxyServer, session: str, history: History) -> str:
    c = anthropic.Anthropic(base_url=proxy.base, api_key=OPENAI_KEY, max_retries=0,
                            default_headers={"X-Session-Id": session})
    try:
        with c.messages.stream(model=GPT, max_tokens=1024, messages=[
                {"role": r, "content": t} for r, t in history]) as stream:
            final = stream.get_final_message()
    except anthropic.APIError as exc:
        raise Cut(str(exc)) from exc
    assert final.stop_reason is not None
    return "".join(b.text for b in final.content if b.type == "text")


def over_socket(proxy: ProxyServer, session: str, history: History) -> str:
    items = [{"type": "message", "role": r, "content": [{
        "type": "input_text" if r == "user" else "output_text", "text": t}]}
        for r, t in history]
    with socket(proxy, key=OPENAI_KEY, session=session) as ws:
        events = turn(ws, {"type": "response.create", "model": GPT, "store": False,
                           "input": items})
    last = events[-1]
    if last["type"] == "error":
        assert last["status"] >= 500 and last["error"]["message"], last
        raise Cut(last["error"]["message"])
    assert last["type"] == "response.completed", last
    return "".join(c["text"] for item in last["response"]["output"]
                   for c in item.get("content") or [] if c.get("type") == "output_text")


@dataclass(frozen=True)
class Path:
    send: Callable[[ProxyServer, str, History], str]
    fault_api: str  # what the upstream speaks: its error event is that API's
    key: str
    proxy: dict[str, Any] = field(default_factory=dict)


PATHS = {
    "chat relayed": Path(chat(False), "chat", OPENAI_KEY),
    "chat with client tools": Path(chat(True), "chat", OPENAI_KEY),
    "responses relayed": Path(responses(False), "responses", OPENAI_KEY),
    "responses with client tools": Path(responses(True), "responses", OPENAI_KEY),
    "responses over the socket": Path(over_socket, "responses", OPENAI_KEY),
    "messages relayed": Path(messages(False), "messages", ANTHROPIC_KEY),
    "messages with client tools": Path(messages(True), "messages", ANTHROPIC_KEY),
    "bridge": Path(bridged, "chat", OPENAI_KEY, {"upstream_format": "chat"}),
}


def stored(proxy: ProxyServer, key: str, session: str) -> dict[str, Any]:
    proxy.settle()
    r = httpx.get(f"{proxy.base}/admin/sessions/{session}",
                  headers={"Authorization": f"Bearer {ADMIN}"},
                  params={"messages": "1", "tenant": _tenant(key)})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def texts(view: dict[str, Any]) -> list[tuple[str, str]]:
    """The stored messages as (role, text), whatever API stored them."""
    out = []
    for m in view["messages"]:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        out.append((m["role"], content or ""))
    return out


@pytest.mark.parametrize("how", CUTS)
@pytest.mark.parametrize("path", list(PATHS))
def test_a_cut_answer_is_an_error_the_sdk_raises_and_nothing_is_stored(
        make_proxy: Any, upstream: ScriptedUpstream, path: str, how: str) -> None:
    """Bug class: a stream recorded as the answer when the upstream never ended it. Red
    with the relayed path's observer recording whatever it had read (the fragment before an
    ``overloaded_error`` stored as the reply, the retry then forking the session), and with
    a chat round complete at its finish reason (a stream cut before ``[DONE]`` taken as
    whole); also red with the relayed path adding no error event when a stream just stops
    (the anthropic SDK returned ``stop_reason=None`` and raised nothing)."""
    p = PATHS[path]
    proxy = make_proxy(admin_key=ADMIN, **p.proxy)
    session = f"cut-{path.replace(' ', '-')}-{how}"
    ask = [("user", "What does the repository hold?")]
    upstream.push({"content": FIRST})
    assert p.send(proxy, session, ask) == FIRST

    ask += [("assistant", FIRST), ("user", "Which test fails, and why?")]
    upstream.push({"content": FRAGMENT, "cut": {"after": AFTER[how], "how": how}})
    with pytest.raises(Cut):
        p.send(proxy, session, ask)
    view = stored(proxy, p.key, session)
    assert texts(view) == ask[:2], "the cut turn was stored"
    assert "HALFDONE" not in orjson.dumps(view).decode()

    upstream.push({"content": RETRIED})  # the client retries the same turn
    assert p.send(proxy, session, ask) == RETRIED
    view = stored(proxy, p.key, session)
    assert texts(view) == [*ask, ("assistant", RETRIED)]
    assert len(view["branches"]) == 1, "the retry forked the session"
