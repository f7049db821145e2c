"""``runloop-proxy export``: stored sessions written as replay input, through a running proxy's
admin API, and replayed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from runloop_proxy.ops.export import since_ms
from runloop_proxy.scripted import ScriptedUpstream

from .keys import openai_project_key

ADMIN_KEY = "admin-" + "7c1e" * 10
NOW = 1_796_000_000.0  # 2026-11-30T...Z


@pytest.mark.parametrize(("text", "expected"), [
    ("90m", int((NOW - 5400) * 1000)), ("24h", int((NOW - 86400) * 1000)),
    ("7d", int((NOW - 7 * 86400) * 1000)), ("45s", int((NOW - 45) * 1000)),
    ("1.5h", int((NOW - 5400) * 1000)),
    ("2026-12-01T09:00", 1_796_115_600_000), ("2026-12-01T09:00+01:00", 1_796_112_000_000),
])
def test_since_reads_ages_and_iso_times_utc_unless_said(text: str, expected: int) -> None:
    assert since_ms(text, NOW) == expected


@pytest.mark.parametrize("text", ["yesterday", "24", "h24", "-3h"])
def test_since_refuses_what_it_cannot_read_saying_what_it_takes(text: str) -> None:
    with pytest.raises(ValueError, match=r"expected an age \(90m, 24h, 7d\) or an ISO time"):
        since_ms(text, NOW)


def export(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runloop_proxy", "export", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RUNLOOP_ADMIN_KEY": ADMIN_KEY})


def test_export_writes_what_the_proxy_stored_and_replay_reads_it(
        tmp_path: Path, upstream: ScriptedUpstream, make_proxy: Any) -> None:
    """Bug class: an export that is not what the proxy stored. Planted: the messages cut to
    the points' count (the messages check red), --since compared the wrong way (the since
    check red)."""
    proxy = make_proxy(admin_key=ADMIN_KEY)
    client = openai.OpenAI(base_url=proxy.url, api_key=openai_project_key(3), max_retries=0)
    sent: dict[str, list[dict[str, Any]]] = {}
    for sid in ("ticket-4471-2026-12-02", "ticket-4472-2026-12-02"):
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You answer shipping questions."}]
        for q in range(3):
            messages.append({"role": "user", "content": f"where is order #W{q}81 ({sid})?"})
            answer = client.chat.completions.create(
                model="gpt-4o-mini-2024-07-18", messages=messages,  # type: ignore[arg-type]
                extra_headers={"X-Session-Id": sid})
            messages.append({"role": "assistant",
                             "content": answer.choices[0].message.content})
        sent[sid] = messages
    proxy.settle()
    one = tmp_path / "one.jsonl"
    r = export("ticket-4471-2026-12-02", "--url", proxy.base, "-o", str(one))
    assert r.returncode == 0, r.stderr
    assert f"exported 1 session to {one}; try: runloop-proxy replay {one}" in r.stderr
    lines = [json.loads(x) for x in one.read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["id"] == "ticket-4471-2026-12-02"
    got = [{k: m.get(k) for k in ("role", "content")} for m in lines[0]["messages"]]
    assert got == sent["ticket-4471-2026-12-02"]
    assert lines[0]["meta"]["requests"] == 3
    assert lines[0]["meta"]["models"] == ["gpt-4o-mini-2024-07-18"]

    day = tmp_path / "day.jsonl"
    r = export("--since", "1h", "--url", proxy.base, "-o", str(day))
    assert r.returncode == 0, r.stderr
    ids = sorted(json.loads(x)["id"] for x in day.read_text().splitlines())
    assert ids == sorted(sent)
    future = time.strftime("%Y-%m-%dT%H:%M", time.gmtime(time.time() + 7200))
    r = export("--since", future, "--url", proxy.base)
    assert r.returncode == 0 and r.stdout == "" and "exported 0 sessions" in r.stderr

    replayed = subprocess.run([sys.executable, "-m", "runloop_proxy", "replay", str(day),
                               "--model", "gpt-4o-mini", "--no-progress"],
                              capture_output=True, text=True, timeout=300)
    assert replayed.returncode == 0, replayed.stderr
    assert "2 conversations, 6 requests" in replayed.stdout
    assert "bill saved" in replayed.stdout

    r = export("no-such-session-9d2", "--url", proxy.base)
    assert r.returncode == 1 and "404" in r.stderr and "Traceback" not in r.stderr
    # the session as the client named it, never the store's key for it ("n:…")
    assert "'no-such-session-9d2'" in r.stderr and "n:" not in r.stderr, r.stderr
    for path in ("/admin/sessions/ticket-0000-gone", "/admin/sessions/ticket-0000-gone?"
                 "messages=1", "/admin/ui/session?id=ticket-0000-gone"):
        page = httpx.get(proxy.base + path, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert page.status_code in (303, 404) and "n:ticket" not in page.text, page.text
