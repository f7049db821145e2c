"""Reference retention and the extractive digest (pure): what a window keeps of what the next
reply uses, and what a summary carries of the loops it covers."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy.window.digest import IDS_HEADER, loop_digest, parse, roll
from runloop_proxy.window.retention import Conversation, candidates


def call(name: str, args: str, cid: str = "c1") -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


@pytest.mark.parametrize(("reply", "want"), [
    ({"role": "assistant", "content": "Order #W2378156 ships to /home/mia on 2024-05-20."},
     ["#W2378156", "/home/mia", "2024-05-20"]),
    ({"role": "assistant", "content": 'The user is "Mia Li" and `mia_li_3668`.'},
     ["mia_li_3668", "Mia Li"]),
    ({"role": "assistant", "content": None, "tool_calls": [
        call("get_order", '{"order_id": "#W1", "nested": {"n": 4421486, "ok": true}}')]},
     ["#W1", "4421486"]),  # argument values of three characters or more; no booleans
    ({"role": "assistant", "content": "nothing identifiable here"}, []),
    ({"role": "assistant", "content": "id 123, 123 and 123."}, ["123"]),
])
def test_candidates(reply: dict[str, Any], want: list[str]) -> None:
    assert candidates(reply) == want  # type: ignore[arg-type]


def conversation() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are an agent. Policy id P-100."},
        {"role": "user", "content": "find order #W2378156"},
        {"role": "assistant", "content": None, "tool_calls": [
            call("get_order", '{"order_id": "#W2378156"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "shipped by carrier-77 on 2024-05-20"},
        {"role": "assistant", "content": "#W2378156 shipped by carrier-77."},
        {"role": "user", "content": "and when?"},
        {"role": "assistant", "content": "On 2024-05-20 with carrier-77 (policy P-100; #NEW999)."},
    ]


def test_references_by_origin_and_what_a_window_keeps() -> None:
    msgs = conversation()
    conv = Conversation(msgs, fixed="You are an agent. Policy id P-100.")  # type: ignore[arg-type]
    # the reply at 6: its loop starts at 5; P-100 is the system prompt's, #NEW999 is new
    current, past = conv.references(6, 5)
    assert current == [] and past == ["2024-05-20", "carrier-77"]
    assert conv.retention(6, 5, msgs[:6]).as_dict()["past_loops"] == 1.0  # type: ignore[arg-type]
    reduced = [msgs[0], msgs[1], {"role": "assistant", "content": "#W2378156 shipped."},
               msgs[5]]
    r = conv.retention(6, 5, reduced)  # type: ignore[arg-type]
    assert (r.past, r.past_kept) == (2, 0)
    with_summary = [*reduced, {"role": "system", "content": "ids: carrier-77"}]
    assert conv.retention(6, 5, with_summary).past_kept == 1  # type: ignore[arg-type]


def test_a_reference_in_the_current_loop_counts_as_current() -> None:
    msgs = conversation()[:5]
    conv = Conversation(msgs, fixed="")  # type: ignore[arg-type]
    current, past = conv.references(4, 1)
    assert current == ["#W2378156", "carrier-77"] and past == []


texts = st.text(alphabet="abc123/#-_ ", min_size=0, max_size=40)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(texts, texts), min_size=1, max_size=8), texts)
def test_pass_through_retains_everything(turns: list[tuple[str, str]], system: str) -> None:
    """The measure's own sanity check: the window that is the request itself keeps 100%."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for q, a in turns:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    conv = Conversation(msgs, fixed=system)  # type: ignore[arg-type]
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            r = conv.retention(i, 0, msgs[:i])  # type: ignore[arg-type]
            assert r.kept == r.total


def test_loop_digest_keeps_question_answer_and_identifiers() -> None:
    line, ids = loop_digest(conversation()[1:5])  # type: ignore[arg-type]
    assert line.startswith("- Q: find order #W2378156 [tools: get_order] → A: #W2378156 shipped")
    assert ids == ["#W2378156", "carrier-77", "2024-05-20"]


def test_roll_is_bounded_and_keeps_identifiers_longest() -> None:
    loops = [[{"role": "user", "content": f"question {k} about item-{k}"},
              {"role": "assistant", "content": f"answer {k}"}] for k in range(200)]
    text = None
    sizes = []
    for k in range(0, 200, 10):  # rolling: each summary from the last and ten new loops
        text = roll(text, loops[k:k + 10], 300, lambda t: len(t) // 4)  # type: ignore[arg-type]
        sizes.append(len(text) // 4)
    assert max(sizes) <= 300
    lines, ids = parse(text)
    assert "item-199" in ids and lines[-1].startswith("- Q: question 199")
    assert IDS_HEADER in text
    # nothing is made up: every identifier comes from a loop
    assert all(i.startswith("item-") or i.isdigit() for i in ids)


def test_with_summaries_the_drop_note_keeps_the_identifiers_of_what_it_drops() -> None:
    from runloop_proxy.config import Policy

    from .test_window import OPS, S, U, build

    msgs: list[dict[str, Any]] = [S, U(tag="task")]
    for k in range(60):
        msgs += [{"role": "assistant", "content": "looking", "tool_calls": [
            call("get_order", f'{{"order_id": "#W{k:03d}77"}}', f"c{k}")]},
            {"role": "tool", "tool_call_id": f"c{k}",
             "content": f"order #W{k:03d}77 ships via carrier-{k}9 " + "pad " * 60}]
    plain = build(msgs, Policy(keep_recent_tool_results=2, clear_at_least=0),  # type: ignore[arg-type]
                  working=900)
    digest = build(msgs, Policy(keep_recent_tool_results=2, clear_at_least=0,  # type: ignore[arg-type]
                                summary_model="extractive"), working=900)
    assert "Identifiers from them" not in plain.messages[1]["content"]
    note = digest.messages[1]["content"]
    assert "Identifiers from them: #W00077 #W00177 #W00277" in note
    assert digest.fits and OPS.count(digest.messages[1]) < 400


def test_roll_appends_while_it_fits_then_condenses_to_half_the_budget() -> None:
    """Between rewrites the digest's text only grows (a provider's prefix cache keeps the
    marker); a rewrite brings it to half the budget, so the batches after it append again."""
    loops = [[{"role": "user", "content": f"question {k} about item-{k}"},
              {"role": "assistant", "content": f"answer {k}"}] for k in range(60)]
    count = lambda t: len(t) // 4  # noqa: E731
    text: str | None = None
    appended = rewritten = 0
    for k in range(0, 60, 3):
        new = roll(text, loops[k:k + 3], 300, count)  # type: ignore[arg-type]
        if text is not None and new.startswith(text + "\n"):
            appended += 1
        elif text is not None:
            rewritten += 1
            assert count(new) <= 150
        assert count(new) <= 300
        text = new
    assert appended > 2 * rewritten > 0


def test_a_hidden_reference_is_recallable_found_by_search_or_lost() -> None:
    """Each reference the window hides is counted by its way back: a ref (or call id) of a
    message holding it shown in the window, else a search_history hit on a holder, else lost."""
    msgs = conversation()
    conv = Conversation(msgs, fixed="")  # type: ignore[arg-type]
    refs = [f"ref{k:03d}" for k in range(len(msgs))]
    searched: list[str] = []

    def search(found: list[int]) -> Any:
        def run(query: str, upto: int) -> list[int]:
            searched.append(query)
            assert upto == 6
            return found
        return run

    # 2024-05-20 and carrier-77 lie in the tool result (3); carrier-77 also in the reply (4)
    hidden = [msgs[0], msgs[1], {"role": "assistant", "content": "#W2378156 shipped."}, msgs[5]]
    r = conv.retention(6, 5, hidden, refs, search([]))  # type: ignore[arg-type]
    assert (r.past_kept, r.by_ref, r.by_search, r.lost) == (0, 0, 0, 2)
    with_ref = [*hidden, {"role": "system", "content": 'recall_tool_call(call_id="ref003")'}]
    r = conv.retention(6, 5, with_ref, refs, search([]))  # type: ignore[arg-type]
    assert (r.by_ref, r.lost) == (2, 0)
    r = conv.retention(6, 5, hidden, refs, search([4]))  # type: ignore[arg-type]
    assert (r.by_ref, r.by_search, r.lost) == (0, 1, 1)  # carrier-77 in 4; the date only in 3
    assert searched[-2:] == ["2024-05-20", "carrier-77"]
    assert r.as_dict()["lost"] == 1 and "lost" not in conv.retention(  # type: ignore[arg-type]
        6, 5, hidden).as_dict()  # unmeasured without refs
