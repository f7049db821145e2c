"""Closed run loops cut into anchored segments (conversation/segments.py, pure)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy.conversation.segments import (
    MAX_PARTS,
    Anchor,
    Kind,
    archived_loops,
    closed_loops,
    segment_key,
    segments,
    split,
)

ORDER = "order #W5102934"


def _call(cid: str, name: str, args: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are the support agent of an online store."},
    {"role": "user", "content": f"I want a reimbursement for {ORDER}."},
    {"role": "assistant", "content": "Looking the order up first.",
     "tool_calls": [_call("call_Qm3xT8", "get_order", '{"order_id": "#W5102934"}')]},
    {"role": "tool", "tool_call_id": "call_Qm3xT8", "content": '{"status": "delivered"}'},
    {"role": "assistant", "content": None,
     "tool_calls": [_call("call_Zp1aL4", "refund", '{"order_id": "#W5102934"}'),
                    _call("call_Zp1aL5", "notify", '{"channel": "email"}')]},
    {"role": "tool", "tool_call_id": "call_Zp1aL4", "content": "refund issued"},
    {"role": "tool", "tool_call_id": "call_Zp1aL5", "content": "email sent"},
    {"role": "assistant", "content": "Your refund of $54.04 is on its way."},
    {"role": "user", "content": "Thanks, and my address?"},
]


def test_a_closed_loop_is_cut_by_kind_with_its_anchors() -> None:
    """Catches: a loop's kinds or anchors mislabelled (planted: an assistant's text beside
    calls taken as the response, red; the iteration never advanced, red); and the open last
    loop archived (planted: every loop taken, red on the loop count)."""
    loops = closed_loops(CONVERSATION)
    assert [lp.index for lp in loops] == [0]
    got = [(s.anchor, s.text) for s in segments(CONVERSATION, loops)]
    assert got == [
        (Anchor(0, 0, 0, Kind.USER, 1, 0), f"I want a reimbursement for {ORDER}."),
        (Anchor(0, 0, 1, Kind.REASONING, 2, 0), "Looking the order up first."),
        (Anchor(0, 0, 2, Kind.TOOL_CALL, 2, 0), 'get_order({"order_id": "#W5102934"})'),
        (Anchor(0, 1, 3, Kind.TOOL_RESULT, 3, 0), '{"status": "delivered"}'),
        (Anchor(0, 1, 4, Kind.TOOL_CALL, 4, 0), 'refund({"order_id": "#W5102934"})'),
        (Anchor(0, 1, 5, Kind.TOOL_CALL, 4, 0), 'notify({"channel": "email"})'),
        (Anchor(0, 2, 6, Kind.TOOL_RESULT, 5, 0), "refund issued"),
        (Anchor(0, 2, 7, Kind.TOOL_RESULT, 6, 0), "email sent"),
        (Anchor(0, 2, 8, Kind.RESPONSE, 7, 0), "Your refund of $54.04 is on its way."),
    ]


def test_a_segment_is_keyed_by_its_kind_and_text_alone() -> None:
    """An echoed or forked copy of a loop (elsewhere in the conversation, other fields) is
    the same keys: embedded once. Catches: the key taking the anchor (planted: the position
    in the hash, red) or dropping the kind (planted, red on the last assertion)."""
    first = segments(CONVERSATION, closed_loops(CONVERSATION))
    forked = [CONVERSATION[0], {"role": "user", "content": "hello"},
              {"role": "assistant", "content": "hi", "refusal": None}, *CONVERSATION[1:]]
    again = segments(forked, closed_loops(forked))
    assert [s.key for s in again[2:]] == [s.key for s in first]
    assert again[2].anchor.loop == 1 and again[2].anchor.position == 3
    assert segment_key(Kind.USER, "same") != segment_key(Kind.RESPONSE, "same")


TASK: list[dict[str, Any]] = [  # a coding agent's single task, its steps still going
    {"role": "system", "content": "You are a software engineer working in a repository."},
    {"role": "user", "content": "Fix the failing timezone test in the scheduler."},
    {"role": "assistant", "content": "THOUGHT: find the test first.",
     "tool_calls": [_call("call_8sKq2", "bash", '{"cmd": "grep -rn timezone tests"}')]},
    {"role": "tool", "tool_call_id": "call_8sKq2", "content": "tests/test_sched.py:41: tz"},
    {"role": "assistant", "content": None,
     "tool_calls": [_call("call_8sKq3", "bash", '{"cmd": "pytest tests/test_sched.py"}'),
                    _call("call_8sKq4", "bash", '{"cmd": "git log -1"}')]},
    {"role": "tool", "tool_call_id": "call_8sKq3", "content": "1 failed: naive datetime"},
    {"role": "tool", "tool_call_id": "call_8sKq4", "content": "commit 4be1f0c"},
    {"role": "assistant", "content": "THOUGHT: patch it.",
     "tool_calls": [_call("call_8sKq5", "bash", '{"cmd": "sed -i s/now/utcnow/ sched.py"}')]},
    {"role": "tool", "tool_call_id": "call_8sKq5", "content": ""},
    {"role": "assistant", "content": "The scheduler now builds aware datetimes; fixed."},
]


@pytest.mark.parametrize(("upto", "archived"), [
    (2, []),  # the task alone: the question being asked, nothing finished yet
    (3, [range(1, 2)]),  # a call made, unanswered: the task is kept, not the call
    (4, [range(1, 2)]),  # answered, but the next step not begun: its call may be retried
    (5, [range(1, 4)]),  # the next step begun: the first is finished
    (7, [range(1, 4)]),  # both results of the second step in: still its newest
    (9, [range(1, 7)]),
    (10, [range(1, 10)]),  # the final reply: the loop closed, whole
])
def test_the_open_loop_keeps_its_finished_steps(upto: int, archived: list[range]) -> None:
    """Catches: the open loop left out (planted: ``closed_loops``, red from upto 3), its
    newest step taken while its calls may still be answered or retried (planted: the
    whole open loop, red at 3, 4 and 7)."""
    assert [lp.positions for lp in archived_loops(TASK[:upto])] == archived


def test_a_finished_step_is_the_same_segment_before_and_after_its_loop_closes() -> None:
    """Every segment the open loop's finished steps give, at every point of the task and of
    the support conversation, is one of the closed loop's own (key, anchor and text), so a
    vector embedded while the loop went on is the one its closed loop looks up. Catches: the
    open loop's part anchored as a loop of its own (planted: ``index=last.index + 1``,
    red)."""
    for conversation in (TASK, [*CONVERSATION[:-1]]):
        whole = set(segments(conversation, archived_loops(conversation)))
        for upto in range(len(conversation) + 1):
            part = segments(conversation[:upto], archived_loops(conversation[:upto]))
            assert set(part) <= whole, upto


@pytest.mark.parametrize(("text", "limit", "pieces"), [
    ("short", 100, ["short"]),
    ("", 100, []),
    ("   \n\n  ", 100, []),
    # a paragraph break in the second half wins over a line break and a sentence end
    ("aaaa bbbb. cccc\ndddd\n\neeee ffff", 24, ["aaaa bbbb. cccc\ndddd", "eeee ffff"]),
    # no paragraph: the last line break
    ("aaaa bbbb. cccc\ndddd eeee ffff", 24, ["aaaa bbbb. cccc", "dddd eeee ffff"]),
    # no line: the last sentence end
    ("aaaa bbbb. cccc dddd. eeee ffff", 24, ["aaaa bbbb. cccc dddd.", "eeee ffff"]),
    # of two sentence ends in the second half, the later
    ("xxxxxxxxxxxx a. b. cccccccc", 24, ["xxxxxxxxxxxx a. b.", "cccccccc"]),
    # a boundary in the first half only is not taken (pieces stay near the size)
    ("a.\n\n" + "b" * 38, 20, ["a.\n\n" + "b" * 16, "b" * 20, "b" * 2]),
    ("x" * 45, 20, ["x" * 20, "x" * 20, "x" * 5]),
])
def test_long_text_is_split_at_the_best_boundary(text: str, limit: int,
                                                  pieces: list[str]) -> None:
    """Catches: a cut at the first boundary rather than the last (planted: ``break`` on the
    first match, red on the two-sentences row), boundaries taken in the first half (planted:
    ``lo = start``, red on the short-paragraph row)."""
    assert split(text, limit) == pieces


def test_a_huge_message_gives_at_most_max_parts() -> None:
    """Catches: the cap on parts gone (planted: the ``len(out) < MAX_PARTS`` test removed,
    red): a 480 KB log would be 400 segments to embed."""
    assert len(split("word " * 100_000, 1_200)) == MAX_PARTS


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab .\n!"), max_size=400),
       st.integers(min_value=4, max_value=60))
def test_split_keeps_every_word_in_order_within_the_size(text: str, limit: int) -> None:
    """Every piece within the size, nothing lost or reordered (whitespace aside) while under
    the cap. Catches: a piece cut past ``max_chars`` (planted: ``end + 1``, red) or text
    skipped between pieces (planted: ``start = end + 1``, red)."""
    got = split(text, limit)
    assert all(0 < len(p) <= limit for p in got)
    if len(got) < MAX_PARTS:
        assert "".join("".join(got).split()) == "".join(text.split())


def _last_boundary(text: str, lo: int, hi: int) -> int:
    """The obvious cut: every match of each boundary in ``text[lo:hi]``, the last's end."""
    import re

    for pattern in (r"\n\s*\n", r"\n", r"(?<=[.!?;])\s", r"\s"):
        ends = [m.end() for m in re.compile(pattern).finditer(text, lo, hi)]
        if ends:
            return ends[-1]
    return hi


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab .;!?\n\t\r\x0b\u2028\u00a0"), max_size=120),
       st.data())
def test_a_long_text_is_cut_where_a_list_of_every_boundary_says(text: str, data: Any) -> None:
    """The cut matched from the end (the greedy prefix backing off to the last boundary)
    is the last boundary's end a scan of every match finds, in any window. Catches: the
    first boundary taken (planted: a lazy prefix, red), the window's start ignored
    (planted: ``match(text, 0, hi)``, red)."""
    from runloop_proxy.conversation.segments import _cut

    lo = data.draw(st.integers(0, len(text)))
    hi = data.draw(st.integers(lo, len(text)))
    assert _cut(text, lo, hi) == _last_boundary(text, lo, hi)
