"""Anthropic's prompt cache is explicit: a request marks where cached prefixes end
(``cache_control`` on a tool, a system block or a message's block, at most four), and a later
request reads the longest marked prefix it repeats. The window keeps the client's marks where
their blocks are (a cut result keeps its block's fields), so they stay on prefixes that change
only at compaction events; it adds none unless the tenant asks (``cache_breakpoints =
"auto"``): then one at the end of the request, one at the end of the marker's note (its
summary as a block per piece it grew by, so the next omission, which appends a piece, repeats
the prefix up to there) and one at the end of the window's stable prefix — the last message it
rewrote, whose form no later request changes until the next event — while there are fewer
than four. (Pure.)"""

from __future__ import annotations

from typing import Any

MAX_BREAKPOINTS = 4
EPHEMERAL = {"type": "ephemeral"}
UNMARKABLE = ("thinking", "redacted_thinking")  # the API refuses cache_control on these


Mark = tuple[int, int, int, str | None]  # (part, turn, block, the mark's ttl)


def marks(body: dict[str, Any]) -> list[Mark]:
    """Where the request's breakpoints are, in the order the API renders the prompt —
    (part, turn, block): part 0 the tools, 1 the system prompt, 2 the messages (a mark inside
    a block, on a tool_result's content, at that block) — with each one's ``ttl``."""
    out = [(0, 0, i, _ttl(t)) for i, t in enumerate(body.get("tools") or []) if _marked(t)]
    system = body.get("system")
    if isinstance(system, list):
        out += [(1, 0, i, _ttl(b)) for i, b in enumerate(system) if _marked(b)]
    for t, turn in enumerate(body.get("messages") or []):
        content = turn.get("content") if isinstance(turn, dict) else None
        if isinstance(content, list):
            for i, b in enumerate(content):
                out += [(2, t, i, _ttl(m)) for m in _with_nested(b) if _marked(m)]
    return out


def _with_nested(block: Any) -> list[Any]:
    """A block and every block inside it, however deep (a tool_result's content, a
    search_result's text in it, a document's content source): a mark on any counts
    against the API's four. In the order they are written (the next mark after a place is
    the first of a block's: a mark given a later one's lifetime could precede a longer-lived
    one, which the API refuses). One walk of the block, its nesting bounded by the
    request's."""
    out: list[Any] = []
    todo = [block]
    while todo:
        value = todo.pop()
        if isinstance(value, dict):
            out.append(value)
            todo.extend(reversed([v for k, v in value.items() if k != "cache_control"
                                  and isinstance(v, (dict, list))]))
        elif isinstance(value, list):
            todo.extend(reversed([v for v in value if isinstance(v, (dict, list))]))
    return out


def with_auto(body: dict[str, Any], stable_turn: int | None,
              note: tuple[int, int] | None = None) -> dict[str, Any]:
    """``body`` with the proxy's breakpoints added, while fewer than four are set, first
    where they are worth most: at the end of the request, at the end of the marker's note
    (``note``: its last block, (turn, block): the summary's pieces stay there while it
    grows), and at the end of turn ``stable_turn`` (-1: the system prompt; None: nowhere).
    Each takes the lifetime of the next breakpoint after it, if any (the API wants
    longer-lived prefixes first)."""
    turns = body.get("messages") or []
    wanted: list[tuple[int, int | None]] = [(len(turns) - 1, None)]
    if note is not None:
        wanted.append(note)
    if stable_turn is not None:
        wanted.append((stable_turn, None))
    out = dict(body)
    for t, block in dict.fromkeys(w for w in wanted if w[0] >= 0 or body.get("system")):
        existing = marks(out)
        if len(existing) >= MAX_BREAKPOINTS:
            break
        if t < 0:
            out["system"] = _marked_blocks(out["system"], existing, (1, 0))
        elif t < len(turns):
            messages = list(out["messages"])
            messages[t] = {**messages[t], "content": _marked_blocks(
                messages[t]["content"], existing, (2, t), block)}
            out["messages"] = messages
    return out


def _marked_blocks(content: Any, existing: list[Mark], where: tuple[int, int],
                   block: int | None = None) -> Any:
    """``content`` with a mark on block ``block`` (None: its last markable block)."""
    blocks = content if isinstance(content, list) else [{"type": "text", "text": content}]
    at = next((i for i in range(len(blocks) - 1 if block is None else block, -1, -1)
               if isinstance(blocks[i], dict) and blocks[i].get("type") not in UNMARKABLE
               and (blocks[i].get("type") != "text" or blocks[i].get("text"))), None)
    if at is None or _marked(blocks[at]):
        return content
    after = [m for m in existing if m[:3] > (*where, at)]
    ttl = after[0][3] if after else None
    control = {**EPHEMERAL, "ttl": ttl} if ttl else EPHEMERAL
    return [*blocks[:at], {**blocks[at], "cache_control": control}, *blocks[at + 1:]]


def _ttl(block: dict[str, Any]) -> str | None:
    ttl = block["cache_control"].get("ttl")
    return ttl if isinstance(ttl, str) else None


def _marked(block: Any) -> bool:
    return isinstance(block, dict) and isinstance(block.get("cache_control"), dict)
