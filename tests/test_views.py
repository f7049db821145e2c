"""How the inspector and ``inspect`` say things (pure): every kind of record a session keeps in
words with no raw field, savings, tenants, and the chart's axes."""

from __future__ import annotations

import hashlib
import re
from html.parser import HTMLParser
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runloop_proxy.ops.inspector_chart import X_TICKS, Y_TICKS, chart, nice_top, request_ticks
from runloop_proxy.ops.views import describe, record_line, saving, tenant_label
from runloop_proxy.window.builder import CompactionKind

RECORDS: list[tuple[dict[str, Any], tuple[str, str, str, str]]] = [
    ({"kind": "loop_omission", "tokens_before": 4389, "tokens_after": 410, "at_message": 45,
      "reason": "max_run_loops/max_time_range"},
     ("loops omitted", "at message 45", "4,389 → 410", "max_run_loops/max_time_range")),
    ({"kind": "past_loop_reduction", "tokens_before": 300, "tokens_after": 80},
     ("past loops reduced", "", "300 → 80", "")),
    ({"kind": "summary", "loops": [0, 5], "summarizer": "extractive-6", "latency_ms": 0.3,
      "tokens_in": None, "tokens_out": None, "appended": True, "in_time": True},
     ("summary of loops 0–4 (appended)", "", "—", "by extractive-6, 0.3 ms")),
    ({"kind": "summary", "loops": [2, 4], "summarizer": "gpt-4o-mini", "latency_ms": 812,
      "tokens_in": 1200, "tokens_out": 90, "in_time": False},
     ("summary of loops 0–3", "", "1,200 in, 90 out",
      "by gpt-4o-mini, 812 ms, late: after the omission it was for")),
    ({"kind": "reply_restated", "branch": 0, "at": 6},
     ("reply restated", "at message 6", "—",
      "the client sent the recorded reply in its own format: replaced in place")),
    ({"kind": "branch_pruned", "branch": 3, "length": 40, "reason": "max_branches"},
     ("branch 3 pruned", "", "—", "40 messages; past max_branches, least recently used")),
    ({"kind": "steps", "count": 97, "kinds": {"loop_omission": 40, "past_loop_reduction": 57},
      "tokens_before": 12000, "tokens_after": 3100, "at_message": 5, "until_message": 380},
     ("97 earlier steps of one request", "at messages 5–380", "12,000 → 3,100",
      "a request that brought many turns: 40 loops omitted, 57 past loops reduced")),
    ({"kind": "steps", "count": 3, "kinds": "junk"},
     ("3 earlier steps of one request", "", "— → —", "a request that brought many turns: ")),
    ({"kind": "something new", "tokens_before": "x"}, ("something new", "", "— → —", "")),
    ({}, ("event", "", "— → —", "")),
]


@pytest.mark.parametrize(("rec", "said"), RECORDS)
def test_every_record_is_said_in_words(rec: dict[str, Any],
                                       said: tuple[str, str, str, str]) -> None:
    assert tuple(describe(rec)) == said
    assert "None" not in record_line(rec)


@pytest.mark.parametrize("kind", list(CompactionKind))
def test_every_window_step_has_a_name(kind: CompactionKind) -> None:
    assert describe({"kind": kind.value}).what != kind.value


@pytest.mark.parametrize(("client", "forwarded", "said"), [
    (1000, 350, "65%"), (1000, 1000, "0%"), (0, 0, "—"), (49, 108, "none (120% added)")])
def test_saving(client: int, forwarded: int, said: str) -> None:
    assert saving(client, forwarded) == said


def test_a_pass_through_namespace_says_what_it_is() -> None:
    assert tenant_label("acme", True) == "acme"
    assert tenant_label("pt-60de2c1f4a5b6c7d", False) == "pass-through caller sunny-toucan"
    assert tenant_label("pt-60de2c1f4a5b6c7d", False, "api.openai.com") == \
        "pass-through caller sunny-toucan via api.openai.com"
    assert tenant_label("pt-configured", True) == "pt-configured"


def test_a_callers_name_is_readable_stable_and_shows_nothing_of_its_keys() -> None:
    """A pass-through caller (and a forwarding tenant's caller) is named by two words picked
    by a hash of its namespace: the same name every time, different callers apart, and no
    run of its keys or of the namespace's hash in it. Bug class: a name made of key
    material. Planted: the hash's first six digits as the name (red: the hash's run), the
    name of old, "pass-through key pt-<hash>" (red: the words and the hash)."""
    from runloop_proxy.api.http import namespace_of
    from runloop_proxy.ops.views import ADJECTIVES, ANIMALS

    names = set()
    for i in range(200):
        key = "sk-proj-" + "".join(hashlib.sha256(f"{i}:{k}".encode()).hexdigest()
                                   for k in range(3))[:156]
        ns = namespace_of([key])
        assert ns is not None and len(key) == 164
        label = tenant_label(ns, False, "api.openai.com")
        assert label == tenant_label(ns, False, "api.openai.com")
        words = label.removeprefix("pass-through caller ").removesuffix(" via api.openai.com")
        adjective, animal = words.split("-")
        assert adjective in ADJECTIVES and animal in ANIMALS, label
        for text, run in ((key[8:], 6), (ns.removeprefix("pt-"), 4)):
            assert not any(text[k:k + run] in label for k in range(len(text) - run + 1)), label
        forwarded = tenant_label(f"acme+{ns.removeprefix('pt-')}", True)
        assert forwarded.startswith("acme, caller ") and ns[3:7] not in forwarded
        names.add(words)
    assert len(names) >= 185  # 4,096 names: a few of 200 callers may share one


@pytest.mark.parametrize(("top", "axis"), [
    (0, 4), (1, 4), (4, 4), (5, 8), (2316, 4000), (19_228, 20_000), (61_377, 80_000),
    (1_000_000, 1_000_000)])
def test_the_token_axis_ends_on_a_round_number(top: int, axis: int) -> None:
    assert nice_top(top) == axis


@given(st.integers(0, 2000))
def test_the_request_axis_names_first_and_last_and_few_between(n: int) -> None:
    ticks = request_ticks(n)
    if n == 0:
        assert ticks == []
        return
    assert ticks[0] == 0 and ticks[-1] == n - 1 and ticks == sorted(set(ticks))
    assert len(ticks) <= X_TICKS + 1


class Texts(HTMLParser):
    def __init__(self, html: str):
        super().__init__()
        self.texts: list[str] = []
        self.tags: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)

    def handle_data(self, data: str) -> None:
        self.texts.append(data)


def test_the_chart_has_a_legend_and_both_axes() -> None:
    points = [{"client": 100 * k, "forwarded": 40 * k} for k in range(1, 19)]
    page = Texts(chart(points))
    assert page.tags.count("polyline") == 2
    for label in ("sent by the client", "forwarded upstream", "tokens",
                  "request (oldest first)", "0", "2,000", "1", "18"):
        assert label in page.texts, label
    assert "the last: client 1,800 tokens, forwarded 720 (60% saved)" in "".join(page.texts)


def test_only_the_lines_depend_on_the_counts() -> None:
    """Two sessions of as many requests draw the same markup but for the lines' points and
    the labels' text (what an escaping sweep may compare)."""
    def attributes(points: list[dict[str, int]]) -> list[tuple[str, str | None]]:
        out: list[tuple[str, str | None]] = []

        class Attrs(HTMLParser):
            def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
                out.extend((f"{tag}.{k}", v) for k, v in attrs if k != "points")
        Attrs().feed(chart(points))
        return out
    a = [{"client": 100 * k, "forwarded": 40 * k} for k in range(7)]
    b = [{"client": 9000 + k, "forwarded": 7 * k} for k in range(7)]
    assert attributes(a) == attributes(b)


def test_no_points_no_chart() -> None:
    assert "No requests recorded yet" in chart([])


@given(st.integers(0, 10**12))
def test_the_token_axis_holds_every_count_with_whole_ticks(top: int) -> None:
    axis = nice_top(top)
    assert top <= axis < 2 * top + 2 * Y_TICKS  # above the highest count, about twice at most
    assert axis % Y_TICKS == 0  # whole ticks


def test_a_single_request_is_drawn() -> None:
    """One point would make a polyline that draws nothing: it gets a short level stroke."""
    svg = chart([{"client": 71_600, "forwarded": 631}])
    strokes = re.findall(r"points='([^']*)'", svg)
    assert len(strokes) == 2 and all(len(s.split()) == 2 for s in strokes)


@pytest.mark.parametrize(("n", "shown", "more"), [(0, 0, None), (1, 1, None), (6, 6, None),
                                                  (7, 7, None), (8, 6, 2), (3000, 6, 2994)])
def test_a_long_list_is_folded_past_six_saying_how_many_more(n: int, shown: int,
                                                             more: int | None) -> None:
    """Bug class: a list that buries the page, or hides items without saying so. Planted:
    the fold's count of the items shown instead of the rest (the 8 and 3,000 rows red)."""
    from runloop_proxy.ops.views import folded

    items = [f"<a href='/m?pos={k}'>call_{k:04d}</a>" for k in range(n)]
    out = folded(items)
    if n == 0:
        assert out == "—"
        return
    head, _, tail = out.partition("<details>")
    assert head.count("<a ") == shown
    if more is None:
        assert not tail
    else:
        assert tail.startswith(f"<summary>{more:,} more</summary>") and tail.count("<a ") == more
    assert [int(k) for k in re.findall(r"call_(\d{4})", out)] == list(range(n))  # all, in order


@pytest.mark.parametrize(("calls", "shown", "more"), [(0, 0, 0), (1, 1, 0), (7, 7, 0),
                                                      (9, 6, 3), (40, 6, 34)])
def test_a_message_of_many_calls_folds_all_but_the_first_six(calls: int, shown: int,
                                                              more: int) -> None:
    """A message's calls (its page, the session's boxes) past six are folded under "N
    more", in order, none lost; seven are all shown (folding one saves nothing). Bug class:
    a long identifier list shown whole, or folded with items lost. Planted: the calls
    joined unfolded (red: 9 and 40), the rest left out of the fold (red)."""
    from runloop_proxy.ops.inspector_message import calls_html

    m: Any = {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{k:02d}Zq8", "type": "function",
         "function": {"name": "get_order", "arguments": f'{{"order_id": "#W{k}417"}}'}}
        for k in range(calls)]}
    out = calls_html(m)
    ids = re.findall(r"call id <code>(call_\d\dZq8)</code>", out)
    assert ids == [f"call_{k:02d}Zq8" for k in range(calls)]
    head = out.split("<details>")[0]
    assert len(re.findall("call id", head)) == shown
    assert (f"<summary>{more} more</summary>" in out) == bool(more)
    assert out.count("<details>") == (1 if more else 0)
