"""Caches bounded in bytes: least recently used out first, never over their budget."""

from __future__ import annotations

import threading
from typing import Any

import httpx
from hypothesis import given
from hypothesis import strategies as st

from runloop_proxy.caches import ENTRY_OVERHEAD, ByteLRU, approx_size
from runloop_proxy.scripted import ScriptedUpstream


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
COUNT_CAPPED = {
    "state.store._indexed": "SESSION_CACHE_SIZE sessions (history.store)",
    "state.tokens._by_model": "MODELS_KEPT model names (pipeline.tokens)",
}


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
    before = _sizes(proxy.state)
    burst(40, 160)
    grew = {p for p, n in _sizes(proxy.state).items() if n - before.get(p, 0) >= 60}
    assert grew <= set(COUNT_CAPPED), sorted(grew - set(COUNT_CAPPED))
