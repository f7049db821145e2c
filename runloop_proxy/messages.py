"""Chat messages: wire types, validation of a chat-completions request, canonical form, hashing.

The canonical form is what reconciliation compares: it ignores what SDKs add or drop when they
echo an assistant reply back (null-valued fields, ``refusal: null``, ``annotations: []``, the
``index`` of streamed tool calls, key order), so a resent reply matches the one stored.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

import orjson
import xxhash

from .errors import InvalidRequest

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
ROLES: frozenset[str] = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


class FunctionCall(TypedDict):
    name: str
    arguments: str


class ToolCall(TypedDict):
    id: str
    type: str
    function: FunctionCall


class Message(TypedDict, total=False):
    role: str
    content: Any
    name: str
    tool_calls: list[ToolCall]
    tool_call_id: str
    function_call: FunctionCall
    refusal: str | None


class ChatRequest(TypedDict):
    model: str
    messages: list[Message]
    stream: NotRequired[bool]
    tools: NotRequired[list[dict[str, Any]]]


_EMPTY_DROPPABLE = ("annotations", "tool_calls")


def canonical(msg: Message) -> dict[str, Any]:
    """The message as compared and stored: stable under SDK echo differences."""
    out: dict[str, Any] = {}
    for k, v in msg.items():
        if v is None or (k in _EMPTY_DROPPABLE and v == []):
            continue
        if k == "content":
            v = _canonical_content(v)
            if v == "" and msg.get("role") == "assistant" and msg.get("tool_calls"):
                continue
        elif k == "tool_calls" and isinstance(v, list):
            v = [_canonical_call(c) for c in v]
        out[k] = v
    return out


def _canonical_content(content: Any) -> Any:
    if isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict) \
            and content[0].get("type") == "text" and set(content[0]) <= {"type", "text"}:
        return content[0].get("text", "")
    return content


def _canonical_call(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    out = {k: v for k, v in call.items() if v is not None and k != "index"}
    fn = out.get("function")
    if isinstance(fn, dict):
        out["function"] = {k: v for k, v in fn.items() if v is not None}
    return out


def canonical_json(msg: Message) -> bytes:
    return orjson.dumps(canonical(msg), option=orjson.OPT_SORT_KEYS)


def content_hash(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def message_hash(msg: Message) -> str:
    return content_hash(canonical_json(msg))


def text_of(content: Any) -> str:
    """The text a message carries, whatever its content shape (string, parts, null)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict):
                if isinstance(p.get("text"), str):
                    parts.append(p["text"])
                elif isinstance(p.get("refusal"), str):
                    parts.append(p["refusal"])
            elif isinstance(p, str):
                parts.append(p)
        return "\n".join(parts)
    return str(content)


def message_text(msg: Message) -> str:
    text = text_of(msg.get("content"))
    refusal = msg.get("refusal")
    return f"{text}\n{refusal}" if refusal and refusal not in text else text


REF_CHARS = 6


def result_refs(messages: list[Message], keys: list[str]) -> list[str]:
    """A short id per tool result (``""`` for other messages), what recall_tool_call takes.

    The leading hex digits of the result's content hash: a few tokens where provider call ids
    take twenty, and unique where call ids are reused. A ref that would name an earlier,
    different result grows two digits until it is unique; refs depend only on the messages
    before them, so appending never changes an earlier one.
    """
    taken: dict[str, str] = {}  # ref -> key
    refs = [""] * len(messages)
    for i, m in enumerate(messages):
        if m.get("role") != "tool":
            continue
        key = keys[i]
        n = REF_CHARS
        while taken.get(key[:n], key) != key and n < len(key):
            n += 2
        refs[i] = key[:n]
        taken.setdefault(key[:n], key)
    return refs


def tool_calls_of(msg: Message) -> list[ToolCall]:
    """Tool calls of an assistant message, legacy ``function_call`` included (id = name)."""
    calls = msg.get("tool_calls") or []
    if not calls and msg.get("function_call"):
        fc = msg["function_call"]
        return [{"id": f"function:{fc.get('name', '')}", "type": "function", "function": fc}]
    return calls


def validate_chat_request(body: Any) -> ChatRequest:
    """Check the shape of a chat-completions request; InvalidRequest names the bad field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string",
                             param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' is required and must be a non-empty array",
                             param="messages")
    for i, m in enumerate(messages):
        _validate_message(m, i)
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequest("'tools' must be an array", param="tools")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InvalidRequest("each tool needs function.name",
                                     param=f"tools[{i}].function.name")
    for field in ("max_tokens", "max_completion_tokens", "n"):
        v = body.get(field)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise InvalidRequest(f"'{field}' must be a non-negative integer", param=field)
    return body  # type: ignore[return-value]


def _validate_message(m: Any, i: int) -> None:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    role = m.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role must be one of {', '.join(sorted(ROLES))}",
                             param=f"{where}.role")
    content = m.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise InvalidRequest(f"{where}.content must be a string, an array of parts or null",
                             param=f"{where}.content")
    if content is None and role in ("user", "system", "developer", "tool"):
        raise InvalidRequest(f"{where}.content is required for role {role!r}",
                             param=f"{where}.content")
    if role == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise InvalidRequest(f"{where}.tool_call_id is required for role 'tool'",
                             param=f"{where}.tool_call_id")
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise InvalidRequest(f"{where}.tool_calls must be an array on an assistant message",
                                 param=f"{where}.tool_calls")
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(c, dict) or not isinstance(c.get("id"), str) \
                    or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InvalidRequest(f"{where}.tool_calls[{j}] needs id and function.name",
                                     param=f"{where}.tool_calls[{j}]")
