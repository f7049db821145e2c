"""The parcel shop's conversation the shadow tests and the replay judge's share: a past loop
whose large tool result holds the order id, then a question about it; and a scripted model
that answers from what its window holds (the id it can see, or that it sees none), in any of
the three APIs' bodies."""

from __future__ import annotations

import re
from typing import Any

import orjson

ORDER = re.compile(r"ORD-\d{4}")
PADDING = "Carrier events: departed facility, arrived at hub, out for delivery. " * 60
SYSTEM = "You are the support agent of a parcel shop."
FOUND = "Your order number is ORD-7731."
NOT_FOUND = "I cannot find an order number anywhere in this conversation."
HIDDEN = "Your last order has shipped."  # a loop's final answer that does not repeat the id
KEPT = "Your order ORD-7731 has shipped."  # ... and one that does
QUESTION = "And what is its number again?"
CALL_ID = "call_Lk3xQ9"
RESULT = f"{PADDING} Order ORD-7731 shipped 2026-03-02 via DHL. {PADDING}"


def decides_from_its_window(body: dict[str, Any]) -> dict[str, Any]:
    """A model that answers with the last order id it can see, or says it sees none: what
    it reads is the body's conversation in any API (chat ``messages``, Responses
    ``instructions`` and ``input``, Messages ``system`` and ``messages``), never its tools."""
    window = orjson.dumps([body.get(k) for k in ("system", "instructions", "messages",
                                                   "input")]).decode()
    seen = ORDER.findall(window)
    return {"content": f"Your order number is {seen[-1]}." if seen else NOT_FOUND}


def conversation(final: str) -> list[dict[str, Any]]:
    """The conversation in chat completions: the past loop, its final answer ``final``, the
    question."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Look up my last order please."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": CALL_ID, "type": "function",
             "function": {"name": "lookup_order", "arguments": '{"customer": "C-20931"}'}}]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT},
        {"role": "assistant", "content": final},
        {"role": "user", "content": QUESTION},
    ]


def anthropic_turns(final: str) -> list[dict[str, Any]]:
    """The same conversation in the Messages API (the system prompt goes apart)."""
    use = "toolu_01A09q90qw90lq917835lq9"
    return [
        {"role": "user", "content": "Look up my last order please."},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": use, "name": "lookup_order",
             "input": {"customer": "C-20931"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use, "content": RESULT}]},
        {"role": "assistant", "content": [{"type": "text", "text": final}]},
        {"role": "user", "content": QUESTION},
    ]


def response_items(final: str) -> list[dict[str, Any]]:
    """The same conversation as Responses input items (the system prompt goes apart, as
    ``instructions``)."""
    return [
        {"type": "message", "role": "user", "content": "Look up my last order please."},
        {"type": "function_call", "call_id": CALL_ID, "name": "lookup_order",
         "arguments": '{"customer": "C-20931"}'},
        {"type": "function_call_output", "call_id": CALL_ID, "output": RESULT},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": final}]},
        {"type": "message", "role": "user", "content": QUESTION},
    ]


CHAT_TOOLS = [{"type": "function", "function": {
    "name": "lookup_order", "description": "Look up a customer's last order",
    "parameters": {"type": "object", "properties": {"customer": {"type": "string"}}}}}]
ANTHROPIC_TOOLS = [{"name": "lookup_order", "description": "Look up a customer's last order",
                    "input_schema": CHAT_TOOLS[0]["function"]["parameters"]}]
RESPONSES_TOOLS = [{"type": "function", "name": "lookup_order",
                    "description": "Look up a customer's last order",
                    "parameters": CHAT_TOOLS[0]["function"]["parameters"]}]
