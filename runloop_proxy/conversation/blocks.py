"""Anthropic Messages content blocks <-> the conversation model (pure).

A Messages request's ``system`` and ``messages`` become chat-shaped messages the window
understands: the system prompt (a string or text blocks) is a system message, and so is a
system turn later in ``messages`` (where it came; it goes back there); a user turn's
``tool_result`` blocks are ``tool`` messages (their content, a string or blocks, is the
message's content as it came) and its other blocks (text, images, documents) a user message
whose content is those very blocks; an assistant turn is one assistant message whose text is
its text blocks, whose ``tool_calls`` are its ``tool_use`` blocks, and which keeps every block
it came from (``blocks``): thinking and redacted thinking, the provider's own tools
(``server_tool_use`` and their results) — opaque, never edited.

The way back gives the very blocks a message came from when the window left it as it was, and
builds new ones only for what it changed: a cut result keeps its block's other fields
(``is_error``, ``cache_control``), a trimmed tool-call message keeps its thinking with its
calls, and a past loop reduced to question and answer drops its thinking. Consecutive
messages of one Anthropic role are one turn (the API merges them anyway), and a window that
opens with the model's words gets a short user turn before them (the API wants a user turn
first).
"""

from __future__ import annotations

from typing import Any

import orjson

from .messages import NOT_JSON, Message, ToolCall, assistant_of, embedded_json, text_of

Block = dict[str, Any]
OPENING = "[runloop-proxy] (earlier turns not shown)"


def to_messages(messages: Any, system: Any = None) -> list[Message]:
    """The conversation a Messages request carries, as messages."""
    out: list[Message] = []
    if isinstance(system, str) and system:
        out.append({"role": "system", "content": system})
    elif isinstance(system, list) and system:
        out.append({"role": "system", "content": _joined(system), "blocks": system})
    for turn in messages or []:
        if not isinstance(turn, dict):
            continue
        role, content = turn.get("role"), turn.get("content")
        if role == "assistant":
            out.append(assistant(content))
        elif role == "system":  # a system turn where it came (after the first turn)
            out.append({"role": "system", "content": _joined(content), "blocks": content}
                       if isinstance(content, list) else
                       {"role": "system", "content": content if isinstance(content, str)
                        else ""})
        else:
            out.extend(_user(content))
    return out


def assistant(content: Any) -> Message:
    """One assistant message for a turn's content (a string, or blocks)."""
    if not isinstance(content, list):
        return {"role": "assistant", "content": content if isinstance(content, str) else ""}
    texts = [str(b.get("text", "")) for b in content if _kind(b) == "text"]
    calls = [call_of(b) for b in content if _kind(b) == "tool_use"]
    return assistant_of(texts, calls, "blocks", content)


def call_of(block: Block) -> ToolCall:
    """A ``tool_use`` block as a tool call (its input as JSON arguments)."""
    return {"id": str(block.get("id", "")), "type": "function",
            "function": {"name": str(block.get("name", "")),
                         "arguments": orjson.dumps(block.get("input", {})).decode()}}


def _user(content: Any) -> list[Message]:
    if not isinstance(content, list):
        return [{"role": "user", "content": content if isinstance(content, str) else ""}]
    out: list[Message] = []
    run: list[Block] = []
    for block in content:
        if _kind(block) == "tool_result":
            if run:
                out.append({"role": "user", "content": run})
                run = []
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                        "content": _result(block.get("content")), "blocks": [block]})
        else:
            run.append(block)
    if run:
        out.append({"role": "user", "content": run})
    return out


def _result(content: Any) -> Any:
    return content if isinstance(content, (str, list)) else ""


def _kind(block: Any) -> str | None:
    return block.get("type") if isinstance(block, dict) else None


def _joined(blocks: list[Any]) -> str:
    return "\n".join(str(b.get("text", "")) for b in blocks if isinstance(b, dict))


# -- the way back ------------------------------------------------------------------------------

def to_anthropic(messages: list[Message], sent: list[Any] | None = None,
                 turn_of: list[int] | None = None) -> tuple[Any, list[dict[str, Any]]]:
    """The window's messages as a Messages ``system`` (None: none) and ``messages``. ``sent``
    is the request's own ``messages``: a result the window cut keeps its block's fields.
    ``turn_of`` gets, for each message, the turn it went into (-1: the system prompt)."""
    results = {str(b.get("tool_use_id")): b for turn in sent or [] if isinstance(turn, dict)
               and isinstance(turn.get("content"), list)
               for b in turn["content"] if _kind(b) == "tool_result"}
    system: list[Any] = []
    plain = True  # every system part a string: the system prompt stays a string
    turns = _Turns()
    out = turns.out
    for m in messages:
        role = m.get("role")
        leading = role in ("system", "developer") and not out
        if leading:  # the system prompt
            old = m.get("blocks")
            plain = plain and old is None
            system += _system_blocks(m, old)
        elif role in ("system", "developer"):  # a system turn, where it was
            old = m.get("blocks")
            turns.add("system", _system_blocks(m, old) if isinstance(old, list)
                      else text_of(m.get("content")))
        elif role == "tool":
            came = m.get("blocks") or [results.get(str(m.get("tool_call_id")), {})]
            turns.add("user", [{**(came[0] or {"type": "tool_result"}),
                                 "tool_use_id": m.get("tool_call_id", ""),
                                 "content": _result(m.get("content"))}])
        elif role == "assistant":
            turns.add("assistant", assistant_blocks(m))
        else:
            content = m.get("content")
            turns.add("user", content if isinstance(content, list) else str(content or ""))
        if turn_of is not None:
            turn_of.append(-1 if leading else len(out) - 1)
    if out and out[0]["role"] != "user":
        out.insert(0, {"role": "user", "content": OPENING})
        if turn_of is not None:
            turn_of[:] = [t + 1 if t >= 0 else t for t in turn_of]
    if not system:
        return None, out
    if plain and len(system) == 1:
        return str(system[0]["text"]), out
    return system, out


def _system_blocks(m: Message, old: Any) -> list[Block]:
    text = text_of(m.get("content"))
    if isinstance(old, list):
        before = _joined(old)
        if text == before:
            return old
        if text.startswith(before):  # the window appended a note (strict roles' marker)
            rest = text[len(before):].lstrip("\n")
            return [*old, {"type": "text", "text": rest}] if rest else old
    return [{"type": "text", "text": text}] if text else []


def assistant_blocks(m: Message) -> Any:
    """An assistant message's content: the blocks it came from when the window left it as it
    was, else blocks made from what it is now — thinking and the provider's own tool blocks
    kept while it has calls (its loop is open), text and calls as the window left them."""
    old = m.get("blocks")
    if isinstance(old, list) and assistant(old) == m:
        return old
    if not isinstance(old, list) and not m.get("tool_calls"):
        return text_of(m.get("content"))
    calls = list(m.get("tool_calls") or [])
    text = text_of(m.get("content"))
    by_id = {str(c.get("id")): c for c in calls}
    out: list[Block] = []
    for b in old if isinstance(old, list) else []:
        kind = _kind(b)
        if kind == "text":
            if text:
                out.append({k: v for k, v in b.items() if k != "citations"} | {"text": text})
                text = ""
        elif kind == "tool_use":
            call = by_id.pop(str(b.get("id")), None)
            if call is not None:
                out.append({**b, "input": call_input(call)})
        elif calls and kind is not None:
            out.append(b)  # thinking, redacted thinking, server tools: with their loop
    if text:
        out.insert(_after_thinking(out), {"type": "text", "text": text})
    for call in by_id.values():
        fn: Any = call.get("function") or {}
        out.append({"type": "tool_use", "id": call.get("id", ""), "name": fn.get("name", ""),
                    "input": call_input(call)})
    return out


def _after_thinking(blocks: list[Block]) -> int:
    i = 0
    while i < len(blocks) and _kind(blocks[i]) in ("thinking", "redacted_thinking"):
        i += 1
    return i


def call_input(call: ToolCall) -> Any:
    """A call's arguments as a tool_use input (the window keeps trimmed ones valid JSON)."""
    raw = (call.get("function") or {}).get("arguments") or "{}"
    value = embedded_json(raw)
    if value is NOT_JSON:
        return {"arguments": raw}
    return value if isinstance(value, dict) else {"value": value}


class _Turns:
    """Turns as they are made, consecutive ones of a role merged into one. A merged turn's
    blocks are a list made here, extended in place: re-copying it per merge made a run of
    same-role messages quadratic."""

    def __init__(self) -> None:
        self.out: list[dict[str, Any]] = []
        self._owned = False  # the last turn's content is a list made here (not the client's)

    def add(self, role: str, content: Any) -> None:
        """Append a turn, merged into the previous one of the same role."""
        if isinstance(content, list) and not content or content == "":
            return
        out = self.out
        if not out or out[-1]["role"] != role:
            out.append({"role": role, "content": content})
            self._owned = False
            return
        if not self._owned:
            out[-1]["content"] = list(_as_blocks(out[-1]["content"]))
            self._owned = True
        out[-1]["content"].extend(_as_blocks(content))


def _as_blocks(content: Any) -> list[Block]:
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


def tool_to_chat(tool: Any) -> Any:
    """A Messages tool in chat form (how tool schemas are counted, and named); the
    provider's own tools (``web_search_…``, ``bash_…``) as they are."""
    if isinstance(tool, dict) and isinstance(tool.get("name"), str) \
            and tool.get("type") in (None, "custom"):
        fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {}}
        if tool.get("description"):
            fn["description"] = tool["description"]
        return {"type": "function", "function": fn}
    return tool


def chat_to_tool(function: dict[str, Any]) -> dict[str, Any]:
    """A function (name, description, parameters) as a Messages tool."""
    out = {"name": function["name"], "input_schema": function.get("parameters") or {
        "type": "object", "properties": {}}}
    if function.get("description"):
        out["description"] = function["description"]
    return out
