"""One headline figure, the same everywhere, and right: a session with compactions through a
real proxy (scripted upstream, real Redis), its *bill saved* as the stored points make it
(the inspector's page), as the dashboard's counters add it up, as ``wrap`` prints it and as
the offline replay makes it of the same conversation — equal, and equal to the replay's finer
money model (every block priced by the provider's own cache) within rounding."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import pytest

from runloop_proxy import savings
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
