"""Messages content blocks <-> the conversation model (pure): what the window leaves as it was
goes back as the very blocks it came from, for any conversation; what it changed is rebuilt
keeping what must stay (a result's fields, thinking with its loop's calls)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy.conversation.blocks import (
    OPENING,
    assistant,
    assistant_blocks,
    to_anthropic,
    to_messages,
    tool_to_chat,
)

from .work import allocated, calls

THINK = {"type": "thinking", "thinking": "plan", "signature": "sig-1"}
CC = {"type": "ephemeral"}

texts = st.text(alphabet="ab c\n", min_size=1, max_size=6)


@st.composite
def blocks_of(draw: st.DrawFn, role: str, ids: list[str]) -> Any:
    if not ids and draw(st.booleans()):
        return draw(texts)
    out: list[dict[str, Any]] = []
    if role == "assistant":
        if draw(st.booleans()):
            out.append({**THINK, "thinking": draw(texts)})
        if draw(st.booleans()):
            out.append({"type": "redacted_thinking", "data": "opaque"})
        for _ in range(draw(st.integers(0, 2))):
            out.append({"type": "text", "text": draw(texts)})
        if draw(st.booleans()):
            out.append({"type": "server_tool_use", "id": "srv_1", "name": "web_search",
                        "input": {"query": "x"}})
        for _ in range(draw(st.integers(0, 2))):
            ids.append(f"toolu_{len(ids)}")
            out.append({"type": "tool_use", "id": ids[-1], "name": "bash",
                        "input": {"cmd": draw(texts), "n": draw(st.integers(0, 9))}})
    else:
        while ids:  # the results come first, as the API wants them
            out.append({"type": "tool_result", "tool_use_id": ids.pop(0),
                        "content": draw(st.one_of(texts, st.just([
                            {"type": "text", "text": "r"},
                            {"type": "image", "source": {"type": "base64", "data": "QQ=="}}]))),
                        **({"is_error": True} if draw(st.booleans()) else {}),
                        **({"cache_control": CC} if draw(st.booleans()) else {})})
        for _ in range(draw(st.integers(0 if out else 1, 2))):
            out.append(draw(st.sampled_from([
                {"type": "text", "text": "hi"},
                {"type": "text", "text": "hi", "cache_control": CC},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "QQ=="}},
                {"type": "document", "source": {"type": "text", "data": "doc"}}])))
    return out or draw(texts)


@st.composite
def conversations(draw: st.DrawFn) -> tuple[Any, list[dict[str, Any]]]:
    system = draw(st.one_of(st.none(), texts, st.just([
        {"type": "text", "text": "you are", "cache_control": CC},
        {"type": "text", "text": "a coding agent"}])))
    ids: list[str] = []
    turns = []
    for k in range(draw(st.integers(1, 6))):
        role = "user" if k % 2 == 0 else "assistant"
        turns.append({"role": role, "content": draw(blocks_of(role, ids))})
        if role == "user" and not ids and draw(st.booleans()):  # a system turn, later on
            turns.append({"role": "system", "content": draw(st.one_of(texts, st.just([
                {"type": "text", "text": "# Environment", "cache_control": CC}])))})
    if ids:  # the client answers its calls
        turns.append({"role": "user", "content": draw(blocks_of("user", ids))})
    return system, turns


@settings(max_examples=300, deadline=None)
@given(conversation=conversations())
def test_a_conversation_left_as_it_was_goes_back_block_for_block(
        conversation: tuple[Any, list[dict[str, Any]]]) -> None:
    system, turns = conversation
    messages = to_messages(turns, system)
    assert to_anthropic(messages, turns) == (system or None, turns)
    # the window's model: calls answered by tool messages, in order
    calls = [c["id"] for m in messages for c in m.get("tool_calls") or []]
    results = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
    assert calls == results


def test_a_user_turn_splits_into_results_and_the_users_words() -> None:
    turns = [{"role": "user", "content": "go"},
             {"role": "assistant", "content": [THINK, {"type": "text", "text": "ok"},
                                               {"type": "tool_use", "id": "t1", "name": "bash",
                                                "input": {"cmd": "ls"}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "t1", "content": "a\nb"},
                 {"type": "text", "text": "also look at c"}]}]
    messages = to_messages(turns, [{"type": "text", "text": "S"}])
    assert [(m["role"], m.get("content")) for m in messages] == [
        ("system", "S"), ("user", "go"), ("assistant", "ok"), ("tool", "a\nb"),
        ("user", [{"type": "text", "text": "also look at c"}])]
    assert messages[2]["tool_calls"] == [{"id": "t1", "type": "function", "function": {
        "name": "bash", "arguments": '{"cmd":"ls"}'}}]


def test_a_cut_result_keeps_its_blocks_fields() -> None:
    block = {"type": "tool_result", "tool_use_id": "t1", "content": "x" * 50,
             "is_error": True, "cache_control": CC}
    turns = [{"role": "user", "content": "go"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "b",
                                                "input": {}}]},
             {"role": "user", "content": [block]}]
    messages = to_messages(turns)
    placeholder = {"role": "tool", "tool_call_id": "t1", "content": "[elided]"}  # a new message
    _, out = to_anthropic([*messages[:2], placeholder], turns)
    assert out[-1] == {"role": "user", "content": [{**block, "content": "[elided]"}]}


def test_a_trimmed_call_keeps_its_thinking_and_a_reduced_reply_drops_it() -> None:
    content = [THINK, {"type": "text", "text": "long reasoning", "citations": []},
               {"type": "tool_use", "id": "t1", "name": "bash", "input": {"cmd": "x" * 40}}]
    m = assistant(content)
    trimmed = {**m, "content": "long…", "tool_calls": [
        {**m["tool_calls"][0], "function": {"name": "bash", "arguments": '{"cmd":"x…x"}'}}]}
    assert assistant_blocks(trimmed) == [
        THINK, {"type": "text", "text": "long…"},
        {"type": "tool_use", "id": "t1", "name": "bash", "input": {"cmd": "x…x"}}]
    reduced = {"role": "assistant", "content": "the answer"}  # a past loop's reply
    assert assistant_blocks(reduced) == "the answer"
    final = assistant([THINK, {"type": "text", "text": "done"}])
    assert assistant_blocks({**final, "content": "do…"}) == [{"type": "text", "text": "do…"}]


def test_a_window_that_opens_with_the_models_words_gets_a_user_turn_first() -> None:
    marker = {"role": "system", "content": "[runloop-proxy] Earlier turns are not shown"}
    summary = {"role": "assistant", "content": "[runloop-proxy] Summary: …"}
    kept = {"role": "assistant", "content": "the last answer"}
    system, out = to_anthropic([{"role": "system", "content": "S"}, marker, summary, kept,
                                {"role": "user", "content": "next"}])
    assert system == [{"type": "text", "text": "S"},
                      {"type": "text", "text": marker["content"]}]
    assert out == [{"role": "user", "content": OPENING},
                   {"role": "assistant", "content": [
                       {"type": "text", "text": summary["content"]},
                       {"type": "text", "text": "the last answer"}]},
                   {"role": "user", "content": "next"}]


def test_strict_roles_marker_joins_the_clients_system_blocks() -> None:
    blocks = [{"type": "text", "text": "S", "cache_control": CC}]
    m = to_messages([{"role": "user", "content": "x"}], blocks)[0]
    system, _ = to_anthropic([{**m, "content": m["content"] + "\n\n[marker]"}])
    assert system == [*blocks, {"type": "text", "text": "[marker]"}]


def test_tools_in_chat_form_keep_their_schema_and_provider_tools_stay() -> None:
    tool = {"name": "bash", "description": "run", "input_schema": {"type": "object"}}
    assert tool_to_chat(tool) == {"type": "function", "function": {
        "name": "bash", "description": "run", "parameters": {"type": "object"}}}
    server = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    assert tool_to_chat(server) is server


def test_arguments_the_window_cut_unreadably_still_go_as_an_object() -> None:
    m = assistant([{"type": "tool_use", "id": "t1", "name": "b", "input": {"a": 1}}])
    broken = {**m, "tool_calls": [{**m["tool_calls"][0], "function": {
        "name": "b", "arguments": '{"a": 1'}}]}
    out = assistant_blocks(broken)
    assert out == [{"type": "tool_use", "id": "t1", "name": "b",
                    "input": {"arguments": '{"a": 1'}}]
    assert orjson.dumps(out)


def test_a_system_turn_stays_where_it_came() -> None:
    """Claude Code sends a model it does not know its environment as a system turn after the
    first: it is a system message in the conversation, and goes back in its place (never
    into the system prompt, whose cache it would break)."""
    turns = [{"role": "user", "content": "go"},
             {"role": "system", "content": [{"type": "text", "text": "# Environment"}]},
             {"role": "assistant", "content": "ok"}]
    messages = to_messages(turns, "S")
    assert [(m["role"], m["content"]) for m in messages] == [
        ("system", "S"), ("user", "go"), ("system", "# Environment"), ("assistant", "ok")]
    turn_of: list[int] = []
    assert to_anthropic(messages, turns, turn_of) == ("S", turns)
    assert turn_of == [-1, 0, 1, 2]
    rebuilt = [{**m, "content": m["content"] + "!"} if m["role"] == "system" and i else m
               for i, m in enumerate(messages)]  # changed by a window: rebuilt, in place
    assert to_anthropic(rebuilt, turns)[1][1] == {"role": "system", "content": [
        {"type": "text", "text": "# Environment"}, {"type": "text", "text": "!"}]}


SAME_ROLE_RUNS: dict[str, Any] = {
    # n consecutive turns of one role, as a client may send them (the API merges them)
    "user texts": lambda n: [{"role": "user", "content": "x"}] * n,
    "user text blocks": lambda n: [{"role": "user", "content": [
        {"type": "text", "text": "x"}]}] * n,
    "tool results": lambda n: [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "f",
                                           "input": {}} for i in range(n)]},
        *[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                        "content": "k"}]} for i in range(n)]],
    "assistant texts": lambda n: [{"role": "user", "content": "x"}] + [
        {"role": "assistant", "content": "y"}] * n,
    "assistant blocks": lambda n: [{"role": "user", "content": "x"}] + [
        {"role": "assistant", "content": [{"type": "text", "text": "y"}]}] * n,
    "system turns": lambda n: [{"role": "user", "content": "x"}] + [
        {"role": "system", "content": "s"}] * n,
}


@pytest.mark.parametrize("kind", SAME_ROLE_RUNS)
def test_a_run_of_same_role_turns_converts_in_linear_work(kind: str) -> None:
    """Merging n consecutive turns of a role into one costs work linear in n, both the calls
    made and the bytes copied (a merged turn re-copied per merge was quadratic: 0.83 s on the
    event loop for 19,000 user turns)."""
    work = {}
    for n in (1000, 2000):
        turns = SAME_ROLE_RUNS[kind](n)
        (system, out), made = calls(lambda t=turns: to_anthropic(to_messages(t), t))
        _, copied = allocated(lambda t=turns: to_anthropic(to_messages(t), t))
        assert sum(len(t["content"]) for t in out if isinstance(t["content"], list)) >= n
        work[n] = made, copied
    assert work[2000][0] <= 2.2 * work[1000][0], work
    assert work[2000][1] <= 2.2 * work[1000][1], work
