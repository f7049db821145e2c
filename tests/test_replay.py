"""`runloop-proxy replay` on a small recorded conversation file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from runloop_proxy.replay import cached_cost


def conversation(steps: int) -> dict[str, object]:
    msgs: list[dict[str, object]] = [{"role": "system", "content": "agent"},
                                     {"role": "user", "content": "task"}]
    for k in range(steps):
        msgs.append({"role": "assistant", "content": f"step {k}", "tool_calls": [
            {"id": f"c{k}", "type": "function",
             "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{k}",
                     "content": " ".join(f"word{k}x{i}" for i in range(600))})
    msgs.append({"role": "assistant", "content": "done"})
    return {"messages": msgs, "tools": [{"type": "function", "function": {"name": "bash"}}]}


def run(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runloop_proxy.cli", "replay", str(path),
                           *args], capture_output=True, text=True)


def test_replay_reports_savings_and_context(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps(conversation(n)) for n in (3, 40)) + "\n")
    out = run(f, "--json", "--context", "16384")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["conversations"] == 2 and data["requests"] == 45
    assert data["raw_saving"] > 0.3 and data["cache_aware_saving"] > 0
    assert data["over_context_passthrough"] > 0 and data["over_context_proxy"] == 0
    human = run(f, "--set", "soft_budget_tokens=4000")
    assert human.returncode == 0 and "saving" in human.stdout


def test_replay_rejects_bad_input(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"messages": []}\nnot json\n')
    out = run(f)
    assert out.returncode == 2 and "bad.jsonl:2" in out.stderr
    assert run(tmp_path / "missing.jsonl").returncode == 2
    good = tmp_path / "g.jsonl"
    good.write_text(json.dumps(conversation(2)))
    assert run(good, "--set", "threshold=7").returncode == 2


def test_cached_cost_rules() -> None:
    assert cached_cost(2000, 1000) == 2000  # under 1024 tokens nothing is cached
    assert cached_cost(2000, 1100) == 2000 - 1024 + 102.4  # 128-token blocks


def test_replay_through_a_running_proxy(tmp_path: Path, proxy: object) -> None:
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps(conversation(30)) + "\n")
    out = run(f, "--json", "--proxy", proxy.url.removesuffix("/v1"))  # type: ignore[attr-defined]
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["requests"] == 31 and data["forwarded_tokens"] < data["client_tokens"]


def test_replay_prints_the_bound_for_multi_turn_conversations(tmp_path: Path) -> None:
    msgs: list[dict[str, object]] = [{"role": "system", "content": "rules " * 300}]
    for k in range(6):
        msgs += [{"role": "user", "content": f"question {k}"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{k}", "type": "function",
                      "function": {"name": "look", "arguments": '{"q": "x"}'}}]},
                 {"role": "tool", "tool_call_id": f"c{k}", "content": "fact " * 200},
                 {"role": "assistant", "content": f"answer {k}"}]
    f = tmp_path / "turns.jsonl"
    f.write_text(json.dumps({"messages": msgs}) + "\n")
    data = json.loads(run(f, "--json").stdout)
    # the bound keeps nothing but the system prompt and the current loop: no window beats it
    assert data["raw_saving"] < data["bound_raw_saving"] < 1
    assert data["cache_aware_saving"] < data["bound_cache_aware_saving"]
    assert "bound (system prompt" in run(f).stdout
    single = tmp_path / "single.jsonl"
    single.write_text(json.dumps(conversation(3)) + "\n")
    assert "bound" not in run(single).stdout  # one run loop: nothing to bound


def test_replay_reads_a_tenant_policy_without_its_secrets(tmp_path: Path) -> None:
    (tmp_path / "tenants").mkdir()
    (tmp_path / "runloop.toml").write_text(
        '[upstreams.main]\nurl = "http://upstream.invalid"\napi_key = "${RUNLOOP_TEST_UNSET_A}"\n'
        '[defaults]\nupstream = "main"\n')
    (tmp_path / "tenants" / "t.toml").write_text(
        'keys = ["${RUNLOOP_TEST_UNSET_B}"]\n[policy]\nsoft_budget_tokens = 4000\n')
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps(conversation(40)) + "\n")
    tight = run(f, "--json", "--config", str(tmp_path), "--tenant", "t")
    assert tight.returncode == 0, tight.stderr
    loose = json.loads(run(f, "--json").stdout)
    assert json.loads(tight.stdout)["forwarded_tokens"] < loose["forwarded_tokens"]
