"""`runloop-proxy replay FILE --judge-upstream URL --judge-model M --judge-sample N`: the
shadow comparison offline. For N request points sampled from the recorded conversations
(a fixed seed), a real model is asked the next step twice — with the full window (the
request as the client sent it) and with the window the proxy builds — and the two steps are
compared as shadow mode compares them (pipeline/shadow.py). Agreement is printed by lever,
with a 95% Wilson interval, beside the replay's savings.

The judge is any OpenAI-compatible chat-completions server (a hosted API, vLLM, llama.cpp)
or an Anthropic Messages API (``--judge-format messages``; taken by default for Anthropic's
own host), asked at temperature 0. Every judged point is appended to ``--judge-output``
(JSON lines) as soon as it is judged; a run started again with the same file skips the
points it holds, so an interrupted run keeps what it has."""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from ..conversation.blocks import chat_to_tool, to_anthropic
from ..conversation.messages import Message
from ..pipeline.shadow import ANY, LEVERS, Outcome, compare, levers_of, step_of
from ..window.builder import Window

Z95 = 1.959964
ANTHROPIC_VERSION = "2023-06-01"
MESSAGES_MAX_TOKENS = 4096  # the Messages API needs a bound; a next step fits in it


def judge_format(url: str, given: str | None = None) -> str:
    """The judge's API: as given, else Messages for Anthropic's own host (its API speaks
    nothing else), else chat completions (every OpenAI-compatible server)."""
    if given is not None:
        return given
    host = urlsplit(url).hostname or ""
    return "messages" if host == "anthropic.com" or host.endswith(".anthropic.com") \
        else "chat"


def wilson(agree: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``agree / n`` (0..1 each end)."""
    if n == 0:
        return 0.0, 1.0
    p = agree / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _wire(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as chat completions takes them (the proxy's own keys dropped)."""
    keep = ("role", "content", "name", "tool_calls", "tool_call_id")
    return [{k: m[k] for k in keep if k in m} for m in messages]  # type: ignore[literal-required]


class Judge:
    """The judge upstream, with the resumable output file."""

    def __init__(self, url: str, model: str, key: str | None, output: Path | None,
                 post: Callable[[str, bytes], Any] | None = None, fmt: str = "chat"):
        import httpx

        self.model = model
        self.format = fmt
        self.output = output
        self.done: dict[str, dict[str, Any]] = {}
        if output is not None and output.exists():
            for line in output.read_bytes().splitlines():
                try:
                    row = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue  # a line cut by an interruption: judged again
                self.done[row["point"]] = row
        headers = {"Content-Type": "application/json"}
        if fmt == "messages":
            headers["anthropic-version"] = ANTHROPIC_VERSION
            if key:
                headers["x-api-key"] = key
        elif key:
            headers["Authorization"] = f"Bearer {key}"
        self._client = httpx.Client(base_url=url.rstrip("/"), timeout=300, headers=headers)
        self._post = post or (lambda path, body: self._client.post(path, content=body))

    def close(self) -> None:
        self._client.close()

    def ask(self, messages: list[Message], tools: list[dict[str, Any]] | None
            ) -> dict[str, Any]:
        """The judge's answer (its API's JSON) to ``messages`` with the conversation's
        ``tools`` (chat completions' form)."""
        body: dict[str, Any]
        if self.format == "messages":
            system, turns = to_anthropic(messages)
            body = {"model": self.model, "max_tokens": MESSAGES_MAX_TOKENS,
                    "messages": turns, "temperature": 0}
            if system is not None:
                body["system"] = system
            if tools:
                body["tools"] = [chat_to_tool(t.get("function") or t) for t in tools]
            path = "/messages"
        else:
            body = {"model": self.model, "messages": _wire(messages), "temperature": 0}
            if tools:
                body["tools"] = tools
            path = "/chat/completions"
        r = self._post(path, orjson.dumps(body))
        if r.status_code != 200:
            raise JudgeError(f"the judge answered {r.status_code}: {r.text[:200]}")
        return r.json()  # type: ignore[no-any-return]

    def judge(self, point: str, req: list[Message], window: Window,
              tools: list[dict[str, Any]] | None, threshold: float,
              baseline: bool = False) -> dict[str, Any]:
        """A point's row: the compressed window's step against the full one's; with
        ``baseline``, also the full window asked again against the first answer (``own``:
        how often the model disagrees with itself on the same request)."""
        if point in self.done:
            return self.done[point]
        levers = levers_of(window.reduced_loops, len(window.elided), window.omitted_loops,
                           (e.kind.value for e in window.events), window.changed)
        full, compressed = self.ask(req, tools), self.ask(window.messages, tools)
        full_step = step_of(self.format, full)
        verdict = compare(step_of(self.format, compressed), full_step, threshold)
        row = {"point": point, "levers": list(levers), "outcome": verdict.outcome.value,
               "basis": verdict.basis.value, "similarity": verdict.similarity}
        if baseline:
            row["own"] = compare(step_of(self.format, self.ask(req, tools)), full_step,
                                 threshold).outcome.value
        if self.output is not None:
            with self.output.open("ab") as f:
                f.write(orjson.dumps(row) + b"\n")
        self.done[point] = row
        return row


class JudgeError(Exception):
    pass


def sample_points(convs: list[dict[str, Any]], n: int, seed: int) -> set[tuple[int, int]]:
    """``n`` request points (conversation, assistant position) drawn with ``seed``; the
    first message of a conversation is never one (nothing precedes it)."""
    points = [(k, i) for k, conv in enumerate(convs)
              for i, m in enumerate(conv["messages"]) if i and m.get("role") == "assistant"]
    return set(random.Random(seed).sample(points, min(n, len(points))))


def baseline_points(points: set[tuple[int, int]], n: int, seed: int
                    ) -> set[tuple[int, int]]:
    """The ``n`` sampled points whose full window is asked twice (drawn with ``seed``)."""
    return set(random.Random(seed).sample(sorted(points), min(n, len(points))))


def own_agreement(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The model's own agreement: two asks of the same full window, over the rows that
    have both (errors left out); None when no row was asked twice."""
    asked = [r["own"] for r in rows if "own" in r]
    if not asked:
        return None
    agree = sum(o == Outcome.AGREE for o in asked)
    n = sum(o in (Outcome.AGREE, Outcome.DIFFER) for o in asked)
    low, high = wilson(agree, n)
    return {"n": n, "agree": agree, "rate": agree / n if n else None,
            "low": round(low, 4), "high": round(high, 4)}


def agreement(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Agreement by lever (and ``any``) over the judged rows; errors left out of the rate."""
    out: dict[str, dict[str, Any]] = {}
    for lever in (*LEVERS, ANY):
        mine = [r for r in rows if lever == ANY or lever in r["levers"]]
        agree = sum(r["outcome"] == Outcome.AGREE for r in mine)
        n = sum(r["outcome"] in (Outcome.AGREE, Outcome.DIFFER) for r in mine)
        if not mine:
            continue
        low, high = wilson(agree, n)
        out[lever] = {"n": n, "agree": agree, "rate": agree / n if n else None,
                      "low": round(low, 4), "high": round(high, 4)}
    return out


def report_lines(by_lever: dict[str, dict[str, Any]], model: str,
                 own: dict[str, Any] | None = None) -> list[str]:
    lines = [f"next-step agreement, judged by {model} (compressed vs full window; "
             "95% Wilson interval):"]
    rows = list(by_lever.items())
    if own is not None:  # beside the figure: how much of a disagreement is the model's own
        rows.append(("own (full vs full)", own))
    for lever, f in rows:
        rate = "n/a" if f["rate"] is None else f"{f['rate']:.1%}"
        lines.append(f"  {lever:<11} {f['agree']:>4}/{f['n']:<4} {rate:>6}  "
                     f"[{f['low']:.1%}, {f['high']:.1%}]")
    return lines


def progress(done: int, total: int) -> None:
    print(f"\rjudged {done}/{total}", end="" if done < total else "\n", file=sys.stderr)
