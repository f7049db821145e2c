"""Responses API items ↔ the conversation model (pure).

A request's ``instructions`` and ``input`` items become chat-shaped messages the window
understands: a message item is a message; a run of the model's items — reasoning, its text,
its calls (``function_call``, ``custom_tool_call`` and the provider's own, like
``web_search_call``) — is one assistant message whose ``tool_calls`` are those calls; a call's
output is a ``tool`` message. Every message keeps the items it came from (``ITEMS``), so the
way back gives the very same items for whatever the window left as it was, and builds new
ones only for what it changed (a cut result, a past loop reduced — whose reasoning, which the
provider ignores in old turns anyway, is then left out).
"""

from __future__ import annotations

from typing import Any

import orjson

from .messages import Message, ToolCall, assistant_of, text_of

Item = dict[str, Any]


def is_output(item: Item) -> bool:
    """A call's output the client sends (function, custom tool, computer, shell, …)."""
    kind = str(item.get("type", ""))
    return kind.endswith("_output") and "call_id" in item


def is_model_side(item: Item) -> bool:
    """An item the model produced: its text, reasoning, or one of its calls."""
    kind = item.get("type", "message")
    if kind == "message":
        return item.get("role") == "assistant"
    return kind == "reasoning" or (kind.endswith("_call") and not is_output(item))


def to_messages(input_: Any, instructions: Any = None) -> list[Message]:
    """The conversation a Responses request carries, as messages."""
    out: list[Message] = []
    if isinstance(instructions, str) and instructions:
        out.append({"role": "system", "content": instructions, "instructions": True})
    items: list[Item] = [{"role": "user", "content": input_}] if isinstance(input_, str) \
        else list(input_ or [])
    run: list[Item] = []
    for item in items:
        if is_model_side(item):
            run.append(item)
            continue
        if run:
            out.append(assistant(run))
            run = []
        out.append(_message(item))
    if run:
        out.append(assistant(run))
    return out


def assistant(run: list[Item]) -> Message:
    """One assistant message for a run of the model's items."""
    texts = [_text(i.get("content")) for i in run if i.get("type", "message") == "message"]
    calls = [_call(i) for i in run if i.get("type") not in ("message", "reasoning", None)]
    return assistant_of(texts, calls, "items", run)


def _message(item: Item) -> Message:
    if is_output(item):
        output = item.get("output")
        content = output if isinstance(output, (str, list)) else \
            orjson.dumps(output).decode() if output is not None else ""
        return {"role": "tool", "tool_call_id": str(item["call_id"]), "content": content,
                "items": [item]}
    role = item.get("role") if item.get("type", "message") == "message" else "user"
    return {"role": str(role or "user"), "content": _content(item.get("content")),
            "items": [item]}


def _call(item: Item) -> ToolCall:
    kind = item.get("type")
    if kind == "function_call":
        name, args = item.get("name", ""), item.get("arguments", "")
    elif kind == "custom_tool_call":
        name, args = item.get("name", ""), item.get("input", "")
    else:  # the provider's own tools (web search, computer, shell …): what it was asked
        name = str(kind)
        rest = {k: v for k, v in item.items() if k not in ("type", "id", "call_id", "status")}
        args = orjson.dumps(rest).decode()
    return {"id": str(item.get("call_id") or item.get("id") or ""), "type": "function",
            "function": {"name": str(name), "arguments": str(args)}}


def _content(content: Any) -> Any:
    """Message content as the window reads it: a text, or parts with a ``text``."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in
                                         ("input_text", "output_text") for p in content):
        return "".join(str(p.get("text", "")) for p in content) if len(content) == 1 \
            else [{"type": "text", "text": str(p.get("text", ""))} for p in content]
    return content if isinstance(content, (str, list)) else ""


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text") or p.get("refusal") or "") for p in content
                       if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _unchanged(m: Message) -> bool:
    """Whether ``m`` is still what its items say (the window did not touch it)."""
    items = m.get("items")
    if not items:
        return False
    again = assistant(items) if m.get("role") == "assistant" else _message(items[0])
    return again == m


def to_items(messages: list[Message]) -> tuple[str | None, list[Item]]:
    """The window's messages as ``instructions`` and ``input`` items (the very items a
    message came from when the window left it as it was)."""
    instructions: str | None = None
    out: list[Item] = []
    kinds = {str(i["call_id"]): str(i.get("type")) for m in messages
             for i in m.get("items") or [] if "call_id" in i and not is_output(i)}
    for m in messages:
        if m.get("instructions"):
            instructions = text_of(m.get("content"))
            continue
        if _unchanged(m):
            out.extend(m.get("items") or [])
            continue
        out.extend(_built(m, kinds))
    return instructions, out


def _built(m: Message, kinds: dict[str, str]) -> list[Item]:
    """Items for a message the window made or changed (from its items where it can)."""
    role = m.get("role", "user")
    old: list[Item] = list(m.get("items") or [])
    if role == "tool":
        call = kinds.get(str(m.get("tool_call_id", "")), "function_call")
        return [{"type": f"{call}_output", "call_id": m.get("tool_call_id", ""),
                 "output": _output(m.get("content"))}]
    if role != "assistant":
        return [{"role": role, "content": m.get("content") if isinstance(m.get("content"), str)
                 else _parts(m.get("content"), role)}]
    calls = m.get("tool_calls") or []
    # reasoning stays with its calls (the open loop); a past loop's reduced reply drops it
    items: list[Item] = [i for i in old if i.get("type") == "reasoning"] if calls else []
    text = text_of(m.get("content"))
    said = next((i for i in old if i.get("type", "message") == "message"), None)
    if text and said is not None:
        items.append({**said, "content": [{"type": "output_text", "text": text,
                                           "annotations": []}]})
    elif text:
        items.append({"role": "assistant", "content": text})
    by_id = {str(i.get("call_id") or i.get("id")): i for i in old if "call_id" in i}
    for tc in calls:
        fn: Any = tc.get("function") or {}
        was = by_id.get(tc.get("id", ""))
        if was is not None and was.get("type") == "function_call":
            items.append({**was, "arguments": fn.get("arguments", "")})
        elif was is not None and was.get("type") == "custom_tool_call":
            items.append({**was, "input": fn.get("arguments", "")})
        elif was is not None:
            items.append(was)  # the provider's own call: as it was
        else:
            items.append({"type": "function_call", "call_id": tc.get("id", ""),
                          "name": fn.get("name", ""), "arguments": fn.get("arguments", "")})
    return items


def _parts(content: Any, role: str) -> Any:
    kind = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, list):
        return [{"type": kind, "text": p["text"]} if isinstance(p, dict) and
                p.get("type") == "text" else p for p in content]
    return [{"type": kind, "text": text_of(content)}]


def _output(content: Any) -> Any:
    if isinstance(content, list):
        return [{"type": "input_text", "text": p["text"]} if isinstance(p, dict) and
                p.get("type") == "text" else p for p in content]
    return text_of(content)


def tool_to_chat(tool: Item) -> Item:
    """A Responses tool in chat form (how tool schemas are counted, and named)."""
    if tool.get("type") == "function":
        return {"type": "function", "function": {k: tool[k] for k in
                                                 ("name", "description", "parameters")
                                                 if k in tool}}
    return tool


def tool_name(tool: Any) -> str | None:
    return tool.get("name") if isinstance(tool, dict) else None
