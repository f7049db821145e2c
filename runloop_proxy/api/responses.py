"""``POST /v1/responses``: the Responses adapter. A request's ``instructions`` and ``input``
items become the conversation model (conversation/items.py) and go through the same pipeline
as chat completions — identity, history, window, the proxy's tools; ``responses_wire.py``
speaks the format on the way out. A request that chains on ``previous_response_id`` keeps
its conversation upstream: it is passed through untouched and recorded (counted as api
``responses_chained``)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from ..conversation.items import is_output, to_messages, tool_to_chat
from ..conversation.messages import Message
from ..errors import InvalidRequest
from ..pipeline.accounting import RequestLog
from ..pipeline.values import Caller, Turn
from ..state import AppState
from .chat import bounded, kind_words, openai_required
from .http import ASGIResponse, answer_turn, authenticate, read_request
from .responses_wire import ResponsesWire

PATH = "/v1/responses"
WIRE = ResponsesWire()
MAX_DEPTH = 64


async def responses(request: Request) -> ASGIResponse:
    return await answer_turn(request, WIRE.api, _turn)


async def _turn(state: AppState, request: Request, rlog: RequestLog) -> Turn:
    caller = authenticate(state, request)
    rlog.authenticated(caller.tenant.name, caller.label)
    raw, (body, messages) = await read_request(state, request, checked, caller, rlog)
    return turn_of(caller, body, raw, messages, list(request.headers.items()), rlog)


def turn_of(caller: Caller, body: dict[str, Any], raw: bytes, messages: list[Message],
            headers: list[tuple[str, str]], rlog: RequestLog) -> Turn:
    """A checked Responses request as a turn, whatever it came by (HTTP, a socket's
    ``response.create``)."""
    chained = body.get("previous_response_id")
    if chained:
        rlog.api = "responses_chained"
    rlog.identify(caller.tenant.name, caller.label, body["model"], bool(body.get("stream")))
    tools = body.get("tools")
    return Turn(caller, WIRE, body, raw, messages, headers,
                chained=chained, tools=[tool_to_chat(t) for t in tools] if tools else None)


def checked(body: Any) -> tuple[dict[str, Any], list[Message]]:
    body = validate_responses_request(body)
    return body, to_messages(body["input"], body.get("instructions"))


def validate_responses_request(body: Any) -> dict[str, Any]:
    """Check what the proxy reads of a Responses request; a 400 names the bad field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise openai_required(body, "model", "a non-empty string")
    input_ = body.get("input")
    if isinstance(input_, list):
        for i, item in enumerate(input_):
            _validate_item(item, i)
    elif not isinstance(input_, str):
        raise openai_required(body, "input", "a string or an array of items")
    for name, kinds in (("instructions", (str,)), ("stream", (bool,)), ("store", (bool,)),
                        ("previous_response_id", (str,)), ("user", (str,)),
                        ("prompt_cache_key", (str,)), ("metadata", (dict,)),
                        ("max_output_tokens", (int,)), ("tools", (list,))):
        v = body.get(name)
        if v is not None and (not isinstance(v, kinds) or _bad_count(v, kinds)):
            raise openai_required(body, name, kind_words(kinds))
    for i, tool in enumerate(body.get("tools") or []):
        if not isinstance(tool, dict):
            raise InvalidRequest(f"tools[{i}] must be an object", param=f"tools[{i}]")
        if tool.get("type") == "function" and not isinstance(tool.get("name"), str):
            raise InvalidRequest("each function tool needs a name", param=f"tools[{i}].name")
    for name, v in body.items():
        if name != "input":
            bounded(v, MAX_DEPTH - 1, name)
    return body


def _bad_count(v: Any, kinds: tuple[type, ...]) -> bool:
    return kinds == (int,) and (isinstance(v, bool) or (isinstance(v, int) and v < 0))


def _validate_item(item: Any, i: int) -> None:
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    kind = item.get("type", "message")
    if not isinstance(kind, str):
        raise InvalidRequest(f"{where}.type must be a string", param=f"{where}.type")
    if kind == "message":
        if not isinstance(item.get("role"), str):
            raise InvalidRequest(f"{where}.role is required", param=f"{where}.role")
        if not isinstance(item.get("content"), (str, list)):
            raise InvalidRequest(f"{where}.content must be a string or an array of parts",
                                 param=f"{where}.content")
    elif kind in ("function_call", "custom_tool_call"):
        arg = "arguments" if kind == "function_call" else "input"
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name")) \
                or not isinstance(item.get(arg, ""), str):
            raise InvalidRequest(f"{where} needs a call_id, a name and string {arg}",
                                 param=where)
    elif is_output(item) and not isinstance(item.get("call_id"), str):
        raise InvalidRequest(f"{where}.call_id must be a string", param=f"{where}.call_id")
    # any other item type the proxy does not read: it goes upstream as it came
    bounded(item, MAX_DEPTH - 2, where)
