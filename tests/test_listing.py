"""The inspector's session list, pure: which rows a query keeps, in what order, and what
they add up to (``ops/listing.py``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runloop_proxy.ops.listing import (
    SORTS,
    Query,
    Row,
    matching,
    models_of,
    ordered,
    per_tenant,
    total,
)
from runloop_proxy.savings import Savings

NOW = 1_796_000_000_000  # ms


def row(sid: str, last: int, first: int, saved: float, models: tuple[str, ...] = (),
        tenant: str = "acme", requests: int = 1) -> Row:
    return Row(tenant, f"n:{sid}", last, first, 2 * requests, models,
               Savings(requests, 1000 * requests, 700 * requests, 0.01 + saved, 0.01))


ROWS = [row("desk-a", NOW - 5_000, NOW - 7_000_000, 0.0031, ("gpt-4o-mini", "gpt-4o")),
        row("desk-b", NOW - 7_200_000, NOW - 7_300_000, 0.0102, ("gpt-4o",), requests=4),
        row("desk-c", NOW - 40_000, NOW - 80_000, -0.0007, ("gpt-4o-mini",), requests=2),
        row("gx-1", NOW - 3 * 86_400_000, NOW - 4 * 86_400_000, 0.0009, ("claude-haiku-4-5",),
            tenant="globex", requests=3)]


@pytest.mark.parametrize(("query", "kept"), [
    (Query("*"), ["desk-a", "desk-b", "desk-c", "gx-1"]),
    (Query("*", model="gpt-4o"), ["desk-a", "desk-b"]),  # desk-a's earlier model counts
    (Query("*", model="gpt-4o-mini"), ["desk-a", "desk-c"]),
    (Query("*", model="gpt-4"), []),  # a model's name whole, not a prefix of it
    (Query("*", within="1h"), ["desk-a", "desk-c"]),
    (Query("*", within="1d"), ["desk-a", "desk-b", "desk-c"]),
    (Query("*", within="7d"), ["desk-a", "desk-b", "desk-c", "gx-1"]),
    (Query("*", search="DESK"), ["desk-a", "desk-b", "desk-c"]),  # any case
    (Query("*", search="sk-c"), ["desk-c"]),
    (Query("*", model="gpt-4o", within="1h", search="desk"), ["desk-a"]),
])
def test_each_filter_keeps_what_it_names_and_no_more(query: Query, kept: list[str]) -> None:
    """Bug class: a filter on the wrong field. Planted: ``within`` measured from the first
    seen (red: desk-b's row), the model matched as a prefix (red: gpt-4)."""
    assert [r.session_id[2:] for r in matching(ROWS, query, NOW)] == kept


@pytest.mark.parametrize(("sort", "desc"), [
    ("last", ["desk-a", "desk-c", "desk-b", "gx-1"]),
    ("first", ["desk-c", "desk-a", "desk-b", "gx-1"]),
    ("saved", ["desk-b", "desk-a", "gx-1", "desk-c"]),
    ("requests", ["desk-b", "gx-1", "desk-c", "desk-a"]),
    ("model", ["desk-c", "desk-a", "desk-b", "gx-1"]),  # by the last model: gpt-4o ties
    ("tenant", ["gx-1", "desk-a", "desk-c", "desk-b"]),  # acme's tie: the newest first
])
def test_each_order_on_distinct_values_both_ways(sort: str, desc: list[str]) -> None:
    """Bug class: an order by the wrong key, or ties that move with the direction.
    Planted: money saved read as the forwarded bill (red), ties broken by the oldest first
    (red: the model and tenant rows)."""
    got = [r.session_id[2:] for r in ordered(ROWS, sort, "desc")]
    assert got == desc
    asc = [r.session_id[2:] for r in ordered(ROWS, sort, "asc")]
    key = SORTS[sort]
    assert [key(r) for r in ordered(ROWS, sort, "asc")] == sorted(key(r) for r in ROWS)
    assert sorted(asc) == sorted(desc)


rows_drawn = st.lists(st.builds(
    row, st.text("abcdef", min_size=1, max_size=4), st.integers(0, 10**6),
    st.integers(0, 10**6), st.floats(-1, 1), st.tuples(st.sampled_from(["m1", "m2"])),
    st.sampled_from(["acme", "globex", "pt-0a1b"]), st.integers(1, 50)), max_size=30)


@given(rows_drawn, st.sampled_from(sorted(SORTS)), st.sampled_from(["desc", "asc"]))
def test_an_order_is_a_permutation_sorted_by_its_key(rows: list[Row], sort: str,
                                                     order: str) -> None:
    got = ordered(rows, sort, order)
    assert sorted(map(id, got)) == sorted(map(id, rows))
    keys = [SORTS[sort](r) for r in got]
    assert keys == sorted(keys, reverse=order == "desc")


@given(rows_drawn)
def test_the_totals_are_their_rows_sums(rows: list[Row]) -> None:
    """The overall total is the sum of the tenants' and each tenant's the sum of its rows.
    Planted: a tenant's total counting its first row only (red)."""
    tenants = per_tenant(rows)
    everything = total(rows)
    assert everything.sessions == len(rows) == sum(t.sessions for t in tenants.values())
    for name, t in tenants.items():
        mine = [r for r in rows if r.tenant == name]
        assert t.bill.requests == sum(r.bill.requests for r in mine)
        assert t.bill.client_usd == pytest.approx(sum(r.bill.client_usd for r in mine))
    assert everything.bill.money_saved == pytest.approx(
        sum(t.bill.money_saved for t in tenants.values()))


def test_a_sessions_models_each_once_the_last_used_last() -> None:
    points = [{"model": "gpt-4o"}, {"model": "gpt-4o-mini"}, {"model": "gpt-4o"}, {},
              {"model": ""}, {"model": 7}]
    assert models_of(points) == ("gpt-4o-mini", "gpt-4o")
