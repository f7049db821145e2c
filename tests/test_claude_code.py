"""Claude Code, the real one (npm ``@anthropic-ai/claude-code``, the release ``VERSION`` pins;
``RUNLOOP_CLAUDE_CODE_VERSION`` runs another, as CI does npm's newest), headless through the
proxy over the Messages API: the scripted model drives it over several turns into its own
Bash tool, reading files large enough to be cut; its session is the one it names, the window
compresses it, the model recalls a cut result in a round Claude Code never sees, and every
turn finishes. Skipped where npm or the package is not available (the install needs the npm
registry)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer
from .npm import npm_bin

# the release CI is gated on; RUNLOOP_CLAUDE_CODE_VERSION runs another (CI runs npm's newest
# too, loudly, never failing the run)
VERSION = os.environ.get("RUNLOOP_CLAUDE_CODE_VERSION") or "2.1.332"
ADMIN = "admin-0123456789abcdef"
KEY = "cc-proxy-key-0123456789"
MODEL = "claude-sonnet-4-6"
FILES = 12  # log files, ~4k tokens each
PER_TURN = 4  # read per turn
RECALL_ID = "toolu_recall"
SEARCH_ID = "toolu_search"


@pytest.fixture(scope="session")
def claude_bin() -> str:
    return npm_bin("@anthropic-ai/claude-code", VERSION, "claude")


def claude_proxy(tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream,
                 fmt: str = "anthropic") -> ProxyServer:
    """A tenant for Claude Code: an upstream of Anthropic's format (or ``fmt``), and a working
    budget above what Claude Code's system prompt and tools take (~20k tokens) by a
    session's worth."""
    cfg = tmp_path / "cfg"
    (cfg / "tenants").mkdir(parents=True)
    (cfg / "runloop.toml").write_text(
        f'[upstreams.claude]\nurl = "{upstream.url}"\nformat = "{fmt}"\n'
        f'api_key = "sk-ant-upstream"\n')
    (cfg / "tenants" / "dev.toml").write_text(
        f'keys = ["{KEY}"]\nupstream = "claude"\n[policy]\nsoft_budget_tokens = 40000\n'
        f'clear_at_least = 4000\n')
    return make_proxy(config_dir=str(cfg), admin_key=ADMIN)  # type: ignore[no-any-return]


def run_claude(claude: str, proxy: ProxyServer, home: Path, work: Path, prompt: str,
               *more: str, model: str | None = MODEL, **env_vars: str) -> list[dict[str, Any]]:
    env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": proxy.base,
           "ANTHROPIC_API_KEY": KEY, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
           "IS_SANDBOX": "1", **env_vars}  # IS_SANDBOX: root may skip permission prompts
    r = subprocess.run([claude, "-p", prompt, "--output-format", "stream-json", "--verbose",
                        *(("--model", model) if model else ()),
                        "--dangerously-skip-permissions", *more],
                       cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    return [orjson.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def workspace(tmp_path: Path) -> tuple[Path, Path]:
    """Claude Code's working directory, with the logs the scripted model reads, and HOME."""
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    for k in range(FILES):
        (work / f"log{k}.txt").write_text("\n".join(f"log {k} line {i}: status ok, "
                                                    f"id {k * 1000 + i}" for i in range(600)))
    return work, home


def session_of_turns(claude: str, proxy: ProxyServer, home: Path, work: Path,
                     model: str = MODEL, **env_vars: str) -> None:
    """One Claude Code session (``--continue`` after the first turn), a turn per group of
    logs: every turn finishes with the scripted model's answer, the last one's recall came
    back whole, and Claude Code never saw the proxy's call (not in its stream, not in what
    it sent back)."""
    outputs = []
    for turn in range(FILES // PER_TURN):
        more = ("--continue",) if turn else ()
        outputs.append(run_claude(claude, proxy, home, work,
                                  f"turn {turn}: read logs {turn * PER_TURN} to "
                                  f"{(turn + 1) * PER_TURN - 1}", *more, model=model,
                                  **env_vars))
    finals = [[e for e in out if e.get("type") == "result"][-1] for out in outputs]
    assert [f["subtype"] for f in finals] == ["success"] * len(finals)
    assert [f["result"] for f in finals][:-1] == [f"turn {t} done"
                                                  for t in range(len(finals) - 1)]
    assert finals[-1]["result"] == f"turn {len(finals) - 1} done; recalled log 0: intact"
    assert not any("recall_tool_call" in orjson.dumps(e).decode()
                   for out in outputs for e in out if e.get("type") == "assistant")


def results_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    last = body["messages"][-1]["content"]
    return [b for b in last if isinstance(b, dict) and b.get("type") == "tool_result"] \
        if isinstance(last, list) else []


def model(body: dict[str, Any]) -> dict[str, Any]:
    """The scripted model: on "turn T" it reads its turn's logs with Bash, one per round
    (call ids say which), then answers; on the last turn it first recalls log 0's output,
    out of view by then, by the ref the window shows for it or (when the turn is omitted)
    the id search_history finds it under."""
    if "Bash" not in {t.get("name") for t in body.get("tools") or []}:
        return {"content": "ok"}  # a side request (a title, a check)
    prompt = _last_prompt(body)
    turn = int(prompt.split()[1].rstrip(":"))
    done = [b for b in results_of(body) if b["tool_use_id"].startswith(f"toolu_t{turn}_")]
    recalled = [b for b in results_of(body) if b["tool_use_id"] == RECALL_ID]
    if recalled:
        text = orjson.dumps(recalled[0]["content"]).decode()
        return {"content": f"turn {turn} done; recalled log 0: "
                           f"{'intact' if 'log 0 line 599' in text else 'missing'}"}
    found = [b for b in results_of(body) if b["tool_use_id"] == SEARCH_ID]
    k = int(done[0]["tool_use_id"].rsplit("_", 1)[1]) + 1 if done else turn * PER_TURN
    if k < (turn + 1) * PER_TURN and not found:
        return {"content": f"Reading log {k}.", "tool_calls": [{
            "id": f"toolu_t{turn}_{k}", "name": "Bash",
            "arguments": {"command": f"cat log{k}.txt", "description": f"read log {k}"}}]}
    if turn < FILES // PER_TURN - 1:
        return {"content": f"turn {turn} done"}
    ref = _ref_of_log0(body) if not found else re.search(
        r"id=(\w+)", orjson.dumps(found[0]["content"]).decode()).group(1)  # type: ignore[union-attr]
    if ref is not None:
        return {"content": "Checking log 0 again.", "tool_calls": [{
            "id": RECALL_ID, "name": "recall_tool_call", "arguments": {"call_id": ref}}]}
    return {"content": "Where was log 0?", "tool_calls": [{  # not in view: search for it
        "id": SEARCH_ID, "name": "search_history", "arguments": {"query": "log 0 line 599"}}]}


def _last_prompt(body: dict[str, Any]) -> str:
    for turn in reversed(body["messages"]):
        content = turn["content"]
        for b in content if isinstance(content, list) else [{"type": "text", "text": content}]:
            if turn["role"] == "user" and b.get("type") == "text" \
                    and re.match(r"turn \d+:", b.get("text", "")):
                return str(b["text"])
    raise AssertionError("no turn prompt in the request")


def _ref_of_log0(body: dict[str, Any]) -> str | None:
    text = orjson.dumps(body["messages"]).decode()
    if "(calls toolu_t0_0 " in text:
        return "toolu_t0_0"
    for turn in body["messages"]:
        for b in turn["content"] if isinstance(turn["content"], list) else []:
            if b.get("type") == "tool_result" and b["tool_use_id"] == "toolu_t0_0":
                found = re.search(r'recall_tool_call\(call_id="(\w+)"\)',
                                  orjson.dumps(b["content"]).decode())
                return found.group(1) if found else None
    found = re.search(r'(\w+) Bash\(command=cat log0\.txt', text)
    return found.group(1) if found else None


def test_claude_code_runs_through_the_proxy_compressed_and_recalled(
        claude_bin: str, make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    proxy = claude_proxy(tmp_path, make_proxy, upstream)
    work, home = workspace(tmp_path)
    upstream.responder = model
    session_of_turns(claude_bin, proxy, home, work)
    main = [b for b in upstream.requests if len(b.get("tools") or []) > 2]
    sessions = {orjson.loads(b["metadata"]["user_id"])["session_id"] for b in main}
    assert len(sessions) == 1  # --continue: one Claude Code session
    session = sessions.pop()
    # the session is the one Claude Code named, stored whole
    proxy.settle()
    view = httpx.get(f"{proxy.base}/admin/sessions/{session}", headers={
        "Authorization": f"Bearer {ADMIN}"}, params={"messages": "1", "tenant": "dev"})
    assert view.status_code == 200, view.text
    stored = view.json()["messages"]
    outputs_stored = [m for m in stored if m["role"] == "tool"]
    assert len(outputs_stored) >= FILES
    assert any("log 0 line 599" in orjson.dumps(m["content"]).decode() for m in outputs_stored)
    # compressed: what went upstream at the end is a fraction of what Claude Code sent
    metrics = proxy.metrics.registry
    client = metrics.get_sample_value("runloop_prompt_tokens_client_total",
                                      {"tenant": "dev", "model": MODEL})
    forwarded = metrics.get_sample_value("runloop_prompt_tokens_forwarded_total",
                                         {"tenant": "dev", "model": MODEL})
    assert forwarded < 0.8 * client
    assert metrics.get_sample_value("runloop_recalls_total", {
        "tenant": "dev", "tool": "recall_tool_call", "outcome": "hit"}) == 1
    assert any(b["messages"][-1]["content"][0].get("tool_use_id") == RECALL_ID
               for b in upstream.requests if isinstance(b["messages"][-1]["content"], list))


def test_the_newest_defaults_through_a_default_proxy_are_one_session_one_branch(
        claude_bin: str, make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """Claude Code with its own default model (2.1.332: ``claude-opus-5-5``, a 1M model,
    with ``max_tokens`` 128,000) through ``serve``'s default configuration:
    three turns, the second ``--continue``, the third ``--resume`` by the session's id; no
    request refused, every turn answered, one stored session with one branch (Claude Code
    moves its cache mark every request), and the proxy's tools in none of Claude Code's
    transcripts. Red with the mark counted as content (a branch per request) and the
    environment's system turn, sent in a marked block and then as a string, read as two
    turns (a fork at it). (The guessed window's refusal is tests/test_windows.py's.)"""
    proxy = make_proxy(admin_key=ADMIN)
    work, home = workspace(tmp_path)
    upstream.responder = model
    outputs = []
    session = None
    for turn in range(FILES // PER_TURN):
        more: tuple[str, ...] = ()
        if turn == 1:
            more = ("--continue",)
        elif turn == 2:
            assert session is not None
            more = ("--resume", session)
        out = run_claude(claude_bin, proxy, home, work,
                         f"turn {turn}: read logs {turn * PER_TURN} to "
                         f"{(turn + 1) * PER_TURN - 1}", *more, model=None)
        outputs.append(out)
        session = next(e["session_id"] for e in out if e.get("session_id"))
    finals = [[e for e in out if e.get("type") == "result"][-1] for out in outputs]
    assert [f["subtype"] for f in finals] == ["success"] * len(finals), finals
    assert finals[-1]["result"].startswith(f"turn {len(finals) - 1} done")
    main = [b for b in upstream.requests if len(b.get("tools") or []) > 2]
    models = {b["model"] for b in main}
    print(f"Claude Code {VERSION}: model {models}, max_tokens "
          f"{sorted({b.get('max_tokens') for b in main})}, {len(main)} main requests")
    assert all(b.get("max_tokens") for b in main)
    proxy.settle()
    auth = {"Authorization": f"Bearer {ADMIN}"}
    tenant = "pt-" + hashlib.sha256(KEY.encode()).hexdigest()[:16]
    listed = httpx.get(f"{proxy.base}/admin/sessions", headers=auth,
                       params={"tenant": tenant}).json()["sessions"]
    named = [s for s in listed if not s["session_id"].startswith("fp-")]
    assert len(named) == 1, listed  # side requests (titles, checks) are fingerprinted apart
    view = httpx.get(f"{proxy.base}/admin/sessions/{named[0]['session_id']}", headers=auth,
                     params={"tenant": tenant, "messages": "1"}).json()
    assert len(view["branches"]) == 1, view["branches"]
    transcripts = "\n".join(p.read_text() for p in (home / ".claude").rglob("*.jsonl"))
    assert transcripts and "recall_tool_call" not in transcripts \
        and "search_history" not in transcripts


# -- the bridge: Claude Code on a model that speaks chat completions ---------------------------

CHAT_MODEL = "gpt-4o"


def as_messages(body: dict[str, Any]) -> dict[str, Any]:
    """A chat body read the way ``model`` reads a Messages one: tools by name, a turn per
    role (each line of a user's text a text block, as Claude Code sends its prompt after its
    reminders), calls as tool_use blocks, results as tool_result blocks."""
    turns: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"] += blocks
        else:
            turns.append({"role": role, "content": blocks})

    for m in body["messages"]:
        content = m.get("content")
        if m["role"] == "assistant":
            add("assistant", ([{"type": "text", "text": content}] if content else []) + [
                {"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": orjson.loads(c["function"]["arguments"])}
                for c in m.get("tool_calls") or []])
        elif m["role"] == "tool":
            add("user", [{"type": "tool_result", "tool_use_id": m["tool_call_id"],
                          "content": content}])
        elif m["role"] == "user":
            text = content if isinstance(content, str) else "\n".join(
                p.get("text", "") for p in content)
            add("user", [{"type": "text", "text": line} for line in text.split("\n")])
    return {"tools": [{"name": t["function"]["name"]} for t in body.get("tools") or []],
            "messages": turns}


def test_claude_code_runs_on_a_chat_model_through_the_bridge(
        claude_bin: str, make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """The same session with an upstream that speaks chat completions only (``format =
    "chat"``): Claude Code finishes every turn on the scripted chat model, the proxy's
    window compresses it and a recall is answered in a round Claude Code never sees; the
    upstream gets chat bodies, nothing else."""
    proxy = claude_proxy(tmp_path, make_proxy, upstream, fmt="chat")
    work, home = workspace(tmp_path)
    upstream.responder = lambda body: model(as_messages(body))
    session_of_turns(claude_bin, proxy, home, work, model=CHAT_MODEL,
                     ANTHROPIC_DEFAULT_HAIKU_MODEL=CHAT_MODEL,
                     ANTHROPIC_SMALL_FAST_MODEL=CHAT_MODEL)
    # the upstream got chat completions only, every one with Claude Code's tools as functions
    assert upstream.requests and all("messages" in b and "system" not in b
                                     for b in upstream.requests)
    assert not [o for o in upstream.other if "/messages" in o[1]]
    main = [b for b in upstream.requests if len(b.get("tools") or []) > 2]
    assert all(t["type"] == "function" for b in main for t in b["tools"])
    sessions = {orjson.loads(b["user"])["session_id"] for b in main}
    assert len(sessions) == 1  # --continue: one Claude Code session, named by Claude Code
    proxy.settle()
    view = httpx.get(f"{proxy.base}/admin/sessions/{sessions.pop()}", headers={
        "Authorization": f"Bearer {ADMIN}"}, params={"messages": "1", "tenant": "dev"})
    assert view.status_code == 200, view.text
    assert sum(m["role"] == "tool" for m in view.json()["messages"]) >= FILES
    metrics = proxy.metrics.registry
    labels = {"tenant": "dev", "model": CHAT_MODEL}
    client = metrics.get_sample_value("runloop_prompt_tokens_client_total", labels)
    forwarded = metrics.get_sample_value("runloop_prompt_tokens_forwarded_total", labels)
    recalls = metrics.get_sample_value("runloop_recalls_total", {
        "tenant": "dev", "tool": "recall_tool_call", "outcome": "hit"})
    print(f"bridge session: {len(upstream.requests)} upstream calls, prompt tokens "
          f"{client:,.0f} sent by Claude Code -> {forwarded:,.0f} forwarded, "
          f"recalls answered {recalls:.0f}")
    assert forwarded < 0.8 * client
    assert recalls == 1


# -- a small window: the real CLI over turns, compressed, one session, one branch -------------

SMALL_WINDOW = 32_000


def test_claude_code_at_a_32k_window_is_one_session_one_branch_and_compressed(
        claude_bin: str, make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """The tenant gives the model a 32,000-token window (its ``[models]`` table; the working
    budget above it, so the window is what bounds the prompt) and Claude
    Code asks for 4,096 output tokens (``CLAUDE_CODE_MAX_OUTPUT_TOKENS``; its own 32,000 would
    leave a known 32k window nothing for the prompt). Three turns, ``--continue`` then
    ``--resume`` by id, each reading four ~4k-token logs over Claude Code's ~20k tokens of
    system prompt and tools: every turn answered (no request refused, none over the window
    upstream), one stored session with one branch, what went upstream well under what
    Claude Code sent, the proxy's tools in none of Claude Code's transcripts, and the
    count_tokens of the session's window (what ``/context`` asks) answered by the proxy
    within the window. Red with the tenant's window not applied (the upstream gets
    requests over 32k) and with the cache marks counted as content (a branch per
    request)."""
    cfg = tmp_path / "cfg"
    (cfg / "tenants").mkdir(parents=True)
    (cfg / "runloop.toml").write_text(
        f'[upstreams.claude]\nurl = "{upstream.url}"\nformat = "anthropic"\n'
        f'api_key = "sk-ant-upstream"\n')
    (cfg / "tenants" / "dev.toml").write_text(
        f'keys = ["{KEY}"]\nupstream = "claude"\n[policy]\nsoft_budget_tokens = 150000\n'
        f'[models."{MODEL}"]\ncontext_window = {SMALL_WINDOW}\n')
    proxy = make_proxy(config_dir=str(cfg), admin_key=ADMIN)
    work, home = workspace(tmp_path)
    upstream.responder = model
    outputs, session = [], None
    for turn in range(FILES // PER_TURN):
        more: tuple[str, ...] = ("--continue",) if turn == 1 else (
            ("--resume", session) if turn == 2 and session else ())
        out = run_claude(claude_bin, proxy, home, work,
                         f"turn {turn}: read logs {turn * PER_TURN} to "
                         f"{(turn + 1) * PER_TURN - 1}", *more,
                         CLAUDE_CODE_MAX_OUTPUT_TOKENS="4096")
        outputs.append(out)
        session = next(e["session_id"] for e in out if e.get("session_id"))
    finals = [[e for e in out if e.get("type") == "result"][-1] for out in outputs]
    assert [f["subtype"] for f in finals] == ["success"] * len(finals), finals
    assert finals[-1]["result"].startswith(f"turn {len(finals) - 1} done")
    main = [b for b in upstream.requests if len(b.get("tools") or []) > 2]
    # every request fits: the windows the proxy built and its own recall round, whose
    # result is cut to the room the window leaves
    rounds = [b for b in main if any(r["tool_use_id"] == RECALL_ID for r in results_of(b))]
    print("upstream tokens", [upstream.anthropic.tokens(b) for b in main])
    assert rounds and max(upstream.anthropic.tokens(b) for b in main) <= SMALL_WINDOW
    labels = {"tenant": "dev", "model": MODEL}
    metrics = proxy.metrics.registry
    client = metrics.get_sample_value("runloop_prompt_tokens_client_total", labels)
    forwarded = metrics.get_sample_value("runloop_prompt_tokens_forwarded_total", labels)
    print(f"32k window: {len(main)} main requests, prompt tokens {client:,.0f} sent by "
          f"Claude Code -> {forwarded:,.0f} forwarded")
    assert forwarded < 0.6 * client
    # /context's count of the session as it stands, answered by the proxy, in the window
    last = main[-1]
    counted = httpx.post(f"{proxy.base}/v1/messages/count_tokens", headers={
        "x-api-key": KEY, "anthropic-version": "2023-06-01",
        "X-Claude-Code-Session-Id": session or ""}, json={
        "model": MODEL, "system": last["system"], "tools": last["tools"],
        "messages": [m for b in upstream.requests[-1:] for m in b["messages"]]})
    assert counted.status_code == 200, counted.text
    assert 0 < counted.json()["input_tokens"] <= SMALL_WINDOW
    proxy.settle()
    auth = {"Authorization": f"Bearer {ADMIN}"}
    listed = httpx.get(f"{proxy.base}/admin/sessions", headers=auth,
                       params={"tenant": "dev"}).json()["sessions"]
    named = [s for s in listed if not s["session_id"].startswith("fp-")]
    assert [s["session_id"] for s in named] == [f"n:{session}"], listed
    view = httpx.get(f"{proxy.base}/admin/sessions/{named[0]['session_id']}", headers=auth,
                     params={"tenant": "dev", "messages": "1"}).json()
    assert len(view["branches"]) == 1, view["branches"]
    transcripts = "\n".join(p.read_text() for p in (home / ".claude").rglob("*.jsonl"))
    assert transcripts and "recall_tool_call" not in transcripts \
        and "search_history" not in transcripts
