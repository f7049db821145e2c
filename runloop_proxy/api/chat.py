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
from .http import ASGIResponse, answer_turn, authenticate, parse_json, read_body

PATH = "/v1/chat/completions"
HISTORY_HEADER = "x-runloop-history"
WIRE = ChatWire()


async def chat_completions(request: Request) -> ASGIResponse:
    return await answer_turn(request, WIRE.api, _turn)


async def _turn(state: AppState, request: Request, rlog: RequestLog) -> Turn:
    caller = authenticate(state, request)
    raw = await read_body(request, state.config.server.max_body_bytes)
    body = validate_chat_request(parse_json(raw))
    rlog.identify(caller.tenant.name, caller.label, body["model"], bool(body.get("stream")))
    headers = list(request.headers.items())
    return Turn(caller, WIRE, body, raw, body["messages"], headers,
                server_history=request.headers.get(HISTORY_HEADER, "").lower() == "server")


def validate_chat_request(body: Any) -> dict[str, Any]:
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
    return body


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
