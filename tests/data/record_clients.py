"""Record the requests the agent libraries send into client_requests.json (test_clients.py's
source; the suite needs none of these libraries). Each library runs a one-call tool loop,
streamed, against the scripted upstream; the second request of the loop (the model's call and
the tool's result sent back) is kept as sent. In a virtualenv of its own:

    pip install -e . litellm pydantic-ai-slim[openai] openai-agents smolagents langgraph \
        langchain-openai
    python tests/data/record_clients.py tests/data/client_requests.json
"""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import json
import sys
from collections.abc import Callable
from typing import Any

import openai

from runloop_proxy.scripted import ScriptedUpstream, _as_chat

KEY = "sk-record"
MODEL = "gpt-4o-mini"
PARAMETERS = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def log_text(n: int) -> str:
    return f"SECRET-{n}-tangerine\n" + "\n".join(f"log {n} line {i}: status ok" for i in range(8))


def read_log(n: int) -> str:
    """Read log number n."""
    return log_text(n)


def model(body: dict[str, Any]) -> dict[str, Any]:
    """Calls the client's log reader once (its final-answer tool where it has one), then
    answers."""
    chat = _as_chat(body)
    names = [t["function"]["name"] for t in chat.get("tools") or [] if "function" in t]
    if "SECRET-0-tangerine" not in json.dumps(chat["messages"]):  # the log not read yet
        return {"content": None, "tool_calls": [
            {"id": "call_read_0_1", "name": "read_log", "arguments": {"n": 0}}]}
    if "final_answer" in names:
        return {"content": None, "tool_calls": [
            {"id": "call_final_2", "name": "final_answer", "arguments": {"answer": "read"}}]}
    return {"content": "log 0 read"}


def litellm_chat(url: str) -> None:
    import litellm
    tools = [{"type": "function", "function": {"name": "read_log", "parameters": PARAMETERS}}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "read log 0"}]
    for _ in range(2):
        chunks = list(litellm.completion(model=f"openai/{MODEL}", api_base=url, api_key=KEY,
                                         messages=msgs, tools=tools, stream=True,
                                         stream_options={"include_usage": True}))
        m = litellm.stream_chunk_builder(chunks, messages=msgs).choices[0].message
        msgs.append(m.model_dump())
        for tc in m.tool_calls or []:
            msgs.append({"role": "tool", "tool_call_id": tc.id, "content": read_log(0)})


def litellm_responses(url: str) -> None:
    import litellm
    tools = [{"type": "function", "name": "read_log", "parameters": PARAMETERS}]
    r = litellm.responses(model=f"openai/{MODEL}", api_base=url, api_key=KEY,
                          input="read log 0", tools=tools)
    call = next(o for o in r.output if getattr(o, "type", None) == "function_call")
    list(litellm.responses(model=f"openai/{MODEL}", api_base=url, api_key=KEY, tools=tools,
                           stream=True, input=[
                               {"role": "user", "content": "read log 0"}, call.model_dump(),
                               {"type": "function_call_output", "call_id": call.call_id,
                                "output": read_log(0)}]))


def pydantic_ai(kind: str) -> Callable[[str], None]:
    def run(url: str) -> None:
        from pydantic_ai import Agent
        from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
        from pydantic_ai.providers.openai import OpenAIProvider
        cls = OpenAIChatModel if kind == "chat" else OpenAIResponsesModel
        agent = Agent(cls(MODEL, provider=OpenAIProvider(base_url=url, api_key=KEY)),
                      instructions="You read logs.", tools=[read_log])

        async def go() -> None:
            async with agent.run_stream("read log 0") as st:
                await st.get_output()
        asyncio.run(go())
    return run


def agents_sdk(kind: str) -> Callable[[str], None]:
    def run(url: str) -> None:
        from agents import (
            Agent,
            OpenAIChatCompletionsModel,
            OpenAIResponsesModel,
            Runner,
            function_tool,
            set_tracing_disabled,
        )
        set_tracing_disabled(True)
        cls = OpenAIResponsesModel if kind == "responses" else OpenAIChatCompletionsModel
        agent = Agent(name="reader", instructions="You read logs.",
                      tools=[function_tool(read_log)],
                      model=cls(MODEL, openai.AsyncOpenAI(base_url=url, api_key=KEY)))

        async def go() -> None:
            r = Runner.run_streamed(agent, "read log 0")
            async for _ in r.stream_events():
                pass
        asyncio.run(go())
    return run


def smolagents_chat(url: str) -> None:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def read_log(n: int) -> str:  # smolagents wants its arguments documented
        """Read a log.

        Args:
            n: the log's number
        """
        return log_text(n)
    ToolCallingAgent(tools=[read_log], stream_outputs=True, verbosity_level=0,
                     model=OpenAIServerModel(MODEL, api_base=url, api_key=KEY)).run("read log 0")


def langgraph(kind: str) -> Callable[[str], None]:
    def run(url: str) -> None:
        from langchain_core.tools import tool
        from langchain_openai import ChatOpenAI
        from langgraph.prebuilt import create_react_agent
        llm = ChatOpenAI(model=MODEL, base_url=url, api_key=KEY, streaming=True,
                         use_responses_api=kind == "responses")
        graph = create_react_agent(llm, [tool(read_log)], prompt="You read logs.")
        list(graph.stream({"messages": [("user", "read log 0")]}, stream_mode="messages"))
    return run


# name -> (the distribution named in the record, the run)
RUNS: dict[str, tuple[str, Callable[[str], None]]] = {
    "litellm chat": ("litellm", litellm_chat),
    "litellm responses": ("litellm", litellm_responses),
    "pydantic-ai chat": ("pydantic-ai-slim", pydantic_ai("chat")),
    "pydantic-ai responses": ("pydantic-ai-slim", pydantic_ai("responses")),
    "openai-agents chat": ("openai-agents", agents_sdk("chat")),
    "openai-agents responses": ("openai-agents", agents_sdk("responses")),
    "smolagents chat": ("smolagents", smolagents_chat),
    "langgraph chat": ("langgraph", langgraph("chat")),
    "langgraph responses": ("langgraph", langgraph("responses")),
}


def main(out_path: str) -> None:
    up = ScriptedUpstream().start()
    up.responder = model
    records = {}
    try:
        for name, (dist, run) in RUNS.items():
            up.reset()
            up.responder = model
            run(up.url)
            convo = [b for b in up.requests if "messages" in b or "input" in b]
            path = "/v1/chat/completions" if "messages" in convo[1] else "/v1/responses"
            extra = f", langchain-openai {md.version('langchain-openai')}" \
                if dist == "langgraph" else ""
            records[name] = {"client": f"{dist} {md.version(dist)}{extra} "
                                       f"(openai {md.version('openai')})",
                             "path": path, "body": convo[1]}
    finally:
        up.stop()
    with open(out_path, "w") as f:
        json.dump(records, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main(sys.argv[1])
