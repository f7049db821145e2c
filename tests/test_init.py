"""``runloop-proxy init``: the directory it writes loads, serves with the keys it printed (and
no other), keeps no key in a file, and is never written over."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from runloop_proxy.scripted import ScriptedUpstream

from .keys import openai_project_key

KEYS = re.compile(r"proxy key \(tenant (\S+)\): (rlp-\S+)\n\s+admin key:\s+(rla-\S+)")


def init(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runloop_proxy", "init", *args],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))


def test_init_writes_a_config_that_serves_with_the_keys_it_printed_once(
        tmp_path: Path, upstream: ScriptedUpstream, make_proxy: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug class: a key init printed that the config it wrote does not accept (or a key kept
    in a file). Planted: the tenant's hash made of another key than the one printed (the
    SDK's call red), the admin key written in plain (the no-key-in-a-file check red)."""
    root = tmp_path / "conf"
    out = init(str(root), "--upstream", upstream.url, "--tenant", "support-eu",
               "--upstream-key-env", "RL_TEST_UPSTREAM_KEY", "--port", "18731")
    assert out.returncode == 0, out.stderr
    found = KEYS.search(out.stdout)
    assert found, out.stdout
    tenant, proxy_key, admin_key = found.groups()
    assert tenant == "support-eu" and len(proxy_key) == len(admin_key) == 47
    assert f"OPENAI_BASE_URL=http://127.0.0.1:18731/v1  OPENAI_API_KEY={proxy_key}" in out.stdout
    assert f"ANTHROPIC_BASE_URL=http://127.0.0.1:18731  ANTHROPIC_API_KEY={proxy_key}" \
        in out.stdout
    files = sorted(p for p in root.rglob("*") if p.is_file())
    assert [p.relative_to(root).as_posix() for p in files] == \
        ["runloop.toml", "tenants/support-eu.toml"]
    for p in files:  # the files hold hashes: no key, nor a part of one long enough to use
        text = p.read_text()
        for key in (proxy_key, admin_key):
            assert key[4:20] not in text, p

    upstream_key = openai_project_key(7)
    monkeypatch.setenv("RL_TEST_UPSTREAM_KEY", upstream_key)
    proxy = make_proxy(config_dir=str(root))
    client = openai.OpenAI(base_url=proxy.url, api_key=proxy_key, max_retries=0)
    answer = client.chat.completions.create(
        model="gpt-4o-mini-2024-07-18", messages=[{"role": "user", "content": "ping 4411"}])
    assert "ping 4411" in (answer.choices[0].message.content or "")
    assert upstream.headers[-1]["authorization"] == f"Bearer {upstream_key}"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=proxy.url, api_key=admin_key, max_retries=0) \
            .chat.completions.create(model="gpt-4o-mini",
                                     messages=[{"role": "user", "content": "x"}])

    tenants = httpx.get(proxy.base + "/admin/tenants",
                        headers={"Authorization": f"Bearer {admin_key}"})
    assert tenants.status_code == 200 and "support-eu" in tenants.text
    wrong = httpx.get(proxy.base + "/admin/tenants",
                      headers={"Authorization": f"Bearer {proxy_key}"})
    assert wrong.status_code == 401
    hashed = re.search(r'admin_key = "(sha256:[0-9a-f]{64})"',
                       (root / "runloop.toml").read_text())
    assert hashed is not None
    as_hash = httpx.get(proxy.base + "/admin/tenants",  # the hash itself is not the key
                        headers={"Authorization": f"Bearer {hashed.group(1)}"})
    assert as_hash.status_code == 401
    ui = httpx.Client(base_url=proxy.base, follow_redirects=False)
    assert ui.post("/admin/ui/login", data={"key": admin_key}).status_code == 303
    assert ui.post("/admin/ui/login", data={"key": proxy_key}).status_code == 401


def test_init_never_writes_over_a_config(tmp_path: Path) -> None:
    root = tmp_path / "conf"
    assert init(str(root)).returncode == 0
    before = {p: p.read_bytes() for p in root.rglob("*.toml")}
    again = init(str(root))
    assert again.returncode == 1 and "already holds a config" in again.stderr
    assert {p: p.read_bytes() for p in root.rglob("*.toml")} == before
    bad = init(str(tmp_path / "other"), "--upstream", 'http://x" injected = "1')
    assert bad.returncode == 2 and "expected an http(s):// URL" in bad.stderr
    assert not (tmp_path / "other").exists()
