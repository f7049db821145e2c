"""Canonical form and the two hashes of a message (pure, table-driven): what an echo may add
or drop without changing a message, and what makes it another message."""

from __future__ import annotations

from typing import Any

import pytest

from runloop_proxy.conversation.messages import canonical, match_hash, message_hash

REPLY: dict[str, Any] = {"role": "assistant", "content": "the answer", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize("echo", [
    {**REPLY, "refusal": None},
    {**REPLY, "annotations": []},
    {**REPLY, "audio": None, "function_call": None},
    {"tool_calls": REPLY["tool_calls"], "content": "the answer", "role": "assistant"},
    {**REPLY, "tool_calls": [{**REPLY["tool_calls"][0], "index": 0}]},
    {**REPLY, "content": [{"type": "text", "text": "the answer"}]},
], ids=["refusal-null", "annotations-empty", "null-fields", "key-order", "stream-index",
        "one-text-part"])
def test_what_an_sdk_echo_changes_is_not_a_change(echo: dict[str, Any]) -> None:
    assert canonical(echo) == canonical(REPLY)  # type: ignore[arg-type]
    assert message_hash(echo) == message_hash(REPLY)  # type: ignore[arg-type]
    assert match_hash(echo) == match_hash(REPLY)  # type: ignore[arg-type]


@pytest.mark.parametrize("other", [
    {**REPLY, "content": "another answer"},
    {**REPLY, "tool_calls": [{**REPLY["tool_calls"][0], "id": "c2"}]},
    {**REPLY, "tool_calls": [{"id": "c1", "type": "function",
                              "function": {"name": "f", "arguments": '{"x": 1}'}}]},
    {**REPLY, "annotations": [{"type": "url_citation", "url": "u"}]},
], ids=["text", "call-id", "arguments", "real-annotations"])
def test_what_makes_another_message(other: dict[str, Any]) -> None:
    assert message_hash(other) != message_hash(REPLY)  # type: ignore[arg-type]


def test_an_assistant_message_matches_on_role_text_and_calls_whatever_else_it_carries() -> None:
    litellm = {**REPLY, "provider_specific_fields": {"refusal": None}, "reasoning_content": None}
    assert message_hash(litellm) != message_hash(REPLY)  # type: ignore[arg-type]
    assert match_hash(litellm) == match_hash(REPLY)  # type: ignore[arg-type]
    # other roles match on everything they carry: a user message is what the user wrote
    user = {"role": "user", "content": "hi"}
    named = {"role": "user", "content": "hi", "name": "bob"}
    assert match_hash(user) != match_hash(named)  # type: ignore[arg-type]
    assert match_hash({**REPLY, "content": "changed"}) != match_hash(REPLY)  # type: ignore[arg-type]
    # and an assistant's calls by their name and arguments, not their ids alone
    for function in ({"name": "g", "arguments": REPLY["tool_calls"][0]["function"]["arguments"]},
                     {"name": "f", "arguments": "{\"x\": 2}"}):
        other = {**REPLY, "tool_calls": [{**REPLY["tool_calls"][0], "function": function}]}
        assert match_hash(other) != match_hash(REPLY), function  # type: ignore[arg-type]
