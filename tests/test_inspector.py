"""The session inspector (/admin/ui): its security over plain HTTP, and its pages in a real
browser — Debian's chromium, headless, driven through the system chromedriver over the
WebDriver protocol (tests/webdriver.py; nothing downloaded; skipped with a reason where either
is missing)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer, until
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


def test_the_session_page_shows_what_the_window_did(inspected: ProxyServer) -> None:
    c = logged_in(inspected)
    page = c.get("/admin/ui/session", params={"id": "order-desk-7"})  # no tenant: found
    assert page.status_code == 200
    html = page.text
    # a point per request (9 turns, each a lookup and an answer), through the write-behind
    assert "<svg" in html and "18 requests · last: client" in html
    assert "class='omitted'" in html and "class='reduced'" in html
    marker = html[html.index("Marker and summary"):html.index("<table", html.index(
        "Marker and summary"))]
    assert "Summary of the turns not shown" in marker and "#W1000" in marker  # the summary
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


def test_in_a_real_browser(inspected: ProxyServer) -> None:
    drv = Browser.start_or_skip()
    shots = os.environ.get("RUNLOOP_SCREENSHOTS")
    try:
        drv.get(inspected.base + "/admin/ui")
        assert drv.current_url.endswith("/admin/ui/login")
        drv.css("input[name=key]").send_keys(ADMIN_KEY)
        drv.navigate(drv.css("button[type=submit]"), "Sessions")
        assert not drv.script("return document.cookie")  # HttpOnly: not readable
        links = [a.text for a in drv.css_all("td a")]
        assert set(links) == {"order-desk-7", "markup"}
        if shots:
            drv.screenshot(DOCS / "inspector-sessions.png")
        drv.navigate(drv.find("link text", "order-desk-7"), "Session order-desk-7")
        assert drv.css_all("svg polyline")
        assert drv.css_all("tr.omitted")
        if shots:
            drv.screenshot(DOCS / "inspector-session.png")
        drv.navigate(drv.find("xpath", "//button[text()='Compact now']"),
                     "Session order-desk-7")
        drv.navigate(drv.css("td a[href*='message']"), "Message 3 (tool)")
        assert "carrier-" in drv.css("pre").text
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
