"""Responses items ↔ the conversation model (pure): items → messages → items is the identity
when nothing changes, and what the window changes comes back as valid items."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy.config import Policy
from runloop_proxy.conversation.items import to_items, to_messages
from runloop_proxy.conversation.messages import message_hash
from runloop_proxy.conversation.runloops import segment
from runloop_proxy.window.builder import build_window
from runloop_proxy.window.forms import Budget

from .test_window import OPS

TEXT = st.text(max_size=30)


@st.composite
def conversations(draw: Any) -> list[dict[str, Any]]:
    """What a Responses client sends: messages, the model's runs (reasoning, text, calls of
    several kinds), and the outputs of the calls it runs."""
    items: list[dict[str, Any]] = []
    call = 0
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["easy", "typed", "parts"]))
        text = draw(TEXT)
        if kind == "easy":
            items.append({"role": "user", "content": text})
        elif kind == "typed":
            items.append({"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": text}]})
        else:
            items.append({"role": "user", "content": [
                {"type": "input_text", "text": text},
                {"type": "input_image", "image_url": "data:image/png;base64,AA"}]})
        for _ in range(draw(st.integers(0, 3))):
            if draw(st.booleans()):
                items.append({"type": "reasoning", "id": f"rs_{call}", "summary": [],
                              "encrypted_content": draw(TEXT)})
            if draw(st.booleans()):
                items.append({"type": "message", "role": "assistant", "id": f"msg_{call}",
                              "status": "completed", "content": [
                                  {"type": "output_text", "text": draw(TEXT),
                                   "annotations": []}]})
            outputs = []
            for _ in range(draw(st.integers(0, 2))):
                call += 1
                cid = f"call_{call}"
                tool = draw(st.sampled_from(["function", "custom", "web"]))
                if tool == "function":
                    items.append({"type": "function_call", "call_id": cid, "name": "shell",
                                  "arguments": '{"cmd": "ls"}', "id": f"fc_{call}"})
                    outputs.append({"type": "function_call_output", "call_id": cid,
                                    "output": draw(TEXT)})
                elif tool == "custom":
                    items.append({"type": "custom_tool_call", "call_id": cid,
                                  "name": "apply_patch", "input": draw(TEXT)})
                    outputs.append({"type": "custom_tool_call_output", "call_id": cid,
                                    "output": draw(TEXT)})
                else:
                    items.append({"type": "web_search_call", "id": f"ws_{call}",
                                  "status": "completed", "action": {"query": draw(TEXT)}})
            items += outputs
        if draw(st.booleans()):
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": draw(TEXT),
                                       "annotations": []}]})
    return items


@settings(max_examples=300)
@given(conversations(), st.one_of(st.none(), TEXT))
def test_items_to_messages_and_back_is_the_identity(items: list[dict[str, Any]],
                                                    instructions: str | None) -> None:
    messages = to_messages(items, instructions)
    back_instructions, back = to_items(messages)
    assert back == items
    assert back_instructions == (instructions or None)
    # every message after the instructions belongs to a run loop, in order
    loops = segment(messages)
    assert sum(lp.end - lp.start for lp in loops) == len(messages) - bool(instructions)


def test_a_string_input_is_one_user_message() -> None:
    assert to_messages("hello", "be brief") == [
        {"role": "system", "content": "be brief", "instructions": True},
        {"role": "user", "content": "hello", "items": [{"role": "user", "content": "hello"}]}]


def test_the_models_run_is_one_assistant_message_with_its_calls() -> None:
    run = [{"type": "reasoning", "id": "rs_1", "summary": []},
           {"type": "message", "role": "assistant", "content": [
               {"type": "output_text", "text": "I'll look.", "annotations": []}]},
           {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
           {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*"}]
    (m,) = to_messages(run)
    assert m["role"] == "assistant" and m["content"] == "I'll look."
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in m["tool_calls"]] == [("c1", "shell", "{}"), ("c2", "apply_patch", "*")]


def test_what_the_window_changed_comes_back_as_valid_items() -> None:
    items: list[dict[str, Any]] = [{"role": "user", "content": "fix it"}]
    for k in range(12):
        items += [{"type": "reasoning", "id": f"rs_{k}", "summary": [],
                   "encrypted_content": "opaque"},
                  {"type": "custom_tool_call", "call_id": f"c{k}", "name": "apply_patch",
                   "input": "patch " * 50},
                  {"type": "custom_tool_call_output", "call_id": f"c{k}",
                   "output": f"result {k} " + "line " * 300}]
    messages = to_messages(items, "You code.")
    keys = [message_hash(m) for m in messages]
    w = build_window(messages, keys, [OPS.count(m) for m in messages],
                     Policy(keep_recent_tool_results=2, clear_at_least=0),
                     Budget(100_000, 2_000), OPS)
    assert w.changed
    instructions, back = to_items(w.messages)
    assert instructions == "You code."
    outputs = [i for i in back if i.get("type", "").endswith("_output")]
    # an elided output keeps its call's type, and names the ref that returns it
    assert all(i["type"] == "custom_tool_call_output" for i in outputs)
    assert any("recall_tool_call" in str(i["output"]) for i in outputs)
    # every call is answered, right after its run; reasoning stays before its call
    calls = [i["call_id"] for i in back if i.get("type") == "custom_tool_call"]
    assert calls == [i["call_id"] for i in outputs]
    assert calls == [f"c{k}" for k in range(12 - len(calls), 12)]  # the oldest may be dropped
    for k, item in enumerate(back):
        if item.get("type") == "reasoning":
            assert back[k + 1]["type"] == "custom_tool_call"


def test_a_changed_run_gives_back_the_providers_own_calls_as_they_were() -> None:
    """The window trims a run's text: its function call comes back with its arguments as the
    window left them, and a call of the provider's own kind (a computer call) as it came."""
    computer = {"type": "computer_call", "id": "cu_1", "call_id": "call_c",
                "action": {"type": "click", "x": 10, "y": 20}, "pending_safety_checks": [],
                "status": "completed"}
    run = [{"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
            "content": [{"type": "output_text", "text": "long " * 50, "annotations": []}]},
           {"type": "function_call", "call_id": "call_f", "name": "shell",
            "arguments": '{"cmd": "ls"}', "id": "fc_1"},
           computer]
    items = [{"role": "user", "content": "go"}, *run,
             {"type": "function_call_output", "call_id": "call_f", "output": "a b"},
             {"type": "computer_call_output", "call_id": "call_c",
              "output": {"type": "computer_screenshot", "image_url": "data:image/png;base64,AA"}}]
    messages = to_messages(items)
    assistant = next(m for m in messages if m["role"] == "assistant")
    assistant["content"] = "long long"  # what a trim leaves
    _, back = to_items(messages)
    assert [i.get("type") for i in back[1:4]] == ["message", "function_call", "computer_call"]
    assert back[1]["content"][0]["text"] == "long long"
    assert back[2]["arguments"] == '{"cmd": "ls"}'
    assert back[3] == computer


@pytest.mark.parametrize(("content", "read"), [
    ("", ""),  # an empty text stays a text, not a list of no parts
    ("where is order 7", "where is order 7"),
    (None, ""),
    (7, ""),
    ({"type": "input_text", "text": "not a list"}, ""),
    ([], []),
    ([{"type": "input_text", "text": "one part"}], "one part"),
    ([{"type": "input_text", "text": "a"}, {"type": "output_text", "text": "b"}],
     [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
    ([{"type": "input_image", "image_url": "data:image/png;base64,iVBO"}],
     [{"type": "input_image", "image_url": "data:image/png;base64,iVBO"}]),
])
def test_a_messages_content_is_read_as_the_window_reads_it(content: Any, read: Any) -> None:
    """Each shape a Responses message's content comes in, read exactly: text parts joined
    when there is one, kept as parts when there are more, anything else as it is or empty.

    Bug class: a reader's type guard widened (mutation sample, seed 3907: ``and`` for
    ``or`` in ``_content``'s guard read an empty text as a list of no parts and raised on
    a null content). Planted too: a non-text part's list read as text (``in`` for the part
    type check dropped)."""
    (message,) = to_messages([{"type": "message", "role": "user", "content": content}])
    assert message["content"] == read
