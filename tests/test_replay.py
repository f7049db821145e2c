"""`runloop-proxy replay` on a small recorded conversation file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from runloop_proxy.ops.replay_offline import cached_cost
from runloop_proxy.pricing import Block, PrefixCache
from runloop_proxy.scripted import PromptCache, ScriptedUpstream
from tests.policies import mechanism_set


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


def test_a_prompt_extended_in_place_still_shares_its_tokens() -> None:
    rules = "rules " * 100
    user = Block("u", 4, "hi", "user")

    def shared(first: list[Block], second: list[Block]) -> int:
        cache = PrefixCache(0, 1)  # to the token
        cache.bill(first)
        return cache.bill(second).cached
    # by message only nothing is shared; by text the old prompt's tokens are (its last
    # token may merge with what was appended)
    assert shared([Block("a", 103, rules, "system"), user],
                  [Block("b", 105, rules + "\n\nmarker", "system"), user]) == 102
    assert shared([Block("a", 103, rules, "system"), user],
                  [Block("c", 5, "other rules", "system"), user]) == 0
    assert shared([Block("a", 103, rules, "system"), user],
                  [Block("b", 105, rules + "x", "user"), user]) == 0  # another role


def test_cached_cost_rules() -> None:
    assert cached_cost(2000, 1000) == 2000  # under 1024 tokens nothing is cached
    assert cached_cost(2000, 1100) == 2000 - 1024 + 102.4  # 128-token blocks


# What a request reads from the cache after one that differed from it only in its tool
# schemas, or only in its system prompt, under each cost model: its provider's render order
# decides (OpenAI renders the system messages, then the tools, then the rest; Anthropic the
# tools, then the system prompt, breakpoints after it and at the end; "strict" is the
# tools-first order; "cache_aware" caches the tools and the messages apart)
RENDER_ORDERS = {  # model -> (cached after a tools change, cached after a system change)
    "cache_aware": (True, True), "strict": (False, True), "openai": (True, False),
    "anthropic": (False, False)}


def test_each_cost_model_reads_a_prompt_in_its_providers_order() -> None:
    """A request whose tool list changed, or whose system prompt changed, after an earlier
    one otherwise alike (both parts past the 1,024 tokens a cache needs): each cost model
    of the replay bills it from its cache, or wholly afresh, as its provider's render
    order says (``RENDER_ORDERS``) — a change before a part re-reads it, a change after it
    does not. Planted, each passed every other test: the strict model rendering the
    system prompt before the tools (as the cache-aware one does), and OpenAI's money
    model rendering the tools first (as Anthropic's does)."""
    from runloop_proxy.ops.replay_offline import Side
    from runloop_proxy.pricing import PriceTable

    table = PriceTable.load()
    system, tools = [Block("system", 2_000)], [Block("tools:a", 1_500)]
    rest = [Block("user", 3_000), Block("reply", 40), Block("next", 20)]
    changes = {"tools": (system, [Block("tools:b", 1_500)]),
               "system": ([Block("system-b", 2_000)], tools)}

    def costs(side: Side, request: tuple[list[Block], list[Block]]) -> dict[str, float]:
        sep, strict, money = side.bill(request[0], request[1], rest)
        return {"cache_aware": sep, "strict": strict, side.provider.name: money}  # type: ignore[union-attr]

    for provider, model in (("openai", "gpt-4o"), ("anthropic", "claude-sonnet-4")):
        prov = table.provider(provider)
        for k, (what, second) in enumerate(changes.items()):
            side = Side(prov, prov.price(model), step=1)
            side.bill(system, tools, rest[:2])
            after = costs(side, second)
            fresh = costs(Side(prov, prov.price(model), step=1), second)
            for name, cost in after.items():
                cached = RENDER_ORDERS[name][k]
                assert (cost < fresh[name]) == cached, (name, what, cost, fresh[name])


def test_replay_through_a_running_proxy(tmp_path: Path, proxy: object,
                                        upstream: ScriptedUpstream) -> None:
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps(conversation(30)) + "\n")
    # gpt-4-turbo's encoding ships offline: the proxy counts exactly, with no calibration from
    # the scripted upstream's rough usage to move its budget
    out = run(f, "--json", "--model", "gpt-4-turbo",
              "--proxy", proxy.base)  # type: ignore[attr-defined]
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    offline = json.loads(run(f, "--json", "--model", "gpt-4-turbo").stdout)
    assert data["requests"] == offline["requests"] == 31
    # the proxy counts and builds windows exactly as the offline replay does
    assert (data["client_tokens"], data["forwarded_tokens"]) == \
        (offline["client_tokens"], offline["forwarded_tokens"])
    assert data["forwarded_tokens"] < data["client_tokens"]
    # one proxy session per conversation
    assert len({h["x-session-id"] for h in upstream.headers}) == 1
    # a cache-aware cost through a proxy needs the upstream's word on both sides
    assert data["cache_aware_saving"] is None and "bound_raw_saving" not in data
    human = run(f, "--proxy", proxy.base)  # type: ignore[attr-defined]
    assert human.returncode == 0, human.stderr  # the text report too, to its end
    assert "not measured" in human.stdout and "compaction events" not in human.stderr
    # what a proxy does not show is not measured, so not given a value: no cost model (no
    # --direct) and no compaction events
    assert "events:" not in human.stdout and "worst conversations" not in human.stdout
    assert "cache-aware n/a, strict n/a (of 1)" in human.stdout, human.stdout
    assert data["compaction_events"] is None and data["worst"] is None
    assert data["costing_more"] == {"cache_aware": None, "strict": None}


def test_replay_through_a_proxy_gives_the_headline_the_inspector_gives(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Bug class: ``replay --proxy`` pricing its headline by another rule than the one every
    other place uses. Through a proxy the headline is the session's stored points priced
    by ``savings.of_points`` (the inspector's, the dashboard's), and equal to the offline
    replay's of the same conversation, which prices the same facts. Planted: each request
    priced from its two token counts alone (the old rule: a compaction's shrunk prompt
    cached nothing; red, 65.93% against the points' 65.92%: few of this conversation's
    prompts shrink)."""
    from runloop_proxy import savings
    from runloop_proxy.pricing import PriceTable

    admin = "admin-" + "5e2b" * 8
    proxy = make_proxy(admin_key=admin)
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps(conversation(30)) + "\n")
    model = ("--model", "gpt-4o-2024-08-06", "--provider", "openai")
    key = "sk-proj-" + "Tq8mV3zK1xNw6RbY4pLc" * 7 + "hJ2u"  # 164 characters, as OpenAI's
    out = run(f, "--json", *model, "--proxy", proxy.base, "--api-key", key,
              "--admin-key", admin)
    assert out.returncode == 0, out.stderr
    through = json.loads(out.stdout)["headline"]
    offline = json.loads(run(f, "--json", *model).stdout)["headline"]
    auth = {"Authorization": f"Bearer {admin}"}
    (tenant,) = [t["tenant"] for t in httpx.get(f"{proxy.base}/admin/tenants",
                                               headers=auth).json()["tenants"]
                 if t.get("sessions")]
    (row,) = httpx.get(f"{proxy.base}/admin/sessions", params={"tenant": tenant},
                       headers=auth).json()["sessions"]
    points = httpx.get(f"{proxy.base}/admin/sessions/{row['session_id']}",
                       params={"points": "1", "tenant": tenant}, headers=auth).json()["points"]
    stored = savings.of_points(points, PriceTable.load(), "openai").as_dict()
    print(through, offline)
    assert through["requests"] == len(points) == 31
    assert through == stored == offline
    assert 0 < through["bill_saved"] < through["raw_saved"]
    # without the admin key the proxy's points cannot be read: no headline, and why
    bare = run(f, "--json", *model, "--proxy", proxy.base, "--api-key", key)
    assert json.loads(bare.stdout)["headline"]["bill_saved"] is None
    assert "--admin-key" in bare.stderr


def test_replay_says_when_the_proxy_cannot_be_reached(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps(conversation(2)) + "\n")
    out = run(f, "--proxy", "http://127.0.0.1:1")
    assert out.returncode == 1
    assert out.stderr.startswith("cannot reach the proxy at http://127.0.0.1:1: ")
    assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr


def test_replay_against_the_upstream_direct_measures_its_cached_tokens(
        tmp_path: Path, proxy: object, upstream: ScriptedUpstream) -> None:
    upstream.prompt_cache = PromptCache()
    try:
        f = tmp_path / "c.jsonl"
        f.write_text(json.dumps(conversation(30)) + "\n")
        out = run(f, "--json", "--proxy", proxy.base,  # type: ignore[attr-defined]
                  "--direct", upstream.url)
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        # both sides were served from the upstream's prefix cache, the proxy's windows less
        # in all (the offline model predicts the same direction)
        assert 0 < data["client_cost"] < data["client_tokens"]
        assert 0 < data["forwarded_cost"] < data["forwarded_tokens"]
        assert data["cache_aware_saving"] > 0
        # the cache-aware model is measured, the strict one and the events are not
        assert data["costing_more"]["cache_aware"] == 0 and data["costing_more"]["strict"] is None
        assert [set(w) for w in data["worst"]] == \
            [{"id", "domain", "requests", "cache_aware_saving", "money"}]
        offline = json.loads(run(f, "--json").stdout)
        assert offline["cache_aware_saving"] > 0
        # the upstream bills as the proxy counts: calibrating against it changes nothing, and
        # the proxy's windows are the offline ones
        factors = proxy.state.tokens._factors  # type: ignore[attr-defined]
        assert all(abs(factors.get(k) - 1) < 0.01 for k in factors)  # whoever the caller
        assert data["forwarded_tokens"] == offline["forwarded_tokens"]
        # each request went both ways, the two sides in their own cache scopes
        scopes = {h["x-scripted-cache-scope"] for h in upstream.headers}
        assert len(upstream.requests) == 2 * 31 and len(scopes) == 2
        human = run(f, "--proxy", proxy.base, "--direct", upstream.url)  # type: ignore[attr-defined]
        assert "cache-aware 0, strict n/a" in human.stdout and "events:" not in human.stdout
        assert re.search(r"worst conversations \(cache-aware\):\n +\d", human.stdout), \
            human.stdout
    finally:
        upstream.prompt_cache = None
    assert run(f, "--direct", upstream.url).returncode == 2  # --direct needs --proxy


def test_prompt_cache_serves_shared_prefixes_in_blocks() -> None:
    cache = PromptCache()

    def body(*texts: str) -> dict[str, object]:
        return {"messages": [{"role": "user", "content": t} for t in texts]}

    long = " ".join(f"w{i}" for i in range(1500))
    assert cache.usage(body("short"))[1] == 0
    total, cached = cache.usage(body(long))
    assert cached == 0 and total > 1024  # nothing cached yet
    again, cached = cache.usage(body(long, "next"))
    assert cached == (total // 128) * 128 and again > total  # whole blocks of the prefix
    assert cache.usage(body(long, "next"), org="other")[1] == 0  # another organization
    assert cache.usage(body("changed " + long))[1] == 0  # a different start: no hit
    assert cache.usage(body("x " * 600))[1] == 0  # under 1,024 tokens: never cached


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
    # a tenant or a policy field it does not have is named, with what there is
    for args, said in [(["--tenant", "nosuch"], f"no tenant 'nosuch' in {tmp_path} (t)"),
                       (["--tenant", "t", "--set", "nosuchfield=1"],
                        "--set nosuchfield: no such policy field"),
                       (["--set", "threshold=abc"],
                        "--set threshold: Input should be a valid number"),
                       (["--set", "threshold"], "--set threshold: expected FIELD=VALUE"),
                       # what is not JSON is text, and the field says whether it takes it
                       # (a newcomer's "ten" and "[read" were tracebacks)
                       (["--set", "max_run_loops=ten"],
                        "--set max_run_loops: Input should be a valid integer"),
                       (["--set", "exclude_tools=[read"],
                        "--set exclude_tools: Input should be a valid tuple"),
                       (["--set", "threshold=1e"],
                        "--set threshold: Input should be a valid number")]:
        out = run(f, "--config", str(tmp_path), *args)
        assert out.returncode == 2 and out.stderr.startswith(said), (args, out.stderr)
        assert len(out.stderr.splitlines()) == 1


def test_replay_through_a_proxy_counts_refused_requests(tmp_path: Path, make_proxy: Any) -> None:
    proxy = make_proxy(context_window=4096)
    huge = {"messages": [{"role": "system", "content": "agent"},
                         {"role": "user", "content": "word " * 6000},
                         {"role": "assistant", "content": "too long to answer"}]}
    f = tmp_path / "huge.jsonl"
    f.write_text(json.dumps(huge) + "\n" + json.dumps(conversation(2)) + "\n")
    # a model listed nowhere: the proxy's default context window (4,096) applies
    out = run(f, "--json", "--model", "house-model", "--proxy", proxy.base)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["rejected"] == 1 and data["over_context_proxy"] == 1
    assert data["client_tokens"] > 6000  # the refused request is counted as sent


def support_like(loops: int) -> dict[str, object]:
    """Questions answered from lookups, each reply quoting what a lookup returned."""
    msgs: list[dict[str, object]] = [{"role": "system", "content": "You help customers."}]
    for k in range(loops):
        msgs.append({"role": "user", "content": f"status of order #W{k}0{k}7?"})
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{k}", "type": "function", "function": {
                "name": "get_order", "arguments": json.dumps({"order_id": f"#W{k}0{k}7"})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{k}", "content": json.dumps(
            {"order": f"#W{k}0{k}7", "tracking": f"1Z{k:03d}X{k * 31:04d}",
             "items": ["x " * 40] * 8})})
        # each answer quotes the tracking number of the order two loops back, which only
        # that loop's lookup result ever showed
        back = max(0, k - 2)
        msgs.append({"role": "assistant", "content": f"#W{k}0{k}7 has shipped; the earlier "
                                                     f"parcel is 1Z{back:03d}X{back * 31:04d}"})
    return {"messages": msgs, "tools": [{"type": "function", "function": {
        "name": "get_order", "parameters": {"type": "object"}}}]}


def test_retention_is_printed_and_pass_through_reads_100(tmp_path: Path) -> None:
    """The retention ledger of reduced past loops, without a summary (``MECHANISM``): what
    a reduction hides, what a digest brings back into view, what a priced summary costs.
    The defaults' digest puts a reduced loop's identifiers on an ``ids:`` line in it, so
    under them nothing of this conversation is hidden to count (asserted last)."""
    f = tmp_path / "s.jsonl"
    f.write_text(json.dumps(support_like(14)) + "\n")
    plain = json.loads(run(f, "--json", *mechanism_set(max_run_loops=3)).stdout)
    r, rp = plain["retention"], plain["retention_passthrough"]
    assert rp["retained"] == 1.0 and rp["references"] == r["references"] > 20
    assert r["current_loop"] == 1.0 and r["past_loops"] < 1.0  # reductions hide past ones
    # nothing hidden is lost: each tracking number is in a result the ledger names by ref
    hidden = r["references"] - round(r["retained"] * r["references"])
    assert hidden > 0 and r["hidden"] == hidden
    assert r["recallable_by_ref"] + r["found_by_search"] == hidden and r["lost"] == 0
    digest = json.loads(run(f, "--json", *mechanism_set(
        max_run_loops=3, summary_model="extractive")).stdout)
    assert digest["retention"]["past_loops"] > r["past_loops"]
    assert digest["summaries"] > 0 and digest["summary_tokens"] == 0  # extractive: free
    priced = json.loads(run(f, "--json", *mechanism_set(
        max_run_loops=3, summary_model="gpt-4o-mini"), "--summary-cost", "500").stdout)
    assert priced["summary_tokens"] == 500 * priced["summaries"]
    assert priced["forwarded_tokens"] == digest["forwarded_tokens"] + priced["summary_tokens"]
    # the summary calls are paid in every cost model, at full price (a mutation sample's
    # survivor: they were added to the tokens and to no cost)
    for cost in ("forwarded_cost", "forwarded_cost_strict"):
        assert priced[cost] == digest[cost] + priced["summary_tokens"], cost
    human = run(f, *mechanism_set(max_run_loops=3))
    assert "references kept window" in human.stdout and "pass-through 100.0%" in human.stdout
    assert ", lost 0" in human.stdout
    # and the careful reader's figures, as --json gives them (a mutation sample's survivor:
    # the line deleted passed every test)
    rc = plain["retention_careful"]
    assert rc["references"] >= r["references"]
    careful = next(line for line in human.stdout.splitlines() if "careful reader" in line)
    assert f"{rc['references']:,} references" in careful, careful
    assert f"lost {rc['lost']:,}" in careful and f"{rc['retained']:.1%}" in careful, careful
    # the defaults: every tracking number a reduced loop's result held is on its ids: line
    tuned = json.loads(run(f, "--json", "--set", "max_run_loops=3").stdout)["retention"]
    assert (tuned["references"], tuned["past_loops"], tuned["hidden"]) == \
        (r["references"], 1.0, 0)


def test_replay_reads_responses_conversations(tmp_path: Path) -> None:
    from runloop_proxy.conversation.items import to_items

    chat = support_like(8)
    instructions, items = to_items(chat["messages"])  # type: ignore[arg-type]
    items.insert(2, {"type": "reasoning", "id": "rs_0", "summary": [],
                     "encrypted_content": "opaque"})
    line = {"instructions": instructions, "input": items, "tools": [
        {"type": "function", "name": "get_order", "parameters": {"type": "object"}}]}
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps(line) + "\n")
    out = json.loads(run(f, "--json", "--set", "max_run_loops=2").stdout)
    c = tmp_path / "c.jsonl"
    c.write_text(json.dumps({**chat, "tools": [{"type": "function", "function": {
        "name": "get_order", "parameters": {"type": "object"}}}]}) + "\n")
    same = json.loads(run(c, "--json", "--set", "max_run_loops=2").stdout)
    assert out["requests"] == same["requests"] == 16
    assert out["client_tokens"] == same["client_tokens"]  # one conversation model
    # kept while its loop is open, left out once the loop is past
    assert out["reasoning_items"]["client"] > out["reasoning_items"]["forwarded"] > 0


def test_the_halves_split_conversations_by_a_fixed_hash_of_their_ids(tmp_path: Path) -> None:
    from runloop_proxy.ops.replay import half_of

    convs = [{**conversation(2), "id": f"conv-{k}"} for k in range(40)]
    halves = [half_of(c) for c in convs]
    assert set(halves) == {"tune", "holdout"}
    # the same id falls in the same half, whatever its content and wherever it stands
    assert half_of({**conversation(5), "id": "conv-7"}) == halves[7]
    # without an id, the opening messages decide, the same way every time
    assert half_of(conversation(3)) == half_of(conversation(3))
    # the split never moves: these halves are the ones the defaults were tuned and checked on
    assert [half_of({"id": f"conv-{k}"}) for k in range(6)] == \
        ["tune", "tune", "tune", "holdout", "tune", "tune"]
    assert half_of({"id": "tau1-gpt4o-airline-t0-trial0-0"}) == "tune"
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps(c) for c in convs) + "\n")
    tune = json.loads(run(f, "--json", "--half", "tune").stdout)
    holdout = json.loads(run(f, "--json", "--half", "holdout").stdout)
    assert (tune["conversations"], holdout["conversations"]) == \
        (halves.count("tune"), halves.count("holdout"))
    assert tune["half"] == "tune" and tune["requests"] + holdout["requests"] == 40 * 3
    assert "(holdout half)" in run(f, "--half", "holdout").stdout


def test_replay_names_the_conversations_that_cost_more_and_prices_them(tmp_path: Path
                                                                       ) -> None:
    short = {"id": "short-one", "meta": {"domain": "a"}, **conversation(1)}
    long = {"id": "long-one", "meta": {"domain": "b"}, **conversation(40)}
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps(short) + "\n" + json.dumps(long) + "\n")
    data = json.loads(run(f, "--json", "--context", "16384").stdout)
    # the short one costs the proxy's tools and saves nothing; the long one saves
    assert data["costing_more"]["strict"] == 1 and data["costing_more"]["cache_aware"] == 1
    worst = data["worst"]
    assert [w["id"] for w in worst] == ["short-one", "long-one"]
    assert worst[0]["strict_saving"] < 0 < worst[1]["strict_saving"]
    assert set(data["by_domain"]) == {"a", "b"} and data["by_domain"]["b"]["strict"] > 0
    money = data["money"]
    assert money["provider"] == "openai" and money["prices_per_million"]["input"] == 2.5
    assert 0 < money["forwarded"] < money["client"] and money["output"] > 0
    human = run(f, "--context", "16384", "--worst", "1").stdout
    assert "costing more than pass-through: cache-aware 1, strict 1" in human
    assert "short-one" in human and "long-one" not in human and "by domain" in human
    assert "money, block by block (openai" in human
    anthropic = json.loads(run(f, "--json", "--provider", "anthropic").stdout)
    assert anthropic["model"] == "claude-sonnet-4"
    assert anthropic["money"]["provider"] == "anthropic"
    assert anthropic["money"]["prices_per_million"]["cache_write"] == 3.75
    assert run(f, "--provider", "anthropic", "--model", "gpt-4o").returncode == 2
    prices = tmp_path / "prices.toml"
    prices.write_text('[openai.models."house-model"]\ninput = 1.0\ncached_input = 0.1\n')
    house = json.loads(run(f, "--json", "--model", "house-model", "--prices",
                           str(prices)).stdout)
    assert house["money"]["prices_per_million"]["input"] == 1.0
    assert json.loads(run(f, "--json", "--model", "house-model").stdout)["money"] is None


def messages_recording(tmp_path: Path, steps: int) -> tuple[Path, Any, list[Any]]:
    """``conversation(steps)`` recorded in Anthropic's Messages format (a ``bash`` tool with
    an input_schema), as a file of one line; and its ``system`` and turns."""
    from runloop_proxy.conversation.blocks import chat_to_tool, to_anthropic

    system, turns = to_anthropic(conversation(steps)["messages"])  # type: ignore[arg-type]
    line = {"system": system, "messages": turns, "tools": [
        chat_to_tool({"name": "bash", "parameters": {"type": "object"}})]}
    f = tmp_path / "m.jsonl"
    f.write_text(json.dumps(line) + "\n")
    return f, system, turns


def test_replay_reads_messages_conversations(tmp_path: Path) -> None:
    """A Messages-format recording (system, tool_use and tool_result blocks, tools with an
    input_schema) replays as the same conversation in chat form does, and prices in
    Anthropic's cache model with --provider anthropic (marks at the end of the system prompt
    and of each request, as Claude Code places them)."""
    from runloop_proxy.conversation.blocks import to_messages

    f, system, turns = messages_recording(tmp_path, 40)
    args = ("--json", "--model", "claude-sonnet-4-6", "--provider", "anthropic")
    out = json.loads(run(f, *args).stdout)
    c = tmp_path / "c.jsonl"  # the same conversation in chat form (its calls' input as JSON)
    plain = [{k: v for k, v in m.items() if k != "blocks"} for m in to_messages(turns, system)]
    c.write_text(json.dumps({"messages": plain, "tools": [{"type": "function", "function": {
        "name": "bash", "parameters": {"type": "object"}}}]}) + "\n")
    same = json.loads(run(c, *args).stdout)
    assert out["requests"] == same["requests"] == 41
    assert out["client_tokens"] == same["client_tokens"]
    # the same windows (refs, hashes of the messages with their blocks, tokenize apart)
    assert abs(out["forwarded_tokens"] - same["forwarded_tokens"]) < 0.001 * out["client_tokens"]
    assert out["compaction_events"] == same["compaction_events"]
    money = out["money"]
    assert money["provider"] == "anthropic" and 0 < money["forwarded"] < money["client"]


def test_a_messages_api_line_keeps_its_id_and_meta() -> None:
    """A conversation recorded in Anthropic's format becomes the conversation model, and keeps
    what names it — its id (the halves split by it) and its meta (the domain rows)."""
    from runloop_proxy.ops.replay import conversation_of, half_of
    line = {"id": "conv-7", "meta": {"domain": "retail"}, "system": "S", "tools": [
        {"name": "look", "input_schema": {"type": "object"}}], "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    conv = conversation_of(line)
    assert conv is not None
    assert conv["id"] == "conv-7" and conv["meta"] == {"domain": "retail"}
    assert conv["messages"][0] == {"role": "system", "content": "S"}
    assert [t["function"]["name"] for t in conv["tools"]] == ["look"]
    assert half_of(conv) == half_of({"id": "conv-7", "messages": []})


def test_replay_of_a_messages_recording_through_a_proxy_sends_messages_requests(
        tmp_path: Path, proxy: object, upstream: ScriptedUpstream) -> None:
    """A Messages-format recording replayed through a proxy goes as the Messages API, a
    request per point of the conversation, each carrying that point's turns."""
    f, _, _ = messages_recording(tmp_path, 6)
    out = run(f, "--json", "--model", "claude-sonnet-4-6",
              "--proxy", proxy.base)  # type: ignore[attr-defined]
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["requests"] == 7 and data["rejected"] == 0
    # the proxy bridged each to the chat upstream: the last carried every step's result
    assert len(upstream.requests) == 7
    last = json.dumps(upstream.requests[-1])
    assert "word5x0" in last and upstream.requests[-1]["model"] == "claude-sonnet-4-6"
    metrics = proxy.state.metrics.render()[0].decode()  # type: ignore[attr-defined]
    served = re.findall(r'runloop_requests_total\{[^}]*api="(\w+)"[^}]*\} (\S+)', metrics)
    assert {api for api, n in served if float(n) > 0} == {"messages"}, served


def support_conversation(turns: int) -> dict[str, object]:
    """A short-turn support agent: a large system prompt, each turn a lookup with a large
    result and a short answer."""
    msgs: list[dict[str, object]] = [
        {"role": "system", "content": "You are the support agent. " + "Follow policy. " * 600}]
    for k in range(turns):
        msgs += [{"role": "user", "content": f"Change booking BK{k}X{k}9 to EA{100 + k}."},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{k}", "type": "function",
                      "function": {"name": "lookup", "arguments": f'{{"id": "BK{k}X{k}9"}}'}}]},
                 {"role": "tool", "tool_call_id": f"c{k}", "content": json.dumps(
                     {"booking": f"BK{k}X{k}9", "rows": [{"seat": f"{r}A", "fare": 100 + r}
                                                         for r in range(60)]})},
                 {"role": "assistant", "content": f"Done: BK{k}X{k}9 is on EA{100 + k}."}]
    return {"messages": msgs, "tools": [{"type": "function", "function": {
        "name": "lookup", "parameters": {"type": "object"}}}]}


def test_anthropics_bill_reads_the_proxy_breakpoints_on_the_summary(tmp_path: Path) -> None:
    """Priced as Anthropic bills, a window whose every turn omits the one before pays for
    what it rewrites after the last breakpoint it repeats: with cache_breakpoints = "auto"
    the proxy sends the summary a block per piece it grew by with a breakpoint after the
    last, and the replay bills the proxy's side with those marks (the client's side, and the
    token cost models, are the same either way). The summary is the digest with a
    question → answer line a loop (``MECHANISM``'s summary_lines); the defaults' digest of
    identifiers alone grows by a few tokens a loop, so its marks save less (asserted last:
    7.8% of the proxy's bill here, against 15% with the lines)."""
    f = tmp_path / "s.jsonl"
    f.write_text(json.dumps(support_conversation(12)) + "\n")
    shape = {"summary_model": "extractive", "max_run_loops": 0, "omit_batch": 1}
    base = ("--json", "--provider", "anthropic", *mechanism_set(**shape))
    plain = json.loads(run(f, *base).stdout)
    auto = json.loads(run(f, *base, "--set", "cache_breakpoints=auto").stdout)
    assert plain["compaction_events"] == auto["compaction_events"]
    assert plain["compaction_events"]["loop_omission"] >= 9
    assert plain["money"]["client"] == auto["money"]["client"]
    assert plain["cache_aware_saving_strict"] == auto["cache_aware_saving_strict"]
    # the pieces read back at 0.1x instead of written again at 1.25x every turn
    assert auto["money"]["forwarded"] < 0.92 * plain["money"]["forwarded"]
    # under the defaults (their digest: identifiers alone), still read back, for less
    tuned = [json.loads(run(f, "--json", "--provider", "anthropic", "--set", "omit_batch=1",
                            *extra).stdout) for extra in ((), ("--set", "cache_breakpoints=auto"))]
    assert tuned[0]["compaction_events"] == plain["compaction_events"]
    assert tuned[1]["money"]["forwarded"] < tuned[0]["money"]["forwarded"]


def test_auto_marks_split_the_note_and_mark_its_last_piece_and_the_stable_prefix() -> None:
    """The replay puts the proxy's breakpoints where the live body has them: the note a
    block per piece, a mark after its last piece, one at the end of the turn holding the
    last message the window rewrote — which the Messages API merges with the kept final
    reply after it, so the mark follows the reply — and one at the end. Planted: the
    stable mark after the rewritten message itself (the replay's old rule: red)."""
    from runloop_proxy.conversation.messages import message_hash
    from runloop_proxy.ops.replay_offline import auto_placed
    from runloop_proxy.savings import placed_blocks
    from runloop_proxy.window.builder import Window

    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are the support agent of Example Air."},
        {"role": "user", "content": "Change booking BK0X09 to EA100."},
        {"role": "assistant", "content": "[runloop-proxy] note\nBK0X09: EA100\nBK1X19: EA101"},
        {"role": "assistant", "content": "Done: BK1X19 is on EA101."},
        {"role": "user", "content": "And BK2X29 to EA102?"}]
    window = Window(messages, True, True, 0, 0,
                    note=(2, ("[runloop-proxy] note", "BK0X09: EA100", "BK1X19: EA101")))
    sent = {message_hash(m) for i, m in enumerate(messages) if i != 2}
    placed = auto_placed(window, sent)
    assert placed.note == window.note
    # after the note (3 messages in), after the reply its turn ends with, and at the end
    assert placed.after == (3, 4, 5)
    blocks = [Block(message_hash(m), 10 + i, str(m["content"]), str(m["role"]))
              for i, m in enumerate(messages)]
    parts, after = placed_blocks(blocks, placed, lambda text: 2)
    assert [p.text for p in parts[2:5]] == list(window.note[1]) and len(parts) == 7
    assert sum(p.tokens for p in parts) == sum(b.tokens for b in blocks)  # nothing lost
    assert after == (5, 6, 7)
    # without a note (nothing omitted), a mark after the last rewritten message's turn
    plain = auto_placed(Window(messages, True, True, 0, 0), sent)
    assert plain == (None, (4, 5))


def test_auto_breakpoints_change_nothing_at_openais_prices(tmp_path: Path) -> None:
    """cache_breakpoints = "auto" marks the Messages API's bodies alone: priced as OpenAI
    bills, the replay's headline and money are the same with it and without it. Planted:
    the summary in pieces and the marks put into every provider's forwarded prompt (red:
    the headline moved, its forwarded bill $0.09693 against $0.10125)."""
    f = tmp_path / "s.jsonl"
    f.write_text(json.dumps(support_conversation(12)) + "\n")
    base = ("--json", "--provider", "openai", *mechanism_set(
        summary_model="extractive", max_run_loops=0, omit_batch=1))
    plain = json.loads(run(f, *base).stdout)
    auto = json.loads(run(f, *base, "--set", "cache_breakpoints=auto").stdout)
    assert plain["compaction_events"]["loop_omission"] >= 9
    assert auto["headline"] == plain["headline"] and auto["money"] == plain["money"]
