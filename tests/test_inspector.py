"""The session inspector (/admin/ui): its security over plain HTTP, and its pages in a real
browser — Debian's chromium, headless, driven through the system chromedriver over the
WebDriver protocol (tests/webdriver.py; nothing downloaded; skipped with a reason where either
is missing)."""

from __future__ import annotations

import html
import os
import re
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from runloop_proxy.conversation.identity import named_key
from runloop_proxy.conversation.items import to_items, to_messages
from runloop_proxy.conversation.messages import canonical
from runloop_proxy.ops.inspector_message import calls_html
from runloop_proxy.ops.inspector_shell import sign
from runloop_proxy.ops.inspector_window import rebuild
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer, until
from .policies import MECHANISM
from .test_compaction_records import KEY, RESPONSES_TOOLS, TENANT, Client, answers
from .test_config import ACME_KEY, write_config
from .test_summaries import TOOLS, converse, model
from .webdriver import Browser

ADMIN_KEY = "admin-0123456789abcdef"
DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.fixture
def inspected(tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream,
              monkeypatch: pytest.MonkeyPatch) -> ProxyServer:
    """A proxy with one tenant and a session worth looking at (omissions, elisions, a
    summary, and a reply that tries to inject markup)."""
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-up")
    monkeypatch.setenv("TEST_ACME_KEY", ACME_KEY)
    upstream.responder = model()
    root = write_config(tmp_path / "cfg", upstream.url, acme_policy=(
        'max_run_loops = 4\nomit_batch = 2\nsummary_model = "extractive"\n'))
    proxy: ProxyServer = make_proxy(config_dir=str(root))
    converse(proxy, "order-desk-7", 9, after=lambda k: proxy.settle())
    upstream.push({"content": "<script>alert('x')</script> done"})
    c = openai.OpenAI(base_url=proxy.url, api_key=ACME_KEY, max_retries=0,
                      default_headers={"X-Session-Id": "markup"})
    c.chat.completions.create(model="gpt-4o-mini", tools=TOOLS,  # type: ignore[arg-type]
                              messages=[{"role": "user", "content": "<b>bold</b> question 1"}])
    proxy.settle()
    return proxy


def logged_in(proxy: ProxyServer) -> httpx.Client:
    c = httpx.Client(base_url=proxy.base, follow_redirects=False)
    r = c.post("/admin/ui/login", data={"key": ADMIN_KEY})
    assert r.status_code == 303
    return c


def test_pages_need_a_login_and_the_cookie_is_locked_down(inspected: ProxyServer) -> None:
    anon = httpx.Client(base_url=inspected.base, follow_redirects=False)
    for path in ("/admin/ui", "/admin/ui/session?id=order-desk-7", "/admin/ui/message?id=x&pos=0"):
        r = anon.get(path)
        assert r.status_code == 303 and r.headers["location"] == "/admin/ui/login"
    bad = anon.post("/admin/ui/login", data={"key": "admin-wrong-key-000000"})
    assert bad.status_code == 401 and "not the admin key" in bad.text
    assert "set-cookie" not in bad.headers
    ok = anon.post("/admin/ui/login", data={"key": ADMIN_KEY})
    cookie = ok.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    assert "Path=/admin/ui" in cookie and ADMIN_KEY not in cookie
    forged = httpx.Client(base_url=inspected.base, follow_redirects=False,
                          cookies={"rl_admin": "9999999999.deadbeef"})
    assert forged.get("/admin/ui").status_code == 303


def test_the_one_form_that_acts_needs_its_csrf_token(inspected: ProxyServer) -> None:
    c = logged_in(inspected)
    page = c.get("/admin/ui/session", params={"tenant": "acme", "id": "order-desk-7"}).text
    token = re.search(r"name='csrf' value='([0-9a-f]+)'", page)
    assert token, "the session page offers compact now (summaries are on)"
    form = {"tenant": "acme", "id": "order-desk-7"}
    assert c.post("/admin/ui/compact", data=form).status_code == 403
    assert c.post("/admin/ui/compact", data={**form, "csrf": "0" * 32}).status_code == 403
    other = c.post("/admin/ui/compact", data={**form, "csrf": token.group(1)},
                   headers={"Origin": "https://evil.example"})
    assert other.status_code == 403
    done = c.post("/admin/ui/compact", data={**form, "csrf": token.group(1)})
    assert done.status_code == 303 and "session?" in done.headers["location"]


def test_compact_now_refuses_every_cross_site_shape(inspected: ProxyServer) -> None:
    """The one form that acts is answered only from the proxy's own origin (or none) and with
    the token made for the very cookie it comes with. Swept: origins that differ by host,
    port or scheme or are opaque, and tokens missing, cut, grown, another login's, another
    admin key's — each a 403 that compacts nothing; the controls compact. Planted, each red:
    the origin compared by host alone, the token made from the admin key alone (one login's
    token good for every other), a token accepted by its prefix."""
    port, sid = inspected.port, named_key("order-desk-7")
    mine, other = (httpx.post(inspected.base + "/admin/ui/login", data={
        "key": ADMIN_KEY}).cookies["rl_admin"] for _ in range(2))  # two logins

    def post(cookie: str, form: dict[str, str], origin: str | None) -> httpx.Response:
        headers = {"Cookie": f"rl_admin={cookie}", **({"Origin": origin} if origin else {})}
        return httpx.post(inspected.base + "/admin/ui/compact", data=form, headers=headers,
                          follow_redirects=False)

    def token(cookie: str) -> str:
        page = httpx.get(inspected.base + "/admin/ui/session", headers={
            "Cookie": f"rl_admin={cookie}"}, params={"tenant": "acme", "id": "order-desk-7"})
        found = re.search(r"name='csrf' value='([0-9a-f]+)'", page.text)
        assert found, page.text[:300]
        return found.group(1)

    def summaries() -> dict[str, str]:
        return inspected.run(inspected.state.store.summaries("acme", sid))  # type: ignore[no-any-return]

    def clear() -> None:
        store = inspected.state.store
        inspected.run(store.client.delete(store.prefix("acme", sid) + ":sum"))

    good, theirs = token(mine), token(other)
    assert good != theirs, "a token is its login's"
    form = {"tenant": "acme", "id": "order-desk-7"}
    own = f"http://127.0.0.1:{port}"
    origins = [f"http://127.0.0.1:{port + 1}", f"https://127.0.0.1:{port}",
               f"http://localhost:{port}", "http://127.0.0.1", "null",
               f"http://127.0.0.1:{port}.evil.example", "https://evil.example"]
    tokens = {"none": None, "empty": "", "cut": good[:16], "grown": good + "0",
              "upper-case": good.upper(), "another login's": theirs,
              "another admin key's": sign("admin-other-key-0123456789", f"csrf:{mine}")[:32]}
    clear()
    before = summaries()
    for origin in origins:
        r = post(mine, {**form, "csrf": good}, origin)
        assert r.status_code == 403 and "another site" in r.text, (origin, r.status_code)
    for name, value in tokens.items():
        for origin in (None, own):
            r = post(mine, form if value is None else {**form, "csrf": value}, origin)
            assert r.status_code == 403 and "expired" in r.text, (name, origin, r.status_code)
    assert summaries() == before, "refused, yet it compacted"
    for origin in (own, None):  # the controls: the form as the page makes it
        clear()
        r = post(mine, {**form, "csrf": good}, origin)
        assert r.status_code == 303 and "session?" in r.headers["location"], (origin, r.text)
        assert any(k.startswith("omit:") for k in summaries()), origin
    r = post(other, {**form, "csrf": theirs}, own)  # the other login, with its own token
    assert r.status_code == 303, r.text


FIGURES = re.compile(r"the client sent <b>([\d,]+)</b> tokens, <b>([\d,]+)</b> went upstream")
CAPTION = re.compile(r"(\d+) requests? · the last: client ([\d,]+) tokens, forwarded "
                     r"([\d,]+)")


def numbers(*found: str) -> tuple[int, ...]:
    return tuple(int(f.replace(",", "")) for f in found)


def test_the_session_page_shows_what_the_window_did(inspected: ProxyServer) -> None:
    c = logged_in(inspected)
    page = c.get("/admin/ui/session", params={"id": "order-desk-7"})  # no tenant: found
    assert page.status_code == 200
    html = page.text
    # a point per request (9 turns, each a lookup and an answer), through the write-behind
    caption = CAPTION.search(html)
    figures = FIGURES.search(html)
    assert "<svg" in html and caption and figures
    assert caption.group(1) == "18"
    # the chart's last point and the last request's window: the same request, the same count
    assert numbers(*caption.groups()[1:]) == numbers(*figures.groups())
    assert "class='omitted'" in html and "class='reduced'" in html
    start = html.index("in place of the omitted loops")
    marker = html[start:html.index("<table", start)]
    assert "Summary of the turns not shown" in marker and "#W1000" in marker  # the summary
    # the compression records name what each step did, where, and to how many tokens
    records = html[html.index("<h2>Compression records"):html.index("<h2>Branches")]
    assert "loops omitted" in records and "at message 22" in records
    assert "None" not in records and "—</td><td>by extractive" in records
    # a summary is named by the loops its text covers
    assert re.search(r"<p>loops 0–1 · by extractive[^<]*</p><pre>- Q: where is order 1 "
                     r"[^<]*\n- Q: where is order 2 [^<]*\nIdentifiers[^<]*</pre>", html)
    assert "the session&#x27;s first branch" in html and "None</td>" not in html
    assert "where is order 1" in html and "#W1000" in html
    assert "script-src" not in page.headers["content-security-policy"]  # no script at all
    markup = c.get("/admin/ui/session", params={"id": "markup"}).text
    assert "<script>alert" not in markup and "&lt;script&gt;alert" in markup
    assert "<b>bold</b>" not in markup
    # every tool result is viewable whole
    link = re.search(r"href='(/admin/ui/message\?[^']+)'", html)
    assert link
    whole = c.get(link.group(1).replace("&amp;", "&"))
    assert whole.status_code == 200 and "shipped via carrier-" in whole.text


def test_a_message_page_links_its_neighbours_and_shows_each_calls_arguments(
        inspected: ProxyServer) -> None:
    """The first message links only to the next, the last only to the previous, one between
    to both, each by its position; a call's arguments are shown formatted, and a call
    without any shows an empty box, not "None"."""
    c = logged_in(inspected)
    pages = []
    while (page := c.get("/admin/ui/message", params={"id": "order-desk-7",
                                                       "pos": str(len(pages))})).status_code == 200:
        pages.append(page.text)
    assert page.status_code == 404 and len(pages) > 3
    last = len(pages) - 1

    def nav(pos: int) -> list[str]:
        return re.findall(r"(← message \d+|message \d+ →)", pages[pos])

    assert nav(0) == ["message 1 →"]
    assert nav(1) == ["← message 0", "message 2 →"]
    assert nav(last) == [f"← message {last - 1}"]
    # each page names the run loop its message is in, as the session's segmentation has it
    # (the mutation smoke's survivor: a membership test inverted named another loop)
    from runloop_proxy.conversation.runloops import segment
    from runloop_proxy.pipeline.tools import spliced_stored

    view = inspected.run(inspected.state.store.session("acme", "n:order-desk-7"))
    assert view is not None
    messages = spliced_stored(view.messages, view.internal)[0]
    assert len(messages) == len(pages)
    loops = {p: lp.index for lp in segment(messages) for p in lp.positions}
    assert len(set(loops.values())) > 2
    for pos, text in enumerate(pages):
        where = f", in run loop {loops[pos]}" if pos in loops else ", before the first run loop"
        assert f"{pos} of {len(pages)}{where}" in text, (pos, where)
    calling = next(p for p in pages if "calls <b>" in p)
    shown = re.search(r"<pre>(.*?)</pre>", calling.split("calls <b>")[1], re.S)
    assert shown and "\n  " in shown.group(1)  # the arguments, indented
    assert orjson.loads(html.unescape(shown.group(1)))  # and whole
    bare = calls_html({"role": "assistant", "content": None,  # type: ignore[typeddict-item]
                       "tool_calls": [{"id": "c9", "type": "function",
                                       "function": {"name": "f", "arguments": None}}]})
    assert "<pre></pre>" in bare and "None" not in bare


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_the_last_requests_window_is_the_one_that_went_upstream(
        make_proxy: Any, upstream: ScriptedUpstream, api: str) -> None:
    """A session of a model with a small window (its budget decides what is omitted), tools
    that cost tokens, through either API: the window the inspector shows is the one that went
    upstream, message for message, and its figures are the response's X-Runloop-Tokens."""
    proxy: ProxyServer = make_proxy(admin_key=ADMIN_KEY, context_window=8192,
                                    policy=MECHANISM)
    client = Client(proxy, api, "small-window", model="my-local-model")
    conversation = client.conversation(12)
    cuts = [i for i, item in enumerate(conversation) if answers(item)]
    for cut in cuts[:-1]:
        client.send(conversation[:cut])
    # the model is counted with a fallback encoding and a factor learned from usage
    # (a caller's own: a factor is learned per namespace)
    proxy.state.tokens.calibrate("my-local-model", 100, 130, TENANT)
    # the last request: its open loop's large result fits only what its output reserve leaves
    last = client.send(conversation[:cuts[-1]], **{
        "max_tokens" if api == "chat" else "max_output_tokens": 6000})
    proxy.state.tokens.calibrate("my-local-model", 100, 50, TENANT)  # learned on since
    sent = upstream.requests[-1]
    proxy.settle()
    html = logged_in(proxy).get("/admin/ui/session", params={
        "id": "small-window", "tenant": TENANT}).text
    figures = FIGURES.search(html)
    assert figures, html
    assert ";".join(map(str, numbers(*figures.groups()))) == last.runloop_tokens
    omitted = re.search(r"(\d+) loops? omitted behind a marker", html)
    assert omitted and int(omitted.group(1)) >= 3, html  # the small window's work

    store = proxy.state.store
    view = proxy.run(store.session(TENANT, named_key("small-window")))
    rebuilt = rebuild(proxy.state, proxy.state.config.passthrough, TENANT,
                      named_key("small-window"), view,
                      proxy.run(store.points(TENANT, named_key("small-window"))), {})
    if api == "chat":
        went = sent["messages"]
        shown = rebuilt.window.messages
    else:
        went = to_messages(sent["input"], sent.get("instructions"))
        instructions, items = to_items(rebuilt.window.messages)
        shown = to_messages(items, instructions)
    assert [canonical(m) for m in shown] == [canonical(m) for m in went]


def test_a_chained_request_is_counted_and_shown_as_chained(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    proxy: ProxyServer = make_proxy(admin_key=ADMIN_KEY)
    c = openai.OpenAI(base_url=proxy.url, api_key=KEY, max_retries=0,
                      default_headers={"X-Session-Id": "chained"})
    first = c.responses.create(model="gpt-4o-mini", input="remember 42", store=True)
    ask = [{"role": "user", "content": "what number?"}]
    chained = c.responses.with_raw_response.create(
        model="gpt-4o-mini", previous_response_id=first.id, input=ask,  # type: ignore[arg-type]
        tools=RESPONSES_TOOLS)  # type: ignore[arg-type]
    # the same request alone counts the same as sent (it gets the proxy's tools added)
    alone = openai.OpenAI(base_url=proxy.url, api_key=KEY, max_retries=0).responses \
        .with_raw_response.create(model="gpt-4o-mini", input=ask,  # type: ignore[arg-type]
                                  tools=RESPONSES_TOOLS)  # type: ignore[arg-type]
    client, forwarded = map(int, chained.headers["x-runloop-tokens"].split(";"))
    assert client == forwarded > 40  # the request's message and the tool's schema: untouched
    assert client == int(alone.headers["x-runloop-tokens"].split(";")[0])
    proxy.settle()
    html = logged_in(proxy).get("/admin/ui/session", params={
        "id": "chained", "tenant": TENANT}).text
    assert "chained on a stored response" in html
    assert f"{client:,} tokens sent and forwarded" in html


def test_admin_api_finds_a_session_without_its_tenant(inspected: ProxyServer,
                                                      upstream: ScriptedUpstream) -> None:
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    tenants = httpx.get(inspected.base + "/admin/tenants", headers=auth).json()["tenants"]
    acme = next(t for t in tenants if t["tenant"] == "acme")
    assert acme["configured"] and acme["sessions"] == 2
    view = httpx.get(inspected.base + "/admin/sessions/order-desk-7", headers=auth)
    assert view.status_code == 200 and view.json()["tenant"] == "acme"
    missing = httpx.get(inspected.base + "/admin/sessions/nope", headers=auth)
    assert missing.status_code == 404 and "any tenant" in missing.json()["error"]["message"]


def test_the_admin_apis_data_agrees_with_what_was_stored(inspected: ProxyServer) -> None:
    """What the admin API says of a tenant's sessions is what the proxy stored, read
    another way: the list walked in pages of every size gives each session once, in the
    order of its last use, its total the same on every page; a session's run loops tile
    its messages (ends included), each naming the calls and the question its messages
    hold; its times bracket the requests that made it (created before, updated after the
    last), the list's time of it at most a minute older (the list is written once a
    minute a session); a summary covers the loops it was made for.
    Planted, each passed every other test: a loop's end one past it, the total the page's
    length, a summary's covered loops one past its own, the updated time the created
    one; and the store's page one session too long. Found by it (one CI run in a few): the
    list's time taken a moment after the session's own write, a millisecond past its last
    use; both are now the one time the write gave it (``Job.written_ms``)."""
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}

    def get(path: str, **params: Any) -> Any:
        r = httpx.get(inspected.base + path, headers=auth, params={"tenant": "acme", **params})
        assert r.status_code == 200, r.text
        return r.json()

    before_more = int(time.time() * 1000)
    time.sleep(0.01)  # a later millisecond: the times must tell the turns apart
    c = openai.OpenAI(base_url=inspected.url, api_key=ACME_KEY, max_retries=0)
    for k in range(5):
        c.chat.completions.create(model="gpt-4o-mini", messages=[
            {"role": "user", "content": f"short question {k}"}],
            extra_headers={"X-Session-Id": f"short-{k}"})
    converse(inspected, "order-desk-7", 1)  # one more turn of the long session
    inspected.settle()
    after_all = int(time.time() * 1000)

    everything = get("/admin/sessions", limit=100)
    rows = everything["sessions"]
    total = everything["total"]
    assert total == len(rows) == 7  # two made by the fixture, five here
    assert [r["updated_ms"] for r in rows] == sorted((r["updated_ms"] for r in rows),
                                                     reverse=True)
    for limit in (1, 2, 3, 5):
        walked = []
        for offset in range(0, total + limit, limit):
            page = get("/admin/sessions", limit=limit, offset=offset)
            assert (page["total"], page["offset"], page["limit"]) == (total, offset, limit)
            assert len(page["sessions"]) == max(0, min(limit, total - offset)), (limit, offset)
            walked += page["sessions"]
        assert walked == rows, limit

    listed = {r["session_id"]: r["updated_ms"] for r in rows}
    for row in rows:
        view = get(f"/admin/sessions/{row['session_id']}", messages=1)
        msgs, loops = view["messages"], view["run_loops"]
        assert view["message_count"] == len(msgs) > 0
        # the list is written at most once a minute a session (``RedisStore._index``)
        assert 0 <= view["updated_ms"] - listed[row["session_id"]] <= 60_000
        assert view["created_ms"] <= view["updated_ms"] <= after_all
        if row["session_id"].startswith("short-") or row["name"] == "order-desk-7":
            assert view["updated_ms"] > before_more, row  # a request after the mark
        if row["session_id"].startswith("short-"):
            assert view["created_ms"] > before_more
        elif row["name"] == "order-desk-7":
            assert view["created_ms"] < before_more
        assert loops[0]["start"] == next(i for i, m in enumerate(msgs)
                                         if m["role"] not in ("system", "developer"))
        assert loops[-1]["end"] == len(msgs) - 1
        for lp, nxt in zip(loops, loops[1:], strict=False):
            assert nxt["start"] == lp["end"] + 1 and nxt["index"] == lp["index"] + 1
        for lp in loops:
            held = msgs[lp["start"]:lp["end"] + 1]
            assert lp["tool_call_ids"] == [call["id"] for m in held
                                           for call in m.get("tool_calls") or []]
            assert held[0]["role"] == "user"
            assert " ".join(str(held[0]["content"]).split()).startswith(
                lp["user_preview"].removesuffix(" …"))
        for summary in view["summaries"]:
            assert summary["covers"] == [0, summary["loops"][1] - 1], summary
    assert any(get(f"/admin/sessions/{r['session_id']}")["summaries"] for r in rows)


def two_callers_name(proxy: ProxyServer, session_id: str) -> None:
    """Two pass-through callers (two namespaces) use the same session id."""
    for key in ("sk-first-caller", "sk-second-caller"):
        openai.OpenAI(base_url=proxy.url, api_key=key, max_retries=0,
                      default_headers={"X-Session-Id": session_id}).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}])
    proxy.settle()


def test_an_ambiguous_session_id_is_a_409_naming_the_tenants(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    proxy: ProxyServer = make_proxy(admin_key=ADMIN_KEY)
    two_callers_name(proxy, "shared-id")
    r = httpx.get(proxy.base + "/admin/sessions/shared-id",
                  headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 409
    assert r.json()["error"]["message"].count("pt-") == 2


def test_in_a_real_browser(inspected: ProxyServer, tmp_path: Path) -> None:
    """What a user sees, in Debian's chromium: the session list with each session's size and
    saving, a session's chart with its legend and axes, its figures agreeing, the records
    named, a message formatted. With RUNLOOP_SCREENSHOTS=1 the README's screenshots are
    written from these very pages (docs/); otherwise into a temporary directory."""
    shots = DOCS if os.environ.get("RUNLOOP_SCREENSHOTS") == "1" else tmp_path
    metrics = httpx.get(inspected.base + "/metrics").text
    sent, forwarded = (sum(float(v) for v in re.findall(
        rf'runloop_prompt_tokens_{kind}_total{{[^}}]*tenant="acme"[^}}]*}} (\S+)', metrics))
        for kind in ("client", "forwarded"))
    drv = Browser.start_or_skip()
    try:
        drv.get(inspected.base + "/admin/ui")
        assert drv.current_url.endswith("/admin/ui/login")
        drv.css("input[name=key]").send_keys(ADMIN_KEY)
        drv.navigate(drv.css("button[type=submit]"), "Sessions")
        assert not drv.script("return document.cookie")  # HttpOnly: not readable
        assert drv.css("select[name=tenant] option[selected]").text == "acme (2)"
        rows = {r[0]: r for r in (
            [td.text for td in tr.find_all("css selector", "td")]
            for tr in drv.css_all("table.sessions tr") if tr.find_all("css selector", "td"))}
        assert set(rows) == {"order-desk-7", "markup"}
        assert rows["order-desk-7"][1:3] == ["37", "18"]  # messages, requests
        # the sessions' tokens add up to what the metrics counted for the tenant
        pairs = {name: numbers(*r[3].split(" → ")) for name, r in rows.items()}
        assert [sum(p[0] for p in pairs.values()), sum(p[1] for p in pairs.values())] == \
            [sent, forwarded]
        client, fwd = pairs["order-desk-7"]
        assert rows["order-desk-7"][4] == f"{(client - fwd) / client:.0%}"
        drv.screenshot(shots / "inspector-sessions.png")

        drv.navigate(drv.find("link text", "order-desk-7"), "Session order-desk-7")
        chart = drv.css("svg.chart")
        labels = [t.text for t in chart.find_all("css selector", "text")]
        assert {"sent by the client", "forwarded upstream", "tokens",
                "request (oldest first)"} <= set(labels)
        assert "0" in labels and "1" in labels and "18" in labels  # both axes' ends
        assert len(chart.find_all("css selector", "polyline")) == 2
        body = drv.css("body").text
        caption = CAPTION.search(body.replace("\n", " "))
        figures = re.search(r"the client sent ([\d,]+) tokens, ([\d,]+) went upstream", body)
        assert caption and figures
        assert numbers(*caption.groups()[1:]) == numbers(*figures.groups())
        assert drv.css_all("tr.omitted") and drv.css_all("tr.reduced")
        assert "None" not in body and "loops omitted" in body
        drv.screenshot(shots / "inspector-session.png")

        drv.navigate(drv.find("xpath", "//button[text()='Compact now']"),
                     "Session order-desk-7")
        drv.navigate(drv.css("td a[href*='message']"), "Message 3: tool result")
        assert "carrier-" in drv.css("pre").text
        assert "answers the call\ncall_1 — made in message 2" in drv.css("dl").text
        drv.navigate(drv.find("link text", "message 2"), "Message 2: assistant")
        assert "calls lookup" in drv.css("main").text
        assert drv.css("pre").text == '{\n  "order": "#W1000"\n}'  # its arguments, indented
        drv.get(inspected.base + "/admin/ui/session?id=markup")
        until(lambda: drv.heading() == "Session markup", what="the markup session's page")
        assert "<script>" in drv.css("body").text  # shown as text
    finally:
        drv.quit()


def test_inspect_names_its_own_flag_when_the_id_is_ambiguous(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    import subprocess
    import sys

    proxy: ProxyServer = make_proxy(admin_key=ADMIN_KEY)
    two_callers_name(proxy, "twice")
    r = subprocess.run([sys.executable, "-m", "runloop_proxy", "inspect", "twice", "--url",
                        proxy.base, "--admin-key", ADMIN_KEY], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1
    assert "409" in r.stderr and "--tenant NAME" in r.stderr and "?tenant" not in r.stderr
    one = subprocess.run([sys.executable, "-m", "runloop_proxy", "inspect", "twice", "--url",
                          proxy.base, "--admin-key", ADMIN_KEY, "--tenant",
                          r.stderr.split("tenants: ")[1].split(",")[0]],
                         capture_output=True, text=True, timeout=60)
    assert one.returncode == 0 and "session twice" in one.stdout


def test_a_small_default_context_window_still_answers_hi(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """`serve --context-window 4096` (now --default-context-window) for an unknown model:
    the output reserve fits the window, and a refusal says what the budget was made of."""
    from runloop_proxy.cli import build_parser

    for flag in ("--context-window", "--default-context-window"):
        assert build_parser().parse_args(["serve", flag, "4096"]).context_window == 4096
    proxy: ProxyServer = make_proxy(context_window=4096)
    c = openai.OpenAI(base_url=proxy.url, api_key="sk-small", max_retries=0)
    hi = c.chat.completions.create(model="my-local-model",
                                   messages=[{"role": "user", "content": "hi"}])
    assert hi.choices[0].message.content == "echo: hi"
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="my-local-model", messages=[
            {"role": "user", "content": "word " * 5000}])
    message = str(err.value)
    assert "4096-token context less 1024 reserved for the output" in message
    assert "margin" in message and "for the messages" in message


def _selected(text: str) -> list[str]:
    tenants = text.split("<select name='tenant'>", 1)[1].split("</select>", 1)[0]
    return re.findall(r"<option value='([^']*)' selected>", tenants)


def test_the_sessions_page_stays_on_the_tenant_chosen_and_prices_its_sessions(
        inspected: ProxyServer) -> None:
    """Bug class: a choice the landing page forgets, a list whose figures are not the
    sessions'. Planted: the cookie not read (the second landing red), the listed total made
    of the page's first session only (the totals check red)."""
    from runloop_proxy import savings
    from runloop_proxy.pricing import PriceTable

    c = logged_in(inspected)
    assert _selected(c.get("/admin/ui?tenant=globex").text) == ["globex"]
    assert _selected(c.get("/admin/ui").text) == ["globex"]  # the landing page stays there
    acme = c.get("/admin/ui?tenant=acme").text
    assert _selected(acme) == ["acme"] and _selected(c.get("/admin/ui").text) == ["acme"]
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    points = []
    for sid in ("order-desk-7", "markup"):
        view = httpx.get(f"{inspected.base}/admin/sessions/{sid}",
                         params={"tenant": "acme", "points": "1"}, headers=admin).json()
        points.append(savings.of_points(view["points"], PriceTable.load()))
    total = sum(points, savings.Savings())
    assert total.priced and total.requests >= 10
    assert f"The 2 sessions listed: <b>{html.escape(total.headline())}</b>" in acme, acme
    for one in points:  # each row: its bill saved and money saved
        assert f"{savings.percent(one.bill_saved or 0)}</td><td class='num'>" \
               f"{savings.usd(one.money_saved)}</td>" in acme


@pytest.mark.parametrize(("forwarded", "marked"), [
    ([1200, 2400, 3600], []),
    ([1200, 2400, 900, 1800, 700], [2, 4]),
    ([5000, 5000, 4999], [2]),
    ([800], []),
])
def test_the_chart_marks_each_request_where_the_window_compacted(
        forwarded: list[int], marked: list[int]) -> None:
    """Bug class: a mark off by one request. Planted: the shrink compared with the client's
    prompt (the second row red), the mark drawn at the request before (the titles red)."""
    from runloop_proxy.ops.inspector_chart import chart, compactions

    points = [{"ts": 1_796_000_000_000 + k, "client": 9000 + 1000 * k, "forwarded": f}
              for k, f in enumerate(forwarded)]
    assert compactions(points) == marked
    svg = chart(points)
    titles = re.findall(r"<line class='compaction'[^>]*><title>request (\d+): the window "
                        r"compacted, forwarded ([\d,]+) → ([\d,]+) tokens</title>", svg)
    assert [(int(r), b, a) for r, b, a in titles] == [
        (i + 1, f"{forwarded[i - 1]:,}", f"{forwarded[i]:,}") for i in marked]
    assert ("window compacted</text>" in svg) == bool(marked)
    if marked:
        assert f"The window compacted at {len(marked)} request" in svg


def test_a_message_page_says_what_the_window_did_with_it(inspected: ProxyServer) -> None:
    """The message page and the session page agree: an elided result with its recall ref, a
    message of an omitted loop, the opening kept. Bug class: a message's fate read from
    another message. Planted: the elided lookup ignoring the position (red here and in the
    table below)."""
    c = logged_in(inspected)
    page = c.get("/admin/ui/session", params={"tenant": "acme", "id": "order-desk-7"}).text
    cut = re.search(r"href='(/admin/ui/message\?[^']+)'>[^<]*</a>[^<]*— elided, ref "
                    r"<code>([^<]+)</code>", page)
    if cut:  # the last window elided a result of this session's
        msg = c.get(html.unescape(cut.group(1))).text
        assert "<dt>in the last request's window</dt><dd>elided: the window showed a stub" \
            in msg
        assert f"by its recall ref <code>{cut.group(2)}</code>" in msg
    omitted = re.search(r"<tr class='omitted'><td>(\d+)</td>.*?href='(/admin/ui/message\?"
                        r"[^']+)'", page, re.S)
    assert omitted, "no omitted loop with a tool result"
    msg = c.get(html.unescape(omitted.group(2))).text
    assert f"omitted (behind the marker) (run loop {omitted.group(1)})" in msg, msg[-3000:]
    first = c.get("/admin/ui/message", params={"tenant": "acme", "id": "order-desk-7",
                                               "pos": 0}).text
    assert "kept in full (before the first run loop" in first


def test_window_fate_names_an_elided_message_s_recall_ref() -> None:
    from types import SimpleNamespace

    from runloop_proxy.ops.inspector_message import window_fate
    from runloop_proxy.window.plan import Dropped, Elided

    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_8f2", "type": "function",
                     "function": {"name": "get_order", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_8f2", "content": "x" * 900},
                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    window = SimpleNamespace(elided=[Elided("r7c21", "call_8f2", "get_order", 231, 3)],
                             omitted_loops=0, reduced_loops=0, dropped=Dropped())
    rebuilt = SimpleNamespace(window=window, messages=messages)
    said = window_fate(rebuilt, messages, 3)  # type: ignore[arg-type]
    assert said.startswith("elided: the window showed a stub in its place (231 tokens")
    assert "recall ref <code>r7c21</code>" in said
    assert window_fate(rebuilt, messages, 2).startswith("kept in full")  # type: ignore[arg-type]
    assert window_fate(rebuilt, messages, 0).startswith(  # type: ignore[arg-type]
        "kept in full (before the first run loop")


def _listing(k: int) -> str:
    return "\n".join(f"src/mod_{k}/file_{i}.py: {i * 37} lines, last touched by commit "
                     f"{k:02d}{i:03d}ab" for i in range(24))


def _dropped_in(window: list[dict[str, Any]]) -> int:
    """The tool exchanges a forwarded window of the long loop left out: those its note on
    the question says are not shown."""
    found = re.search(r"The first (\d+) tool exchange\(s\) after this message",
                      "\n".join(str(m.get("content")) for m in window if m.get("role") == "user"))
    return int(found.group(1)) if found else 0


def test_the_inspector_counts_and_places_the_exchanges_dropped_inside_the_open_loop(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """One long run loop through a model with a small window: the proxy elides the loop's
    old results, then drops whole exchanges behind a note. What went upstream, the admin
    API's records and the inspector's page agree: the records' figures are the forwarded
    window's (its messages, the exchanges dropped, the results each elision took), the page
    says how many exchanges were dropped and where, marks each dropped result in the loop
    table (its size in tokens, not characters), and does not call the open loop "in full".
    Bug class: a figure that says less than the window did (planted: the elision record's
    count left at 0 beside its tokens; the loop's fate read without its drops; and, of the
    unit, the tool-result column counting characters)."""
    proxy: ProxyServer = make_proxy(admin_key=ADMIN_KEY, context_window=8192,
                                    policy=MECHANISM)
    sdk = openai.OpenAI(base_url=proxy.url, api_key=KEY, max_retries=0,
                        default_headers={"X-Session-Id": "long-loop"})
    tools = [{"type": "function", "function": {"name": "shell", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string"}}}}}]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You audit repositories."},
        {"role": "user", "content": "Audit every module of the repository, one by one."}]
    calls = 34
    for k in range(calls):
        cid = f"call_{k:02d}{'9f3a' * 5}"
        upstream.push({"content": f"Module {k} next: listing it to see its files and owners "
                                  f"before reading any of them closely. " * 3,
                       "tool_calls": [{"id": cid, "name": "shell",
                                       "arguments": {"cmd": f"ls -l src/mod_{k}"}}]})
        answer = sdk.chat.completions.create(model="my-local-model", messages=messages,  # type: ignore[arg-type]
                                             tools=tools)  # type: ignore[arg-type]
        messages.append(answer.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": cid, "content": _listing(k)})
    upstream.push({"content": "All modules audited."})
    sdk.chat.completions.create(model="my-local-model", messages=messages,  # type: ignore[arg-type]
                                tools=tools)  # type: ignore[arg-type]
    went = upstream.requests[-1]["messages"]
    proxy.settle()

    view = httpx.get(f"{proxy.base}/admin/sessions/long-loop", params={"tenant": TENANT},
                     headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    recs = view["compression_records"]
    drops = [r for r in recs if r["kind"] == "in_loop_drop"]
    assert drops, [r["kind"] for r in recs]
    assert len(upstream.requests) == calls + 1
    # what went upstream, by the length the client sent: request k carried 2 + 2k messages
    sent = {2 + 2 * k: r["messages"] for k, r in enumerate(upstream.requests)}

    def taken(window: list[dict[str, Any]]) -> tuple[int, int]:
        """The exchanges a forwarded window dropped, and the results it shows elided."""
        elided = sum(1 for m in window if m.get("role") == "tool"
                     and not str(m.get("content")).startswith("src/mod_"))
        return _dropped_in(window), elided

    for r in recs:  # each record's figures are those of the window that went upstream
        window = sent[r["messages_before"]]
        exchanges, elided = taken(window)
        assert r["messages_after"] == len(window), r
        assert (r["dropped_exchanges"], r["dropped_messages"], r["elided"]) == \
            (exchanges, 2 * exchanges, elided), r
        if r["kind"] == "in_loop_elision":  # what it took, never 0 beside its tokens
            assert r["results_elided"] > 0 and r["tokens_after"] < r["tokens_before"], r
        if r["kind"] == "in_loop_drop":
            assert r["exchanges_dropped"] > 0, r
            assert r["messages_dropped"] == 2 * r["exchanges_dropped"], r
    dropped, elided_shown = taken(went)
    assert dropped > 0 and len(went) == len(messages) - 2 * dropped
    # every result elided was elided by some step: still shown elided, or dropped since
    assert sum(r.get("results_elided", 0) for r in recs) >= elided_shown + dropped

    page = logged_in(proxy).get("/admin/ui/session", params={
        "id": "long-loop", "tenant": TENANT}).text
    said = re.search(r"(\d+) tool exchanges? \((\d+) messages, ([\d,]+) tokens elided\) "
                     r"dropped inside loop 0, messages (\d+)–(\d+)", page)
    assert said, page
    assert int(said.group(1)) == dropped and int(said.group(2)) == 2 * dropped
    assert (int(said.group(4)), int(said.group(5))) == (2, 1 + 2 * dropped)
    assert f"{elided_shown} tool result{'s' if elided_shown != 1 else ''} elided" in page
    table = page[page.index("<th>the final reply</th>"):page.index("<h2>Summaries")]
    assert "in full (the open loop)" not in table
    also = f", {elided_shown} tool result{'s' if elided_shown != 1 else ''} elided" \
        if elided_shown else ""
    assert f"the open loop: {dropped} tool exchanges dropped ({2 * dropped} messages){also}" \
        f"</td>" in table
    assert table.count(" — dropped") == dropped
    assert " chars" not in table
    first = re.search(r"href='(/admin/ui/message\?[^']+)'>[^<]*</a>[^<]*— dropped", table)
    assert first, table
    msg = logged_in(proxy).get(html.unescape(first.group(1))).text
    assert (f"<dd>dropped: one of {dropped} tool exchanges (messages 2–{1 + 2 * dropped}) "
            f"left out whole") in msg
    sizes = [int(n.replace(",", "")) for n in re.findall(r"shell, ([\d,]+) tokens", table)]
    assert len(sizes) == calls and all(150 < n < 1500 for n in sizes), sizes
    records = page[page.index("<h2>Compression records"):page.index("<h2>Branches")]
    assert f"{drops[-1]['exchanges_dropped']} tool exchange" in records
    assert "tool results elided" in records or "tool result elided" in records
