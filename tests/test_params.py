"""Every parameter of every admin route and inspector page is parsed in one place
(``ops/params.py``): hostile values get a 400 naming the parameter, never a 500. The sweep
walks the route table, so a page added later is swept the day it lands."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import openai
import pytest
from starlette.routing import Route

from runloop_proxy.api.routes import routes
from runloop_proxy.ops import params
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer

ADMIN_KEY = "admin-0123456789abcdef"
OPS = Path(__file__).resolve().parent.parent / "runloop_proxy" / "ops"
NOT_WHOLE = ["abc", "1e3", "10**20", "-1", "1.5", " 1", "²", "٣", "0x10", "1" * 5000,
             "99999999999999999999999"]
NOT_TEXT = ["x" * 5000, "a\x00b"]  # longer than any text parameter; a NUL
ANY_TEXT = ["<script>alert(1)</script>", "../../etc/passwd", "%ff%fe", "😀" * 500, " ",
            "n:", "h:", "fp-", "chain-", "'\"", "\\", "\r\n"]
NOT_FLAG = ["yes", "2", "-1", "TRUE "]
NOT_CHOSEN = ["bogus", "LAST", " desc", "<script>", "1h ", "x" * 5000]


@pytest.fixture
def swept(make_proxy: Any, upstream: ScriptedUpstream) -> ProxyServer:
    proxy: ProxyServer = make_proxy(admin_key=ADMIN_KEY)
    upstream.push({"content": "hello"})
    openai.OpenAI(base_url=proxy.url, api_key="sk-swept", max_retries=0,
                  default_headers={"X-Session-Id": "swept"}).chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    proxy.settle()
    return proxy


def admin_routes() -> list[Route]:
    out = [r for r in routes() if isinstance(r, Route) and r.path.startswith("/admin")]
    assert any(r.path.startswith("/admin/ui") for r in out) and len(out) >= 10
    return out


class Sweep:
    def __init__(self, proxy: ProxyServer):
        self.base = proxy.base
        self.http = httpx.Client(base_url=proxy.base, follow_redirects=False, timeout=30)
        login = self.http.post("/admin/ui/login", data={"key": ADMIN_KEY})
        self.cookie = login.cookies["rl_admin"]
        self.http.cookies.clear()
        tenants = self.http.get("/admin/tenants", headers=self.bearer).json()["tenants"]
        page = self.ui("GET", "/admin/ui/session", {"id": "swept"}, {}).text
        csrf = re.search(r"name='csrf' value='([0-9a-f]+)'", page)
        self.valid: dict[str, str] = {
            "tenant": tenants[0]["tenant"], "id": "swept", "q": "", "page": "0",
            "offset": "0", "limit": "10", "pos": "0", "messages": "1", "points": "1",
            "model": "", "sort": "last", "order": "desc", "within": "",
            "session_id": "swept", "key": ADMIN_KEY, "csrf": csrf.group(1) if csrf else ""}
        assert set(self.valid) == set(params.FIELDS), "a new parameter needs a valid value here"

    @property
    def bearer(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_KEY}"}

    def ui(self, method: str, path: str, query: dict[str, str], form: dict[str, str]
           ) -> httpx.Response:
        self.http.cookies.set("rl_admin", self.cookie)
        r = self.http.request(method, path, params=query, data=form or None)
        self.http.cookies.clear()
        if r.status_code == 303 and path.rstrip("/").endswith("/logout"):
            # a logout ends every login made before it: the sweep logs in again, and the
            # form token is the new login's
            login = self.http.post("/admin/ui/login", data={"key": ADMIN_KEY})
            self.cookie = login.cookies["rl_admin"]
            self.http.cookies.clear()
            page = self.ui("GET", "/admin/ui/session", {"id": "swept"}, {}).text
            csrf = re.search(r"name='csrf' value='([0-9a-f]+)'", page)
            self.valid["csrf"] = csrf.group(1) if csrf else ""
        return r

    def send(self, route: Route, values: dict[str, str]) -> httpx.Response:
        method = "POST" if "POST" in (route.methods or ()) else "GET"
        path = route.path.replace("{session_id:path}", quote(values["session_id"], safe=""))
        query = {k: v for k, v in values.items() if k != "session_id"}
        if path.startswith("/admin/ui"):
            form = {k: query.pop(k) for k in ("key", "csrf", "tenant", "id")} \
                if method == "POST" else {}
            return self.ui(method, path, query, form)
        return self.http.request(method, path, params=query, headers=self.bearer)


def hostile(field: params.Field) -> list[str]:
    if field.kind == "int":
        return NOT_WHOLE
    if field.kind == "flag":
        return NOT_FLAG
    if field.kind == "choice":
        return NOT_CHOSEN
    return NOT_TEXT + ANY_TEXT


def refused(name: str, field: params.Field, value: str) -> bool:
    """Whether ``params`` must refuse this value of the field."""
    if field.kind == "int":
        return not (value.isascii() and value.isdigit() and len(value) <= 12
                    and field.low <= int(value) <= field.high)
    if field.kind == "flag":
        return value not in params.FLAGS
    if field.kind == "choice":
        return value not in params.CHOICES[name]
    return not field.low <= len(value) <= field.high or "\x00" in value


def test_every_parameter_of_every_admin_route_and_page_refuses_hostile_values(
        swept: ProxyServer) -> None:
    sweep = Sweep(swept)
    readers: dict[str, set[str]] = {name: set() for name in params.FIELDS}
    for route in admin_routes():
        baseline = sweep.send(route, sweep.valid)
        assert baseline.status_code < 500, (route.path, baseline.text[:300])
        for name, field in params.FIELDS.items():
            for value in hostile(field):
                r = sweep.send(route, {**sweep.valid, name: value})
                where = f"{route.path} {name}={value[:40]!r}"
                assert r.status_code < 500, f"{where}: {r.status_code} {r.text[:300]}"
                if r.status_code == baseline.status_code:
                    continue  # the route does not read it (or accepts this value)
                if refused(name, field, value):
                    assert r.status_code == 400, f"{where}: {r.status_code} {r.text[:300]}"
                    said = r.json()["error"]["param"] if "json" in \
                        r.headers.get("content-type", "") else r.text
                    assert name in said, f"{where}: the answer does not name it: {said[:200]}"
                    readers[name].add(route.path)
    unread = [name for name, paths in readers.items() if not paths]
    assert not unread, f"declared but refused by no route (dead, or parsed elsewhere): {unread}"


def test_the_session_list_answered_500_for_these(swept: ProxyServer) -> None:
    """Issue 21's finding: ``?page=abc``, ``1e3``, ``10**20`` were 500s."""
    sweep = Sweep(swept)
    for page in ("abc", "1e3", "10**20"):
        r = sweep.ui("GET", "/admin/ui", {"page": page}, {})
        assert r.status_code == 400 and "page must be a whole number" in r.text
    ok = sweep.ui("GET", "/admin/ui", {"page": "3"}, {})
    assert ok.status_code == 200 and "← previous" in ok.text
    api = httpx.get(swept.base + "/admin/sessions", headers=sweep.bearer,
                    params={"tenant": sweep.valid["tenant"], "offset": str(10**20)})
    assert api.status_code == 400 and api.json()["error"]["param"] == "offset"


def test_only_params_reads_request_parameters() -> None:
    """The one place: no other module of ops/ reads a query, a path parameter or a form."""
    for module in OPS.glob("*.py"):
        if module.name == "params.py":
            continue
        text = module.read_text()
        for reader in ("query_params", "path_params", "form.get(", "form["):
            assert reader not in text, f"{module.name} reads {reader} itself"
