"""Long-term memory on recorded conversations: does a search find the past turn a reply needs?

    python bench/memory_recall.py [TRACE.jsonl ...] [--half holdout] [--limit N]
                                  [--segments 10000] [--redis-url URL]
                                  [--paraphrases bench/memory_paraphrases.jsonl]

For every reply of the held-out half (``replay.half_of``), the identifiers it takes from a past
loop that the proxy's window (default policy, offline replay) does not show are the
references a search must find (``window/retention.py``, the careful reader). For each, the
query is the user message that opened the reply's loop, as a model would pass it on; the
hit counts when a loop holding the reference is among the first five past loops found.
Lexical is ``search_history``'s word ranking alone, hybrid the same fused with the embedded
model's (``pipeline/memory.py``: rank fusion of the two, each message by its best segment).

Words already find most of those: a reply takes an identifier the next user message names
too. So, second, the references words miss: ``bench/memory_paraphrases.jsonl``, queries
written by hand before any model was run on them (``bench/check_paraphrases.py`` checks
them), each saying in other words what a past loop (the support trace) or an earlier step
of one long task (the coding trace: one loop, its finished steps archived) said. The hit
counts when that loop, or that step's call or result, is among the first five found.

Then the costs, with the proxy's own code on a real Redis (an embedded redis-server unless
--redis-url): embedding per segment (batches of 64, one thread), indexing a conversation of N
segments through the store, a search over it (``Memory.search``) p50/p99, and the bytes 1,000
segments take in Redis (MEMORY USAGE) and in the process while searched.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from runloop_proxy.config import Settings, passthrough_tenant
from runloop_proxy.conversation.messages import Message, message_hash
from runloop_proxy.conversation.runloops import segment
from runloop_proxy.conversation.segments import Segment, archived_loops, loop_segments
from runloop_proxy.ops.replay import conversation_of, half_of
from runloop_proxy.ops.replay_offline import Replayer
from runloop_proxy.ops.replay_tally import Tally
from runloop_proxy.pipeline.embeddings import StaticEmbedder
from runloop_proxy.pipeline.memory import (
    CANDIDATES,
    EMBED_BATCH,
    conversation_segments,
    hybrid,
    nearest,
)
from runloop_proxy.pipeline.tools import (
    MAX_QUERY_CHARS,
    doc,
    loop_index,
    query_terms,
    rank_docs,
)
from runloop_proxy.window.retention import Conversation

TOP = 5
# the team's traces beside the checkout (or beside the folder of worktrees)
_ROOT = Path(__file__).resolve().parents[1]
SHARED = next((p for p in (_ROOT.parent / "shared" / "traces",
                           _ROOT.parent.parent / "shared" / "traces") if p.is_dir()),
              _ROOT.parent / "shared" / "traces")


def _loops_ranked(keys: list[str], loop_of: dict[str, int], before: int) -> list[int]:
    """Message keys, best first, as the distinct past loops they stand in."""
    out: list[int] = []
    for k in keys:
        lp = loop_of.get(k)
        if lp is not None and lp < before and lp not in out:
            out.append(lp)
    return out


class Recall:
    """Hits at top 5, by words alone and fused with meaning, over one trace's half."""

    def __init__(self, embedder: StaticEmbedder):
        self.embedder = embedder
        self.asked = 0
        self.lexical = 0
        self.hybrid = 0
        # those of a loop with more past loops than the top holds (with fewer, a ranking
        # that names every past loop finds it: a fusion always does, filled by meaning)
        self.deep = 0
        self.deep_lexical = 0
        self.deep_hybrid = 0
        self.segments = 0
        self.embed_s = 0.0

    def embed(self, texts: list[str]) -> Any:
        import numpy as np

        t = time.perf_counter()
        rows = [self.embedder.embed(texts[i:i + EMBED_BATCH])
                for i in range(0, len(texts), EMBED_BATCH)]
        self.embed_s += time.perf_counter() - t
        self.segments += len(texts)
        return np.concatenate(rows) if rows else np.zeros((0, self.embedder.dim), np.float32)

    def conversation(self, replayer: Replayer, conv: dict[str, Any]) -> None:
        messages: list[Message] = conv["messages"]
        keys = [message_hash(m) for m in messages]
        loops = segment(messages)
        loop_of: dict[str, int] = {}
        start_of = [0] * len(messages)
        for lp in loops:
            for i in lp.positions:
                loop_of.setdefault(keys[i], lp.index)
                start_of[i] = lp.start
        segs: list[Segment] = [s for lp in archived_loops(messages)
                               for s in loop_segments(messages, lp)]
        rows = self.embed([s.text for s in segs])
        docs = [doc(k, m) for k, m in zip(keys, messages, strict=True)]
        fixed = "\n".join([*(str(m.get("content")) for m in messages
                             if m.get("role") in ("system", "developer")),
                           orjson.dumps(conv.get("tools") or []).decode()])
        careful = Conversation(messages, fixed, careful=True)
        asked: set[tuple[str, int]] = set()

        def seen(i: int, req: list[Message], window: Any) -> None:
            start = start_of[i - 1] if i else 0
            _, past = careful.references(i, start)
            shown = "\n".join(careful.show(m) for m in window.messages)
            hidden = [r for r in past if not careful.holds(shown, r)]
            if not hidden:
                return
            here = loop_of.get(keys[start])
            if here is None:
                return
            opener = next((messages[k] for k in range(start, i)
                           if messages[k].get("role") == "user"), None)
            if opener is None:
                return
            query = str(opener.get("content") or "")[:MAX_QUERY_CHARS]
            lexical = [k for _, k, _ in rank_docs(query_terms(query), docs[:start], CANDIDATES,
                                                  query)]
            past_segs = [j for j, s in enumerate(segs) if s.anchor.position < start]
            q = self.embed([query])[0]
            best = nearest(q, rows[past_segs], CANDIDATES) if past_segs else []
            semantic = list(dict.fromkeys(keys[segs[past_segs[r]].anchor.position]
                                          for r, _ in best))
            by_words = _loops_ranked(lexical, loop_of, here)[:TOP]
            by_both = _loops_ranked([k for _, k in hybrid(query, lexical, semantic)], loop_of,
                                    here)[:TOP]
            for ref in hidden:
                if (ref, here) in asked:
                    continue  # each reference once per loop: the query is the loop's
                asked.add((ref, here))
                holders = {loop_of[keys[k]] for k in range(start)
                           if not careful.system[k] and careful.holds(careful.texts[k], ref)
                           and keys[k] in loop_of}
                self.asked += 1
                self.lexical += bool(holders & set(by_words))
                self.hybrid += bool(holders & set(by_both))
                if here > TOP:
                    self.deep += 1
                    self.deep_lexical += bool(holders & set(by_words))
                    self.deep_hybrid += bool(holders & set(by_both))

        replayer.conversation(conv, Tally(), seen)


PARAPHRASES = Path(__file__).resolve().parent / "memory_paraphrases.jsonl"


class Paraphrased:
    """Hits at top 5 of the hand-written queries, by words alone and fused with meaning."""

    def __init__(self, embedder: StaticEmbedder):
        self.embedder = embedder
        self.kept: dict[str, Any] = {}  # a segment's vector by its key: each embedded once
        self.asked: dict[tuple[str, str], int] = {}  # by (half, trace)
        self.lexical: dict[tuple[str, str], int] = {}
        self.hybrid: dict[tuple[str, str], int] = {}

    def vectors(self, segs: list[Segment]) -> Any:
        import numpy as np

        new = list(dict.fromkeys(s.key for s in segs if s.key not in self.kept))
        text = {s.key: s.text for s in segs}
        for i in range(0, len(new), EMBED_BATCH):
            batch = new[i:i + EMBED_BATCH]
            for k, row in zip(batch, self.embedder.embed([text[k] for k in batch]),
                              strict=True):
                self.kept[k] = row
        return np.stack([self.kept[s.key] for s in segs])

    def entry(self, conv: dict[str, Any], e: dict[str, Any]) -> None:
        messages: list[Message] = conv["messages"][:e["at"]]
        keys = [message_hash(m) for m in messages]
        query = str(e["query"])[:MAX_QUERY_CHARS]
        docs = [doc(k, m) for k, m in zip(keys, messages, strict=True)]
        lexical = [k for _, k, _ in rank_docs(query_terms(query), docs, CANDIDATES, query)]
        segs = [s for lp in archived_loops(messages) for s in loop_segments(messages, lp)]
        best = nearest(self.embedder.embed([query])[0], self.vectors(segs),
                       CANDIDATES) if segs else []
        semantic = list(dict.fromkeys(keys[segs[r].anchor.position] for r, _ in best))
        fused = [k for _, k in hybrid(query, lexical, semantic)]
        targets = set(e["targets"])
        if e["unit"] == "loop":
            loop_of = loop_index(messages, keys)
            want = {loop_of[keys[i]] for i in targets}

            def top(ranked: list[str]) -> set[int]:
                # every key ranked is of messages[:at]: each loop is before len(messages)
                return set(_loops_ranked(ranked, loop_of, len(messages))[:TOP])
        else:  # a step: its call or its result among the first five messages found
            first = {}
            for i, k in enumerate(keys):
                first.setdefault(k, i)
            want = {first[keys[i]] for i in targets}

            def top(ranked: list[str]) -> set[int]:
                return set(list(dict.fromkeys(first[k] for k in ranked))[:TOP])
        at = (e["half"], e["trace"])
        self.asked[at] = self.asked.get(at, 0) + 1
        self.lexical[at] = self.lexical.get(at, 0) + bool(want & top(lexical))
        self.hybrid[at] = self.hybrid.get(at, 0) + bool(want & top(fused))

    def report(self, halves: set[str]) -> None:
        rows = sorted(k for k in self.asked if k[0] in halves)
        for half in sorted(halves):
            mine = [k for k in rows if k[0] == half]
            if len(mine) > 1:
                rows.append((half, "all traces"))
                self.asked[(half, "all traces")] = sum(self.asked[k] for k in mine)
                for d in (self.lexical, self.hybrid):
                    d[(half, "all traces")] = sum(d[k] for k in mine)
        for half, trace in sorted(set(rows)):
            n = self.asked[(half, trace)]
            lex = 100 * self.lexical[(half, trace)] / n
            hyb = 100 * self.hybrid[(half, trace)] / n
            print(f"paraphrased, {trace} ({half}): {n} queries; the target in the top {TOP}: "
                  f"lexical {lex:.1f}%, hybrid {hyb:.1f}% ({hyb - lex:+.1f} points)")


def paraphrased(path: Path, traces: list[Path], half: str, embedder: StaticEmbedder) -> None:
    entries = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    halves = {"tune", "holdout"} if half == "all" else {half}
    by_trace = {p.name: p for p in traces}
    r = Paraphrased(embedder)
    for name in sorted({e["trace"] for e in entries if e["half"] in halves}):
        if name not in by_trace:
            print(f"paraphrased: {name} not among the traces given; its queries skipped")
            continue
        wanted = {e["id"] for e in entries if e["trace"] == name}
        convs = {}
        with open(by_trace[name], "rb") as f:
            for line in f:
                line_ = orjson.loads(line) if line.strip() else None
                conv = conversation_of(line_)
                if conv is not None and conv.get("id") in wanted:
                    convs[conv["id"]] = conv
        for e in entries:
            if e["trace"] == name and e["half"] in halves:
                r.entry(convs[e["id"]], e)
    r.report(halves)


def search_costs(embedder: StaticEmbedder, messages: list[Message], n: int, url: str,
                 runs: int, queries: list[str]) -> dict[str, float]:
    """The proxy's own indexing and search (``Memory.index``, ``Memory.search``, a real
    ``RedisStore``) over one conversation of ``n`` segments of recorded loops."""
    from runloop_proxy.caches import SHARES
    from runloop_proxy.config import ServerSection, StoreSection
    from runloop_proxy.conversation.messages import message_hash
    from runloop_proxy.history.store import RedisStore
    from runloop_proxy.ops.metrics import Metrics
    from runloop_proxy.pipeline.memory import Memory, carried, conversation_segments

    segs = conversation_segments(messages)
    out: dict[str, float] = {"segments": len(segs)}

    async def run() -> list[float]:
        store = RedisStore(url, StoreSection(key_prefix="bench-memory"), Metrics())
        share = int((ServerSection().cache_mb << 20) * SHARES["vectors"])  # the default's
        memory = Memory(embedder, store.metrics, asyncio.ensure_future, share,
                        int((ServerSection().cache_mb << 20) * SHARES["segment_cuts"]))
        ns, sid = "bench", "n:memory-recall"
        try:
            t = time.perf_counter()
            done = 0
            while True:  # an indexing takes at most MAX_INDEX_SEGMENTS: as answers would
                k = await memory.index(store, ns, sid, messages, None)
                done += k
                if not k:
                    break
            out["index_ms_per_segment"] = (time.perf_counter() - t) * 1000 / max(1, done)
            key = store.prefix(ns, sid)
            client = store.client
            used = 0
            async for k in client.scan_iter(match=f"{key}:mem*"):
                used += await client.memory_usage(k, samples=0) or 0
            out["redis_mb_per_1000"] = used / 1e6 * 1000 / max(1, len(segs))
            t = time.perf_counter()
            cut = carried(messages)
            out["cut_ms"] = (time.perf_counter() - t) * 1000
            # as the proxy cuts: the session's last cut kept (Memory.cuts), the next
            # request the same conversation and one more turn
            keys = [message_hash(m) for m in messages]
            await memory.carried(ns, sid, messages[:-2], keys[:-2])
            t = time.perf_counter()
            kept = await memory.carried(ns, sid, messages, keys)
            out["cut_kept_ms"] = (time.perf_counter() - t) * 1000
            assert kept.fields == cut.fields, "the kept cut differs from a fresh one"
            t = time.perf_counter()  # the first: the session's blocks read and assembled
            found = await memory.search(store, ns, sid, queries[0], cut)
            out["cold_ms"] = (time.perf_counter() - t) * 1000
            assert found.hits and not found.note, found.note
            took = []
            for r in range(runs):
                t = time.perf_counter()
                found = await memory.search(store, ns, sid, queries[r % len(queries)], cut)
                took.append(time.perf_counter() - t)
                assert found.hits and not found.note, found.note
            kept = memory.vectors.get((ns, sid, embedder.name))
            assert kept is not None, "the session's matrix was not kept"
            out["matrix_mb"] = kept.nbytes() / 1e6 * 1000 / max(1, len(segs))
            async for k in client.scan_iter(match=f"{key}:*"):
                await client.delete(k)
            return took
        finally:
            await store.client.aclose()

    took = sorted(asyncio.run(run()))
    out["p50_ms"] = statistics.median(took) * 1000
    out["p99_ms"] = took[min(len(took) - 1, int(len(took) * 0.99))] * 1000
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="*", type=Path)
    parser.add_argument("--half", default="holdout", choices=["tune", "holdout", "all"])
    parser.add_argument("--limit", type=int, default=0, help="conversations per trace")
    parser.add_argument("--segments", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    parser.add_argument("--paraphrases", type=Path, default=PARAPHRASES,
                        help="the hand-written queries (none: --paraphrases '')")
    args = parser.parse_args()
    traces = args.traces or sorted(SHARED.glob("*.jsonl"))
    if not traces:
        print(f"no traces given and none in {SHARED}", file=sys.stderr)
        return 2
    embedder = StaticEmbedder()
    replayer = Replayer(passthrough_tenant(Settings()), "gpt-4o-mini", None)
    pool: list[Message] = []  # recorded loops, for a conversation of --segments segments
    queries: list[str] = []
    total = Recall(embedder)
    for path in traces:
        with open(path, "rb") as f:
            convs = [c for c in (conversation_of(orjson.loads(line)) for line in f
                                 if line.strip()) if c is not None]
        if args.half != "all":
            convs = [c for c in convs if half_of(c) == args.half]
        convs = convs[:args.limit] if args.limit else convs
        one = Recall(embedder)
        for conv in convs:
            one.conversation(replayer, conv)
            if len(pool) < args.segments:
                body = [m for m in conv["messages"] if m.get("role") not in
                        ("system", "developer")]
                pool += body
                queries += [str(m.get("content"))[:200] for m in body
                            if m.get("role") == "user"][:3]
        _report(f"{path.name} ({args.half}, {len(convs)} conversations)", one)
        for name in ("asked", "lexical", "hybrid", "segments", "deep", "deep_lexical",
                     "deep_hybrid"):
            setattr(total, name, getattr(total, name) + getattr(one, name))
        total.embed_s += one.embed_s
    if len(traces) > 1:
        _report("all traces", total)
    if args.paraphrases and args.paraphrases.is_file():
        paraphrased(args.paraphrases, traces, args.half, embedder)
    if total.segments:
        print(f"indexing: {total.embed_s / total.segments * 1000:.3f} ms a segment "
              f"({total.segments} segments and queries, batches of {EMBED_BATCH}, one thread)")
    messages = list(pool)
    while messages and len(conversation_segments(messages)) < args.segments:
        messages += pool  # a short trace (the smoke run's) repeated up to the size asked
    lo, hi = 0, max(0, len(messages) - 2)  # the fewest oldest messages left out to fit
    while lo < hi:
        mid = (lo + hi) // 2
        if len(conversation_segments(messages[mid:])) > args.segments:
            lo = mid + 1
        else:
            hi = mid
    messages = messages[lo:]
    embedded = None
    url = args.redis_url
    if not url:
        from runloop_proxy.history.embedded import EmbeddedRedis
        embedded = EmbeddedRedis(tempfile.mkdtemp(prefix="rl-memory-bench-"))
        url = embedded.start()
    try:
        c = search_costs(embedder, messages, args.segments, url, args.runs,
                         queries or ["where is the file"])
    finally:
        if embedded is not None:
            embedded.stop()
    print(f"indexing through the store: {c['index_ms_per_segment']:.3f} ms a segment")
    print(f"search at {c['segments']:.0f} segments: p50 {c['p50_ms']:.1f} ms, p99 "
          f"{c['p99_ms']:.1f} ms (Memory.search, the session's matrix in the process: its "
          f"blocks' names asked, the query embedded, exact cosine; off the event loop); the "
          f"first, its blocks read and assembled: {c['cold_ms']:.1f} ms; the conversation "
          f"cut into its segments first, once a request: {c['cut_ms']:.0f} ms, "
          f"{c['cut_kept_ms']:.0f} ms with the session's last cut kept (a turn more)")
    print(f"memory per 1,000 segments: {c['redis_mb_per_1000']:.2f} MB in Redis, "
          f"{c['matrix_mb']:.2f} MB in the process (its cache of the session's matrix)")
    return 0


def _report(what: str, r: Recall) -> None:
    if not r.asked:
        print(f"{what}: no reference a reply took from a hidden past loop")
        return
    lex, hyb = 100 * r.lexical / r.asked, 100 * r.hybrid / r.asked
    print(f"{what}: {r.asked} hidden past references; the loop holding it in the top {TOP}: "
          f"lexical {lex:.1f}%, hybrid {hyb:.1f}% ({hyb - lex:+.1f} points)")
    if r.deep:
        lex, hyb = 100 * r.deep_lexical / r.deep, 100 * r.deep_hybrid / r.deep
        print(f"  of them {r.deep} in a loop with more than {TOP} past loops: lexical "
              f"{lex:.1f}%, hybrid {hyb:.1f}% ({hyb - lex:+.1f} points)")


if __name__ == "__main__":
    sys.exit(main())
