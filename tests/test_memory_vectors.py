"""A session's vectors kept in the process as one matrix (pipeline/vectors.py) and searched
exactly (``Memory.search``): the same hits as an exact search over the request's own
segments, on two replicas that share one Redis while answers keep adding blocks, and each
stored block read once by each."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import redis

from runloop_proxy.config import StoreSection
from runloop_proxy.history.store import RedisStore
from runloop_proxy.ops.metrics import Metrics
from runloop_proxy.pipeline.embeddings import KEY_BYTES, StaticEmbedder, block
from runloop_proxy.pipeline.memory import Memory, carried
from runloop_proxy.pipeline.memory import conversation_segments as memory_segments
from runloop_proxy.pipeline.vectors import assemble, rows_of

NAMESPACE = "pt-" + "5" * 61  # a pass-through caller's namespace: its key's digest
SESSION = "sess_" + "3" * 59
SYSTEM = "You are the airline's support agent. Verify the passenger before any change."
CITIES = ["Lisbon", "Porto", "Denver", "Austin", "Boston", "Seattle", "Miami", "Atlanta"]
QUERIES = ["the refund for the cancelled flight", "which seat did I upgrade to",
           "baggage fee for my second checked bag", "change the passenger's name",
           "Seattle hotel voucher after the delay"]


def _loop(i: int) -> list[dict[str, Any]]:
    """One closed support loop: a request, a tool call and its result, the reply; each
    loop's ids and cities its own (reservation ids as tau2's, 6 characters)."""
    rid, city = f"{(i * 7919) % 1_000_000:06X}", CITIES[i % len(CITIES)]
    call = f"call_{i:04d}Xq7LmT2"
    return [
        {"role": "user", "content": [
            f"Please move reservation {rid} to the {city} flight next week.",
            f"I was charged twice for reservation {rid}; I want a refund of the $89 fee.",
            f"Can you add a second checked bag to {rid}? Flying to {city}.",
            f"Upgrade me to business on {rid}, seat {i % 30 + 1}A if free.",
        ][i % 4]},
        {"role": "assistant", "content": "Let me look the reservation up.", "tool_calls": [
            {"id": call, "type": "function", "function": {
                "name": "get_reservation_details",
                "arguments": f'{{"reservation_id": "{rid}"}}'}}]},
        {"role": "tool", "tool_call_id": call,
         "content": f'{{"reservation_id": "{rid}", "origin": "JFK", "destination": "{city}", '
                    f'"cabin": "economy", "passengers": [{{"first_name": "Ava", '
                    f'"last_name": "Nguyen{i}"}}], "total_baggages": {i % 3}}}'},
        {"role": "assistant", "content": f"Done: reservation {rid} is updated for {city}; "
                                         f"your confirmation is on its way."},
    ]


def _conversation(loops: range) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, *(m for i in loops for m in _loop(i)),
            {"role": "user", "content": "One more thing."}]


class _Counting:
    """The real embedded model, counting the texts it is given."""

    def __init__(self, real: StaticEmbedder):
        self.real, self.name, self.dim, self.texts = real, real.name, real.dim, 0

    def embed(self, texts: list[str]) -> Any:
        self.texts += len(texts)
        return self.real.embed(texts)


class _Store(RedisStore):
    """A real store that counts the vector blocks it reads, and whole reads."""

    whole = 0
    blocks_read = 0

    async def vector_blocks(self, namespace: str, session_id: str, model: str,
                            names: list[str] | None = None) -> dict[str, bytes]:
        got = await super().vector_blocks(namespace, session_id, model, names)
        self.whole += names is None
        self.blocks_read += len(got)
        return got


def _exact(embedder: StaticEmbedder, query: str, messages: list[dict[str, Any]], k: int
           ) -> list[tuple[str, float]]:
    """The obvious search: every distinct segment the request carries embedded now, scored
    against the query, best first."""
    c = carried(messages)
    rows = embedder.embed([c.first[f].text for f in c.fields])
    q = embedder.embed([query])[0]
    scored = sorted(((float(r @ q), f) for r, f in zip(rows, c.fields, strict=True)),
                    key=lambda p: -p[0])
    return [(f, s) for s, f in scored[:k]]


def test_a_search_is_the_exact_search_of_the_request_and_reads_each_block_once(
        redis_url: str) -> None:
    """Replica A answers a session whose history grows over four answers (each indexing a
    block of vectors); replica B, which indexes nothing, searches after each. Every search
    of both equals the exact search over the segments the request carries (a request that
    leaves loop 1 out never gets its stored rows); B reads the blocks whole once, then
    each new block once, and embeds only the query. With the session's keys gone (its
    retention over) B keeps none of its rows. Planted, red: no cache (every search reads
    the blocks whole), the cache served without asking Redis which blocks there are (B
    embeds the new segments itself), the matrix's keys left unsorted (hits differ from
    the exact search), the request's mask gone (loop 1's rows found), rows kept after the
    session's keys are gone."""
    real = StaticEmbedder()
    k = 8
    prefix = f"test-vectors-{id(real)}"
    counting = [_Counting(real), _Counting(real)]

    async def go() -> None:
        stores = [_Store(redis_url, StoreSection(key_prefix=prefix), Metrics())
                  for _ in range(2)]
        a, b = (Memory(counting[n], stores[n].metrics, asyncio.ensure_future, 8 << 20)
                for n in range(2))
        stored = 0
        try:
            for answered in (3, 6, 10, 14):
                history = _conversation(range(answered))
                assert await a.index(stores[0], NAMESPACE, SESSION, history, None) > 0
                stored += 1
                without_one = [m for m in history if m not in _loop(1)]
                for request in (history, without_one):
                    cut = carried(request)
                    for query in QUERIES:
                        want = _exact(real, query, request, k)
                        for memory, store in ((a, stores[0]), (b, stores[1])):
                            before = memory.embedder.texts  # type: ignore[attr-defined]
                            found = await memory.search(store, NAMESPACE, SESSION, query,
                                                        cut, k)
                            assert found.note == ""
                            got = [(s.key[:KEY_BYTES], c) for s, c in found.hits]
                            assert [f for f, _ in got] == [f for f, _ in want], query
                            assert np.allclose([c for _, c in got], [c for _, c in want],
                                               atol=1e-5)
                            assert memory.embedder.texts == before + 1  # type: ignore[attr-defined]
            assert (stores[1].whole, stores[1].blocks_read) == (1, stored)
            # the session's retention over: its keys gone, its rows with them
            r = redis.Redis.from_url(redis_url)
            for key in r.scan_iter(match=f"{prefix}:*"):
                r.delete(key)
            history = _conversation(range(14))
            before = counting[1].texts
            found = await b.search(stores[1], NAMESPACE, SESSION, QUERIES[0], carried(history))
            assert counting[1].texts == before + 1 + len(carried(history).fields)
            kept = b.vectors.get((NAMESPACE, SESSION, real.name))
            assert kept is not None and len(kept.keys) == 0
        finally:
            r = redis.Redis.from_url(redis_url)
            for key in r.scan_iter(match=f"{prefix}:*"):
                r.delete(key)
            for store in stores:
                await store.client.aclose()

    asyncio.run(go())


def _unit(seed: int, n: int) -> Any:
    rows = np.random.default_rng(seed).standard_normal((n, 8)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


@pytest.mark.parametrize(("blocks", "wanted"), [
    # keys out of order across blocks, one stored twice (two indexings at once), one absent
    ([["f" * 16, "a" * 16], ["c" * 16, "a" * 16]], ["a" * 16, "b" * 16, "c" * 16, "f" * 16]),
    ([["9d2c41e07b3f5a68", "0e5b7d13c9a2f846"]], ["0e5b7d13c9a2f846", "zz" * 8]),
    ([[]], ["0e5b7d13c9a2f846"]),
    ([], ["0e5b7d13c9a2f846"]),
])
def test_a_matrix_finds_each_stored_row_by_its_key(blocks: list[list[str]],
                                                   wanted: list[str]) -> None:
    """Blocks assembled into one matrix (whole, and a first block then the rest added to
    it) give each wanted key its own stored row, the first stored where a key is twice, and
    say which keys are absent. Planted, red: the keys not sorted (``np.unique`` replaced by
    a plain concatenation), the last copy of a key kept."""
    stored: dict[str, Any] = {}
    named: dict[str, bytes] = {}
    for n, keys in enumerate(blocks):
        rows = _unit(n, len(keys))
        for key, row in zip(keys, rows, strict=True):
            stored.setdefault(key, row)
        named[f"{n}:{n:08x}"] = block(keys, rows) if keys else b""
    first = dict(list(named.items())[:1])
    rest = dict(list(named.items())[1:])
    for matrix in (assemble(named, 8), assemble(rest, 8, assemble(first, 8))):
        assert matrix.rows.flags.c_contiguous and matrix.blocks == frozenset(named)
        rows, held = rows_of(matrix, np.array([w.encode() for w in wanted], f"S{KEY_BYTES}"))
        assert held.tolist() == [w in stored for w in wanted]
        got = matrix.rows[rows]
        want = [stored[w] for w in wanted if w in stored]
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert np.array_equal(g, w)


def test_a_sessions_kept_cut_is_the_fresh_cut_and_cuts_only_what_changed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory.carried keeps a session's segments by loop between its requests: each
    request's segments equal a fresh cut of its messages (``carried``), whatever the last
    request was — the same with a turn more, a past message edited (a fork), a loop
    moved by a message inserted before it — and only the loops whose digest is new are cut
    again. Red with: the digest over the loop's place alone (planted: the keys left out:
    the edited reply's old text comes back), the cut never kept (planted: ``kept``
    ignored: every loop cut again, red on the count)."""
    from runloop_proxy.conversation.messages import message_hash
    from runloop_proxy.ops.metrics import Metrics
    from runloop_proxy.pipeline import memory as memory_mod
    from runloop_proxy.pipeline.memory import Memory, carried

    cuts: list[int] = []
    real = memory_mod.loop_segments

    def counted(messages: Any, lp: Any, *a: Any) -> Any:
        cuts.append(lp.index)
        return real(messages, lp, *a)
    monkeypatch.setattr(memory_mod, "loop_segments", counted)
    mem = Memory(StaticEmbedder(), Metrics(), asyncio.ensure_future, 1 << 20, 8 << 20)

    def request(messages: list[dict[str, Any]]) -> Any:
        keys = [message_hash(m) for m in messages]
        cuts.clear()
        got = asyncio.run(mem.carried("acme", "n:s", messages, keys))
        fresh = cuts.copy()
        cuts.clear()
        want = carried(messages)
        assert got.segments == want.segments and got.fields == want.fields
        return fresh

    base = _conversation(range(6))
    assert request(base) == list(range(6))  # nothing kept yet: every loop cut
    more = [*base[:-1], {"role": "user", "content": "One more thing."},
            {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Bye."}]
    assert request(more) == [6]  # a turn more: only the loop it closed
    edited = [dict(m) for m in more]
    edited[8] = {**edited[8], "content": "Done: reservation moved; no confirmation."}
    assert request(edited) == [1]  # loop 1's reply edited: that loop alone
    moved = [edited[0], {"role": "user", "content": "Hello."},
             {"role": "assistant", "content": "Hi."}, *edited[1:]]
    assert len(request(moved)) == 8  # every loop moved: each cut again


class _Asking(RedisStore):
    """A real store that records how many segment keys each indexing looks up."""

    asked: list[int]

    async def missing_vectors(self, namespace: str, session_id: str, model: str,
                              fields: list[str]) -> list[int]:
        self.asked.append(len(fields))
        return await super().missing_vectors(namespace, session_id, model, fields)


TASK_OPENING: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a software engineer; use bash."},
    {"role": "user", "content": "Route requests to their handlers by path."}]


def _step(n: int) -> list[dict[str, Any]]:
    """A coding agent's step: its thought and bash call, and the command's output."""
    call = f"call_{n:03d}Rk5vN8pW"
    return [{"role": "assistant", "content": f"THOUGHT: look at module {n} next.",
             "tool_calls": [{"id": call, "type": "function", "function": {
                 "name": "bash", "arguments": f'{{"command": "sed -n 1,40p src/mod{n}.py"}}'}}]},
            {"role": "tool", "tool_call_id": call,
             "content": f"def handler_{n}(request):\n    return route_{n}(request.path)\n"}]


def test_a_long_tasks_answers_each_look_up_only_their_new_steps(redis_url: str) -> None:
    """One task's answers, a step each (a coding agent's session: one loop, never closed
    until the end): each indexing looks up the segments of the step its answer finished and
    no more, and embeds them, and the task's closing reply adds its own alone; a fork (back
    to an earlier step, its output edited) looks its steps up again and embeds the edit. Catches:
    the mark ignored (planted: ``start = 0``, red: every answer looks up the whole task, 1,
    4, 7, 10 ...), the mark counting loops and the open one never (the mark before: red,
    the same)."""
    real = StaticEmbedder()
    counting = _Counting(real)

    async def go() -> list[int]:
        store = _Asking(redis_url, StoreSection(key_prefix=f"test-task-{id(real)}"), Metrics())
        store.asked = []
        memory = Memory(counting, store.metrics, asyncio.ensure_future, 8 << 20)
        task = list(TASK_OPENING)
        embedded = []
        try:
            for n in range(6):  # the answer: step n's call, its output sent with the next
                task += _step(n)
                embedded.append(await memory.index(store, "acme", "n:task", task[:-1], None))
            task.append({"role": "assistant", "content": "Routing is in place."})
            embedded.append(await memory.index(store, "acme", "n:task", task, None))
            # the client goes back to step 2, its output edited, and the agent goes on
            forked = [*task[:7], {**task[7], "content": "sed: can't read src/mod2.py"},
                      *_step(9)]
            embedded.append(await memory.index(store, "acme", "n:task", forked[:-1], None))
            return [*store.asked, *embedded]
        finally:
            async for k in store.client.scan_iter(match=f"test-task-{id(real)}:*"):
                await store.client.delete(k)
            await store.client.aclose()

    got = asyncio.run(go())
    asked, embedded = got[:8], got[8:]
    # the first answer: the task alone (the call it made is not finished); then each
    # answer the step before it, three segments (thought, call, output); the reply: the
    # last step and itself; the fork: its task and three steps again (its new step's call
    # not finished)
    assert asked == [1, 3, 3, 3, 3, 3, 4, 10]
    assert embedded == [1, 3, 3, 3, 3, 3, 4, 1]
    assert counting.texts == sum(embedded)


def test_a_step_edited_before_the_marks_last_segment_is_indexed(redis_url: str) -> None:
    """The mark trusts the segments before it by its last segment's key alone: a client
    whose copy of an earlier step differs (a regenerated thought with the same call and
    output, an edited or cleared tool result) keeps the count and the last key, and its new
    segment must still be indexed (else a tenant's model never finds it by meaning, the
    embedded one embeds it inline at every search)."""
    real = StaticEmbedder()

    async def go() -> tuple[list[int], list[int]]:
        prefix = f"test-edit-{id(real)}"
        store = _Asking(redis_url, StoreSection(key_prefix=prefix), Metrics())
        store.asked = []
        memory = Memory(real, store.metrics, asyncio.ensure_future, 8 << 20)
        task = list(TASK_OPENING)
        try:
            for n in range(4):
                task += _step(n)
            # the answer: step 4's call; steps 0-3 archived
            await memory.index(store, "acme", "n:edit", [*task, *_step(4)[:1]], None)
            # the same task, step 1's thought as the client now sends it (regenerated)
            edited = [*task[:4], {**task[4], "content": "THOUGHT: the router lives in "
                                  "module 1; read it."}, *task[5:]]
            await memory.index(store, "acme", "n:edit", [*edited, *_step(4)[:1]], None)
            segs = memory_segments(edited)
            fields = [s.key[:KEY_BYTES] for s in segs]
            missing = await store.missing_vectors("acme", "n:edit", real.name, fields)
            return store.asked, missing
        finally:
            async for k in store.client.scan_iter(match=f"{prefix}:*"):
                await store.client.delete(k)
            await store.client.aclose()

    asked, missing = asyncio.run(go())
    assert missing == []  # the edited thought has its vector


class _FailsOnce:
    """A tenant's model through its upstream (as ``Memory`` sees one) whose second call
    fails once (a 429, the day's embedding tokens spent mid-indexing), then answers."""

    inline = False

    def __init__(self, real: StaticEmbedder):
        self.real, self.name, self.dim = real, "upstream-" + real.name, real.dim
        self.calls, self.embedded = 0, 0

    async def vectors(self, texts: list[str], op: str) -> Any:
        self.calls += 1
        if self.calls == 2:
            from runloop_proxy.errors import EmbeddingError
            raise EmbeddingError("the embedding call answered 429")
        self.embedded += len(texts)
        return self.real.embed(texts)


def test_an_indexing_failed_midway_keeps_the_batches_it_paid_for(redis_url: str) -> None:
    """An indexing whose embedding fails after some batches landed keeps those (and its
    mark up to them): the next answer embeds only what is left, not every batch again (an
    upstream model's tokens, spent again at each answer while the failure lasts)."""
    real = StaticEmbedder()

    async def go() -> tuple[int, int, list[int]]:
        prefix = f"test-midway-{id(real)}"
        store = _Asking(redis_url, StoreSection(key_prefix=prefix), Metrics())
        store.asked = []
        memory = Memory(real, store.metrics, asyncio.ensure_future, 8 << 20)
        model = _FailsOnce(real)
        task = list(TASK_OPENING)
        for n in range(60):  # 1 + 3 * 60 segments: three batches of 64
            task += _step(n)
        task += _step(60)[:1]
        try:
            from runloop_proxy.errors import EmbeddingError
            with pytest.raises(EmbeddingError):
                await memory.index(store, "acme", "n:midway", task, None, model)
            await memory.index(store, "acme", "n:midway", task, None, model)
            segs = memory_segments(task)
            missing = await store.missing_vectors(
                "acme", "n:midway", model.name, [s.key[:KEY_BYTES] for s in segs])
            return model.embedded, len({s.key for s in segs}), missing
        finally:
            async for k in store.client.scan_iter(match=f"{prefix}:*"):
                await store.client.delete(k)
            await store.client.aclose()

    embedded, distinct, missing = asyncio.run(go())
    assert missing == []
    assert embedded == distinct  # each segment embedded once: the first batch kept
