"""A tenant's embedding model through its upstream's ``/v1/embeddings`` (memory = "upstream").

Called as the summaries call their model: with the key the proxy holds for the tenant (the
caller's own where the tenant forwards client keys), to the tenant's upstream or its
``embedding_upstream`` (then with that upstream's own key only), and only while the upstream
is the one the key was taken for. Every call holds one of the background model calls
(``SummaryService.calls``: ``server.summary_calls`` in all, ``tenant_share`` of them a
tenant; the connections each upstream keeps beside ``max_connections`` for them), its
tokens are counted from the upstream's ``usage`` (a metric, and the tenant's day in Redis,
every replica's) and, with ``embedding_daily_tokens``, capped: past the cap, or while Redis
cannot say what was spent, no call goes. Whatever fails is an ``EmbeddingError``: indexing
is left to the next answer, a search answers by words, and says so.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from ..errors import EmbeddingError, ProxyError, ProxyFull, StoreError, TenantOverShare
from ..ops import logs
from .embeddings import unit

if TYPE_CHECKING:
    from ..config import Policy, ProxyConfig, UpstreamSpec
    from ..history.store import RedisStore
    from ..ops.metrics import Metrics
    from .embeddings import Vectors
    from .shares import Shares
    from .upstream import UpstreamClient

log = logs.get("memory")
EMBED_ANSWER_BYTES = 64 << 20  # an embeddings answer read whole (64 vectors of 16,384 floats)
SPEND = "embedding"  # the day's ledger of the tenant's embedding tokens (RedisStore)


class Host(Protocol):
    """What the calls need of the app (``state.AppState``, as the summaries' ``Host``)."""

    config: ProxyConfig
    metrics: Metrics
    store: RedisStore | None

    def upstream(self, name: str) -> UpstreamClient: ...


class Job(Protocol):
    """Who the calls are for (``history.summaries.Job`` is one): the tenant's policy and
    upstream, the key taken for it, and who holds the share."""

    @property
    def policy(self) -> Policy: ...
    @property
    def tenant(self) -> str: ...
    @property
    def label(self) -> str: ...
    @property
    def upstream(self) -> str: ...
    @property
    def auth(self) -> str | None: ...
    @property
    def drop_headers(self) -> frozenset[str]: ...
    @property
    def spec(self) -> UpstreamSpec | None: ...
    @property
    def holder(self) -> str: ...


def stored_name(upstream: str, model: str, dim: int) -> str:
    """What a model's vectors are kept under: its upstream, its name and its size, so that
    two models' (or one model's at two sizes) never meet in a session's matrix."""
    return f"upstream:{upstream}/{model}/{dim}"


def utc_day() -> str:
    return time.strftime("%Y-%m-%d", time.gmtime())


class UpstreamModel:
    """The tenant's ``embedding_model`` for one piece of work (an indexing, a search): what
    ``Memory`` embeds with when the policy says "upstream"."""

    inline = False  # a search embeds only its query: segments are embedded after answers

    def __init__(self, host: Host, job: Job, calls: Shares, given: Any = None):
        policy = job.policy
        assert policy.embedding_model and policy.embedding_dimensions
        self.host, self.job, self.calls, self._given = host, job, calls, given
        self.model, self.dim = policy.embedding_model, policy.embedding_dimensions
        self.upstream = policy.embedding_upstream or job.upstream
        self.name = stored_name(self.upstream, self.model, self.dim)

    async def vectors(self, texts: list[str], op: str) -> Vectors:
        """Unit vectors, a row per text, from one call (``op``: "index" or "search", what
        its tokens are counted under)."""
        import numpy as np

        if not texts:
            return np.zeros((0, self.dim), np.float32)
        job, metrics = self.job, self.host.metrics
        await self._within_cap(op)
        try:
            self.calls.take(job.holder, 1, "background model calls")
        except (TenantOverShare, ProxyFull) as exc:
            metrics.memory.labels(job.label, op, "over_share").inc()
            raise EmbeddingError(f"the embedding model's calls are at their share ({exc})"
                                 ) from exc
        try:
            data = await self._call(texts)
        finally:
            self.calls.give(job.holder)
            if self._given is not None:
                self._given()
        rows, tokens = self._read(data, len(texts))
        if tokens:
            metrics.memory_tokens.labels(job.label, op).inc(tokens)
            await self._spent(tokens)
        return unit(rows)

    async def _within_cap(self, op: str) -> None:
        cap, store = self.job.policy.embedding_daily_tokens, self.host.store
        if cap is None:
            return
        try:
            if store is None:
                raise StoreError("no store")
            spent, _ = await store.shadow_spend(self.job.tenant, utc_day(), SPEND)
        except StoreError as exc:  # fail closed: a cap per replica is the cap times them
            raise EmbeddingError(f"the embedding spend ledger is unavailable ({exc})"
                                 ) from exc
        if spent >= cap:
            self.host.metrics.memory.labels(self.job.label, op, "capped").inc()
            raise EmbeddingError(f"the embedding model's tokens for today are spent "
                                 f"({spent} of embedding_daily_tokens = {cap})")

    async def _spent(self, tokens: int) -> None:
        store = self.host.store
        if store is None:
            return
        try:
            await store.add_shadow_spend(self.job.tenant, utc_day(), tokens, 0, SPEND)
        except StoreError as exc:
            log.warning("memory: an embedding call's tokens not added to the day's",
                        extra={"tenant": self.job.tenant, "tokens": tokens,
                               "error": str(exc)})

    async def _call(self, texts: list[str]) -> Any:
        from .upstream import json_headers, upstream_headers

        job = self.job
        auth, name = job.auth, job.upstream
        if self.upstream != job.upstream:
            # another upstream: its own key only, never the tenant's or the client's
            # (config validation refuses one without a key)
            spec = self.host.config.upstreams.get(self.upstream)
            if spec is None or not spec.api_key:
                raise EmbeddingError(f"embedding upstream {self.upstream!r} has no key "
                                     f"of its own")
            auth, name = f"Bearer {spec.api_key}", self.upstream
        try:
            client = self.host.upstream(name)
        except KeyError as exc:
            raise EmbeddingError(f"upstream {name!r} is no longer configured") from exc
        if name == job.upstream and job.spec is not None and client.spec != job.spec:
            raise EmbeddingError(f"upstream {name!r} changed since the request this work "
                                 f"is for")
        body = orjson.dumps({"model": self.model, "input": texts,
                             "encoding_format": "float"})
        headers = json_headers(upstream_headers([], auth, job.drop_headers))
        try:
            resp = await client.request("POST", "/embeddings", headers, body)
            raw = await resp.read(EMBED_ANSWER_BYTES)
        except ProxyError as exc:
            raise EmbeddingError(f"the embedding call failed: {exc.log_text}") from exc
        if resp.status != 200:
            raise EmbeddingError(f"the embedding call answered {resp.status}")
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise EmbeddingError("the embedding call answered no JSON") from exc

    def _read(self, data: Any, n: int) -> tuple[Vectors, int]:
        """The answer's vectors in the order of the inputs, and the tokens its usage says."""
        import numpy as np

        try:
            items = sorted(data["data"], key=lambda d: int(d["index"]))
            rows = np.array([d["embedding"] for d in items], np.float32)
        except (KeyError, TypeError, ValueError) as exc:
            raise EmbeddingError(f"the embedding call's answer cannot be read "
                                 f"({type(exc).__name__})") from exc
        if rows.shape != (n, self.dim):
            raise EmbeddingError(f"the embedding call answered {rows.shape} vectors for "
                                 f"{n} texts of embedding_dimensions = {self.dim}")
        usage = data.get("usage") if isinstance(data, dict) else None
        tokens = 0
        if isinstance(usage, dict):
            got = usage.get("prompt_tokens") or usage.get("total_tokens") or 0
            tokens = got if isinstance(got, int) and got > 0 else 0
        return rows, tokens
