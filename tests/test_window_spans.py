"""Every loop's messages are where the window says they are, whatever the policy and budget:
a property over the window builder's spans. The segmentation (``runloops.segment``) is the
oracle for where each loop starts and ends; the window's own counts (``omitted_loops``,
``reduced_loops``) say what it did to them. Then, message by message:

- every question of every loop not omitted is shown exactly once, in order (whole, or cut to
  its head and tail, or carrying a drop note), and no question of an omitted loop;
- every final reply of a loop not omitted is shown exactly once, in order (whole or capped) —
  and an omitted loop's only as the one reply an omission may keep after the marker;
- the only tool results shown are those of loops shown whole, each at most once, and each call
  a whole loop shows is answered.

An off-by-one anywhere a span is taken — a reduced loop's messages, the first loop shown whole,
the loops rendered reduced, a loop's question or reply — moves a message out of its loop, drops
it, or shows it twice, and this fails."""

from __future__ import annotations

import os
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runloop_proxy.config import Policy
from runloop_proxy.conversation.messages import Message, message_text, tool_calls_of
from runloop_proxy.conversation.runloops import RunLoop, segment
from runloop_proxy.window.builder import Window
from runloop_proxy.window.forms import TAG

from .test_window import assert_valid, build, conversations, policies

PROPS = settings(max_examples=int(os.environ.get("WINDOW_EXAMPLES", "120")), deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def first_word(m: Message) -> str:
    words = message_text(m).split()
    return words[0] if words else ""


def proxys(m: Message) -> bool:
    """A message the proxy wrote (the marker, a summary, a ledger alone, a stand-in)."""
    return message_text(m).startswith(TAG)


def opening_task(msgs: list[Message], loops: list[RunLoop]) -> list[str]:
    """The first loop's user messages before its first assistant message (the task)."""
    out = []
    for i in loops[0].positions if loops else []:
        if msgs[i]["role"] != "user":
            break
        out.append(first_word(msgs[i]))
    return out


def spans_hold(msgs: list[Message], w: Window, policy: Policy, opening_may_go: bool) -> None:
    """``opening_may_go``: the hard limit's last resort may have dropped the opening task."""
    loops = segment(msgs)
    shown_from = w.omitted_loops
    whole_from = w.omitted_loops + w.reduced_loops
    assert 0 <= shown_from <= whole_from <= len(loops)
    out = [m for m in w.messages if m["role"] != "system"]
    # questions: every shown loop's, in order, once each; with keep_opening and the first
    # loop omitted, its opening task first
    questions = [first_word(msgs[i]) for lp in loops[shown_from:] for i in lp.user_positions]
    asked = [first_word(m) for m in out if m["role"] == "user" and not proxys(m)]
    if policy.keep_opening and shown_from > 0:
        opened = opening_task(msgs, loops) + questions
        assert asked == opened or (opening_may_go and asked == questions), (asked, opened)
    else:
        assert asked == questions, (asked, questions)
    # final replies: every shown loop's, in order, once each; before them at most the reply
    # of the last omitted loop (kept after the marker)
    finals = [first_word(msgs[lp.final_position]) for lp in loops[shown_from:]
              if lp.final_position is not None]
    said = [first_word(m) for m in out if m["role"] == "assistant"
            and not tool_calls_of(m) and not proxys(m) and first_word(m).startswith("a")]
    kept = [] if shown_from == 0 or loops[shown_from - 1].final_position is None else \
        [first_word(msgs[loops[shown_from - 1].final_position])]  # type: ignore[index]
    assert said in (finals, kept + finals), (said, finals)
    # tool results: only whole loops', each at most once; every call shown is answered
    whole = Counter(msgs[i]["tool_call_id"] for lp in loops[whole_from:] for i in lp.positions
                    if msgs[i]["role"] == "tool")
    results = Counter(m["tool_call_id"] for m in out if m["role"] == "tool")
    assert not results - whole, (results, whole)
    calls = Counter(c["id"] for m in out for c in tool_calls_of(m))
    assert calls == results, (calls, results)


@PROPS
@given(conversations(), policies, st.integers(300, 3000))
def test_every_loops_messages_are_where_the_window_says(msgs: list[Message], policy: Policy,
                                                         working: int) -> None:
    w = build(msgs, policy, hard=working * 10, working=working)
    assert_valid(w.messages)
    spans_hold(msgs, w, policy, opening_may_go=not w.fits)


@PROPS
@given(conversations(), policies, st.integers(300, 3000))
def test_spans_hold_under_the_hard_limit_too(msgs: list[Message], policy: Policy,
                                             working: int) -> None:
    """With a hard limit close to the working budget, exchanges are dropped whole: questions
    and replies still all where they belong."""
    w = build(msgs, policy, hard=working + 200, working=working)
    if w.fits:
        spans_hold(msgs, w, policy, opening_may_go=True)
