"""Codex CLI, the real one (npm ``@openai/codex``), through the proxy over the Responses API:
its shell tool called by the scripted model, its session stored and compressed like any other.
Skipped where npm or the package is not available (the install needs the npm registry)."""

from __future__ import annotations

import hashlib
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

CODEX_VERSION = "0.169.0"
ADMIN = "admin-0123456789abcdef"
KEY = "sk-codex-test"


@pytest.fixture(scope="session")
def codex_bin() -> str:
    return npm_bin("@openai/codex", CODEX_VERSION, "codex")


def shell_call(body: dict[str, Any]) -> dict[str, Any]:
    """Codex's shell tool, whatever this version calls it, asked to read note.txt."""
    names = {t.get("name") for t in body.get("tools") or []}
    if "exec_command" in names:
        return {"id": "codex_1", "name": "exec_command", "arguments": {"cmd": "cat note.txt"}}
    return {"id": "codex_1", "name": "shell", "arguments": {"command": ["cat", "note.txt"]}}


def run_codex(codex: str, proxy: ProxyServer, home: Path, work: Path, prompt: str) -> str:
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        'model = "gpt-4o-mini"\nmodel_provider = "runloop"\n'
        '[model_providers.runloop]\nname = "runloop"\n'
        f'base_url = "{proxy.url}"\nwire_api = "responses"\nenv_key = "RUNLOOP_TEST_KEY"\n')
    env = {**os.environ, "CODEX_HOME": str(home), "RUNLOOP_TEST_KEY": KEY}
    r = subprocess.run([codex, "exec", "--skip-git-repo-check",
                        "--dangerously-bypass-approvals-and-sandbox", prompt], cwd=work,
                       env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_codex_session_is_stored_and_its_tool_round_passes(
        codex_bin: str, make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    proxy = make_proxy(admin_key=ADMIN)
    work = tmp_path / "work"
    work.mkdir()
    (work / "note.txt").write_text("the magic word is 'tangerine-42'\n")

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        out = [i for i in body["input"] if i.get("type") == "function_call_output"
               and i.get("call_id") == "codex_1"]
        if out:
            said = out[-1]["output"]
            text = said if isinstance(said, str) else orjson.dumps(said).decode()
            return {"content": "note.txt says " + ("tangerine-42" if "tangerine-42" in text
                                                   else "nothing I can read")}
        return {"content": "Reading it.", "reasoning": "opaque-thoughts",
                "tool_calls": [shell_call(body)]}

    upstream.responder = respond
    out = run_codex(codex_bin, proxy, tmp_path / "home", work, "what does note.txt say?")
    assert "note.txt says tangerine-42" in out
    first, second = upstream.requests[0], upstream.requests[-1]
    assert first["store"] is False and first["stream"] is True
    # the proxy's tools ride along from the first request (proxy_tools = "always"), after
    # Codex's own, so the tool list never changes mid-session
    names = [t.get("name") for t in first["tools"]]
    assert names[-2:] == ["recall_tool_call", "search_history"] and "exec_command" in names
    assert len(upstream.requests) == 2
    # Codex named its session (the session-id header): stored under that id
    session = upstream.headers[0].get("session-id") or first.get("prompt_cache_key")
    proxy.settle()
    tenant = "pt-" + hashlib.sha256(KEY.encode()).hexdigest()[:16]
    view = httpx.get(f"{proxy.base}/admin/sessions/{session}", params={
        "tenant": tenant, "messages": "1"}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert view.status_code == 200, view.text
    stored = view.json()["messages"]
    assert stored[-1]["content"] == "note.txt says tangerine-42"
    results = [m for m in stored if m["role"] == "tool"]
    assert results and "tangerine-42" in str(results[-1]["content"])
    assert second["input"][-1]["call_id"] == "codex_1"


def test_a_long_codex_turn_is_compressed_and_still_completes(
        codex_bin: str, make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """One task, fourteen shell calls with large outputs: later requests go up smaller than
    what Codex sends, with the proxy's tools, and Codex gets its answer."""
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
        call["id"] = f"codex_{k}"
        args = call["arguments"]
        if "cmd" in args:
            args["cmd"] = f"cat log{k}.txt"
        else:
            args["command"] = ["cat", f"log{k}.txt"]
        return {"content": None, "tool_calls": [call]}

    upstream.responder = respond
    out = run_codex(codex_bin, proxy, tmp_path / "home", work, "read every log")
    assert f"read {steps} logs" in out
    last = upstream.requests[-1]
    assert {"recall_tool_call", "search_history"} <= {t.get("name") for t in last["tools"]}
    # Codex sent every output whole (14 x ~17 KB); what went up is bounded by the window
    assert len(orjson.dumps(last["input"])) < 0.5 * 14 * 17_000
    cut = [i for i in last["input"] if i.get("type") == "function_call_output"
           and "recall_tool_call" in str(i.get("output"))]
    note = any("not shown" in orjson.dumps(i).decode() for i in last["input"])
    assert cut or note
