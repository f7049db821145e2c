"""Counting work instead of timing it: the calls (Python and C) a function makes, read with
a profiler hook in this thread and in the threads it starts (work offloaded to a worker
thread counts too; coverage's tracer is a separate hook and keeps running).
A property that the calls grow linearly with the input catches an exponential or quadratic
path on any machine, however loaded. ``allocated`` counts the other kind of work, which makes
no calls: copying (``[*merged, *new]`` re-copies a list in one opcode); ``lines`` a third, a
loop of arithmetic and indexing with no call in it (a BPE merge's scan for its lowest rank)."""

from __future__ import annotations

import asyncio
import sys
import threading
import tracemalloc
from collections.abc import Callable
from types import FrameType
from typing import Any


def calls(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """``fn(*args, **kwargs)`` (awaited when it is a coroutine) and the calls it made."""
    count = 0

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal count
        if event == "call" or event == "c_call":
            count += 1

    previous = sys.getprofile()
    sys.setprofile(hook)
    threading.setprofile(hook)  # asyncio.run's executor starts its threads afresh
    try:
        result = fn(*args, **kwargs)
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
    finally:
        sys.setprofile(previous)
        threading.setprofile(None)  # type: ignore[arg-type]
    return result, count


# while ``allocated`` counts, the other threads wait: tracemalloc's counts are the process's,
# and a thread an earlier test left running (a server's loop, a writer) allocating meanwhile
# counted as the function's (a whole-suite run: 95 MB where the function's own were 71)
HOLD_S = 30.0


def allocated(fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """``fn(*args)`` and the bytes it allocated (in this thread), each step's high-water mark
    over what was live when the step began, summed over the steps between its calls and
    returns: a list re-copied per item costs its length every time, one grown in place only
    what it grew by. No other thread runs meanwhile unless ``fn`` waits (the interpreter
    does not switch threads for ``HOLD_S``)."""
    total = 0
    last = 0

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal total, last
        current, peak = tracemalloc.get_traced_memory()
        total += max(0, peak - last)
        tracemalloc.reset_peak()
        last = current

    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    previous = sys.getprofile()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(HOLD_S)
    try:
        last = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        sys.setprofile(hook)
        try:
            result = fn(*args)
        finally:
            sys.setprofile(previous)
    finally:
        sys.setswitchinterval(interval)
        if started:
            tracemalloc.stop()
    return result, total


def lines(fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """``fn(*args)`` and the lines of Python it ran (in this thread): the work of a loop that
    calls nothing, which neither the calls nor the allocations show. The tracer it sets
    stands in for any other (coverage's) while ``fn`` runs."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        result = fn(*args)
    finally:
        sys.settrace(previous)
    return result, count
