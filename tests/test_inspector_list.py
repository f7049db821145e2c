"""The inspector's landing page through a real proxy, Redis and the openai SDK: the totals
per tenant and overall, the sessions sorted and filtered, a page at a time, and pass-through
callers by readable names. Every figure is checked against one computed here from the
sessions' stored points with ``savings`` (the one definition of the headline)."""

from __future__ import annotations

import html
import re
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from runloop_proxy import savings
from runloop_proxy.conversation.identity import named_key
from runloop_proxy.ops import inspector_list
from runloop_proxy.pricing import PriceTable
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer
from .test_config import ACME_KEY, GLOBEX_KEY, write_config
from .test_summaries import TOOLS, model

ADMIN_KEY = "admin-0123456789abcdef"
UPSTREAM_KEY = ("sk-proj-" + "Qm7vX2kLp9RtYw4NbC8eHs1JdF6gUa3Z" * 5)[:164]
# (tenant's key, session, model, turns): each session a different size, so no two bills
# coincide; desk-a is continued last, on another model: the first seen and the last used
SESSIONS = [(ACME_KEY, "desk-a", "gpt-4o-mini", 3), (ACME_KEY, "desk-b", "gpt-4o-2024-08-06", 2),
            (ACME_KEY, "desk-c", "gpt-4o-mini", 4), (GLOBEX_KEY, "gx-1", "gpt-4o-mini", 1),
            (ACME_KEY, "desk-a", "gpt-4o-2024-08-06", 2)]


def talk(proxy: ProxyServer, key: str, session: str, model_name: str, turns: int,
         start: int = 1) -> None:
    """An agent looking orders up: each turn a tool call and a reply (two requests)."""
    c = openai.OpenAI(base_url=proxy.url, api_key=key, max_retries=0,
                      default_headers={"X-Session-Id": session})
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You track orders."}]
    for k in range(start, start + turns):
        msgs.append({"role": "user", "content": f"where is order {k}"})
        while True:
            r = c.chat.completions.create(model=model_name, messages=msgs,  # type: ignore[arg-type]
                                          tools=TOOLS)  # type: ignore[arg-type]
            m = r.choices[0].message
            msgs.append(m.model_dump(exclude_none=True))
            if not m.tool_calls:
                break
            for call in m.tool_calls:
                msgs.append({"role": "tool", "tool_call_id": call.id,
                             "content": f"#W{k}000 shipped via carrier-{k}7 " + "box " * 150})
    proxy.settle()


@pytest.fixture
def listed(tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream,
           monkeypatch: pytest.MonkeyPatch) -> ProxyServer:
    monkeypatch.setenv("TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    monkeypatch.setenv("TEST_ACME_KEY", ACME_KEY)
    upstream.responder = model()
    root = write_config(tmp_path / "cfg", upstream.url,
                        acme_policy="max_run_loops = 1\nomit_batch = 2\n")
    proxy: ProxyServer = make_proxy(config_dir=str(root))
    done: dict[str, int] = {}
    for key, sid, name, turns in SESSIONS:
        talk(proxy, key, sid, name, turns, start=done.get(sid, 0) + 1)
        done[sid] = done.get(sid, 0) + turns
        time.sleep(0.01)  # each session's times apart from the next one's
    return proxy


class Tables(HTMLParser):
    """Every table of a page: its rows, each a list of (cell text, first link in it)."""

    def __init__(self, text: str):
        super().__init__()
        self.tables: dict[str, list[list[tuple[str, str | None]]]] = {}
        self._table = ""
        self._cell: list[str] | None = None
        self._href: str | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._table = dict(attrs).get("class") or ""
            self.tables[self._table] = []
        elif tag == "tr":
            self.tables[self._table].append([])
        elif tag in ("td", "th"):
            self._cell, self._href = [], None
        elif tag == "a" and self._cell is not None and self._href is None:
            self._href = dict(attrs).get("href")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.tables[self._table][-1].append(("".join(self._cell).strip(), self._href))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


class Text(HTMLParser):
    """A page's text as a reader sees it (no attribute, no markup)."""

    def __init__(self, text: str):
        super().__init__()
        self.parts: list[str] = []
        self.feed(text)

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def rows(page: str, table: str) -> list[list[str]]:
    return [[text for text, _ in r] for r in Tables(page).tables[table][1:]]


def bills(proxy: ProxyServer) -> dict[tuple[str, str], savings.Savings]:
    """Each session's bill from its points as the admin API gives them, priced here."""
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    out = {}
    for tenant in ("acme", "globex"):
        listed = httpx.get(proxy.base + "/admin/sessions", headers=auth,
                           params={"tenant": tenant, "limit": 100}).json()["sessions"]
        for row in listed:
            view = httpx.get(f"{proxy.base}/admin/sessions/{row['session_id']}", headers=auth,
                             params={"tenant": tenant, "points": "1"}).json()
            out[tenant, row["name"]] = savings.of_points(view["points"], PriceTable.load())
    return out


def figures(bill: savings.Savings) -> list[str]:
    """The cells a row shows for a bill: requests, tokens, tokens saved, bill and money."""
    raw = bill.client_tokens - bill.forwarded_tokens
    return [f"{bill.requests:,}", f"{bill.client_tokens:,} → {bill.forwarded_tokens:,}",
            f"{raw / bill.client_tokens:.0%}" if raw >= 0 else
            f"none ({-raw / bill.client_tokens:.0%} added)",
            savings.percent(bill.bill_saved or 0), savings.usd(bill.money_saved)]


def names(page: str) -> list[str]:
    head = [t for t, _ in Tables(page).tables["sessions"][0]]
    at = head.index("session")
    return [r[at] for r in rows(page, "sessions")]


def test_the_totals_are_the_sums_of_the_sessions_figures(listed: ProxyServer) -> None:
    """Each tenant's row of the totals is the sum of its sessions' bills (priced here from
    their points), and the overall row the sum of every session's. Bug class: a total that
    is not its sessions'. Planted: the overall row made of the chosen tenant's sessions
    alone (red: globex's request missing), a tenant's total without its last session (red:
    acme's requests short)."""
    c = httpx.Client(base_url=listed.base)
    assert c.post("/admin/ui/login", data={"key": ADMIN_KEY}).status_code == 303
    page = c.get("/admin/ui", params={"tenant": "acme"}).text
    by = bills(listed)
    assert len({round(b.money_saved, 9) for b in by.values()}) == len(by) == 4  # all apart
    acme = sum((b for (t, _), b in by.items() if t == "acme"), savings.Savings())
    every = sum(by.values(), savings.Savings())
    assert acme.priced and 0 < acme.bill_saved < 1  # type: ignore[operator]
    totals = {r[0]: r[1:] for r in rows(page, "totals")}
    assert totals == {"acme": ["3", *figures(acme)],
                      "globex": ["1", *figures(by["globex", "gx-1"])],
                      "all tenants": ["4", *figures(every)]}
    # the list's own headline: the sessions listed, acme's three
    assert f"The 3 sessions listed: <b>{html.escape(acme.headline())}</b>" in page
    table = {r[0]: r for r in rows(page, "sessions")}
    for (tenant, sid), bill in by.items():
        if tenant == "acme":
            assert table[sid][2:7] == figures(bill), sid



def test_the_page_reads_a_bounded_number_of_sessions_and_says_so(
        listed: ProxyServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most ``TALLIED`` sessions a tenant and ``READ`` in all, the chosen tenant's
    first; a tenant's row says when it counts fewer than it holds, and the page names what
    it left out. Bug class: a bound not kept, or kept without a word. Planted: the budget
    not taken down by what was read (red: globex read), the chosen tenant read last (red:
    acme's row missing when globex is chosen)."""
    monkeypatch.setattr(inspector_list, "TALLIED", 2)
    monkeypatch.setattr(inspector_list, "READ", 2)
    c = httpx.Client(base_url=listed.base)
    c.post("/admin/ui/login", data={"key": ADMIN_KEY})
    by = bills(listed)
    acme = c.get("/admin/ui", params={"tenant": "acme"}).text
    totals = {r[0]: r[1] for r in rows(acme, "totals")}
    assert totals == {"acme": "2 of 3", "all tenants": "2"}
    assert "1 more tenant (1 sessions) not in the totals" in acme
    # two, the most recent by the list's time (written at most once a minute a session)
    assert len(names(acme)) == 2 and set(names(acme)) < {"desk-a", "desk-b", "desk-c"}
    globex = c.get("/admin/ui", params={"tenant": "globex"}).text
    assert {r[0]: r[1] for r in rows(globex, "totals")} == {
        "acme": "1 of 3", "globex": "1", "all tenants": "2"}
    assert [r[1:] for r in rows(globex, "totals") if r[0] == "globex"] == [
        ["1", *figures(by["globex", "gx-1"])]]


def test_sorts_and_filters_keep_each_other_and_exclude_what_they_should(
        listed: ProxyServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sorted by money saved, first seen and last used (each on distinct values, both
    ways), filtered by model, by last use and by id, across tenants, two to a page, each
    link keeping the others. Bug class: an order or a filter that reads the wrong field, a
    link that drops a choice. Planted: money saved sorted by bill saved (red), first seen
    read as last used (red), the model filter matching the
    session's last model only (red: desk-a's earlier model), the next page's link
    without the model (red)."""
    monkeypatch.setattr(inspector_list, "PAGE", 2)
    c = httpx.Client(base_url=listed.base)
    c.post("/admin/ui/login", data={"key": ADMIN_KEY})
    by = bills(listed)

    def get(**query: str) -> str:
        r = c.get("/admin/ui", params=query)
        assert r.status_code == 200, r.text[:500]
        return r.text

    every = {"tenant": "*", "sort": "saved"}
    page = get(**every)
    by_money = sorted(by, key=lambda k: by[k].money_saved, reverse=True)
    assert names(page) == [s for _, s in by_money[:2]]
    follow = html.unescape(page.split("next →")[0].rsplit("href='", 1)[1].split("'")[0])
    assert "sort=saved" in follow and "tenant=%2A" in follow and "page=1" in follow
    assert names(c.get(follow).text) == [s for _, s in by_money[2:4]]
    page = get(**every, order="asc")
    assert names(page) == [s for _, s in by_money[::-1][:2]]

    first_seen = get(tenant="acme", sort="first", order="asc")
    assert names(first_seen) == ["desk-a", "desk-b"]
    last_used = get(tenant="acme", sort="last")
    assert names(last_used) == ["desk-a", "desk-c"]  # desk-a was continued last
    newest = get(tenant="acme", sort="first")
    assert names(newest) == ["desk-c", "desk-b"]

    only = get(tenant="acme", model="gpt-4o-2024-08-06")
    assert names(only) == ["desk-a", "desk-b"] and "The 2 sessions listed" in only
    mini = get(tenant="*", model="gpt-4o-mini", sort="first", order="asc")
    assert names(mini) == ["desk-a", "desk-c"]  # desk-a's earlier requests were on it
    follow = html.unescape(mini.split("next →")[0].rsplit("href='", 1)[1].split("'")[0])
    assert names(c.get(follow).text) == ["gx-1"]  # the model kept: desk-b is not here
    assert names(get(tenant="acme", q="sk-c")) == ["desk-c"]

    # a session last used two days ago: out of the last day, in the last week
    store = listed.state.store
    meta = store.prefix("globex", named_key("gx-1")) + ":meta"
    listed.run(store.client.hset(meta, "updated", int(time.time() * 1000) - 2 * 86_400_000))
    assert "gx-1" not in names(get(tenant="*", within="1d", sort="tenant", order="desc"))
    week = get(tenant="*", within="7d", sort="tenant", order="desc")
    assert names(week)[0] == "gx-1"  # globex after acme, the other way round

    # each heading sorts by its column, and again the other way
    head = {text: href for text, href in Tables(get(tenant="acme", sort="saved")).tables[
        "sessions"][0]}
    assert "order=asc" in html.unescape(head["money saved ▼"] or "")
    assert "sort=first" in html.unescape(head["first seen"] or "")


@pytest.mark.parametrize(("query", "said"), [
    ({"sort": "cost"}, "sort must be one of last, first, saved"),
    ({"order": "up"}, "order must be one of desc, asc"),
    ({"within": "2h"}, "within must be one of (empty), 1h"),
    ({"page": "-1"}, "page must be a whole number"),
    ({"model": "m" * 300}, "model must be 0 to 256 characters"),
])
def test_a_bad_parameter_is_a_400_page_naming_it(listed: ProxyServer, query: dict[str, str],
                                                 said: str) -> None:
    c = httpx.Client(base_url=listed.base)
    c.post("/admin/ui/login", data={"key": ADMIN_KEY})
    r = c.get("/admin/ui", params={"tenant": "acme", **query})
    assert r.status_code == 400 and said in r.text, r.text[-400:]
    assert r.headers["content-type"].startswith("text/html")
    gone = c.get("/admin/ui", params={"tenant": "initech"})
    assert gone.status_code == 404 and "No tenant initech" in gone.text


def test_pass_through_callers_read_by_name_and_never_by_their_keys(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """The landing page names pass-through callers by words and their upstream's host, and
    shows nothing of their keys nor of the namespace's hash as text; it stays on the caller
    chosen. Planted: the label of old, ``pass-through key pt-<hash>`` (red)."""
    proxy: ProxyServer = make_proxy(admin_key=ADMIN_KEY)
    keys = ["sk-proj-" + f"{k}q7Lm2xVb9TzR4wYc8NpE1sKd6HgJ3uFa0" * 5 for k in range(2)]
    keys = [k[:164] for k in keys]
    for key in keys:
        upstream.push({"content": "hello"})
        openai.OpenAI(base_url=proxy.url, api_key=key, max_retries=0,
                      default_headers={"X-Session-Id": "hello-desk"}).chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    proxy.settle()
    c = httpx.Client(base_url=proxy.base)
    c.post("/admin/ui/login", data={"key": ADMIN_KEY})
    page = c.get("/admin/ui").text
    callers = [r[0] for r in rows(page, "totals")][:-1]
    assert len(callers) == 2 and all(n.startswith("pass-through caller ") and
                                     n.endswith(" via 127.0.0.1") for n in callers), callers
    assert callers[0] != callers[1]
    for shown in (page, c.get("/admin/ui/session", params={"id": "hello-desk",
                                                           "tenant": _chosen(page, 0)}).text):
        text = " ".join(Text(shown).parts)
        assert not re.search(r"pt-[0-9a-f]{6}|sk-proj", text), text  # no hash, no key
        assert all(key[8:20] not in shown for key in keys)
    second = c.get(html.unescape(_href(page, callers[1]))).text
    assert f"<h2>Sessions of {html.escape(callers[1])}</h2>" in second
    assert f"<h2>Sessions of {html.escape(callers[1])}</h2>" in c.get("/admin/ui").text


def _href(page: str, label: str) -> str:
    return next(href for r in Tables(page).tables["totals"][1:] for text, href in r
                if text == label and href)


def _chosen(page: str, k: int) -> str:
    """The namespace of the k-th caller in the totals (from its link)."""
    from urllib.parse import parse_qs, urlsplit

    hrefs = [href for r in Tables(page).tables["totals"][1:-1] for _, href in r if href]
    return parse_qs(urlsplit(html.unescape(hrefs[k])).query)["tenant"][0]


def test_a_sessions_row_is_priced_again_only_when_it_changed(
        listed: ProxyServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The list keeps each session's priced row until the session changes: a page shown
    again prices no session, and after one more turn of desk-b only desk-b, whose row then
    shows its new bill (priced here from its points). Bug class: a cached figure that
    outlives what it was made of, or a cache that spares nothing. Planted: the stamp not
    compared (red: desk-b's old row shown after its turn), the cache never read (red:
    every session priced again on each page)."""
    priced: list[int] = []
    real = inspector_list.savings.of_points

    def counted(points: Any, prices: Any, provider: str | None = None) -> savings.Savings:
        priced.append(len(points))
        return real(points, prices, provider)

    monkeypatch.setattr(inspector_list.savings, "of_points", counted)
    c = httpx.Client(base_url=listed.base)
    assert c.post("/admin/ui/login", data={"key": ADMIN_KEY}).status_code == 303
    first = c.get("/admin/ui", params={"tenant": "acme"}).text
    assert len(priced) == 4  # acme's three and globex's one, for the totals
    priced.clear()
    assert c.get("/admin/ui", params={"tenant": "acme"}).text == first
    assert priced == []
    before = bills(listed)["acme", "desk-b"]
    talk(listed, ACME_KEY, "desk-b", "gpt-4o-2024-08-06", 1, start=3)
    after = bills(listed)["acme", "desk-b"]
    assert after.requests > before.requests
    priced.clear()  # (bills priced them here too)
    page = c.get("/admin/ui", params={"tenant": "acme"}).text
    assert priced == [after.requests]  # desk-b alone, with its new points
    table = {r[0]: r for r in rows(page, "sessions")}
    assert table["desk-b"][2:7] == figures(after) != figures(before)
