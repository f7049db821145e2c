"""Reference retention and the extractive digest (pure): what a window keeps of what the next
reply uses, and what a summary carries of the loops it covers."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy.window.digest import (
    IDS_HEADER,
    _clip,
    argument_values,
    block,
    condensed,
    found_in,
    identifiers,
    leaves,
    loop_digest,
    parse,
    pick,
    result_identifiers,
    roll,
    strength,
)
from runloop_proxy.window.retention import Conversation, candidates, careful_candidates, holds

from .policies import mechanism


def call(name: str, args: str, cid: str = "c1") -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def one_loop(user: str, tool: str, args: str, result: str, final: str
             ) -> list[dict[str, Any]]:
    """A run loop: the user's question, one tool call and its result, the final answer."""
    return [{"role": "user", "content": user},
            {"role": "assistant", "content": "", "tool_calls": [call(tool, args)]},
            {"role": "tool", "tool_call_id": "c1", "content": result},
            {"role": "assistant", "content": final}]


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


def test_summaries_change_nothing_in_a_window_that_omits_no_loop() -> None:
    """Summaries stand for omitted loops: a one-loop agent run (a coding task) whose window
    drops and elides its own tool exchanges is forwarded the same with them on as off, the
    drop note included (it names the calls, and search_history and recall reach them). Under
    ``MECHANISM`` (no summary unless the test turns one on), and the defaults' (the extractive
    digest) alike."""
    from runloop_proxy.config import Policy

    from .test_window import S, U, build

    msgs: list[dict[str, Any]] = [S, U(tag="task")]
    for k in range(60):
        msgs += [{"role": "assistant", "content": "looking", "tool_calls": [
            call("get_order", f'{{"order_id": "#W{k:03d}77"}}', f"c{k}")]},
            {"role": "tool", "tool_call_id": f"c{k}",
             "content": f"order #W{k:03d}77 ships via carrier-{k}9 " + "pad " * 60}]
    plain = build(msgs, mechanism(keep_recent_tool_results=2, clear_at_least=0), working=900)
    digest = build(msgs, mechanism(keep_recent_tool_results=2, clear_at_least=0,
                                   summary_model="extractive"), working=900)
    defaults = build(msgs, Policy(keep_recent_tool_results=2, clear_at_least=0),  # type: ignore[arg-type]
                     working=900)
    assert plain.omitted_loops == digest.omitted_loops == defaults.omitted_loops == 0
    note = plain.messages[1]["content"]
    assert "tool exchange(s) after this message (calls c0 … " in note and "search_history" in note
    assert digest.messages == plain.messages == defaults.messages
    assert digest.fits


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


@pytest.mark.parametrize(("text", "want"), [
    ("ids a1b and ab1 but x1", ["a1b", "ab1"]),  # three characters or more
    ("path a/b, mail a@b, plain abc", ["a/b", "a@b"]),  # a separator counts like a digit
    ("1" * 80 + " " + "2" * 81, ["1" * 80]),  # at most 80 characters
    ("see #W123. (or W9!) =k42", ["#W123", "k42"]),  # trimmed of punctuation, split on =
])
def test_identifiers(text: str, want: list[str]) -> None:
    assert identifiers(text) == want


def test_clip_keeps_n_characters_with_the_ellipsis() -> None:
    assert _clip("abc  \n def", 7) == "abc def"
    assert _clip("abcdefgh", 8) == "abcdefgh"
    assert _clip("abcdefgh", 5) == "abcd…"


def test_condensed_trims_oldest_lines_then_oldest_ids_then_the_newest_line() -> None:
    count = len  # a character is a token here
    lines, ids = ["- one", "- two", "- three"], [f"id{k}" for k in range(16)]
    whole = block(lines, ids)
    assert condensed(lines, ids, len(whole), count) == whole  # exactly the budget: kept
    assert condensed(lines, ids, len(whole) - 1, count) == block(lines[1:], ids)
    one = block(lines[2:], ids)
    assert condensed(lines, ids, len(one), count) == one  # two oldest lines out, ids whole
    assert condensed(lines, ids, len(one) - 1, count) == block(lines[2:], ids[3:])  # 16//8+1
    long = ["- " + "x" * 100]
    assert condensed([*lines[:1], *long], [], 20, count) == block([], [])


def test_message_text_shows_calls_by_name_and_arguments() -> None:
    from runloop_proxy.window.retention import message_text

    m = {"role": "assistant", "content": "ok", "tool_calls": [
        call("get_order", '{"id": "#W1"}'),
        {"id": "c2", "type": "custom", "custom": {"name": "apply_patch", "input": "*** x"}}]}
    assert message_text(m) == \
        'ok\nc1\nget_order\n{"id": "#W1"}\nc2\napply_patch\n*** x'  # type: ignore[arg-type]
    assert message_text({"role": "tool", "content": "r"}) == "r"  # type: ignore[arg-type]


@pytest.mark.parametrize(("reply", "want"), [
    ({"role": "assistant", "content": "say 'one two' then `x=1` and \"end\""},
     ["one two", "x=1", "end"]),  # each kind of quote, in order (x, 1: too short alone)
    ({"role": "assistant", "content": None, "tool_calls": [call("f", "not json {")]},
     ["not json {"]),  # arguments that are not JSON count whole
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "custom",
      "custom": {"name": "shell", "input": "ls /srv/app"}}]}, ["ls /srv/app"]),
    ({"role": "assistant", "content": "ab1 " + "9" * 201 + " " + "8" * 200},
     ["ab1", "8" * 200]),  # 3 to 200 characters
    ({"role": "assistant", "content": None, "tool_calls": [
        call("f", '{"a": ["x-1", ["y-22"]]}'), call("g", '{"b": "z-333"}', "c2")]},
     ["x-1", "y-22", "z-333"]),  # every call's values, lists within lists
    ({"role": "assistant", "content": " ".join(f"n{k:03d}" for k in range(70))},
     [f"n{k:03d}" for k in range(64)]),  # at most 64 per reply
])
def test_candidates_more(reply: dict[str, Any], want: list[str]) -> None:
    assert candidates(reply) == want  # type: ignore[arg-type]


def test_retention_adds_up_and_reports_shares() -> None:
    from runloop_proxy.window.retention import Retention

    a = Retention(4, 3, 2, 1, by_ref=1, by_search=0, measured=True)
    a.add(Retention(1, 1, 2, 0, by_ref=0, by_search=2))
    a.add(Retention(0, 0, 1, 1, by_ref=1, by_search=1))
    a.add(Retention(0, 0, 1, 0, by_ref=0, by_search=0))
    assert (a.current, a.current_kept, a.past, a.past_kept, a.by_ref, a.by_search) == \
        (5, 4, 6, 2, 2, 3)
    a = Retention(4, 3, 2, 1, by_ref=1, by_search=0, measured=True)
    a.add(Retention(1, 1, 2, 0, by_ref=0, by_search=2))
    assert (a.total, a.kept, a.lost) == (9, 5, 1) and a.measured
    assert a.as_dict() == {"references": 9, "retained": 0.5556, "current_loop": 0.8,
                           "past_loops": 0.25, "current_references": 5, "past_references": 4,
                           "hidden": 4, "recallable_by_ref": 1, "found_by_search": 2,
                           "lost": 1}
    assert Retention().as_dict() == {"references": 0, "retained": None, "current_loop": None,
                                     "past_loops": None, "current_references": 0,
                                     "past_references": 0}


def test_loop_digest_joins_questions_names_tools_and_takes_the_last_final() -> None:
    loop = [{"role": "user", "content": "first ask-1"}, {"role": "user", "content": "then"},
            {"role": "assistant", "content": "checking", "tool_calls": [
                call("zeta", ""), call("alpha", '{"k": "v-22"}', "c2"), call("", "", "c3")]},
            {"role": "tool", "tool_call_id": "c1", "content": "row-7"},
            {"role": "assistant", "content": "early"}, {"role": "assistant", "content": "done"}]
    line, ids = loop_digest(loop)  # type: ignore[arg-type]
    assert line == "- Q: first ask-1 / then [tools: alpha, zeta] → A: done"
    assert ids == ["ask-1", "v-22", "row-7"]  # users, arguments, finals, then results
    line, _ = loop_digest([{"role": "user", "content": "q"}])  # type: ignore[arg-type]
    assert line == "- Q: q → A: (no answer)"


@pytest.mark.parametrize(("ident", "rank"), [
    ("#W2378156", 0), ("gift_card_6490722", 0), ("HAT023", 0), ("item-7", 0),
    ("2024-05-20", 1), ("/src/app.py", 1), ("a@b.io", 1), ("8293011", 1), ("12345", 1),
    ("1234", 2), ("253", 2), ("$142", 2), ("54.04", 2), ("11:00:00", 2),
    ("2024-05-03T06:57:21", 2), ("10:30", 2),
])
def test_strength_ranks_codes_before_dates_before_quantities_and_clocks(
        ident: str, rank: int) -> None:
    assert strength(ident) == rank


def test_loop_digest_keeps_what_was_said_first_then_the_strongest_results() -> None:
    loop = one_loop("change flight 1234", "get", '{"reservation": "XEWRD9"}',
                    "seats 253 at 11:00:00 on 2024-05-20 price 54.04 code HAT023 user u_77",
                    "done: 1234 moved")
    _, ids = loop_digest(loop)  # type: ignore[arg-type]
    # a result's amounts come last (a later reply quotes a fare or a refund: 1.7 points of
    # the careful reader's past retention on both halves); its clock times and row
    # coordinates are left out
    assert ids == ["1234", "XEWRD9", "HAT023", "u_77", "2024-05-20", "253", "54.04"]
    loop[-1] = {"role": "assistant", "content": "moved to seat 14C on 2024-05-20"}
    _, ids = loop_digest(loop)  # type: ignore[arg-type]  # the reply's before the results'
    assert ids[:4] == ["1234", "XEWRD9", "14C", "2024-05-20"] and ids[4] == "HAT023"
    rows = one_loop("show rows", "get", '{"table": "t"}',
                    "0-0 0-1 11:30 $12.50 " + " ".join(str(n) for n in range(101, 111)), "done")
    _, ids = loop_digest(rows)  # type: ignore[arg-type]
    assert ids == ["$12.50", *(str(n) for n in range(101, 108))]  # AMOUNTS of them


def test_a_tool_call_passes_identifiers_whole_and_a_result_names_none_by_its_fields() -> None:
    """What the agent passed a tool is an identifier whatever its look (a booking code of
    letters, an airport, a surname); a JSON result's field names are not."""
    assert argument_values('{"reservation_id": "HXDUBJ", "origin": "SEA", "n": 2, '
                           '"ok": true, "thought": "try flight HAT102 on 2024-05-20 first", '
                           '"passengers": [{"last_name": "Smith"}]}') == [
        "HXDUBJ", "SEA", "HAT102", "2024-05-20", "Smith"]
    assert argument_values("not json id-42") == ["id-42"]
    loop = one_loop("my booking", "get", '{"reservation_id": "HXDUBJ"}',
                    '{"address1": "Main St", "user_id": "mia_li_3668", "zip": "78750"}',
                    "found it")
    assert loop_digest(loop)[1] == ["HXDUBJ", "mia_li_3668", "78750"]  # no "address1"
    plain = [*loop[:2], {**loop[2], "content": "address1: Main St, user mia_li_3668"}]
    assert loop_digest(plain)[1] == ["HXDUBJ", "address1", "mia_li_3668"]  # text: no fields


def test_json_nested_deep_is_read_without_exhausting_the_stack() -> None:
    """A tool's output is a string: the request's nesting bound never sees inside it, and a
    recursive walk of a thousand-deep array raised RecursionError on the request path."""
    deep = "[" * 1000 + '{"id": "HXDUBJ7", "n": [true, null, 2.5]}' + "]" * 1000
    assert result_identifiers(deep) == ["HXDUBJ7", "2.5"]
    assert argument_values(deep) == ["HXDUBJ7", "2.5"]
    assert leaves({"a": [1, {"b": "x", "c": [True, None]}], "d": "y"}) == ["1", "x", "y"]
    # deeper than Python's stack, parsed by orjson's own bound-free reader where it can:
    # every walk of a value is iterative (planted: a recursive leaves passed at 1,000 deep)
    deeper: Any = "HXDUBJ9"
    for _ in range(5_000):
        deeper = [deeper]
    assert leaves({"x": deeper}) == ["HXDUBJ9"]
    loop = one_loop("go", "get", deep, deep, "done")
    assert loop_digest(loop)[1] == ["HXDUBJ7", "2.5"]  # type: ignore[arg-type]
    conv = Conversation([{"role": "user", "content": "HXDUBJ7"}, loop[1]],  # type: ignore[list-item]
                        fixed="")
    assert conv.references(1, 0) == (["HXDUBJ7"], [])  # the replay's reading of a reply too


def test_a_large_result_keeps_a_bounded_number_of_identifiers_in_order() -> None:
    """A carried session holds each result's identifiers: a bounded number per strength, the
    first ones, each once (a digest takes at most IDS_PER_LOOP of a loop)."""
    from runloop_proxy.window.digest import IDS_PER_LOOP, RESULT_IDS

    rows = ", ".join(f'{{"code": "A{k}B", "code": "A1B", "day": "2024-05-{k % 28 + 1:02d}"}}'
                     for k in range(1000))
    found = found_in({"role": "tool", "content": f"[{rows}]"})
    assert RESULT_IDS >= 2 * IDS_PER_LOOP
    assert found.results[0] == tuple(f"A{k}B" for k in range(RESULT_IDS))
    assert found.results[1] == tuple(f"2024-05-{d:02d}" for d in range(1, 29))


def test_an_identifier_inside_a_longer_one_or_the_system_prompt_is_not_repeated() -> None:
    """``7091239`` adds nothing beside ``gift_card_7091239`` (a window that shows the longer
    shows the shorter), whichever comes first; nor does what the system prompt says."""
    loop = one_loop("use card 7091239, policy P-100", "pay",
                    '{"payment_id": "gift_card_7091239"}', "charged gift_card_7091239",
                    "paid with 7091239")
    assert loop_digest(loop)[1] == ["P-100", "gift_card_7091239"]
    assert loop_digest(loop, known="Policy P-100 applies.")[1] == ["gift_card_7091239"]
    longer_first = [{"role": "user", "content": "pay with my card"}, *loop[1:]]
    assert loop_digest(longer_first)[1] == ["gift_card_7091239"]
    count = len
    one = roll(None, [loop], 1000, count, lines_too=False)  # type: ignore[list-item]
    later = [{"role": "user", "content": "and 7091239 again, with #W55"},
             {"role": "assistant", "content": "ok"}]
    assert roll(one, [later], 1000, count, lines_too=False) == f"{one}\n{IDS_HEADER} #W55"
    # the summariser reads the system prompt off the conversation itself
    from runloop_proxy.config import Policy
    from runloop_proxy.conversation.runloops import segment
    from runloop_proxy.history.summaries import digest

    msgs = [{"role": "system", "content": "Policy P-100 applies."}, *loop]
    assert digest(Policy(summary_model="extractive", summary_lines=False), None,
                  msgs, segment(msgs), count) == f"{IDS_HEADER} gift_card_7091239"  # type: ignore[arg-type]


def test_a_rolled_summary_names_each_identifier_once_across_its_loops() -> None:
    """Loops that produce the same identifiers (a user asking twice about one order) add it
    once per summary, never once per loop (planted: a summary of three such loops said
    ``#W77`` three times, each riding in every later request)."""
    loops = [[{"role": "user", "content": f"where is #W77, try {k}"},
              {"role": "assistant", "content": "on its way: #W77"}] for k in range(3)]
    text = roll(None, loops, 1000, len, lines_too=False)  # type: ignore[arg-type]
    assert text.count("#W77") == 1, text


def test_a_summary_with_nothing_to_say_is_empty_and_adds_no_empty_block() -> None:
    """The window shows no summary for "" (a heading over nothing costs every later request),
    and a batch that adds nothing leaves the text as it was (its prefix stays cached)."""
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    assert roll(None, [chat], 1000, len, lines_too=False) == ""  # type: ignore[list-item]
    one = roll(None, [[{"role": "user", "content": "q id-1"}, *chat[1:]]], 1000, len,
               lines_too=False)  # type: ignore[list-item]
    assert roll(one, [chat], 1000, len, lines_too=False) == one  # type: ignore[list-item]
    assert roll(one, [chat], 1000, len).endswith("- Q: hello → A: hi")  # lines: a block


def test_roll_without_lines_keeps_the_identifiers_alone() -> None:
    loops = [[{"role": "user", "content": "q id-1"}, {"role": "assistant", "content": "a"}],
             [{"role": "user", "content": "q id-2 id-1"}, {"role": "assistant", "content": "b"}]]
    one = roll(None, loops[:1], 1000, len, lines_too=False)  # type: ignore[arg-type]
    assert one == f"{IDS_HEADER} id-1"  # the window's heading says what it is: none here
    two = roll(one, loops[1:], 1000, len, lines_too=False)  # type: ignore[arg-type]
    assert two == f"{one}\n{IDS_HEADER} id-2" and parse(two) == ([], ["id-1", "id-2"])


def test_roll_carries_the_previous_summary_and_its_identifiers() -> None:
    count = len
    first = [[{"role": "user", "content": "q id-1"}, {"role": "assistant", "content": "a"}]]
    again = [[{"role": "user", "content": "q2 id-1 id-2"}, {"role": "assistant", "content": "b"}]]
    one = roll(None, first, 1000, count)  # type: ignore[arg-type]
    assert one == f"- Q: q id-1 → A: a\n{IDS_HEADER} id-1"
    two = roll(one, again, 1000, count)  # type: ignore[arg-type]
    assert two == f"{one}\n- Q: q2 id-1 id-2 → A: b\n{IDS_HEADER} id-2"  # id-1 not again
    assert parse(two) == (["- Q: q id-1 → A: a", "- Q: q2 id-1 id-2 → A: b"], ["id-1", "id-2"])
    assert roll(one, again, len(two), count) == two  # exactly the budget still appends
    squeezed = roll(one, again, len(two) - 1, count)  # type: ignore[arg-type]
    assert not squeezed.startswith(one) and len(squeezed) <= (len(two) - 1) // 2
    assert "\n" + IDS_HEADER not in block(["- Q: x"], [])  # no identifiers, no line
    twice = roll(None, [*first, *first], 1000, count)  # type: ignore[arg-type]
    assert parse(twice)[1] == ["id-1"]  # one batch's loops share an identifier: listed once


def test_references_skip_the_fixed_part_and_developer_messages_and_split_at_the_loop() -> None:
    msgs = [{"role": "user", "content": "ids k-100 and f-200"},
            {"role": "developer", "content": "d-300"},
            {"role": "user", "content": "s-400"},
            {"role": "assistant", "content": "f-200, k-100, d-300 and s-400"}]
    conv = Conversation(msgs, fixed="f-200")  # type: ignore[arg-type]
    # f-200 is the fixed part's (skipped, the rest still read); d-300 only in a developer
    # message (not history); k-100 at position 0; s-400 exactly at the loop's start: current
    assert conv.references(3, 2) == (["s-400"], ["k-100"])


def test_every_hidden_reference_is_classified_one_by_one() -> None:
    msgs = [{"role": "user", "content": "find a-111"},
            {"role": "assistant", "content": None, "tool_calls": [call("get", "{}", "call_9")]},
            {"role": "tool", "tool_call_id": "call_9", "content": "b-222 c-333"},
            {"role": "user", "content": "and d-444 e-555"},
            {"role": "assistant", "content": "a-111 b-222 c-333 d-444 e-555"}]
    conv = Conversation(msgs, fixed="")  # type: ignore[arg-type]
    refs = ["r0", "r1", "r2", "r3"]
    window = [msgs[0], msgs[1]]  # a-111 shown; the result's call id is shown: b, c by ref
    r = conv.retention(4, 3, window, refs,  # type: ignore[arg-type]
                       lambda q, upto: [3])  # search finds d and e in message 3
    assert (r.kept, r.by_ref, r.by_search, r.lost) == (1, 2, 2, 0)
    r = conv.retention(4, 3, window, refs, None)  # type: ignore[arg-type]
    assert (r.kept, r.by_ref, r.by_search) == (1, 0, 0)  # no search given: not classified
    only_current = conv.retention(4, 0, msgs[:4])  # type: ignore[arg-type]
    assert (only_current.current, only_current.past) == (5, 0)
    none = conv.retention(1, 0, [], refs, lambda q, upto: [])  # type: ignore[arg-type]
    assert none.total == 0 and none.measured and none.as_dict()["lost"] == 0


_words = st.sampled_from(["order", "#W2378156", "HAT023", "2024-05-20", "253", "11:00:00",
                          "/src/app.py", "u_77", "54.04", "a@b.io", "12345", "done"])
_messages = st.lists(st.builds(
    lambda role, words: {"role": role, "content": " ".join(words)} if role != "call" else
    {"role": "assistant", "content": "", "tool_calls": [call("f", f'{{"x": "{words[0]}"}}')]},
    st.sampled_from(["user", "assistant", "tool", "call"]), st.lists(_words, min_size=1,
                                                                      max_size=8)),
    max_size=12)


@settings(max_examples=200, deadline=None)
@given(_messages, st.integers(1, 14))
def test_picking_from_found_identifiers_lazily_matches_the_digest(
        msgs: list[dict[str, Any]], cap: int) -> None:
    """The window reads a span's tool results only as far as the cap needs them: the same
    identifiers as a digest that reads every message."""
    found = [found_in(m) for m in msgs]  # type: ignore[arg-type]
    said = [f for f, m in zip(found, msgs, strict=True) if m["role"] != "tool"]
    read: list[int] = []

    def results() -> Any:
        for k, m in enumerate(msgs):
            if m["role"] == "tool":
                read.append(k)
                yield found[k]
    assert pick(said, results(), cap) == pick(found, cap=cap)
    if len(pick(said, (), cap)) == cap:  # what was said fills the cap: no result is read
        assert not read
    assert pick(found) == loop_digest(msgs)[1]  # type: ignore[arg-type]


def test_parse_reads_a_summary_an_earlier_version_stored() -> None:
    old = "Turns left out (extractive digest):\n- Q: q → A: a\nIdentifiers from them: id-1 id-2"
    assert parse(old) == (["- Q: q → A: a"], ["id-1", "id-2"])


def _call(command: str, text: str = "") -> dict[str, Any]:
    return {"role": "assistant", "content": text, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "bash", "arguments": json.dumps({"command": command})}}]}


@pytest.mark.parametrize("reply, want", [
    # a command taken whole, and what a reviewer reads inside it: paths, numbers
    (_call("sed -n '100,120p' astropy/modeling/separable.py"),
     ["sed -n '100,120p' astropy/modeling/separable.py", "100", "120p", "120",
      "astropy/modeling/separable.py"]),
    # dotted, snake_case and camelCase names; no plain words
    (_call("python -c 'import m; print(m.Pix2Sky_TAN, fooBar, CompoundModel, done)'"),
     ["python -c 'import m; print(m.Pix2Sky_TAN, fooBar, CompoundModel, done)'",
      "m.Pix2Sky_TAN", "fooBar", "CompoundModel"]),
    # a price with and without its $, thousands and zero cents as the number
    ({"role": "assistant", "content": "That is $594, or $1,250.00 for both (594.00)."},
     ["594", "1250"]),
    # snake_case with the number inside it
    ({"role": "assistant", "content": "Use gift_card_7091239 now."},
     ["gift_card_7091239", "7091239"]),
])
def test_the_careful_reader_reads_inside_arguments_and_text(reply: dict[str, Any],
                                                            want: list[str]) -> None:
    assert careful_candidates(reply) == want


@pytest.mark.parametrize("text, ref, found", [
    ("6594", "594", False), ("594", "594", True), ("x 594.00", "594", True),
    ("594.5", "594", False), ("v1.594", "594", False), ("$594", "594", True),
    ("astropy/modeling/separable.py:3", "separable.py", True),
    ("user_id", "_id", False), ("user_id", "user", False), ("a user_id b", "user_id", True),
    ("m.Pix2Sky_TAN.x", "m.Pix2Sky_TAN", True), ("xm.Pix2Sky_TAN", "m.Pix2Sky_TAN", False),
    ("594 and 6594", "594", True), ("6594 and 1594", "594", False),
])
def test_a_careful_match_is_a_whole_token(text: str, ref: str, found: bool) -> None:
    assert holds(text, ref) is found


def test_the_careful_reader_counts_what_the_plain_one_misses_and_matches_whole_tokens() -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "fix astropy/modeling/separable.py; price 6594"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and?"},
        _call("grep -n separability_matrix astropy/modeling/separable.py", "It costs $594.")]
    plain = Conversation(msgs, "sys")
    careful = Conversation(msgs, "sys", careful=True)
    # the plain reader finds neither the whole command nor "$594" in the history
    assert plain.references(4, 3) == ([], [])
    # the careful one finds the path, and not 594 inside 6594
    assert careful.references(4, 3) == ([], ["astropy/modeling/separable.py"])
    window = [msgs[0], {"role": "user", "content": "see separable.py"}, msgs[3]]
    r = careful.retention(4, 3, window)
    assert (r.past, r.past_kept) == (1, 0)
    r = careful.retention(4, 3, msgs[:4])
    assert (r.past, r.past_kept) == (1, 1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.text(alphabet="ab_1/.$ ", max_size=30),
                          st.text(alphabet="ab_1/.$ ", max_size=30)), min_size=1, max_size=5))
def test_the_careful_reader_retains_everything_in_pass_through(turns: list[tuple[str, str]]
                                                                ) -> None:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "s"}]
    for q, a in turns:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    meter = Conversation(msgs, "s", careful=True)
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            r = meter.retention(i, 0, msgs[:i])
            assert r.kept == r.total


def test_the_careful_reader_reads_arguments_decoded_and_whitespace_as_one_space() -> None:
    edit = _call("python - <<EOF\nimport shutil\nshutil.rmtree(path)\nEOF")
    later = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c2", "type": "function", "function": {"name": "edit", "arguments": json.dumps(
            {"command": "grep -n 'shutil.rmtree' a.py", "old": "if not objs:\n      return"})}}]}
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "s"}, {"role": "user", "content": "go"}, edit,
        {"role": "tool", "tool_call_id": "c1", "content": "if not objs:\n    return  # ok"},
        later]
    meter = Conversation(msgs, "s", careful=True)
    current, _ = meter.references(4, 1)
    # "\nshutil.rmtree" in the JSON arguments is a newline, not an "n" before the name
    assert "shutil.rmtree" in current
    # a quoted snippet's spacing is not what tells it apart
    assert "if not objs: return" in current
    window = [msgs[0], msgs[1], edit]
    r = meter.retention(4, 1, window)
    assert r.current_kept == sum(1 for x in current if x != "if not objs: return")
