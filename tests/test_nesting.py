"""Request nesting is bounded wherever it sits: a property over every API and every place in
a body. A value nested anywhere — a top-level field known or not, inside a message, an item,
a content part or block, a tool call, a tool schema — makes the body deeper than
``MAX_DEPTH`` levels of arrays and objects exactly when the validator refuses it for its
depth, naming the field; anything shallower is accepted. A field that skips the check (a
validator bounding only some of the body's fields) fails here whatever its name."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from runloop_proxy.api.chat import MAX_DEPTH, validate_chat_request
from runloop_proxy.api.messages import validate_messages_request
from runloop_proxy.api.responses import validate_responses_request
from runloop_proxy.errors import InvalidRequest

FN = {"type": "object", "properties": {"q": {"type": "string"}}}
BODIES: dict[str, tuple[Callable[[Any], Any], dict[str, Any]]] = {
    "chat": (validate_chat_request, {
        "model": "m", "metadata": {"k": "v"}, "response_format": {"type": "json_object"},
        # a tool of another kind too: a bound applied to function tools alone fails here
        "tools": [{"type": "function", "function": {"name": "f", "parameters": FN}},
                  {"type": "custom", "custom": {"name": "g", "format": {"type": "text"}}}],
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}),
    "responses": (validate_responses_request, {
        "model": "m", "metadata": {"k": "v"}, "text": {"format": {"type": "text"}},
        "tools": [{"type": "function", "name": "f", "parameters": FN},
                  {"type": "web_search", "filters": {"allowed_domains": ["a.example"]}}],
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}),
    "messages": (validate_messages_request, {
        "model": "m", "max_tokens": 16, "metadata": {"user_id": "u"},
        "system": [{"type": "text", "text": "s"}],
        "tools": [{"name": "f", "input_schema": FN},
                  {"type": "web_search_20250305", "name": "web_search",
                   "user_location": {"type": "approximate", "city": "Oslo"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"q": "x"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "ok"}]}]}]}),
}


def depth(v: Any) -> int:
    """Levels of arrays and objects (a scalar is 0)."""
    if isinstance(v, dict):
        return 1 + max((depth(x) for x in v.values()), default=0)
    if isinstance(v, list):
        return 1 + max((depth(x) for x in v), default=0)
    return 0


def objects(v: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Every object in ``v`` and its path."""
    if isinstance(v, dict):
        yield at, v
        for k, x in v.items():
            yield from objects(x, (*at, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from objects(x, (*at, i))


def nested(levels: int) -> Any:
    """A value ``levels`` deep, alternating arrays and objects."""
    v: Any = "leaf"
    for k in range(levels):
        v = [v] if k % 2 else {"n": v}
    return v


def copy(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: copy(x) for k, x in v.items()}
    if isinstance(v, list):
        return [copy(x) for x in v]
    return v


@pytest.mark.parametrize("api", sorted(BODIES))
def test_the_bodies_are_valid_as_they_stand(api: str) -> None:
    validate, body = BODIES[api]
    validate(copy(body))


@pytest.mark.parametrize("api", sorted(BODIES))
def test_a_value_nested_anywhere_is_refused_exactly_past_the_bound(api: str) -> None:
    """Every object of the body, every nesting from 1 to 80 levels below it: the boundary
    itself is tried at every place (an off-by-one in one part's bound fails here)."""
    validate, base = BODIES[api]
    for index, (at, _) in enumerate(objects(base)):
        where = ".".join(str(p) for p in at) or "(top level)"
        for levels in range(1, 81):
            body = copy(base)
            obj = list(objects(body))[index][1]
            obj["x_extra"] = nested(levels)  # a field the proxy does not know: passed through
            if depth(body) > MAX_DEPTH:
                with pytest.raises(InvalidRequest, match="nested more than") as refused:
                    validate(body)
                param = str(refused.value.param or "")
                assert param and (not at or param.split(".")[0].split("[")[0] == str(at[0])), \
                    (where, param)
            else:
                validate(body)  # accepted: the bound refuses nothing shallower
