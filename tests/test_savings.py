"""The headline figure (``savings``): both sides priced as the provider bills, worked out by
hand for each cache model; properties over any sequence of requests; the shipped sample is the
demo's session."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy import savings
from runloop_proxy.ops.demo import TOOLS, sample_conversation
from runloop_proxy.ops.replay import SAMPLE
from runloop_proxy.pricing import PriceTable
from runloop_proxy.savings import Meter, Savings, of_points

TABLE = PriceTable.load()
M = 1_000_000

# (what, model, times (s), client prompts, forwarded prompts, client USD, forwarded USD), each
# worked out by hand from prices.toml: gpt-4o input 2.50 cached 1.25 (a 1,024-token minimum,
# 128-token steps); claude-sonnet-4 input 3.00, cache writes 3.75, reads 0.30, a 300 s TTL
CASES = [
    ("forwarded as sent saves nothing", "gpt-4o", [0, 10], [2000, 3000], [2000, 3000],
     (2000 * 2.5 + 1080 * 2.5 + 1920 * 1.25) / M, (2000 * 2.5 + 1080 * 2.5 + 1920 * 1.25) / M),
    ("a prompt that shrank starts a chain, cached nothing", "gpt-4o-2024-08-06", [0, 10],
     [2000, 3000], [2000, 1500],
     (2000 * 2.5 + 1080 * 2.5 + 1920 * 1.25) / M, (2000 * 2.5 + 1500 * 2.5) / M),
    ("under the cache's minimum nothing is cached", "gpt-4o", [0, 10], [1000, 1100],
     [600, 700], (1000 + 1100) * 2.5 / M, (600 + 700) * 2.5 / M),
    # a breakpoint sits after the last message, before the reply's 3 priming tokens
    ("breakpoints: written once, read after", "claude-sonnet-4", [0, 10], [2000, 3000],
     [800, 900], (1997 * 3.75 + 1997 * 0.30 + 1000 * 3.75 + 6 * 3.0) / M,
     (800 + 900) * 3.0 / M),
    ("breakpoints: an entry past its TTL is written again", "claude-sonnet-4", [0, 400],
     [2000, 3000], [2000, 2100], (1997 * 3.75 + 2997 * 3.75 + 6 * 3.0) / M,
     (1997 * 3.75 + 2097 * 3.75 + 6 * 3.0) / M),
]

# (what, model, forwarded prompts, what each shares with the last, heads, forwarded USD):
# a compaction, as the proxy records it (the client's side grows as sent)
COMPACTIONS = [
    ("openai: the prefix a compaction kept is read cached", "gpt-4o", [2000, 1500],
     [0, 1200], [0, 0], (2000 * 2.5 + (1500 - 1152) * 2.5 + 1152 * 1.25) / M),
    ("openai: a prefix under the cache's minimum is read afresh", "gpt-4o", [2000, 1500],
     [0, 1000], [0, 0], (2000 + 1500) * 2.5 / M),
    ("anthropic: a compaction reads the head at its breakpoint, writes the rest",
     "claude-sonnet-4", [3000, 2500], [0, 1800], [1100, 1100],
     (2997 * 3.75 + 1100 * 0.30 + 1397 * 3.75 + 6 * 3.0) / M),
    ("anthropic: a compaction past the last prompt's end reads all of it", "claude-sonnet-4",
     [3000, 3500], [0, 3000], [1100, 1100], (2997 * 3.75 + 2997 * 0.30 + 500 * 3.75 + 6 * 3.0) / M),
]


@pytest.mark.parametrize(("what", "model", "forwarded", "shared", "head", "f_usd"), COMPACTIONS,
                         ids=[c[0] for c in COMPACTIONS])
def test_a_compaction_keeps_the_prefix_it_shares_cached(
        what: str, model: str, forwarded: list[int], shared: list[int], head: list[int],
        f_usd: float) -> None:
    """Bug class: the prefix a compaction keeps priced as read afresh. Planted: a prompt
    that shrank billed from token 0 whatever it shares (the first and third cases red), and
    Anthropic's head breakpoint left out (the third red)."""
    points = [{"ts": 1_764_650_000_000 + 20_000 * k, "model": model, "client": f,
               "forwarded": f, "shared": [s, s], "head": [h, h]}
              for k, (f, s, h) in enumerate(zip(forwarded, shared, head, strict=True))]
    s = of_points(points, TABLE)
    assert s.forwarded_usd == pytest.approx(f_usd) and s.client_usd == pytest.approx(f_usd)
    # a point recorded before points carried what they share: the old reading
    old = of_points([{k: v for k, v in p.items() if k not in ("shared", "head")}
                     for p in points], TABLE)
    assert old.forwarded_usd >= s.forwarded_usd - 1e-12


@pytest.mark.parametrize(("what", "model", "times", "client", "forwarded", "c_usd", "f_usd"),
                         CASES, ids=[c[0] for c in CASES])
def test_each_cache_model_bills_both_sides_as_worked_out_by_hand(
        what: str, model: str, times: list[float], client: list[int], forwarded: list[int],
        c_usd: float, f_usd: float) -> None:
    """Bug class: a side priced by another cache model than the provider's. Planted: a chain
    kept going when its prompt shrank (the second case red), and the TTL ignored (the last
    case red)."""
    points = [{"ts": int(t * 1000), "model": model, "client": c, "forwarded": f}
              for t, c, f in zip(times, client, forwarded, strict=True)]
    s = of_points(points, TABLE)
    assert (s.client_usd, s.forwarded_usd) == (pytest.approx(c_usd), pytest.approx(f_usd))
    assert s.bill_saved == pytest.approx(1 - f_usd / c_usd)
    assert (s.client_tokens, s.forwarded_tokens, s.requests) == \
        (sum(client), sum(forwarded), len(client))
    assert s.headline().startswith(f"bill saved {1 - f_usd / c_usd:.1%} ($")


def test_a_model_without_a_price_says_so_instead_of_a_figure() -> None:
    s = of_points([{"ts": 1, "model": "my-local-llama-3", "client": 4000, "forwarded": 900},
                   {"ts": 2, "model": "gpt-4o", "forwarded": 5}], TABLE)  # no client count
    assert s.bill_saved is None and s.requests == 1 and s.raw_saved == pytest.approx(1 - 0.225)
    assert s.headline() == ("bill saved: not priced (no price for my-local-llama-3; add it to "
                            "prices.toml)")
    assert Savings().headline() == "bill saved: —"
    assert Savings(36, 832_122, 116_250, 0.066012, 0.013604).headline() == \
        "bill saved 79.4% ($0.0524 of $0.0660)"
    assert Savings(2, 900, 1000, 0.01, 0.0125).headline() == \
        "bill saved -25.0% (-$0.0025 of $0.0100)"
    assert s.secondary() == "prompt tokens saved 77.5% (4,000 sent, 900 forwarded)"


prompts = st.lists(st.tuples(st.integers(1, 60_000), st.integers(0, 60_000),
                             st.floats(0, 900)), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(prompts, st.sampled_from(["gpt-4o-mini", "claude-sonnet-4-5", "gpt-4.1"]))
def test_forwarding_as_sent_saves_exactly_nothing(reqs: list[tuple[int, int, float]],
                                                   model: str) -> None:
    """Bug class: the two sides priced unlike. Planted: the client's side priced without
    the requests' times (its entries never expire: red), and a chain kept going when its
    prompt shrank (red)."""
    at = sorted(t for _, _, t in reqs)
    s = of_points([{"ts": int(t * 1000), "model": model, "client": c, "forwarded": c}
                   for (c, _, _), t in zip(reqs, at, strict=True)], TABLE)
    assert s.client_usd == pytest.approx(s.forwarded_usd) and s.client_usd > 0
    assert s.bill_saved == pytest.approx(0.0, abs=1e-12) and s.money_saved == pytest.approx(0)


@settings(max_examples=60, deadline=None)
@given(prompts)
def test_a_session_s_figure_is_the_sum_of_its_requests(reqs: list[tuple[int, int, float]]
                                                       ) -> None:
    meter = Meter(savings.providers(TABLE))
    ones = [meter.add("gpt-4o", c, f, t) for c, f, t in sorted(reqs, key=lambda r: r[2])]
    total = sum(ones, Savings())
    assert total.client_usd == pytest.approx(meter.total.client_usd)
    assert total.forwarded_usd == pytest.approx(meter.total.forwarded_usd)
    assert total.requests == len(reqs) and total.client_tokens == sum(c for c, _, _ in reqs)
    # a prompt's cache can only lower its price: never above every token at the input price
    assert total.client_usd <= total.client_tokens * 2.5 / M + 1e-12


def test_the_shipped_sample_is_the_demo_s_session() -> None:
    """``replay --sample`` promises the demo's figures: the file is what the demo sends
    (tests/test_cli.py checks the figures themselves agree, demo, inspector and replay)."""
    from importlib import resources

    line = json.loads(resources.files("runloop_proxy").joinpath(SAMPLE).read_text())
    assert line["messages"] == sample_conversation() and line["tools"] == TOOLS
