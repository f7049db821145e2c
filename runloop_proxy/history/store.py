"""The history store: every session's complete, never-compressed history, in Redis.

Keys of one session share the hash tag ``{namespace:session}`` so they live in one Redis Cluster
slot and every update is a single atomic Lua script (scripts.py)::

    P:{n:s}:meta      hash   head branch, its length and chain tip, the tip's kind, timestamps
    P:{n:s}:msg       hash   content hash -> canonical JSON (content-addressed)
    P:{n:s}:ts        hash   content hash -> first seen (ms)
    P:{n:s}:tok       hash   content hash -> token count (tagged with its encoding)
    P:{n:s}:tool      hash   tool_call_id -> hashes of every result with that id (ids repeat)
    P:{n:s}:b:N       list   branch N: content hashes in order
    P:{n:s}:c:N       list   branch N: chain hashes (sha1 of the previous chain + match hash)
    P:{n:s}:branches  hash   N -> {parent, fork_at, created}
    P:{n:s}:bused     zset   live branches by last use (the least recent is pruned first)
    P:{n:s}:int       hash   chain hash at a client-visible message -> the proxy's tool
                             exchange spliced around it (only that lineage finds it)
    P:{n:s}:intk      list   the anchors of :int in the order written (a replica's sync
                             reads the exchanges after the ones it holds)
    P:{n:s}:rec       list   compression records and branch events (seed 004 §3.4)
    P:{n:s}:req       list   per request: prompt tokens as sent and as forwarded (last 500)
    P:{n:s}:sum       hash   "<loops>:<cover hash>" -> a summary of those loops, or "late"
    P:{n:s}:sumlock   string one summary in flight per session: its holder's token (expires)
    P:t:<n>:sessions  zset   session -> last use (for listing; a different slot)
    P:a:<n>:<anchor>  string session id a recorded reply belongs to (trimmed histories)

Nothing is written before the upstream has answered a request: a cold replica reads what it
needs (``load``), and the turn is written behind, after the reply (writes.py). Reconciliation
costs O(new messages): the proxy sends chain hashes and bodies from the length it last saw (a
hint); the script answers "need" when the hint was wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import re
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..caches import SHARES, ByteLRU, approx_size
from ..config import ServerSection, StoreSection
from ..conversation.messages import Message, kept_json
from ..errors import StoreError, StoreLimitExceeded
from ..ops import logs
from ..ops.metrics import Metrics
from ..pipeline.offload import is_large, offload
from .scripts import (
    ADD_INTERNAL_LUA,
    APPEND_LUA,
    EXPIRE_WITH_SESSION_LUA,
    LOAD_LUA,
    LOCK_LUA,
    MISSING_LUA,
    PUT_DATES_LUA,
    SYNC_LUA,
    UNLOCK_LUA,
)
from .writes import (
    Job,
    Prepared,
    WriteBehind,
    chain_hashes,
    held_bytes,
    lost_message,
    prepare,
)

__all__ = ["Prepared", "RedisStore", "prepare"]
log = logs.get("store")
_SAFE_ID = re.compile(r"[A-Za-z0-9._:-]{1,160}")
MAX_POINTS = 500
LARGE_JOB = 2_000  # messages in a write job whose arguments are made off the event loop
MAX_RECORDS = 1_000
SHADOW_DAY_TTL_MS = 2 * 86_400_000  # a day's shadow spend, kept a day past its end
INDEX_EVERY_S = 60.0
PROBE_EVERY_S = 0.25
_RECONNECT = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError, TimeoutError)


@dataclass
class _Cached:
    """What this replica knows of a session: the head's length and chain tip, and the
    proxy's tool exchanges as of the ``seen``-th entry of the session's exchange log (None:
    not known whole, read again)."""

    length: int
    chain: str
    internal: dict[str, Any] | None
    seen: int = 0
    gen: str = ""  # the generation of the exchange log ``seen`` counts in (scripts.INTK)
    last: str = ""  # the anchor at ``seen`` in that log (a log rolled back is told by it)


@dataclass
class SyncResult:
    length: int
    branch: str
    forked: bool
    internal: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Loaded:
    """What a replica that has not seen a session reads before its first window."""

    internal: dict[str, Any]
    counts: dict[str, int]
    stored: int = 0  # how many of the messages asked about, from the first, the session holds
    # when the session's loops were first seen (``put_dates``): an omission by age survives
    # a restart, and holds on any replica
    dates: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Overview:
    """A session in a list: its messages (head branch), and its requests' prompt tokens as
    sent and as forwarded (summed over the last ``MAX_POINTS`` requests)."""

    messages: int
    requests: int
    client: int
    forwarded: int
    points: tuple[dict[str, Any], ...] = ()  # the requests' points (what prices them)
    created_ms: int = 0  # when the session was first stored (0: not known)
    updated_ms: int = 0  # when it was last stored (the list's own time lags up to a minute)


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
    internal: dict[str, Any]
    size: int = 0  # the stored messages' bytes: a large session is worked on off the loop

    @property
    def large(self) -> bool:
        return is_large(self.size, len(self.messages))


def session_slug(session_id: str) -> str:
    """A session key as its Redis keys spell it. Keys come from conversation/identity.py
    (``n:``/``h:`` named, ``fp-``, ``chain-``), all plain; anything else (an operator's typo)
    is hashed under a prefix none of those uses, so it can only miss."""
    if _SAFE_ID.fullmatch(session_id):
        return session_id
    return "x-" + hashlib.sha256(session_id.encode()).hexdigest()[:32]


def client_identity() -> dict[str, Any]:
    """What the store's connections name themselves to Redis (CLIENT SETINFO), resolved once:
    left to redis-py 7+, every connection it opens reads the package's metadata from disk and
    parses it as mail headers (about 1,300 calls on the event loop, as many times as a burst
    opens connections)."""
    try:
        from redis.driver_info import DriverInfo
    except ImportError:  # redis-py before 7: its default version is read once, at import
        return {}
    return {"driver_info": DriverInfo()}


class RedisStore:
    """Redis-backed history. Every failure becomes StoreError; the caller fails open."""

    def __init__(self, url: str, cfg: StoreSection, metrics: Metrics,
                 cache_bytes: Mapping[str, int] | None = None):
        """``cache_bytes``: what each of its caches may hold, by its name in ``SHARES``
        (sessions, chains, anchors, indexed, exchanges); unnamed, its share of the default
        cache_mb."""
        self.cfg = cfg
        self.metrics = metrics
        timeout = cfg.timeout_s
        if url.startswith("redis+cluster://"):
            self.client: Any = RedisCluster.from_url(
                "redis://" + url.removeprefix("redis+cluster://"), socket_timeout=timeout,
                socket_connect_timeout=timeout, **client_identity())
        else:
            # A blocking pool: a burst waits for a connection instead of failing.
            self._pool = aioredis.BlockingConnectionPool.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout, max_connections=64,
                timeout=timeout, health_check_interval=30, **client_identity())
            # retries are ours (_call): one on a fresh connection, then the store is down
            self.client = aioredis.Redis(connection_pool=self._pool, retry=Retry(NoBackoff(), 0))
        self._sync = self.client.register_script(SYNC_LUA)
        self._append = self.client.register_script(APPEND_LUA)
        self._load = self.client.register_script(LOAD_LUA)
        self._add_internal = self.client.register_script(ADD_INTERNAL_LUA)
        self._missing = self.client.register_script(MISSING_LUA)
        self._lock = self.client.register_script(LOCK_LUA)
        self._unlock = self.client.register_script(UNLOCK_LUA)
        budgets = cache_bytes or {}

        def share(name: str) -> int:
            return budgets.get(name) or int((ServerSection().cache_mb << 20) * SHARES[name])
        self._sessions: ByteLRU[tuple[str, str], _Cached] = ByteLRU(
            share("sessions"), lambda k, v: 300 + approx_size(v.internal))
        self._chains: ByteLRU[tuple[str, str], tuple[list[str], list[str]]] = ByteLRU(
            share("chains"), lambda k, v: 200 + 190 * len(v[0]))
        # (namespace, session) -> when this replica last listed it (``_index_due``)
        self._indexed: ByteLRU[tuple[str, str], float] = ByteLRU(
            share("indexed"), lambda k, v: 200 + len(k[0]) + len(k[1]))
        self._down_until = 0.0
        self._probe: asyncio.Task[None] | None = None
        self._scripts_loaded = False
        self.writes = WriteBehind(self._pipeline, self._settle, self._available_in,
                                  cfg.write_retry_s, self._lost, cfg.write_queue_mb << 20,
                                  metrics.write_queue.set, self._refused,
                                  lambda name: metrics.background_failures.labels(name).inc())
        self._refused_logged = 0.0
        # the proxy's tool exchanges this replica is writing, until Redis holds them: its
        # next request of the session splices them whatever the write's timing (a window's
        # shape must not depend on when a background write landed)
        self._writing_internal: dict[tuple[str, str], dict[str, Any]] = {}
        # per session, the sequence number of the last exchange write begun or ended
        # (``add_internal``, numbered across sessions by ``_internal_seq``): a sync sent
        # before then may have read the exchange log without it, and its reply must not
        # become what this replica knows
        self._internal_seq = 0
        self._internal_begun: ByteLRU[tuple[str, str], int] = ByteLRU(
            share("exchanges"), lambda k, v: 100 + len(k[0]) + len(k[1]))
        # anchors this replica set, until Redis holds them (a few hundred bytes each)
        self._anchors: ByteLRU[tuple[str, str], str] = ByteLRU(
            share("anchors"), lambda k, v: 200 + len(k[0]) + len(k[1]) + len(v))

    def resize(self, cache_bytes: dict[str, int]) -> None:
        """Its caches' new budgets, by name (a reload that changed ``cache_mb``)."""
        for name, cache in (("sessions", self._sessions), ("chains", self._chains),
                            ("anchors", self._anchors), ("indexed", self._indexed),
                            ("exchanges", self._internal_begun)):
            if name in cache_bytes:
                cache.resize(cache_bytes[name])

    # -- health ---------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _available_in(self) -> float:
        return self._down_until - time.monotonic()

    async def _call(self, op: str, make: Callable[[], Awaitable[Any]]) -> Any:
        """Run one store operation. A connection that fails is retried once on a fresh one
        (pooled connections go stale when Redis restarts); a second failure marks the store
        down, and a probe brings it back as soon as Redis answers again."""
        if not self.available:
            raise StoreError(f"store marked down, retrying in {self._available_in():.1f}s")
        started = time.perf_counter()
        for attempt in (0, 1):
            try:
                result = await make()
                break
            except NoScriptError:
                self._scripts_loaded = False
                if attempt:
                    raise self._down(op, "the store lost its scripts") from None
            except _RECONNECT as exc:
                await self._reset()
                if attempt:
                    raise self._down(op, f"{type(exc).__name__}: {exc}") from exc
            except RedisError as exc:
                self.metrics.store_errors.labels(op).inc()
                raise StoreError(f"redis {op} failed: {type(exc).__name__}: {exc}") from exc
            except StoreError:
                raise  # the store's own (a session's limits): as it is
            except Exception as exc:  # noqa: BLE001 - whatever the client library raises
                # redis-py's cluster client raises RuntimeError / AttributeError while it
                # reconnects after a master died: a store failure like any other (fail
                # open), never a 500 nor a dead background task; retried once, as a
                # dropped connection is
                if attempt:
                    log.warning("store client raised %s", type(exc).__name__, exc_info=True,
                                extra={"op": op})
                    raise self._down(op, f"{type(exc).__name__}: {exc}") from exc
        self.metrics.store_latency.labels(op).observe(time.perf_counter() - started)
        self.metrics.store_up.set(1)
        return result

    def _down(self, op: str, why: str) -> StoreError:
        self.metrics.store_errors.labels(op).inc()
        self.metrics.store_up.set(0)
        self._down_until = time.monotonic() + self.cfg.retry_after_s
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._probe_until_up())
        return StoreError(f"redis {op} failed: {why}")

    async def _reset(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            if isinstance(self.client, RedisCluster):
                return
            await self._pool.disconnect(inuse_connections=False)

    async def _probe_until_up(self) -> None:
        while not self.available:
            await asyncio.sleep(PROBE_EVERY_S)
            # whatever the client raises, the probe goes on (it is what brings the store
            # back: a probe dead of a cluster client's RuntimeError left it down for good)
            with contextlib.suppress(Exception):
                await self.client.ping()
                self._down_until = 0.0
                self.metrics.store_up.set(1)
                log.info("store reachable again")
                return

    async def ping(self) -> bool:
        if not self.available:
            return False
        try:
            await self._call("ping", self.client.ping)
        except StoreError as exc:
            log.warning("store unreachable", extra={"error": str(exc)})
            return False
        return True

    async def start(self) -> None:
        self.writes.start()

    async def drain(self, timeout: float = 5.0) -> bool:
        """Wait until queued writes are flushed (or given up); False on timeout."""
        return await self.writes.drain(timeout)

    @property
    def refusing_writes(self) -> bool:
        """Whether Redis refuses the history's writes (they wait, backing off)."""
        return self.writes.refusing

    async def written(self, namespace: str, session_id: str, timeout: float) -> bool:
        """Wait until every write of this session is in Redis (or given up); False if one is
        still outstanding after ``timeout`` seconds."""
        return await self.writes.written((namespace, session_id), timeout)

    def reserve(self, namespace: str, session_id: str) -> None:
        """A write of this session on its way (``WriteBehind.reserve``)."""
        self.writes.reserve((namespace, session_id))

    def release(self, namespace: str, session_id: str) -> None:
        self.writes.release((namespace, session_id))

    def lost(self, namespace: str, session_id: str) -> bool:
        """Whether a write of this session was given up on this replica."""
        return self.writes.lost((namespace, session_id))

    async def close(self) -> None:
        await self.drain()
        await self.writes.stop()
        if self._probe is not None:
            self._probe.cancel()
        await self.client.aclose()

    # -- keys -----------------------------------------------------------------------------

    def prefix(self, namespace: str, session_id: str) -> str:
        return f"{self.cfg.key_prefix}:{{{namespace}:{session_slug(session_id)}}}"

    def _index_key(self, namespace: str) -> str:
        return f"{self.cfg.key_prefix}:t:{namespace}:sessions"

    def _anchor_key(self, namespace: str, anchor: str) -> str:
        return f"{self.cfg.key_prefix}:a:{namespace}:{anchor}"

    def _ttl_ms(self, retention_days: float | None) -> int:
        return int((retention_days or self.cfg.retention_days) * 86_400_000)

    def _window_key(self, scope: str, model: str) -> str:
        digest = hashlib.sha256(f"{scope}\0{model}".encode()).hexdigest()[:32]
        return f"{self.cfg.key_prefix}:w:{digest}"

    def _logins_key(self) -> str:
        return f"{self.cfg.key_prefix}:admin:logins"

    def _spend_key(self, tenant: str, day: str, kind: str) -> str:
        digest = hashlib.sha256(tenant.encode()).hexdigest()[:32]
        return f"{self.cfg.key_prefix}:{kind}:{digest}:{day}"

    async def shadow_spend(self, tenant: str, day: str, kind: str = "shadow"
                           ) -> tuple[int, int]:
        """What ``tenant``'s shadow calls (or another ``kind`` of calls it is charged for:
        ``embedding``) spent on the UTC ``day``, every replica's: tokens, and money in
        millionths of a dollar."""
        raw = await self._call(kind, lambda: self.client.hmget(
            self._spend_key(tenant, day, kind), "tokens", "micro_usd"))
        return int(raw[0] or 0), int(raw[1] or 0)

    async def add_shadow_spend(self, tenant: str, day: str, tokens: int,
                               micro_usd: int, kind: str = "shadow") -> None:
        """Add a call's cost to ``day``'s (each field's increment atomic, whichever
        replica adds at the same moment); the day's key outlives the day by one."""
        key = self._spend_key(tenant, day, kind)

        async def run() -> None:
            pipe = self.client.pipeline(transaction=False)
            pipe.hincrby(key, "tokens", tokens)
            pipe.hincrby(key, "micro_usd", micro_usd)
            pipe.pexpire(key, SHADOW_DAY_TTL_MS)
            await pipe.execute()

        await self._call(kind, run)

    async def logins_epoch(self, ttl_ms: int, start: bool = False) -> str | None:
        """The admin's logins' epoch, which every login cookie is signed with (so every
        replica agrees which logins hold): None when none holds. ``start``: begin one if
        none holds; either way it is kept ``ttl_ms`` more (a login's life), never for good."""
        key = self._logins_key()
        if start:
            await self._call("logins", lambda: self.client.set(
                key, secrets.token_hex(16), nx=True, px=ttl_ms))
            await self._call("logins", lambda: self.client.pexpire(key, ttl_ms))
        raw = await self._call("logins", lambda: self.client.get(key))
        return bytes(raw).decode("ascii", "replace") if raw else None

    async def end_logins(self, ttl_ms: int) -> None:
        """Every login made so far ends: a new epoch no cookie was signed with."""
        await self._call("logins", lambda: self.client.set(
            self._logins_key(), secrets.token_hex(16), px=ttl_ms))

    async def learned_window(self, scope: str, model: str) -> int | None:
        """The window an upstream's overflow error said ``model`` has, for callers of
        ``scope`` (any replica's), or None."""
        raw = await self._call("window", lambda: self.client.get(
            self._window_key(scope, model)))
        return int(raw) if raw is not None and bytes(raw).isdigit() else None

    async def learn_window(self, scope: str, model: str, tokens: int) -> None:
        """Remember ``model``'s window for ``scope`` (kept as long as a session is)."""
        await self._call("window", lambda: self.client.set(
            self._window_key(scope, model), str(tokens), px=self._ttl_ms(None)))

    def check_limits(self, count: int, largest: int) -> None:
        """StoreLimitExceeded when a conversation of ``count`` messages (and a reply) cannot
        be kept: too many messages, or the largest new one (``largest`` bytes, measured where
        the messages were prepared) too large."""
        if count + 1 > self.cfg.max_messages_per_session:
            raise StoreLimitExceeded(
                f"the conversation has more messages than the store keeps per session "
                f"({self.cfg.max_messages_per_session})")
        self._check_size(largest)

    def _check_size(self, largest: int) -> None:
        if largest > self.cfg.max_message_bytes:
            raise StoreLimitExceeded(
                f"a message of {largest} bytes exceeds the store's max_message_bytes "
                f"({self.cfg.max_message_bytes})")

    def _check_sizes(self, items: list[Prepared]) -> None:
        self._check_size(max((len(it.body) for it in items), default=0))

    # -- writes ---------------------------------------------------------------------------

    async def sync(self, namespace: str, session_id: str, items: list[Prepared],
                   retention_days: float | None = None) -> SyncResult:
        """Make the session's head branch hold ``items`` (append, keep, or fork), now."""
        job = self._job(namespace, session_id, items, retention_days)
        for _ in range(3):
            reply = await self._call("sync", lambda: self._run_one(job))
            if self._settle(job, reply):
                cached = self._sessions[job.key]
                return SyncResult(cached.length, _s(reply[2]), reply[3] in (b"1", "1"),
                                  cached.internal or {})
        raise StoreError("sync did not converge")

    def submit(self, namespace: str, session_id: str, items: list[Prepared],
               retention_days: float | None = None, point: dict[str, int] | None = None,
               size: int = 0) -> None:
        """Queue a sync off the request path (write-behind; see writes.py); ``point``: the
        request's prompt tokens as sent and as forwarded, kept with it (the inspector's
        chart)."""
        job = self._job(namespace, session_id, items, retention_days)
        job.points = [kept_json(point)] if point else []
        job.size = size  # 0: measured when queued (``prepared``: measured off the event loop)
        self.writes.submit(job)

    def prepared(self, namespace: str, session_id: str, items: list[Prepared]) -> int:
        """A large conversation's job made ready off the event loop: its chain hashes (kept,
        for the job to find) and the bytes it will hold in the queue."""
        self.chains(namespace, session_id, items)
        return held_bytes(items)

    def submit_append(self, namespace: str, session_id: str, items: list[Prepared],
                      retention_days: float | None = None, system: int = 0,
                      point: dict[str, int] | None = None) -> None:
        """Queue messages to append to the head whatever it holds (server-history mode); the
        first ``system`` are the request's system prompt, stored only if they open it."""
        self._check_sizes(items)
        self._sessions.pop((namespace, session_id), None)
        self.writes.submit(Job(namespace, session_id, items, retention_days, append=True,
                               system=system, points=[kept_json(point)] if point else [],
                               token=secrets.token_hex(8)))

    def chains(self, namespace: str, session_id: str, items: list[Prepared]) -> list[str]:
        """The chain hash after each of ``items`` (a conversation from its start; index 0 is
        the empty chain before them), reusing the prefix this session sent last time: a
        growing conversation hashes only what is new. A chain names a position in one
        lineage: the conversation up to there, and nothing else."""
        key = (namespace, session_id)
        chains = chain_hashes([it.match for it in items], self._chains.get(key))
        self._chains[key] = ([it.match for it in items], chains)
        return chains

    def _job(self, namespace: str, session_id: str, items: list[Prepared],
             retention_days: float | None) -> Job:
        job = Job(namespace, session_id, items, retention_days)
        job.chains = self.chains(namespace, session_id, items)
        return job

    def _hint(self, job: Job) -> int:
        cached = self._sessions.get(job.key)
        if cached is None:
            return 0
        n = cached.length
        return n if n <= len(job.items) and job.chains[n] == cached.chain else 0

    def _args(self, job: Job) -> list[Any]:
        """The script's arguments for a job."""
        p = self.prefix(job.namespace, job.session_id)
        job.written_ms = now = _now_ms()
        job.internal_seq = self._internal_seq
        if job.append:
            args: list[Any] = [p, now, self._ttl_ms(job.retention_days),
                               self.cfg.max_messages_per_session, job.session_id, job.system,
                               self.cfg.max_stored_messages, job.token]
            for it in job.items:
                args += [it.hash, it.match, it.body, it.tool_call_id, _tokens_field(it),
                         it.kind]
            return args
        hint = job.retry_hint if job.retry_hint is not None else self._hint(job)
        items, chains = job.items, job.chains
        self._check_sizes(items[hint:])
        args = [p, hint, len(items), "".join(chains[hint + 1:]),
                "".join(it.hash for it in items[hint:]), now,
                self._ttl_ms(job.retention_days), self.cfg.max_messages_per_session,
                self.cfg.max_branches, job.session_id, chains[hint],
                "".join(it.kind for it in items[hint:]),
                # the bodies joined, and what the script needs to part them: packing a
                # command costs per argument (redis-py packs on the event loop), so a sync
                # of 20,000 new messages costs three arguments, not 60,000
                b"".join(it.body for it in items[hint:]),
                orjson.dumps([[len(it.body), it.tool_call_id, _tokens_field(it)]
                              for it in items[hint:]]),
                *self._seen(job.key, self.cfg.max_branch_messages),
                self.cfg.max_stored_messages]
        job.hint = hint
        return args

    def _seen(self, key: tuple[str, str], cap: int) -> tuple[int, int, str, str, str]:
        """How many entries of a session's exchange log, of which generation, this replica
        holds the exchanges of (the sync reads only the ones after them; another generation
        or none: all), with the branches' cap between, a generation for a log made anew, and
        the anchor it read last (a log rolled back and grown again does not hold it there)."""
        cached = self._sessions.get(key)
        if cached is None or cached.internal is None:
            return 0, cap, "", new_generation(), ""
        return cached.seen, cap, cached.gen, new_generation(), cached.last

    async def _job_args(self, job: Job) -> list[Any]:
        """``_args``, made off the event loop for a job of many messages (a new session of
        thousands: each message's body, id and count read into the arguments)."""
        if len(job.items) > LARGE_JOB:
            return await asyncio.to_thread(self._args, job)
        return self._args(job)

    async def _run_one(self, job: Job) -> Any:
        script = self._append if job.append else self._sync
        args = await self._job_args(job)
        reply = await script(keys=[args[0] + ":meta"], args=args)
        indexed = self._index_due(job.namespace, job.session_id)
        if indexed or job.points:
            pipe = self.client.pipeline(transaction=False)
            if indexed:
                self._index(pipe, job)
            if job.points:
                self._points(pipe, job)
            await pipe.execute()
            job.points = []
        return reply

    def _settle(self, job: Job, reply: Any) -> bool:
        """Apply a script's reply; False when the job must be sent again (a stale hint)."""
        status = _s(reply[0])
        if status == "limit":
            raise StoreLimitExceeded(f"session {_s(reply[1]) if len(reply) > 1 else ''} "
                                     f"limit reached")
        if job.append:
            self._sessions.pop(job.key, None)
            return True
        if status == "ok":
            length = int(reply[1])
            chain = job.chains[length] if length <= len(job.items) else ""
            if (self._internal_begun.get(job.key) or 0) > job.internal_seq:
                # an exchange write began or ended after this sync was sent: the reply holds
                # the log without it, whichever of the two Redis ran first (under load
                # the sync's reply came after the exchange had landed, and the session's
                # next request spliced nothing: issue 40). Read it all again
                self._remember(job.key, length, chain, None)
            else:
                self._remember(job.key, length, chain, *self._exchanges(job, reply))
            if reply[6]:
                pruned = _s(reply[6]).split(",")
                self.metrics.branches_pruned.inc(len(pruned))
                log.info("least recently used branches pruned (max_branches, "
                         "max_branch_messages)",
                         extra={"tenant": job.namespace, "branch": ",".join(pruned[:16]),
                                "count": len(pruned)})
            return True
        stored = int(reply[1])
        job.retry_hint = stored if 0 < stored <= len(job.items) and stored != job.hint else 0
        return False

    def _refused(self, job: Job, why: str) -> None:
        """Redis refused a job's write (out of memory, read-only, busy): counted each time,
        logged at most once a second (the job waits and is sent again)."""
        self.metrics.store_errors.labels("sync").inc()
        now = time.monotonic()
        if now - self._refused_logged >= 1.0:
            self._refused_logged = now
            log.warning("Redis refused a history write; it waits and is sent again",
                        extra={"tenant": job.namespace, "error": why[:200],
                               "attempts": job.attempts + 1})

    def _lost(self, job: Job, why: str) -> None:
        self.metrics.store_errors.labels("write_lost").inc()
        log.warning("history not stored", extra={**lost_message(job), "error": why})

    async def _pipeline(self, batch: list[Job]) -> list[Any]:
        if isinstance(self.client, RedisCluster):
            return await self._cluster_batch(batch)
        return await self._call("sync", lambda: self._batch(batch))  # type: ignore[no-any-return]

    async def _batch(self, batch: list[Job]) -> list[Any]:
        # EVALSHA straight into the pipeline: redis-py's script objects would ask
        # SCRIPT EXISTS on every flush, one more round trip each time.
        if not self._scripts_loaded:
            await self.client.script_load(SYNC_LUA)
            await self.client.script_load(APPEND_LUA)
            self._scripts_loaded = True
        pipe = self.client.pipeline(transaction=False)
        sent: list[Job] = []
        errors: dict[int, Exception] = {}
        for i, job in enumerate(batch):
            try:
                args = await self._job_args(job)
            except StoreLimitExceeded as exc:
                errors[i] = exc
                continue
            sha = self._append.sha if job.append else self._sync.sha
            pipe.evalsha(sha, 1, args[0] + ":meta", *args)
            sent.append(job)
        # the sessions' listing, in the same round trip (one ZADD per session a minute)
        for job in sent:
            if self._index_due(job.namespace, job.session_id):
                self._index(pipe, job)
        pointed = [job for job in sent if job.points]
        for job in pointed:
            self._points(pipe, job)
        results = await pipe.execute(raise_on_error=False) if sent else []
        for job in pointed:
            job.points = []  # sent: a job sent again (a stale hint) does not repeat them
        results = results[:len(sent)]  # the scripts' replies; the rest are bookkeeping
        if any(isinstance(r, NoScriptError) for r in results):
            raise NoScriptError("scripts not loaded")  # _call reloads them and sends again
        it = iter(results)
        return [errors[i] if i in errors else next(it) for i in range(len(batch))]

    async def _cluster_batch(self, batch: list[Job]) -> list[Any]:
        """A cluster has no cross-slot pipeline: sessions in parallel, each session's jobs in
        order (appends must keep theirs)."""
        by_session: dict[tuple[str, str], list[int]] = {}
        for i, job in enumerate(batch):
            by_session.setdefault(job.key, []).append(i)
        out: list[Any] = [None] * len(batch)

        async def one_session(indexes: list[int]) -> None:
            for i in indexes:
                try:
                    out[i] = await self._call("sync", functools.partial(self._run_one,
                                                                        batch[i]))
                except (StoreError, StoreLimitExceeded) as exc:
                    out[i] = exc

        await asyncio.gather(*(one_session(ix) for ix in by_session.values()))
        return out

    def _index_due(self, namespace: str, session_id: str) -> bool:
        """Whether the namespace's session list needs this session's last use again (at most
        once a minute per session); marks it done."""
        now = time.monotonic()
        key = (namespace, session_id)
        last = self._indexed.get(key)
        if last is not None and now - last < INDEX_EVERY_S:
            return False
        self._indexed[key] = now
        return True

    def _index(self, pipe: Any, job: Job) -> None:
        """Queue the session's last use in its namespace's listing, which forgets sessions
        past their retention (with a minute's margin: the listing is written at most once a
        minute per session) and expires when none was used for that long."""
        key, ttl = self._index_key(job.namespace), self._ttl_ms(job.retention_days)
        now = job.written_ms or _now_ms()  # the time the session's own write gave it
        pipe.zadd(key, {job.session_id: now})
        pipe.zremrangebyscore(key, "-inf", now - ttl - int(INDEX_EVERY_S * 1000))
        pipe.pexpire(key, ttl)

    def _exchanges(self, job: Job, reply: Any
                   ) -> tuple[dict[str, Any] | None, int, str, str]:
        """The session's proxy exchanges after a sync's reply, the log entries they cover, the
        log's generation and its last anchor: the reply's new ones over what this replica
        held when it asked (the same generation), or the reply alone when it read the log
        from its start."""
        new, logged, since = _pairs(reply[5]), int(reply[7]), int(reply[8])
        gen, last = _s(reply[9]), _s(reply[10])
        if since == 0:
            return new, logged, gen, last
        cached = self._sessions.get(job.key)
        if cached is None or cached.internal is None or cached.gen != gen \
                or cached.seen != since:
            return None, 0, "", ""  # not what this replica held when it asked: read it all
        cached.internal.update(new)
        return cached.internal, logged, gen, last

    def _remember(self, key: tuple[str, str], length: int, chain: str,
                  internal: dict[str, Any] | None, seen: int = 0, gen: str = "",
                  last: str = "") -> None:
        self._sessions[key] = _Cached(length, chain, internal, seen, gen, last)

    def writing_internal(self, namespace: str, session_id: str, anchor: str,
                         entry: dict[str, Any]) -> None:
        """A proxy exchange about to be kept (``add_internal``): from now on the session's
        next request on this replica splices it, and a sync of the session sent before it
        lands is not taken as what Redis holds of its exchanges. Called where the write is
        decided, before it is spawned: a request handled before the write's task first ran
        spliced nothing."""
        key = (namespace, session_id)
        self._writing_internal.setdefault(key, {})[anchor] = entry
        self._internal_seq += 1
        self._internal_begun[key] = self._internal_seq

    async def add_internal(self, namespace: str, session_id: str, anchor: str,
                           entry: dict[str, Any], retention_days: float | None = None) -> None:
        """Keep a proxy-owned tool exchange, to splice around ``anchor`` (the chain hash at
        the message the client saw: that message, in that lineage) in later windows."""
        p = self.prefix(namespace, session_id)
        key = (namespace, session_id)
        self.writing_internal(namespace, session_id, anchor, entry)
        try:
            # the hash and the log a replica's sync reads on from, written together
            logged, gen, fresh = await self._call("internal", lambda: self._add_internal(
                keys=[p + ":meta"], args=[p, anchor, orjson.dumps(entry), new_generation(),
                                              self._ttl_ms(retention_days)]))
        finally:
            self._internal_seq += 1  # a sync sent before this landed may not hold it
            self._internal_begun[key] = self._internal_seq
            writing = self._writing_internal.get(key)
            if writing is not None:
                writing.pop(anchor, None)
                if not writing:
                    del self._writing_internal[key]
        cached = self._sessions.get((namespace, session_id))
        if cached is not None and cached.internal is not None:
            if int(fresh) and not cached.internal and not cached.gen and int(logged) == 1:
                cached.internal, cached.seen, cached.gen = {anchor: entry}, 1, _s(gen)
                cached.last = anchor
            elif int(fresh) or cached.gen != _s(gen):
                cached.internal = None  # the log was made anew: read it all again
            else:
                cached.internal[anchor] = entry
                if cached.seen == int(logged) - 1:
                    cached.seen, cached.last = int(logged), anchor  # else another replica
                    # wrote between: the next sync reads it

    async def add_record(self, namespace: str, session_id: str, record: dict[str, Any],
                         retention_days: float | None = None) -> None:
        await self.add_records(namespace, session_id, [record], retention_days)

    async def add_records(self, namespace: str, session_id: str,
                          records: list[dict[str, Any]],
                          retention_days: float | None = None) -> None:
        """Append compression records, in order, in one round trip (the last MAX_RECORDS of
        a session are kept)."""
        key = self.prefix(namespace, session_id) + ":rec"

        async def run() -> None:
            pipe = self.client.pipeline(transaction=False)
            pipe.rpush(key, *(orjson.dumps(r) for r in records))
            pipe.ltrim(key, -MAX_RECORDS, -1)
            _expire_with_session(pipe, self.prefix(namespace, session_id),
                                 self._ttl_ms(retention_days), key)
            await pipe.execute()

        await self._call("record", run)

    def _points(self, pipe: Any, job: Job) -> None:
        """Queue the job's per-request token points (the last 500 of a session kept) in the
        pipeline that carries the job: they cost no round trip of their own."""
        key = self.prefix(job.namespace, job.session_id) + ":req"
        pipe.rpush(key, *job.points)
        pipe.ltrim(key, -MAX_POINTS, -1)
        pipe.pexpire(key, self._ttl_ms(job.retention_days))

    async def points(self, namespace: str, session_id: str) -> list[dict[str, int]]:
        found = await self._call("read", lambda: self.client.lrange(
            self.prefix(namespace, session_id) + ":req", 0, -1))
        return [orjson.loads(p) for p in found or []]

    async def put_summary(self, namespace: str, session_id: str, name: str,
                          value: str, retention_days: float | None = None) -> bool:
        """Store a summary (or its lateness) under what it covers; the first one stays."""
        key = self.prefix(namespace, session_id) + ":sum"

        async def run() -> bool:
            pipe = self.client.pipeline(transaction=False)
            pipe.hsetnx(key, name, value)
            _expire_with_session(pipe, self.prefix(namespace, session_id),
                                 self._ttl_ms(retention_days), key)
            return bool((await pipe.execute())[0])

        return bool(await self._call("summary", run))

    async def summaries(self, namespace: str, session_id: str) -> dict[str, str]:
        found = await self._call("summary", lambda: self.client.hgetall(
            self.prefix(namespace, session_id) + ":sum"))
        return {_s(k): _s(v) for k, v in (found or {}).items()}

    async def lock_summary(self, namespace: str, session_id: str, ttl_s: float,
                           unreleased: str | None = None) -> str | None:
        """One summary in flight per session, across replicas and workers: the token this
        holder took the lock with (``unlock_summary`` needs it), or None when another holds
        it. Expires on its own (a replica that died holding it). ``unreleased``: a token this
        holder took it with before and could not release; a lock still held by it is taken
        over (the holder's own, never another's)."""
        token = secrets.token_hex(16)
        taken = await self._call("summary", lambda: self._lock(
            keys=[self.prefix(namespace, session_id) + ":sumlock"],
            args=[token, max(1, int(ttl_s * 1000)), unreleased or ""]))
        return token if taken else None

    async def unlock_summary(self, namespace: str, session_id: str, token: str) -> bool:
        """Release the lock taken with ``token``, if it is still that one (compared and
        deleted in one script: never a lock another holder took after this one expired).
        False when Redis did not answer: the lock may still be held by ``token``."""
        try:
            await self._call("summary", lambda: self._unlock(
                keys=[self.prefix(namespace, session_id) + ":sumlock"], args=[token]))
        except StoreError:
            return False
        return True

    async def announce(self, namespace: str, session_id: str, anchors: list[tuple[str, str]],
                       retention_days: float | None, announced_ms: int,
                       token: str) -> None:
        """Before an answer ends, in one round trip: its anchors (key and value: which
        session a recorded reply or response belongs to, or what a response chains on; a
        client that trims its history still sends its latest replies), kept as long as the
        session; and that a write of the session is on its way (``announced``, for
        ``announced_ms``): a request the client sends the moment it has the answer, to
        another replica, finds the session and waits for the write there (until
        ``unannounce`` with the same ``token`` says it landed)."""
        ttl = self._ttl_ms(retention_days)

        async def run() -> None:
            pipe = self.client.pipeline(transaction=False)
            for key, value in anchors:
                pipe.set(self._anchor_key(namespace, key), value, px=ttl)
            pipe.set(self.prefix(namespace, session_id) + ":announced", token, px=announced_ms)
            await pipe.execute()

        await self._call("anchor", run)

    async def unannounce(self, namespace: str, session_id: str, token: str) -> None:
        """The write ``announce`` said was on its way with ``token`` has landed: a request
        that does not line up with the session stops waiting for it. A newer answer's
        announcement (another token, from any replica) stays (compared and deleted in one
        script)."""
        with contextlib.suppress(StoreError):
            await self._call("anchor", lambda: self._unlock(
                keys=[self.prefix(namespace, session_id) + ":announced"], args=[token]))

    async def announced(self, namespace: str, session_id: str) -> bool:
        """Whether a replica announced a write of the session lately (``announce``)."""
        return bool(await self._call("read", lambda: self.client.exists(
            self.prefix(namespace, session_id) + ":announced")))

    # -- reads ----------------------------------------------------------------------------

    def with_writing(self, namespace: str, session_id: str,
                     internal: dict[str, Any]) -> dict[str, Any]:
        """``internal`` (the exchanges a request read) with those this replica is still
        writing (``add_internal`` in flight): what its next request splices does not depend
        on whether the write has landed."""
        writing = self._writing_internal.get((namespace, session_id))
        return {**internal, **writing} if writing else internal

    def cached_internal(self, namespace: str, session_id: str) -> dict[str, Any] | None:
        """The proxy's tool exchanges of a session this replica has seen, None if cold."""
        cached = self._sessions.get((namespace, session_id))
        return None if cached is None else cached.internal

    async def load(self, namespace: str, session_id: str, hashes: list[str],
                   encoding: str, large: bool = False) -> Loaded:
        """One round trip for a session this replica has not seen: the proxy's stored tool
        exchanges, the token counts of these messages made with ``encoding``, and how many
        of them, from the first, the session holds (an earlier request carried them). The
        reply is read entry by entry, in a worker thread when ``large`` (a session of 18,000
        messages left 27,000 calls on the event loop here)."""
        p = self.prefix(namespace, session_id)
        internal, found, dated = await self._call("read", lambda: self._load(
            keys=[p + ":int", p + ":tok", p + ":seen"], args=["".join(hashes)]))
        if large:
            return await asyncio.to_thread(_loaded, hashes, encoding, internal, found, dated)
        return _loaded(hashes, encoding, internal, found, dated)

    async def put_dates(self, namespace: str, session_id: str, packed: str,
                        retention_days: float | None = None) -> None:
        """Keep when messages of the session were first seen (``framing.FirstSeen.packed``:
        a position and its message's key with its date, a line each; the first date kept),
        expiring with the session. One argument whatever the count: the event loop packs
        nothing (a large request's dates were packed with its window, off the loop)."""
        key = self.prefix(namespace, session_id) + ":seen"

        async def run() -> None:
            pipe = self.client.pipeline(transaction=False)
            pipe.eval(PUT_DATES_LUA, 1, key, packed)
            _expire_with_session(pipe, self.prefix(namespace, session_id),
                                 self._ttl_ms(retention_days), key)
            await pipe.execute()

        await self._call("record", run)

    async def head(self, namespace: str, session_id: str) -> list[tuple[str, Message]]:
        """The head branch: (content hash, message) in order."""
        return (await self.head_sized(namespace, session_id))[0]

    async def head_sized(self, namespace: str, session_id: str
                         ) -> tuple[list[tuple[str, Message]], int]:
        """The head branch and its stored bytes: what it weighs decides, as a request's size
        does, whether it is worked on off the event loop (parsed here, and by the caller)."""
        p = self.prefix(namespace, session_id)

        async def run() -> tuple[list[Any], list[Any]]:
            head = await self.client.hget(p + ":meta", "head")
            if head is None:
                return [], []
            hashes = await self.client.lrange(f"{p}:b:{_s(head)}", 0, -1)
            bodies = await self.client.hmget(p + ":msg", hashes) if hashes else []
            return hashes, bodies

        hashes, bodies = await self._call("read", run)
        size = sum(len(b) for b in bodies if b is not None)
        items = await offload(is_large(size, len(bodies)), lambda: [
            (_s(h), orjson.loads(b)) for h, b in zip(hashes, bodies, strict=True)
            if b is not None])
        return items, size

    async def head_length(self, namespace: str, session_id: str) -> int:
        """How many messages a session's head branch holds (one field read: what reading it
        would cost is known before it is read)."""
        found = await self._call("read", lambda: self.client.hget(
            self.prefix(namespace, session_id) + ":meta", "len"))
        return int(found) if found is not None and _s(found).isdigit() else 0

    async def continuation(self, namespace: str, session_id: str,
                           anchors: list[str]) -> str | None:
        """For a fingerprinted request its fingerprint did not find: the session one of its
        replies (``anchors``, newest first) was recorded in, if the fingerprint's session does
        not exist (it then is a new conversation, or one whose client trimmed its history).
        An anchor this replica noted (``note_anchor``) is found before Redis holds it."""
        p = self.prefix(namespace, session_id)

        async def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            pipe.exists(p + ":meta")
            for a in anchors:
                pipe.get(self._anchor_key(namespace, a))
            return list(await pipe.execute())

        replies = await self._call("read", run)
        if replies[0]:
            return None
        for a, stored in zip(anchors, replies[1:], strict=True):
            found = self._anchors.get((namespace, a)) or (_s(stored) if stored else None)
            if found:
                return found
        return None

    def note_anchor(self, namespace: str, anchor: str, session_id: str) -> None:
        """An anchor this replica is about to store (``announce``): found at once here, so a
        request that chains on the answer the moment it arrives finds its session (it raced
        the write and began a session of its own)."""
        self._anchors[(namespace, anchor)] = session_id

    async def anchored(self, namespace: str, anchor: str) -> str | None:
        """The session an anchor was set for, if any."""
        noted = self._anchors.get((namespace, anchor))
        if noted is not None:
            return noted
        found = await self._call("read", lambda: self.client.get(
            self._anchor_key(namespace, anchor)))
        return _s(found) if found else None

    async def tool_results(self, namespace: str, session_id: str,
                           call_id: str) -> list[Message]:
        """Every stored result of a call id, in every branch (explicit sessions only)."""
        p = self.prefix(namespace, session_id)

        async def run() -> list[Message]:
            packed = await self.client.hget(p + ":tool", call_id)
            if not packed:
                return []
            packed = _s(packed)
            hashes = [packed[i:i + 32] for i in range(0, len(packed), 32)]
            bodies = await self.client.hmget(p + ":msg", hashes)
            return [orjson.loads(b) for b in bodies if b is not None]

        return await self._call("recall", run)  # type: ignore[no-any-return]

    async def all_messages(self, namespace: str, session_id: str) -> list[tuple[str, Message]]:
        """Every message of every branch of the session (explicit sessions only)."""
        p = self.prefix(namespace, session_id)

        async def run() -> list[tuple[str, Message]]:
            raw = await self.client.hgetall(p + ":msg")
            return [(_s(h), orjson.loads(b)) for h, b in raw.items()]

        return await self._call("search", run)  # type: ignore[no-any-return]

    # -- long-term memory -----------------------------------------------------------------

    def _memory_key(self, namespace: str, session_id: str, model: str) -> str:
        # a model's vectors apart from another's (their spaces differ)
        tag = hashlib.sha256(model.encode()).hexdigest()[:8]
        return f"{self.prefix(namespace, session_id)}:mem:{tag}"

    async def memory_mark(self, namespace: str, session_id: str, model: str
                          ) -> tuple[int, str]:
        """How many of the session's archived segments were indexed last, and the digest
        of their keys (``memory.covered_digest``; (0, "") when none)."""
        upto, tail = await self._call("memory", lambda: self.client.hmget(
            self._memory_key(namespace, session_id, model), "_upto", "_tail"))
        return (int(upto) if upto is not None and bytes(upto).isdigit() else 0,
                _s(tail) if tail is not None else "")

    async def missing_vectors(self, namespace: str, session_id: str, model: str,
                              fields: list[str]) -> list[int]:
        """The places in ``fields`` (segment keys) that have no vector yet."""
        if not fields:
            return []
        found = await self._call("memory", lambda: self._missing(
            keys=[self._memory_key(namespace, session_id, model)], args=fields))
        return [int(i) - 1 for i in found or []]

    async def put_vectors(self, namespace: str, session_id: str, model: str,
                          fields: list[str], block: bytes, mark: tuple[int, str],
                          retention_days: float | None = None) -> None:
        """Keep a block of segments' vectors (``embeddings.block``), the segments as
        indexed and how far the conversation is, expiring with the session."""
        key = self._memory_key(namespace, session_id, model)
        blocks = key.replace(":mem:", ":memv:", 1)

        async def run() -> None:
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(key, mapping={**dict.fromkeys(fields, "1"), "_upto": str(mark[0]),
                                    "_tail": mark[1]})
            if fields:
                pipe.hset(blocks, f"{mark[0]}:{secrets.token_hex(4)}", block)
            _expire_with_session(pipe, self.prefix(namespace, session_id),
                                 self._ttl_ms(retention_days), key, blocks)
            await pipe.execute()

        await self._call("memory", run)

    async def vector_blocks(self, namespace: str, session_id: str, model: str,
                            names: list[str] | None = None) -> dict[str, bytes]:
        """The session's blocks of vectors by name: every one (a few large values, read in
        one reply), or those of ``names`` still stored."""
        key = self._memory_key(namespace, session_id, model).replace(":mem:", ":memv:", 1)
        if names is None:
            found = await self._call("memory", lambda: self.client.hgetall(key))
            return {_s(k): bytes(v) for k, v in (found or {}).items()}
        if not names:
            return {}
        got = await self._call("memory", lambda: self.client.hmget(key, names))
        return {n: bytes(v) for n, v in zip(names, got or [], strict=False) if v is not None}

    async def vector_block_names(self, namespace: str, session_id: str, model: str
                                 ) -> set[str]:
        """The names of the session's blocks of vectors (a block is never changed once
        stored: a name known is a block known)."""
        key = self._memory_key(namespace, session_id, model).replace(":mem:", ":memv:", 1)
        found = await self._call("memory", lambda: self.client.hkeys(key))
        return {_s(k) for k in found or []}

    async def session(self, namespace: str, session_id: str) -> SessionView | None:
        p = self.prefix(namespace, session_id)

        async def run() -> SessionView | None:
            meta = {_s(k): _s(v) for k, v in (await self.client.hgetall(p + ":meta")).items()}
            if not meta:
                return None
            head = meta.get("head", "0")
            hashes = await self.client.lrange(f"{p}:b:{head}", 0, -1)
            bodies = await self.client.hmget(p + ":msg", hashes) if hashes else []
            branches_raw = {_s(k): v for k, v in
                            (await self.client.hgetall(p + ":branches")).items()}
            live = [_s(b) for b in await self.client.zrange(p + ":bused", 0, -1)] or [head]
            records = await self.client.lrange(p + ":rec", 0, -1)
            internal = await self.client.hgetall(p + ":int")
            branches: dict[str, dict[str, Any]] = {}
            for b in sorted(live, key=int):
                info = orjson.loads(branches_raw[b]) if b in branches_raw \
                    else {"parent": None, "fork_at": 0}
                info["length"] = await self.client.llen(f"{p}:b:{b}")
                branches[b] = info
            size = sum(len(b) for b in bodies if b is not None) \
                + sum(len(r) for r in records) + sum(len(v) for v in internal.values())
            return await offload(is_large(size, len(bodies)), lambda: SessionView(
                session_id=meta.get("sid", session_id), tenant=namespace, head=head,
                messages=[orjson.loads(b) for b in bodies if b is not None],
                branches=branches, records=[orjson.loads(r) for r in records],
                created_ms=int(meta.get("created", "0")),
                updated_ms=int(meta.get("updated", "0")),
                internal={_s(k): orjson.loads(v) for k, v in internal.items()}, size=size))

        return await self._call("read", run)  # type: ignore[no-any-return]

    async def list_sessions(self, namespace: str, offset: int, limit: int
                            ) -> tuple[list[tuple[str, int]], int]:
        key = self._index_key(namespace)

        async def run() -> tuple[list[tuple[str, int]], int]:
            total = await self.client.zcard(key)
            rows = await self.client.zrevrange(key, offset, offset + limit - 1, withscores=True)
            return [(_s(sid), int(score)) for sid, score in rows], int(total)

        return await self._call("list", run)  # type: ignore[no-any-return]


    async def overviews(self, namespace: str, session_ids: list[str]) -> list[Overview]:
        """Each session's ``Overview``, in one round trip (a page of the inspector's list)."""
        async def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for sid in session_ids:
                p = self.prefix(namespace, sid)
                pipe.hmget(p + ":meta", "len", "created", "updated")
                pipe.lrange(p + ":req", 0, -1)
            return list(await pipe.execute()) if session_ids else []

        replies = await self._call("list", run)
        out = []
        for (length, created, updated), raw in zip(replies[::2], replies[1::2], strict=True):
            points = [orjson.loads(r) for r in raw or []]
            out.append(Overview(int(length or 0), len(points),
                                sum(_count(p, "client") for p in points),
                                sum(_count(p, "forwarded") for p in points),
                                tuple({k: p.get(k) for k in ("ts", "model", "client",
                                                             "forwarded", "shared", "head",
                                                             "marks")}
                                      for p in points),
                                int(created or 0), int(updated or 0)))
        return out

    async def stamps(self, namespace: str, session_ids: list[str]
                     ) -> list[tuple[int, int, int, int, int]]:
        """What says whether each session changed since its ``Overview`` was read, in one
        round trip of a few hundred bytes a session: its messages, first and last stored
        times, how many points it keeps, and its newest point's hash (a point added to a
        session's full list of ``MAX_POINTS`` changes that one)."""
        async def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for sid in session_ids:
                p = self.prefix(namespace, sid)
                pipe.hmget(p + ":meta", "len", "created", "updated")
                pipe.llen(p + ":req")
                pipe.lindex(p + ":req", -1)
            return list(await pipe.execute()) if session_ids else []

        replies = await self._call("list", run)
        return [(int(length or 0), int(created or 0), int(updated or 0), int(n or 0),
                 hash(last) if last else 0)
                for (length, created, updated), n, last in zip(
                    replies[::3], replies[1::3], replies[2::3], strict=True)]

    async def namespaces(self) -> list[tuple[str, int]]:
        """Every namespace with stored sessions (tenants, pass-through keys), with its count."""
        prefix = f"{self.cfg.key_prefix}:t:"

        async def run() -> list[tuple[str, int]]:
            out = []
            async for key in self.client.scan_iter(match=prefix + "*:sessions", count=500):
                name = _s(key)[len(prefix):-len(":sessions")]
                out.append((name, int(await self.client.zcard(key))))
            return sorted(out)

        return await self._call("list", run)  # type: ignore[no-any-return]

    async def holders(self, namespaces: list[str], session_id: str) -> list[str]:
        """The namespaces among ``namespaces`` that hold a session with this id."""
        async def run() -> list[str]:
            pipe = self.client.pipeline(transaction=False)
            for ns in namespaces:
                pipe.zscore(self._index_key(ns), session_id)
            found = await pipe.execute()
            return [ns for ns, score in zip(namespaces, found, strict=True) if score is not None]

        return await self._call("list", run)  # type: ignore[no-any-return]


def _count(point: Any, key: str) -> int:
    v = point.get(key) if isinstance(point, dict) else None
    return v if isinstance(v, int) else 0


def _expire_with_session(pipe: Any, prefix: str, ttl_ms: int, *keys: str) -> None:
    """Queue: ``keys`` (of the session at ``prefix``) expire when the session does (in
    ``ttl_ms``, its retention, while it has not synced yet)."""
    pipe.eval(EXPIRE_WITH_SESSION_LUA, 1 + len(keys), prefix + ":meta", *keys, ttl_ms)


def _tokens_field(it: Prepared) -> str:
    return f"{it.encoding}:{it.tokens}" if it.tokens is not None else ""


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def new_generation() -> str:
    """A generation for an exchange log made anew (scripts.INTK)."""
    return uuid.uuid4().hex[:16]


def _loaded(hashes: list[str], encoding: str, internal: list[Any], found: list[Any],
            dated: list[Any]) -> Loaded:
    """``RedisStore.load``'s reply read: the counts made with ``encoding``, how many of the
    messages the session holds, the loop dates."""
    counts: dict[str, int] = {}
    for h, v in zip(hashes, found, strict=True):
        if v is not None:
            enc, _, n = _s(v).rpartition(":")
            if enc == encoding and n.isdigit():
                counts[h] = int(n)
    held = next((i for i, v in enumerate(found) if v is None), len(found))
    dates = {_s(dated[i]): int(dated[i + 1]) for i in range(0, len(dated) - 1, 2)
             if bytes(dated[i + 1]).isdigit()}
    return Loaded(_pairs(internal), counts, held, dates)


def _pairs(flat: list[Any]) -> dict[str, Any]:
    return {_s(flat[i]): orjson.loads(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}


def _now_ms() -> int:
    return int(time.time() * 1000)

