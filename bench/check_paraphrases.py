"""Checks the hand-written paraphrased recall queries and shows what words they share with
their targets.

    python bench/check_paraphrases.py [bench/memory_paraphrases.jsonl] \
        --traces ../shared/traces

Each line names a conversation of a trace, a position ``at`` (the query is asked with
``messages[:at]`` as history), the target messages and the query. The checker validates every
line (the conversation exists, its half is ``half_of``'s, indices are in range and before
``at``, a loop target is a whole loop at least two loops before ``at``'s loop, a message
target is an assistant call and its tool result at least 15 messages before ``at``, the
query has 4-14 words and no digit), prints for each entry the words (lower-cased, 3 letters
or more) the query shares with the target messages' text, then entries per half and trace
and the mean count of shared words. Exits 1 if any line is invalid.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from runloop_proxy.conversation.runloops import segment
from runloop_proxy.ops.replay import half_of

WORD = re.compile(r"[a-z]{3,}")
FIELDS = ("trace", "id", "half", "at", "unit", "targets", "query", "about")


def words(text: str) -> set[str]:
    return set(WORD.findall(text.lower()))


def message_words(msg: dict[str, Any]) -> set[str]:
    """The words of a message's content and of its tool calls' names and arguments."""
    content = msg.get("content") or ""
    out = words(content if isinstance(content, str) else json.dumps(content))
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        out |= words(fn.get("name") or "") | words(fn.get("arguments") or "")
    return out


def load(traces: Path, name: str, cache: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if name not in cache:
        with open(traces / name) as f:
            cache[name] = {c["id"]: c for c in map(json.loads, f)}
    return cache[name]


def problems(entry: dict[str, Any], traces: Path, cache: dict) -> list[str]:
    missing = [k for k in FIELDS if k not in entry]
    if missing:
        return [f"missing {', '.join(missing)}"]
    try:
        convs = load(traces, entry["trace"], cache)
    except OSError as exc:
        return [f"trace: {exc}"]
    conv = convs.get(entry["id"])
    if conv is None:
        return ["no such conversation"]
    out = []
    msgs = conv["messages"]
    at, targets = entry["at"], entry["targets"]
    if half_of(conv) != entry["half"]:
        out.append(f"half is {half_of(conv)}, not {entry['half']}")
    if not isinstance(at, int) or not 0 < at <= len(msgs):
        out.append(f"at {at} out of range (0, {len(msgs)}]")
    if not targets or not all(isinstance(t, int) and 0 <= t < len(msgs) for t in targets):
        out.append("targets out of range")
    elif isinstance(at, int) and max(targets) >= at:
        out.append("a target is not before at")
    if entry["unit"] == "loop" and not out:
        loops = segment(msgs)
        at_loop = next((L.index for L in loops if L.start <= at < L.end), len(loops))
        target_loops = {L.index for L in loops for t in targets if t in L.positions}
        if len(target_loops) != 1:
            out.append(f"targets span loops {sorted(target_loops)}")
        else:
            (t,) = target_loops
            if list(loops[t].positions) != sorted(targets):
                out.append(f"targets are not loop {t}'s positions")
            if at_loop - t < 2:
                out.append(f"target loop {t} is fewer than 2 loops before at's loop {at_loop}")
    elif entry["unit"] == "message" and not out:
        # a step: an assistant tool call and its result, asked about 15 or more messages later
        first = msgs[targets[0]]
        if (len(targets) != 2 or targets[1] != targets[0] + 1 or first.get("role") != "assistant"
                or not first.get("tool_calls") or msgs[targets[1]].get("role") != "tool"):
            out.append("targets are not [assistant call, its tool result]")
        elif at - targets[1] < 14:
            out.append(f"at {at} is fewer than 15 messages after target {targets[0]}")
    elif entry["unit"] not in ("loop", "message"):
        out.append(f"unit {entry['unit']!r}")
    n = len(entry["query"].split())
    if not 4 <= n <= 14:
        out.append(f"query has {n} words")
    if re.search(r"\d", entry["query"]):
        out.append("query has a digit")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", nargs="?", type=Path,
                    default=Path(__file__).parent / "memory_paraphrases.jsonl")
    ap.add_argument("--traces", type=Path, default=Path("/work/shared/traces"))
    args = ap.parse_args()
    cache: dict[str, dict[str, Any]] = {}
    counts: Counter[tuple[str, str]] = Counter()
    shared_total, valid, bad = 0, 0, 0
    for lineno, line in enumerate(args.file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        entry = json.loads(line)
        errs = problems(entry, args.traces, cache)
        if errs:
            bad += 1
            print(f"{lineno}: INVALID {entry.get('id')}: {'; '.join(errs)}")
            continue
        msgs = cache[entry["trace"]][entry["id"]]["messages"]
        target_words = set().union(*(message_words(msgs[t]) for t in entry["targets"]))
        shared = sorted(words(entry["query"]) & target_words)
        shared_total += len(shared)
        valid += 1
        counts[entry["half"], entry["trace"]] += 1
        print(f"{lineno}: {entry['id']} at={entry['at']} {entry['query']!r} "
              f"shares: {' '.join(shared) or '-'}")
    print()
    for (half, trace), n in sorted(counts.items()):
        print(f"{half:8} {trace:22} {n}")
    print(f"valid {valid}, invalid {bad}, mean shared words "
          f"{shared_total / valid if valid else 0:.2f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
