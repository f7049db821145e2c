"""Long-term memory: past loops' segments embedded after the answer, found again by meaning.

After a turn is answered, the loops it closed and the finished steps of the loop still going
(``archived_loops``) are cut into segments (``conversation/segments.py``), and those the
session has no vector of yet are embedded in a worker thread and kept in Redis beside the
session (its ``:mem`` hash, under its retention).
``search_history`` then ranks by words and by meaning together (reciprocal rank fusion); the
search reads only the vectors of segments the request itself carries, so a session nobody
named still reaches only what its request carries, and a vector is never another session's.
A session's vectors are kept in the process as one matrix between searches
(``pipeline/vectors.py``), a share of ``server.cache_mb``.
Nothing here is on the request path but the search the model asked for, which runs off the
event loop under a deadline; any failure leaves the words alone to answer, and says so.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import xxhash

from ..caches import ENTRY_OVERHEAD, ByteLRU
from ..conversation.messages import Message
from ..conversation.runloops import RunLoop
from ..conversation.segments import Segment, archived_loops, loop_segments
from ..errors import EmbeddingError, StoreError
from ..history.store import RedisStore
from ..ops import logs
from ..ops.metrics import Metrics
from .embeddings import KEY_BYTES, Embedder, block
from .remote_embeddings import Job, UpstreamModel
from .vectors import SessionVectors, VectorCache, assemble, empty, rows_of, scores

if TYPE_CHECKING:
    from .embeddings import Vectors
    from .remote_embeddings import Host
    from .shares import Shares

log = logs.get("memory")
FIELD_CHARS = KEY_BYTES  # of a segment's key, as its field in the session's hash
EMBED_BATCH = 64  # segments a worker thread embeds at a time
MAX_INDEX_SEGMENTS = 2_048  # embedded by one answer's indexing; the next answer goes on
MAX_PENDING = 8  # sessions being indexed in the process; past it an answer's is left to the next
MAX_SEARCH_SEGMENTS = 20_000  # of a request's conversation, the newest, searched by meaning
INLINE_EMBED = 256  # segments a search embeds itself when their indexing has not landed yet
SEARCH_TIMEOUT_S = 2.0  # a search by meaning past this answers by words alone
CANDIDATES = 50  # of each ranking, fused
# How the two rankings are fused, chosen on the traces' tune half (bench/memory_recall.py:
# the references replies took, and the hand-written paraphrases): a rank's weight
# 1 / (20 + r), the top ranks counting more than the usual 60 gives; a query of plain words
# takes meaning's ranking at three times the words', one naming a number or an identifier
# (an order, a reservation code, a line; a file, a function: what words find exactly) the
# two alike. (No query of either set names an identifier without a digit: that part is
# not measured, and holds words' exact matches where meaning knows nothing of them.)
RRF_K = 20
MEANING_WEIGHT = 3.0
# a digit; or inside a word an underscore, a dot or a slash; or a lower letter then a capital
_NAMES_AN_IDENTIFIER = re.compile(r"\d|\w[_./]\w|[a-z][A-Z]")


def fuse(rankings: list[list[str]], k: int = RRF_K, weights: list[float] | None = None
         ) -> list[tuple[float, str]]:
    """Reciprocal rank fusion (pure): each key's sum of weight / (k + rank) over the
    rankings (rank from 1; each weight 1 unless given), best first; ties keep the order of
    first appearance."""
    scores: dict[str, float] = {}
    for n, ranking in enumerate(rankings):
        w = weights[n] if weights is not None else 1.0
        for r, key in enumerate(ranking, 1):
            scores[key] = scores.get(key, 0.0) + w / (k + r)
    order = {key: i for i, key in enumerate(scores)}
    return sorted(((s, key) for key, s in scores.items()), key=lambda p: (-p[0], order[p[1]]))


def hybrid(query: str, by_words: list[str], by_meaning: list[str]) -> list[tuple[float, str]]:
    """``search_history``'s ranking: the words' and meaning's fused, meaning weighted by
    what the query is (``MEANING_WEIGHT`` for plain words, alike when it names a number or
    an identifier)."""
    meaning = 1.0 if _NAMES_AN_IDENTIFIER.search(query) else MEANING_WEIGHT
    return fuse([by_words, by_meaning], RRF_K, [1.0, meaning])


def nearest(query: Vectors, rows: Vectors, k: int) -> list[tuple[int, float]]:
    """The ``k`` rows most like ``query`` (unit vectors: cosine), as (row, score), best
    first; exact, one matrix product (pure)."""

    if not len(rows) or k <= 0:
        return []
    return best(scores(rows, query), k)


def best(scored: Vectors, k: int) -> list[tuple[int, float]]:
    """The ``k`` highest of ``scored``, as (place, score), best first (ties by place)."""
    import numpy as np

    if not len(scored) or k <= 0:
        return []
    top = np.argpartition(-scored, k - 1)[:k] if k < len(scored) else np.arange(len(scored))
    ranked = sorted(top.tolist(), key=lambda i: (-float(scored[i]), i))
    return [(i, float(scored[i])) for i in ranked]


def field_of(seg: Segment) -> str:
    return seg.key[:FIELD_CHARS]


def covered_digest(segs: list[Segment], upto: int) -> str:
    """What the index mark knows the first ``upto`` segments by: a digest of all their keys
    (pure), so an edit anywhere before the mark, not only at its last segment, reads as a
    fork ("" when none)."""
    if not upto:
        return ""
    h = xxhash.xxh3_128()
    for s in segs[:upto]:
        h.update(field_of(s).encode())
    return h.hexdigest()


def conversation_segments(messages: list[Message]) -> list[Segment]:
    """The segments of the conversation's archived loops (``archived_loops``: the closed
    ones, the open one's finished iterations), the newest ``MAX_SEARCH_SEGMENTS``."""
    out = [s for lp in archived_loops(messages) for s in loop_segments(messages, lp)]
    return out[-MAX_SEARCH_SEGMENTS:]


class Carried(NamedTuple):
    """A request's segments as its searches take them (``carried``: once a request, off the
    event loop): each distinct key's first segment, the keys in conversation order, and the
    same keys as an array (what the session's matrix is looked up by)."""

    segments: list[Segment]
    first: dict[str, Segment]
    fields: list[str]
    wanted: Any  # numpy array of S{KEY_BYTES}


def loop_digest(lp: RunLoop, keys: list[str]) -> bytes:
    """What a loop's segments follow from: its place and its messages' content hashes (a
    changed or forked message, or the loop moved, is another digest)."""
    h = xxhash.xxh3_128(f"{lp.index}:{lp.start}:{lp.end}:{lp.final_position}".encode())
    for key in keys[lp.start:lp.end]:
        h.update(key.encode())
    return h.digest()


def cut_bytes(cut: dict[bytes, list[Segment]]) -> int:
    """About what a session's kept cut holds (``Memory.cuts``): each segment's text, key
    and anchor, each loop's entry."""
    return ENTRY_OVERHEAD + sum(96 + sum(len(s.text) + 260 for s in segs)
                                for segs in cut.values())


def carried(messages: list[Message]) -> Carried:
    return cut_carried(messages)[0]


def cut_carried(messages: list[Message], keys: list[str] | None = None,
                kept: dict[bytes, list[Segment]] | None = None
                ) -> tuple[Carried, dict[bytes, list[Segment]]]:
    """The request's segments, and its loops' cut by digest (to keep for the session's
    next request). ``kept``: a previous request's cut, whose loops of the same digest
    (``loop_digest`` over ``keys``, the messages' content hashes) are taken, not cut again."""
    import numpy as np

    cut: dict[bytes, list[Segment]] = {}
    segs: list[Segment] = []
    for lp in archived_loops(messages):
        if keys is None:
            segs.extend(loop_segments(messages, lp))
            continue
        d = loop_digest(lp, keys)
        got = kept.get(d) if kept is not None else None
        cut[d] = got if got is not None else loop_segments(messages, lp)
        segs.extend(cut[d])
    segs = segs[-MAX_SEARCH_SEGMENTS:]
    first: dict[str, Segment] = {}
    for s in segs:
        first.setdefault(field_of(s), s)
    fields = list(first)
    return Carried(segs, first, fields, np.array([f.encode() for f in fields],
                                                 f"S{KEY_BYTES}")), cut


class Model(Protocol):
    """What a piece of memory's work embeds with: the embedded model, or a tenant's through
    its upstream (``remote_embeddings.UpstreamModel``). ``name``: what its vectors are kept
    under (a session's vectors of one model never meet another's); ``inline``: whether a
    search embeds the segments not indexed yet itself (the embedded model: no cost)."""

    name: str
    dim: int
    inline: bool

    async def vectors(self, texts: list[str], op: str) -> Vectors:
        """Unit vectors, a row per text (float32); ``op``: "index" or "search"."""


class Local:
    """The embedded model, in a worker thread, one embedding at a time in the process."""

    inline = True

    def __init__(self, embedder: Embedder, one: asyncio.Semaphore):
        self.embedder, self._one = embedder, one
        self.name, self.dim = embedder.name, embedder.dim

    async def vectors(self, texts: list[str], op: str) -> Vectors:
        async with self._one:
            return await asyncio.to_thread(self.embedder.embed, texts)


@dataclass
class Found:
    """What a search by meaning found: (segment, cosine) best first, or why it found
    nothing (``note``: the words alone answered)."""

    hits: list[tuple[Segment, float]]
    note: str = ""


class Memory:
    """The process's long-term memory: its embedder, the indexings under way, searches."""

    def __init__(self, embedder: Embedder, metrics: Metrics,
                 spawn: Callable[[Coroutine[Any, Any, object]], object], cache_bytes: int,
                 cut_cache_bytes: int = 0,
                 host: Host | None = None, calls: Shares | None = None,
                 given: Callable[[], None] | None = None):
        self.embedder = embedder
        # for tenants' models through their upstreams: the app, the background model
        # calls' shares (the summaries'), and what to tell when a call gives its share back
        self.host, self.calls, self._given = host, calls, given
        self.vectors = VectorCache(cache_bytes)
        # per session, the last request's segments by loop (``carried``): a request cuts
        # only the loops it does not share with the one before (a share of cache_mb)
        self.cuts: ByteLRU[tuple[str, str], dict[bytes, list[Segment]]] = ByteLRU(
            cut_cache_bytes, lambda k, v: cut_bytes(v) + len(k[0]) + len(k[1]) + 100)
        self.metrics = metrics
        self._spawn = spawn
        # the sessions being indexed, each with the turn to index after (None: none yet)
        self._next: dict[tuple[str, str], tuple[RedisStore, str, list[Message],
                                                float | None, Model] | None] = {}
        # one embedding at a time in the process: indexing is background work, and the
        # machine's cores are the requests'
        self._embedding = asyncio.Semaphore(1)

    async def carried(self, namespace: str, session_id: str, messages: list[Message],
                      keys: list[str]) -> Carried:
        """The request's segments (``carried``, in a worker thread), the loops the
        session's last request had cut taken from the process's cache."""
        at = (namespace, session_id)
        kept = self.cuts.get(at)
        got, cut = await asyncio.to_thread(cut_carried, messages, keys, kept)
        self.cuts[at] = cut
        return got

    def local(self) -> Local:
        return Local(self.embedder, self._embedding)

    def model_for(self, job: Job | None) -> Model:
        """What a piece of work embeds with: ``job``'s tenant's model through its upstream
        (policy.memory = "upstream", ``job`` as its summaries would be made for), else the
        embedded one."""
        if job is None or job.policy.memory != "upstream":
            return self.local()
        assert self.host is not None and self.calls is not None
        return UpstreamModel(self.host, job, self.calls, self._given)

    def after_answer(self, store: RedisStore, tenant: str, namespace: str, session_id: str,
                     messages: list[Message], retention_days: float | None,
                     model: Model | None = None) -> None:
        """Index the loops this turn closed, in the background: one indexing a session at
        a time (a turn answered meanwhile is indexed after it, the newest only), at most
        ``MAX_PENDING`` sessions at once (a skipped one is caught up by its next answer)."""
        at = (namespace, session_id)
        model = model or self.local()
        if at in self._next:
            self._next[at] = (store, tenant, messages, retention_days, model)
            return
        if len(self._next) >= MAX_PENDING:
            self.metrics.memory.labels(tenant, "index", "skipped").inc()
            return
        self._next[at] = None
        self._spawn(self._indexing(at, store, tenant, messages, retention_days, model))

    async def _indexing(self, at: tuple[str, str], store: RedisStore, tenant: str,
                        messages: list[Message], retention_days: float | None,
                        model: Model) -> None:
        try:
            while True:
                await self._index(store, tenant, *at, messages, retention_days, model)
                later = self._next.get(at)
                if later is None:
                    return
                self._next[at] = None
                store, tenant, messages, retention_days, model = later
        finally:
            self._next.pop(at, None)

    async def _index(self, store: RedisStore, tenant: str, namespace: str, session_id: str,
                     messages: list[Message], retention_days: float | None,
                     model: Model) -> None:
        try:
            done = await self.index(store, namespace, session_id, messages, retention_days,
                                    model)
            self.metrics.memory.labels(tenant, "index", "ok").inc(done)
        except (StoreError, EmbeddingError) as exc:
            self.metrics.memory.labels(tenant, "index", "failed").inc()
            log.warning("memory: segments not indexed", extra={
                "tenant": tenant, "model": model.name, "error": str(exc)})

    async def index(self, store: RedisStore, namespace: str, session_id: str,
                    messages: list[Message], retention_days: float | None,
                    model: Model | None = None) -> int:
        """Embed and keep the archived loops' segments the session has no vector of; how
        many were embedded. The segments a previous indexing covered (its mark: how many,
        and a digest of their keys, which a fork or an edit before it changes) are not
        looked at again: the archived segments only grow at their end (a step finished, a
        loop closed), so a long task's answers each look up their new steps alone. An
        embedding that fails midway keeps the batches before it, and is raised."""
        import numpy as np

        model = model or self.local()
        name = model.name
        segs = await asyncio.to_thread(lambda: [s for lp in archived_loops(messages)
                                                for s in loop_segments(messages, lp)])
        upto, tail = await store.memory_mark(namespace, session_id, name)
        start = upto if 0 < upto <= len(segs) and await asyncio.to_thread(
            covered_digest, segs, upto) == tail else 0
        todo: dict[str, int] = {}  # each new field's first segment
        for n in range(start, len(segs)):
            todo.setdefault(field_of(segs[n]), n)
        fields = list(todo)
        missing = [fields[i] for i in await store.missing_vectors(
            namespace, session_id, name, fields)]
        taken = missing[:MAX_INDEX_SEGMENTS]
        # how far the conversation is indexed: up to the first segment left out
        upto = todo[missing[len(taken)]] if len(taken) < len(missing) else len(segs)
        mark = (upto, await asyncio.to_thread(covered_digest, segs, upto))
        rows = []
        failed: EmbeddingError | None = None
        for i in range(0, len(taken), EMBED_BATCH):
            try:
                rows.append(await model.vectors([segs[todo[f]].text
                                                 for f in taken[i:i + EMBED_BATCH]], "index"))
            except EmbeddingError as exc:
                failed = exc
                break
        if failed is not None:
            # the batches that landed are kept (paid for: an upstream's tokens), the mark
            # up to the first segment not embedded; the failure still said
            done = sum(len(r) for r in rows)
            if not done:
                raise failed
            upto = todo[taken[done]]
            taken = taken[:done]
            mark = (upto, await asyncio.to_thread(covered_digest, segs, upto))
        packed = await asyncio.to_thread(
            lambda: block(taken, np.concatenate(rows)) if rows else b"")
        await store.put_vectors(namespace, session_id, name, taken, packed, mark,
                                retention_days)
        if failed is not None:
            raise failed
        return len(taken)

    async def search(self, store: RedisStore | None, namespace: str, session_id: str,
                     query: str, request: Carried, k: int = CANDIDATES,
                     model: Model | None = None) -> Found:
        """Of the segments the request carries (``carried``: no other segment is read),
        those nearest ``query`` by meaning, under ``SEARCH_TIMEOUT_S``."""
        try:
            async with asyncio.timeout(SEARCH_TIMEOUT_S):
                return await self._search(store, namespace, session_id, query, request, k,
                                          model or self.local())
        except TimeoutError:
            return Found([], f"the search by meaning took over {SEARCH_TIMEOUT_S:g} s")
        except EmbeddingError as exc:
            return Found([], str(exc))
        except Exception as exc:  # noqa: BLE001 - fail open: the words answer, said so
            log.exception("memory: the search by meaning failed")
            return Found([], f"the search by meaning failed ({type(exc).__name__})")

    async def session_vectors(self, store: RedisStore, namespace: str, session_id: str,
                              model: Model | None = None) -> SessionVectors:
        """The session's stored vectors as one matrix: from the process's cache while Redis
        holds the same blocks (asked by name only), the new blocks read and added, and read
        whole (one HGETALL) when not cached or a block is gone (the session expired)."""
        model = model or self.local()
        name, dim = model.name, model.dim
        at = (namespace, session_id, name)
        kept = self.vectors.get(at)
        got: SessionVectors | None = None
        if kept is not None:
            names = await store.vector_block_names(namespace, session_id, name)
            if names == kept.blocks:
                return kept
            new = sorted(names - kept.blocks)
            if kept.blocks <= names:
                more = await store.vector_blocks(namespace, session_id, name, new)
                if len(more) == len(new):
                    got = await asyncio.to_thread(assemble, more, dim, kept)
        if got is None:
            blocks = await store.vector_blocks(namespace, session_id, name)
            got = await asyncio.to_thread(assemble, blocks, dim)
        self.vectors.put(at, got)
        return got

    async def _search(self, store: RedisStore | None, namespace: str, session_id: str,
                      query: str, request: Carried, k: int, model: Model) -> Found:
        import numpy as np

        if not request.segments:
            return Found([])
        note = ""
        vectors = empty(model.dim)
        if store is not None:
            try:
                vectors = await self.session_vectors(store, namespace, session_id, model)
            except StoreError as exc:
                note = f"stored vectors unavailable ({exc})"

        def plan() -> tuple[Any, list[str]]:
            # the matrix's rows of the segments this request carries (no other's is scored)
            rows, held = rows_of(vectors, request.wanted)
            return rows, [request.fields[i] for i in np.flatnonzero(~held).tolist()]

        def ranked(rows: Any, q: Vectors, inline: Vectors, embedded: list[str]
                   ) -> list[tuple[Segment, float]]:
            stored = scores(vectors.rows, q)[rows] if len(rows) else np.zeros(0, np.float32)
            scored = [(score, vectors.keys[rows[r]].decode()) for r, score in best(stored, k)]
            scored += [(score, embedded[r]) for r, score in nearest(q, inline, k)]
            scored.sort(key=lambda p: -p[0])
            return [(request.first[f], score) for score, f in scored[:k]]

        def indexed() -> tuple[Any, list[str], list[tuple[Segment, float]] | None]:
            # every segment indexed (the usual case): the query embedded and the rows
            # ranked in the same worker thread, not queued behind an indexing's batch
            rows, absent = plan()
            if absent:
                return rows, absent, None
            q = self.embedder.embed([query])
            return rows, absent, ranked(rows, q[0], q[1:], [])

        if not model.inline:
            # a tenant's model: the query alone goes to it; what is not indexed yet is
            # searched by words alone until its indexing lands
            q = await model.vectors([query], "search")
            rows, absent = await asyncio.to_thread(plan)
            if absent:
                note = f"{len(absent)} segments not indexed yet"
            return Found(await asyncio.to_thread(ranked, rows, q[0], q[1:], []), note)
        rows, absent, hits = await asyncio.to_thread(indexed)
        if hits is not None:
            return Found(hits, note)
        embedded = absent[-INLINE_EMBED:]  # the newest: likeliest not indexed yet
        if len(absent) > len(embedded):
            note = f"{len(absent) - len(embedded)} older segments not indexed yet"
        inline = await model.vectors([query, *(request.first[f].text for f in embedded)],
                                     "search")
        return Found(await asyncio.to_thread(ranked, rows, inline[0], inline[1:], embedded),
                     note)
