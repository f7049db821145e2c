"""The held-out conversations whose task the tuning half never saw.

    python bench/unseen_tasks.py IN.jsonl OUT.jsonl

``replay --half`` splits a trace by a fixed hash of each conversation's id, so trials of one
task (``tau1-gpt4o-airline-t39-trial1-89`` and ``…-t39-trial3-189``) can fall in both halves,
and a policy tuned on one trial is measured on its sibling: the held-out half is kinder than
traffic nobody has seen. This keeps the held-out conversations whose task — the id without
its ``-trial<k>-<n>`` suffix — has no trial in the tuning half: the stricter estimate of what
new traffic gets (``runloop-proxy replay OUT.jsonl``, no ``--half``).
"""

from __future__ import annotations

import re
import sys
from typing import Any

import orjson

from runloop_proxy.ops.replay import half_of

_TRIAL = re.compile(r"-trial\d+-\d+$")


def task_of(conv: dict[str, Any]) -> str:
    return _TRIAL.sub("", str(conv.get("id", "")))


def unseen(conversations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    tuned = {task_of(c) for c in conversations if half_of(c) == "tune"}
    return [c for c in conversations if half_of(c) == "holdout" and task_of(c) not in tuned]


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    with open(sys.argv[1], "rb") as f:
        conversations = [orjson.loads(line) for line in f if line.strip()]
    kept = unseen(conversations)
    with open(sys.argv[2], "wb") as out:
        for c in kept:
            out.write(orjson.dumps(c) + b"\n")
    print(f"{len(kept)} of {sum(half_of(c) == 'holdout' for c in conversations)} held-out "
          f"conversations have a task the tuning half never saw", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
