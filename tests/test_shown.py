"""Questions of the kind "does this text show that name", asked for many names, cost work
bounded by the text, not by names × text: every such question goes through
``window.shown.Shown``, which reads the text into a set once and never searches it. Work is
counted (characters a search may read: a ``str`` that counts its own searches), not timed.
Finding: an agent message of 40,000 names of its own whose calls' arguments were cut
(310 KB) cost 7 s of one request's CPU, 5 s of event loop under the offload threshold; a
``search_history`` query of 1,000 ``a`` over results of ``a`` cost 1,000 comparisons per
byte."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy.config import Policy
from runloop_proxy.pipeline.sse import SSEDecoder
from runloop_proxy.window import digest, forms
from runloop_proxy.window.names import holds
from runloop_proxy.window.shown import Shown

from .test_window import build


class Scanned(str):
    """A text that counts what its searches may read: its length per ``in``, and per
    ``find`` what lies after where it starts."""

    read = 0

    def __contains__(self, other: object) -> bool:
        Scanned.read += len(self)
        return super().__contains__(other)  # type: ignore[operator]

    def find(self, sub: Any, start: Any = None, end: Any = None) -> int:
        Scanned.read += len(self) - (start or 0)
        return super().find(sub, start, end)


@pytest.fixture(autouse=True)
def _reset() -> None:
    Scanned.read = 0


NAMES = st.text(alphabet="ab_1.-/ ", min_size=1, max_size=6)
SEARCHED = 1  # characters a search may read, per character of the texts searched


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab_1. -/$", max_size=60), names=st.lists(NAMES, max_size=40),
       added=st.lists(NAMES, max_size=4))
def test_shown_never_says_a_text_shows_a_name_it_does_not(text: str, names: list[str],
                                                         added: list[str]) -> None:
    """Shown errs one way only: a note may repeat a name, never leave out one the text does
    not show; and what a reader takes as a name in the text (a run, a run without its edge
    punctuation, a word piece) it shows."""
    shown = Shown(text)
    for x in added:
        shown.add(x)
    for x in names:
        if x in shown:
            assert x in text or any(x in a for a in added), x
    for run in re.findall(r"[A-Za-z0-9_./\-$@~+:]+", text):
        assert run in shown and run.strip("./-:~+$") in shown
        assert all(piece in shown for piece in re.findall(r"\w+|[A-Za-z0-9]+", run))


def test_many_names_read_a_text_once() -> None:
    text = Scanned(" ".join(f"n_{i} m{i}.x" for i in range(20_000)))
    shown = Shown(text)
    asked = [*(f"n_{i}" for i in range(20_000)), *(f"{i} m" for i in range(20_000)),
             *(f"zz{i}" for i in range(20_000))]
    answers = [x in shown for x in asked]
    assert all(answers[:20_000]) and not any(answers[20_000:])
    assert Scanned.read == 0  # read once, by the regular expressions; never searched


def _agent_names(k: int) -> list[dict[str, Any]]:
    """An agent message of ``k`` names of its own (content as parts: never cut), whose
    call's long arguments are cut when its loop is reduced."""
    text = " ".join(f"n_{i}" for i in range(k))
    args = orjson.dumps({"long": "x " * 400}).decode()
    loop = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "text", "text": text}],
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "f", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok " * 300},
            {"role": "assistant", "content": "done"}]
    later = [m for j in range(6) for m in (
        {"role": "user", "content": f"next {j}"},
        {"role": "assistant", "content": f"fine {j}"})]
    return [{"role": "system", "content": "s"}, *loop, *later]


def test_the_window_s_kept_names_read_each_text_a_bounded_number_of_times(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The names kept of a message whose arguments were cut (``missing_names``) and of the
    exchanges a drop hides (``dropped_names``), each text searched through ``Shown``."""
    made = forms.message_text
    texts: list[int] = []

    def scanned(m: Any) -> Scanned:
        out = Scanned(made(m))
        texts.append(len(out))
        return out

    monkeypatch.setattr(forms, "message_text", scanned)
    build(_agent_names(4_000), hard=40_000)  # type: ignore[arg-type]
    assert texts, "no kept-names text was searched: the case no longer reaches them"
    assert Scanned.read <= SEARCHED * sum(texts), \
        f"{Scanned.read:,} characters read over texts of {sum(texts):,}"
    # a drop's note: the task names every file the dropped steps name again
    files = [f"pkg/mod_{j}.py" for j in range(800)]
    msgs: list[Any] = [{"role": "system", "content": "s"},
                       {"role": "user", "content": "fix " + " ".join(files)}]
    for k in range(12):
        msgs += [{"role": "assistant", "content": f"step {k}: " + " ".join(files),
                  "tool_calls": [{"id": f"c{k}", "type": "function",
                                  "function": {"name": "bash", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": f"c{k}", "content": "out " * 60}]
    texts.clear()
    Scanned.read = 0
    w = build(msgs, Policy(keep_recent_tool_results=2, clear_at_least=0), working=1_500)
    assert "are not shown" in str(w.messages[1]["content"]), "the case no longer drops"
    assert Scanned.read <= SEARCHED * sum(texts), \
        f"{Scanned.read:,} characters read over texts of {sum(texts):,}"


def test_a_summary_reads_the_system_prompt_and_itself_a_bounded_number_of_times() -> None:
    """The system prompt's identifiers are skipped (never counted to a loop's cap): a user
    who repeats 3,000 of them made a search of the prompt each, in every loop."""
    ids = [f"id{i:06d}" for i in range(3_000)]
    prompt = Scanned(" ".join(ids))
    previous = Scanned("\n".join(f"- Q: q{i} → A: a{i}" for i in range(300)))
    loops = [[{"role": "user", "content": " ".join(reversed(ids)) + " " + " ".join(
        f"new{j}_{t}x" for t in range(digest.IDS_PER_LOOP))},
              {"role": "assistant", "content": f"ok {j}"}] for j in range(30)]
    text = digest.roll(previous, loops, 100_000, len, known=prompt)  # type: ignore[arg-type]
    assert all(f"new{j}_{t}x" in text for j in range(30) for t in range(14))
    assert "id000001" not in text
    assert Scanned.read <= SEARCHED * len(loops) * (len(prompt) + len(previous))
    Scanned.read = 0
    picked = digest.pick([digest.found_in(loops[0][0])], known=prompt)
    assert picked == [f"new0_{t}x" for t in range(digest.IDS_PER_LOOP)]
    assert Scanned.read <= SEARCHED * len(prompt)


def test_whole_token_search_compares_in_proportion_to_the_text() -> None:
    text = Scanned("a" * 100_000)
    assert holds(text, "a" * 1_000) is False  # a periodic ref: past its budget, not shown
    read = Scanned.read
    assert read <= 8 * len(text) ** 2 // 1_000, read  # was 1,000 comparisons per byte
    assert holds(Scanned("say 594 and 6594"), "594") is True


def test_a_stream_of_cr_ended_lines_is_read_once() -> None:
    """The upstream's lines ended by a bare CR: each looked for the next LF to the end of
    the chunk (256 KB: 0.36 s). Counted by the searches made, one per line."""
    import sys

    finds = 0

    def hook(frame: Any, event: str, arg: Any) -> None:
        nonlocal finds
        if event == "c_call" and getattr(arg, "__name__", "") == "find":
            finds += 1

    lines = 5_000
    decoder = SSEDecoder()
    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        events = decoder.feed(b"data: x\r\r" * lines)
    finally:
        sys.setprofile(previous)
    assert len(events) == lines
    assert finds <= 2 * lines + 2, finds  # a line is a search (four an event before)


def test_a_summary_condensed_counts_its_text_a_logarithmic_number_of_times() -> None:
    """A summary rewritten into its budget dropped its oldest line one at a time, counting
    the whole block after each (1,000 lines: 1 s): now as many as fit are found by halving,
    and the result is the one the one-at-a-time rule gives."""
    lines = [f"- Q: question {i} → A: answer {i}" for i in range(1_000)]
    ids = [f"ORD-{i:05d}" for i in range(50)]
    counted = 0

    def count(text: str) -> int:
        nonlocal counted
        counted += 1
        return len(text.split())

    budget = 2_000
    out = digest.condensed(lines, ids, budget, count)
    assert counted <= 2 * 10 + 4, counted  # log2(1,000) ~ 10
    keep = next(k for k in range(len(lines))
                if len(digest.block(lines[k:], ids).split()) <= budget)
    assert out == digest.block(lines[keep:], ids)
