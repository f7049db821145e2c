"""One headline figure, the same everywhere, and right: a session with compactions through a
real proxy (scripted upstream, real Redis), its *bill saved* as the stored points make it
(the inspector's page), as the dashboard's counters add it up, as ``wrap`` prints it and as
the offline replay makes it of the same conversation — equal, and equal to the replay's finer
money model (every block priced by the provider's own cache) within rounding."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from runloop_proxy import savings
from runloop_proxy.api.breakpoints import marks
from runloop_proxy.conversation.blocks import chat_to_tool, to_anthropic
from runloop_proxy.ops.demo import TOOLS, sample_conversation
from runloop_proxy.ops.replay_offline import Replayer
from runloop_proxy.ops.replay_tally import Tally
from runloop_proxy.ops.wrap import AGENTS, Proxy, report
from runloop_proxy.pricing import PriceTable
from runloop_proxy.scripted import ScriptedUpstream

from .test_metrics import BILL, _samples

ADMIN = "admin-" + "7c1d" * 8
KEY = "sk-proj-" + "hD4kq9Zr2mXv7TnB1sLw" * 7 + "aQ3e"  # 164 characters, as OpenAI's
MODEL = "gpt-4o-2024-08-06"
# a support agent's system prompt, over the provider's cache minimum on its own (about 2,400
# tokens): what a compaction keeps, and the old reading priced as read afresh
POLICY = "You are the support agent of an online shop. " + " ".join(
    f"Rule {k}: an order placed in region R{k % 13} ships within {k % 5 + 1} days; refunds "
    f"over ${k * 7 % 300 + 20} need a supervisor's note, quoted by its id SUP-{k * 31:05d}."
    for k in range(1, 61))


def replayed(state: Any, conversation: list[dict[str, Any]], provider: str, model: str
             ) -> Tally:
    """The offline replay of ``conversation`` with the proxy's own policy."""
    tenant = state.config.passthrough
    replayer = Replayer(tenant, model, None, provider=PriceTable.load().provider(provider))
    tally = Tally()
    replayer.conversation({"messages": conversation, "tools": TOOLS}, tally)
    return tally


def test_a_session_with_compactions_shows_one_figure_everywhere(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Bug class: the headline priced from other facts in one place than in another, or
    priced wrong for a compaction. Planted: a prompt that shrank billed as uncached from
    token 0 whatever it shares (the old rule: 48.6% against the finer model's 53.6%, red),
    the forwarded side's shared prefix taken from the client's (red), and ``wrap`` pricing
    the points without what they share (red)."""
    proxy = make_proxy(admin_key=ADMIN, summary_model="extractive")
    conversation = sample_conversation(5)
    conversation[0] = {"role": "system", "content": POLICY}  # a support agent's: long, fixed
    answers = iter([m for m in conversation if m.get("role") == "assistant"])

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        m = next(answers, {"content": "done"})
        return {"content": m.get("content"), "tool_calls": [
            {"id": c["id"], "name": c["function"]["name"],
             "arguments": c["function"]["arguments"]} for c in m.get("tool_calls") or []]}
    upstream.responder = respond
    sid = "support-headline-2026-12-02"
    since = int(time.time() * 1000)
    with httpx.Client(base_url=proxy.base, timeout=60, headers={
            "Authorization": f"Bearer {KEY}", "X-Session-Id": sid}) as c:
        for i, m in enumerate(conversation):
            if m.get("role") == "assistant":
                r = c.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": conversation[:i], "tools": TOOLS})
                assert r.status_code == 200, r.text
    proxy.settle()
    lines = report(Proxy(proxy.base, 0, upstream.url, ADMIN, False), since, AGENTS["codex"])
    link = re.search(r"inspector: (\S+)", "\n".join(lines))
    assert link, lines
    admin = httpx.Client(base_url=proxy.base, timeout=30,
                         headers={"Authorization": f"Bearer {ADMIN}"})
    tenant = link.group(1).split("tenant=")[1].split("&")[0]
    points = admin.get(f"/admin/sessions/{sid}", params={"points": "1", "tenant": tenant}
                       ).json()["points"]
    assert len(points) == 15
    # compactions that kept a prefix: the forwarded prompt shrank, sharing its head and more
    shrank = [p for q, p in zip(points, points[1:], strict=False)
              if p["forwarded"] < q["forwarded"]]
    assert len(shrank) >= 3 and all(p["head"][1] < p["shared"][1] < p["forwarded"]
                                    for p in shrank), points
    stored = savings.of_points(points, PriceTable.load())
    figure = stored.headline()
    # the dashboard's counters: the same bills
    text = httpx.get(proxy.base + "/metrics").text
    assert (_samples(text, BILL, side="client"), _samples(text, BILL, side="forwarded")) == \
        (pytest.approx(stored.client_usd, rel=1e-9),
         pytest.approx(stored.forwarded_usd, rel=1e-9))
    # wrap: the same name and value, the raw tokens beside it, labelled
    assert lines[0].endswith(f": {figure}") and lines[1] == f"  {stored.secondary()}", lines
    # the inspector's page of the session
    ui = httpx.Client(base_url=proxy.base, follow_redirects=False)
    assert ui.post("/admin/ui/login", data={"key": ADMIN}).status_code == 303
    page = ui.get(link.group(1).removeprefix(proxy.base)).text
    assert f"<b>{figure}</b>" in page, page[:3000]
    # the offline replay of the same conversation: the same figure; and the finer model's
    for provider, model in (("openai", MODEL), ("anthropic", "claude-sonnet-4-20250514")):
        tally = replayed(proxy.state, conversation, provider, model)
        finer = 1 - tally.money[1] / tally.money[0]
        print(provider, tally.savings.headline(), f"finer {finer:.1%}")
        assert tally.savings.bill_saved == pytest.approx(finer, abs=0.005), provider
        if provider == "openai":
            assert tally.savings.headline() == figure


ANTHROPIC_MODEL = "claude-sonnet-4-6"
TENANT_KEY = "acme-proxy-key-" + "Qm7rT2vX9kLp4sWz" * 6  # 111 characters, as Anthropic's


def support_session(turns: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A support agent as globex's (its long fixed policy, each turn a lookup with a large
    result and a short answer), in chat form, and its tools."""
    conversation: list[dict[str, Any]] = [{"role": "system", "content": POLICY}]
    for k in range(turns):
        booking = f"BK{k:02d}X{k * 7 % 10}9"
        conversation += [
            {"role": "user", "content": f"Please move booking {booking} to flight EA{100 + k} "
                                        f"on 2026-12-{3 + k:02d}."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"toolu_01{k:02d}Hx7Rz", "type": "function", "function": {
                    "name": "lookup_booking", "arguments": f'{{"booking": "{booking}"}}'}}]},
            {"role": "tool", "tool_call_id": f"toolu_01{k:02d}Hx7Rz", "content": orjson.dumps(
                {"booking": booking, "seats": [{"seat": f"{r}A", "fare": 100 + r * 3}
                                               for r in range(50)]}).decode()},
            {"role": "assistant", "content": f"Done: {booking} is now on EA{100 + k}."}]
    tools = [{"type": "function", "function": {
        "name": "lookup_booking", "description": "Look a booking up by its id.",
        "parameters": {"type": "object", "properties": {"booking": {"type": "string"}},
                       "required": ["booking"]}}}]
    return conversation, tools


def test_the_headline_prices_the_breakpoints_the_proxy_adds(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Bug class: the headline pricing a prompt at other breakpoints than the ones the
    proxy sends. A support session through the Messages API to an Anthropic upstream with
    ``cache_breakpoints = "auto"`` (globex's): the stored points' bill saved (the inspector's,
    the dashboard's) equals the finer model's — the replay's, every block priced by
    Anthropic's own cache at the breakpoints of the body the live proxy sends — for the same
    requests, and the replay's headline; the inspector's list and session page show it,
    the dashboard's counters add up to it. Planted: the proxy's own breakpoints left out of
    the bill (red: 12.3% against 20.6%), the inspector's list reading the points without
    them (red), the dashboard's counters billing without them (red)."""
    (tmp_path / "cfg" / "tenants").mkdir(parents=True)
    (tmp_path / "cfg" / "runloop.toml").write_text(
        f'[upstreams.claude]\nurl = "{upstream.url}"\nformat = "anthropic"\n'
        f'api_key = "sk-ant-upstream"\n')
    (tmp_path / "cfg" / "tenants" / "acme.toml").write_text(
        f'keys = ["{TENANT_KEY}"]\nupstream = "claude"\n[policy]\n'
        'cache_breakpoints = "auto"\n')
    proxy = make_proxy(config_dir=str(tmp_path / "cfg"), admin_key=ADMIN)
    conversation, tools = support_session(10)
    sid = "support-auto-breakpoints-2026-12-02"
    client = anthropic.Anthropic(base_url=proxy.base, api_key=TENANT_KEY, max_retries=0,
                                 default_headers={"X-Session-Id": sid})
    for i, m in enumerate(conversation):
        if m.get("role") == "assistant":
            system, turns = to_anthropic(conversation[:i])
            client.messages.create(model=ANTHROPIC_MODEL, max_tokens=1024, system=system,
                                   messages=turns, tools=[chat_to_tool(t["function"])
                                                          for t in tools])
    proxy.settle()
    sent = upstream.requests
    assert len(sent) == 20 and sum(len(marks(b)) >= 3 for b in sent) >= 10, \
        "the proxy marked the note and the merged turn after it"
    points = httpx.get(f"{proxy.base}/admin/sessions/{sid}", params={
        "points": "1", "tenant": "acme"}, headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=30).json()["points"]
    assert len(points) == 20
    # the proxy's own breakpoints, between the head and the end, on the forwarded side only
    assert all(p["marks"][0] == [] and all(p["head"][1] < k < p["forwarded"]
                                           for k in p["marks"][1])
               for p in points if "marks" in p)
    assert sum(len(p.get("marks", [[], []])[1]) >= 2 for p in points) >= 10
    stored = savings.of_points(points, PriceTable.load())
    # the dashboard's counters: the same bills
    text = httpx.get(proxy.base + "/metrics").text
    assert (_samples(text, BILL, side="client"), _samples(text, BILL, side="forwarded")) == \
        (pytest.approx(stored.client_usd, rel=1e-9),
         pytest.approx(stored.forwarded_usd, rel=1e-9))
    # the inspector's list and the session's page: the same figure
    ui = httpx.Client(base_url=proxy.base, follow_redirects=False, timeout=30)
    assert ui.post("/admin/ui/login", data={"key": ADMIN}).status_code == 303
    for page in (ui.get("/admin/ui", params={"tenant": "acme"}).text,
                 ui.get("/admin/ui/session", params={"id": sid, "tenant": "acme"}).text):
        assert f"<b>{stored.headline()}</b>" in page, page[:3000]
    tenant = proxy.state.config.tenants["acme"]
    replayer = Replayer(tenant, ANTHROPIC_MODEL, None,
                        provider=PriceTable.load().provider("anthropic"))
    tally = Tally()
    replayer.conversation({"messages": conversation, "tools": tools}, tally)
    finer = 1 - tally.money[1] / tally.money[0]
    assert stored.bill_saved is not None and tally.savings.bill_saved is not None
    print(stored.headline(), tally.savings.headline(), f"finer {finer:.1%}")
    assert stored.bill_saved == pytest.approx(finer, abs=0.005)
    assert tally.savings.bill_saved == pytest.approx(stored.bill_saved, abs=0.002)
