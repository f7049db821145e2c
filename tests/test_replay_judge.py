"""`replay --judge-upstream`: the shadow comparison on recorded conversations, with the
scripted upstream as a judge model that answers from what its window holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from runloop_proxy.ops.replay_judge import (
    agreement,
    judge_format,
    report_lines,
    sample_points,
    wilson,
)
from runloop_proxy.scripted import ScriptedUpstream
from tests.keys import anthropic_key
from tests.parcels import (
    ANTHROPIC_TOOLS,
    CHAT_TOOLS,
    FOUND,
    HIDDEN,
    KEPT,
    SYSTEM,
    conversation,
    decides_from_its_window,
)
from tests.policies import mechanism_set

JUDGE_MODEL = "qwen3-32b-2025-04-29"


@pytest.mark.parametrize(("agree", "n", "low", "high"), [
    (0, 0, 0.0, 1.0),
    (8, 10, 0.4902, 0.9433),
    (50, 100, 0.4038, 0.5962),
    (0, 12, 0.0, 0.2425),
    (37, 37, 0.9059, 1.0),  # n / (n + z²)
])
def test_wilson_interval(agree: int, n: int, low: float, high: float) -> None:
    """Known Wilson 95% intervals. Bug class: the wrong interval. Planted: the normal (Wald)
    interval (red), and z=1.645 (a 90% interval: red)."""
    got = wilson(agree, n)
    assert got == pytest.approx((low, high), abs=1e-4)


def test_sampled_points_are_fixed_by_the_seed_and_never_the_first_message() -> None:
    convs = [{"messages": [{"role": "assistant"}, {"role": "user"}, {"role": "assistant"},
                           {"role": "user"}, {"role": "assistant"}]}] * 3
    a, b = sample_points(convs, 4, 11), sample_points(convs, 4, 11)
    assert a == b and len(a) == 4 and all(i in (2, 4) for _, i in a)
    assert len(sample_points(convs, 99, 11)) == 6  # every point there is


def test_agreement_by_lever_leaves_errors_out() -> None:
    rows = [{"levers": ["omission"], "outcome": "agree"},
            {"levers": ["omission", "summary"], "outcome": "differ"},
            {"levers": [], "outcome": "error"}]
    got = agreement(rows)
    assert (got["omission"]["agree"], got["omission"]["n"]) == (1, 2)
    assert (got["any"]["agree"], got["any"]["n"]) == (1, 2)
    assert got["summary"]["rate"] == 0.0
    assert "elided" not in got


def _conv(cid: str, final: str, tools: bool = False) -> dict[str, Any]:
    return {"id": cid, **({"tools": CHAT_TOOLS} if tools else {}),
            "messages": [*conversation(final), {"role": "assistant", "content": FOUND}]}


def _run(path: Path, upstream: ScriptedUpstream, out: Path, *extra: str
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runloop_proxy.cli", "replay", str(path), "--json",
         "--set", "reduce_at_least=8", "--set", "names_kept=0", "--set", "soft_budget_tokens=1024",
         "--judge-upstream", upstream.url, "--judge-model", JUDGE_MODEL,
         "--judge-sample", "100", "--judge-output", str(out), *extra],
        capture_output=True, text=True, timeout=600)


# the outcome at each point of the two conversations: the tool result, cut to its share of
# the budget, lost the id from the second point on
OUTCOMES = {
    "conv-hidden:2": ("agree", []), "conv-hidden:4": ("differ", ["other"]),
    "conv-hidden:6": ("differ", ["other"]), "conv-kept:2": ("agree", []),
    "conv-kept:4": ("differ", ["other"]), "conv-kept:6": ("agree", ["other"])}


def _two(tmp_path: Path, tools: bool = False) -> Path:
    path = tmp_path / "convs.jsonl"
    path.write_bytes(orjson.dumps(_conv("conv-hidden", HIDDEN, tools)) + b"\n"
                     + orjson.dumps(_conv("conv-kept", KEPT, tools)) + b"\n")
    return path


def test_the_judge_measures_what_a_window_hid_and_resumes(
        tmp_path: Path, upstream: ScriptedUpstream) -> None:
    """One conversation whose reduced past loop hid the order id (a disagreement at its last
    point), one whose final answer kept it (an agreement); every point judged twice (full,
    compressed) and written as judged; run again on the same output file, nothing is asked
    again; a line cut by an interruption is judged again. Bug class: a comparison of the
    wrong windows. Planted: the compressed side asked with the full messages (all agree:
    red), and the output file not read back (asked again: red)."""
    upstream.responder = decides_from_its_window
    path = _two(tmp_path)
    out = tmp_path / "judged.jsonl"
    r = _run(path, upstream, out)
    assert r.returncode == 0, r.stderr
    judge = orjson.loads(r.stdout)["judge"]
    assert judge["model"] == JUDGE_MODEL
    rows = {row["point"]: row for row in map(orjson.loads, out.read_bytes().splitlines())}
    assert set(rows) == {"conv-hidden:2", "conv-hidden:4", "conv-hidden:6",
                         "conv-kept:2", "conv-kept:4", "conv-kept:6"}
    assert {p: (r["outcome"], r["levers"]) for p, r in rows.items()} == OUTCOMES
    assert judge["by_lever"]["other"] == {"n": 4, "agree": 1, "rate": 0.25,
                                          "low": 0.0456, "high": 0.6994}
    assert judge["by_lever"]["any"]["n"] == 6
    asked = len(upstream.requests)
    assert asked == 12 and all(b["model"] == JUDGE_MODEL and b["temperature"] == 0
                               for b in upstream.requests)
    assert _run(path, upstream, out).returncode == 0
    assert len(upstream.requests) == asked  # resumed: nothing asked again
    lines = out.read_bytes().splitlines()
    out.write_bytes(b"\n".join(lines[:-1]) + b"\n" + lines[-1][:10])  # cut mid-line
    assert _run(path, upstream, out).returncode == 0
    assert len(upstream.requests) == asked + 2


@pytest.mark.parametrize(("url", "given", "fmt"), [
    ("https://api.anthropic.com/v1", None, "messages"),
    ("https://eu.api.anthropic.com/v1", None, "messages"),
    ("https://api.openai.com/v1", None, "chat"),
    ("http://127.0.0.1:8000/v1", None, "chat"),
    ("https://anthropic.com.example.net/v1", None, "chat"),  # not Anthropic's host
    ("https://gateway.example.net/v1", "messages", "messages"),
    ("https://api.anthropic.com/v1", "chat", "chat"),  # as given
])
def test_the_judge_format_is_detected_from_anthropics_host(
        url: str, given: str | None, fmt: str) -> None:
    """Planted: the host matched by substring (the look-alike host read as Anthropic's:
    red), and the given format ignored for Anthropic's host (red)."""
    assert judge_format(url, given) == fmt


def test_the_judge_speaks_messages_to_an_anthropic_upstream(
        tmp_path: Path, upstream: ScriptedUpstream) -> None:
    """``--judge-format messages``: every point asked as Messages (system apart, tool_use and
    tool_result blocks, Anthropic's tools, max_tokens, the key as x-api-key) of the scripted
    Messages upstream, its answers read as Messages: the same verdicts as the chat judge's.
    Under ``MECHANISM`` (no summary), where a reduced loop hides what its result held; the
    defaults' digest keeps the order id on the reduced loop's ``ids:`` line (asserted
    last). Planted: the answer read as a chat completion (every step empty, all agree:
    red), and the key sent as a Bearer token (red)."""
    upstream.responder = decides_from_its_window
    key = anthropic_key(77)
    out = tmp_path / "judged.jsonl"
    path = _two(tmp_path, tools=True)
    r = _run(path, upstream, out, "--judge-format", "messages", "--judge-key", key,
             *mechanism_set())
    assert r.returncode == 0, r.stderr
    rows = {row["point"]: row for row in map(orjson.loads, out.read_bytes().splitlines())}
    # with the conversation's tools, the window reduces the past loop at the last point
    assert {p: (r["outcome"], r["levers"]) for p, r in rows.items()} == {
        **OUTCOMES, "conv-hidden:6": ("differ", ["past_loops"]),
        "conv-kept:6": ("agree", ["past_loops"])}
    assert len(upstream.requests) == 12
    for body, headers in zip(upstream.requests, upstream.headers, strict=True):
        assert (body["model"], body["temperature"], body["max_tokens"]) == (
            JUDGE_MODEL, 0, 4096)
        assert body["system"] == SYSTEM and body["tools"] == ANTHROPIC_TOOLS
        assert (headers["x-api-key"], headers["anthropic-version"]) == (key, "2023-06-01")
        assert "authorization" not in headers
    full = upstream.requests[-2]  # the last point's full window
    assert [b["type"] for t in full["messages"] if isinstance(t["content"], list)
            for b in t["content"]] == ["tool_use", "tool_result"]
    tuned = tmp_path / "tuned.jsonl"
    r = _run(path, upstream, tuned, "--judge-format", "messages", "--judge-key", key)
    assert r.returncode == 0, r.stderr
    rows = {row["point"]: row for row in map(orjson.loads, tuned.read_bytes().splitlines())}
    assert (rows["conv-hidden:6"]["outcome"], rows["conv-hidden:6"]["levers"]) == (
        "agree", ["past_loops"])
    # what the judge read there: the reduced loop's ids line (conv-kept's final answer
    # shows the id, so its line has only the date)
    said = [orjson.dumps(b).decode() for b in upstream.requests[-12:]]
    assert sum("ids: ORD-7731" in b for b in said) == 1


def test_the_models_own_agreement_is_measured_beside_the_figure(
        tmp_path: Path, upstream: ScriptedUpstream) -> None:
    """``--judge-baseline N``: N of the six judged points ask the full window a second
    time. A model that answers a window the same way every time agrees with itself 6/6
    (where the compressed window misled it, too); one whose phrasing changes at every call
    (a sampling temperature above 0) 0/2, the figure
    printed beside the agreement by lever. Planted: the second answer compared with the
    compressed window's (red: the hidden points then differ for the steady model), and
    the full window's second ask skipped (red: no own figure)."""
    upstream.responder = decides_from_its_window
    path = _two(tmp_path)
    r = _run(path, upstream, tmp_path / "steady.jsonl", "--judge-baseline", "6")
    assert r.returncode == 0, r.stderr
    own = orjson.loads(r.stdout)["judge"]["own"]
    assert own == {"n": 6, "agree": 6, "rate": 1.0, "low": 0.6097, "high": 1.0}
    assert len(upstream.requests) == 18
    upstream.requests.clear()

    phrasings = ["Your order number is ORD-7731.", "ORD-7731, shipped with DHL on March 2.",
                 "The parcel you asked about carries the reference ORD-7731 today."]
    calls = iter(range(100))
    upstream.responder = lambda body: {"content": phrasings[next(calls) % 3]}
    r = _run(path, upstream, tmp_path / "varied.jsonl", "--judge-baseline", "2",
             "--no-progress")
    assert r.returncode == 0, r.stderr
    own = orjson.loads(r.stdout)["judge"]["own"]
    assert (own["n"], own["agree"]) == (2, 0) and len(upstream.requests) == 14
    rows = list(map(orjson.loads, (tmp_path / "varied.jsonl").read_bytes().splitlines()))
    assert sorted(row.get("own", "-") for row in rows) == ["-"] * 4 + ["differ"] * 2
    assert report_lines({}, JUDGE_MODEL, own)[1:] == [
        "  own (full vs full)    0/2      0.0%  [0.0%, 65.8%]"]
