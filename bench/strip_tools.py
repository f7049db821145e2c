"""A trace's conversations as a client that sends no tools would have had them.

    python bench/strip_tools.py IN.jsonl OUT.jsonl

Every tool call and result goes, with the ``tools`` list; what the assistant said beside its
calls stays, and its consecutive messages are joined. Support conversations made so are the
shape of a triage chat: questions and answers under a long system prompt, and a proxy that
adds its own tools to such a session changes its tool list (see README, "Measuring savings").
"""

from __future__ import annotations

import sys
from typing import Any

import orjson


def stripped(conv: dict[str, Any]) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    for m in conv["messages"]:
        if m.get("role") == "tool":
            continue
        if m.get("role") == "assistant" and m.get("tool_calls"):
            if not m.get("content"):
                continue
            m = {"role": "assistant", "content": m["content"]}
        if out and out[-1]["role"] == "assistant" == m["role"]:
            out[-1] = {"role": "assistant",
                       "content": f"{out[-1].get('content') or ''}\n{m.get('content') or ''}"}
        else:
            out.append(m)
    meta = dict(conv.get("meta") or {})
    meta["domain"] = f"{meta.get('domain', 'support')} without tools"
    return {k: v for k, v in conv.items() if k not in ("messages", "tools", "meta")} \
        | {"messages": out, "meta": meta}


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    with open(sys.argv[1], "rb") as src, open(sys.argv[2], "wb") as dst:
        for line in src:
            if line.strip():
                dst.write(orjson.dumps(stripped(orjson.loads(line))) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
