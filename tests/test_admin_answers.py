"""What the admin area's answers promise a browser and any cache on the way: nothing kept
(``Cache-Control: no-store``), whatever the route, method, credential or outcome."""

from __future__ import annotations

from typing import Any

import httpx

from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer
from .test_route_security import ADMIN_KEY, CANARY, SESSION, admin_paths

METHODS = ["GET", "HEAD", "POST", "DELETE", "PUT"]


def test_every_admin_answer_is_kept_by_no_cache(make_proxy: Any,
                                                upstream: ScriptedUpstream) -> None:
    """Bug class: an answer under /admin a browser or a proxy may keep (the admin API's
    JSON holds whole conversations; a shared machine's browser cache kept them after
    logout). Swept over every route the app serves under /admin, their sub-paths and
    spellings, five methods, and no credential / the admin key / a login cookie: each
    answer says ``no-store``, the refusals and redirects too. Red with the header added by
    the inspector's pages alone (as before) and with it added only to 200s."""
    proxy: ProxyServer = make_proxy(admin_key=ADMIN_KEY)
    r = httpx.post(proxy.url + "/chat/completions", json={
        "model": "gpt-4o-2024-08-06", "messages": [{"role": "user", "content": CANARY}]},
        headers={"Authorization": "Bearer sk-proj-admin-answers-0123456789",
                 "X-Session-Id": SESSION})
    assert r.status_code == 200
    proxy.settle()
    ui = httpx.Client(base_url=proxy.base, follow_redirects=False, timeout=30)
    login = ui.post("/admin/ui/login", data={"key": ADMIN_KEY})
    assert login.status_code == 303 and login.headers["cache-control"] == "no-store"
    cookie = "; ".join(f"{k}={v}" for k, v in ui.cookies.items())
    credentials = [{}, {"Authorization": f"Bearer {ADMIN_KEY}"}, {"Cookie": cookie}]
    statuses: set[int] = set()
    held = 0
    with httpx.Client(follow_redirects=False, timeout=30) as c:
        for path in admin_paths(proxy.app):
            for method in METHODS:
                for headers in credentials:
                    c.cookies.clear()
                    r = c.request(method, proxy.base + path, headers=headers,
                                  params={"id": SESSION})
                    statuses.add(r.status_code)
                    held += CANARY in r.text
                    assert r.headers.get("cache-control") == "no-store", (
                        method, path, headers, r.status_code)
    assert {200, 303, 401, 404, 405} <= statuses  # the sweep saw every kind of answer
    assert held  # ... the conversation itself among them
