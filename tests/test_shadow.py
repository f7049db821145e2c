"""Shadow comparisons (pure): steps out of each API's answers, the verdict, the spend cap."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runloop_proxy.config import Policy
from runloop_proxy.pipeline.shadow import (
    TEXT_THRESHOLD,
    Basis,
    Outcome,
    Spend,
    Step,
    ToolStep,
    canonical_args,
    compare,
    micro_usd,
    similarity,
    step_of,
    within_cap,
)


def _read(path: str) -> ToolStep:
    return ToolStep("read_file", canonical_args({"path": path}))


CASES: list[tuple[str, Step, Step, Outcome, Basis]] = [
    ("same tool, same args", Step((_read("src/app.py"),)), Step((_read("src/app.py"),)),
     Outcome.AGREE, Basis.TOOLS),
    ("same tool, other args", Step((_read("src/app.py"),)), Step((_read("src/db.py"),)),
     Outcome.DIFFER, Basis.TOOLS),
    ("other tool, same args", Step((ToolStep("cat", canonical_args({"path": "a"})),)),
     Step((ToolStep("read_file", canonical_args({"path": "a"})),)),
     Outcome.DIFFER, Basis.TOOLS),
    ("parallel calls in another order", Step((_read("a.py"), _read("b.py"))),
     Step((_read("b.py"), _read("a.py"))), Outcome.AGREE, Basis.TOOLS),
    ("one call fewer", Step((_read("a.py"),)), Step((_read("a.py"), _read("b.py"))),
     Outcome.DIFFER, Basis.TOOLS),
    ("the same call twice is not once", Step((_read("a.py"), _read("a.py"))),
     Step((_read("a.py"),)), Outcome.DIFFER, Basis.TOOLS),
    ("tool against text", Step((_read("a.py"),)), Step(text="a.py is fine"),
     Outcome.DIFFER, Basis.TOOLS),
    ("tool against text, the same text beside", Step((_read("a.py"),), text="checking"),
     Step(text="checking"), Outcome.DIFFER, Basis.TOOLS),
    ("both refuse, other words", Step(refusal=True, text="I can't help with that."),
     Step(refusal=True, text="Sorry, I won't do this."), Outcome.AGREE, Basis.REFUSAL),
    ("one refuses", Step(refusal=True, text="I can't help with that."),
     Step(text="I can't help with that."), Outcome.DIFFER, Basis.REFUSAL),
    ("same text, other case and punctuation",
     Step(text="The order ORD-7731 shipped on 2026-03-02."),
     Step(text="the order ord 7731 shipped on 2026 03 02"), Outcome.AGREE, Basis.TEXT),
    ("other id in a long answer", Step(text="Your refund for order ORD-7731 was issued"),
     Step(text="Your refund for order ORD-9120 was issued"), Outcome.AGREE, Basis.TEXT),
    ("other answer", Step(text="The build fails in test_db because the fixture is stale."),
     Step(text="I could not find the file you asked about."), Outcome.DIFFER, Basis.TEXT),
    ("both empty", Step(), Step(), Outcome.AGREE, Basis.TEXT),
    ("one empty", Step(text="done"), Step(), Outcome.DIFFER, Basis.TEXT),
]


@pytest.mark.parametrize(("compressed", "full", "outcome", "basis"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_verdicts(compressed: Step, full: Step, outcome: Outcome, basis: Basis) -> None:
    """Table of verdicts. Bug class: a basis chosen wrongly or a comparison too lax. Planted:
    tool calls compared as sets (the same call twice equals once: red), and the text basis
    checked before the refusal one (one refusal with the same words agreed: red)."""
    verdict = compare(compressed, full)
    assert (verdict.outcome, verdict.basis) == (outcome, basis)
    assert compare(full, compressed).outcome == outcome  # symmetric


def test_the_text_threshold_is_stated_and_used() -> None:
    """The ratio and the threshold are in the verdict; the threshold decides. Planted: ``>``
    for ``>=`` (a ratio equal to the threshold differed: red)."""
    a, b = Step(text="one two three four"), Step(text="one two three five")
    ratio = similarity(a.text, b.text)
    assert ratio == 0.75
    at = compare(a, b, threshold=0.75)
    assert (at.outcome, at.similarity, at.threshold) == (Outcome.AGREE, 0.75, 0.75)
    assert compare(a, b, threshold=0.76).outcome == Outcome.DIFFER
    assert compare(a, b).threshold == TEXT_THRESHOLD == Policy().shadow_text_threshold


@pytest.mark.parametrize(("a", "b"), [
    ('{"path": "a.py", "lines": [1, 20]}', '{"lines":[1,20],"path":"a.py"}'),
    ('{"n": 2}', '{"n": 2.0}'),
    ('{"q": "caf\\u00e9"}', '{"q": "café"}'),
    ('{"deep": {"b": 1, "a": {"y": 2, "x": 1.0}}}', '{"deep":{"a":{"x":1,"y":2},"b":1}}'),
    ("", "{}"),
    ('  not json ', "not json"),
])
def test_canonical_args_same(a: str, b: str) -> None:
    """Spellings of one object are one canonical string. Bug class: a spelling difference
    read as another argument. Planted: 2.0 kept as a float only inside nested objects (red on
    "deep"), and everywhere (red on "n" and "deep")."""
    assert canonical_args(a) == canonical_args(b)


@pytest.mark.parametrize(("a", "b"), [
    ('{"n": 2}', '{"n": "2"}'),
    ('{"lines": [1, 20]}', '{"lines": [20, 1]}'),
    ('{"n": 2.5}', '{"n": 2}'),
    ('{"flag": true}', '{"flag": 1}'),
    ('{"path": "A.py"}', '{"path": "a.py"}'),
])
def test_canonical_args_different(a: str, b: str) -> None:
    """Different arguments stay different (a canonical form that folds too much agrees
    wrongly). Planted: the canonical string case-folded (red on A.py and the property)."""
    assert canonical_args(a) != canonical_args(b)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


@given(st.dictionaries(st.text(max_size=6), _json, max_size=5), st.randoms())
def test_canonical_args_ignore_spelling(value: dict[str, Any], rnd: Any) -> None:
    """Property: any key order and spacing of one object is one canonical string, and the
    canonical string parses back to the object."""
    keys = list(value)
    rnd.shuffle(keys)
    shuffled = {k: value[k] for k in keys}
    spelt = json.dumps(shuffled, indent=rnd.choice([None, 1, 4]), ensure_ascii=rnd.random() < .5)
    assert canonical_args(spelt) == canonical_args(value)
    assert json.loads(canonical_args(value)) == value


_words = st.lists(st.sampled_from(["fix", "the", "db", "test", "ORD-7731", "now", "é"]),
                  max_size=30).map(" ".join)


@given(_words, _words)
def test_similarity_properties(a: str, b: str) -> None:
    """Property: similarity is in 0..1, symmetric, 1 for a text and itself. Planted: difflib's
    ratio taken in the order given (red: it is not symmetric)."""
    s = similarity(a, b)
    assert 0.0 <= s <= 1.0
    assert similarity(b, a) == pytest.approx(s)
    assert similarity(a, a) == 1.0
    assert similarity(a.upper(), a) == 1.0


@given(_words, _words, st.floats(0.05, 1.0))
def test_verdict_is_the_threshold_on_the_ratio(a: str, b: str, threshold: float) -> None:
    """Property: on the text basis, agree exactly when the ratio reaches the threshold."""
    verdict = compare(Step(text=a), Step(text=b), threshold)
    assert verdict.basis == Basis.TEXT
    assert (verdict.outcome == Outcome.AGREE) == (similarity(a, b) >= threshold)


def test_similarity_work_is_bounded() -> None:
    """Two long answers cost bounded work: only MAX_WORDS words of each are compared (a
    quadratic matcher on 100k words would take minutes). Planted: no bound (the test hangs
    past its pytest timeout)."""
    long_a = " ".join(f"w{i % 997}" for i in range(100_000))
    long_b = " ".join(f"w{(i * 7) % 991}" for i in range(100_000))
    assert 0.0 <= similarity(long_a, long_b) < 1.0


STEPS: list[tuple[str, dict[str, Any], Step]] = [
    ("chat", {"id": "chatcmpl-9xQ2", "choices": [{"message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "call_Ab3", "type": "function",
             "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]}}]},
     Step((_read("a.py"),))),
    ("chat", {"id": "chatcmpl-9xQ3", "choices": [{"message": {
        "role": "assistant", "content": None, "refusal": "I can't help with that."}}]},
     Step(refusal=True)),
    ("chat", {"id": "chatcmpl-9xQ4", "choices": [{"message": {
        "role": "assistant", "content": "Shipped on 2026-03-02."}}]},
     Step(text="Shipped on 2026-03-02.")),
    ("responses", {"id": "resp_68a1", "output": [
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_Zq1", "name": "read_file",
         "arguments": '{"path":"a.py"}'}]}, Step((_read("a.py"),))),
    ("responses", {"id": "resp_68a2", "output": [{"type": "message", "content": [
        {"type": "refusal", "refusal": "No."}]}]}, Step(refusal=True)),
    ("responses", {"id": "resp_68a3", "output": [{"type": "message", "content": [
        {"type": "output_text", "text": "Done: "}, {"type": "output_text", "text": "3 rows"}]}]},
     Step(text="Done: 3 rows")),
    ("messages", {"id": "msg_01Xb", "stop_reason": "tool_use", "content": [
        {"type": "text", "text": "Reading it."},
        {"type": "tool_use", "id": "toolu_01Ab", "name": "read_file",
         "input": {"path": "a.py"}}]}, Step((_read("a.py"),), text="Reading it.")),
    ("messages", {"id": "msg_01Xc", "stop_reason": "refusal", "content": []},
     Step(refusal=True)),
]


@pytest.mark.parametrize(("api", "body", "step"), STEPS)
def test_steps_of_each_api(api: str, body: dict[str, Any], step: Step) -> None:
    """Each API's answer gives its step. Bug class: a field of one API read wrongly. Planted:
    chat's refusal field ignored (red), Messages' tool_use input not canonicalised (red)."""
    assert step_of(api, body) == step


CAPS: list[tuple[Spend, int | None, float | None, bool]] = [
    (Spend("2026-12-02", 0, 0.0), None, None, True),
    (Spend("2026-12-02", 49_999, 0.0), 50_000, None, True),
    (Spend("2026-12-02", 50_000, 0.0), 50_000, None, False),
    (Spend("2026-12-02", 50_001, 0.0), 50_000, None, False),
    (Spend("2026-12-01", 90_000, 9.0), 50_000, 2.5, True),  # yesterday's spend
    (Spend("2026-12-02", 10, 2.5), 50_000, 2.5, False),
    (Spend("2026-12-02", 10, 2.49), 50_000, 2.5, True),
]


@pytest.mark.parametrize(("spend", "tokens", "usd", "allowed"), CAPS)
def test_the_daily_cap(spend: Spend, tokens: int | None, usd: float | None,
                       allowed: bool) -> None:
    """The cap in tokens or money, reset each UTC day. Planted: ``>`` for ``>=`` (a cap
    reached exactly still spent: red), and the day not compared (yesterday's spend stopped
    today: red)."""
    assert within_cap(spend, "2026-12-02", tokens, usd) is allowed


def test_spend_adds_up() -> None:
    spend = Spend("2026-12-02").add(1_234, 0.0123).add(766, None)
    assert spend == Spend("2026-12-02", 2_000, 0.0123)


def test_shadow_mode_is_off_by_default() -> None:
    policy = Policy()
    assert (policy.shadow_rate, policy.shadow_daily_tokens, policy.shadow_daily_usd) == (
        0.0, None, None)
    with pytest.raises(ValueError):
        Policy(shadow_rate=1.5)


def test_step_of_a_conversation_message() -> None:
    message = {"role": "assistant", "content": [{"type": "text", "text": "Reading "},
                                                 {"type": "text", "text": "it."}],
               "tool_calls": [{"id": "call_Ab3", "type": "function", "function": {
                   "name": "read_file", "arguments": '{ "path" : "a.py" }'}}]}
    from runloop_proxy.pipeline.shadow import step_of_message
    assert step_of_message(message) == Step((_read("a.py"),), text="Reading it.")


def test_the_metrics_levers_are_the_pipelines() -> None:
    from runloop_proxy.ops.metrics import SHADOW_LEVERS
    from runloop_proxy.pipeline.shadow import ANY, BASELINE, LEVERS
    assert SHADOW_LEVERS == (*LEVERS, ANY, BASELINE)


@pytest.mark.parametrize(("usd", "micro"), [
    (None, 0), (0.0, 0), (0.0123, 12_300), (0.0000001, 1), (2.5, 2_500_000),
    (0.1 + 0.2, 300_000),  # float noise is not a millionth more
])
def test_the_ledger_adds_money_in_millionths_rounded_up(usd: float | None, micro: int) -> None:
    """What Redis adds per call (integers, so every replica's increments add exactly).
    Planted: rounded down (a tenth of a millionth read as nothing: red), and the float's
    noise kept (0.1 + 0.2 as 300001: red)."""
    assert micro_usd(usd) == micro
    assert Spend.of_ledger("2026-12-02", 7, micro).usd == pytest.approx(usd or 0.0, abs=1e-6)
