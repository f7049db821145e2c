"""``runloop-proxy doctor``: each check a line, run as a user runs it against a real scripted
upstream and a real Redis; a failure named with its fix, and the exit code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from runloop_proxy.scripted import ScriptedUpstream

from .conftest import free_port
from .keys import openai_project_key


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "REDIS_URL")}
    return subprocess.run([sys.executable, "-m", "runloop_proxy", "doctor", *args],
                          capture_output=True, text=True, timeout=180, env={**base, **(env or {})})


def test_doctor_says_each_check_passed_for_a_working_setup(
        upstream: ScriptedUpstream, redis_url: str, tmp_path: Path) -> None:
    """Bug class: a check that says ok without its evidence. Planted (each red in the test
    below): the request's status not read (the dead upstream said ok), a Redis error said
    as ok (the unreachable Redis passed). Not caught: the read-back compare dropped (no
    Redis here loses a write)."""
    key = openai_project_key(11)
    r = doctor("--upstream", upstream.url, "--redis-url", redis_url, "--data-dir",
               str(tmp_path), env={"OPENAI_API_KEY": key})
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines] == [
        "ok    config", "ok    encodings", "ok    store", "ok    upstream", "ok    key"], lines
    assert "written and read back" in lines[2] and "gpt-4o-mini answered" in lines[3]
    assert upstream.headers[-1]["authorization"] == f"Bearer {key}"  # the request went up
    assert key not in r.stdout + r.stderr


def test_doctor_names_what_fails_and_exits_1(upstream: ScriptedUpstream, redis_url: str,
                                             tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    r = doctor("--upstream", dead, "--redis-url", redis_url, "--data-dir", str(tmp_path),
               "--key", "sk-doctor-" + "d" * 30)
    assert r.returncode == 1, r.stdout
    assert "FAIL  upstream: not reachable (502)" in r.stdout or \
        "FAIL  upstream: not reachable (503)" in r.stdout, r.stdout
    assert "ok    store" in r.stdout and "1 check failed" in r.stdout

    no_redis = f"redis://127.0.0.1:{free_port()}/0"
    r = doctor("--upstream", upstream.url, "--redis-url", no_redis, "--key", "sk-x" * 8)
    assert r.returncode == 1 and "FAIL  store: redis://127.0.0.1:" in r.stdout, r.stdout
    assert "Traceback" not in r.stderr

    bare = upstream.url.removesuffix("/v1")
    r = doctor("--upstream", bare, "--redis-url", redis_url, "--key", "sk-y" * 8)
    assert r.returncode == 1 and "FAIL  upstream URL:" in r.stdout and \
        f"did you mean {bare}/v1?" in r.stdout, r.stdout

    r = doctor("--upstream", upstream.url, "--redis-url", redis_url)  # no key anywhere
    assert r.returncode == 1 and "FAIL  request: no key to send: --key" in r.stdout

    r = doctor("--config", str(tmp_path / "missing"))
    assert r.returncode == 1 and r.stdout.startswith("FAIL  config:"), r.stdout
