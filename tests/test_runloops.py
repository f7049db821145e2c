"""Run-loop segmentation: table-driven cases and properties over random conversations."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runloop_proxy.conversation.runloops import LoopStatus, preamble_end, preview, segment

S = {"role": "system", "content": "sys"}
U = {"role": "user", "content": "q"}
F = {"role": "assistant", "content": "answer"}


def A(*ids: str, content: Any = None) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "t", "arguments": "{}"}} for i in ids]}


def T(i: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": i, "content": "r"}


CASES = [
    ("empty", [], []),
    ("system only", [S], []),
    ("one open question", [S, U], [(1, 2, "open", None)]),
    ("one closed loop", [S, U, F], [(1, 3, "closed", 2)]),
    ("tool loop", [S, U, A("a"), T("a"), F], [(1, 5, "closed", 4)]),
    ("parallel calls", [U, A("a", "b"), T("a"), T("b"), F], [(0, 5, "closed", 4)]),
    ("three loops", [S, U, F, U, A("x"), T("x"), F, U],
     [(1, 3, "closed", 2), (3, 7, "closed", 6), (7, 8, "open", None)]),
    ("user joins an open loop", [U, A("a"), T("a"), U, F], [(0, 5, "closed", 4)]),
    ("two users in a row", [U, U, F], [(0, 3, "closed", 2)]),
    ("starts with assistant", [F, U, F], [(0, 1, "closed", 0), (1, 3, "closed", 2)]),
    ("legacy function_call", [U, {"role": "assistant", "content": None,
                                   "function_call": {"name": "f", "arguments": "{}"}},
                              {"role": "function", "name": "f", "content": "r"}, F],
     [(0, 4, "closed", 3)]),
    ("content as parts, null and refusal",
     [U | {"content": [{"type": "text", "text": "hi"}]},
      {"role": "assistant", "content": None, "refusal": "no"}], [(0, 2, "closed", 1)]),
    ("open after tool result", [U, A("a"), T("a")], [(0, 3, "open", None)]),
    # a result after the final reply: the loop is not settled, it is still being worked on
    ("result after a final reply", [U, F, T("x")], [(0, 3, "open", None)]),
]


@pytest.mark.parametrize("name,messages,expected", CASES, ids=[c[0] for c in CASES])
def test_segment_table(name: str, messages: list[Any], expected: list[Any]) -> None:
    loops = segment(messages)
    got = [(lp.start, lp.end, lp.status.value, lp.final_position) for lp in loops]
    assert got == expected


def test_legacy_function_call_is_one_call_named_after_the_function() -> None:
    from runloop_proxy.conversation.messages import tool_calls_of

    fc = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    msg = {"role": "assistant", "content": None, "function_call": fc}
    assert tool_calls_of(msg) == [{"id": "function:get_weather", "type": "function",  # type: ignore[arg-type]
                                   "function": fc}]
    assert tool_calls_of({"role": "assistant", "content": None,  # type: ignore[arg-type]
                          "function_call": {"arguments": "{}"}})[0]["id"] == "function:"
    # tool_calls win over a function_call on the same message
    both = {**A("t1"), "function_call": fc}
    assert [c["id"] for c in tool_calls_of(both)] == ["t1"]  # type: ignore[arg-type]
    lp, = segment([U, msg, {"role": "function", "name": "get_weather", "content": "9C"}, F])
    assert lp.tool_call_ids == ("function:get_weather",)


def test_tool_call_ids_collected() -> None:
    loops = segment([U, A("a", "b"), T("a"), T("b"), A("c"), T("c"), F])
    assert loops[0].tool_call_ids == ("a", "b", "c")


message = st.one_of(
    st.just(U), st.just(F), st.just(S),
    st.builds(lambda i: A(f"c{i}"), st.integers(0, 5)),
    st.builds(lambda i: T(f"c{i}"), st.integers(0, 5)),
)


@given(st.lists(message, max_size=40))
def test_every_message_in_exactly_one_loop_in_order(messages: list[Any]) -> None:
    loops = segment(messages)
    covered = [i for lp in loops for i in lp.positions]
    assert covered == list(range(preamble_end(messages), len(messages)))
    for k, lp in enumerate(loops):
        assert lp.index == k and lp.start < lp.end


@given(st.lists(message, max_size=40))
def test_loop_boundaries_as_defined(messages: list[Any]) -> None:
    loops = segment(messages)
    for lp in loops:
        if lp.index > 0:
            # a loop after the first starts with a user message once the previous loop gave
            # its final reply (only system notes may stand between them)
            assert messages[lp.start]["role"] == "user"
            prev = loops[lp.index - 1]
            assert prev.status is LoopStatus.CLOSED
            between = messages[prev.final_position + 1:lp.start]  # type: ignore[operator]
            assert all(m["role"] in ("system", "developer") for m in between)
        if lp.status is LoopStatus.CLOSED:
            final = messages[lp.final_position]  # type: ignore[index]
            assert final["role"] == "assistant" and not final.get("tool_calls")
        # a user message joins a loop only while it is open (no final reply yet, or a tool
        # result after it)
        for i in range(lp.start + 1, lp.end):
            if messages[i]["role"] == "user":
                before = [m for m in messages[lp.start:i] if m["role"] in ("assistant", "tool")]
                assert not before or before[-1]["role"] == "tool" \
                    or before[-1].get("tool_calls")


@pytest.mark.parametrize(("text", "chars", "shown"), [
    ("short", 20, "short"),
    ("your parcel 1Z0109A0000000001 ships today", 24, "your parcel …"),
    ("your parcel 1Z0109A0000000001 ships today", 31, "your parcel 1Z0109A0000000001 …"),
    ("https://example.com/a/very/long/path/to/a/file.txt and more", 20,
     "https://example.com/a/very/long/path/to/a/file.txt …"),
    ("x" * 100, 20, "x" * 19 + "…"),  # no identifier: a blob is cut
    ("  spaced\n\tout   words ", 40, "spaced out words"),
])
def test_a_preview_is_cut_between_words(text: str, chars: int, shown: str) -> None:
    assert preview({"role": "user", "content": text}, chars) == shown


@given(st.lists(st.text(alphabet="aZ09#-./:", min_size=1, max_size=30), max_size=40),
       st.integers(10, 150))
def test_a_preview_shows_whole_words_in_order(words: list[str], chars: int) -> None:
    text = " ".join(words)
    shown = preview({"role": "user", "content": text}, chars)
    kept = shown.removesuffix(" …").split()
    assert kept == words[:len(kept)]  # whole words, none cut
    assert shown == text or shown.endswith(" …")
    assert len(shown) <= chars + 2 or kept == words[:1]
