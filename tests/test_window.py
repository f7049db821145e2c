"""The window builder: table-driven cases and its invariants as properties (hypothesis)."""

from __future__ import annotations

import asyncio
import os
import re
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runloop_proxy.config import Policy, ReducePastLoops
from runloop_proxy.conversation.messages import (
    Message,
    message_hash,
    message_refs,
    message_text,
    tool_calls_of,
)
from runloop_proxy.conversation.runloops import segment
from runloop_proxy.pipeline.tools import ProxyTools, ToolRunner
from runloop_proxy.window import builder as window_mod
from runloop_proxy.window.builder import CompactionKind, Window, build_window, request_points
from runloop_proxy.window.forms import DEFAULT_NAMES, Budget, Cut

from .policies import mechanism


class WordOps:
    """A deterministic token model for pure tests: one token per word, +3 per message."""

    name = "words"

    def count(self, msg: Message) -> int:
        n = 3 + len(str(msg.get("content") or "").split())
        for c in msg.get("tool_calls") or []:
            n += 4 + len(c["function"]["arguments"].split()) + 1
        return n

    def cut(self, text: str, max_tokens: int) -> Cut | None:
        words = text.split()
        if len(words) <= max_tokens:
            return None
        head = max_tokens * 2 // 3
        tail = max_tokens - head
        return Cut(" ".join(words[:head]), " ".join(words[-tail:]), len(words) - max_tokens)


OPS = WordOps()
# the levers' mechanics, tested apart from when they pay and from the opening task kept
MECHANICS: dict[str, Any] = {"keep_opening": False}


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def U(n: int = 5, tag: str = "u") -> Message:
    return {"role": "user", "content": words(n, tag)}


def F(n: int = 5, tag: str = "f") -> Message:
    return {"role": "assistant", "content": words(n, tag)}


def A(cid: str, n: int = 3, args: int = 2) -> Message:
    return {"role": "assistant", "content": words(n, "think"), "tool_calls": [
        {"id": cid, "type": "function", "function": {
            "name": "bash", "arguments": orjson.dumps({"cmd": words(args, "a")}).decode()}}]}


def T(cid: str, n: int = 20) -> Message:
    return {"role": "tool", "tool_call_id": cid, "content": words(n, "out")}


S: Message = {"role": "system", "content": words(10, "sys")}


def ref_of(messages: list[Message], call_id: str, nth: int = 0) -> str:
    """The recall ref of the ``nth`` result of ``call_id``."""
    refs = message_refs([message_hash(m) for m in messages])
    return [r for m, r in zip(messages, refs, strict=True)
            if m.get("tool_call_id") == call_id][nth]


def build(messages: list[Message], policy: Policy | None = None, hard: int = 100_000,
          working: int = 1_000, client_tools: bool = True) -> Window:
    keys = [message_hash(m) for m in messages]
    counts = [OPS.count(m) for m in messages]
    return build_window(messages, keys, counts, policy or mechanism(), Budget(hard, working), OPS,
                        client_tools=client_tools)


def assert_valid(window: list[Message]) -> None:
    """A valid chat-completions list: system first, every call answered, every result called."""
    seen_other = False
    for m in window:
        if m["role"] in ("system", "developer"):
            assert not seen_other, "system message after the conversation started"
        else:
            seen_other = True
    i = 0
    while i < len(window):
        m = window[i]
        if m["role"] == "tool":
            raise AssertionError(f"tool message at {i} follows no tool call")
        if m["role"] == "assistant" and tool_calls_of(m):
            ids = [c["id"] for c in tool_calls_of(m)]
            j = i + 1
            answered = []
            while j < len(window) and window[j]["role"] == "tool":
                answered.append(window[j]["tool_call_id"])
                j += 1
            assert sorted(answered) == sorted(ids), (ids, answered)
            i = j
        else:
            i += 1


# -- table-driven ---------------------------------------------------------------------------

def test_short_conversation_is_passed_unchanged() -> None:
    msgs = [S, U(), F(), U()]
    w = build(msgs)
    assert not w.changed and w.messages is msgs and w.fits and not w.events


def test_past_loops_without_tools_stay_identical() -> None:
    msgs = [S, U(), F(), U(), F(), U()]
    w = build(msgs, mechanism(reduce_at_least=0))
    assert not w.changed


def test_past_loop_reduced_to_question_answer_and_ledger() -> None:
    msgs = [S, U(tag="q"), A("c1"), T("c1", 300), A("c2"), T("c2", 300), F(tag="ans"), U()]
    w = build(msgs, mechanism(reduce_at_least=0))
    assert w.changed
    roles = [m["role"] for m in w.messages]
    assert roles == ["system", "user", "assistant", "user"]
    assert w.messages[1] is msgs[1]  # the question is untouched (its cached prefix holds)
    final = w.messages[2]["content"]
    assert final.startswith(msgs[6]["content"])
    # the ledger: ref, tool, arguments as key=value, result size
    assert f"{ref_of(msgs, 'c1')} bash(cmd=a0 a1) 303t" in final
    assert f"{ref_of(msgs, 'c2')} bash(cmd=a0 a1) 303t" in final and "recall_tool_call" in final
    assert [e.kind for e in w.events] == [CompactionKind.PAST_LOOPS]


def test_a_long_ledger_keeps_its_first_and_last_calls() -> None:
    msgs: list[Message] = [S, U(tag="q")]
    for k in range(40):
        msgs += [A(f"c{k}"), T(f"c{k}", 300)]
    msgs += [F(tag="ans"), U()]
    w = build(msgs, mechanism(reduce_at_least=0))
    ledger = w.messages[2]["content"].split("tools used (recall_tool_call takes the id): ")[1]
    entries = ledger.split("; ")
    head = 24 // 3
    assert len(entries) == 24 + 1 and entries[head] == f"…{40 - 24} more…"
    refs = [ref_of(msgs, f"c{k}") for k in range(40)]
    assert [e.split()[0] for e in entries[:head]] == refs[:head]
    assert [e.split()[0] for e in entries[head + 1:]] == refs[40 - (24 - head):]


def test_a_result_whose_call_is_not_in_view_is_ledgered_as_a_plain_tool() -> None:
    msgs = [S, U(tag="q"), T("orphan", 300), F(tag="ans"), U()]
    w = build(msgs, mechanism(reduce_at_least=0))
    assert f"{ref_of(msgs, 'orphan')} tool() 303t" in w.messages[2]["content"]


def test_past_loop_reduction_waits_for_reduce_at_least() -> None:
    msgs = [S, U(), A("c1"), T("c1", 30), F(), U()]
    assert not build(msgs, mechanism(**MECHANICS, reduce_at_least=2000)).changed
    assert build(msgs, mechanism(**MECHANICS, reduce_at_least=10)).changed


def test_ledger_shows_a_tiny_result_inline_and_long_arguments_cut() -> None:
    msgs = [S, U(), A("c1", args=40), T("c1", 300), A("c2"), T("c2", 2), F(), U()]
    w = build(msgs, mechanism(reduce_at_least=0, ledger_arg_chars=20))
    final = w.messages[2]["content"]
    assert "bash(cmd=a0 a1) → out0 out1" in final  # shown, no ref needed
    assert ref_of(msgs, "c2") not in final
    assert f"{ref_of(msgs, 'c1')} bash(cmd=a0 a1 a2 a3 a4 …) 303t" in final


def test_over_threshold_mode_keeps_past_loops_until_pressure() -> None:
    policy = mechanism(reduce_past_loops=ReducePastLoops.OVER_THRESHOLD, clear_at_least=0,
                    reduce_at_least=0)
    msgs = [S, U(), A("c1"), T("c1", 50), F(), U()]
    assert not build(msgs, policy, working=1000).changed
    assert build(msgs, policy, working=80).changed


def test_in_loop_elision_keeps_recent_results_and_names_the_ref() -> None:
    msgs: list[Message] = [S, U()]
    for k in range(8):
        msgs += [A(f"c{k}"), T(f"c{k}", 100)]
    w = build(msgs, mechanism(keep_recent_tool_results=2, clear_at_least=0), working=1000)
    assert w.changed and w.fits
    tools = [m for m in w.messages if m["role"] == "tool"]
    assert tools[-1]["content"] == msgs[-1]["content"]
    assert tools[-2]["content"] == msgs[-3]["content"]
    # the placeholder names the tool, the result's size and how to get it back
    assert tools[0]["content"] == (f'[runloop-proxy] bash result elided ({OPS.count(msgs[3])} '
                                   f'tokens); recall_tool_call(call_id="{ref_of(msgs, "c0")}")'
                                   f' returns it.')
    assert {e.ref for e in w.elided} >= {ref_of(msgs, "c0")}
    assert w.tokens_out <= 0.8 * 1000
    assert_valid(w.messages)


def test_an_elided_calls_long_arguments_are_cut_and_stay_json() -> None:
    """Where results are elided, the calls before them lose their long argument values too
    (head and tail, a note naming the ref that returns them), and stay valid JSON; short
    values and the calls kept whole are untouched."""
    msgs: list[Message] = [S, U()]
    for k in range(8):
        msgs += [A(f"c{k}", args=80), T(f"c{k}", 100)]
    policy = mechanism(keep_recent_tool_results=2, clear_at_least=0, reasoning_keep_tokens=16,
                    names_kept=0)
    w = build(msgs, policy, working=1000)
    calls = [m for m in w.messages if m.get("tool_calls")]
    cut = [c for c in calls if "arguments cut" in c["tool_calls"][0]["function"]["arguments"]]
    assert cut and len(cut) < len(calls), "the oldest calls are cut, the recent ones whole"
    for m in cut:
        (call,) = m["tool_calls"]
        value = orjson.loads(call["function"]["arguments"])["cmd"]
        assert f'recall_tool_call(call_id="args:{call["id"]}")' in value
        assert len(value.split()) < 80
    assert calls[-1]["tool_calls"] == msgs[-2]["tool_calls"]
    assert_valid(w.messages)


def test_excluded_tools_are_never_elided() -> None:
    msgs: list[Message] = [S, U()]
    for k in range(6):
        msgs += [A(f"c{k}"), T(f"c{k}", 100)]
    msgs[2]["tool_calls"][0]["function"]["name"] = "read_spec"
    w = build(msgs, mechanism(keep_recent_tool_results=1, clear_at_least=0,
                           exclude_tools=("read_spec",)), working=400)
    assert w.changed
    kept = [m for m in w.messages if m.get("tool_call_id") == "c0"]
    assert kept and kept[0]["content"] == msgs[3]["content"]


def test_reused_call_id_gets_a_distinct_ref() -> None:
    msgs: list[Message] = [S, U(), A("dup"), T("dup", 200), A("dup"),
                           {**T("dup", 200), "content": words(200, "second")}]
    msgs += [A("z"), T("z", 5), A("y"), T("y", 5), A("x"), T("x", 5)]
    w = build(msgs, mechanism(keep_recent_tool_results=1, clear_at_least=0), working=300)
    refs = [e.ref for e in w.elided if e.call_id == "dup"]
    assert len(refs) == 2 and refs[0] != refs[1]
    assert all(re.fullmatch(r"[0-9a-f]{6}", r) for r in refs)


def test_refs_are_short_unique_and_stable_under_append() -> None:
    # keys forced to share a prefix: a later message's ref grows until it is unique
    keys = ["abcdef01" + "0" * 24, "abcdef02" + "0" * 24, "abcdef01" + "0" * 24,
            "123456ff" + "0" * 24, "abcdef0201" + "0" * 22]
    refs = message_refs(keys)
    assert refs == ["abcdef", "abcdef02", "abcdef", "123456", "abcdef0201"]
    assert message_refs(keys[:3]) == refs[:3]


def test_old_loops_omitted_in_batches_with_a_marker() -> None:
    msgs: list[Message] = [S]
    for k in range(13):
        msgs += [U(tag=f"q{k}"), A(f"c{k}"), T(f"c{k}", 50), F(tag=f"a{k}")]
    msgs.append(U())
    w = build(msgs, mechanism(**MECHANICS, max_run_loops=4, reduce_at_least=0))
    # the marker is the model's own note, right after the system prompt
    assert w.messages[1]["role"] == "assistant" and "Earlier turns" in w.messages[1]["content"]
    assert w.omitted_loops >= 2 and w.reduced_loops <= 4
    assert "search_history" in w.messages[1]["content"]
    assert_valid(w.messages)


def test_loops_older_than_max_time_range_are_omitted() -> None:
    day = 86_400_000
    msgs: list[Message] = [S]
    stamps: list[int | None] = [0]
    for k in range(4):
        loop = [U(tag=f"q{k}"), A(f"c{k}"), T(f"c{k}", 50), F(tag=f"a{k}")]
        msgs += loop
        stamps += [k * 3 * day] * len(loop)  # loops 3 days apart
    msgs.append(U())
    stamps.append(12 * day)
    keys = [message_hash(m) for m in msgs]
    counts = [OPS.count(m) for m in msgs]
    w = build_window(msgs, keys, counts,
                     mechanism(**MECHANICS, reduce_at_least=0, max_time_range_s=7 * 86_400),
                     Budget(100_000, 1_000), OPS, timestamps=stamps, now_ms=12 * day)
    assert w.omitted_loops == 2  # loops started 12 and 9 days ago; 6 and 3 days ago stay
    assert "Earlier turns" in w.messages[1]["content"]
    assert [m["content"] for m in w.messages if m["role"] == "user"][0] == words(5, "q2")
    assert_valid(w.messages)
    # a checkpoint saved while no loop was old yet is not resumed once the clock moved on
    memo: dict[Any, Any] = {}
    policy = mechanism(**MECHANICS, reduce_at_least=0, max_time_range_s=7 * 86_400)
    prev = len(msgs) - 2
    build_window(msgs[:prev], keys[:prev], counts[:prev], policy, Budget(100_000, 1_000), OPS,
                 timestamps=stamps[:prev], now_ms=6 * day, memo=memo)
    resumed = build_window(msgs, keys, counts, policy, Budget(100_000, 1_000), OPS,
                           timestamps=stamps, now_ms=12 * day, memo=memo)
    assert orjson.dumps(resumed.messages) == orjson.dumps(w.messages)


def test_huge_single_result_is_capped_and_recallable() -> None:
    msgs = [S, U(), A("big"), T("big", 5000)]
    w = build(msgs, mechanism(max_tool_result_share=0.25), working=1000)
    assert w.changed
    capped = w.messages[-1]["content"]
    assert len(capped.split()) < 400
    assert f'recall_tool_call(call_id="{ref_of(msgs, "big")}")' in capped


def test_hard_limit_drops_oldest_exchanges_then_fits() -> None:
    msgs: list[Message] = [S, U()]
    for k in range(40):
        msgs += [A(f"c{k}", args=30), T(f"c{k}", 40)]
    w = build(msgs, mechanism(keep_recent_tool_results=1), hard=500, working=500)
    assert w.fits and w.tokens_out <= 500
    assert_valid(w.messages)


def test_cannot_fit_is_a_rejection() -> None:
    msgs = [S, U(n=3000)]
    w = build(msgs, hard=200, working=200)
    assert not w.fits
    assert w.events[-1].kind is CompactionKind.REJECTION


def test_drop_note_rides_on_the_question() -> None:
    msgs: list[Message] = [S, U(tag="task")]
    for k in range(60):
        msgs += [A(f"c{k}", n=20, args=20), T(f"c{k}", 60)]
    w = build(msgs, mechanism(keep_recent_tool_results=2, clear_at_least=0), working=900)
    assert w.fits
    note = w.messages[1]["content"]
    assert note.startswith(msgs[1]["content"])  # the question stays byte-identical first
    found = re.search(r"The first (\d+) tool exchange\(s\) after this message "
                      r"\(calls (c\d+) … (c\d+)\) are not shown", note)
    assert found is not None, note
    dropped, first, last = int(found.group(1)), found.group(2), found.group(3)
    assert first == "c0" and last == f"c{dropped - 1}" and 0 < dropped < 60
    shown_calls = [c["id"] for m in w.messages for c in m.get("tool_calls") or []]
    assert shown_calls == [f"c{k}" for k in range(dropped, 60)]
    assert_valid(w.messages)


def test_disabled_policy_is_pass_through() -> None:
    msgs: list[Message] = [S, U()]
    for k in range(30):
        msgs += [A(f"c{k}"), T(f"c{k}", 100)]
    w = build(msgs, mechanism(enabled=False), working=100)
    assert not w.changed


def test_request_points() -> None:
    msgs = [S, U(), A("a"), T("a"), F(), U()]
    assert request_points(msgs, 1) == [2, 4, 6]


# -- properties -----------------------------------------------------------------------------

@st.composite
def conversations(draw: Any) -> list[Message]:
    msgs: list[Message] = [S] if draw(st.booleans()) else []
    n_loops = draw(st.integers(1, 7))
    call = 0
    for k in range(n_loops):
        msgs.append(U(draw(st.integers(1, 120)), tag=f"q{k}"))
        for _ in range(draw(st.integers(0, 6))):
            ids = []
            for _ in range(draw(st.integers(1, 3))):
                call += 1
                reuse = draw(st.integers(0, 9)) == 0 and call > 1
                ids.append(f"c{call - 1}" if reuse else f"c{call}")
            ids = list(dict.fromkeys(ids))
            msgs.append({"role": "assistant", "content": words(draw(st.integers(0, 80)), "t"),
                         "tool_calls": [{"id": i, "type": "function", "function": {
                             "name": draw(st.sampled_from(["bash", "read", "grep"])),
                             "arguments": orjson.dumps({"x": words(draw(st.integers(0, 90)),
                                                                   "a")}).decode()}}
                             for i in ids]})
            for i in ids:
                msgs.append(T(i, draw(st.integers(1, 600))))
        last = k == n_loops - 1
        if not last or draw(st.booleans()):
            msgs.append(F(draw(st.integers(1, 100)), tag=f"a{k}"))
    if msgs[-1]["role"] == "assistant" and not msgs[-1].get("tool_calls"):
        msgs.append(U(3))
    return msgs


policies = st.builds(
    Policy, max_run_loops=st.integers(0, 6), keep_recent_tool_results=st.integers(0, 4),
    clear_at_least=st.sampled_from([0, 100, 500]), max_message_length=st.integers(16, 80),
    reduce_past_loops=st.sampled_from(list(ReducePastLoops)),
    reasoning_keep_tokens=st.integers(16, 40), reduce_at_least=st.sampled_from([0, 64, 300]),
    omit_batch=st.one_of(st.none(), st.integers(1, 4)), ledger_arg_chars=st.integers(0, 40),
    strict_roles=st.booleans(), keep_opening=st.booleans(), names_kept=st.sampled_from([0, 3, 48]),
    payback_requests=st.sampled_from([None, 0, 2]),
    summary_model=st.sampled_from([None, "extractive"]), summary_lines=st.booleans())

PROPS = settings(max_examples=int(os.environ.get("WINDOW_EXAMPLES", "80")), deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@PROPS
@given(conversations(), policies, st.integers(300, 3000))
def test_window_is_valid_and_within_budget(msgs: list[Message], policy: Policy,
                                           working: int) -> None:
    hard = working + 200
    w = build(msgs, policy, hard=hard, working=working)
    assert_valid(w.messages)
    if w.fits:
        assert sum(OPS.count(m) for m in w.messages) == w.tokens_out
        assert w.tokens_out <= hard
    else:
        assert w.events and w.events[-1].kind is CompactionKind.REJECTION


@PROPS
@given(conversations(), policies)
def test_window_is_deterministic(msgs: list[Message], policy: Policy) -> None:
    a = build(msgs, policy, working=800)
    b = build(orjson.loads(orjson.dumps(msgs)), policy, working=800)
    assert orjson.dumps(a.messages) == orjson.dumps(b.messages)
    # the cross-request memo of derived forms never changes a window
    memo: dict[Any, Any] = {}
    keys = [message_hash(m) for m in msgs]
    counts = [OPS.count(m) for m in msgs]
    for _ in range(2):
        c = build_window(msgs, keys, counts, policy, Budget(100_000, 800), OPS, memo=memo)
        assert orjson.dumps(c.messages) == orjson.dumps(a.messages)


@PROPS
@given(conversations(), policies, st.integers(300, 3000))
def test_a_growing_session_with_the_memo_gets_the_same_windows(
        msgs: list[Message], policy: Policy, working: int) -> None:
    """Request by request, as the proxy sees a session: resuming the replay from the memo's
    checkpoint (and its memoised forms) yields exactly the window a fresh build yields."""
    memo: dict[Any, Any] = {}
    keys = [message_hash(m) for m in msgs]
    counts = [OPS.count(m) for m in msgs]
    budget = Budget(working + 300, working)
    for p in request_points(msgs, 0):
        fresh = build_window(msgs[:p], keys[:p], counts[:p], policy, budget, OPS)
        resumed = build_window(msgs[:p], keys[:p], counts[:p], policy, budget, OPS, memo=memo)
        assert orjson.dumps(resumed.messages) == orjson.dumps(fresh.messages), p
        assert (resumed.events, resumed.elided, resumed.fits, resumed.tokens_out) == \
            (fresh.events, fresh.elided, fresh.fits, fresh.tokens_out)


def test_a_growing_session_resumes_from_the_last_windows_carry() -> None:
    """Each request of a growing session extends the previous window's conversation and
    resumes its replay (and only a request that continues it does)."""
    msgs: list[Message] = [S]
    for k in range(6):
        msgs += [U(tag=f"q{k}"), A(f"c{k}"), T(f"c{k}", 200), F(tag=f"a{k}")]
    keys = [message_hash(m) for m in msgs]
    counts = [OPS.count(m) for m in msgs]
    policy, budget = mechanism(max_run_loops=2, reduce_at_least=0), Budget(100_000, 1_000)
    carry = None
    resumed = 0
    built = 0
    for p in request_points(msgs, 0):
        w = build_window(msgs[:p], keys[:p], counts[:p], policy, budget, OPS, carry=carry)
        if w.carry is None:  # a short opening: nothing to do, nothing built
            continue
        assert w.carry.n == p
        built += 1
        resumed += carry is not None and w.carry.conv is carry.conv  # grown, not rebuilt
        carry = w.carry
    assert built >= 8 and resumed == built - 1
    assert carry is not None
    # another branch does not grow it (it builds its own), nor does an older view of it
    other = [*msgs[:1], U(tag="edited"), *msgs[2:]]
    ok = [message_hash(m) for m in other]
    oc = [OPS.count(m) for m in other]
    w = build_window(other, ok, oc, policy, budget, OPS, carry=carry)
    assert w.carry is not None and w.carry.conv is not carry.conv
    stale = window_mod.Carry(carry.conv, carry.n - 4, carry.states, None)
    assert window_mod._carried(stale, msgs, keys, counts, policy, budget, OPS, None,
                               frozenset(), None, DEFAULT_NAMES) is None


@PROPS
@given(conversations(), policies, st.integers(300, 3000), st.data())
def test_a_window_built_from_the_last_ones_carry_equals_a_fresh_one(
        msgs: list[Message], policy: Policy, working: int, data: Any) -> None:
    """Request by request — at any subset of the request points (a client that sends several
    messages at once), and now and then with the carry of another branch (an edit) — a window
    that grows the previous window's carry is exactly the window a fresh build yields."""
    keys = [message_hash(m) for m in msgs]
    counts = [OPS.count(m) for m in msgs]
    budget = Budget(working + 300, working)
    carry = None
    for p in request_points(msgs, 0):
        if p < len(msgs) and data.draw(st.booleans()):
            continue
        fresh = build_window(msgs[:p], keys[:p], counts[:p], policy, budget, OPS)
        grown = build_window(msgs[:p], keys[:p], counts[:p], policy, budget, OPS, carry=carry)
        assert orjson.dumps(grown.messages) == orjson.dumps(fresh.messages), p
        assert (grown.events, grown.elided, grown.fits, grown.tokens_out, grown.reduced_loops,
                grown.omitted_loops) == (fresh.events, fresh.elided, fresh.fits,
                                         fresh.tokens_out, fresh.reduced_loops,
                                         fresh.omitted_loops)
        carry = grown.carry
        last = next((i for i in range(p - 1, -1, -1) if msgs[i]["role"] == "user"), None)
        if last is not None and data.draw(st.integers(0, 3)) == 0:
            # the next request continues another branch's carry: its last question was edited
            edited = [*msgs[:last], {"role": "user", "content": "an edit"}, *msgs[last + 1:p]]
            ek = [message_hash(m) for m in edited]
            other = build_window(edited, ek, [OPS.count(m) for m in edited], policy, budget,
                                 OPS).carry
            carry = other or carry


@PROPS
@given(conversations(), policies, st.integers(300, 3000), st.data())
def test_each_points_events_are_recorded_once_however_the_conversation_arrives(
        msgs: list[Message], policy: Policy, working: int, data: Any) -> None:
    """A client sends every turn, or several at once (any subset of the request points), the
    first request in the middle of the conversation, with the last window's carry or the
    memo or neither: the events its requests record (each from the point after the last
    request's answer on) are the turn-by-turn session's, point for point — none lost when a
    request brings several turns, none counted twice when the next one resumes."""
    keys = [message_hash(m) for m in msgs]
    counts = [OPS.count(m) for m in msgs]
    budget = Budget(working + 300, working)
    points = request_points(msgs, 0)
    replayed = {k for k in CompactionKind} - {CompactionKind.TRUNCATION,
                                             CompactionKind.REJECTION}

    def steps(w: Window) -> list[tuple[Any, ...]]:
        return [(e.kind, e.at, e.tokens_before, e.tokens_after, e.reason) for e in w.events
                if e.kind in replayed]  # the hard limit acts on a request's own window only

    turn_by_turn = [s for p in points
                    for s in steps(build_window(msgs[:p], keys[:p], counts[:p], policy,
                                                budget, OPS))]
    assert all(at == p for p in points for _, at, *_ in steps(build_window(
        msgs[:p], keys[:p], counts[:p], policy, budget, OPS)))  # each at its own point
    sent = [p for p in points[:-1] if data.draw(st.booleans())] + [points[-1]]
    carry, seen = None, 0
    memo: dict[Any, Any] = {}
    recorded: list[tuple[Any, ...]] = []
    for p in sent:
        # the proxy may know less of what earlier requests carried (a restart, an evicted
        # cache): then it records again from where it knows
        known = seen if data.draw(st.integers(0, 3)) else data.draw(st.integers(0, seen))
        w = build_window(msgs[:p], keys[:p], counts[:p], policy, budget, OPS,
                         record_from=known, carry=carry if data.draw(st.booleans()) else None,
                         memo=memo if data.draw(st.booleans()) else None)
        assert steps(w) == [s for s in turn_by_turn if known <= s[1] <= p or s[1] == p], p
        recorded += [s for s in steps(w) if s[1] >= seen]
        carry, seen = w.carry or carry, p + 1  # the answer to messages[:p] comes next
    assert recorded == turn_by_turn


@pytest.mark.parametrize("cache", ["memo", "carry"])
def test_a_request_that_records_from_the_start_replays_every_point(cache: str) -> None:
    """The last request's memo checkpoint or carry is not resumed past a point whose events
    this request records (the proxy forgot what earlier requests carried)."""
    msgs: list[Message] = [S]
    for k in range(8):
        msgs += [U(tag=f"q{k}"), A(f"c{k}"), T(f"c{k}", 200), F(tag=f"a{k}")]
    msgs.append(U())
    keys = [message_hash(m) for m in msgs]
    counts = [OPS.count(m) for m in msgs]
    policy, budget = mechanism(max_run_loops=2, reduce_at_least=0), Budget(100_000, 1_000)
    memo: dict[Any, Any] = {}
    carry = None
    for p in request_points(msgs, 0)[:-1]:
        w = build_window(msgs[:p], keys[:p], counts[:p], policy, budget, OPS, memo=memo,
                         carry=carry)
        carry = w.carry or carry
    whole = build_window(msgs, keys, counts, policy, budget, OPS, record_from=0)
    assert len({e.at for e in whole.events}) >= 5
    kw: dict[str, Any] = {"memo": memo} if cache == "memo" else {"carry": carry}
    again = build_window(msgs, keys, counts, policy, budget, OPS, record_from=0, **kw)
    assert again.events == whole.events


@PROPS
@given(conversations(), policies, st.integers(400, 3000))
def test_append_only_between_compaction_events(msgs: list[Message], policy: Policy,
                                               working: int) -> None:
    hard = 10 * working  # hard-limit truncation is the one lever allowed to break the prefix
    previous: list[Message] | None = None
    for p in request_points(msgs, 0):
        w = build(msgs[:p], policy, hard=hard, working=working)
        if previous is not None and not w.events:
            assert w.messages[: len(previous)] == previous, f"prefix changed at {p}"
        previous = list(w.messages)


@PROPS
@given(conversations(), policies, st.integers(300, 3000), st.data())
def test_windows_with_aged_loops_stay_valid_and_within_budget(
        msgs: list[Message], policy: Policy, working: int, data: Any) -> None:
    """Loops older than ``max_time_range`` go by the clock, at any request point, also while
    the open loop has elided or dropped exchanges: the window stays valid, within budget,
    append-only between events, and the same with or without the memo."""
    day = 86_400_000
    stamps: list[int | None] = []
    age = data.draw(st.integers(0, 12))
    for m in msgs:
        if m["role"] == "user" and stamps:
            age = data.draw(st.integers(0, age))  # later loops are younger
        stamps.append((20 - age) * day)
    policy = policy.model_copy(update={"max_time_range_s": 7 * 86_400.0})
    keys = [message_hash(m) for m in msgs]
    counts = [OPS.count(m) for m in msgs]
    budget = Budget(working + 200, working)
    memo: dict[Any, Any] = {}
    previous: list[Message] | None = None
    for p in request_points(msgs, 0):
        args = (msgs[:p], keys[:p], counts[:p], policy, budget, OPS)
        w = build_window(*args, timestamps=stamps[:p], now_ms=20 * day)
        assert_valid(w.messages)
        if w.fits:
            assert sum(OPS.count(m) for m in w.messages) == w.tokens_out <= budget.hard
        again = build_window(*args, timestamps=stamps[:p], now_ms=20 * day, memo=memo)
        assert orjson.dumps(again.messages) == orjson.dumps(w.messages)
        if previous is not None and not w.events:
            assert w.messages[: len(previous)] == previous, f"prefix changed at {p}"
        previous = list(w.messages) if w.fits else None


@PROPS
@given(conversations(), policies, st.integers(300, 3000))
def test_strict_roles_keep_one_system_message_and_a_user_turn_first(
        msgs: list[Message], policy: Policy, working: int) -> None:
    """What chat templates like Qwen3's or Mistral's demand: the system prompt alone first,
    then a user turn — whatever the window omitted or kept."""
    policy = policy.model_copy(update={"strict_roles": True})
    w = build(msgs, policy, hard=working * 10, working=working)
    systems = [k for k, m in enumerate(w.messages) if m["role"] == "system"]
    assert systems == ([0] if msgs[0]["role"] == "system" or w.omitted_loops else [])
    rest = [m["role"] for m in w.messages if m["role"] != "system"]
    assert rest[0] == "user"
    if w.omitted_loops and msgs[0]["role"] == "system":
        assert w.messages[0]["content"].startswith(msgs[0]["content"])  # the prompt, then


def resolve(ref: str, msgs: list[Message]) -> Any:
    """What the proxy's recall_tool_call answers for ``ref`` (no store: the request alone)."""
    runner = ToolRunner(ProxyTools.for_request(None), msgs, [message_hash(m) for m in msgs], 5)
    content, outcome = asyncio.run(runner.recall(ref))
    return content if outcome == "hit" else None


def dropped_by_a_note(msgs: list[Message], i: int, text: str) -> bool:
    """Whether the tool result at ``i`` lies in a run of exchanges a drop note names (by its
    first and last call ids: recall_tool_call takes those)."""
    calls = [(k, c["id"]) for k, m in enumerate(msgs) for c in m.get("tool_calls") or []]
    for first, last in re.findall(r"\(calls (\S+) … (\S+)\) (?:are not shown|were dropped)",
                                  text):
        starts = [k for k, cid in calls if cid == first]
        ends = [k for k, cid in calls if cid == last]
        if starts and ends:
            after = next((k for k, _ in calls if k > max(ends)), len(msgs))
            if min(starts) < i < after:
                return True
    return False


@PROPS
@given(conversations(), policies, st.integers(300, 3000))
def test_every_elided_item_is_recallable(msgs: list[Message], policy: Policy,
                                         working: int) -> None:
    w = build(msgs, policy, hard=working * 10, working=working)
    text = orjson.dumps(w.messages).decode()
    shown = {orjson.dumps(m) for m in w.messages}
    refs = message_refs([message_hash(m) for m in msgs])
    loop_of = {i: lp.index for lp in segment(msgs) for i in lp.positions}
    for i, (m, ref) in enumerate(zip(msgs, refs, strict=True)):
        if m["role"] != "tool" or orjson.dumps(m) in shown:
            continue
        # not shown as sent: its ref resolves to it byte for byte ...
        assert resolve(ref, msgs) == m["content"]
        # ... and the model is told how to get it back, whichever way it went:
        if loop_of[i] < w.omitted_loops:  # its loop was omitted: the marker says search
            assert "Earlier turns are not shown" in text and "search_history(query)" in text
            continue
        named = f'call_id=\\"{ref}\\"' in text or f"{ref} " in text  # a note, a ledger
        inline = f"→ {' '.join(m['content'].split())}" in text  # a tiny result, in the ledger
        assert named or inline or dropped_by_a_note(msgs, i, text), (i, ref)
    for e in w.elided:
        assert resolve(e.ref, msgs) == msgs[e.position]["content"]
    # every message the window cut says where and names the ref that returns it whole
    originals = {message_text(m) for m in msgs}
    for cut in re.finditer(r'tokens cut; recall_tool_call\(call_id="([0-9a-f]+)"\)', text):
        whole = resolve(cut.group(1), msgs)
        assert whole is not None and (whole in originals or
                                      any(whole == m["content"] for m in msgs))


@PROPS
@given(conversations())
def test_nothing_to_reduce_means_identical(msgs: list[Message]) -> None:
    w = build(msgs, mechanism(clear_at_least=10**9, reduce_at_least=10**9, max_run_loops=50),
              working=10**6, hard=10**7)
    assert not w.changed and w.messages is msgs


def test_omit_batch_sets_how_many_loops_go_per_omission() -> None:
    shown = []
    for n in range(4, 11):
        msgs: list[Message] = [S]
        for k in range(n):
            msgs += [U(tag=f"q{k}"), A(f"c{k}"), T(f"c{k}", 50), F(tag=f"a{k}")]
        msgs.append(U())
        w = build(msgs, mechanism(**MECHANICS, max_run_loops=3, omit_batch=3,  # coincide: the
                               reduce_at_least=0))  # batch as large as what stays: the table's
        shown.append(w.reduced_loops)
        assert_valid(w.messages)
    # past loops shown run 1, 2, 3 then drop back to 1: one prefix change per three turns
    assert shown == [1, 2, 3, 1, 2, 3, 1]
    # the marker reads the same whatever was omitted: an omission event changes the prefix
    # after it, never the marker itself
    markers = set()
    for n in (4, 7, 10):
        msgs = [S]
        for k in range(n):
            msgs += [U(tag=f"q{k}"), A(f"c{k}"), T(f"c{k}", 50), F(tag=f"a{k}")]
        msgs.append(U())
        markers.add(build(msgs, mechanism(**MECHANICS, max_run_loops=3, omit_batch=2,
                                       reduce_at_least=0)).messages[1]["content"])
    assert len(markers) == 1


def loops_of(n: int, result: int = 50) -> list[Message]:
    msgs: list[Message] = [S]
    for k in range(n):
        msgs += [U(tag=f"q{k}"), A(f"c{k}"), T(f"c{k}", result), F(tag=f"a{k}")]
    return [*msgs, U(tag="now")]


@pytest.mark.parametrize(("max_run_loops", "batch", "shown", "omitted"), [
    (3, 3, [1, 2, 3, 1, 2, 3, 1], [0, 0, 0, 3, 3, 3, 6]),
    (2, 3, [1, 2, 0, 1, 2, 0, 1], [0, 0, 3, 3, 3, 6, 6]),
    # a batch larger than max_run_loops + 1 waits until it has closed, so that omissions
    # stay on multiples of the batch, where the summaries made for them are
    (1, 3, [1, 2, 0, 1, 2, 0, 1], [0, 0, 3, 3, 3, 6, 6]),
    (1, 5, [1, 2, 3, 4, 0, 1, 2], [0, 0, 0, 0, 5, 5, 5]),
    # no past loop shown: each turn omits the one before (its final reply stays) — once
    # that takes tokens out: the first loop alone is shorter than the marker, its summary
    # and its reply, so it goes with the second
    (0, 1, [1, 0, 0, 0, 0, 0, 0], [0, 2, 3, 4, 5, 6, 7]),
    (0, 2, [1, 0, 1, 0, 1, 0, 1], [0, 2, 2, 4, 4, 6, 6]),
])
def test_omissions_come_in_whole_batches_each_with_its_summary(
        max_run_loops: int, batch: int, shown: list[int], omitted: list[int]) -> None:
    policy = mechanism(**MECHANICS, max_run_loops=max_run_loops, omit_batch=batch,
                       reduce_at_least=0)
    summaries = tuple((e, f"summary of the first {e} loops") for e in range(batch, 8, batch))
    got_shown, got_omitted = [], []
    for n in range(1, 8):
        msgs = loops_of(n)
        w = build_window(msgs, [message_hash(m) for m in msgs], [OPS.count(m) for m in msgs],
                         policy, Budget(100_000, 50_000), OPS, summaries=summaries)
        assert_valid(w.messages)
        got_shown.append(w.reduced_loops)
        got_omitted.append(w.omitted_loops)
        if w.omitted_loops:  # the marker, then the summary, as the model's own note
            assert w.messages[1] == {"role": "assistant", "content": (
                "[runloop-proxy] Earlier turns are not shown: search_history(query) searches "
                "them and recall_tool_call(call_id) returns their tool results.\n"
                f"Summary of the turns not shown:\n"
                f"summary of the first {w.omitted_loops} loops")}
    assert (got_shown, got_omitted) == (shown, omitted)


def test_an_omission_that_leaves_no_past_loop_keeps_the_last_reply() -> None:
    # omit_batch above max_run_loops: the past shown runs 1, 2, then none ... but the model
    # always keeps the final reply the user is answering, right after the marker
    policy = mechanism(**MECHANICS, max_run_loops=2, omit_batch=3, reduce_at_least=0,
                    max_message_length=16)
    shown = []
    for n in range(2, 9):
        w = build(loops_of(n), policy)
        assert_valid(w.messages)
        shown.append(w.reduced_loops)
        if w.reduced_loops == 0:
            assert [m["role"] for m in w.messages] == ["system", "assistant", "assistant",
                                                       "user"]
            # the reply as a reduced loop shows it, capped, without the ledger (the marker
            # points at search_history for the omitted loops' tools)
            assert w.messages[2]["content"] == words(5, f"a{n - 1}")
    assert shown == [2, 0, 1, 2, 0, 1, 2]
    # a long reply is capped like a reduced loop's
    msgs = loops_of(3)
    msgs[-2] = F(40, tag="long")
    w = build(msgs, policy)
    assert w.reduced_loops == 0
    assert "tokens cut; recall_tool_call(call_id=" in w.messages[2]["content"]
    assert len(w.messages[2]["content"].split()) < 30


def test_strict_roles_put_the_marker_in_the_system_prompt() -> None:
    policy = mechanism(**MECHANICS, max_run_loops=2, omit_batch=3, reduce_at_least=0,
                    strict_roles=True)
    w = build(loops_of(3), policy)  # everything past omitted: the last reply is kept
    assert [m["role"] for m in w.messages] == ["system", "user", "assistant", "user"]
    assert w.messages[0]["content"].startswith(S["content"] + "\n\n[runloop-proxy] Earlier")
    assert w.messages[2]["content"] == words(5, "a2")
    assert sum(OPS.count(m) for m in w.messages) == w.tokens_out
    # the same for a system prompt in parts, and for none at all
    parts = [{"role": "system", "content": [{"type": "text", "text": "rules"}]}, *loops_of(3)[1:]]
    w = build(parts, policy)
    assert w.messages[0]["content"][-1]["text"].startswith("[runloop-proxy] Earlier")
    w = build(loops_of(3)[1:], policy)
    assert w.messages[0]["role"] == "system" and w.messages[1]["role"] == "user"


def test_the_kept_reply_stays_until_the_next_omission() -> None:
    # inside the turn that omitted everything, and the turn after it, the window only grows
    policy = mechanism(**MECHANICS, max_run_loops=2, omit_batch=3, reduce_at_least=0)
    msgs = loops_of(3)
    first = build(msgs, policy).messages
    later = build([*msgs, A("c-now"), T("c-now"), F(tag="done"), U(tag="next")], policy)
    assert later.messages[: len(first)] == first
    assert later.reduced_loops == 1
    assert [e.kind for e in later.events] == [CompactionKind.PAST_LOOPS]


def test_loops_beyond_max_run_loops_go_even_when_reducing_them_did_not_pay() -> None:
    # question-and-answer turns with no tools: reducing them saves nothing, yet only
    # max_run_loops of them stay in view
    msgs: list[Message] = [S]
    for k in range(6):
        msgs += [U(tag=f"q{k}"), F(tag=f"a{k}")]
    msgs.append(U(tag="now"))
    w = build(msgs, mechanism(**MECHANICS, max_run_loops=2, omit_batch=1))
    users = [m["content"] for m in w.messages if m["role"] == "user"]
    assert w.omitted_loops == 4 and "Earlier turns" in w.messages[1]["content"]
    assert users == [words(5, "q4"), words(5, "q5"), words(5, "now")]
    assert_valid(w.messages)


def test_the_next_request_replays_only_its_own_point(monkeypatch: Any) -> None:
    msgs: list[Message] = [S]
    for k in range(30):
        msgs += [U(tag=f"q{k}"), A(f"c{k}"), T(f"c{k}", 80), F(tag=f"a{k}")]
    msgs.append(U())
    keys = [message_hash(m) for m in msgs]
    counts = [OPS.count(m) for m in msgs]
    memo: dict[Any, Any] = {}
    budget = Budget(100_000, 2_000)
    prev = len(msgs) - 2  # the previous request: up to the last final reply
    build_window(msgs[:prev], keys[:prev], counts[:prev], mechanism(), budget, OPS, memo=memo)
    steps: list[int] = []
    real = window_mod._Replay.step

    def counting(self: Any, p: int, record: bool) -> None:
        steps.append(p)
        real(self, p, record)

    monkeypatch.setattr(window_mod._Replay, "step", counting)
    build_window(msgs, keys, counts, mechanism(), budget, OPS, memo=memo)
    assert steps == [len(msgs)]
    steps.clear()
    build_window(msgs, keys, counts, mechanism(), budget, OPS)  # no memo: every point again
    assert len(steps) == len(request_points(msgs, 0))


@PROPS
@given(st.lists(st.integers(5, 400), min_size=20, max_size=70), st.integers(0, 3000),
       st.integers(0, 4), st.integers(600, 4000))
def test_in_loop_elision_comes_in_batches_of_clear_at_least(
        sizes: list[int], clear: int, keep: int, working: int) -> None:
    """Along one growing agent loop, each in-loop elision event clears at least
    ``clear_at_least`` tokens (at most the target, half the working budget) — unless it elided
    everything elidable (all results but the newest ``keep_recent_tool_results``): prefix
    changes come in batches, not one per turn."""
    policy = mechanism(clear_at_least=clear, keep_recent_tool_results=keep, reduce_at_least=0)
    msgs: list[Message] = [S, U(tag="task")]
    for k, n in enumerate(sizes):
        msgs += [A(f"c{k}"), T(f"c{k}", n)]
    keys = [message_hash(m) for m in msgs]
    counts = [OPS.count(m) for m in msgs]
    budget = Budget(working * 20, working)
    least = min(clear, policy.target * working)
    carry = None
    for p in request_points(msgs, 0):
        w = build_window(msgs[:p], keys[:p], counts[:p], policy, budget, OPS, carry=carry)
        carry = w.carry or carry
        for e in w.events:
            if e.kind is not CompactionKind.ELISION or e.tokens_before - e.tokens_after >= least:
                continue
            results = [m for m in w.messages if m["role"] == "tool"]
            # still shown whole, and a placeholder (~13 tokens) would be shorter
            full = [m for m in results[:-keep or None]
                    if "[runloop-proxy]" not in m["content"] and OPS.count(m) > 20]
            assert not full, f"at {p}: cleared {e.tokens_before - e.tokens_after} < {least}"


def test_a_60_step_loop_changes_its_prefix_a_few_times_not_every_turn() -> None:
    msgs: list[Message] = [S, U(tag="task")]
    for k in range(60):
        msgs += [A(f"c{k}"), T(f"c{k}", 120)]
    keys = [message_hash(m) for m in msgs]
    counts = [OPS.count(m) for m in msgs]

    def prefix_changes(clear: int) -> int:
        previous: list[Message] | None = None
        changes = 0
        for p in request_points(msgs, 0):
            w = build_window(msgs[:p], keys[:p], counts[:p], mechanism(clear_at_least=clear),
                             Budget(100_000, 3_000), OPS)
            if previous is not None and w.messages[:len(previous)] != previous:
                changes += 1
            previous = list(w.messages)
        return changes

    batched, eager = prefix_changes(2000), prefix_changes(0)
    assert batched <= 5 < eager


def test_clear_at_least_larger_than_the_target_clears_the_target_not_everything() -> None:
    """A small working budget caps the batch at its target: an event does not elide every
    result the loop has just because ``clear_at_least`` (6000 by default) is larger."""
    msgs: list[Message] = [S, U(tag="task")]
    for k in range(40):
        msgs += [A(f"c{k}"), T(f"c{k}", 120)]
    keys = [message_hash(m) for m in msgs]
    counts = [OPS.count(m) for m in msgs]
    for p in request_points(msgs, 0):
        w = build_window(msgs[:p], keys[:p], counts[:p], mechanism(), Budget(100_000, 3_000), OPS)
        if any(e.kind is CompactionKind.ELISION for e in w.events):
            break
    results = [m for m in w.messages if m["role"] == "tool"]
    elided = [m for m in results if "[runloop-proxy]" in m["content"]]
    assert 0 < len(elided) < len(results) - mechanism().keep_recent_tool_results


def test_compact_now_omits_the_loops_it_names_from_its_point_on() -> None:
    """``compactions`` (the admin's compact now): from request point n on the first e loops
    are omitted, with the summary made for them inside the marker; before n nothing changes,
    and after the event the window is append-only again."""
    msgs: list[Message] = [S]
    for k in range(6):
        msgs += [U(tag=f"q{k}"), A(f"c{k}"), T(f"c{k}"), F(tag=f"f{k}")]
    keys = [message_hash(m) for m in msgs]
    counts = [OPS.count(m) for m in msgs]
    policy, budget = mechanism(**MECHANICS, max_run_loops=10, omit_batch=2), Budget(100_000, 10_000)
    n = 1 + 4 * 4  # compacted when four loops were stored
    asked, summaries = ((n, 4),), ((4, "SUMMARY-OF-FOUR"),)

    def window(p: int, compactions: tuple[tuple[int, int], ...]) -> Window:
        return build_window(msgs[:p], keys[:p], counts[:p], policy, budget, OPS,
                            summaries=summaries, compactions=compactions)

    previous: list[Message] | None = None
    for p in request_points(msgs, 1):
        w, plain = window(p, asked), window(p, ())
        if p < n:
            assert w.messages == plain.messages and not w.omitted_loops
            continue
        text = orjson.dumps(w.messages).decode()
        assert w.omitted_loops == 4 and "SUMMARY-OF-FOUR" in text
        assert all(f"q{k}" not in text for k in range(4)) and "q4" in text
        if previous is None:
            assert [e.reason for e in w.events] == ["compact now"]
        else:
            assert not w.events and w.messages[:len(previous)] == previous
        previous = list(w.messages)
    assert previous is not None


@PROPS
@given(conversations(), policies, st.integers(300, 3000), st.data())
def test_compactions_keep_windows_valid_append_only_and_carry_consistent(
        msgs: list[Message], policy: Policy, working: int, data: Any) -> None:
    """A compaction at any point and loop count: every window is valid, the prefix changes
    only with an event, and a carried build equals a fresh one."""
    keys = [message_hash(m) for m in msgs]
    counts = [OPS.count(m) for m in msgs]
    budget = Budget(working * 10, working)
    n = data.draw(st.integers(0, len(msgs)))
    e = data.draw(st.integers(1, 7))
    asked = ((n, e),)
    carry = None
    previous: list[Message] | None = None
    for p in request_points(msgs, 0):
        args = (msgs[:p], keys[:p], counts[:p], policy, budget, OPS)
        w = build_window(*args, compactions=asked, summaries=((e, "S"),))
        assert_valid(w.messages)
        grown = build_window(*args, compactions=asked, summaries=((e, "S"),), carry=carry)
        assert orjson.dumps(grown.messages) == orjson.dumps(w.messages), p
        carry = grown.carry
        if previous is not None and not w.events:
            assert w.messages[: len(previous)] == previous, f"prefix changed at {p}"
        previous = list(w.messages)


@PROPS
@given(conversations(), policies, st.integers(400, 3000), st.booleans())
def test_summaries_enter_only_at_omission_events(msgs: list[Message], policy: Policy,
                                                 working: int, rolled: bool) -> None:
    """With a summary for every loop count an omission can reach (rewritten or appended), the
    window is valid and its prefix changes only with an event: a summary shows up inside the
    marker with the omission it was made for, never between."""
    b = policy.omission_batch
    texts, text = [], "Turns left out:"
    for e in range(b, 8, b):
        text = f"{text}\n- loops to {e}" if rolled else f"summary of the first {e} loops"
        texts.append((e, text))
    keys = [message_hash(m) for m in msgs]
    counts = [OPS.count(m) for m in msgs]
    budget = Budget(working * 10, working)
    previous: list[Message] | None = None
    for p in request_points(msgs, 0):
        w = build_window(msgs[:p], keys[:p], counts[:p], policy, budget, OPS,
                         summaries=tuple(texts))
        assert_valid(w.messages)
        shown = [t for e, t in texts if e == w.omitted_loops]
        assert all(t in orjson.dumps(w.messages).decode().replace("\\n", "\n")
                   for t in shown)
        if previous is not None and not w.events:
            assert w.messages[: len(previous)] == previous, f"prefix changed at {p}"
        previous = list(w.messages)


# -- a session's shape, the levers that only save money, the opening task, the agent's names --

def chat(loops: int, n: int = 40) -> list[Message]:
    """A conversation with no tools: questions and answers."""
    msgs: list[Message] = [S]
    for k in range(loops):
        msgs += [U(n, tag=f"q{k}"), F(n, tag=f"a{k}")]
    return [*msgs, U(tag="now")]


def test_a_session_whose_client_sends_no_tools_goes_as_it_came_under_the_threshold() -> None:
    msgs = chat(8)
    policy = mechanism(max_run_loops=2, max_message_length=16)
    # with tools the past loops are cut and omitted at once; without, nothing changes ...
    assert build(msgs, policy).changed
    calm = build(msgs, policy, working=5_000, client_tools=False)
    assert not calm.changed and calm.messages is msgs and not calm.events
    assert not calm.offers_tools(policy, client_tools=False)
    # ... until the budget forces it: then the proxy's tools come with the compaction
    tight = build(msgs, policy, working=400, client_tools=False)
    assert tight.changed and tight.tokens_out <= 400
    assert tight.offers_tools(policy, client_tools=False)
    # the levers that only save money wait for the threshold too, and stay off after it
    assert {e.reason for e in tight.events} <= {"over threshold"}
    # with proxy_tools = "when_needed" the tools arrive at the first event anyway: no wait
    needed = mechanism(max_run_loops=2, max_message_length=16, proxy_tools="when_needed")
    assert build(msgs, needed, working=5_000, client_tools=False).changed


@PROPS
@given(conversations(), policies, st.integers(300, 3000))
def test_without_client_tools_a_window_under_the_threshold_is_the_request(
        msgs: list[Message], policy: Policy, working: int) -> None:
    w = build(msgs, policy, hard=working * 10, working=working, client_tools=False)
    assert_valid(w.messages)
    over = any(sum(OPS.count(m) for m in msgs[:p]) > policy.threshold * working
               for p in request_points(msgs, 0))
    big = max(64, int(policy.max_tool_result_share * working))
    if not over and all(OPS.count(m) <= big for m in msgs):
        assert not w.changed and w.messages is msgs


def test_an_omission_is_made_only_when_it_takes_tokens_out() -> None:
    # loops shorter than the marker, the summary and the reply an omission shows instead
    policy = mechanism(max_run_loops=0, omit_batch=1, keep_opening=False)
    tiny = chat(1, n=2)
    w = build(tiny, policy)
    assert w.omitted_loops == 0 and not any(e.kind is CompactionKind.OMISSION for e in w.events)
    # a loop worth omitting goes at once
    w = build(chat(1, n=60), policy)
    assert w.omitted_loops == 1 and w.tokens_out < w.tokens_in
    # the tiny ones go together once together they take tokens out
    w = build(chat(6, n=2), policy)
    assert w.omitted_loops > 0 and w.tokens_out < w.tokens_in


def test_with_payback_requests_a_lever_waits_until_it_pays() -> None:
    msgs: list[Message] = [S]
    for k in range(6):
        msgs += [U(tag=f"q{k}"), A(f"c{k}"), T(f"c{k}", 40), F(tag=f"a{k}")]
    msgs.append(U(tag="now"))

    def reductions(policy: Policy) -> int:
        count = 0
        for p in request_points(msgs, 1):
            count += sum(e.kind is CompactionKind.PAST_LOOPS for e in build(msgs[:p],
                                                                            policy).events)
        return count
    # each reduction takes out a loop's result; paying at once it must take out more than
    # the provider reads again (the loop's reduced form and what follows): none does
    eager = reductions(mechanism(reduce_at_least=0))
    patient = reductions(mechanism(reduce_at_least=0, payback_requests=20))
    at_once = reductions(mechanism(reduce_at_least=0, payback_requests=0))
    assert eager == 6 and patient == 6 and at_once < eager
    final = build(msgs, mechanism(reduce_at_least=0, payback_requests=0))
    assert final.reduced_loops < 6  # whole loops wait in view


def codex_like(turns: int, result: int = 60) -> list[Message]:
    """Instructions, an environment message and a task sent together, then turns of work."""
    msgs: list[Message] = [S, {"role": "user", "content": "<environment_context> cwd /repo "
                                                          "</environment_context>"},
                           U(30, tag="task")]
    for k in range(turns):
        msgs += [A(f"c{k}"), T(f"c{k}", result), F(tag=f"done{k}"), U(tag=f"next{k}")]
    return msgs


def test_the_opening_task_stays_in_view_when_its_loop_is_reduced_or_omitted() -> None:
    msgs = codex_like(6)
    opening = msgs[1:3]
    policy = mechanism(max_run_loops=2, max_message_length=16)
    w = build(msgs, policy)
    assert w.omitted_loops > 0
    # the environment message and the task, whole, right after the system prompt
    assert w.messages[1:3] == opening
    assert "Earlier turns are not shown" in w.messages[3]["content"]
    assert_valid(w.messages)
    # reduced (not omitted), its task is kept whole, past max_message_length
    w = build(codex_like(1), mechanism(max_message_length=16, reduce_at_least=0))
    assert w.reduced_loops == 1 and w.messages[1:3] == opening
    # without keep_opening the omission hides it
    w = build(msgs, mechanism(max_run_loops=2, max_message_length=16, keep_opening=False))
    assert not any(m == opening[1] for m in w.messages)


def test_an_opening_task_that_alone_breaks_the_budget_is_cut_then_dropped_last() -> None:
    msgs = codex_like(6)
    msgs[2] = U(2_000, tag="huge")
    w = build(msgs, mechanism(max_run_loops=2), working=4_000, hard=20_000)
    assert w.omitted_loops > 0  # the first loop too: the opening is shown apart
    task = next(m for m in w.messages if m["role"] == "user" and "huge0" in m["content"])
    # cut to the share of the budget a single message gets, and recallable whole
    assert OPS.count(task) <= 0.25 * 4_000 + 30 and "tokens cut; recall_tool_call" in \
        task["content"]
    # and the window counts it as cut, not as nothing
    assert sum(OPS.count(m) for m in w.messages) == w.tokens_out
    # at the hard limit it goes only when nothing else is left to take
    msgs = codex_like(6, result=30)
    small = build(msgs, mechanism(max_run_loops=2), working=300, hard=300)
    assert small.fits and small.messages[1:3] == msgs[1:3]
    # the current question alone nearly fills the budget: the opening, cut, goes last
    gone = build([*msgs[:-1], U(250, tag="now")], mechanism(max_run_loops=2), working=300,
                 hard=300)
    assert gone.fits and not any("task0" in str(m.get("content")) for m in gone.messages)
    assert gone.events[-1].kind is CompactionKind.TRUNCATION


@PROPS
@given(conversations(), policies, st.integers(300, 3000))
def test_an_omitted_first_loop_leaves_its_opening_in_view(msgs: list[Message], policy: Policy,
                                                           working: int) -> None:
    w = build(msgs, policy, hard=working * 10, working=working)
    loops = segment(msgs)
    if not (policy.keep_opening and w.omitted_loops and loops):
        return
    if any(e.kind in (CompactionKind.TRUNCATION, CompactionKind.REJECTION) for e in w.events):
        return
    opening = [i for i in loops[0].positions][:1]
    cap = max(64, int(policy.max_tool_result_share * working))
    for i in opening:
        if msgs[i]["role"] == "user" and OPS.count(msgs[i]) <= cap:
            assert msgs[i] in w.messages


def test_a_trimmed_call_and_a_drop_note_keep_the_agents_names() -> None:
    def step(k: int) -> list[Message]:
        # the names sit in the middle of the reasoning, where trimming cuts
        thought = f"{'look ' * 40}at pkg/mod_{k}.py and Model{k}.fit_params{' then' * 40}"
        return [{"role": "assistant", "content": thought, "tool_calls": [
            {"id": f"c{k}", "type": "function", "function": {
                "name": "bash", "arguments": orjson.dumps({"cmd": "ls"}).decode()}}]},
            T(f"c{k}", 60)]
    msgs: list[Message] = [S, U(tag="task")]
    for k in range(12):
        msgs += step(k)
    w = build(msgs, mechanism(keep_recent_tool_results=2, clear_at_least=0), working=1_200)
    assert w.changed and w.elided
    text = "\n".join(message_text(m) for m in w.messages)
    trimmed = [m for m in w.messages if "[runloop-proxy] names:" in str(m.get("content"))]
    assert trimmed and all("tokens cut" in m["content"] for m in trimmed)
    # every file and name the agent wrote stays in view: in its call or its trimmed form
    for k in range(12):
        assert f"pkg/mod_{k}.py" in text and f"Model{k}.fit_params" in text, k
    # a drop note keeps those of the exchanges it drops
    msgs = [S, U(tag="task")]
    for k in range(40):
        msgs += step(k)
    w = build(msgs, mechanism(keep_recent_tool_results=2, clear_at_least=0), working=1_500)
    note = w.messages[1]["content"]
    assert "are not shown" in note and "Names in them: pkg/mod_0.py Model0.fit_params" in note
    text = "\n".join(message_text(m) for m in w.messages)
    assert all(f"Model{k}.fit_params" in text for k in range(40))
    # without names_kept they go with the text that held them
    bare = build(msgs, mechanism(keep_recent_tool_results=2, clear_at_least=0, names_kept=0),
                 working=1_500)
    text = "\n".join(message_text(m) for m in bare.messages)
    assert sum(f"Model{k}.fit_params" in text for k in range(40)) < 20


@pytest.mark.parametrize(("soft", "tools", "working"), [
    (16_000, 1_400, 14_600),  # a support agent's tools: the soft budget less them
    (16_000, 0, 16_000),
    (16_000, 8_000, 8_000),  # tools take at most half of the soft budget...
    (16_000, 15_000, 8_000),  # ...so Claude Code's ~15k of tools leave 8,000, not 1,000
    (16_000, 40_000, 8_000),
    (None, 15_000, 128_000 - 4_096 - 512 - 15_000 - 3),  # unset: the whole window
])
def test_the_working_budget_leaves_room_whatever_the_tools(
        soft: int | None, tools: int, working: int) -> None:
    budget = Budget.for_request(mechanism(soft_budget_tokens=soft), 128_000, None, tools)
    assert budget.working == working
    assert budget.hard == 128_000 - 4_096 - 512 - tools - 3


@pytest.mark.parametrize(("soft", "context", "fitting"), [
    (16_000, 128_000, False),  # the soft budget binds: a cost cap
    (16_000, 16_384, True),  # the model's window binds: 16,384 less the reserves is 11,773
    (None, 128_000, True),  # no soft budget: the window alone
])
def test_an_event_waits_for_fit_threshold_where_the_window_binds(
        soft: int | None, context: int, fitting: bool) -> None:
    policy = mechanism(soft_budget_tokens=soft)
    budget = Budget.for_request(policy, context, None, 0)
    assert budget.fitting is fitting
    assert budget.trigger(policy) == (0.9 if fitting else 0.8) * budget.working
    unset = mechanism(soft_budget_tokens=soft, fit_threshold=None)
    assert budget.trigger(unset) == 0.8 * budget.working  # unset: threshold everywhere
    later = mechanism(soft_budget_tokens=soft, threshold=0.95, target=0.9)  # a tenant's own, later
    assert budget.trigger(later) == 0.95 * budget.working


@pytest.mark.parametrize("past", [False, True])  # one loop (the builder's shortcut), or more
def test_a_window_the_model_bounds_keeps_what_a_cost_cap_would_elide(past: bool) -> None:
    """85% of the working budget: over threshold (0.8), under fit_threshold (0.9)."""
    msgs: list[Message] = [S, U(), F(), U()] if past else [S, U()]
    for k in range(8):
        msgs += [A(f"c{k}"), T(f"c{k}", 100)]
    counts = [OPS.count(m) for m in msgs]
    working = int(sum(counts) / 0.85)
    keys = [message_hash(m) for m in msgs]
    policy = mechanism(clear_at_least=0, reduce_past_loops=ReducePastLoops.OVER_THRESHOLD)
    for fitting, elided in ((False, True), (True, False)):
        budget = Budget(working, working, fitting=fitting)
        w = build_window(msgs, keys, counts, policy, budget, OPS)
        assert w.changed is elided and bool(w.elided) is elided, fitting
        assert w.fits


def test_the_hard_limits_last_resort_keeps_no_past_reply() -> None:
    """Still over the hard limit once the budget's steps are taken: every past loop is
    omitted and the reply an omission would keep after the marker goes too."""
    msgs: list[Message] = [S, U(tag="old"), F(n=60, tag="reply"), U(tag="now")]
    for k in range(40):
        msgs += [A(f"c{k}", args=30), T(f"c{k}", 40)]
    # a working budget above the hard limit: the budget's steps never get under it
    w = build(msgs, mechanism(keep_recent_tool_results=1, max_run_loops=10), hard=500,
              working=5000)
    assert w.fits and w.tokens_out <= 500 and w.omitted_loops == 1
    shown = " ".join(message_text(m) for m in w.messages)
    assert "reply0" not in shown and "now0" in shown
    assert_valid(w.messages)


def _real_ops() -> Any:
    from runloop_proxy.caches import ByteLRU
    from runloop_proxy.pipeline.tokens import TokenCounter, WindowTokens
    counter = TokenCounter()
    enc, _ = counter.encoding("gpt-4o", None)
    return WindowTokens(counter, enc, ByteLRU(1 << 20))


REAL_OPS = _real_ops()


WORDS = ["a", "booking", "HAT045", "2024-05-28", "é", "\n", "x" * 7, "$50", "reservation",
         "ok."]


@settings(max_examples=150, deadline=None)
@given(limit=st.integers(16, 80), data=st.data(), real=st.booleans())
def test_no_form_the_window_shows_is_longer_than_its_message(limit: int, data: st.DataObject,
                                                             real: bool) -> None:
    """A past question or answer cut to ``max_message_length`` (head, a note with its ref,
    tail) is never more tokens than the message: a cut that elides no more than its note
    costs is not made. Over any text and length (a few words past the limit most of all),
    with a word model and the real tokenizer."""
    over = data.draw(st.one_of(st.integers(1, 8), st.integers(1, 60)))
    words = data.draw(st.lists(st.sampled_from(WORDS), min_size=limit + over,
                               max_size=limit + over))
    from runloop_proxy.window.forms import Conversation
    ops = REAL_OPS if real else OPS
    text = " ".join(words)
    msgs: list[Message] = [{"role": "user", "content": text},
                           {"role": "assistant", "content": text},
                           {"role": "user", "content": "next"}]
    keys = [message_hash(m) for m in msgs]
    counts = [ops.count(m) for m in msgs]
    policy = mechanism(max_message_length=limit, summary_model=None, keep_opening=False,
                    names_kept=0)
    conv = Conversation.of(msgs, keys, counts, policy, Budget(100_000, 10_000), ops,
                           frozenset(), None)
    answer, tokens = conv.answer(0)
    assert answer is not None and tokens <= counts[1]
    shown, reduced, _ = conv.reduced(0)
    assert reduced <= counts[0] + counts[1]
    assert all(ops.count(m) <= c for m, c in zip(shown, counts, strict=False))


@pytest.mark.parametrize(("old", "new", "shared"), [
    ([("pre", 100), (("marker", None), 20)], [("pre", 100), (("marker", None), 20)], 120),
    ([("pre", 100), (("marker", "a"), 30)], [("pre", 100), (("marker", "a b"), 35)], 129),
    ([("pre", 100), (("marker", None), 20)], [("pre", 100), (("marker", "a"), 30)], 119),
    ([("pre", 100), (("marker", "a b"), 35)], [("pre", 100), (("marker", "a"), 30)], 100),
    ([("pre", 100), (("marker", "a"), 30)], [("pre", 100), (("marker", "b"), 30)], 100),
    ([("pre", 100), (("marker", "a"), 30), (("bridge", 1), 9)],
     [("pre", 100), (("marker", "a x"), 33), (("bridge", 2), 9)], 129),
    ([("pre", 100), ("opening", 8)], [("pre", 100), ("opening", 0)], 100),
    ([("pre", 100), (("loop", 0), 50)], [("pre", 100), (("marker", "a"), 30)], 100),
])
def test_what_a_changed_plan_shares_with_the_last_request(
        old: list[tuple[object, int]], new: list[tuple[object, int]], shared: int) -> None:
    """What a lever makes the provider read again is judged at token level: the parts
    alike, then a marker whose summary only grew (all but its last token), nothing past
    the first part that differs otherwise."""
    from runloop_proxy.window.plan import shared_prefix
    assert shared_prefix(old, new) == shared


def test_a_late_results_ledger_names_its_own_calls_arguments_through_the_memo() -> None:
    """A loop's reduced form is memoised by what it reads: a late result's ledger line reads
    its call's arguments, which lie in an earlier loop, so they are part of its key (two
    conversations alike but for those arguments each get their own ledger)."""
    rows = "status OK " + " ".join(f"row{i} fine" for i in range(300))

    def conv(acct: str) -> list[Message]:
        return [S, U(tag="hello"), {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "lookup", "arguments": f'{{"acct": "{acct}"}}'}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": "r0"},
            {"role": "assistant", "content": "done"}, U(tag="again"),
            {"role": "tool", "tool_call_id": "call_0", "content": rows},
            {"role": "assistant", "content": "fine"}, U(tag="x")]  # type: ignore[list-item]

    memo: dict[tuple[str, ...], Any] = {}
    policy = mechanism(max_run_loops=7)
    for acct in ("ACCT-1111", "ACCT-2222"):
        msgs = conv(acct)
        w = build_window(msgs, [message_hash(m) for m in msgs], [OPS.count(m) for m in msgs],
                         policy, Budget(100_000, 1_000), OPS, memo=memo)
        text = "\n".join(message_text(m) for m in w.messages)
        assert "tools used" in text, text[:300]
        assert f"acct={acct}" in text and text.count("acct=ACCT-") == text.count(
            f"acct={acct}"), text


def test_the_hard_limit_takes_the_opening_task_then_more_exchanges() -> None:
    """Over the hard limit with everything elided and every past loop omitted, the oldest
    exchanges go, then the opening task (last of all), then again the oldest exchanges its
    going left in: the request fits with its newest exchange, where it was refused before."""
    msgs: list[Message] = [S, U(400, tag="task"), F(5), U(5, tag="next")]
    for k in range(10):
        msgs += [A(f"c{k}", 3), T(f"c{k}", 200)]
    w = build(msgs, mechanism(), hard=130, working=100)
    assert w.fits and w.tokens_out <= 130
    assert w.events[-1].kind.value == "hard_truncation"
    text = "\n".join(message_text(m) for m in w.messages)
    assert "task" not in text
    tools = [m for m in w.messages if m.get("role") == "tool"]
    assert [m["tool_call_id"] for m in tools] == ["c9"]
    assert_valid(w.messages)


def test_a_carried_window_is_sized_by_the_text_it_holds() -> None:
    """Finding (red team): a carried window was sized at four bytes a token, and a token can
    be 128 spaces: 2 MB of spaces passed for 64 KB, and the carries held 15 times their
    share. It is sized by the text its messages hold, whatever it tokenizes to."""
    from runloop_proxy.state import carry_size

    spaces = " " * 2_000_000
    msgs: list[Message] = [S, U(tag="q0"), {"role": "assistant", "content": spaces},
                           U(tag="q1"), A("c1"), {"role": "tool", "tool_call_id": "c1",
                                                  "content": "é" * 1000}]
    counts = [OPS.count(m) for m in msgs]
    counts[2] = 2_000_000 // 128  # what o200k makes of it
    w = build_window(msgs, [message_hash(m) for m in msgs], counts, mechanism(),
                     Budget(100_000, 1_000), OPS)
    assert w.carry is not None
    assert carry_size(("t", "s"), w.carry) >= 2_000_000 + 4 * 1000


@given(factor=st.floats(0.5, 2.0), context=st.integers(4_096, 400_000),
       reserve=st.integers(0, 8_000), tools=st.integers(0, 3_000))
def test_what_fits_the_budget_fits_the_models_window_whatever_the_calibration(
        factor: float, context: int, reserve: int, tools: int) -> None:
    """The budget is in the proxy's count, the window in the model's tokens; ``factor`` (what
    the upstream reports per counted token) converts one into the other. Whatever the
    factor, a prompt that fills the hard budget, its tool schemas with it, is within the
    model's window once converted (planted: the window multiplied by the factor, not divided,
    passed every test, all of which ran at 1.0 — a model the proxy undercounts then got
    prompts past its window)."""
    budget = Budget.for_request(mechanism(), context, reserve or None, tools, factor)
    if budget.hard == 0:
        return
    sent = (budget.hard + budget.tools) * factor
    assert sent + budget.reserve + budget.margin <= context + 1, (budget, sent)
    assert str(round(factor, 2))[:3] in budget.explained() or factor == 1.0


def test_summary_pieces_follow_the_append_chain() -> None:
    from runloop_proxy.window.builder import summary_pieces
    stored = {1: "a", 2: "a", 3: "a\nb", 4: "a\nb\nc", 5: "z", 6: "z\ny", 7: "z\ny\n "}
    assert summary_pieces("a", stored, 1) == ("a",)
    assert summary_pieces("a\nb\nc", stored, 4) == ("a", "b", "c")
    assert summary_pieces("z\ny", stored, 6) == ("z", "y")  # a condensed one starts anew
    assert summary_pieces("z\ny\n ", stored, 7) == ("z\ny\n ",)  # a blank piece: whole
    assert summary_pieces("a\nb", {3: "a\nb"}, 3) == ("a\nb",)
    assert summary_pieces("q", stored, 4) == ("q",)  # not the chain's end: whole


# Every policy field the window reads, with values that matter in these conversations
WINDOW_FIELDS: dict[str, Any] = {
    "max_message_length": st.integers(16, 80), "ledger_arg_chars": st.integers(0, 40),
    "reasoning_keep_tokens": st.integers(16, 40), "keep_recent_tool_results": st.integers(0, 4),
    "names_kept": st.sampled_from([0, 3, 48]),
    "max_tool_result_share": st.sampled_from([0.05, 0.25, 1.0]),
    "keep_opening": st.booleans(), "strict_roles": st.booleans(),
    "exclude_tools": st.sampled_from([(), ("bash",), ("read", "grep")]),
    "summary_model": st.sampled_from([None, "extractive"]), "max_run_loops": st.integers(0, 6),
    "omit_batch": st.one_of(st.none(), st.integers(1, 4)),
    "reduce_past_loops": st.sampled_from(list(ReducePastLoops)),
    "reduce_at_least": st.sampled_from([0, 64, 300]),
    "clear_at_least": st.sampled_from([0, 100, 500]),
    "payback_requests": st.sampled_from([None, 0, 2])}


class CharOps(WordOps):
    """Counts by characters (five a token, +3 a message), cuts by words: any deterministic
    counter will do where only a memo's effect is compared."""

    name = "chars"

    def count(self, msg: Message) -> int:
        calls = orjson.dumps(msg.get("tool_calls") or []).decode()
        return 3 + (len(str(msg.get("content") or "")) + len(calls)) // 5


@st.composite
def request_frames(draw: Any, msgs: list[Message]) -> list[dict[str, Any]]:
    """A few requests' inputs besides their messages: a base frame, and the same with one
    input drawn anew in each of three others — a policy field (a reload), the budget
    (the model's window, the soft budget), the summaries stored, a compaction asked for,
    the results the proxy's tools brought back, the names its tools took, whether the
    client sends tools. Frames one input apart show which part of a key is missing."""
    calls = sorted({m["tool_call_id"] for m in msgs if m["role"] == "tool"})
    inputs: dict[str, Any] = {
        "working": st.sampled_from([400, 900, 2500]), "hard": st.sampled_from([1200, 30_000]),
        "summaries": st.sampled_from([(), ((1, "SUM-A"),), ((2, "SUM-A"), (4, "SUM-A\nSUM-B"))]),
        "compactions": st.sampled_from([(), ((0, 1),), ((len(msgs) // 2, 2),)]),
        "protected": st.builds(frozenset, st.lists(st.sampled_from(calls), max_size=2))
        if calls else st.just(frozenset()),
        "tool_names": st.sampled_from([DEFAULT_NAMES, ("runloop_recall_tool_call",
                                                       "runloop_search_history")]),
        "client_tools": st.booleans(),
        # the counter: a model of another encoding (counts by characters, not words)
        "ops": st.sampled_from([OPS, CharOps()])}
    base = {"policy": draw(policies), **{k: draw(s) for k, s in inputs.items()}}
    out = [base]
    # a policy field half the time, one of the other inputs the other half
    for changed in draw(st.lists(st.one_of(st.sampled_from(sorted(WINDOW_FIELDS)),
                                           st.sampled_from(sorted(inputs))),
                                 min_size=3, max_size=3, unique=True)):
        if changed in WINDOW_FIELDS:
            policy = mechanism(**{**base["policy"].model_dump(),
                               changed: draw(WINDOW_FIELDS[changed])})
            out.append({**base, "policy": policy})
        else:
            out.append({**base, changed: draw(inputs[changed])})
    return out


@settings(PROPS, max_examples=2 * (PROPS.max_examples or 100))
@given(conversations(), st.data())
def test_one_memo_across_requests_that_differ_in_any_input_never_changes_a_window(
        msgs: list[Message], data: Any) -> None:
    """The memo of derived forms and replay checkpoints is shared by every request of a
    session, and a session's requests differ in more than their messages: a policy field
    (a reload), the budget (another model, max_tokens, the tools), the summaries stored, a
    compaction asked for, the results the proxy's tools brought back, the names its tools
    took. Request by request, each with one of a few frames one input apart, a window built
    through the one memo is the window a build without any memo makes — so every memo key
    names every input its form or state reads. Found with it: a trimmed call keyed without
    ``names_kept`` (a reload that changed it kept the old names list, or none). Planted,
    each passed every other test: a replay checkpoint keyed without the compactions, the
    soft budget or the tools' names; a reduced loop keyed without ``max_message_length``."""
    # the agent names files and functions (what names_kept keeps of a trimmed message)
    msgs = [{**m, "content": f"{m['content']} edit pkg/m{i}.py fn_{i}"}
            if m.get("tool_calls") else m for i, m in enumerate(msgs)]
    keys = [message_hash(m) for m in msgs]
    frames = data.draw(request_frames(msgs))
    memo: dict[Any, Any] = {}
    carry = None
    for k, p in enumerate(request_points(msgs, 0)):
        # every other request the base frame: each other one follows a request one input
        # apart, and may resume that one's replay
        f = frames[0] if k % 2 else data.draw(st.sampled_from(frames))
        budget = Budget(max(f["hard"], f["working"]), f["working"])
        kw = {k: f[k] for k in ("summaries", "compactions", "protected", "tool_names",
                                "client_tools")}
        # by words, or by characters: a name's length (the proxy's tools renamed) counts too
        counts = [f["ops"].count(m) for m in msgs[:p]]
        args = (msgs[:p], keys[:p], counts, f["policy"], budget, f["ops"])
        fresh = build_window(*args, **kw)
        memoed = build_window(*args, memo=memo, carry=carry, **kw)
        carry = memoed.carry  # and the conversation the last request grew, grown again
        assert orjson.dumps(memoed.messages) == orjson.dumps(fresh.messages), (p, f)
        assert (memoed.events, memoed.elided, memoed.fits, memoed.tokens_out,
                memoed.reduced_loops, memoed.omitted_loops) == \
            (fresh.events, fresh.elided, fresh.fits, fresh.tokens_out, fresh.reduced_loops,
             fresh.omitted_loops), (p, f)


def _marker_text(m: Message) -> bool:
    content = m.get("content")
    text = content if isinstance(content, str) else orjson.dumps(content).decode()
    return "Earlier turns are not shown" in text


@PROPS
@given(conversations(), policies, st.integers(300, 3000))
def test_the_marker_stands_in_one_place_right_after_what_it_follows(
        msgs: list[Message], policy: Policy, working: int) -> None:
    """Where the omission's marker is, not only that it is there: exactly one, and
    - without ``strict_roles``: an assistant message (the model's own note, never a system
      message, which would make OpenAI re-read the tool schemas), standing right after the
      system prompt and the opening task (when ``keep_opening``) — the messages before it
      are those, in their order — and right before the loops still shown;
    - with ``strict_roles``: inside the client's last system message (a system message of
      its own, first, only when the client sent none), never an assistant message.

    Bug class: a mark of the proxy's that exists but stands in a worse place (a prefix
    re-read, a model misled). Planted: the note before the opening task (``[*pre, note,
    *task]``); the note as a system message after the system prompt; the note after the
    first kept loop's question."""
    w = build(msgs, policy, hard=working + 200, working=working)
    if not w.omitted_loops or not w.fits:
        return
    marked = [i for i, m in enumerate(w.messages) if _marker_text(m)]
    assert len(marked) == 1, marked
    at = marked[0]
    pre = next((i for i, m in enumerate(msgs) if m["role"] not in ("system", "developer")),
               len(msgs))
    if policy.strict_roles:
        assert w.messages[at]["role"] in ("system", "developer")
        assert at == (pre - 1 if pre else 0)
        return
    assert w.messages[at]["role"] == "assistant"
    assert [m["role"] for m in w.messages[:pre]] == [m["role"] for m in msgs[:pre]]
    assert w.messages[:pre] == msgs[:pre]  # the system prompt whole, untouched
    opening = w.messages[pre:at]
    assert all(m["role"] == "user" for m in opening), [m["role"] for m in opening]
    if policy.keep_opening:
        first = msgs[pre]
        assert opening and opening[0]["content"][:40] == first["content"][:40]
    else:
        assert opening == []
    after = w.messages[at + 1:]
    # what follows is the shown conversation: never a second note, never another system
    assert all(m["role"] not in ("system", "developer") for m in after)


LEVERS = {k for k in CompactionKind} - {CompactionKind.TRUNCATION, CompactionKind.REJECTION}


@settings(PROPS, max_examples=max(PROPS.max_examples // 3, 10))
@given(conversations(), policies, st.integers(300, 3000), st.integers(0, 400))
def test_no_compaction_event_leaves_the_window_larger(
        msgs: list[Message], policy: Policy, working: int, over: int) -> None:
    """Every lever of the budget or of savings, at every request point of a session, takes
    tokens out or does not fire (an omission by age or by the operator's "compact now" is
    made as asked; none here: no clock, no request):
    a compaction is a rewrite the provider bills as a cache write, for nothing when it
    saves nothing. The hard limit's last resort may only keep the window as it is.
    The bug class: *a lever that fires without taking tokens out* — dropping old tool
    exchanges whose results were already elided (the note cost 2-3 tokens more than the
    short forms it replaced: all seven drops in a Claude Code session); planted again:
    an omission that adds its marker and kept reply to a window with one short past loop."""
    keys = [message_hash(m) for m in msgs]
    counts = [OPS.count(m) for m in msgs]
    w = build_window(msgs, keys, counts, policy, Budget(working + over, working), OPS,
                     record_from=0)
    for e in w.events:
        if e.kind in LEVERS:
            assert e.tokens_after < e.tokens_before, e
        else:
            assert e.tokens_after <= e.tokens_before, e


def test_a_drop_and_the_elision_before_it_say_what_they_took() -> None:
    """The window names the exchanges it dropped inside the open loop (positions, how many,
    their tokens) and each step counts what it took in its own unit: the elision its tool
    results (still counted once a later drop leaves them out whole), the drop its exchanges
    and their messages. Bug class: a figure counted in the wrong unit (planted: the drop's
    exchanges counted as its messages; the drop event's messages counted as exchanges)."""
    msgs: list[Message] = [S, U(tag="task")]
    for k in range(60):
        msgs += [A(f"c{k}", n=20, args=20), T(f"c{k}", 60)]
    keys = [message_hash(m) for m in msgs]
    # every request point's steps recorded, as for a request that brings all its turns
    w = build_window(msgs, keys, [OPS.count(m) for m in msgs],
                     mechanism(keep_recent_tool_results=2, clear_at_least=0), Budget(100_000, 900),
                     OPS, record_from=0)
    d = w.dropped
    shown_calls = [c["id"] for m in w.messages for c in m.get("tool_calls") or []]
    assert d.exchanges == 60 - len(shown_calls) and d.exchanges > 0
    assert d.positions == tuple(range(2, 2 + 2 * d.exchanges))
    assert len(w.messages) == len(msgs) - len(d.positions)
    # their tokens as the window would have shown them: every one elided by then
    short = {e.position for e in w.elided}
    assert not short & set(d.positions)
    kinds = [e.kind for e in w.events]
    assert CompactionKind.DROP in kinds and CompactionKind.ELISION in kinds
    drops = [e for e in w.events if e.kind is CompactionKind.DROP]
    assert sum(e.items for e in drops) == d.exchanges
    assert sum(e.messages for e in drops) == len(d.positions)
    assert all(e.messages == 2 * e.items for e in drops)  # a call and its result each
    elisions = [e for e in w.events if e.kind is CompactionKind.ELISION]
    # every result elided is either still shown elided or was dropped after
    assert sum(e.items for e in elisions) == len(w.elided) + d.exchanges
    assert all(e.items > 0 for e in elisions)
    assert all(e.items == 0 and e.messages == 0 for e in w.events
               if e.kind not in (CompactionKind.DROP, CompactionKind.ELISION))
    # the drop's tokens: what the window's figure lost to it, less its note
    assert d.tokens > 0 and w.tokens_out < w.tokens_in - d.tokens + 200
