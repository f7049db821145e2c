"""Who may call what, swept over the route table: every route the app serves (Starlette's
routes and the conversation handlers the ASGI front serves past them) is classified here, and
each class is checked against the credentials that must not open it — no key, a wrong key,
the tenant's own proxy key, and for the inspector valid login cookies that other admin keys
(a wrong one, the tenant's key used as one) signed. A route nobody classified fails the
sweep, naming itself: a route is covered the day it lands.

Every refusal is checked for what it would have given away (the seeded session's canary
text) and what it would have done (the upstream called, a summary made), and every class has
its control: the same request with the right credential is answered, with the data."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute

from runloop_proxy.api.routes import ALL_METHODS, CONVERSATIONS
from runloop_proxy.ops import inspector_shell as shell
from runloop_proxy.ops.gate import OPEN
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer
from .test_config import ACME_KEY, GLOBEX_KEY, write_config

ADMIN_KEY = "admin-0123456789abcdef"  # write_config's
WRONG_KEY = "admin-not-the-key-0123456789"
CANARY = "CANARY-7f3a9e secret order for Ms Okafor"
SESSION = "canary-desk"
METHODS = tuple(m for m in ALL_METHODS if m != "HEAD")
WEBSOCKET = "WEBSOCKET"  # a WebSocket route's "method": its handshake


class Access(Enum):
    ADMIN = "the admin API: the admin key as Bearer"
    INSPECTOR = "an inspector page: a login cookie the admin key signed"
    LOGIN = "the inspector's login: public, checks the key it is given"
    LOGOUT = "the inspector's logout: public, ends a login"
    TENANT = "a tenant's API: a proxy key of a tenant (tenant mode)"
    PUBLIC = "health, readiness, metrics: public, nothing about sessions or keys"


# Every (method, path) the app serves. A new route is added here with its class, or the
# sweep fails naming it.
ACCESS: dict[tuple[str, str], Access] = {
    ("POST", "/v1/chat/completions"): Access.TENANT,
    ("POST", "/v1/responses"): Access.TENANT,
    (WEBSOCKET, "/v1/responses"): Access.TENANT,  # the handshake, then a response.create
    ("POST", "/v1/messages"): Access.TENANT,
    ("POST", "/v1/messages/count_tokens"): Access.TENANT,
    ("GET", "/healthz"): Access.PUBLIC,
    ("GET", "/readyz"): Access.PUBLIC,
    ("GET", "/metrics"): Access.PUBLIC,
    ("GET", "/admin/tenants"): Access.ADMIN,
    ("GET", "/admin/sessions"): Access.ADMIN,
    ("GET", "/admin/shadow"): Access.ADMIN,
    ("POST", "/admin/sessions/{session_id:path}/compact"): Access.ADMIN,
    ("GET", "/admin/sessions/{session_id:path}"): Access.ADMIN,
    ("GET", "/admin/ui"): Access.INSPECTOR,
    ("GET", "/admin/ui/login"): Access.LOGIN,
    ("POST", "/admin/ui/login"): Access.LOGIN,
    ("POST", "/admin/ui/logout"): Access.LOGOUT,
    ("GET", "/admin/ui/session"): Access.INSPECTOR,
    ("GET", "/admin/ui/message"): Access.INSPECTOR,
    ("POST", "/admin/ui/compact"): Access.INSPECTOR,
    **{(m, "/v1/{path:path}"): Access.TENANT
       for m in ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")},
}
# what the pass-through route asks the upstream for (the scripted upstream records a request
# for a path it does not serve, and answers it 404)
PASSTHROUGH = "files/file-1"
# a request body each conversation route answers with the right key
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "gpt-4o-mini",
                             "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "gpt-4o-mini", "input": "hi"},
    "/v1/messages": {"model": "claude-sonnet-4-6", "max_tokens": 64,
                     "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": "claude-sonnet-4-6",
                                  "messages": [{"role": "user", "content": "hi"}]},
}


def served(app: Any) -> Iterator[tuple[str, str]]:
    """(method, path) of every endpoint a built app serves: its router's routes as they are
    registered — wherever that was, not only ``routes()``; mounts walked; a route with no
    method list (a class or ASGI app endpoint) at every method — and the conversation
    handlers the ASGI front (app.FastPath) serves before Starlette sees them."""
    yield from _table(list(app.app.routes), "")
    for path in CONVERSATIONS:
        yield "POST", path


def _table(table: list[BaseRoute], prefix: str) -> Iterator[tuple[str, str]]:
    for route in table:
        if isinstance(route, Mount):
            inner = list(route.routes)
            if inner:
                yield from _table(inner, prefix + route.path)
            else:  # an ASGI app mounted whole answers every method below its path
                for method in METHODS:
                    yield method, prefix + route.path + "/{path:path}"
        elif isinstance(route, Route):
            for method in sorted(route.methods or METHODS):
                if method != "HEAD":  # Starlette's, with every GET: swept with it
                    yield method, prefix + route.path
        elif isinstance(route, WebSocketRoute):
            yield WEBSOCKET, prefix + route.path
        else:
            raise AssertionError(f"{route!r} is neither a Route nor a Mount: teach the sweep "
                                 f"how to reach it")


def test_every_route_is_classified(proxy: ProxyServer) -> None:
    endpoints = set(served(proxy.app))
    unclassified = sorted(endpoints - set(ACCESS))
    assert not unclassified, (
        "routes nobody said who may call — add each to ACCESS in tests/test_route_security.py "
        "(and a body to BODIES if it needs one): "
        + ", ".join(f"{m} {p}" for m, p in unclassified))
    gone = sorted(set(ACCESS) - endpoints)
    assert not gone, f"ACCESS lists routes the app no longer serves: {gone}"
    # what the gate opens to anyone is exactly the login and logout routes classified here
    public = {(m, p) for (m, p), a in ACCESS.items() if a in (Access.LOGIN, Access.LOGOUT)}
    assert OPEN == public | {("HEAD", p) for m, p in public if m == "GET"}, OPEN


@dataclass
class Credential:
    name: str
    headers: dict[str, str]
    cookies: dict[str, str]


def login_cookie(proxy: ProxyServer, key: str) -> str:
    r = httpx.post(proxy.base + "/admin/ui/login", data={"key": key})
    assert r.status_code == 303, r.text
    return r.cookies["rl_admin"]


class Sweep:
    """The tenant-mode proxy under test, a session with the canary in it, and the other
    proxies whose admin keys sign the cookies that must not work here."""

    def __init__(self, proxy: ProxyServer, upstream: ScriptedUpstream, make_proxy: Any):
        self.proxy, self.upstream = proxy, upstream
        self.cookie = login_cookie(proxy, ADMIN_KEY)
        self.epoch = lambda: proxy.run(proxy.state.logins(1000))
        # valid logins elsewhere: a proxy whose admin key is a wrong one, one whose admin key
        # is the tenant's proxy key (what a tenant could sign with)
        self.foreign = {name: login_cookie(make_proxy(admin_key=key), key)
                        for name, key in (("wrong", WRONG_KEY), ("tenant", ACME_KEY))}
        page = self.request("GET", "/admin/ui/session", {}, {"rl_admin": self.cookie},
                            {"tenant": "acme", "id": SESSION}).text
        csrf = re.search(r"name='csrf' value='([0-9a-f]+)'", page)
        assert csrf, "the session page offers compact now"
        self.csrf = csrf.group(1)

    def request(self, method: str, path: str, headers: dict[str, str],
                cookies: dict[str, str], query: dict[str, str] | None = None,
                json: Any = None, form: dict[str, str] | None = None) -> httpx.Response:
        with httpx.Client(base_url=self.proxy.base, cookies=cookies, timeout=30,
                          follow_redirects=False) as c:
            return c.request(method, path, params=query, headers=headers, json=json,
                             data=form)

    def send(self, method: str, template: str, cred: Credential) -> httpx.Response:
        """The request a legitimate caller of this route would make, with ``cred``."""
        path = template.replace("{session_id:path}", SESSION)
        path = path.replace("{path:path}", PASSTHROUGH)
        leftover = re.search(r"\{[^}]+\}", path)
        assert not leftover, f"{method} {template}: no value for {leftover.group(0)}"
        query: dict[str, str] = {}
        form: dict[str, str] | None = None
        if path.startswith("/admin"):
            query = {"tenant": "acme", "id": SESSION, "pos": "0", "messages": "1"}
        if path == "/admin/ui/compact":
            form, query = {"tenant": "acme", "id": SESSION, "csrf": self.csrf}, {}
        if path == "/admin/ui/login" and method == "POST":
            form = {"key": cred.headers.get("Authorization", "Bearer ")[7:]}
        if method == WEBSOCKET:
            return self.socket(path, cred)
        body = BODIES.get(path) if method == "POST" and path.startswith("/v1/") else None
        return self.request(method, path, cred.headers, cred.cookies, query, body, form)

    def socket(self, path: str, cred: Credential) -> httpx.Response:
        """A WebSocket route as a legitimate caller uses it: the handshake with ``cred``,
        then the route's body as a ``response.create``; a refused handshake is its HTTP
        answer, an accepted one the events it sent (as one response's text)."""
        import orjson
        from websockets.exceptions import InvalidStatus
        from websockets.sync.client import connect

        headers = {**cred.headers}
        if cred.cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in cred.cookies.items())
        url = self.proxy.base.replace("http://", "ws://") + path
        try:
            with connect(url, additional_headers=headers, open_timeout=10) as ws:
                ws.send(orjson.dumps({"type": "response.create", **BODIES[path]}).decode())
                events = []
                while not events or events[-1]["type"] not in ("response.completed", "error"):
                    events.append(orjson.loads(ws.recv(timeout=30)))
        except InvalidStatus as refused:
            return httpx.Response(refused.response.status_code,
                                  content=bytes(refused.response.body or b""))
        return httpx.Response(200, content=orjson.dumps(events))

    def upstream_seen(self) -> int:
        return len(self.upstream.requests) + len(self.upstream.other)

    def summaries(self) -> dict[str, str]:
        ns = "acme"
        return self.proxy.run(self.proxy.state.store.summaries(ns, "n:" + SESSION))  # type: ignore[no-any-return]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def refusing(sweep: Sweep, access: Access) -> list[Credential]:
    """What must not open a route of this class."""
    keys = [Credential("no key", {}, {}), Credential("a wrong key", bearer(WRONG_KEY), {}),
            Credential("the tenant's proxy key", bearer(ACME_KEY), {}),
            Credential("the tenant's proxy key as x-api-key", {"x-api-key": ACME_KEY}, {})]
    if access is Access.INSPECTOR:
        keys += [Credential("a login cookie a wrong admin key signed", {},
                            {"rl_admin": sweep.foreign["wrong"]}),
                 Credential("a login cookie the tenant's proxy key signed", {},
                            {"rl_admin": sweep.foreign["tenant"]}),
                 Credential("a forged cookie", {}, {"rl_admin": "9999999999.deadbeef"}),
                 # signed by the admin key itself, its time over (a planted-bug survivor:
                 # an expiry not checked let a login cookie work for good)
                 Credential("an expired login cookie the admin key signed", {},
                            {"rl_admin": shell.login_cookie(
                                ADMIN_KEY, int(time.time()) - 1, "0" * shell.NONCE_CHARS,
                                sweep.epoch())})]
    if access is Access.TENANT:
        keys = [Credential("no key", {}, {}), Credential("a wrong key", bearer(WRONG_KEY), {}),
                Credential("the admin key", bearer(ADMIN_KEY), {}),
                Credential("the admin key as api-key", {"api-key": ADMIN_KEY}, {}),
                Credential("the admin login cookie", {}, {"rl_admin": sweep.cookie})]
    return keys


def allowed(sweep: Sweep, access: Access) -> Credential:
    if access is Access.INSPECTOR:
        return Credential("the admin login", {}, {"rl_admin": sweep.cookie})
    if access is Access.TENANT:
        return Credential("the tenant's key", bearer(ACME_KEY), {})
    if access in (Access.ADMIN, Access.LOGIN):
        return Credential("the admin key", bearer(ADMIN_KEY), {})
    return Credential("nothing", {}, {})


def check_refused(sweep: Sweep, method: str, path: str, access: Access, cred: Credential,
                  r: httpx.Response) -> None:
    where = f"{method} {path} with {cred.name}"
    assert CANARY not in r.text and SESSION not in r.text, f"{where}: gave the session away"
    if access in (Access.ADMIN, Access.TENANT):
        assert r.status_code == 401, f"{where}: {r.status_code} {r.text[:200]}"
        if method != "HEAD" and path.startswith("/v1/messages"):  # Anthropic's error shape
            assert r.json()["type"] == "error", where
            assert r.json()["error"]["type"] == "authentication_error", where
        elif method != "HEAD":
            assert r.json()["error"]["code"] == "invalid_api_key", where
    elif access is Access.INSPECTOR:
        assert (r.status_code, r.headers.get("location")) == (303, "/admin/ui/login"), \
            f"{where}: {r.status_code} {r.headers.get('location')} {r.text[:200]}"
    elif access is Access.LOGIN and method == "POST":
        assert r.status_code == 401 and "set-cookie" not in r.headers, \
            f"{where}: {r.status_code} {r.headers}"


def check_allowed(sweep: Sweep, method: str, path: str, access: Access,
                  r: httpx.Response) -> None:
    """The control: the right credential opens the route, and it answers with the data."""
    where = f"{method} {path} with the right credential"
    if access is Access.TENANT:  # passed on: the upstream's answer, whatever it is
        assert r.status_code != 401, f"{where}: {r.text[:300]}"
        if path.endswith("/count_tokens"):  # the count of the window the proxy would send
            assert r.status_code == 200 and r.json()["input_tokens"] > 0, \
                f"{where}: {r.text[:300]}"
        elif path in BODIES:
            assert r.status_code == 200 and "echo: hi" in r.text, f"{where}: {r.text[:300]}"
        return
    assert r.status_code < 400, f"{where}: {r.status_code} {r.text[:300]}"
    if access is Access.ADMIN:
        assert "acme" in r.text and (path in ("/admin/tenants", "/admin/shadow")
                                     or SESSION in r.text), where
    elif access is Access.INSPECTOR and method == "GET":
        assert r.status_code == 200 and (SESSION in r.text), where
    elif access is Access.INSPECTOR:  # compact now: done, back to the session's page
        assert r.status_code == 303 and SESSION in r.headers["location"], where
    elif access is Access.LOGIN and method == "POST":
        assert r.status_code == 303 and "rl_admin" in r.cookies, where


@pytest.fixture
def sweep(tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream,
          monkeypatch: pytest.MonkeyPatch) -> Sweep:
    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-up")
    monkeypatch.setenv("TEST_ACME_KEY", ACME_KEY)
    # one closed loop is enough to compact: omitted one at a time, none shown
    root = write_config(tmp_path / "cfg", upstream.url, acme_policy=(
        'summary_model = "extractive"\nmax_run_loops = 0\nomit_batch = 1\n'))
    proxy: ProxyServer = make_proxy(config_dir=str(root))
    openai.OpenAI(base_url=proxy.url, api_key=ACME_KEY, max_retries=0,
                  default_headers={"X-Session-Id": SESSION}).chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": CANARY}])
    proxy.settle()
    return Sweep(proxy, upstream, make_proxy)


def test_every_route_refuses_what_it_must_and_answers_the_right_credential(
        sweep: Sweep) -> None:
    endpoints = sorted(set(served(sweep.proxy.app)))
    for method, path in endpoints:
        access = ACCESS[(method, path)]  # test_every_route_is_classified names a missing one
        for m in (method, "HEAD") if method == "GET" else (method,):
            for cred in refusing(sweep, access):
                seen, summaries = sweep.upstream_seen(), sweep.summaries()
                r = sweep.send(m, path, cred)
                if access in (Access.PUBLIC, Access.LOGOUT) or \
                        (access is Access.LOGIN and m != "POST"):
                    # public: answered, with nothing about sessions or keys
                    assert r.status_code < 400, f"{m} {path}: {r.status_code}"
                    for secret in (CANARY, SESSION, ADMIN_KEY, ACME_KEY, GLOBEX_KEY, "sk-up"):
                        assert secret not in r.text, f"{m} {path} shows {secret!r}"
                    if access is Access.LOGIN and m == "GET":  # a login form, and no more
                        assert "name='key'" in r.text and "log out" not in r.text and \
                            "href='/admin/ui'" not in r.text, r.text
                    continue
                check_refused(sweep, m, path, access, cred, r)
                assert sweep.upstream_seen() == seen, \
                    f"{m} {path} with {cred.name}: refused, yet the upstream was called"
                assert sweep.summaries() == summaries, \
                    f"{m} {path} with {cred.name}: refused, yet it compacted"
        before = sweep.upstream_seen()
        acts = path.endswith("/compact")
        if acts:  # what a compaction leaves, cleared: the control must make it again
            sweep.proxy.run(sweep.proxy.state.store.client.delete(
                sweep.proxy.state.store.prefix("acme", "n:" + SESSION) + ":sum"))
        r = sweep.send(method, path, allowed(sweep, access))
        check_allowed(sweep, method, path, access, r)
        if access is Access.TENANT:  # count_tokens is answered here unless a tenant forwards it
            forwarded = 0 if path.endswith("/count_tokens") else 1
            assert sweep.upstream_seen() == before + forwarded, f"{method} {path}: forwarded?"
        if acts:
            assert any(k.startswith("omit:") for k in sweep.summaries()), \
                f"{method} {path}: answered, and compacted nothing"


def test_without_an_admin_key_the_admin_routes_and_pages_are_off(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """No admin key configured: every admin route and inspector page refuses every caller —
    no key, an empty one, any key at all."""
    proxy: ProxyServer = make_proxy()  # pass-through mode, no admin key
    openai.OpenAI(base_url=proxy.url, api_key="sk-caller-key", max_retries=0,
                  default_headers={"X-Session-Id": SESSION}).chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": CANARY}])
    proxy.settle()
    for method, path in sorted(set(served(proxy.app))):
        access = ACCESS[(method, path)]
        if access not in (Access.ADMIN, Access.INSPECTOR, Access.LOGIN):
            continue
        url = path.replace("{session_id:path}", SESSION)
        for headers in ({}, {"x-api-key": ""}, {"Authorization": "Basic YWRtaW46"},
                        bearer("sk-caller-key"), bearer(WRONG_KEY)):
            with httpx.Client(base_url=proxy.base, follow_redirects=False) as c:
                r = c.request(method, url, headers=headers, params={"id": SESSION},
                              data={"key": headers.get("Authorization", "")[7:]}
                              if method == "POST" else None)
            where = f"{method} {path} with {headers or 'nothing'}"
            assert CANARY not in r.text and SESSION not in r.text, where
            if access is Access.INSPECTOR:
                assert r.status_code == 303 and r.headers["location"] == "/admin/ui/login", \
                    where
            else:
                assert r.status_code == 404 and "disabled" in r.text, \
                    f"{where}: {r.status_code} {r.text[:200]}"
    # and every other method, sub-path and spelling under /admin: off for everyone too
    with httpx.Client(timeout=30, follow_redirects=False) as c:
        for path in admin_paths(proxy.app):
            for method in ALL_METHODS:
                if (method, path) in OPEN:
                    continue
                r = probe(c, proxy, method, path, bearer(WRONG_KEY), {}, {"id": SESSION})
                where = f"{method} {path}"
                assert CANARY not in r.text and SESSION not in r.text, where
                if is_inspector(path):
                    assert (r.status_code, r.headers.get("location")) == \
                        (303, "/admin/ui/login"), f"{where}: {r.status_code}"
                else:
                    assert r.status_code == 404, f"{where}: {r.status_code} {r.text[:200]}"
                    if method != "HEAD":
                        assert r.json()["error"]["message"] == "admin endpoints are disabled " \
                            "(no admin key configured)", f"{where}: {r.text[:200]}"


# --- the admin gate: nothing under /admin answers without the admin's credential ----------
#
# The sweep above sends each route the request a legitimate caller makes. A handler can still
# open on a shape nobody sends it: a sub-path it dispatches itself (an id ending in
# /messages), a query it branches on, a method, a route registered outside routes() or with no
# method list. Those are closed by construction — one gate in the ASGI front (ops.gate) that
# every request under /admin passes before any route — and checked here by what the gate is
# for: every method, every route's path and sub-paths of it, odd spellings and queries, and a
# handler that checks nothing at all in front of every route.

QUERIES: list[dict[str, str] | None] = [
    None, {"tenant": "acme", "id": SESSION, "pos": "0", "messages": "1"},
    {"messages": "0"}, {"id": SESSION, "debug": "1", "tenant": "globex"}]
ELSEWHERE = ["/admin", "/admin/", "/admin/nope", "/admin/debug/vars", "/admin/ui/",
             "/admin/ui/nope", "/admin/ui/login/x", "/admin/ui/logout/x", "/admin/ui/session/x",
             "/admin/ui/login/", "/administrator", f"/admin/sessions/{SESSION}/messages/0",
             "/admin/sessions/", "/admin%2Ftenants", f"/admin/sessions/{SESSION}%2Fmessages"]


def fill(template: str, value: str) -> str:
    return re.sub(r"\{[^}]+\}", value, template)


def admin_paths(app: Any) -> list[str]:
    """Every path under /admin the app routes, and shapes a handler may read that nobody
    sends it: below each route, a path parameter holding more segments, a trailing slash,
    the prefix's case and slashes spelt otherwise, and paths no route serves."""
    out = set(ELSEWHERE)
    for _, template in served(app):
        if not template.startswith("/admin"):
            continue
        for value in (SESSION, f"{SESSION}/messages", f"{SESSION}/compact", f"{SESSION}/a/b"):
            path = fill(template, value)
            out |= {path, path + "/", path + "/x", "/ADMIN" + path[len("/admin"):],
                    "/" + path}
    return sorted(out)


def is_inspector(path: str) -> bool:
    folded = "/" + path.lstrip("/").lower()
    return folded == "/admin/ui" or folded.startswith("/admin/ui/")


def check_gate_refused(where: str, path: str, method: str, r: httpx.Response) -> None:
    """The gate's answer: the inspector's login page, or the admin API's 401."""
    assert CANARY not in r.text and SESSION not in r.text, f"{where}: gave the session away"
    if is_inspector(path):
        assert (r.status_code, r.headers.get("location"), r.content) == \
            (303, "/admin/ui/login", b""), f"{where}: {r.status_code} {r.text[:200]}"
        assert "set-cookie" not in r.headers, where
    else:
        assert r.status_code == 401, f"{where}: {r.status_code} {r.text[:200]}"
        if method != "HEAD":
            assert r.json() == {"error": {
                "message": "admin endpoints need the admin key as Bearer token",
                "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}, \
                f"{where}: {r.text[:200]}"


def probe(c: httpx.Client, proxy: ProxyServer, method: str, path: str,
          headers: dict[str, str], cookies: dict[str, str], query: dict[str, str] | None = None,
          form: dict[str, str] | None = None) -> httpx.Response:
    """A request with exactly these headers and cookies (none kept from an earlier one), to
    the URL whole, so that httpx takes '//admin' as a path, not a host."""
    c.cookies.clear()
    if cookies:
        headers = {**headers, "Cookie": "; ".join(f"{k}={v}" for k, v in cookies.items())}
    return c.request(method, proxy.base + path, params=query, headers=headers, data=form)


def test_nothing_under_admin_answers_without_the_admin_credential(sweep: Sweep) -> None:
    """Every method, every path the router serves under /admin and sub-paths and spellings
    of it, with and without the queries a handler reads: each refusing credential gets the
    gate's refusal — the same answer, whatever the route behind it does — and nothing is read
    or done (upstream, summaries, the stored session)."""
    proxy = sweep.proxy
    admin = bearer(ADMIN_KEY)
    before = sweep.request("GET", f"/admin/sessions/{SESSION}", admin, {},
                           {"tenant": "acme", "messages": "1"}).json()
    seen, summaries = sweep.upstream_seen(), sweep.summaries()
    api_creds = refusing(sweep, Access.ADMIN) + [
        Credential("the admin login cookie (a page's, not the API's)", {},
                   {"rl_admin": sweep.cookie}),
        Credential("Basic auth with the admin key", {"Authorization": "Basic " + __import__(
            "base64").b64encode(f"admin:{ADMIN_KEY}".encode()).decode()}, {})]
    ui_creds = refusing(sweep, Access.INSPECTOR)
    probes = 0
    with httpx.Client(timeout=30, follow_redirects=False) as c:
        for path in admin_paths(proxy.app):
            creds = ui_creds if is_inspector(path) else api_creds
            for method in ALL_METHODS:
                if (method, path) in OPEN:  # the login and logout: the sweep above
                    continue
                for query in QUERIES:
                    # every credential with the legitimate query, the others with no key
                    for cred in creds if query is QUERIES[1] else creds[:1]:
                        r = probe(c, proxy, method, path, cred.headers, cred.cookies, query,
                                  {"tenant": "acme", "id": SESSION, "csrf": sweep.csrf}
                                  if method in ("POST", "PUT", "PATCH") else None)
                        check_gate_refused(f"{method} {path}?{query} with {cred.name}",
                                           path, method, r)
                        probes += 1
    assert probes > 5000, probes  # the sweep reached what it says it does
    assert sweep.upstream_seen() == seen, "refused, yet the upstream was called"
    assert sweep.summaries() == summaries, "refused, yet something compacted"
    after = sweep.request("GET", f"/admin/sessions/{SESSION}", admin, {},
                          {"tenant": "acme", "messages": "1"}).json()
    assert after == before, "refused, yet the stored session changed"
    assert CANARY in str(after["messages"]), "the control: the admin key reads the session"


class Leaky:
    """A route that checks nothing and answers anything — the worst handler there could be,
    as an ASGI app (a Route with no method list: the kind the route walk once missed)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.send", "text": CANARY})
            await send({"type": "websocket.close", "code": 1000})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"x-leaky", b"1"), (b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": CANARY.encode()})


def test_a_handler_that_checks_nothing_is_still_closed(make_proxy: Any) -> None:
    """A route in front of every other, registered outside routes() after the app was built,
    that checks nothing: under /admin only the login and logout reach it without the admin's
    credential, and nothing else with a wrong one; the admin key reaches it on the API's
    paths, the login cookie on the inspector's (so the refusals are the gate's doing)."""
    proxy: ProxyServer = make_proxy(admin_key=ADMIN_KEY)
    login = login_cookie(proxy, ADMIN_KEY)  # before a route in front of the login's
    proxy.app.app.router.routes.insert(0, Route("/{rest:path}", Leaky()))
    proxy.app.app.router.routes.insert(0, Mount("/admin/raw", app=Leaky()))
    proxy.app.app.router.routes.insert(0, Mount("/ws", app=Leaky()))  # websockets' control
    exp = int(time.time()) + 600
    cookie = {"rl_admin": login}
    epoch = proxy.run(proxy.state.logins(1000))  # everything right but the key
    foreign = shell.login_cookie(WRONG_KEY, exp, "0" * shell.NONCE_CHARS, epoch)
    paths = admin_paths(proxy.app) + ["/admin/raw", "/admin/raw/x", "/admin/ui/raw"]
    reached: set[tuple[str, str]] = set()
    with httpx.Client(timeout=30, follow_redirects=False) as c:
        for path in paths:
            for method in ALL_METHODS:
                for headers, cookies in (({}, {}), (bearer(WRONG_KEY), {}),
                                         ({"x-api-key": WRONG_KEY}, {"rl_admin": foreign})):
                    r = probe(c, proxy, method, path, headers, cookies, {"id": SESSION})
                    if r.headers.get("x-leaky"):
                        reached.add((method, path))
                    else:
                        check_gate_refused(f"{method} {path} with {headers}", path, method, r)
                # the controls: the right credential for the path's area reaches the handler
                r = probe(c, proxy, method, path, {}, cookie) if is_inspector(path) else \
                    probe(c, proxy, method, path, bearer(ADMIN_KEY), {})
                assert r.headers.get("x-leaky") == "1", f"{method} {path}: {r.status_code}"
    assert reached == {(m, p) for m, p in OPEN if p in paths}, sorted(reached)
    # and elsewhere the leaky route answers anyone: it is in front of every route
    assert httpx.get(proxy.base + "/healthz").headers.get("x-leaky") == "1"
    # a websocket under /admin is refused before any route, with any credential
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect
    ws = proxy.base.replace("http://", "ws://")
    with connect(ws + "/ws/x") as conn:  # the control: a mount takes websockets
        assert conn.recv(timeout=10) == CANARY
    for path in ("/admin/raw/x", "/ADMIN/raw/x", "/admin/ui"):
        with pytest.raises(InvalidStatus) as refused:
            connect(ws + path, additional_headers=bearer(ADMIN_KEY)).close()
        assert refused.value.response.status_code == 403, path
        assert CANARY.encode() not in refused.value.response.body, path
