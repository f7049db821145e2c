"""A model's summary says what it no longer holds (``history.summaries.not_held``): pure,
table-driven and by property."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy.history.summaries import not_held


def words(text: str) -> int:  # one token a word
    return len(text.split())


@pytest.mark.parametrize(("text", "previous", "sources", "skipped", "budget", "said"), [
    # appended to: the previous summary is all there, the loop's identifiers too
    ("Goals: refund #W1001\nLater turns:\nrefund RF-7731", "Goals: refund #W1001",
     ["user: refund RF-7731 please"], None, 40, None),
    # condensed: the previous summary's order is gone, and said
    ("Goals: refunds RF-7731", "Goals: refund #W1001 for ada@example.com",
     ["user: refund RF-7731 please"], None, 40,
     "identifiers #W1001 ada@example.com"),
    # the call was not given two loops: they are named, with what they held
    ("Goals: refunds RF-7731", None, ["tool: order #W2002 shipped", "user: RF-7731"],
     (2, 3), 40, "loops 2–3 (the call was not given them); identifiers #W2002"),
    ("Goals: refunds RF-7731", None, ["tool: nothing here"], (4, 4), 40,
     "loop 4 (the call was not given them)"),
    # too many to name in the budget: as many as fit, then how many more
    ("Goals: x", None, [" ".join(f"#W{k:04d}" for k in range(50))], None, 24,
     "and 45 more"),
])
def test_what_a_summary_no_longer_holds_is_said(text: str, previous: str | None,
                                                 sources: list[str],
                                                 skipped: tuple[int, int] | None,
                                                 budget: int, said: str | None) -> None:
    """Bug class: what condensing loses, lost silently (planted: the previous summary's
    identifiers left out of the lost ones; the skipped loops not named)."""
    out, lost = not_held(text, previous, sources, skipped, budget, words)
    assert words(out) <= budget
    if said is None:
        assert out == text and lost == []
        return
    assert out.startswith(text.split("\n")[0])
    note = out.split("\n")[-1]
    assert note.startswith("Not held in this summary (search_history finds them, "
                           "recall_tool_call returns any tool result):")
    assert said in note, note


def test_a_summary_longer_than_its_budget_is_cut_at_a_line() -> None:
    """Bug class: a summary of summaries past summary_max_tokens (planted: the model's text
    kept whole when it wrote more than it was given)."""
    text = "\n".join(f"- loop {k}: asked about order #W{k}" for k in range(30))
    out, lost = not_held(text, None, [], None, 60, words)
    assert words(out) <= 60
    kept = [ln for ln in out.split("\n") if ln.startswith("- loop")]
    assert kept and text.startswith("\n".join(kept))
    assert lost == []  # the sources held nothing else; what the cut took is the model's


IDS = st.lists(st.from_regex(r"#W[0-9]{4}", fullmatch=True), max_size=60, unique=True)


@settings(max_examples=150, deadline=None)
@given(IDS, IDS, IDS, st.integers(24, 120), st.booleans())
def test_every_lost_identifier_is_named_or_counted_within_the_budget(
        held: list[str], previous: list[str], sources: list[str], budget: int,
        skipped: bool) -> None:
    """Whatever the model kept, the summary as stored stays within its budget and every
    identifier it lost is named in its note or counted in its "and N more"."""
    text = "Goals: " + " ".join(held[:max(0, budget // 3)])
    prev = "Goals: " + " ".join(previous) if previous else None
    out, lost = not_held(text, prev, [" ".join(sources)], (1, 2) if skipped else None,
                         budget, words)
    assert words(out) <= budget
    kept = set(re.findall(r"#W\d{4}", text))
    expected = [i for i in dict.fromkeys([*(previous if prev else []), *sources])
                if i not in kept]
    assert lost == expected
    if not lost and not skipped:
        assert out == text
        return
    note = out.split("\n")[-1]
    named = set(re.findall(r"#W\d{4}", note))
    more = re.search(r"and (\d+) more|: (?:loops 1–2 \(the call was not given them\); )?"
                     r"(\d+) identifiers", note)
    counted = int(next(g for g in more.groups() if g)) if more else 0
    assert named <= set(lost) and len(named) + counted == len(lost), note


@pytest.mark.parametrize(("record", "heading"), [
    ({"not_held": {"loops": [2, 5], "identifiers": ["#W3000"], "identifiers_lost": 14}},
     " (loops 2–5 not held, 14 identifiers not held: search_history finds them)"),
    ({"not_held": {"loops": [3, 3], "identifiers": [], "identifiers_lost": 0}},
     " (loop 3 not held: search_history finds them)"),
    ({"not_held": {"loops": None, "identifiers": ["#W1000"], "identifiers_lost": 1}},
     " (1 identifier not held: search_history finds them)"),
    ({}, ""),
    ({"not_held": "garbage"}, ""),
])
def test_the_inspectors_summary_heading_names_what_it_does_not_hold(
        record: dict[str, object], heading: str) -> None:
    """A summary's label names what it covers and what it does not (bug class: a label
    claiming more than the summary holds; planted: the skipped loops left out of the
    heading, and the identifier count read from the list kept, capped at 200)."""
    from runloop_proxy.ops.inspector_session import _not_held

    assert _not_held(record) == heading
