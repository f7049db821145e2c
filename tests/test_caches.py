"""Caches bounded in bytes: least recently used out first, never over their budget."""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import runloop_proxy
from runloop_proxy.caches import ENTRY_OVERHEAD, SHARES, ByteLRU, approx_size
from runloop_proxy.scripted import ScriptedUpstream

from .keys import openai_project_key


def test_the_least_recently_used_goes_first() -> None:
    c: ByteLRU[str, int] = ByteLRU(300, lambda k, v: 100)
    c["a"], c["b"], c["c"] = 1, 2, 3
    assert c.get("a") == 1  # used: now the newest
    c["d"] = 4
    assert list(c) == ["c", "a", "d"] and c.bytes == 300 and "b" not in c


def test_an_entry_larger_than_the_cache_is_not_kept() -> None:
    c: ByteLRU[str, str] = ByteLRU(100)
    c["big"] = "x" * 1000
    assert "big" not in c and c.bytes == 0


def test_replacing_an_entry_accounts_its_new_size() -> None:
    c: ByteLRU[str, str] = ByteLRU(10_000)
    c["k"] = "x" * 1000
    first = c.bytes
    c["k"] = "x" * 10
    assert c.bytes < first and len(c) == 1
    del c["k"]
    assert c.bytes == 0


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 400)), max_size=200),
       st.integers(1, 2000))
def test_never_over_budget_and_bytes_add_up(ops: list[tuple[int, int]], budget: int) -> None:
    c: ByteLRU[int, int] = ByteLRU(budget, lambda k, v: v)
    for key, size in ops:
        c[key] = size
        assert c.bytes <= budget
        assert c.bytes == sum(c._data[k][1] for k in c)


def test_threads_share_it_safely() -> None:
    c: ByteLRU[int, str] = ByteLRU(50_000)

    def work(base: int) -> None:
        for i in range(2000):
            c[base + i % 300] = "v" * (i % 50)
            c.get(base + (i * 7) % 300)

    threads = [threading.Thread(target=work, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.bytes == sum(c._data[k][1] for k in c) <= 50_000


def test_sizes_are_estimated_from_what_the_value_holds() -> None:
    small, large = approx_size({"a": "x"}), approx_size({"a": "x" * 10_000})
    assert large - small >= 9_999
    assert approx_size([[["deep"]]] * 3) > approx_size([])


def test_clearing_empties_it_and_its_byte_count() -> None:
    c: ByteLRU[str, str] = ByteLRU(1 << 20)
    for k in range(10):
        c[str(k)] = "x" * 100
    assert len(c) == 10 and c.bytes > 1000
    c.clear()
    assert len(c) == 0 and c.bytes == 0 and c.get("3") is None
    c["again"] = "y"
    assert c.get("again") == "y" and c.bytes == approx_size("y") + ENTRY_OVERHEAD


# What may grow with the number of distinct strings clients send (models, keys, sessions),
# each with the bound that holds it. Everything else a process keeps per client string is
# a ByteLRU, bounded in bytes by construction.
COUNT_CAPPED: dict[str, str] = {}


def _sizes(root: object) -> dict[str, int]:
    """The length of every dict, list and set reachable from ``root`` through the
    proxy's own objects (ByteLRUs skipped: bounded in bytes), by attribute path."""
    from runloop_proxy.caches import ByteLRU

    out: dict[str, int] = {}
    seen: set[int] = set()
    stack: list[tuple[str, object, int]] = [("state", root, 0)]
    while stack:
        path, o, depth = stack.pop()
        if id(o) in seen or depth > 6 or isinstance(o, ByteLRU):
            continue
        seen.add(id(o))
        if isinstance(o, (dict, list, set)):
            out[path] = len(o)
            if isinstance(o, dict):
                stack += [(f"{path}[]", v, depth + 1) for v in list(o.values())[:50]]
            continue
        if type(o).__module__.startswith("runloop_proxy") and hasattr(o, "__dict__"):
            stack += [(f"{path}.{k}", v, depth + 1) for k, v in vars(o).items()]
    return out


def test_nothing_a_process_keeps_grows_with_the_strings_clients_send(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Finding (red team): the token counter's calibration was a dict keyed by the model
    names clients send (30,000 names: 9 MB, never released). The class, swept: after
    requests with distinct models, keys and sessions over every API, the only structures
    of the process that grew with them are the count-capped ones named above; the rest are
    ByteLRUs (a new unbounded one fails here, naming its path)."""
    proxy = make_proxy()

    def burst(a: int, b: int) -> None:
        for k in range(a, b):
            headers = {"Authorization": f"Bearer sk-growth-{k}", "X-Session-Id": f"s-{k}"}
            path, body = [
                ("/chat/completions", {"model": f"model-{k}", "messages": [
                    {"role": "user", "content": f"hello {k}"}]}),
                ("/responses", {"model": f"model-{k}", "input": f"hello {k}"}),
                ("/messages", {"model": f"model-{k}", "max_tokens": 16, "messages": [
                    {"role": "user", "content": f"hello {k}"}]}),
                ("/messages/count_tokens", {"model": f"model-{k}", "messages": [
                    {"role": "user", "content": f"hello {k}"}]}),
            ][k % 4]
            r = httpx.post(proxy.url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
        proxy.settle()

    burst(0, 40)
    before = {**_sizes(proxy.state), **_module_sizes()}
    burst(40, 160)
    after = {**_sizes(proxy.state), **_module_sizes()}
    grew = {p for p, n in after.items() if n - before.get(p, 0) >= 60}
    assert grew <= set(COUNT_CAPPED), sorted(grew - set(COUNT_CAPPED))


# Module-level caches, each with what bounds it. Any other functools cache in the package,
# or any module-level ByteLRU (whose budget is no share of cache_mb), fails the sweep below
# the day it lands; a module-level dict, list or set that grows with traffic fails above.
MODULE_CACHES = {
    "runloop_proxy.pipeline.tokens._shipped": "the encodings the package ships, by name: "
                                              "names from the config and tiktoken's table",
}


def _modules() -> Iterator[ModuleType]:
    for info in pkgutil.walk_packages(runloop_proxy.__path__, "runloop_proxy."):
        if not info.name.endswith("__main__"):  # (that one runs the command line)
            yield importlib.import_module(info.name)


def _module_sizes() -> dict[str, int]:
    """The size of every container and the entries of every functools cache held at a
    module's top level in the package (the process's, whatever app made it)."""
    out: dict[str, int] = {}
    for module in _modules():
        for name, obj in vars(module).items():
            path = f"{module.__name__}.{name}"
            if getattr(obj, "__module__", module.__name__) != module.__name__:
                continue  # imported from elsewhere: counted where it is defined
            if hasattr(obj, "cache_info"):
                out[path] = obj.cache_info().currsize
            elif isinstance(obj, (dict, list, set, ByteLRU)):
                out[path] = len(obj)
    return out


def test_every_module_level_cache_is_known_and_none_is_bounded_by_count_alone() -> None:
    """Finding: the masker's pattern and forms were lru_caches of 256 entries each, keyed by
    credentials a pass-through client chooses (a 60 KB key: ~11 MB an entry, ~2.7 GB in
    all, outside cache_mb). A functools cache is bounded by count, not bytes: none but
    those named here, and no module-level ByteLRU (a cache's budget is its share of
    cache_mb, given by AppState). Planted, red: the mask tables made by an lru_cache again;
    a module-level dict of forms by credential."""
    caches = {f"{m.__name__}.{n}" for m in _modules() for n, o in vars(m).items()
              if hasattr(o, "cache_info") and getattr(o, "__module__", "") == m.__name__}
    assert caches == set(MODULE_CACHES), sorted(caches ^ set(MODULE_CACHES))
    lrus = [f"{m.__name__}.{n}" for m in _modules() for n, o in vars(m).items()
            if isinstance(o, ByteLRU)]
    assert not lrus, lrus


# The caches whose budget is not yet a share of cache_mb, each fixed (bytes) where it is
# made, and who holds it. Every other ByteLRU a proxy reaches grows with cache_mb.
FIXED_BUDGETS: dict[str, str] = {}


def _budgets(root: object) -> dict[str, int]:
    """The budget (max_bytes) of every ByteLRU reachable from ``root``, by path."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    stack: list[tuple[str, object, int]] = [("state", root, 0)]
    while stack:
        path, o, depth = stack.pop()
        if id(o) in seen or depth > 6:
            continue
        seen.add(id(o))
        if isinstance(o, ByteLRU):
            out[path] = o.max_bytes
        elif isinstance(o, dict):
            stack += [(f"{path}[]", v, depth + 1) for v in list(o.values())[:50]]
        elif type(o).__module__.startswith("runloop_proxy") and hasattr(o, "__dict__"):
            stack += [(f"{path}.{k}", v, depth + 1) for k, v in vars(o).items()]
    return out


def test_the_caches_a_proxy_keeps_share_cache_mb(make_proxy: Any) -> None:
    """Every ByteLRU a proxy reaches is sized from server.cache_mb (it grows with it) and
    together they fit in it, but for the fixed ones named above (none now). Planted, red:
    the mask tables given a fixed 64 MB; the shares adding up to more than the whole; the
    store's anchors at a fixed 2 MB again."""
    small = _budgets(make_proxy(server={"cache_mb": 16}).state)
    large = _budgets(make_proxy(server={"cache_mb": 64}).state)
    assert small.keys() == large.keys()
    fixed = {p for p in small if small[p] == large[p]}
    assert fixed == set(FIXED_BUDGETS), sorted(fixed ^ set(FIXED_BUDGETS))
    for budget, mb in ((small, 16), (large, 64)):
        assert sum(n for p, n in budget.items() if p not in fixed) <= mb << 20
    assert "state.masks._kept" in small
    assert sum(SHARES.values()) <= 1.0


def _text(n: int, tag: str) -> str:
    """``n`` characters of hex ids (as tool results are full of), distinct for each tag."""
    return (tag + " " + random.Random(tag).randbytes(n // 2 + 1).hex())[:n]


def _pending(i: int) -> Any:
    """A summary waiting for its session's reply: the session's 40 messages of 4 KB (tool
    results of distinct ids, as an agent's are), its keys, a stored summary."""
    from runloop_proxy.caches import messages_bytes
    from runloop_proxy.history.summaries import _Pending

    messages = [{"role": ("user", "assistant", "tool")[k % 3], "content": _text(4096, f"{i}.{k}")}
                for k in range(40)]
    keys = [f"{i:06d}{k:058d}" for k in range(40)]
    return _Pending.of(Any, messages, messages_bytes(messages), keys, 8,
                       {f"omit:8:{i}": _text(2000, str(i))})


def _prompts(i: int) -> Any:
    """A session's last prompts, as sent and as forwarded: 300 messages under a system
    prompt and tools, a third of them rewritten by the window (keys of their own)."""
    from runloop_proxy.pricing import Block
    from runloop_proxy.savings import Prompt

    keys = [f"{i:06d}{k:026d}" for k in range(300)]
    system, tools = [Block(f"{i:06d}s{0:025d}", 2400)], [Block(f"tools:{i:026d}", 900)]
    primed = [Block("priming", 3)]
    sent = [Block(k, 180 + n) for n, k in enumerate(keys)]
    window = [Block(b.key if n % 3 else f"{b.key[:-1]}w", 40) for n, b in enumerate(sent)]
    return (Prompt.of(system, tools, [*sent, *primed]),
            Prompt.of(system, tools, [*window, Block("proxy-tools", 410), *primed]))


def _vectors(i: int) -> Any:
    """A session's vectors as searched: 600 segments' keys and 256-dimension rows, from
    three stored blocks (distinct each time)."""
    import numpy as np

    from runloop_proxy.pipeline.embeddings import block
    from runloop_proxy.pipeline.vectors import assemble

    rows = np.random.default_rng(i).standard_normal((600, 256)).astype(np.float32)
    keys = [f"{i:06x}{k:010x}" for k in range(600)]
    return assemble({f"{n}:{i:08x}": block(keys[n::3], rows[n::3]) for n in range(3)}, 256)


def _listed(i: int) -> Any:
    """A session's row in the inspector's list, as the page keeps it: its id the key's,
    two models, its bill."""
    from runloop_proxy.ops.listing import Row
    from runloop_proxy.savings import Savings
    from runloop_proxy.state import Listed

    sid = f"{SESSION}{i}"
    row = Row(NAMESPACE, sid, 1764650000000 + i, 1764640000000 + i, 2 * i + 40,
              (f"gpt-4o-mini-2024-07-18-ft-{i:020d}", f"gpt-4o-2024-08-06-ft-{i:024d}"),
              Savings(60 + i, 300_000 + i, 120_000 + i, 0.75 + i / 1e6, 0.25 + i / 1e6))
    return (NAMESPACE, sid), Listed((2 * i + 40, 1764640000000 + i, 1764650000000 + i, 60,
                                     hash(str(i))), _prices(), row)


@functools.cache
def _prices() -> Any:
    """One price table, as every row of a process's list shares its config's."""
    from runloop_proxy.pricing import PriceTable

    return PriceTable.load()


def _cut(i: int) -> Any:
    """A session's kept cut (``Memory.cuts``): the segments of 40 support loops by their
    digests, distinct each time."""
    from runloop_proxy.conversation.messages import message_hash
    from runloop_proxy.pipeline.memory import cut_carried

    from .test_memory_vectors import _conversation

    messages = _conversation(range(i * 40, i * 40 + 40))
    return cut_carried(messages, [message_hash(m) for m in messages])[1]


SESSION = "sess_" + "7" * 123  # a session id as long as a plain one may be (128 characters)
NAMESPACE = "pt-" + "c" * 61  # a pass-through caller's namespace: its key's digest

# Every cache the proxy keeps whose bytes its own formula counts (rather than approx_size's
# walk of the value), with entries of the largest realistic kind, distinct each time: what
# the formula says must be what tracemalloc sees.
FILLS: dict[str, Any] = {
    "state.summaries.pending": lambda i: ((NAMESPACE, f"{SESSION}{i}"), _pending(i)),
    "state.summaries.wanted": lambda i: ((NAMESPACE, f"{SESSION}{i}"), _pending(i)),
    "state.summaries.waiting": lambda i: ((NAMESPACE, f"{SESSION}{i}"), _pending(i)),
    "state.summaries.failures": lambda i: (f"{NAMESPACE}{i}", i),
    "state.summaries.paused_until": lambda i: (f"{NAMESPACE}{i}", i + 0.5),
    "state.summaries.unreleased": lambda i: ((NAMESPACE, f"{SESSION}{i}"), f"{i:032x}"),
    "state.store._anchors": lambda i: ((NAMESPACE, f"{i:064x}"), f"{SESSION}{i}"),
    "state.store._indexed": lambda i: ((NAMESPACE, f"{SESSION}{i}"), i + 0.25),
    "state.store._internal_begun": lambda i: ((NAMESPACE, f"{SESSION}{i}"), 10_000_000 + i),
    "state.tokens._by_model": lambda i: ((f"claude-sonnet-4-5-20250929-ft-{i:034d}", None),
                                         (None, False)),
    "state.tokens._factors": lambda i: ((NAMESPACE, f"gpt-4o-2024-08-06-ft-{i:043d}"),
                                        1.0 + i / 1e6),
    "state.prompts": lambda i: ((NAMESPACE, f"{SESSION}{i}"), _prompts(i)),
    "state.listed": _listed,
    "state.first_seen": lambda i: (f"{NAMESPACE}\0{SESSION}\0{i:064x}", 1764650000000 + i),
    "state.windows._known": lambda i: ((NAMESPACE, f"gpt-4o-2024-08-06-ft-{i:043d}"), 128_000),
    "state.windows._asked": lambda i: ((NAMESPACE, f"gpt-4o-2024-08-06-ft-{i:043d}"),
                                       i + 0.75),
    "state.memory.vectors._kept": lambda i: ((NAMESPACE, f"{SESSION}{i}",
                                              "wordllama-l2_supercat-256"), _vectors(i)),
    "state.memory.cuts": lambda i: ((NAMESPACE, f"{SESSION}{i}"), _cut(i)),
}


def _reach(state: Any, path: str) -> Any:
    o = state
    for name in path.split(".")[1:]:
        o = getattr(o, name)
    return o


@pytest.mark.parametrize("path", sorted(FILLS))
def test_what_a_cache_counts_is_what_it_holds(make_proxy: Any, path: str) -> None:
    """Filled with large distinct entries to three times its budget, a cache holds (as
    tracemalloc sees it) no more than 1.5 times the bytes it counts, and those within its
    budget: a cache's share of cache_mb bounds the process only if its count is honest.
    Bug caught: the summaries waiting for a reply counted at 64 bytes a key, not the
    session's messages they hold (a 160 KB session passed for 3 KB: ~50 times its budget
    held: 32 MB for a 0.5 MB budget, red). Planted too, red: the store's anchors counted at
    a fixed 200 bytes, without their keys and session ids."""
    import gc
    import tracemalloc

    cache = _reach(make_proxy(server={"cache_mb": 16}).state, path)
    fill = FILLS[path]
    first = fill(0)
    probe: ByteLRU[Any, Any] = ByteLRU(1 << 30, cache._size)
    probe[first[0]] = first[1]
    entries = 3 * cache.max_bytes // probe.bytes + 3
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(entries):
            key, value = fill(i + 1)
            cache[key] = value
            del key, value
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0 < cache.bytes <= cache.max_bytes and len(cache) < entries
    assert held <= 1.5 * cache.bytes + (64 << 10), \
        f"{path}: holds {held} bytes, counts {cache.bytes} ({len(cache)} of {entries})"


# The others, and the test that checks their count against tracemalloc.
ELSEWHERE = {
    "state.carries": "test_hardening.py::test_what_the_caches_hold_is_what_they_are_allowed",
    "state.recent": "test_hardening.py::test_what_the_caches_hold_is_what_they_are_allowed",
    "state.store._sessions": "test_hardening.py::test_what_the_caches_hold_is_what_the…",
    "state.store._chains": "test_hardening.py::test_what_the_caches_hold_is_what_the…",
    "state.tokens._cache": "test_hardening.py::test_what_the_caches_hold_is_what_the…",
    "state.masks._kept": "test_masking.py (a 60 KB credential's tables, tracemalloc)",
    "state.bills": "savings.Meter measured: BILL_ENTRY_BYTES (state.py)",
}


def _formulas(root: object) -> set[str]:
    """Every ByteLRU reachable from ``root`` whose bytes a size function of its own counts
    (not the default walk of the value), by path."""
    default = ByteLRU(1)._size.__qualname__
    out: set[str] = set()
    seen: set[int] = set()
    stack: list[tuple[str, object, int]] = [("state", root, 0)]
    while stack:
        path, o, depth = stack.pop()
        if id(o) in seen or depth > 6:
            continue
        seen.add(id(o))
        if isinstance(o, ByteLRU):
            if o._size.__qualname__ != default:
                out.add(path)
        elif type(o).__module__.startswith("runloop_proxy") and hasattr(o, "__dict__"):
            stack += [(f"{path}.{k}", v, depth + 1) for k, v in vars(o).items()]
    return out


def test_every_cache_counted_by_a_formula_is_filled_somewhere(make_proxy: Any) -> None:
    """A new cache with a size function of its own fails here until its count is checked
    against what it holds (in FILLS above, or a test named in ELSEWHERE)."""
    found = _formulas(make_proxy().state)
    assert found == set(FILLS) | set(ELSEWHERE), sorted(found ^ (set(FILLS) | set(ELSEWHERE)))


class _ByteLRUAgainstAList(RuleBasedStateMachine):
    """A ``ByteLRU`` over a long run (up to 60 steps) of sets, gets, deletes and clears, its
    values growing as the run goes on, against the obvious model: a list of (key, value,
    size) from least to most recently used, where a set removes the key and appends it, then
    drops from the front while over the budget (an entry larger than the budget is not kept),
    and a get moves its key to the end. After every step the cache holds exactly the model's
    entries, in its order, and its byte count is their sum.

    Bug class: bookkeeping that goes wrong at a later step (a short run with values that do
    not grow passes). Planted: a get that does not refresh recency (``move_to_end`` left
    out); a replaced entry whose old size stays counted; eviction from the wrong end
    (``popitem(last=True)``: the entry just set goes first)."""

    BUDGET = 2_917  # a size no value's growth lands on exactly

    def __init__(self) -> None:
        super().__init__()
        self.cache: ByteLRU[str, str] = ByteLRU(self.BUDGET, lambda k, v: len(k) + len(v))
        self.model: list[tuple[str, str, int]] = []
        self.step = 0

    def _touch(self, key: str) -> tuple[str, str, int] | None:
        for i, entry in enumerate(self.model):
            if entry[0] == key:
                return self.model.pop(i)
        return None

    @rule(key=st.sampled_from([f"sess-{i:02d}" for i in range(12)]), extra=st.integers(0, 90))
    def put(self, key: str, extra: int) -> None:
        self.step += 1
        value = "v" * (extra + 40 * self.step)  # grows with the run: evictions get larger
        self.cache[key] = value
        self._touch(key)
        size = len(key) + len(value)
        if size <= self.BUDGET:
            self.model.append((key, value, size))
            while sum(e[2] for e in self.model) > self.BUDGET:
                self.model.pop(0)

    @rule(key=st.sampled_from([f"sess-{i:02d}" for i in range(12)]))
    def get(self, key: str) -> None:
        entry = self._touch(key)
        if entry is not None:
            self.model.append(entry)
        assert self.cache.get(key) == (entry[1] if entry else None)

    @rule(key=st.sampled_from([f"sess-{i:02d}" for i in range(12)]))
    def delete(self, key: str) -> None:
        entry = self._touch(key)
        if entry is None:
            with pytest.raises(KeyError):
                del self.cache[key]
        else:
            del self.cache[key]

    @rule()
    def clear(self) -> None:
        self.cache.clear()
        self.model.clear()

    @invariant()
    def same_entries_in_the_same_order(self) -> None:
        assert list(self.cache) == [e[0] for e in self.model]
        assert {k: self.cache._data[k][0] for k in self.cache} == {e[0]: e[1] for e in self.model}
        assert self.cache.bytes == sum(e[2] for e in self.model) <= self.BUDGET
        assert len(self.cache) == len(self.model)


_ByteLRUAgainstAList.TestCase.settings = settings(
    max_examples=60, stateful_step_count=60, deadline=None)
test_byte_lru_over_long_runs_is_the_model = _ByteLRUAgainstAList.TestCase


def _config_dir(root: Path, url: str, cache_mb: int) -> Path:
    (root / "tenants").mkdir(parents=True, exist_ok=True)
    (root / "runloop.toml").write_text(
        f'[server]\ncache_mb = {cache_mb}\n[upstreams.main]\nurl = "{url}"\n'
        f'api_key = "{openai_project_key(3)}"\n')
    (root / "tenants" / "acme.toml").write_text(
        f'keys = ["sk-acme-proxy-{openai_project_key(4)[8:40]}"]\nupstream = "main"\n')
    return root


def test_a_reload_that_changes_cache_mb_resizes_every_cache(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Finding: a reload (SIGHUP, a file change) that changed ``server.cache_mb`` moved no
    cache: every one kept the budget it was made with, so an operator shrinking it to
    stop a replica's growth saw nothing until a restart. Now a reload resizes every
    ByteLRU the proxy reaches (the sweep of ``_budgets``: a cache added later is covered)
    to what a proxy started with the new value has, and what a smaller budget leaves over
    goes at once. 48 MB -> 20 MB by editing the file: every budget moved, each equal to a
    fresh 20 MB proxy's; a cache filled to its 48 MB share holds at most its 20 MB one.
    Planted, red: the reload resizing nothing (every budget as before); the store's caches
    left out of the resize (state.store._sessions and three more at their old budgets);
    ByteLRU.resize setting the bound without dropping what is over it (first_seen over);
    memory's vectors left out (state.memory.vectors._kept at its old budget)."""
    import time

    root = _config_dir(tmp_path / "cfg", upstream.url, 48)
    proxy = make_proxy(config_dir=str(root))
    fresh = _budgets(make_proxy(config_dir=str(
        _config_dir(tmp_path / "cfg20", upstream.url, 20))).state)
    before = _budgets(proxy.state)
    seen = proxy.state.first_seen
    for i in range(3000):  # 320 bytes each: ~0.96 MB, within the 48 MB share (~1 MB)
        seen[f"{NAMESPACE}\0{SESSION}\0{i:064x}"] = 1764650000000 + i
    assert seen.bytes > int((20 << 20) * SHARES["first_seen"])  # over the new share
    reloads = proxy.state.metrics.config_reloads.labels("ok")
    done = reloads._value.get()
    toml = root / "runloop.toml"
    toml.write_text(toml.read_text().replace("cache_mb = 48", "cache_mb = 20"))
    os.utime(toml, (time.time() + 5, time.time() + 5))  # a change the poll sees
    deadline = time.monotonic() + 30
    while reloads._value.get() == done:
        assert time.monotonic() < deadline, "the file change never reloaded the config"
        time.sleep(0.1)
    after = _budgets(proxy.state)
    assert after.keys() == fresh.keys() == before.keys()
    assert {p for p in after if after[p] == before[p]} == set(), "caches not resized"
    assert after == fresh
    assert seen.max_bytes == int((20 << 20) * SHARES["first_seen"])
    assert 0 < seen.bytes <= seen.max_bytes
