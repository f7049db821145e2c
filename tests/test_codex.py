"""Codex CLI, the real one (npm ``@openai/codex``), through the proxy as its users point it there:
its built-in provider with ``openai_base_url`` and an API key login, which speaks the
Responses API over a WebSocket first (a warmup, then each request going on from the last
response with only its new items). Its shell tool is called by the scripted model, its
threads are stored one session each and compressed like any other, across ``codex exec`` and
``codex exec resume``. ``RUNLOOP_CODEX_VERSION`` runs another release (CI runs npm's newest
beside the pinned one). Skipped where npm or the package is not available (the install needs
the npm registry)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer
from .npm import npm_bin

CODEX_VERSION = os.environ.get("RUNLOOP_CODEX_VERSION") or "0.171.0"
ADMIN = "admin-codex-0123456789abcdef"
# an OpenAI project key as long as a real one (164 characters): Codex's login holds it
KEY = "sk-proj-" + "hT4kWm9Qz2Lr7Xc5Vb8N" * 7 + "pA3sD6fG1jK0lZ9x"
TENANT = "pt-" + hashlib.sha256(KEY.encode()).hexdigest()[:16]
MODEL = "gpt-5-mini-2025-08-07"
PROXY_TOOLS = ("recall_tool_call", "search_history")


@pytest.fixture(scope="session")
def codex_bin() -> str:
    return npm_bin("@openai/codex", CODEX_VERSION, "codex")


def test_the_pin_names_one_release() -> None:
    """The pin names a release (not a range): the suite runs one Codex, CI another."""
    assert CODEX_VERSION.count(".") == 2 and CODEX_VERSION.replace(".", "").isdigit()


def shell_call(body: dict[str, Any]) -> dict[str, Any]:
    """Codex's shell tool, whatever this version calls it, asked to read note.txt."""
    names = {t.get("name") for t in body.get("tools") or []}
    if "exec_command" in names:
        return {"id": "call_codex_1", "name": "exec_command", "arguments": {"cmd": "cat note.txt"}}
    return {"id": "call_codex_1", "name": "shell", "arguments": {"command": ["cat", "note.txt"]}}


def codex_home(codex: str, home: Path, proxy: ProxyServer) -> Path:
    """A CODEX_HOME as a user's: the proxy as the built-in provider's base URL, an API key
    login (``codex login --with-api-key``)."""
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(f'model = "{MODEL}"\nopenai_base_url = "{proxy.url}"\n')
    r = subprocess.run([codex, "login", "--with-api-key"], input=KEY, text=True,
                       capture_output=True, env={**os.environ, "CODEX_HOME": str(home)},
                       timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return home


def run_codex(codex: str, home: Path, work: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    r = subprocess.run([codex, "exec", *args], cwd=work, env={**env, "CODEX_HOME": str(home)},
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    # it connected the first time: no refused upgrade retried, no fall back to HTTP
    for sign in ("Reconnecting", "Falling back", "HTTPS transport", "403 Forbidden"):
        assert sign not in r.stderr, r.stderr[-2000:]
    return r


def exec_args(prompt: str, *more: str) -> list[str]:
    return ["--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", *more,
            prompt]


def requests_by_api(proxy: ProxyServer) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in proxy.metrics.requests.collect():
        for s in metric.samples:
            if s.name.endswith("_total") and s.value:
                out[s.labels["api"]] = out.get(s.labels["api"], 0) + s.value
    return out


def sessions(proxy: ProxyServer) -> list[dict[str, Any]]:
    proxy.settle()
    auth = {"Authorization": f"Bearer {ADMIN}"}
    listed = httpx.get(f"{proxy.base}/admin/sessions", headers=auth,
                       params={"tenant": TENANT}).json()["sessions"]
    return [httpx.get(f"{proxy.base}/admin/sessions/{s['session_id']}", headers=auth,
                      params={"tenant": TENANT, "messages": "1"}).json() for s in listed]


def transcripts(home: Path) -> str:
    """Everything Codex kept of its threads (its rollout files)."""
    return "\n".join(p.read_text() for p in sorted((home / "sessions").rglob("*.jsonl")))


def test_codex_session_is_stored_and_its_tool_round_passes(
        codex_bin: str, make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """A tool round over the socket: stored under Codex's thread id, one branch. Red with
    the session-id header lost on the socket (a fingerprint instead)."""
    proxy = make_proxy(admin_key=ADMIN)
    work = tmp_path / "work"
    work.mkdir()
    (work / "note.txt").write_text("the magic word is 'tangerine-42'\n")

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        out = [i for i in body["input"] if i.get("type") == "function_call_output"
               and i.get("call_id") == "call_codex_1"]
        if out:
            said = out[-1]["output"]
            text = said if isinstance(said, str) else orjson.dumps(said).decode()
            return {"content": "note.txt says " + ("tangerine-42" if "tangerine-42" in text
                                                   else "nothing I can read")}
        return {"content": "Reading it.", "reasoning": "opaque-thoughts",
                "tool_calls": [shell_call(body)]}

    upstream.responder = respond
    home = codex_home(codex_bin, tmp_path / "home", proxy)
    out = run_codex(codex_bin, home, work, *exec_args("what does note.txt say?")).stdout
    assert "note.txt says tangerine-42" in out
    first, second = upstream.requests[0], upstream.requests[-1]
    assert first["store"] is False and first["stream"] is True
    assert "type" not in first and "generate" not in first  # the socket's envelope stays
    # the proxy's tools ride along from the first request (proxy_tools = "always"), after
    # Codex's own, so the tool list never changes mid-session
    names = [t.get("name") for t in first["tools"]]
    assert names[-2:] == list(PROXY_TOOLS) and "exec_command" in names
    assert len(upstream.requests) == 2
    # over the socket: a warmup the proxy answered, two turns; nothing over HTTP
    assert requests_by_api(proxy) == {"responses_warmup": 1, "responses_ws": 2}
    # the second turn went on from the first with its new items only; the upstream got all
    assert second["input"][:len(first["input"])] == first["input"]
    assert second["input"][-1]["call_id"] == "call_codex_1"
    (view,) = sessions(proxy)
    assert view["name"] == upstream.headers[0]["session-id"]  # Codex's thread names it
    stored = view["messages"]
    assert stored[-1]["content"] == "note.txt says tangerine-42"
    results = [m for m in stored if m["role"] == "tool"]
    assert results and "tangerine-42" in str(results[-1]["content"])
    assert len(view["branches"]) == 1


def test_a_long_codex_turn_is_compressed_and_still_completes(
        codex_bin: str, make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """One task, fourteen shell calls with large outputs: later requests go up smaller than
    what Codex sends, with the proxy's tools, and Codex gets its answer; none of the
    proxy's tools is in what Codex kept of the thread."""
    proxy = make_proxy(admin_key=ADMIN)
    work = tmp_path / "work"
    work.mkdir()
    for k in range(14):
        (work / f"log{k}.txt").write_text("\n".join(f"log {k} line {i}: status ok"
                                                    for i in range(600)))
    steps = 14
    asked: list[int] = []  # the fake model counts its own calls (the window cuts old ones)

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        k = len(asked)
        if k >= steps:
            return {"content": f"read {k} logs"}
        asked.append(k)
        call = shell_call(body)
        call["id"] = f"call_log_{k}"
        args = call["arguments"]
        if "cmd" in args:
            args["cmd"] = f"cat log{k}.txt"
        else:
            args["command"] = ["cat", f"log{k}.txt"]
        return {"content": None, "tool_calls": [call]}

    upstream.responder = respond
    home = codex_home(codex_bin, tmp_path / "home", proxy)
    out = run_codex(codex_bin, home, work, *exec_args("read every log")).stdout
    assert f"read {steps} logs" in out
    last = upstream.requests[-1]
    assert set(PROXY_TOOLS) <= {t.get("name") for t in last["tools"]}
    # Codex sent every output whole (14 x ~17 KB); what went up is bounded by the window
    assert len(orjson.dumps(last["input"])) < 0.5 * 14 * 17_000
    cut = [i for i in last["input"] if i.get("type") == "function_call_output"
           and "recall_tool_call" in str(i.get("output"))]
    note = any("not shown" in orjson.dumps(i).decode() for i in last["input"])
    assert cut or note
    kept = transcripts(home)
    assert "log 13 line 599" in kept and not any(name in kept for name in PROXY_TOOLS)
    assert requests_by_api(proxy).get("responses", 0) == 0


def test_threads_over_exec_and_resume_are_one_session_each_with_one_branch(
        codex_bin: str, make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """Three turns of one thread (``exec``, then ``exec resume --last`` twice), each its own
    Codex process and socket, and a second thread: two sessions, each one branch holding
    its turns in order; every process connected the first time. Red with a continuation
    that forgets the output it kept (each resume forks its session) and with the socket
    refused (403: Codex retries, then falls back to HTTP)."""
    proxy = make_proxy(admin_key=ADMIN)
    work = tmp_path / "work"
    work.mkdir()
    (work / "note.txt").write_text("release 7.4.1 ships on Thursday\n")

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        said = [i for i in body["input"] if i.get("type") == "message"
                and i.get("role") == "user"][-1]
        text = orjson.dumps(said).decode()
        if "turn 1" in text and not any(i.get("type") == "function_call_output"
                                        for i in body["input"]):
            return {"content": "Checking.", "tool_calls": [shell_call(body)]}
        for t in ("turn 3", "turn 2", "turn 1", "other thread"):
            if t in text:
                return {"content": f"answered {t}"}
        return {"content": "ok"}

    upstream.responder = respond
    home = codex_home(codex_bin, tmp_path / "home", proxy)
    outs = [run_codex(codex_bin, home, work, *exec_args("turn 1: when does it ship?")).stdout]
    for t in (2, 3):
        outs.append(run_codex(codex_bin, home, work, "resume", "--last",
                              *exec_args(f"turn {t}: and then?")).stdout)
    outs.append(run_codex(codex_bin, home, work, *exec_args("other thread: hello")).stdout)
    assert [f"answered {t}" in o for t, o in zip(
        ("turn 1", "turn 2", "turn 3", "other thread"), outs, strict=True)] == [True] * 4
    views = sorted(sessions(proxy), key=lambda v: v["message_count"])
    assert len(views) == 2
    other, thread = views
    assert [len(v["branches"]) for v in views] == [1, 1]
    finals = [m["content"] for m in thread["messages"] if m["role"] == "assistant"
              and isinstance(m["content"], str) and m["content"].startswith("answered")]
    assert finals == ["answered turn 1", "answered turn 2", "answered turn 3"]
    assert other["messages"][-1]["content"] == "answered other thread"
    # every request went over a socket; the upstream got each as the whole conversation
    counts = requests_by_api(proxy)
    assert counts.get("responses", 0) == 0 and counts["responses_ws"] == len(upstream.requests)
    turn3 = upstream.requests[-2]["input"]
    assert json.dumps(turn3).count("turn 1: when does it ship?") == 1
