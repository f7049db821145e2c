"""Background work, supervised: every task the proxy starts off a request's path (records,
summaries, anchors, the write-behind flusher, the store's probe, the config watcher) runs
under one rule. Any exception is logged with its traceback and counted
(``runloop_background_failures_total{task}``); a task meant to run for the process's life
is started again (after a short, doubling pause), so one exception a client library raises
while it reconnects cannot leave the proxy without its flusher for good."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from .ops import logs

log = logs.get("tasks")
RESTART_S, RESTART_MAX_S = 0.05, 5.0  # a failed long-lived task's pause before it runs again

Failed = Callable[[str], None]  # told the name of each task that failed (a metric)


def told(failed: Failed | None, name: str) -> None:
    if failed is None:
        return
    try:
        failed(name)
    except Exception:  # noqa: BLE001 - counting must not be what kills the task
        log.exception("counting a background failure failed", extra={"task": name})


async def once(name: str, work: Awaitable[Any], failed: Failed | None = None) -> None:
    """One piece of work off the request path: its exception logged and counted, never left
    to the event loop's "exception was never retrieved"."""
    try:
        await work
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - supervised: logged with its traceback and counted
        log.exception("background task failed", extra={"task": name})
        told(failed, name)


async def forever(name: str, run: Callable[[], Coroutine[Any, Any, None]],
                  failed: Failed | None = None, restart_s: float = RESTART_S) -> None:
    """``run()`` for the life of the process: whenever it raises, logged with its
    traceback, counted, and run again (the pause doubling up to RESTART_MAX_S, back to
    ``restart_s`` once a run has lasted that long); it ends when it returns or is
    cancelled."""
    pause = restart_s
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        try:
            await run()
            return
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - supervised: logged, counted, started again
            log.exception("background task failed; starting it again",
                          extra={"task": name})
            told(failed, name)
        if loop.time() - started >= RESTART_MAX_S:
            pause = restart_s
        await asyncio.sleep(pause)
        pause = min(pause * 2, RESTART_MAX_S)
