"""The store's write-behind queue: a conversation is reconciled with Redis after its reply, off
the request path — pipelined, coalesced per session, and retried for a bounded time when Redis
is away (``store.write_retry_s``), so an outage delays history instead of losing it.

Two kinds of job. A *sync* makes a session's head hold the conversation a client sent (the SYNC
script: append, keep or fork); a later sync of the same session that extends a queued one
replaces it, since the conversation it carries holds the earlier one whole — but only when its
chain says so: a regenerated reply does not extend the job it replaces the end of, and both are
sent (the second forks). An *append* adds messages whatever the head holds (server-history
mode); appends are never merged and keep their order.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..conversation.messages import Message, canonical_json, content_hash, match_hash
from ..errors import StoreError, StoreLimitExceeded
from ..ops import logs
from ..tasks import Failed, forever, told

log = logs.get("store")
BATCH = 256
MAX_QUEUE = 100_000
LOST_KEPT = 100_000  # sessions remembered for a write given up (server history refuses them)
REWALK_S = 0.05  # a queue held by refusals is walked at most this often
STOP_S = 2.0  # a stop waits this long for the flusher at most
BACKOFF_S, BACKOFF_MAX_S = 0.05, 5.0  # a refused job's wait: doubled each time, at most this
# replies no retry can change (a key of another type, a script's own error): dropped at once
NEVER_RETRIED = ("WRONGTYPE", "ERR Error running script", "ERR user_script")
EMPTY_CHAIN = ""


class Kind:
    CLIENT = "c"  # a message the client sent
    ASSISTANT = "a"  # an assistant message the client sent (maybe restating a reply)
    REPLY = "r"  # a reply the proxy recorded from the upstream


class Prepared(NamedTuple):
    """A message ready for the store: its content hash (its address), match hash (what
    reconciliation compares), stored body, tool id, token count and kind."""

    hash: str
    match: str
    body: bytes
    tool_call_id: str
    tokens: int | None = None
    encoding: str = ""  # the tiktoken encoding the count was made with
    kind: str = Kind.CLIENT


def prepare(msg: Message, tokens: int | None = None, reply: bool = False) -> Prepared:
    body = canonical_json(msg)
    key = content_hash(body)
    tid = msg.get("tool_call_id") if msg.get("role") == "tool" else ""
    kind = Kind.REPLY if reply else Kind.ASSISTANT if msg.get("role") == "assistant" \
        else Kind.CLIENT
    return Prepared(key, match_hash(msg, key, body), body, tid if isinstance(tid, str) else "",
                    tokens, "", kind)


def held_bytes(items: list[Prepared]) -> int:
    """What queued items hold: each its body, two hashes and its tuple (~320 bytes)."""
    return sum(len(it.body) for it in items) + 320 * len(items)


def chain_next(prev: str, match: str) -> str:
    return hashlib.sha1((prev + match).encode()).hexdigest()


@dataclass
class Job:
    namespace: str
    session_id: str
    items: list[Prepared]
    retention_days: float | None
    append: bool = False  # an append job (server-history mode), else a sync
    # append: what makes it applied once however often it is sent (APPEND_LUA)
    token: str = ""
    system: int = 0  # append: leading system items, stored only when they open the session
    chains: list[str] = field(default_factory=list)  # sync: chain after each item
    hint: int = 0
    retry_hint: int | None = None
    attempts: int = 0
    not_before: float = 0.0  # a job Redis refused waits (backing off) before it is sent again
    deadline: float = 0.0
    size: int = 0  # bytes it holds, roughly (the queue is bounded in bytes)
    points: list[bytes] = field(default_factory=list)  # per-request token points it carries
    # the time its write gave the session (its last use): the sessions' listing says the same
    written_ms: int = 0
    internal_seq: int = 0  # RedisStore._internal_seq when its script was sent

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.session_id)

    def extended_by(self, other: Job) -> bool:
        """Whether ``other`` carries this job's conversation whole (and then some)."""
        n = len(self.items)
        return not self.append and not other.append and len(other.items) >= n \
            and other.chains[n] == self.chains[n] \
            and other.retention_days == self.retention_days


Runner = Callable[[list[Job]], Awaitable[list[Any]]]
Settler = Callable[[Job, Any], bool]  # True: done; False: send again


class WriteBehind:
    """Queued jobs, flushed in batches by one task; ``run`` sends a batch (a pipeline),
    ``settle`` applies a job's reply."""

    def __init__(self, run: Runner, settle: Settler, available: Callable[[], float],
                 retry_s: float, on_lost: Callable[[Job, str], None],
                 max_bytes: int = 256 << 20, depth: Callable[[int], None] = lambda n: None,
                 on_refused: Callable[[Job, str], None] = lambda job, why: None,
                 failed: Failed | None = None):
        self._run = run
        self._failed = failed  # told of the flusher's own failures (it is started again)
        self._on_refused = on_refused  # told of each job Redis refused (counted, logged)
        self._settle = settle
        self._available_in = available  # seconds until the store is tried again (0: now)
        self.retry_s = retry_s
        self._on_lost = on_lost
        self._queue: list[Job] = []
        self._depth = depth  # told the queue's length (a gauge)
        self.max_bytes = max_bytes
        self.bytes = 0
        self._queued: dict[tuple[str, str], Job] = {}  # the newest sync job per session
        self._in_flight = 0
        self._sending: list[Job] = []  # the batch being sent (a stop may cut it short)
        # per session, its jobs not yet written nor given up (queued, waiting, being sent),
        # and a write about to be submitted (``reserve``): a turn still being counted
        self._open: collections.Counter[tuple[str, str]] = collections.Counter()
        # the sessions a write was given up for (bounded: the oldest forgotten first)
        self._lost: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        # Redis refusing every write (out of memory, read-only): one job probes it at a
        # doubling interval, the rest wait, so the work is not the queue's length each time
        self._streak = 0  # flushes in a row whose every job was refused
        self._probe_at = 0.0  # until then nothing is sent
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        # supervised: whatever kills a run of the flusher is logged, counted, and the
        # flusher started again (it died silently in 7 of 18 Redis Cluster master kills)
        self._task = asyncio.create_task(forever("write_behind", self._flush_forever,
                                                 self._failed))

    async def stop(self) -> None:
        """Stop flushing: a stop waits at most STOP_S for the flusher, whatever it is in
        (a cancel lost inside a client library must not keep the process from exiting: one
        run went on 290 s after SIGTERM while Redis refused its writes)."""
        if self._task is not None:
            self._task.cancel()
            try:
                async with asyncio.timeout(STOP_S):
                    await asyncio.shield(self._task)
            except asyncio.CancelledError:
                pass
            except TimeoutError:
                log.warning("write-behind flusher did not stop; leaving it",
                            extra={"jobs": len(self._queue)})
        self._unwritten_at_stop()

    def _unwritten_at_stop(self) -> None:
        """What a stop leaves unwritten (Redis refusing writes, or away): every job given up
        as lost (each logged and counted, ``on_lost``), and one line with the totals — the
        turns were answered, and are not in the history."""
        left = [*self._sending, *self._queue]
        self._sending, self._queue = [], []
        if not left:
            return
        messages = sum(len(job.items) for job in left)
        log.error("stopping with history writes not stored: %d jobs, %d messages lost",
                  len(left), messages, extra={"jobs": len(left), "messages": messages})
        for job in left:
            self._drop(job, "the proxy stopped before Redis took it")
        self.bytes = 0
        self._depth(0)

    @property
    def pending(self) -> int:
        return len(self._queue) + self._in_flight

    @property
    def refusing(self) -> bool:
        """Whether Redis refused every write of the last flush (out of memory, read-only):
        history is not being stored while it does."""
        return self._streak > 0

    def holds(self, key: tuple[str, str]) -> bool:
        """Whether a write of this session is outstanding (reserved, queued, waiting or
        being sent)."""
        return self._open[key] > 0

    def reserve(self, key: tuple[str, str]) -> None:
        """A write of this session is on its way (its turn answered, still being counted):
        outstanding from now until ``release``, so no read runs before it is queued."""
        self._open[key] += 1

    def release(self, key: tuple[str, str]) -> None:
        """The end of a ``reserve`` (its job, if any, was submitted: outstanding by itself)."""
        self._open[key] -= 1
        if self._open[key] <= 0:
            del self._open[key]

    def lost(self, key: tuple[str, str]) -> bool:
        """Whether a write of this session was given up (Redis refused it past the retry
        time, the queue was full, the store's limits): what Redis holds of it has a gap."""
        return key in self._lost

    async def written(self, key: tuple[str, str], timeout: float) -> bool:
        """Wait until no write of this session is outstanding; False if one still is after
        ``timeout`` seconds (one given up is not)."""
        deadline = time.monotonic() + timeout
        while self.holds(key):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def _closed(self, job: Job) -> None:
        """``job`` is written, given up, or carried by a newer one of its session."""
        self.release(job.key)

    def submit(self, job: Job) -> None:
        job.deadline = time.monotonic() + self.retry_s
        job.size = job.size or held_bytes(job.items)
        queued = None if job.append else self._queued.get(job.key)
        if queued is not None and queued.extended_by(job):
            self.bytes += job.size - queued.size
            queued.items, queued.chains, queued.size = job.items, job.chains, job.size
            queued.points += job.points  # the earlier requests' points stay
            queued.deadline = job.deadline
        else:
            self._queue.append(job)
            self._open[job.key] += 1
            self.bytes += job.size
            if not job.append:
                self._queued[job.key] = job
        over = 0  # the oldest jobs past the bounds, dropped in one cut (not one pop(0) each)
        size, count = self.bytes, len(self._queue)
        while count - over > 1 and (count - over > MAX_QUEUE or size > self.max_bytes):
            size -= self._queue[over].size
            over += 1
        if over:
            dropped, self._queue = self._queue[:over], self._queue[over:]
            self.bytes = size
            for old in dropped:
                self._drop(old, "write-behind queue full")
        self._depth(len(self._queue))
        self._wake.set()

    async def drain(self, timeout: float = 5.0) -> bool:
        """Wait until every queued job is written (or given up); False on timeout."""
        deadline = time.monotonic() + timeout
        while self.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return not self.pending

    def _drop(self, job: Job, why: str) -> None:
        if self._queued.get(job.key) is job:
            del self._queued[job.key]
        self._closed(job)
        self._lost[job.key] = None
        self._lost.move_to_end(job.key)
        if len(self._lost) > LOST_KEPT:
            self._lost.popitem(last=False)
        self._on_lost(job, why)

    def _requeue(self, job: Job, why: str, backoff: bool = False) -> None:
        """Queue ``job`` again; ``backoff``: Redis refused it (out of memory, read-only after
        a failover, busy, loading), so it waits, doubling each time, instead of being sent
        again at once (one refused job was sent 18,000 times a second)."""
        job.attempts += 1
        if time.monotonic() > job.deadline:
            self._drop(job, why)
            return
        if backoff:
            job.not_before = time.monotonic() + min(BACKOFF_MAX_S,
                                                    BACKOFF_S * 2 ** min(job.attempts, 16))
        if not job.append and self._queued.get(job.key) not in (None, job):
            self._closed(job)
            return  # a newer sync of the session is queued: it carries this one
        self._queue.append(job)
        self.bytes += job.size
        if not job.append:
            self._queued[job.key] = job

    async def _flush_forever(self) -> None:
        if self._queue:
            self._wake.set()  # started again after a failure: what waits is sent
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                wait = max(self._available_in(), self._probe_at - time.monotonic())
                if wait > 0:
                    await asyncio.sleep(min(max(0.05, wait), 1.0))
                    self._expire()
                    continue
                batch, self._queue = self._ready(time.monotonic(),
                                                 1 if self._streak else BATCH)
                if not batch:
                    # what waits on a refusal waits (and a session's later jobs behind it);
                    # anything submitted meanwhile wakes this — but the queue is walked at
                    # most every REWALK_S however many requests come (a walk a request made
                    # each one cost the whole queue: 11,700 held jobs, 2.3 -> 6.9 ms a request)
                    soonest = min(j.not_before for j in self._queue)
                    await asyncio.sleep(REWALK_S)
                    # asyncio.timeout, not wait_for: a cancellation arriving as the wake does
                    # is never swallowed (3.11's wait_for can lose it: the proxy then never
                    # stopped on SIGTERM while Redis refused its writes)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(
                                min(max(0.0, soonest - time.monotonic()), 1.0)):
                            await self._wake.wait()
                    self._wake.clear()
                    self._expire()
                    continue
                for job in batch:
                    self.bytes -= job.size
                    if self._queued.get(job.key) is job:
                        del self._queued[job.key]
                self._in_flight = len(batch)
                self._sending = batch
                self._depth(len(self._queue))
                try:
                    await self._flush(batch)
                    self._sending = []  # (cancelled by a stop, it is the stop's to count)
                finally:
                    self._in_flight = 0

    def _ready(self, now: float, size: int = BATCH) -> tuple[list[Job], list[Job]]:
        """The next batch (at most ``size``) and what stays queued: jobs in the order
        queued, but none that waits on a refusal and none of a session behind one of its
        own that is not sent now (a session's turns are stored in the order they came: an
        append that waited less must not overtake one that waits). A full batch ends the
        walk: the rest stays as it is."""
        batch: list[Job] = []
        rest: list[Job] = []
        held: set[tuple[str, str]] = set()
        for i, job in enumerate(self._queue):
            if len(batch) >= size:
                rest.extend(self._queue[i:])
                break
            if job.not_before <= now and job.key not in held:
                batch.append(job)
            else:
                held.add(job.key)
                rest.append(job)
        return batch, rest

    def _expire(self) -> None:
        """While the store is away, jobs past their deadline are given up."""
        now = time.monotonic()
        keep = []
        for job in self._queue:
            if now > job.deadline:
                self.bytes -= job.size
                self._drop(job, "store unavailable")
            else:
                keep.append(job)
        self._queue = keep

    async def _flush(self, batch: list[Job]) -> None:
        """Send a batch and settle each job: whatever fails, every job of the batch is
        requeued, dropped or closed (a job left open keeps its session waiting for good)."""
        try:
            replies = await self._run(batch)
        except Exception as exc:  # noqa: BLE001 - StoreError, or a client library's own
            if not isinstance(exc, StoreError):  # (redis-py's RuntimeError reconnecting)
                log.exception("write-behind flush raised; will retry",
                              extra={"jobs": len(batch)})
                told(self._failed, "write_behind_flush")
            else:
                log.warning("write-behind flush failed; will retry",
                            extra={"jobs": len(batch), "error": str(exc)})
            for job in batch:
                self._requeue(job, str(exc))
            return
        if len(replies) != len(batch):
            log.error("write-behind flush: %d replies for %d jobs; will retry",
                      len(replies), len(batch))
            told(self._failed, "write_behind_flush")
            for job in batch:
                self._requeue(job, "replies missing")
            return
        refused = sum(isinstance(r, Exception) and not isinstance(r, StoreLimitExceeded)
                      and not str(r).startswith(NEVER_RETRIED) for r in replies)
        if refused and refused == len(batch):  # Redis refuses writes: probe it, doubling
            self._probe_at = time.monotonic() + min(BACKOFF_MAX_S,
                                                    BACKOFF_S * 2 ** min(self._streak, 16))
            self._streak += 1
        else:
            self._streak, self._probe_at = 0, 0.0
        for job, reply in zip(batch, replies, strict=True):
            if isinstance(reply, StoreLimitExceeded):
                self._drop(job, str(reply))
            elif isinstance(reply, Exception):
                why = str(reply)
                self._on_refused(job, why)
                if why.startswith(NEVER_RETRIED):
                    self._drop(job, why)  # sending it again cannot succeed
                else:
                    self._requeue(job, why, backoff=True)
            else:
                try:
                    done = self._settle(job, reply)
                except StoreError as exc:
                    self._drop(job, str(exc))
                    continue
                except Exception:  # noqa: BLE001 - a reply it cannot read: not stored, told
                    log.exception("write-behind: a write's reply could not be read")
                    told(self._failed, "write_behind_settle")
                    self._drop(job, "unreadable reply")
                    continue
                if done:
                    self._closed(job)
                else:
                    self._requeue(job, "stale hint")


def chain_hashes(matches: list[str], known: tuple[list[str], list[str]] | None) -> list[str]:
    """The chain after each match hash (``[""]`` first: before any), reusing ``known`` (the
    matches and chains sent last time) for the prefix they share."""
    chains = [EMPTY_CHAIN]
    if known is not None:
        old, cached = known
        if len(old) <= len(matches) and matches[:len(old)] == old:
            k = len(old)  # the usual case, one comparison in C: the conversation grew
        else:
            k = 0
            limit = min(len(old), len(matches))
            while k < limit and old[k] == matches[k]:
                k += 1
        chains = cached[:k + 1]
    for m in matches[len(chains) - 1:]:
        chains.append(chain_next(chains[-1], m))
    return chains


def lost_message(job: Job) -> dict[str, Any]:
    return {"tenant": job.namespace, "messages": len(job.items),
            "kind": "append" if job.append else "sync"}
