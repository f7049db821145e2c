"""The context windows upstreams said their models have, remembered (windows.py reads them
from an overflow error): in Redis, so every replica agrees, and in the process (a share of
``cache_mb``), which is what a request reads — Redis is asked once per caller and model the
process has not seen, and a store that is down costs nothing but the memory of other
replicas. Keyed by the caller's scope: what one caller's upstream said is that caller's."""

from __future__ import annotations

import time

from ..caches import ByteLRU
from ..errors import StoreError
from ..history.store import RedisStore
from ..ops import logs

log = logs.get("window")
ENTRY_BYTES = 256  # a scope, a model name (at most MAX_MODEL_CHARS) and a number
ASK_AGAIN_S = 60.0  # a caller and model Redis knew nothing of are asked again after this


class LearnedWindows:
    def __init__(self, max_bytes: int) -> None:
        # what is known, and when Redis was last asked of what is not: the share split 3:1
        self._known: ByteLRU[tuple[str, str], int] = ByteLRU(max_bytes - max_bytes // 4,
                                                             self._size)
        self._asked: ByteLRU[tuple[str, str], float] = ByteLRU(max_bytes // 4, self._size)

    def resize(self, max_bytes: int) -> None:
        self._known.resize(max_bytes - max_bytes // 4)
        self._asked.resize(max_bytes // 4)

    @staticmethod
    def _size(key: tuple[str, str], value: object) -> int:
        return ENTRY_BYTES + len(key[0]) + len(key[1])

    def learned(self, scope: str, model: str) -> int | None:
        """What the process knows of ``model``'s window for ``scope`` (no I/O)."""
        return self._known.get((scope, model))

    async def load(self, store: RedisStore | None, scope: str, model: str) -> None:
        """Read what another replica learned, once a minute at most per caller and model
        this process knows nothing of; a store error leaves the process's own memory."""
        key = (scope, model)
        if store is None or key in self._known:
            return
        asked = self._asked.get(key)
        now = time.monotonic()
        if asked is not None and now - asked < ASK_AGAIN_S:
            return
        self._asked[key] = now
        try:
            found = await store.learned_window(scope, model)
        except StoreError as exc:
            log.warning("learned windows unavailable: %s", exc, extra={"model": model[:64]})
            return
        if found is not None:
            self._known[key] = found

    async def learn(self, store: RedisStore | None, scope: str, model: str,
                    tokens: int) -> bool:
        """Remember ``tokens`` as ``model``'s window for ``scope``; whether that is news."""
        key = (scope, model)
        if self._known.get(key) == tokens:
            return False
        self._known[key] = tokens
        log.info("learned a context window from the upstream", extra={
            "model": model[:64], "tokens": tokens})
        if store is not None:
            try:
                await store.learn_window(scope, model, tokens)
            except StoreError as exc:
                log.warning("learned window kept in this process only: %s", exc,
                            extra={"model": model[:64]})
        return True
