"""The inspector's logins: each one unique, every one made before a logout (or an admin key
rotation) ended on every replica, and none holding while the store cannot say which hold."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx

from runloop_proxy.ops.inspector_shell import csrf_token
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer, RedisServer

ADMIN = "admin-7Qm2vX9pL4kR8tW1zY6nB3cD5fG0hJ"
ROTATED = "admin-Ns4Hd8Kq1Vx7Ma3Lp9Wz2Rb6Tc0Ye5"
SESSIONS = "/admin/ui"


def login(proxy: ProxyServer, key: str = ADMIN) -> str:
    r = httpx.post(proxy.base + "/admin/ui/login", data={"key": key})
    assert r.status_code == 303, r.text
    return r.cookies["rl_admin"]


def opens(proxy: ProxyServer, cookie: str) -> bool:
    r = httpx.get(proxy.base + SESSIONS, headers={"Cookie": f"rl_admin={cookie}"})
    assert r.status_code in (200, 303), r.status_code
    return r.status_code == 200


def logout(proxy: ProxyServer, cookie: str | None) -> httpx.Response:
    return httpx.post(proxy.base + "/admin/ui/logout",
                      headers={"Cookie": f"rl_admin={cookie}"} if cookie else {})


def test_each_login_is_its_own_and_a_logout_ends_every_login_before_it(
        make_proxy: Any) -> None:
    """Bug class: a login that outlives the logout (the cookie was an HMAC of its expiry: a
    copy taken before logout opened every tenant's conversations for 12 h, and two logins
    in one second got the same cookie). Two logins in the same second differ, as do their
    CSRF tokens; a logout from either ends both (their copies open nothing), and a login
    after it holds. A logout with no login ends nobody's. Red with the nonce left out of
    the cookie (the same second, the same cookie) and with logout only dropping the
    cookie (the copy still opens)."""
    proxy: ProxyServer = make_proxy(admin_key=ADMIN)
    first, second = login(proxy), login(proxy)  # (most often in the same second)
    assert first != second and first.split(".")[1] != second.split(".")[1]  # nonces
    assert csrf_token(proxy.state, first) != csrf_token(proxy.state, second)
    assert opens(proxy, first) and opens(proxy, second)
    assert logout(proxy, None).status_code == 303  # nobody's login: ends nothing
    assert opens(proxy, first) and opens(proxy, second)
    r = logout(proxy, first)
    assert r.status_code == 303 and r.headers["location"] == "/admin/ui/login"
    assert 'rl_admin=""' in r.headers["set-cookie"] or "Max-Age=0" in r.headers["set-cookie"]
    assert not opens(proxy, first) and not opens(proxy, second)
    third = login(proxy)
    assert opens(proxy, third) and third not in (first, second)


def test_a_logout_on_one_replica_ends_the_login_on_the_other(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Two replicas on one Redis: a login made on one opens the other (they agree through
    the store), and a logout on either ends it on both. Red with the logins' epoch kept in
    each process (the other replica's copy still opens)."""
    prefix = "logins" + str(int(time.time() * 1000))
    one = make_proxy(admin_key=ADMIN, store={"key_prefix": prefix})
    two = make_proxy(admin_key=ADMIN, store={"key_prefix": prefix})
    cookie = login(one)
    assert opens(one, cookie) and opens(two, cookie)
    logout(two, cookie)
    assert not opens(one, cookie) and not opens(two, cookie)
    again = login(two)
    assert opens(one, again)
    key = f"{prefix}:admin:logins"
    ttl = one.run(one.state.store.client.pttl(key))
    assert 0 < ttl <= 12 * 3600 * 1000 + 1000  # a login's life, never for good


def test_an_admin_key_rotated_ends_the_logins_it_made(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """A login made under the old admin key opens nothing once the key is rotated, nor
    after the key is rotated back (A, B, A: the signature alone would hold again). Red
    with the reload not ending the logins."""
    root = tmp_path / "cfg"
    (root / "tenants").mkdir(parents=True)

    def admin_key(key: str) -> None:
        (root / "runloop.toml").write_text(
            f'[server]\nadmin_key = "{key}"\n[upstreams.main]\nurl = "{upstream.url}"\n'
            f'api_key = "sk-proj-rotation-0123456789"\n[defaults]\nupstream = "main"\n')
    admin_key(ADMIN)
    (root / "tenants" / "acme.toml").write_text('keys = ["acme-proxy-key-rotation-01"]\n')
    proxy: ProxyServer = make_proxy(config_dir=str(root))
    before = login(proxy)
    assert opens(proxy, before)
    for key in (ROTATED, ADMIN):
        admin_key(key)
        assert proxy.run(proxy.state.reload("test"))
        assert not opens(proxy, before)
    assert opens(proxy, login(proxy))


def test_no_login_holds_while_the_store_cannot_say_which_do(make_proxy: Any) -> None:
    """Fail closed: with Redis gone, a login made before opens nothing (a 303 to the login
    page) and a new one is refused with a 503 that says why; once Redis is back, a login
    holds again. Red with an unreadable epoch taken as "no logout happened"."""
    server = RedisServer().start()
    try:
        proxy: ProxyServer = make_proxy(admin_key=ADMIN, redis=server.url)
        cookie = login(proxy)
        assert opens(proxy, cookie)
        server.stop()
        assert not opens(proxy, cookie)
        r = httpx.post(proxy.base + "/admin/ui/login", data={"key": ADMIN})
        assert r.status_code == 503 and "set-cookie" not in r.headers
        assert re.search(r"store is unavailable", r.text)
        server.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the store's probe brings it back
            r = httpx.post(proxy.base + "/admin/ui/login", data={"key": ADMIN})
            if r.status_code == 303:
                break
            time.sleep(0.2)
        assert r.status_code == 303 and opens(proxy, r.cookies["rl_admin"])
    finally:
        server.cleanup()
