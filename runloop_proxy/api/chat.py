"""``POST /v1/chat/completions``: the chat adapter. It checks a request field by field (every
answer to a bad one is a 400 naming the field, before anything reaches the upstream) and hands
it to the pipeline as a Turn; ``chat_wire.py`` speaks the format on the way out."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from ..conversation.messages import ROLES
from ..errors import InvalidRequest
from ..pipeline.accounting import RequestLog
from ..pipeline.values import Turn
from ..state import AppState
from .chat_wire import ChatWire
from .http import ASGIResponse, answer_turn, authenticate, read_request

PATH = "/v1/chat/completions"
WIRE = ChatWire()


async def chat_completions(request: Request) -> ASGIResponse:
    return await answer_turn(request, WIRE.api, _turn)


async def _turn(state: AppState, request: Request, rlog: RequestLog) -> Turn:
    caller = authenticate(state, request)
    rlog.authenticated(caller.tenant.name, caller.label)
    raw, body = await read_request(state, request, validate_chat_request, caller, rlog)
    rlog.identify(caller.tenant.name, caller.label, body["model"], bool(body.get("stream")))
    headers = list(request.headers.items())
    return Turn(caller, WIRE, body, raw, body["messages"], headers)


def validate_chat_request(body: Any) -> dict[str, Any]:
    """Check every field the proxy reads, and bound the nesting of those it does not: a bad
    request gets a 400 naming the field, before anything reaches the upstream."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise openai_required(body, "model", "a non-empty string")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise openai_required(body, "messages", "a non-empty array of messages")
    for i, m in enumerate(messages):
        if type(m) is dict and _plain(m):
            continue
        _validate_message(m, i)
    _validate_tools(body.get("tools"))
    for name, kinds in TOP_LEVEL.items():
        v = body.get(name)
        if v is not None and (not isinstance(v, kinds) or _is_bool_int(v, kinds)):
            raise openai_required(body, name, kind_words(kinds))
    for name in ("max_tokens", "max_completion_tokens", "n"):
        if (body.get(name) or 0) < 0:
            raise InvalidRequest(f"'{name}' must not be negative", param=name)
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is not None \
            and not isinstance(options["include_usage"], bool):
        raise InvalidRequest("'stream_options.include_usage' must be a boolean",
                             param="stream_options.include_usage")
    for name, v in body.items():
        if name not in ("messages", "tools"):
            bounded(v, MAX_DEPTH - 1, name)
    return body


MAX_DEPTH = 64  # JSON nesting a request may use; the proxy's own (de)serialisers stop at 254
_INT = (int,)
TOP_LEVEL: dict[str, tuple[type, ...]] = {
    "stream": (bool,), "stream_options": (dict,), "n": _INT, "max_tokens": _INT,
    "max_completion_tokens": _INT, "user": (str,), "prompt_cache_key": (str,),
    "metadata": (dict,), "tool_choice": (str, dict), "parallel_tool_calls": (bool,)}
def json_kind(value: Any) -> str:
    """What a JSON value is, as an error message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    if isinstance(value, str):
        return "a string" if value else "an empty string"
    if isinstance(value, list):
        return "an array" if value else "an empty array"
    return "an object"


def kind_words(kinds: tuple[type, ...]) -> str:
    """What a field of these Python types must be, in an error message's words."""
    words = {bool: "a boolean", dict: "an object", int: "an integer", str: "a string",
             list: "an array", float: "a number"}
    return " or ".join(words.get(k, k.__name__) for k in kinds)


def openai_required(body: dict[str, Any], name: str, expected: str) -> InvalidRequest:
    """A required field that is missing, or there but not what it must be, as OpenAI says it."""
    if name not in body:
        return InvalidRequest(f"Missing required parameter: '{name}' ({expected}).",
                              param=name)
    return InvalidRequest(f"Invalid type for '{name}': expected {expected}, but got "
                          f"{json_kind(body[name])} instead.", param=name)


MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "function_call",
                  "refusal"}


_PLAIN_ROLES = frozenset({"system", "developer", "user", "assistant"})


def _plain(m: dict[str, Any]) -> bool:
    """The common shapes, checked in a few operations: a role and text, a tool result, an
    assistant message with plain function calls (what an agent sends)."""
    role, content = m.get("role"), m.get("content")
    if type(role) is not str:
        return False
    if type(content) is str:
        if len(m) == 2:
            return role in _PLAIN_ROLES
        if len(m) == 3 and role == "tool":
            return type(m.get("tool_call_id")) is str
    calls = m.get("tool_calls")
    # exactly role, content and tool_calls (a third key of another name is checked in full)
    return role == "assistant" and type(calls) is list and "content" in m \
        and (content is None or type(content) is str) and len(m) == 3 \
        and all(map(_plain_call, calls))


def _plain_call(c: Any) -> bool:
    fn = c.get("function") if type(c) is dict else None
    return type(fn) is dict and len(fn) == 2 and type(fn.get("name")) is str \
        and type(fn.get("arguments")) is str and type(c.get("id")) is str and len(c) <= 3 \
        and type(c.get("type", "")) is str


def _is_bool_int(v: Any, kinds: tuple[type, ...]) -> bool:
    return kinds is _INT and isinstance(v, bool)


def bounded(value: Any, depth: int, where: str) -> None:
    """InvalidRequest when ``value`` nests deeper than ``depth`` levels of arrays/objects."""
    if not isinstance(value, (dict, list)):
        return
    stack = [(value, depth)]
    while stack:
        v, left = stack.pop()
        if left <= 0:
            raise InvalidRequest(f"'{where}' is nested more than {MAX_DEPTH} levels deep",
                                 param=where)
        for child in v.values() if isinstance(v, dict) else v:
            if isinstance(child, (dict, list)):
                stack.append((child, left - 1))


def _validate_message(m: Any, i: int) -> None:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidRequest(f"{where}.role must be one of {', '.join(sorted(ROLES))}",
                             param=f"{where}.role")
    content = m.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise InvalidRequest(f"{where}.content must be a string, an array of parts or null",
                             param=f"{where}.content")
    if content is None and role in ("user", "system", "developer", "tool"):
        raise InvalidRequest(f"{where}.content is required for role {role!r}",
                             param=f"{where}.content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, (dict, str)):
                raise InvalidRequest(f"{where}.content[{j}] must be an object",
                                     param=f"{where}.content[{j}]")
            bounded(part, MAX_DEPTH - 4, f"{where}.content[{j}]")
    for name in ("tool_call_id", "name", "refusal"):
        if m.get(name) is not None and not isinstance(m[name], str):
            raise InvalidRequest(f"{where}.{name} must be a string", param=f"{where}.{name}")
    if role == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise InvalidRequest(f"{where}.tool_call_id is required for role 'tool'",
                             param=f"{where}.tool_call_id")
    fc = m.get("function_call")
    if fc is not None and not _is_function(fc):
        raise InvalidRequest(f"{where}.function_call must be an object with a name and "
                             f"string arguments", param=f"{where}.function_call")
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise InvalidRequest(f"{where}.tool_calls must be an array on an assistant message",
                                 param=f"{where}.tool_calls")
        for j, c in enumerate(calls):
            if not isinstance(c, dict) or not isinstance(c.get("id"), str) \
                    or not (_is_function(c.get("function")) or _is_custom(c.get("custom"))):
                raise InvalidRequest(f"{where}.tool_calls[{j}] needs an id and a function "
                                     f"(a name and string arguments) or a custom tool call "
                                     f"(a name and a string input)",
                                     param=f"{where}.tool_calls[{j}]")
            bounded(c, MAX_DEPTH - 4, f"{where}.tool_calls[{j}]")
    for name, v in m.items():
        if name not in MESSAGE_FIELDS:
            bounded(v, MAX_DEPTH - 3, f"{where}.{name}")


def _is_function(fn: Any) -> bool:
    return isinstance(fn, dict) and isinstance(fn.get("name"), str) \
        and isinstance(fn.get("arguments", ""), str)


def _is_custom(call: Any) -> bool:
    return isinstance(call, dict) and isinstance(call.get("name"), str) \
        and isinstance(call.get("input", ""), str)


def _validate_tools(tools: Any) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise openai_required({"tools": tools}, "tools", "an array")
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise InvalidRequest(f"tools[{i}] must be an object", param=f"tools[{i}]")
        if t.get("type", "function") == "function":
            fn = t.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InvalidRequest("each function tool needs function.name",
                                     param=f"tools[{i}].function.name")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise InvalidRequest("function.parameters must be an object",
                                     param=f"tools[{i}].function.parameters")
        bounded(t, MAX_DEPTH - 2, f"tools[{i}]")
