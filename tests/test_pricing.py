"""ops/pricing.py: the providers' prompt caches and the price table."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy.errors import ConfigError
from runloop_proxy.pricing import (
    Bill,
    Block,
    BreakpointCache,
    PrefixCache,
    Price,
    PriceTable,
)


def blocks(*spec: tuple[str, int]) -> list[Block]:
    return [Block(k, n) for k, n in spec]


@pytest.mark.parametrize("first, second, cached", [
    # nothing cached below 1024 shared tokens
    ([("s", 1000)], [("s", 1000), ("u", 50)], 0),
    # then whole 128-token steps of what is shared
    ([("s", 1100)], [("s", 1100), ("u", 50)], 1024),
    ([("s", 1300), ("u", 10)], [("s", 1300), ("u", 10), ("a", 90)], 1280),
    # a changed block ends the shared prefix, whatever follows
    ([("s", 2000), ("u", 10)], [("s", 2000), ("x", 10), ("u", 10)], 1920),
    ([("s", 2000)], [("t", 2000)], 0),
])
def test_prefix_cache_counts_whole_steps_of_the_shared_prefix(
        first: list[tuple[str, int]], second: list[tuple[str, int]], cached: int) -> None:
    cache = PrefixCache()
    assert cache.bill(blocks(*first)) == Bill(sum(n for _, n in first), 0)
    bill = cache.bill(blocks(*second))
    assert bill.cached == cached and bill.total == sum(n for _, n in second)


def test_prefix_cache_serves_any_earlier_prompt_while_it_lives() -> None:
    cache = PrefixCache(ttl=300)
    cache.bill(blocks(("s", 2048), ("a", 256)), at=0)
    cache.bill(blocks(("s", 2048), ("b", 256)), at=10)
    # the first prompt's longer prefix is still there, not only the last prompt's
    assert cache.bill(blocks(("s", 2048), ("a", 256), ("u", 5)), at=20).cached == 2304
    # past its lifetime nothing is; a read of the shorter prefix at 20 kept that one alive
    assert cache.bill(blocks(("s", 2048), ("b", 256)), at=311).cached == 2048
    assert cache.bill(blocks(("s", 2048), ("b", 256)), at=700).cached == 0


def reference_prefix(history: list[list[Block]], prompt: list[Block], minimum: int,
                     step: int) -> int:
    """Longest block prefix shared with any earlier prompt, counted the slow way."""
    best = 0
    for old in history:
        k = 0
        while k < min(len(old), len(prompt)) and old[k].key == prompt[k].key:
            k += 1
        best = max(best, sum(b.tokens for b in prompt[:k]))
    return (best // step) * step if best >= minimum else 0


prompts = st.lists(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(1, 400)),
                            min_size=1, max_size=8), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(prompts, st.sampled_from([(0, 1), (1024, 128), (256, 64)]))
def test_prefix_cache_matches_the_slow_reference(spec: list[list[tuple[str, int]]],
                                                 rules: tuple[int, int]) -> None:
    # a block's key fixes its tokens, as content does
    size: dict[str, int] = {}
    history: list[list[Block]] = []
    cache = PrefixCache(*rules)
    for p in spec:
        prompt = [Block(k, size.setdefault(k, n)) for k, n in p]
        want = reference_prefix(history, prompt, *rules)
        bill = cache.bill(prompt)
        assert bill.cached == want and bill.uncached == sum(b.tokens for b in prompt) - want
        history.append(prompt)


def test_breakpoints_write_at_a_premium_then_read_at_a_tenth() -> None:
    cache = BreakpointCache()
    tools_system = blocks(("tools", 1500), ("system", 600))
    first = [*tools_system, Block("u1", 100)]
    # the whole prompt is written: up to its last breakpoint
    assert cache.bill(first, [2, 3]) == Bill(0, 0, 2200)
    second = [*first, Block("a1", 50), Block("u2", 30)]
    assert cache.bill(second, [2, 5]) == Bill(0, 2200, 80)
    # a change after the system prompt: only its breakpoint's entry is read
    changed = [*tools_system, Block("marker", 40), Block("u2", 30)]
    assert cache.bill(changed, [2, 4]) == Bill(0, 2100, 70)
    # nothing after the last breakpoint is written
    assert cache.bill([*changed, Block("x", 9)], [2]) == Bill(79, 2100, 0)


def test_breakpoints_need_the_minimum_a_limit_and_the_lookback() -> None:
    cache = BreakpointCache()
    assert cache.bill(blocks(("s", 500), ("u", 100)), [2]) == Bill(600, 0, 0)  # < 1024
    assert cache.bill(blocks(("s", 500), ("u", 100)), [2]) == Bill(600, 0, 0)  # nothing kept
    # only the last four breakpoints count
    many = [Block(f"b{i}", 1100) for i in range(6)]
    fresh = BreakpointCache()
    assert fresh.bill(many, [1, 2, 3, 4, 5, 6]) == Bill(0, 0, 6600)
    assert fresh.bill(many[:2], [2]).cached == 0  # the second breakpoint was not one
    assert fresh.bill(many[:3], [3]).cached == 3300  # the fourth-to-last was
    # an entry more than 20 blocks before every breakpoint is not found
    lookback = BreakpointCache()
    head = [Block("h", 2000)]
    lookback.bill(head, [1])
    tail = [Block(f"t{i}", 1) for i in range(25)]
    assert lookback.bill([*head, *tail], [26]).cached == 0
    assert lookback.bill([*head, *tail[:19]], [20]).cached == 2000


def test_breakpoint_entries_live_five_minutes_from_their_last_use() -> None:
    cache = BreakpointCache()
    p = blocks(("s", 2000), ("u", 10))
    cache.bill(p, [2], at=0)
    assert cache.bill(p, [2], at=299).cached == 2010  # read: lives on from 299
    assert cache.bill(p, [2], at=590).cached == 2010
    assert cache.bill(p, [2], at=891).cached == 0  # 301 s unused: written again
    assert cache.bill(p, [2], at=891).written == 0 and cache.bill(p, [2], at=892).cached


def test_prices_bill_tokens_and_usage() -> None:
    price = Price(input=3.0, cached_input=0.3, output=15.0, cache_write=3.75)
    assert price.cost(Bill(1_000_000, 2_000_000, 1_000_000), 100_000) == \
        pytest.approx(3.0 + 0.6 + 3.75 + 1.5)
    openai = Price(input=2.5, cached_input=1.25, output=10.0)
    # OpenAI's prompt_tokens include the cached ones
    cost = openai.usage_cost({"prompt_tokens": 1_000_000, "completion_tokens": 1_000_000,
                              "prompt_tokens_details": {"cached_tokens": 400_000}})
    assert cost == pytest.approx({"input": 1.5, "cached_input": 0.5, "cache_write": 0.0,
                                  "output": 10.0})
    # Anthropic's input_tokens are those read afresh, beside its cache's reads and writes
    cost = price.usage_cost({"input_tokens": 1_000_000, "output_tokens": 0,
                             "cache_read_input_tokens": 1_000_000,
                             "cache_creation_input_tokens": 2_000_000})
    assert cost == pytest.approx({"input": 3.0, "cached_input": 0.3, "cache_write": 7.5,
                                  "output": 0.0})
    assert sum(openai.usage_cost({"prompt_tokens": "x", "completion_tokens": -5}).values()) == 0


def test_the_price_table_ships_both_providers_and_merges_an_operators(tmp_path: Path) -> None:
    table = PriceTable.load()
    openai, anthropic = table.provider("openai"), table.provider("anthropic")
    assert openai.price("gpt-4o-2024-08-06") == openai.price("gpt-4o")  # a dated snapshot
    assert openai.price("gpt-4o") == Price(2.5, 1.25, 10.0)
    sonnet = anthropic.price("claude-sonnet-4")
    assert sonnet is not None and sonnet.cache_write == pytest.approx(3.75) \
        and sonnet.cached_input == pytest.approx(0.3)
    assert isinstance(openai.new_cache(), PrefixCache)
    assert isinstance(anthropic.new_cache(), BreakpointCache)
    assert openai.price("unknown-model") is None
    mine = tmp_path / "prices.toml"
    mine.write_text('[openai.models."gpt-4o"]\ncached_input = 0.25\n'
                    '[openai.models."my-model"]\ninput = 1.0\ncached_input = 0.1\n')
    merged = PriceTable.load(mine).provider("openai")
    assert merged.price("gpt-4o") == Price(2.5, 0.25, 10.0)  # field by field
    assert merged.price("my-model") == Price(1.0, 0.1, 0.0)
    with pytest.raises(ConfigError):
        table.provider("nobody")
    mine.write_text('[openai.models."bad"]\ncached_input = 1.0\n')  # no input price
    with pytest.raises(ConfigError, match="bad price table"):
        PriceTable.load(mine)
    mine.write_text("not toml [")
    with pytest.raises(ConfigError, match="cannot read prices"):
        PriceTable.load(mine)


@pytest.mark.parametrize("text, where", [
    ('[openai.models."house-model"]\ninptu = 9.00\n',
     "openai.models.house-model.inptu: unknown name (did you mean 'input'?)"),
    ('[opnai.models."gpt-4o"]\ninput = 9.0\n', "opnai: unknown name (did you mean 'openai'?)"),
    ('[anthropic]\ncache_ttl = 300\n', "anthropic.cache_ttl: unknown name (did you mean "
                                       "'cache_ttl_s'?)")])
def test_a_misspelled_name_in_a_price_table_is_refused(tmp_path: Path, text: str,
                                                       where: str) -> None:
    """Found by a newcomer: a misspelled price, model field or provider was ignored — the
    model went unpriced, or kept the built-in price, and the cost metrics were wrong. Every
    name of an operator's table is known or refused, naming it."""
    path = tmp_path / "prices.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        PriceTable.load(path)
    assert str(err.value) == f"{path}: {where}"
