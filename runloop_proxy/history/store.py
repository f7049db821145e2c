"""The history store: every session's complete, never-compressed history, in Redis.

Keys of one session share the hash tag ``{tenant:session}`` so they live in one Redis Cluster slot
and every update is a single atomic Lua script::

    P:{t:s}:meta      hash   head branch, its length and chain tip, timestamps
    P:{t:s}:msg       hash   message hash -> canonical JSON (content-addressed)
    P:{t:s}:ts        hash   message hash -> first seen (ms)
    P:{t:s}:tok       hash   message hash -> token count
    P:{t:s}:tool      hash   tool_call_id -> hashes of every tool result with that id (ids repeat)
    P:{t:s}:b:N       list   branch N: message hashes in order
    P:{t:s}:c:N       list   branch N: chain hashes (sha1 of previous chain + message hash)
    P:{t:s}:branches  hash   N -> {parent, fork_at, created}
    P:{t:s}:int       hash   anchor message hash -> proxy-owned tool exchange spliced before it
    P:{t:s}:rec       list   compression records (seed 004 §3.4)
    P:t:<tenant>:sessions  zset  session -> last use (for listing; a different slot)

Reconciliation costs O(new messages): the proxy sends the chain hashes and bodies from the
length it last saw (a hint); the script answers "need" when the hint was wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from ..config import StoreSection
from ..conversation.messages import Message, canonical_json, content_hash
from ..errors import StoreError, StoreLimitExceeded
from ..ops import logs
from ..ops.metrics import Metrics
from .scripts import APPEND_LUA, SYNC_LUA

log = logs.get("store")
_SAFE_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
EMPTY_CHAIN = ""
SESSION_CACHE_SIZE = 50_000
CHAIN_CACHE_SIZE = 2_000
MAX_RECORDS = 1_000
INDEX_EVERY_S = 60.0
BATCH = 256
MAX_QUEUE = 100_000
MAX_ATTEMPTS = 3




def chain_next(prev: str, msg_hash: str) -> str:
    return hashlib.sha1((prev + msg_hash).encode()).hexdigest()


class Prepared(NamedTuple):
    """A message ready for the store: its hash, stored body, tool id and token count."""

    hash: str
    body: bytes
    tool_call_id: str
    tokens: int | None
    encoding: str = ""  # the tiktoken encoding the count was made with


def prepare(msg: Message, tokens: int | None = None) -> Prepared:
    body = canonical_json(msg)
    tid = msg.get("tool_call_id") if msg.get("role") == "tool" else ""
    return Prepared(content_hash(body), body, tid if isinstance(tid, str) else "", tokens)


@dataclass
class _Job:
    tenant: str
    session_id: str
    items: list[Prepared]
    chains: list[str]
    retention_days: float | None
    hint: int = 0
    retry_hint: int | None = None
    attempts: int = 0

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.session_id)

    def extended_by(self, other: _Job) -> bool:
        n = len(self.items)
        return len(other.items) >= n and other.chains[n] == self.chains[n] \
            and other.retention_days == self.retention_days


@dataclass
class _Cached:
    length: int
    chain: str
    internal: dict[str, Any]


@dataclass
class SyncResult:
    length: int
    branch: str
    forked: bool
    internal: dict[str, list[Message]] = field(default_factory=dict)


@dataclass
class SessionView:
    session_id: str
    tenant: str
    head: str
    messages: list[Message]
    branches: dict[str, dict[str, Any]]
    records: list[dict[str, Any]]
    created_ms: int
    updated_ms: int
    internal: dict[str, list[Message]]


def session_slug(session_id: str) -> str:
    if _SAFE_ID.fullmatch(session_id):
        return session_id
    return "h-" + hashlib.sha256(session_id.encode()).hexdigest()[:32]


class RedisStore:
    """Redis-backed HistoryStore. Every failure becomes StoreError; the caller fails open."""

    def __init__(self, url: str, cfg: StoreSection, metrics: Metrics):
        self.cfg = cfg
        self.metrics = metrics
        timeout = cfg.timeout_s
        if url.startswith("redis+cluster://"):
            self.client: Any = RedisCluster.from_url(
                "redis://" + url.removeprefix("redis+cluster://"), socket_timeout=timeout,
                socket_connect_timeout=timeout)
        else:
            # A blocking pool: a burst waits for a connection instead of failing.
            pool = aioredis.BlockingConnectionPool.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout, max_connections=64,
                timeout=timeout)
            # no retries inside redis-py: a failure marks the store down and requests fail open
            self.client = aioredis.Redis(connection_pool=pool, retry=Retry(NoBackoff(), 0))
        self._sync = self.client.register_script(SYNC_LUA)
        self._append = self.client.register_script(APPEND_LUA)
        self._sessions: OrderedDict[tuple[str, str], _Cached] = OrderedDict()
        self._chains: OrderedDict[tuple[str, str], tuple[list[str], list[str]]] = OrderedDict()
        self._indexed: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._down_until = 0.0
        self._queue: list[_Job] = []
        self._queued: dict[tuple[str, str], _Job] = {}
        self._in_flight = 0
        self._wake = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self._scripts_loaded = False

    # -- health ---------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    async def _call(self, op: str, coro: Any) -> Any:
        if not self.available:
            coro.close()
            raise StoreError(f"store marked down, retrying in "
                             f"{self._down_until - time.monotonic():.1f}s")
        started = time.perf_counter()
        try:
            result = await coro
        except (RedisError, OSError, TimeoutError) as exc:
            self.metrics.store_errors.labels(op).inc()
            self.metrics.store_up.set(0)
            self._down_until = time.monotonic() + self.cfg.retry_after_s
            raise StoreError(f"redis {op} failed: {type(exc).__name__}: {exc}") from exc
        self.metrics.store_latency.labels(op).observe(time.perf_counter() - started)
        self.metrics.store_up.set(1)
        return result

    async def ping(self) -> bool:
        try:
            await self._call("ping", self.client.ping())
        except StoreError as exc:
            log.warning("store unreachable", extra={"error": str(exc)})
            return False
        return True

    async def close(self) -> None:
        await self.drain()
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        await self.client.aclose()

    # -- keys -----------------------------------------------------------------------------

    def prefix(self, tenant: str, session_id: str) -> str:
        return f"{self.cfg.key_prefix}:{{{tenant}:{session_slug(session_id)}}}"

    def _index_key(self, tenant: str) -> str:
        return f"{self.cfg.key_prefix}:t:{tenant}:sessions"

    def _ttl_ms(self, retention_days: float | None) -> int:
        return int((retention_days or self.cfg.retention_days) * 86_400_000)

    def _check_sizes(self, items: list[Prepared]) -> None:
        for it in items:
            if len(it.body) > self.cfg.max_message_bytes:
                raise StoreLimitExceeded(
                    f"a message of {len(it.body)} bytes exceeds the store's max_message_bytes "
                    f"({self.cfg.max_message_bytes})")

    # -- writes ---------------------------------------------------------------------------

    async def sync(self, tenant: str, session_id: str, items: list[Prepared],
                   retention_days: float | None = None) -> SyncResult:
        """Make the session's head branch hold ``items`` (append, keep, or fork), now."""
        job = self._job(tenant, session_id, items, retention_days)
        for _ in range(3):
            reply = await self._call("sync", self._run_one(job))
            result = self._settle(job, reply)
            if result is not None:
                return result
        raise StoreError("sync did not converge")

    def submit(self, tenant: str, session_id: str, items: list[Prepared],
               retention_days: float | None = None) -> None:
        """Queue a sync off the request path (write-behind, pipelined, coalesced per session).

        A later job of the same session that extends an earlier queued one replaces it: the
        conversation it carries holds the earlier one whole.
        """
        job = self._job(tenant, session_id, items, retention_days)
        key = (tenant, session_id)
        queued = self._queued.get(key)
        if queued is not None and queued.extended_by(job):
            queued.items, queued.chains = job.items, job.chains
        else:
            self._queue.append(job)
            self._queued[key] = job
        if len(self._queue) > MAX_QUEUE:
            dropped = self._queue.pop(0)
            self._queued.pop(dropped.key, None)
            self.metrics.store_errors.labels("queue_overflow").inc()
        self._wake.set()

    def _job(self, tenant: str, session_id: str, items: list[Prepared],
             retention_days: float | None) -> _Job:
        key = (tenant, session_id)
        chains = [EMPTY_CHAIN]
        known = self._chains.get(key)
        if known is not None:
            # reuse the chain of the prefix this session sent last time (O(new) hashing)
            hashes, cached = known
            k = 0
            limit = min(len(hashes), len(items))
            while k < limit and hashes[k] == items[k].hash:
                k += 1
            chains = cached[:k + 1]
        for it in items[len(chains) - 1:]:
            chains.append(chain_next(chains[-1], it.hash))
        self._chains[key] = ([it.hash for it in items], chains)
        self._chains.move_to_end(key)
        if len(self._chains) > CHAIN_CACHE_SIZE:
            self._chains.popitem(last=False)
        return _Job(tenant, session_id, items, chains, retention_days)

    def _hint(self, job: _Job) -> int:
        cached = self._sessions.get(job.key)
        if cached is None:
            return 0
        n = cached.length
        return n if n <= len(job.items) and job.chains[n] == cached.chain else 0

    def _args(self, job: _Job) -> list[Any]:
        """The SYNC script's arguments, from the re-send hint or the session cache's."""
        hint = job.retry_hint if job.retry_hint is not None else self._hint(job)
        items, chains = job.items, job.chains
        self._check_sizes(items[hint:])
        args: list[Any] = [self.prefix(job.tenant, job.session_id), hint, len(items),
                           "".join(chains[hint + 1:]), "".join(it.hash for it in items[hint:]),
                           _now_ms(), self._ttl_ms(job.retention_days),
                           self.cfg.max_messages_per_session, self.cfg.max_branches,
                           job.session_id, chains[hint]]
        for it in items[hint:]:
            args += [it.body, it.tool_call_id, _tokens_field(it)]
        job.hint = hint
        return args

    async def _run_one(self, job: _Job) -> Any:
        args = self._args(job)
        reply = await self._sync(keys=[args[0] + ":meta"], args=args)
        await self._index(job.tenant, job.session_id)
        return reply

    def _settle(self, job: _Job, reply: Any) -> SyncResult | None:
        """Apply a script reply: cache the new head; None when the job must be re-sent."""
        status = _s(reply[0])
        if status == "ok":
            length = int(reply[1])
            internal = _pairs(reply[5])
            chain = job.chains[length] if length <= len(job.items) else ""
            self._remember(job.key, length, chain, internal)
            return SyncResult(length, _s(reply[2]), reply[3] in (b"1", "1"), internal)
        if status == "limit":
            raise StoreLimitExceeded(f"session {_s(reply[1])} limit reached")
        stored = int(reply[1])
        job.retry_hint = stored if 0 < stored <= len(job.items) and stored != job.hint else 0
        return None

    async def start(self) -> None:
        self._flusher = asyncio.create_task(self._flush_forever())

    async def drain(self, timeout: float = 5.0) -> None:
        """Wait until queued writes are flushed (or the store gives up)."""
        deadline = time.monotonic() + timeout
        while (self._queue or self._in_flight) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def _flush_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                if not self.available:
                    await asyncio.sleep(max(0.05, self._down_until - time.monotonic()))
                    continue
                batch, self._queue = self._queue[:BATCH], self._queue[BATCH:]
                for job in batch:
                    if self._queued.get(job.key) is job:
                        del self._queued[job.key]
                self._in_flight = len(batch)
                try:
                    await self._flush(batch)
                finally:
                    self._in_flight = 0

    async def _flush(self, batch: list[_Job]) -> None:
        try:
            replies = await self._call("sync", self._pipeline(batch))
        except StoreError as exc:
            # Keep the newest job per session for when Redis is back: the next request of a
            # session carries the whole conversation anyway, so the history heals.
            log.warning("write-behind flush failed; will retry",
                        extra={"jobs": len(batch), "error": str(exc)})
            for job in batch:
                if job.key not in self._queued and job.attempts < MAX_ATTEMPTS:
                    job.attempts += 1
                    self._queue.append(job)
                    self._queued[job.key] = job
            return
        for job, reply in zip(batch, replies, strict=True):
            try:
                if isinstance(reply, Exception):
                    raise StoreError(str(reply))
                if self._settle(job, reply) is None and job.attempts < MAX_ATTEMPTS:
                    job.attempts += 1
                    self._queue.append(job)
            except StoreError as exc:
                self.metrics.store_errors.labels("sync").inc()
                log.warning("history not stored", extra={"tenant": job.tenant,
                                                         "error": str(exc)})

    async def _pipeline(self, batch: list[_Job]) -> list[Any]:
        if isinstance(self.client, RedisCluster):
            return list(await asyncio.gather(*[self._run_one(j) for j in batch],
                                             return_exceptions=True))
        # EVALSHA straight into the pipeline: redis-py's script objects would ask
        # SCRIPT EXISTS on every flush, one more round trip each time.
        if not self._scripts_loaded:
            await self.client.script_load(SYNC_LUA)
            self._scripts_loaded = True
        pipe = self.client.pipeline(transaction=False)
        ok: list[_Job] = []
        errors: dict[int, Exception] = {}
        for i, job in enumerate(batch):
            try:
                args = self._args(job)
            except StoreLimitExceeded as exc:
                errors[i] = exc
                continue
            pipe.evalsha(self._sync.sha, 1, args[0] + ":meta", *args)
            ok.append(job)
        results = await pipe.execute(raise_on_error=False) if ok else []
        if any(isinstance(r, NoScriptError) for r in results):
            self._scripts_loaded = False  # Redis lost its scripts (restart): reload, re-send
            raise NoScriptError("scripts not loaded")
        it = iter(results)
        out = [errors[i] if i in errors else next(it) for i in range(len(batch))]
        for job in ok:
            await self._index(job.tenant, job.session_id)
        return out

    def cached_internal(self, tenant: str, session_id: str) -> dict[str, Any] | None:
        """The proxy's tool exchanges of a session this replica has seen, None if cold."""
        cached = self._sessions.get((tenant, session_id))
        return None if cached is None else cached.internal

    async def _index(self, tenant: str, session_id: str) -> None:
        """Keep the tenant's session list current, at most once a minute per session."""
        now = time.monotonic()
        key = (tenant, session_id)
        if now - self._indexed.get(key, -INDEX_EVERY_S) < INDEX_EVERY_S:
            return
        self._indexed[key] = now
        self._indexed.move_to_end(key)
        if len(self._indexed) > SESSION_CACHE_SIZE:
            self._indexed.popitem(last=False)
        await self.client.zadd(self._index_key(tenant), {session_id: _now_ms()})

    def _remember(self, key: tuple[str, str], length: int, chain: str,
                  internal: dict[str, Any]) -> None:
        self._sessions[key] = _Cached(length, chain, internal)
        self._sessions.move_to_end(key)
        if len(self._sessions) > SESSION_CACHE_SIZE:
            self._sessions.popitem(last=False)

    async def append(self, tenant: str, session_id: str, items: list[Prepared],
                     retention_days: float | None = None, system: int = 0) -> list[Message]:
        """Append to the head branch whatever it holds (server-history mode); return it all.

        The first ``system`` items are the request's system prompt: stored only when they open
        the session."""
        self._check_sizes(items)
        p = self.prefix(tenant, session_id)
        args: list[Any] = [p, _now_ms(), self._ttl_ms(retention_days),
                           self.cfg.max_messages_per_session, session_id, system]
        for it in items:
            args += [it.hash, it.body, it.tool_call_id, _tokens_field(it)]

        async def run() -> Any:
            reply = await self._append(keys=[p + ":meta"], args=args)
            await self._index(tenant, session_id)
            return reply

        reply = await self._call("append", run())
        if _s(reply[0]) == "limit":
            raise StoreLimitExceeded("session messages limit reached")
        self._sessions.pop((tenant, session_id), None)
        return [orjson.loads(b) for b in reply[1] if b is not None]

    async def add_internal(self, tenant: str, session_id: str, anchor: str,
                           entry: dict[str, Any]) -> None:
        """Keep a proxy-owned tool exchange, to splice around ``anchor`` in later windows."""
        p = self.prefix(tenant, session_id)
        await self._call("internal", self.client.hset(p + ":int", anchor, orjson.dumps(entry)))
        cached = self._sessions.get((tenant, session_id))
        if cached is not None:
            cached.internal[anchor] = entry

    async def add_record(self, tenant: str, session_id: str, record: dict[str, Any]) -> None:
        key = self.prefix(tenant, session_id) + ":rec"

        async def run() -> None:
            pipe = self.client.pipeline(transaction=False)
            pipe.rpush(key, orjson.dumps(record))
            pipe.ltrim(key, -MAX_RECORDS, -1)
            await pipe.execute()

        await self._call("record", run())

    # -- reads ----------------------------------------------------------------------------

    async def token_counts(self, tenant: str, session_id: str, hashes: list[str],
                           encoding: str) -> dict[str, int]:
        """Stored token counts of these messages, made with ``encoding`` (a cold replica
        reads them instead of tokenizing the whole history again)."""
        if not hashes:
            return {}
        raw = await self._call("read", self.client.hmget(
            self.prefix(tenant, session_id) + ":tok", hashes))
        out = {}
        for h, v in zip(hashes, raw, strict=True):
            if v is not None:
                enc, _, n = _s(v).rpartition(":")
                if enc == encoding and n.isdigit():
                    out[h] = int(n)
        return out

    async def tool_results(self, tenant: str, session_id: str, call_id: str) -> list[Message]:
        p = self.prefix(tenant, session_id)

        async def run() -> list[Message]:
            packed = await self.client.hget(p + ":tool", call_id)
            if not packed:
                return []
            packed = _s(packed)
            hashes = [packed[i:i + 32] for i in range(0, len(packed), 32)]
            bodies = await self.client.hmget(p + ":msg", hashes)
            return [orjson.loads(b) for b in bodies if b is not None]

        return await self._call("recall", run())  # type: ignore[no-any-return]

    async def all_messages(self, tenant: str, session_id: str) -> list[tuple[str, Message]]:
        """Every message of every branch of the session (for search_history)."""
        p = self.prefix(tenant, session_id)

        async def run() -> list[tuple[str, Message]]:
            raw = await self.client.hgetall(p + ":msg")
            return [(_s(h), orjson.loads(b)) for h, b in raw.items()]

        return await self._call("search", run())  # type: ignore[no-any-return]

    async def session(self, tenant: str, session_id: str) -> SessionView | None:
        p = self.prefix(tenant, session_id)

        async def run() -> SessionView | None:
            meta = {_s(k): _s(v) for k, v in (await self.client.hgetall(p + ":meta")).items()}
            if not meta:
                return None
            head = meta.get("head", "0")
            hashes = await self.client.lrange(f"{p}:b:{head}", 0, -1)
            bodies = await self.client.hmget(p + ":msg", hashes) if hashes else []
            branches_raw = await self.client.hgetall(p + ":branches")
            records = await self.client.lrange(p + ":rec", 0, -1)
            internal = await self.client.hgetall(p + ":int")
            nb = int(meta.get("nbranches", "0"))
            branches: dict[str, dict[str, Any]] = {}
            for b in range(nb + 1):
                info = orjson.loads(branches_raw[str(b).encode()]) \
                    if str(b).encode() in branches_raw else {"parent": None, "fork_at": 0}
                info["length"] = await self.client.llen(f"{p}:b:{b}")
                branches[str(b)] = info
            return SessionView(
                session_id=meta.get("sid", session_id), tenant=tenant, head=head,
                messages=[orjson.loads(b) for b in bodies if b is not None],
                branches=branches, records=[orjson.loads(r) for r in records],
                created_ms=int(meta.get("created", "0")),
                updated_ms=int(meta.get("updated", "0")),
                internal={_s(k): orjson.loads(v) for k, v in internal.items()})

        return await self._call("read", run())  # type: ignore[no-any-return]

    async def list_sessions(self, tenant: str, offset: int, limit: int
                            ) -> tuple[list[tuple[str, int]], int]:
        key = self._index_key(tenant)

        async def run() -> tuple[list[tuple[str, int]], int]:
            total = await self.client.zcard(key)
            rows = await self.client.zrevrange(key, offset, offset + limit - 1, withscores=True)
            return [(_s(sid), int(score)) for sid, score in rows], int(total)

        return await self._call("list", run())  # type: ignore[no-any-return]


def _tokens_field(it: Prepared) -> str:
    return f"{it.encoding}:{it.tokens}" if it.tokens is not None else ""


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _pairs(flat: list[Any]) -> dict[str, list[Message]]:
    return {_s(flat[i]): orjson.loads(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}


def _now_ms() -> int:
    return int(time.time() * 1000)
