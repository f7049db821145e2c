"""ops/pricing.py: the providers' prompt caches and the price table."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

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


# -- long conversations against slow references --------------------------------------------


class _PrefixReference:
    """A provider's prefix cache the slow way: every prefix of every prompt billed, by its
    keys, with when it was last used, and every block that followed it in any prompt."""

    def __init__(self, minimum: int, step: int, ttl: float) -> None:
        self.minimum, self.step, self.ttl = minimum, step, ttl
        self.used: dict[tuple[str, ...], float] = {}  # a prefix's keys -> last used
        self.after: dict[tuple[str, ...], dict[Block, float]] = {}  # -> next blocks, when

    def bill(self, prompt: list[Block], at: float) -> Bill:
        keys = tuple(b.key for b in prompt)
        alive = [j for j in range(1, len(prompt) + 1)
                 if keys[:j] in self.used and at - self.used[keys[:j]] <= self.ttl]
        k = max(alive, default=0)
        shared = sum(b.tokens for b in prompt[:k])
        if k < len(prompt):  # a block that only grew shares its tokens but the last
            new = prompt[k]
            grown = [min(old.tokens, new.tokens) - 1
                     for old, t in self.after.get(keys[:k], {}).items()
                     if at - t <= self.ttl and old.role == new.role and old.text and new.text
                     and (old.text.startswith(new.text) or new.text.startswith(old.text))]
            shared += max(grown, default=0)
        total = sum(b.tokens for b in prompt)
        cached = shared // self.step * self.step if shared >= self.minimum else 0
        for j in range(len(prompt)):
            self.used[keys[:j + 1]] = at
            self.after.setdefault(keys[:j], {})[prompt[j]] = at
        return Bill(total - cached, cached)


class _BreakpointReference:
    """Anthropic's breakpoints the slow way: entries by a prefix's keys and when each was
    last used; a prompt reads the longest live entry at most ``lookback`` blocks before one
    of its last four breakpoints, and writes from there to its last one."""

    def __init__(self, minimum: int, ttl: float) -> None:
        self.minimum, self.ttl, self.lookback = minimum, ttl, 20
        self.entries: dict[tuple[str, ...], float] = {}

    def bill(self, prompt: list[Block], marks: list[int], at: float) -> Bill:
        keys = tuple(b.key for b in prompt)
        upto = [sum(b.tokens for b in prompt[:j]) for j in range(len(prompt) + 1)]
        marks = sorted(set(m for m in marks if 0 < m <= len(prompt)))[-4:]
        live = [j for m in marks for j in range(max(1, m - self.lookback), m + 1)
                if keys[:j] in self.entries and at - self.entries[keys[:j]] <= self.ttl]
        read = max(live, default=0)
        if read:
            self.entries[keys[:read]] = at
        written = 0
        if marks and marks[-1] > read and upto[marks[-1]] >= self.minimum:
            written = upto[marks[-1]] - upto[read]
            for m in marks:
                if upto[m] >= self.minimum:
                    self.entries[keys[:m]] = at
        return Bill(upto[-1] - upto[read] - written, upto[read], written)


class _Conversation(RuleBasedStateMachine):
    """One agent conversation over many requests (up to 60 steps): messages appended, the
    last one grown (a summary that appends), a fork back to an earlier point, a compaction
    that replaces old messages by a marker whose text grows, time passing past the caches'
    lives; each request billed by both caches and by their slow references, which must agree
    to the token at every step.

    Bug class: a provider model whose state goes wrong on a later request (two or three
    prompts of unchanging content pass). Planted: the prefix cache remembering only the last
    prompt's block after a prefix (an earlier branch's grown block missed: a real one, fixed
    here: a conversation that went back to an earlier branch and compacted it again was
    billed its marker's tokens in full); a breakpoint entry's life measured from its first
    write (``setdefault``); a grown block found after its prompt's life ended (its own time
    not checked)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[Block] = [Block("system", 1_311, "You are a coding agent.", "system")]
        self.now = 0.0
        self.serial = 0
        self.sent: list[list[Block]] = []

    @initialize(rules=st.sampled_from([(1024, 128), (0, 1), (256, 64)]))
    def caches(self, rules: tuple[int, int]) -> None:
        minimum, step = rules
        self.prefix = PrefixCache(minimum, step, ttl=300)
        self.prefix_ref = _PrefixReference(minimum, step, ttl=300)
        self.marks = BreakpointCache(minimum, ttl=300)
        self.marks_ref = _BreakpointReference(minimum, ttl=300)

    def _block(self, role: str, text: str) -> Block:
        self.serial += 1
        return Block(f"{role}-{self.serial}", 7 + len(text) // 4, text, role)

    @rule(role=st.sampled_from(["user", "assistant", "tool"]), words=st.integers(1, 120))
    def append(self, role: str, words: int) -> None:
        self.messages.append(self._block(role, f"m{self.serial} " + "word " * words))

    @rule(words=st.integers(1, 80))
    def grow_the_last(self, words: int) -> None:
        if len(self.messages) > 1:
            last = self.messages.pop()
            self.messages.append(self._block(last.role, last.text + " more" * words))

    @rule(back=st.integers(1, 6), words=st.integers(1, 60))
    def fork(self, back: int, words: int) -> None:
        del self.messages[max(1, len(self.messages) - back):]
        self.messages.append(self._block("user", f"edited {self.serial} " + "x " * words))

    @rule(keep=st.integers(1, 4), words=st.integers(5, 90))
    def compact(self, keep: int, words: int) -> None:
        if len(self.messages) > keep + 2:
            marker = next((m for m in self.messages if m.key.startswith("marker")), None)
            text = (marker.text if marker else "Earlier turns:") + " done" * words
            block = self._block("assistant", text)
            self.messages = [self.messages[0], Block("marker" + block.key, block.tokens,
                                                     text, "assistant"),
                             *self.messages[-keep:]]

    @rule(data=st.data())
    def back_to_a_branch(self, data: st.DataObject) -> None:
        """A conversation sent before, resumed (a client's regenerate, another tab)."""
        if self.sent:
            self.messages = list(data.draw(st.sampled_from(self.sent)))

    @rule(seconds=st.sampled_from([3, 41, 299, 300, 301, 977]))
    def wait(self, seconds: float) -> None:
        self.now += seconds

    @rule(extra=st.lists(st.integers(1, 40), max_size=4))
    def send(self, extra: list[int]) -> None:
        prompt = list(self.messages)
        self.sent.append(prompt)
        assert self.prefix.bill(prompt, self.now) == self.prefix_ref.bill(prompt, self.now)
        marks = [len(prompt), *extra]
        assert self.marks.bill(prompt, marks, self.now) == \
            self.marks_ref.bill(prompt, marks, self.now)
        self.now += 1


_Conversation.TestCase.settings = settings(max_examples=80, stateful_step_count=60,
                                           deadline=None)
test_both_caches_over_long_conversations_match_their_references = _Conversation.TestCase
