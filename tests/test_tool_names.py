"""A client's own tool named like one of the proxy's: the proxy renames its own, whatever API
the client speaks (chat's nested tools, Responses' flat ones, Messages' ``input_schema``,
the bridge's chat body), its window's notes name the renamed tool, and the model's call of
the client's tool reaches the client. One rule (``ProxyTools.for_request`` over
``Turn.chat_tools``, which every adapter fills in chat form), swept over every API."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import openai
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer
from .test_anthropic import BASH, coding_turns
from .test_responses import TOOLS as RESPONSES_TOOLS
from .test_responses import agent_turns
from .test_tools import CLIENT_TOOLS, long_session

PARAMS = {"type": "object", "properties": {"call_id": {"type": "string"}}}
MINE = ["runloop_recall_tool_call", "search_history"]


def chat(proxy: ProxyServer) -> tuple[list[str], Any]:
    tools = [*CLIENT_TOOLS, {"type": "function", "function": {
        "name": "recall_tool_call", "parameters": PARAMS}}]
    r = openai.OpenAI(base_url=proxy.url, api_key="sk-t", max_retries=0).chat.completions \
        .create(model="gpt-4o-mini", messages=long_session(), tools=tools)  # type: ignore[arg-type]
    return [c.function.name for c in r.choices[0].message.tool_calls or []], tools


def responses(proxy: ProxyServer) -> tuple[list[str], Any]:
    tools = [*RESPONSES_TOOLS, {"type": "function", "name": "recall_tool_call",
                                "parameters": PARAMS}]
    r = openai.OpenAI(base_url=proxy.url, api_key="sk-t", max_retries=0).responses.create(
        model="gpt-4o-mini", input=agent_turns(12, tasks=False), tools=tools)  # type: ignore[arg-type]
    return [i.name for i in r.output if i.type == "function_call"], tools


def messages(proxy: ProxyServer) -> tuple[list[str], Any]:
    tools = [BASH, {"name": "recall_tool_call", "input_schema": PARAMS}]
    r = anthropic.Anthropic(base_url=proxy.base, api_key="sk-t", max_retries=0).messages \
        .create(model="claude-sonnet-4-6", max_tokens=256, tools=tools,  # type: ignore[arg-type]
                messages=coding_turns(12))  # type: ignore[arg-type]
    return [b.name for b in r.content if b.type == "tool_use"], tools


def name_of(tool: dict[str, Any]) -> str:
    return str(tool["function"]["name"] if "function" in tool else tool["name"])


@pytest.mark.parametrize(("client", "fmt"), [(chat, None), (responses, None),
                                             (messages, None), (messages, "chat")],
                         ids=["chat", "responses", "messages", "messages-bridge"])
def test_the_proxy_renames_its_tool_for_a_client_whose_tool_has_its_name(
        make_proxy: Any, upstream: ScriptedUpstream,
        client: Callable[[ProxyServer], tuple[list[str], Any]], fmt: str | None) -> None:
    proxy = make_proxy(**({"upstream_format": fmt} if fmt else {}))
    upstream.push({"content": "Asking the client's tool.", "tool_calls": [
        {"id": "call_c", "name": "recall_tool_call", "arguments": {"call_id": "x"}}]})
    called, tools = client(proxy)
    sent = upstream.requests[-1]
    names = [name_of(t) for t in sent["tools"]]
    assert names == [*(name_of(t) for t in tools), *MINE]
    # the window cut something, and its notes name the proxy's tool as renamed
    window = orjson.dumps(sent.get("messages", sent.get("input"))).decode()
    assert "runloop_recall_tool_call(call_id=" in window
    assert window.count("recall_tool_call(") == window.count("runloop_recall_tool_call(")
    # the model's call of the client's own tool is the client's: it gets it
    assert called == ["recall_tool_call"]
    assert len(upstream.requests) == 1


@pytest.mark.parametrize("tools", [
    [{"type": "function", "function": {"name": "recall_tool_call"}}],  # chat
    [{"type": "function", "name": "recall_tool_call", "parameters": {}}],  # Responses, flat
    [{"type": "custom", "name": "recall_tool_call"}],  # a provider's own form
    [{"type": "function", "function": {"name": "bash"}}, {"name": "recall_tool_call"}]])
def test_every_tool_form_takes_its_name(tools: list[dict[str, Any]]) -> None:
    from runloop_proxy.pipeline.tools import ProxyTools
    assert ProxyTools.for_request(tools).names == {
        "runloop_recall_tool_call": "recall_tool_call", "search_history": "search_history"}


@given(st.lists(st.sampled_from([
    "recall_tool_call", "runloop_recall_tool_call", "runloop_recall_tool_call_2",
    "runloop_recall_tool_call_3", "search_history", "runloop_search_history",
    "runloop_search_history_2", "bash"]), unique=True))
def test_the_proxys_names_are_never_a_clients_whatever_its_tools(taken: list[str]) -> None:
    """A client may already use the proxy's names, and the names the proxy would rename to
    (planted: one rename instead of one per clash gave a client with both
    ``recall_tool_call`` and ``runloop_recall_tool_call`` two tools of one name). Over any
    set of client names: the proxy's two are distinct and neither is a client's."""
    from runloop_proxy.pipeline.tools import ProxyTools
    names = ProxyTools.for_request([{"type": "function", "function": {"name": n}}
                                    for n in taken]).names
    assert len(names) == 2 and sorted(names.values()) == ["recall_tool_call", "search_history"]
    assert not set(names) & set(taken), (taken, names)
