"""Long-term memory through the real proxy (pipeline/memory.py, the search and the recall in
pipeline/tools.py): closed loops indexed in Redis after the answer, a past turn found by what
it meant, opened around the hit; failures answered by words alone; sessions kept apart."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import redis

from runloop_proxy.conversation.messages import message_hash, message_refs
from runloop_proxy.conversation.segments import archived_loops, closed_loops, segments
from runloop_proxy.errors import EmbeddingError
from runloop_proxy.pipeline.memory import FIELD_CHARS, fuse, hybrid, nearest
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer, until
from .keys import openai_project_key

TENANT_KEY = openai_project_key(371)
UPSTREAM_KEY = openai_project_key(372)
MODEL = "gpt-4.1-mini-2025-04-14"
SYSTEM = "You are the support agent of an online store. Be brief."
ORDER_TOOLS = [{"type": "function", "function": {"name": "get_order", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "string"}}}}}]
PAST = [  # two closed loops: the refund, then small talk
    {"role": "user", "content": "My blender from order #W5102934 arrived cracked; I would "
                                "like my money back."},
    {"role": "assistant", "content": "Let me open the order.", "tool_calls": [
        {"id": "call_Qm3xT8vLw2", "type": "function",
         "function": {"name": "get_order", "arguments": '{"order_id": "#W5102934"}'}}]},
    {"role": "tool", "tool_call_id": "call_Qm3xT8vLw2",
     "content": '{"order_id": "#W5102934", "status": "delivered", "total": 54.04}'},
    {"role": "assistant", "content": "I issued a reimbursement of $54.04 for order #W5102934; "
                                     "the money reaches your card within five days."},
    {"role": "user", "content": "Will it rain in Lisbon tomorrow?"},
    {"role": "assistant", "content": "I only help with orders, sorry."},
]
QUERY = "refund we discussed"


def _config(root: Path, upstream_url: str, memory: str) -> str:
    (root / "tenants").mkdir(parents=True)
    (root / "runloop.toml").write_text(
        f'[upstreams.main]\nurl = "{upstream_url}"\napi_key = "{UPSTREAM_KEY}"\n'
        f'max_retries = 0\n[defaults]\nupstream = "main"\n')
    (root / "tenants" / "acme.toml").write_text(
        f'keys = ["{TENANT_KEY}"]\n[policy]\nproxy_tools = "always"\nmemory = "{memory}"\n')
    return str(root)


def _client(proxy: ProxyServer, session: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url, api_key=TENANT_KEY, max_retries=0,
                         default_headers={"X-Session-Id": session})


def _searching(query: str) -> Any:
    """The fake model: asked anything, it searches for ``query`` (then opens the hit that
    speaks of a reimbursement, when one does), and answers with what the proxy's tools
    said."""
    def respond(body: dict[str, Any]) -> dict[str, Any]:
        msgs = body["messages"]
        names = [t["function"]["name"] for t in body.get("tools") or []]
        last = msgs[-1]
        if last.get("role") == "tool" and last["tool_call_id"] == "sh_1":
            opened = re.search(r"open=(s:[0-9a-f]+)[^\n]*reimbursement",
                               str(last["content"]))
            if opened:
                return {"tool_calls": [{"id": "rc_1", "name": "recall_tool_call",
                                        "arguments": {"call_id": opened.group(1)}}]}
        if last.get("role") == "tool":
            found = [str(m["content"]) for m in msgs if m.get("tool_call_id") in
                     ("sh_1", "rc_1")]
            return {"content": "\n=====\n".join(found)}
        assert "search_history" in names
        return {"tool_calls": [{"id": "sh_1", "name": "search_history",
                                "arguments": {"query": query}}]}
    return respond


def _mem_keys(proxy: ProxyServer) -> list[str]:
    r = redis.Redis.from_url(proxy.settings.redis_url)
    prefix = proxy.state.config.store.key_prefix
    return sorted(k.decode() for k in r.scan_iter(f"{prefix}:*:mem:*"))


def _fields(proxy: ProxyServer, key: str) -> set[str]:
    r = redis.Redis.from_url(proxy.settings.redis_url)
    return {f.decode() for f in r.hkeys(key)}


def _served(tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream,
            memory: str = "embedded") -> ProxyServer:
    return make_proxy(config_dir=_config(tmp_path / "cfg", upstream.url, memory))  # type: ignore[no-any-return]


def _live_past(proxy: ProxyServer, upstream: ScriptedUpstream, session: str) -> None:
    """The past as the client lived it, turn by turn through the proxy (each answer's
    indexing behind it)."""
    c = _client(proxy, session)
    sent = [{"role": "system", "content": SYSTEM}]
    for m in PAST:
        if m["role"] == "assistant":
            upstream.push({"content": m["content"]} if not m.get("tool_calls") else
                          {"content": m["content"], "tool_calls": [
                              {"id": m["tool_calls"][0]["id"], "name": "get_order",
                               "arguments": {"order_id": "#W5102934"}}]})
            c.chat.completions.create(model=MODEL, messages=sent,  # type: ignore[arg-type]
                                      tools=ORDER_TOOLS)  # type: ignore[arg-type]
        sent.append(m)


def test_closed_loops_are_indexed_once_and_a_past_turn_is_found_by_meaning_and_opened(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Each answer's closed loops reach Redis as one vector per distinct segment, with the
    session's expiry; a second copy of the conversation adds none. A model's "refund we
    discussed" finds the turn that said "reimbursement" (no word in common but "we"), with
    its anchor, and the recall tool opens it into its loop. Catches: indexing the open loop
    too (planted: every loop indexed, red on the fields), a hit without its anchor
    (planted: ``anchor = ""``, red), the meaning ranking dropped from the fusion (planted:
    ``fuse([lexical])``, red: the refund turn is not found). (The mark only spares the
    lookup of loops indexed before: with it ignored, the lookup still finds them.)"""
    proxy = _served(tmp_path, make_proxy, upstream)
    _live_past(proxy, upstream, "mem-refund")
    conversation = [{"role": "system", "content": SYSTEM}, *PAST]
    want = {s.key[:FIELD_CHARS] for s in segments(conversation, closed_loops(conversation))}
    until(lambda: len(_mem_keys(proxy)) == 1
          and _fields(proxy, _mem_keys(proxy)[0]) >= want, what="both loops indexed")
    key = _mem_keys(proxy)[0]
    assert _fields(proxy, key) == want | {"_upto", "_tail"}
    r = redis.Redis.from_url(proxy.settings.redis_url)
    assert 0 < r.pttl(key) <= int(proxy.state.config.store.retention_days * 86_400_000)
    embedded = proxy.metrics.memory.labels("acme", "index", "ok")._value.get()
    assert embedded == len(want)

    upstream.responder = _searching(QUERY)
    ask = [*conversation, {"role": "user", "content": f"Did the {QUERY} go through?"}]
    answer = _client(proxy, "mem-refund").chat.completions.create(
        model=MODEL, messages=ask, tools=ORDER_TOOLS)  # type: ignore[arg-type]
    text = answer.choices[0].message.content or ""
    found, opened = text.split("\n=====\n")
    hits = found.splitlines()[1:]
    assert found.startswith(f"{len(hits)} best match(es) for '{QUERY}', by words and meaning:")
    refund = next(h for h in hits if "reimbursement of $54.04" in h)
    said = next(m for m in ask if "reimbursement of $54.04" in str(m.get("content")))
    ref = dict(zip(map(id, ask), message_refs([message_hash(m) for m in ask]),
                   strict=True))[id(said)]  # what recall_tool_call takes for the message
    assert refund.startswith(f"- [turn 0, assistant id={ref}, iteration 1, segment 4 response, "
                             f"open=s:")
    assert " response, open=s:" in refund and "meaning 0." in refund
    rain = next((i for i, h in enumerate(hits) if "Lisbon" in h), len(hits))
    assert hits.index(refund) < rain
    # the hit, its three neighbours before it (the loop has none after), and the way on
    user = segments(conversation, closed_loops(conversation))[0]
    assert opened.splitlines() == [
        "[runloop-proxy] turn 0, segments 1-4 of 5:",
        "[iteration 0, reasoning] Let me open the order.",
        '[iteration 0, tool_call] get_order({"order_id": "#W5102934"})',
        '[iteration 1, tool_result] {"order_id": "#W5102934", "status": "delivered", '
        '"total": 54.04}',
        f">> [iteration 1, response] {PAST[3]['content']}",
        f'1 earlier segment(s) of this turn: recall_tool_call(call_id="s:{user.key[:8]}")']
    # the same conversation again, echoed: nothing of it embedded again. The answer closed
    # a loop of its own (the question and the search): its segments are new, embedded once
    # each, behind the answer (this waited for the count to stay put, and was red whenever
    # that indexing landed first: twice in whole-suite runs)
    proxy.quiet()
    count = proxy.metrics.memory.labels("acme", "index", "ok")._value.get()
    fields = _fields(proxy, key) - {"_upto", "_tail"}
    assert fields >= want and count == len(fields), (count, embedded, sorted(fields - want))
    assert len(fields - want) <= 3  # the new loop: its question, the search, the answer


BASH = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}]
STEPS = [  # a coding agent's steps under one task (mini-swe-agent's shape), with their output
    ("grep -rn 'def next_run' src/", "src/scheduler/jobs.py:88:    def next_run(self, now):"),
    ("python -m pytest tests/test_jobs.py -x -q",
     "FAILED tests/test_jobs.py::test_next_run_daylight - TypeError: can't compare "
     "offset-naive and offset-aware datetimes\n1 failed, 31 passed in 0.84s"),
    ("sed -n 80,110p src/scheduler/jobs.py",
     "    def next_run(self, now):\n        due = self.last + self.every\n        return due"),
    ("git log --oneline -3 -- src/scheduler/jobs.py",
     "4be1f0c jobs: cache the cron parse\n91d2a7e jobs: every= accepts seconds"),
    ("pip list 2>/dev/null | grep -i tz", "tzdata 2024.1"),
]
CLOCK_QUERY = "mismatch between plain versus zoned timestamps"


def test_a_coding_agents_earlier_step_is_found_by_meaning_while_its_task_goes_on(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """One task, many steps, no second user turn (a coding agent's whole session is one
    loop): each answer indexes the steps finished so far, and a search by meaning from the
    middle of the task finds the earlier test failure by what it meant (the query shares no
    word with it), with its anchor. Catches: only closed loops archived (planted:
    ``archived_loops`` as ``closed_loops``, red: nothing indexed, the failure not found)."""
    proxy = _served(tmp_path, make_proxy, upstream)
    c = _client(proxy, "mem-task")
    sent: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a software engineer; use bash."},
        {"role": "user", "content": "The scheduler's daylight-saving test fails: fix it."}]
    for n, (command, output) in enumerate(STEPS):
        call = f"call_{n}Xq8Lw2Tz7pR"
        upstream.push({"content": f"THOUGHT: step {n}.", "tool_calls": [
            {"id": call, "name": "bash", "arguments": {"command": command}}]})
        got = c.chat.completions.create(model=MODEL, messages=sent,  # type: ignore[arg-type]
                                        tools=BASH)  # type: ignore[arg-type]
        sent += [got.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call, "content": output}]
    # the last answer's conversation (its tool result not sent yet): the task and the four
    # steps before it, three segments each (the thought, the call, its output)
    answered = sent[:-1]
    finished = {s.key[:FIELD_CHARS] for s in segments(answered, archived_loops(answered))}
    assert len(finished) == 13
    until(lambda: len(_mem_keys(proxy)) == 1
          and _fields(proxy, _mem_keys(proxy)[0]) >= finished, what="the steps indexed")

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        last = body["messages"][-1]
        if last.get("tool_call_id") == "sh_1":
            return {"content": str(last["content"])}
        return {"tool_calls": [{"id": "sh_1", "name": "search_history",
                                "arguments": {"query": CLOCK_QUERY}}]}
    upstream.responder = respond
    found = c.chat.completions.create(model=MODEL, messages=sent,  # type: ignore[arg-type]
                                      tools=BASH).choices[0].message.content or ""  # type: ignore[arg-type]
    hits = found.splitlines()[1:]
    assert found.startswith(f"{len(hits)} best match(es) for '{CLOCK_QUERY}', by words and "
                            f"meaning:"), found
    first = hits[0]
    assert "offset-naive and offset-aware" in first, found
    assert re.match(r"- \[turn 0, tool id=\S+, iteration 2, segment \d+ tool_result, "
                    r"open=s:[0-9a-f]+, score [0-9.]+, meaning 0\.\d+\] ", first), first
    assert "words " not in first  # found by meaning alone


def test_with_memory_off_the_search_is_by_words_alone(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """The same question with memory off: the old answer (no fusion), nothing indexed.
    Catches: memory on whatever the policy (planted: ``_memory`` ignoring "off", red)."""
    proxy = _served(tmp_path, make_proxy, upstream, memory="off")
    upstream.responder = _searching(QUERY)
    ask = [{"role": "system", "content": SYSTEM}, *PAST,
           {"role": "user", "content": f"Did the {QUERY} go through?"}]
    text = _client(proxy, "mem-off").chat.completions.create(
        model=MODEL, messages=ask, tools=ORDER_TOOLS).choices[0].message.content or ""  # type: ignore[arg-type]
    assert "by words and meaning" not in text and "open=s:" not in text
    assert "best match(es)" in text
    proxy.settle()
    assert _mem_keys(proxy) == []


class _Broken:
    name, dim = "wordllama-l2_supercat-256", 256

    def embed(self, texts: list[str]) -> Any:
        raise EmbeddingError("the embedded model failed: MemoryError: planted")


def test_a_failing_model_leaves_the_words_to_answer_and_says_so(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """The embedder raising: the request is answered, its search by words, the tool's
    answer says why, the answer's header says ``memory``, the metrics count it and the
    indexing's failure. Catches: the embedding error escaping the search (planted: the
    ``except EmbeddingError`` gone, red: a 500), the header left out (planted, red)."""
    proxy = _served(tmp_path, make_proxy, upstream)
    proxy.state.memory.embedder = _Broken()
    _live_past(proxy, upstream, "mem-broken")
    until(lambda: proxy.metrics.memory.labels("acme", "index", "failed")._value.get() >= 1,
          what="an indexing failure counted")
    upstream.responder = _searching(QUERY)
    ask = [{"role": "system", "content": SYSTEM}, *PAST,
           {"role": "user", "content": f"Did the {QUERY} go through?"}]
    raw = _client(proxy, "mem-broken").chat.completions.with_raw_response.create(
        model=MODEL, messages=ask, tools=ORDER_TOOLS)  # type: ignore[arg-type]
    text = raw.parse().choices[0].message.content or ""
    assert raw.headers["x-runloop-degraded"] == "memory"
    assert "(meaning partly unavailable: the embedded model failed: MemoryError: planted):" \
        in text
    assert proxy.metrics.memory.labels("acme", "search", "words_only")._value.get() == 1
    assert proxy.metrics.degraded.labels("acme", "memory")._value.get() == 1


def test_another_session_never_reads_a_segment_or_a_vector_of_this_one(
        tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Two named sessions of one tenant: the second's search and recall reach only what its
    own request carries, and its vectors are its own key's. Catches: vectors keyed by
    tenant (planted: the session left out of the key, red on the key count) and, with that,
    the search taking every stored row rather than the request's segments' (planted: the
    mask in ``Memory._search`` gone, red: alice's order number in bob's answer)."""
    proxy = _served(tmp_path, make_proxy, upstream)
    _live_past(proxy, upstream, "mem-alice")
    until(lambda: len(_mem_keys(proxy)) == 1, what="alice's loops indexed")
    upstream.responder = _searching(QUERY)
    other = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "Where is my parcel 1Z999AA10123456784?"},
             {"role": "assistant", "content": "It is in the Porto depot."},
             {"role": "user", "content": f"And the {QUERY}?"}]
    text = _client(proxy, "mem-bob").chat.completions.create(
        model=MODEL, messages=other, tools=ORDER_TOOLS).choices[0].message.content or ""  # type: ignore[arg-type]
    assert "W5102934" not in text and "reimbursement" not in text
    until(lambda: len(_mem_keys(proxy)) == 2, what="bob's loop indexed")
    alice, bob = (_fields(proxy, k) for k in _mem_keys(proxy))
    assert not (alice & bob) - {"_upto", "_tail"}


@pytest.mark.parametrize(("rankings", "want"), [
    ([["a", "b", "c"], ["c", "b"]], ["c", "b", "a"]),  # c: 1/63 + 1/61 beats b: 2/62
    # y (2nd, 2nd) beats x (1st, 4th) at k = 60; at k = 0, x would
    ([["x", "y"], ["z", "y", "w", "x"]], ["y", "x", "z", "w"]),
    ([["a"], []], ["a"]),
    ([[], []], []),
    ([["a", "b"], ["b", "a"]], ["a", "b"]),  # a tie keeps the first ranking's order
])
def test_reciprocal_rank_fusion(rankings: list[list[str]], want: list[str]) -> None:
    """Catches: the constant lost (planted: ``k = 0``, red on the second row) and scores
    added as ranks (planted: ``+= r``, red)."""
    assert [k for _, k in fuse(rankings, 60)] == want


@pytest.mark.parametrize(("query", "want"), [
    # plain words: w2, in both, first (1 / 22 + 3 / 23); meaning's first two (3 / 21,
    # 3 / 22) before the words' first (1 / 21)
    ("the refund we talked about", ["w2", "m1", "m2", "w1"]),
    # a number named: the two alike; the words' first ties meaning's (1 / 21), kept first
    ("reservation WUNA5K", ["w2", "w1", "m1", "m2"]),
    ("order #W5102934", ["w2", "w1", "m1", "m2"]),
    # an identifier without a digit: a file, a function, a camel-cased name
    ("where is src/router.py read", ["w2", "w1", "m1", "m2"]),
    ("handle_request", ["w2", "w1", "m1", "m2"]),
    ("the nextRun bug", ["w2", "w1", "m1", "m2"]),
    ("setup.cfg", ["w2", "w1", "m1", "m2"]),
    # a sentence's full stop, a hyphen, a capital after a space: plain words still
    ("Where was it. Then what?", ["w2", "m1", "m2", "w1"]),
    ("the follow-up About routing", ["w2", "m1", "m2", "w1"]),
])
def test_meaning_counts_more_for_a_query_of_plain_words(query: str, want: list[str]) -> None:
    """Catches: one weighting for every query (planted: ``meaning = MEANING_WEIGHT``
    always, red on the numbered rows; planted: 1.0 always, red on the first), identifiers
    missed (planted: the digit alone, red on the identifier rows), the weights
    ignored by ``fuse`` (planted: ``w = 1.0``, red on the first)."""
    by_words, by_meaning = ["w1", "w2"], ["m1", "m2", "w2"]
    assert [k for _, k in hybrid(query, by_words, by_meaning)][:4] == want


def test_nearest_is_exact_and_ordered() -> None:
    """Catches: the partition taken for the order (planted: ``top.tolist()`` unsorted, red)
    and ``k`` past the rows (planted: no guard, red: argpartition raises)."""
    rows = np.eye(4, dtype=np.float32)[[3, 0, 2, 1]]
    q = np.array([0.1, 0.7, 0.2, 0.69], np.float32)
    assert [i for i, _ in nearest(q, rows, 3)] == [3, 0, 2]
    assert [i for i, _ in nearest(q, rows, 9)] == [3, 0, 2, 1]
    assert nearest(q, rows[:0], 3) == []


def test_a_stranger_who_opens_alike_reads_the_same_whether_or_not_the_victim_came_first(
        tmp_path: Path, make_proxy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory on, in a session nobody named: the stranger who opens as the victim did (one
    fingerprint, one stored session, her vectors beside his) gets byte for byte the upstream
    bodies he gets alone, and none of her secrets, though his model searches for them
    before each answer (``test_noninterference``'s world). Catches: the search scoring every
    row the session stores rather than the request's own segments' (planted: the mask in
    ``Memory._search`` gone, red: his search fails on her rows and answers by words alone,
    unlike his run alone — before the search failed open, a 500)."""
    from .test_config import ACME_KEY
    from .test_noninterference import CARD, LINE_UPS, POLICIES, SECRET, _normal, run

    monkeypatch.setenv("TEST_UPSTREAM_KEY", "sk-up")
    monkeypatch.setenv("TEST_ACME_KEY", ACME_KEY)
    policy = POLICIES["default"] + 'memory = "embedded"\n'
    alone = run(tmp_path, "alone", make_proxy, policy, "chat", LINE_UPS["same-opening"],
                with_victim=False)
    after = run(tmp_path, "after", make_proxy, policy, "chat", LINE_UPS["same-opening"],
                with_victim=True)
    assert any(b"by words and meaning" in b for b in after), "his model searched by meaning"
    for body in after:
        for secret in (SECRET, CARD, "9,120.44"):
            assert secret.encode() not in body, f"the stranger's model was shown {secret}"
    assert [_normal(b) for b in after] == [_normal(b) for b in alone]
