"""``POST /v1/messages``: the Messages adapter (Anthropic's API, what Claude Code and the
``anthropic`` SDKs speak). A request's ``system`` and ``messages`` become the conversation
model (conversation/blocks.py) and go through the same pipeline as chat completions and the
Responses API — identity, history, window, the proxy's tools; ``messages_wire.py`` speaks the
format on the way out (``bridge.py`` when the upstream speaks chat completions), and errors
come back in Anthropic's shape."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from ..conversation.blocks import to_messages, tool_to_chat
from ..conversation.messages import Message
from ..errors import InvalidRequest
from ..pipeline.accounting import RequestLog
from ..pipeline.turn import count
from ..pipeline.values import Turn
from ..pipeline.wire import Wire
from ..state import AppState
from .bridge import BridgeWire
from .chat import MAX_DEPTH, bounded, json_kind, kind_words
from .http import ASGIResponse, answer_turn, authenticate, read_request
from .messages_wire import MessagesWire

PATH = "/v1/messages"
COUNT_PATH = "/v1/messages/count_tokens"
WIRE = MessagesWire()
ROLES = ("user", "assistant")


async def messages(request: Request) -> ASGIResponse:
    return await answer_turn(request, WIRE.api, _turn)


async def count_tokens(request: Request) -> ASGIResponse:
    """The prompt the proxy would send for this request, counted (pipeline.turn.count)."""
    return await answer_turn(request, "messages_count", _counted, count)


async def _turn(state: AppState, request: Request, rlog: RequestLog,
                counting: bool = False) -> Turn:
    caller = authenticate(state, request)
    rlog.authenticated(caller.tenant.name, caller.label)
    raw, (body, messages, tools) = await read_request(
        state, request, lambda parsed: _checked(parsed, counting), caller, rlog)
    rlog.identify(caller.tenant.name, caller.label, body["model"], bool(body.get("stream")))
    # an upstream of chat completions only: the bridge translates both ways
    # (the upstream as the request began: a reload while its body was read moves nothing)
    wire: Wire = BridgeWire() if caller.client(state.upstreams).spec.format == "chat" \
        else MessagesWire(caller.tenant.policy.cache_breakpoints == "auto")
    return Turn(caller, wire, body, raw, messages, list(request.headers.items()),
                tools=tools, counting=counting)


def _checked(parsed: Any, counting: bool) -> tuple[dict[str, Any], list[Message],
                                                   list[dict[str, Any]] | None]:
    """The request checked and in the conversation model (off the event loop when large)."""
    body = validate_messages_request(parsed, counting)
    tools = body.get("tools")
    return (body, to_messages(body["messages"], body.get("system")),
            [tool_to_chat(t) for t in tools] if tools else None)


async def _counted(state: AppState, request: Request, rlog: RequestLog) -> Turn:
    return await _turn(state, request, rlog, counting=True)


def validate_messages_request(body: Any, counting: bool = False) -> dict[str, Any]:
    """Check what the proxy reads of a Messages request; a 400 names the bad field.
    ``counting``: a count_tokens body (no ``max_tokens``)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise _required(body, "model", "a non-empty string")
    max_tokens = body.get("max_tokens")
    if ("max_tokens" in body or not counting) and (
            not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise _required(body, "max_tokens", "an integer of at least 1")
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise _required(body, "messages", "a non-empty array of turns")
    for i, turn in enumerate(turns):
        _validate_turn(turn, i)
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        _blocks(system, "system", text_only=True)
    for name, kinds in (("stream", (bool,)), ("metadata", (dict,)), ("tools", (list,)),
                        ("tool_choice", (dict,)), ("thinking", (dict,)),
                        ("stop_sequences", (list,))):
        v = body.get(name)
        if v is not None and not isinstance(v, kinds):
            raise _required(body, name, kind_words(kinds))
    for i, tool in enumerate(body.get("tools") or []):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise InvalidRequest(f"tools.{i}: each tool needs a name", param=f"tools.{i}")
        schema = tool.get("input_schema")
        if tool.get("type") in (None, "custom") and not isinstance(schema, dict):
            raise InvalidRequest(f"tools.{i}.input_schema: Field required (an object)",
                                 param=f"tools.{i}.input_schema")
    for name, v in body.items():
        if name != "messages":
            bounded(v, MAX_DEPTH - 1, name)
    return body


def _required(body: dict[str, Any], name: str, expected: str) -> InvalidRequest:
    """A required field that is missing, or there but not what it must be, as Anthropic says
    it."""
    if name not in body:
        return InvalidRequest(f"{name}: Field required (missing from the body: {expected})",
                              param=name)
    return InvalidRequest(f"{name}: Input should be {expected} (got {json_kind(body[name])})",
                          param=name)


def _validate_turn(turn: Any, i: int) -> None:
    where = f"messages.{i}"
    if not isinstance(turn, dict):
        raise InvalidRequest(f"{where}: must be an object", param=where)
    role = turn.get("role")
    if role not in ROLES and not (role == "system" and i > 0):
        # a system turn may follow the conversation's first (Claude Code sends one to a
        # model it does not know); the system prompt itself is the body's ``system``
        raise InvalidRequest(f"{where}.role: must be 'user' or 'assistant'"
                             + (" (or 'system' after the first turn)" if i else ""),
                             param=f"{where}.role")
    content = turn.get("content")
    if not isinstance(content, str):
        _blocks(content, f"{where}.content", text_only=role == "system")
    bounded(turn, MAX_DEPTH - 2, where)


def _blocks(content: Any, where: str, text_only: bool = False) -> None:
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}: must be a string or an array of content blocks",
                             param=where)
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str) or (text_only and kind != "text"):
            raise InvalidRequest(f"{where}.{j}: must be a content block with a type"
                                 + (" 'text'" if text_only else ""), param=f"{where}.{j}")
        if kind == "text" and not isinstance(block.get("text"), str):
            raise InvalidRequest(f"{where}.{j}.text: Field required", param=f"{where}.{j}.text")
        if kind == "tool_use" and not (isinstance(block.get("id"), str)
                                       and isinstance(block.get("name"), str)):
            raise InvalidRequest(f"{where}.{j}: a tool_use block needs an id and a name",
                                 param=f"{where}.{j}")
        if kind == "tool_result" and not isinstance(block.get("tool_use_id"), str):
            raise InvalidRequest(f"{where}.{j}.tool_use_id: Field required",
                                 param=f"{where}.{j}.tool_use_id")
