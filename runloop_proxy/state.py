"""The state every request shares: config, clients, store and caches, created once in the
lifespan (app.py) and reached through ``state_of(request)``. Nothing here is imported back from
the modules that use it: this module sits below them all."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from starlette.requests import HTTPConnection

from . import savings
from .caches import SHARES, STORE_CACHES, ByteLRU, message_bytes
from .config import (
    ProxyConfig,
    ServerSection,
    Settings,
    config_mtimes,
    load_config,
    redact_url,
)
from .errors import ConfigError, StoreError
from .history.embedded import EmbeddedRedis
from .history.store import RedisStore
from .history.summaries import Job, SummaryService
from .ops import logs
from .ops.metrics import Metrics
from .pipeline.embeddings import StaticEmbedder
from .pipeline.limits import LearnedWindows
from .pipeline.masking import MaskTables
from .pipeline.memory import Memory, Model
from .pipeline.shadow import ShadowBook
from .pipeline.shares import Shares
from .pipeline.tokens import WARM_ENCODINGS, TokenCounter, encoding_name_for
from .pipeline.upstream import UpstreamClient
from .pipeline.values import Recent, Turn
from .pricing import PriceTable, Provider
from .savings import Meter, Prompt, Savings
from .tasks import once
from .window.builder import Carry

log = logs.get("state")
RELOAD_POLL_S = 2.0
BACKGROUND_WORKERS = 4  # worker threads beside one per large request (server.large_requests)
ADMIN_LOGIN_S = 12 * 3600  # an inspector login's life
FIRST_SEEN_ENTRY_BYTES = 320  # a session, a position, a message hash and a timestamp
BILL_ENTRY_BYTES = 1400  # a session's Meter, its chains and totals (tracemalloc: 1.13 KB), a key
CLOSE_STALE_AFTER_S = 60.0


@dataclass
class AppState:
    settings: Settings
    config: ProxyConfig
    metrics: Metrics
    tokens: TokenCounter
    upstreams: dict[str, UpstreamClient] = field(default_factory=dict)
    store: RedisStore | None = None
    embedded: EmbeddedRedis | None = None
    background: set[asyncio.Task[object]] = field(default_factory=set)
    loop: asyncio.AbstractEventLoop | None = None  # the one the app runs on (set at startup)
    # the admin's logins' epoch when there is no store to keep it in (one replica's own)
    local_logins: str = field(default_factory=lambda: secrets.token_hex(16))
    # the loop's worker threads and how many (``start_workers``)
    _workers: tuple[ThreadPoolExecutor, int] | None = field(default=None, init=False,
                                                            repr=False)

    def __post_init__(self) -> None:
        # every per-process cache, bounded in bytes: its share of server.cache_mb, given
        # by ``resize`` (at start and at each reload)
        self.cuts: ByteLRU[tuple[str, int], Any] = ByteLRU(0)
        self.first_seen: ByteLRU[str, int] = ByteLRU(0, lambda k, v: FIRST_SEEN_ENTRY_BYTES)
        self.window_memo: ByteLRU[tuple[str, ...], Any] = ByteLRU(0)
        # (namespace, session) -> the last window's carry (window/builder.py)
        self.carries: ByteLRU[tuple[str, str], Carry] = ByteLRU(0, carry_size)
        # (namespace, session) -> its last request, hashed and counted (pipeline/reconcile.py)
        self.recent: ByteLRU[tuple[str, str], Recent] = ByteLRU(0, lambda k, v: v.size)
        # (namespace, session) -> its prompts' bills, both sides (savings.py): what the
        # dashboard's headline adds up; a session evicted starts its chains again
        self.bills: ByteLRU[tuple[str, str], Meter] = ByteLRU(0, lambda k, v: BILL_ENTRY_BYTES)
        self._bill_prices: tuple[Any, list[Provider]] | None = None
        # (namespace, session) -> its last recorded prompts, as sent and as forwarded: what
        # the next request's point says it shares with them (``compared``)
        self.prompts: ByteLRU[tuple[str, str], tuple[Prompt, Prompt]] = ByteLRU(
            0, prompts_size)
        # (namespace, session) -> its row in the inspector's list, priced, and what says
        # whether it changed since (ops/inspector_list.py)
        self.listed: ByteLRU[tuple[str, str], Listed] = ByteLRU(0, listed_size)
        # (scope, model) -> the window its upstream's overflow error said (pipeline/limits.py)
        self.windows = LearnedWindows(0)
        # the tables that mask the credentials of a request in its answer (upstream.py)
        self.masks = MaskTables(0)
        server = self.config.server
        # answers read whole, in bytes: a share each tenant (pipeline/shares.py)
        self.answers = Shares("room for answers read whole", server.held_answers_mb << 20,
                              server.tenant_share, self._refused)
        # requests whose large work is done in worker threads: a share each tenant, so
        # one tenant's huge bodies leave the threads (and the GIL) to the others
        self.large = Shares("large requests", server.large_requests, server.tenant_share,
                            self._refused)
        self.summaries = SummaryService(self)
        # long-term memory (policy.memory): the embedded model loads on first use
        self.memory = Memory(StaticEmbedder(), self.metrics, self.spawn, 0, host=self,
                             calls=self.summaries.calls, given=self.summaries.wake)
        self.resize(server)
        self.shadows = ShadowBook()  # shadow comparisons and spend, per tenant (today's)
        self.metrics.prices = self.config.prices

    def resize(self, server: ServerSection) -> None:
        """Every bound of ``server`` the process holds made what it says, for what comes
        next (at start, and at a reload that changed them): each cache's share of
        ``cache_mb`` (what a smaller one leaves over dropped now), the answers read whole
        (``held_answers_mb``), the large requests and their worker threads
        (``large_requests``), the summaries' model calls (``summary_calls``), each
        tenant's ``tenant_share`` of them. (An upstream's connections: ``sync_upstreams``.)"""
        budget = server.cache_mb << 20

        def share(name: str) -> int:
            return int(budget * SHARES[name])

        for name, cache in (("cuts", self.cuts), ("first_seen", self.first_seen),
                            ("memo", self.window_memo), ("carries", self.carries),
                            ("recent", self.recent), ("bills", self.bills),
                            ("prompts", self.prompts), ("listed", self.listed)):
            cache.resize(share(name))
        self.tokens.resize(share("tokens"), share("factors"), share("models"))
        self.windows.resize(share("windows"))
        self.masks.resize(share("masks"))
        self.memory.vectors.resize(share("vectors"))
        self.memory.cuts.resize(share("segment_cuts"))
        if self.store is not None:
            self.store.resize({name: share(name) for name in STORE_CACHES})
        self.summaries.resize(budget * SHARES["summaries"], server.summary_calls,
                              server.tenant_share)
        self.answers.resize(server.held_answers_mb << 20, server.tenant_share)
        self.large.resize(server.large_requests, server.tenant_share)
        if self.loop is not None:
            self.start_workers(server.large_requests + BACKGROUND_WORKERS)

    def start_workers(self, n: int) -> None:
        """The worker threads large work runs in (offload.py: the loop's default executor),
        ``n`` of them: one per large request admitted (``large``) and a few for background
        work (summaries' digests, DNS). Made again when their number changes; the old ones
        finish what they were given, then end."""
        if self._workers is not None and self._workers[1] == n:
            return
        assert self.loop is not None
        old = self._workers
        pool = ThreadPoolExecutor(n, thread_name_prefix="runloop")
        self.loop.set_default_executor(pool)
        self._workers = (pool, n)
        if old is not None:
            old[0].shutdown(wait=False)

    def compared(self, namespace: str, session_id: str, prompts: tuple[Prompt, Prompt] | None
                 ) -> dict[str, list[Any]]:
        """What a recorded request's prompts (as sent, as forwarded) share with the session's
        last ones and their heads, as its point keeps them (``savings``); nothing when the
        last ones are not known here (the session's first request, one this replica has not
        served, or evicted: the point is read as one recorded without them, which prices a
        first request the same), only its heads."""
        if prompts is None:
            return {}
        key = (namespace, session_id)
        last = self.prompts.get(key)
        self.prompts[key] = prompts
        return savings.facts(prompts, last)

    def bill(self, namespace: str, session_id: str, label: str, model: str,
             tokens: tuple[int, int], at: float, facts: dict[str, list[Any]] | None = None
             ) -> Savings:
        """A recorded request's prompt priced on both sides (``savings``; ``facts``: what
        ``compared`` said of it), counted in runloop_prompt_bill_usd_total under its tenant
        and model."""
        prices = self.config.prices
        if self._bill_prices is None or self._bill_prices[0] is not prices:
            self._bill_prices = (prices, savings.providers(prices or PriceTable.load()))
        key = (namespace, session_id)
        meter = self.bills.get(key)
        if meter is None:
            meter = Meter(self._bill_prices[1])
        facts = facts or {}
        shared, head = facts.get("shared"), facts.get("head")
        one = meter.add(model, tokens[0], tokens[1], at, shared,
                        (head[0], head[1]) if head else (0, 0),
                        savings.marks_of(facts.get("marks")))
        self.bills[key] = meter
        if one.priced:
            b = self.metrics.bound(label, self.metrics.model_label(label, model))
            b.bill_client.inc(one.client_usd)
            b.bill_forwarded.inc(one.forwarded_usd)
        return one

    def _refused(self, resource: str, reason: str) -> None:
        """A request refused for a bounded resource: counted (the log line is its
        error's, where it is answered)."""
        self.metrics.share_refusals.labels(resource.split(" to ")[0], reason).inc()

    def spawn(self, coro: Coroutine[Any, Any, object]) -> asyncio.Future[Any]:
        """Run work off the request path, supervised (``tasks.once``: an exception logged
        with its traceback and counted); keep a reference so it is not collected
        mid-flight. The task, for a caller that must see it end (a server-history turn
        waits for its write: ``relay.kept``)."""
        name = getattr(coro, "__qualname__", None) or "background"
        task = asyncio.ensure_future(once(name, coro, self.background_failed))
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    def background_failed(self, name: str) -> None:
        self.metrics.background_failures.labels(name).inc()

    def init_metrics(self) -> None:
        """Every tenant's series exported from the start (see Metrics.init_tenants)."""
        cfg = self.config
        self.metrics.init_tenants(["passthrough"] if cfg.passthrough else list(cfg.tenants))

    def memory_model(self, turn: Turn) -> Model:
        """What ``turn``'s long-term memory embeds with (``Memory.model_for``): its tenant's
        model through the upstream with the key its summaries take, or the embedded one."""
        if turn.policy.memory != "upstream" or turn.caller.namespace is None:
            return self.memory.local()
        return self.memory.model_for(Job.of(turn))

    def upstream(self, name: str) -> UpstreamClient:
        return self.upstreams[name]

    async def sync_upstreams(self, config: ProxyConfig | None = None) -> None:
        """The clients of ``config``'s upstreams (the current config's when None), made
        before either changes; then the config and its clients are swapped in one step, so
        no request ever reads a key from one config and the client of another. A client
        kept takes the new ``tenant_share`` of its connections; one whose connection pool
        changes (its spec, or the connections kept for ``summary_calls``) is made again."""
        config = config or self.config
        server = config.server
        old = self.upstreams
        new: dict[str, UpstreamClient] = {}
        for name, spec in config.upstreams.items():
            client = old.get(name)
            if client is not None and client.spec == spec \
                    and client.summary_connections == server.summary_calls:
                client.connections.resize(spec.max_connections, server.tenant_share)
            else:
                # the pass-through upstream is the URL its user typed (--upstream): errors
                # name it so; a configured one is named by its name alone
                typed = config.passthrough is not None and name == config.passthrough.upstream
                client = UpstreamClient(name, spec, redact_url(spec.url) if typed else None,
                                        self.masks, server.tenant_share, self.answers,
                                        self._refused, server.summary_calls)
                await client.start()
            new[name] = client
        self.config, self.upstreams = config, new
        stale = [c for n, c in old.items() if new.get(n) is not c]
        if stale:
            # In-flight requests still hold the old clients: each closes once it is idle
            for client in stale:
                self.spawn(client.close_when_idle(CLOSE_STALE_AFTER_S))

    async def warm_encodings(self, config: ProxyConfig) -> None:
        """Load the encodings the config's models use now, bounded in time, never on a
        request (tiktoken fetches what is not shipped offline)."""
        await asyncio.get_running_loop().run_in_executor(
            None, self.tokens.warm, [*WARM_ENCODINGS, *_configured_encodings(config)])
        log.info("encodings loaded", extra={"encodings": self.tokens.encoding_names()})

    async def logins(self, ttl_ms: int, start: bool = False) -> str | None:
        """The epoch every admin login cookie is signed with (``RedisStore.logins_epoch``;
        this process's own without a store); None when none holds. Raises StoreError: a
        caller fails closed."""
        if self.store is None:
            return self.local_logins
        return await self.store.logins_epoch(ttl_ms, start)

    async def end_logins(self, ttl_ms: int) -> None:
        """End every admin login made so far (a logout, an admin key rotated)."""
        self.local_logins = secrets.token_hex(16)
        if self.store is not None:
            await self.store.end_logins(ttl_ms)

    async def reload(self, reason: str) -> bool:
        before = self.config.server.admin_key
        try:
            config = load_config(self.settings)
        except ConfigError as exc:
            self.metrics.config_reloads.labels("error").inc()
            log.error("config reload failed; keeping the last good config",
                      extra={"reason": reason, "error": str(exc)})
            return False
        await self.warm_encodings(config)
        await self.sync_upstreams(config)
        self.resize(config.server)
        self.metrics.prices = config.prices
        self.init_metrics()
        self.metrics.config_reloads.labels("ok").inc()
        log.info("config reloaded", extra={"reason": reason, "tenants": len(config.tenants)})
        if config.server.admin_key != before:  # a rotated key ends the logins it made
            try:
                await self.end_logins(ADMIN_LOGIN_S * 1000)
            except StoreError as exc:
                log.error("admin key rotated, but the logins it made could not be ended: "
                          "the old key's cookies fail on every replica that reloaded",
                          extra={"error": str(exc)})
        return True

    async def watch_config(self) -> None:
        """Reload when a config file changes (polled: no inotify in every container)."""
        seen = config_mtimes(self.settings.config_dir)
        while True:
            await asyncio.sleep(RELOAD_POLL_S)
            now = config_mtimes(self.settings.config_dir)
            if now != seen:
                seen = now
                await self.reload("file change")


STR_BYTES = 49  # a str's own bytes in CPython, its characters apart (ASCII)


def prompts_size(key: tuple[str, str], prompts: tuple[Prompt, Prompt]) -> int:
    """What a session's last prompts hold: a key (a pointer) and a count (four bytes) a
    block on each side, and the keys' strings — the messages' hashes, which the forwarded
    side shares but for the blocks a window rewrote (held by the conversation too while it
    is cached, counted here all the same: it may be evicted first)."""
    client, forwarded = prompts
    mine = set(client.keys)
    own = [k for k in forwarded.keys if k not in mine] if forwarded is not client else []
    # map, not a generator: the sum is made on the event loop, in C, not a call a message
    strings = STR_BYTES * (len(mine) + len(own)) + sum(map(len, mine)) + sum(map(len, own))
    marks = 8 * (len(client.marks) + len(forwarded.marks))
    return 400 + 12 * (len(client.keys) + len(forwarded.keys)) + strings + marks


class Listed(NamedTuple):
    """A session's row in the inspector's list, as priced when the session was as
    ``stamp`` says (``store.stamps``), at ``prices``."""

    stamp: tuple[int, int, int, int, int]
    prices: Any  # the price table it was priced at (a reload's new table prices it again)
    row: Any  # listing.Row


def listed_size(key: tuple[str, str], listed: Listed) -> int:
    """What a listed row holds: the key's strings and the row's (its tenant and id, its
    models' names; counted apart, though the row's are mostly the key's), the stamp's ints,
    the row's and its bill's objects."""
    row = listed.row
    strings = sum(STR_BYTES + len(t) for t in (*key, row.tenant, row.session_id, *row.models))
    return 620 + strings + 8 * len(row.models)


def carry_size(key: tuple[str, str], carry: Carry) -> int:
    """What a carried window holds: the conversation's messages — their text as Python holds
    it, not their tokens (a token of o200k can be 128 spaces: counted at four bytes a token,
    2 MB of spaces passed for 64 KB) — and a few hundred bytes of derived facts per
    message."""
    conv = carry.conv
    return max(conv.prefix[-1] * 4, sum(map(message_bytes, conv.messages))) + conv.n * 600


def state_of(request: HTTPConnection) -> AppState:
    state: AppState = request.app.state.runloop
    return state


def _configured_encodings(config: ProxyConfig) -> list[str]:
    tenants = [*config.tenants.values(), *([config.passthrough] if config.passthrough else [])]
    names = (spec.encoding or encoding_name_for(model)
             for t in tenants for model, spec in t.models.items())
    return sorted({n for n in names if n})
