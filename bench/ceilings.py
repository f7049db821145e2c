"""What simple windows would save on recorded conversations: ceilings for the real one.

    python bench/ceilings.py FILE.jsonl [--cap 64]

For every assistant turn it builds, instead of the proxy's window, three idealised ones and
prices them with the replay's cost model (raw tokens, and a prefix repeated from the previous
request at 10%): the system prompt and the current run loop only; the same plus the previous
turn's final reply; the same plus the previous turn's question and final reply (both capped at
``--cap`` tokens). The last two carry the proxy's tool definitions, as any window that leaves
something out must; none carries a ledger or a marker. They bound what a window that keeps the
previous turn in view can save on a trace.
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import orjson

from runloop_proxy.conversation.messages import Message, message_hash
from runloop_proxy.conversation.runloops import RunLoop, preamble_end, segment
from runloop_proxy.ops.replay_offline import cached_cost
from runloop_proxy.pipeline.tokens import REPLY_PRIMING, TokenCounter, WindowTokens
from runloop_proxy.pipeline.tools import definitions_tokens
from runloop_proxy.pricing import Block, PrefixCache

Shape = Callable[[list[Message], list[RunLoop]], list[Message]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("file")
    parser.add_argument("--cap", type=int, default=64)
    parser.add_argument("--model", default="gpt-4o")
    args = parser.parse_args()
    convs = [orjson.loads(line) for line in open(args.file, "rb") if line.strip()]
    counter = TokenCounter()
    enc, _ = counter.encoding(args.model)
    ops = WindowTokens(counter, enc, OrderedDict())

    def capped(m: Message) -> Message:
        text = str(m.get("content") or "")
        cut = ops.cut(text, args.cap)
        return {**m, "content": text if cut is None else f"{cut.head}…{cut.tail}"}

    def current(req: list[Message], loops: list[RunLoop]) -> list[Message]:
        return [*req[: preamble_end(req)], *(req[i] for i in loops[-1].positions)]

    def with_final(req: list[Message], loops: list[RunLoop]) -> list[Message]:
        prev = loops[-2] if len(loops) > 1 else None
        final = [capped(req[prev.final_position])] if prev and prev.final_position else []
        return [*req[: preamble_end(req)], *final, *(req[i] for i in loops[-1].positions)]

    def with_turn(req: list[Message], loops: list[RunLoop]) -> list[Message]:
        prev = loops[-2] if len(loops) > 1 else None
        turn = [capped(req[i]) for i in prev.user_positions] if prev else []
        if prev and prev.final_position:
            turn.append(capped(req[prev.final_position]))
        return [*req[: preamble_end(req)], *turn, *(req[i] for i in loops[-1].positions)]

    proxy_tools = definitions_tokens(counter, enc)
    shapes: list[tuple[str, Shape, int]] = [
        ("system + current loop", current, 0),
        ("+ previous final reply, proxy tools", with_final, proxy_tools),
        ("+ previous question and final reply, proxy tools", with_turn, proxy_tools)]
    for label, shape, extra in shapes:
        raw, cost = _price(convs, shape, extra, counter, enc)
        print(f"{label:<52} raw saving {raw:6.1%}   cache-aware saving {cost:6.1%}")
    return 0


def _price(convs: list[dict[str, Any]], shape: Shape, extra: int, counter: TokenCounter,
           enc: Any) -> tuple[float, float]:
    client = forwarded = client_cost = forwarded_cost = 0.0
    for conv in convs:
        msgs: list[Message] = conv["messages"]
        tools = counter.tools(enc, conv.get("tools"))
        keys = [message_hash(m) for m in msgs]
        counts = [counter.message(enc, m, k) for m, k in zip(msgs, keys, strict=True)]
        side_c, side_f = PrefixCache(0, 1), PrefixCache(0, 1)  # shared tokens, to the token
        first = True
        for i in range(1, len(msgs)):
            if msgs[i].get("role") != "assistant":
                continue
            req = msgs[:i]
            loops = segment(req)
            win = shape(req, loops) if loops else req
            wkeys = [message_hash(m) for m in win]
            wcounts = [counter.message(enc, m, k) for m, k in zip(win, wkeys, strict=True)]
            c_total = sum(counts[:i]) + tools + REPLY_PRIMING
            f_total = sum(wcounts) + tools + extra + REPLY_PRIMING
            client += c_total
            forwarded += f_total
            c_shared = side_c.bill([Block(k, n) for k, n in zip(keys[:i], counts[:i],
                                                                strict=True)]).cached
            f_shared = side_f.bill([Block(k, n) for k, n in zip(wkeys, wcounts,
                                                                strict=True)]).cached
            client_cost += cached_cost(c_total, c_shared + (0 if first else tools))
            forwarded_cost += cached_cost(f_total, f_shared + (0 if first else tools + extra))
            first = False
    return 1 - forwarded / client, 1 - forwarded_cost / client_cost


if __name__ == "__main__":
    sys.exit(main())
