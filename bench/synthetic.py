"""Synthetic agent sessions for the benchmarks (the real traces are not on a user's machine)."""

from __future__ import annotations

import json
import random
from typing import Any

WORDS = ("the function returns a value when called with the parser config file test module "
         "error stack trace line import class def self return None True False path os sys "
         "json request response session token window loop tool result output").split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def agent_session(n_messages: int, seed: int = 7, turns: int = 3) -> list[dict[str, Any]]:
    """A coding-agent-like session: a system prompt, a few user turns, each with tool calls
    whose results vary from a line to a few thousand tokens."""
    rng = random.Random(seed)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": text(rng, 300)}]
    per_turn = max(4, (n_messages - 1) // turns)
    call = 0
    while len(msgs) < n_messages:
        msgs.append({"role": "user", "content": text(rng, rng.randint(20, 200))})
        steps = (per_turn - 2) // 2
        for _ in range(steps):
            if len(msgs) >= n_messages - 2:
                break
            call += 1
            cid = f"call_{call:05d}"
            msgs.append({"role": "assistant", "content": text(rng, rng.randint(5, 80)),
                         "tool_calls": [{"id": cid, "type": "function", "function": {
                             "name": "bash", "arguments": json.dumps({"cmd": text(rng, 6)})}}]})
            size = rng.choice((20, 80, 300, 1200, 3000))
            msgs.append({"role": "tool", "tool_call_id": cid, "content": text(rng, size)})
        msgs.append({"role": "assistant", "content": text(rng, rng.randint(30, 150))})
    return msgs[:n_messages]
