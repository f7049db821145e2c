"""``/v1/responses`` through real servers: the official SDK's ``responses.create`` and
``responses.stream`` against the proxy, the scripted upstream speaking the Responses API (JSON
and events), a real Redis. Stateless sessions are stored, compressed and recalled like chat
sessions; chains on ``previous_response_id`` pass through untouched and are counted."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import httpx
import openai
import orjson
import pytest

from runloop_proxy.conversation.identity import named_key
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer, until
from .keys import openai_project_key
from .policies import MECHANISM

ADMIN = "admin-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
KEY = openai_project_key(13)
TENANT = "pt-" + hashlib.sha256(KEY.encode()).hexdigest()[:16]  # a pass-through tenant
TOOLS = [{"type": "function", "name": "shell", "description": "run a command",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]
# what a big tool output looks like to an agent: Unicode, runs of spaces, CRLF
BIG = "Ünïcode   runs\r\n\tof  whitespace — {k}\n" + "\n".join(
    f"row {{k}}-{i}:  値 {i * 7}" for i in range(400))


DEEP: Any = []
for _ in range(80):
    DEEP = [DEEP]


def sdk(proxy: ProxyServer, session: str | None = None) -> openai.OpenAI:
    headers = {"X-Session-Id": session} if session else None
    return openai.OpenAI(base_url=proxy.url, api_key=KEY, max_retries=0,
                         default_headers=headers)


def proxy_tool(body: dict[str, Any], kind: str = "recall_tool_call") -> str | None:
    return next((t["name"] for t in body.get("tools") or []
                 if str(t.get("name", "")).endswith(kind)), None)


def ref_of(items: list[dict[str, Any]], call_id: str, k: int) -> str | None:
    """The ref the window gives for the output of ``call_id`` (``cat f{k}``): in its cut
    output's placeholder, in a reduced past loop's list of the tools it used, or (its own
    id) in the note that says which exchanges of the open loop are not shown."""
    for item in items:
        if f"(calls {call_id} \u2026" in str(item.get("content")):
            return call_id
        if item.get("type") == "function_call_output" and item.get("call_id") == call_id:
            found = re.search(r'recall_tool_call\(call_id="([^"]+)"\)', str(item["output"]))
            return found.group(1) if found else None
        found = re.search(rf"(\w+) shell\(cmd=cat f{k}\)", orjson.dumps(item).decode())
        if found:
            return found.group(1)
    return None


def agent_turns(n: int, tasks: bool = True) -> list[dict[str, Any]]:
    """A stateless agent session as Codex sends it: reasoning, calls, large outputs; a user
    task per step (``tasks``) or one task worked on for ``n`` steps."""
    items: list[dict[str, Any]] = []
    for k in range(n):
        if tasks or k == 0:
            items.append({"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": f"task {k}: look at f{k}"}]})
        items.append({"type": "reasoning", "id": f"rs_{k}", "summary": [],
                      "encrypted_content": f"opaque-{k}"})
        items.append({"type": "function_call", "id": f"fc_{k}", "call_id": f"call_{k}",
                      "name": "shell", "arguments": orjson.dumps({"cmd": f"cat f{k}"}).decode()})
        items.append({"type": "function_call_output", "call_id": f"call_{k}",
                      "output": BIG.format(k=k)})
        if tasks:
            items.append({"type": "message", "role": "assistant", "id": f"msg_{k}",
                          "content": [{"type": "output_text", "text": f"f{k} looks fine",
                                       "annotations": []}]})
    return items


def recalling(target: str, k: int) -> Any:
    """A fake model: recalls ``target`` when it sees it cut, then answers with its size."""
    def respond(body: dict[str, Any]) -> dict[str, Any]:
        last = body["input"][-1]
        if last.get("type") == "function_call_output" and last["call_id"] == "rc_1":
            return {"content": f"recalled {len(last['output'])} chars"}
        ref = ref_of(body["input"], target, k)
        if ref and proxy_tool(body):
            return {"content": "Let me look.", "reasoning": "thinking",
                    "tool_calls": [{"id": "rc_1", "name": proxy_tool(body),
                                    "arguments": {"call_id": ref}}]}
        return {"content": "nothing to recall"}
    return respond



def final_response(c: Any, stream: bool, **kw: Any) -> Any:
    """The response a request's client ends with, asked for streamed or not."""
    if stream:
        with c.responses.stream(**kw) as s:
            return s.get_final_response()
    return c.responses.create(**kw)

def test_a_plain_request_is_answered_and_stored(make_proxy: Any,
                                               upstream: ScriptedUpstream) -> None:
    proxy = make_proxy(admin_key=ADMIN)
    c = sdk(proxy, "resp-plain")
    first = c.responses.create(model="gpt-4o-mini", instructions="Be brief.", input="hello")
    assert first.output_text == "echo: hello"
    assert first.id.startswith("resp_")
    second = c.responses.create(model="gpt-4o-mini", instructions="Be brief.", input=[
        {"role": "user", "content": "hello"},
        *[o.model_dump(exclude_none=True) for o in first.output],
        {"role": "user", "content": "again"}])
    assert second.output_text == "echo: again"
    sent = upstream.requests[-1]
    assert sent["instructions"] == "Be brief." and sent["input"][-1]["content"] == "again"
    proxy.settle()
    view = httpx.get(proxy.base + "/admin/sessions/resp-plain", headers=AUTH,
                     params={"messages": "1", "tenant": TENANT}).json()
    assert [(m["role"], m["content"]) for m in view["messages"]] == [
        ("system", "Be brief."), ("user", "hello"), ("assistant", "echo: hello"),
        ("user", "again"), ("assistant", "echo: again")]
    assert len(view["branches"]) == 1  # the SDK's echo of its output is the same turn


def test_unknown_fields_and_items_pass_through(proxy: ProxyServer,
                                              upstream: ScriptedUpstream) -> None:
    body = {"model": "gpt-4o-mini", "input": [
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "look"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
        {"type": "web_search_call", "id": "ws_1", "status": "completed",
         "action": {"type": "search", "query": "x"}},
        {"type": "item_reference", "id": "msg_0"}],
        "reasoning": {"effort": "low"}, "include": ["reasoning.encrypted_content"],
        "text": {"verbosity": "low"}, "a_field_from_the_future": {"x": [1, 2]}}
    r = httpx.post(proxy.url + "/responses", json=body, headers={"X-Session-Id": "pass"})
    assert r.status_code == 200, r.text
    assert orjson.loads(upstream.raw_bodies[-1]) == body


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("tasks", [True, False], ids=["40-tasks", "one-task"])
def test_a_long_stateless_session_is_compressed_and_recalled_byte_for_byte(
        make_proxy: Any, upstream: ScriptedUpstream, stream: bool, tasks: bool) -> None:
    """40 turns with large function outputs, the full input every time (store=false): what
    goes upstream is far smaller, and a cut output comes back whole when the model asks —
    from a reduced past loop (40 tasks: past loops kept in view, ``MECHANISM``) or from the
    open loop's cut outputs (one task)."""
    proxy: ProxyServer = make_proxy(policy=MECHANISM)
    k = 35 if tasks else 0  # a reduced past loop still in view; the open loop's first step
    model = recalling(f"call_{k}", k)
    # each round's response named by its round: the client must be given the last one's (the
    # first is stored upstream with the proxy's call unanswered: chaining on it would fail)
    upstream.responder = lambda body: {**model(body),
                                       "response_id": f"resp_round{len(upstream.requests)}"}
    items = agent_turns(40, tasks)
    if tasks:
        items.append({"type": "message", "role": "user",
                      "content": [{"type": "input_text", "text": f"and f{k}?"}]})
    c = sdk(proxy, f"long-{stream}-{tasks}")
    kw: dict[str, Any] = {"model": "gpt-4o-mini", "input": items, "tools": TOOLS,
                          "store": False, "include": ["reasoning.encrypted_content"]}
    if stream:
        with c.responses.stream(**kw) as s:
            events = list(s)
            final = s.get_final_response()
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created" and kinds.count("response.created") == 1
        assert kinds[-1] == "response.completed" and kinds.count("response.completed") == 1
        assert not any(e.type.startswith("response.function_call") for e in events)
        assert [e.sequence_number for e in events] == list(range(len(events)))
        added = [e.output_index for e in events if e.type == "response.output_item.added"]
        assert added == list(range(len(added)))  # renumbered across the rounds
    else:
        final = c.responses.create(**kw)
    # a stream shows the text of every round as it came; JSON answers with the last round's
    said = "Let me look." if stream else ""
    assert final.output_text == f"{said}recalled {len(BIG.format(k=k))} chars"
    assert all(o.type != "function_call" for o in final.output)
    # JSON answers with the last round's response; a stream keeps the id its
    # response.created showed (the SDK refuses a lifecycle whose id changes)
    n = len(upstream.requests)
    assert final.id == f"resp_round{n - 1 if stream else n}"
    assert final.usage is not None and final.usage.input_tokens == sum(
        _usage(b) for b in upstream.requests[-2:])
    first, second = upstream.requests[-2], upstream.requests[-1]
    assert len(orjson.dumps(first["input"])) < len(orjson.dumps(items)) * 0.3
    assert [t["name"] for t in first["tools"]] == ["shell", "recall_tool_call",
                                                   "search_history"]
    recalled = second["input"][-1]
    assert recalled == {"type": "function_call_output", "call_id": "rc_1",
                        "output": BIG.format(k=k)}
    if not tasks:  # the open loop's last reasoning and call go up as they came
        assert items[-3:-1] == first["input"][-3:-1]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_chained_on_an_answer_of_several_rounds_goes_on_from_the_last(
        proxy: ProxyServer, upstream: ScriptedUpstream, stream: bool) -> None:
    """An answer the proxy's tools took two rounds over is two responses upstream; the
    first holds the proxy's call with no output, and a request chained on it would be
    refused ("No tool output found"). JSON gives the client the last round's id; a stream
    must keep the id its response.created showed, so a request chained on that id is sent
    on from the last round's (stored, answered), and its session is the same."""
    model = recalling("call_0", 0)
    upstream.responder = lambda body: {**model(body),
                                       "response_id": f"resp_r{len(upstream.requests)}"}
    c = sdk(proxy, f"chain-{stream}")
    kw: dict[str, Any] = {"model": "gpt-4o-mini", "input": agent_turns(40, False),
                          "tools": TOOLS}
    final = final_response(c, stream, **kw)
    assert len(upstream.requests) == 2 and final.output_text.startswith(
        "Let me look." if stream else "recalled")
    proxy.settle()
    follow = c.responses.create(model="gpt-4o-mini", previous_response_id=final.id,
                                input=[{"role": "user", "content": "and then?"}])
    sent = upstream.requests[-1]
    assert sent["previous_response_id"] == "resp_r2"  # the last round's: the whole turn
    assert sent["input"] == [{"role": "user", "content": "and then?"}]  # nothing else
    assert follow.output_text == "nothing to recall"


def _usage(body: dict[str, Any]) -> int:
    from runloop_proxy.scripted import _as_chat, estimate_prompt_tokens
    return estimate_prompt_tokens(_as_chat(body))


def test_a_past_loop_keeps_question_and_answer_and_drops_reasoning(
        proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    items = agent_turns(12) + [{"role": "user", "content": "next"}]
    sdk(proxy, "reduce").responses.create(model="gpt-4o-mini", input=items, tools=TOOLS)
    sent = upstream.requests[-1]["input"]
    texts = [orjson.dumps(i).decode() for i in sent]
    assert any('"task 11: look at f11"' in t for t in texts)
    assert any("f11 looks fine" in t for t in texts)
    assert not any('"opaque-11"' in t for t in texts)  # old reasoning left out
    assert not any("row 11-0" in t for t in texts)  # and the loop's output: by its ref
    assert sent[-1] == {"role": "user", "content": "next"}


def test_chained_requests_pass_through_untouched_and_are_counted(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    proxy = make_proxy(admin_key=ADMIN)
    c = sdk(proxy)
    first = c.responses.create(model="gpt-4o-mini", input="remember 42", store=True)
    raw = orjson.dumps({"model": "gpt-4o-mini", "previous_response_id": first.id,
                        "input": [{"role": "user", "content": "what number?"}],
                        "tools": TOOLS})
    r = httpx.post(proxy.url + "/responses", content=raw, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    assert upstream.raw_bodies[-1] == raw  # no window, no tools of the proxy's
    metrics = httpx.get(proxy.base + "/metrics").text
    assert re.search(r'runloop_requests_total\{api="responses_chained",[^}]*status="200"'
                     r'[^}]*\} 1\.0', metrics), metrics
    proxy.settle()
    (row,) = httpx.get(proxy.base + "/admin/sessions", headers=AUTH,
                       params={"tenant": TENANT}).json()["sessions"]
    view = httpx.get(f"{proxy.base}/admin/sessions/{row['session_id']}", headers=AUTH,
                     params={"tenant": TENANT, "messages": "1"}).json()
    # the chained turn joined the session of the response it chains on
    assert [m["content"] for m in view["messages"]] == [
        "remember 42", "echo: remember 42", "what number?", "echo: what number?"]


def test_admin_view_shows_the_run_loops(make_proxy: Any, upstream: ScriptedUpstream) -> None:
    proxy = make_proxy(admin_key=ADMIN)
    c = sdk(proxy, "loops")
    c.responses.create(model="gpt-4o-mini", input=agent_turns(3) + [
        {"role": "user", "content": "done?"}], tools=TOOLS)
    proxy.settle()
    view = httpx.get(proxy.base + "/admin/sessions/loops", headers=AUTH,
                     params={"tenant": TENANT}).json()
    assert view["message_count"] == 3 * 4 + 2
    assert [loop["user_preview"] for loop in view["run_loops"]][:3] == [
        "task 0: look at f0", "task 1: look at f1", "task 2: look at f2"]


@pytest.mark.parametrize("body", [
    {"model": "m"},
    {"model": "m", "input": 5},
    {"model": "m", "input": [1]},
    {"model": "m", "input": [{"type": "message", "content": "x"}]},
    {"model": "m", "input": [{"type": "function_call", "call_id": 1, "name": "f"}]},
    {"model": "m", "input": [{"type": "function_call_output", "call_id": None}]},
    {"model": "m", "input": "x", "tools": [{"type": "function"}]},
    {"model": "m", "input": "x", "stream": "yes"},
    {"model": "m", "input": "x", "previous_response_id": 3},
    {"model": "m", "input": [{"role": "user", "content": "x", "deep": DEEP}]},
])
def test_bad_requests_get_a_400_naming_the_field(proxy: ProxyServer, upstream: ScriptedUpstream,
                                                 body: dict[str, Any]) -> None:
    r = httpx.post(proxy.url + "/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert upstream.requests == []


def test_an_upstream_error_in_the_stream_reaches_the_client(
        proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    upstream.push({"content": "partial answer that dies", "die_after": 0})
    body = {"model": "gpt-4o-mini", "input": agent_turns(2) + [
        {"role": "user", "content": "x"}], "tools": TOOLS, "stream": True}
    with httpx.stream("POST", proxy.url + "/responses", json=body, timeout=30,
                      headers={"X-Session-Id": "dies"}) as r:
        raw = b"".join(r.iter_bytes())
    assert b"response.completed" not in raw
    assert b"event: error" in raw or r.status_code >= 500
    until(lambda: upstream.streams_closed_early >= 1, what="the upstream stream closed")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_mixed_calls_the_client_gets_its_own_and_the_proxys_are_spliced_back(
        proxy: ProxyServer, upstream: ScriptedUpstream, stream: bool) -> None:
    items = agent_turns(14, tasks=False)

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        if any(i.get("call_id") == "client_1" and "output" in i for i in body["input"]):
            return {"content": "all done"}
        return {"tool_calls": [{"id": "rc_9", "name": proxy_tool(body),
                                "arguments": {"call_id": "call_1"}},
                               {"id": "client_1", "name": "shell",
                                "arguments": {"cmd": "ls"}}]}

    upstream.responder = respond
    c = sdk(proxy, f"mixed-{stream}")
    kw: dict[str, Any] = {"model": "gpt-4o-mini", "input": items, "tools": TOOLS}
    if stream:
        with c.responses.stream(**kw) as s:
            events = list(s)
            first = s.get_final_response()
        added = [(e.output_index, e.item.type) for e in events
                 if e.type == "response.output_item.added"]
        assert added == [(0, "function_call")]  # the client's call, renumbered to 0
    else:
        first = c.responses.create(**kw)
    calls = [o for o in first.output if o.type == "function_call"]
    assert [(o.call_id, o.name) for o in calls] == [("client_1", "shell")]
    items += [o.model_dump(exclude_none=True) for o in first.output]
    items.append({"type": "function_call_output", "call_id": "client_1", "output": "a b"})
    until(lambda: proxy.state.store.cached_internal(TENANT, named_key(f"mixed-{stream}")),
          what="the proxy's part of the turn kept")
    assert c.responses.create(**{**kw, "input": items}).output_text == "all done"
    sent = upstream.requests[-1]["input"]
    called = [i["call_id"] for i in sent if i.get("type") == "function_call"][-2:]
    answered = [i["call_id"] for i in sent if i.get("type") == "function_call_output"][-2:]
    assert sorted(called) == sorted(answered) == ["client_1", "rc_9"]
    recalled = next(i for i in sent if i.get("call_id") == "rc_9" and "output" in i)
    assert recalled["output"] == BIG.format(k=1)


def mixed_answer(body: dict[str, Any]) -> dict[str, Any]:
    """A model that answers with the proxy's call and the client's (``client_1``) in one
    response, then, once the client's output is given, "all done"."""
    given = body["input"] if isinstance(body["input"], list) else []
    if any(i.get("call_id") == "client_1" and "output" in i for i in given):
        return {"content": "all done"}
    return {"tool_calls": [{"id": "rc_9", "name": proxy_tool(body),
                            "arguments": {"call_id": "call_1"}},
                           {"id": "client_1", "name": "shell", "arguments": {"cmd": "ls"}}]}


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_chained_on_a_mixed_answer_carries_the_proxys_outputs(
        proxy: ProxyServer, upstream: ScriptedUpstream, stream: bool) -> None:
    """Finding (red team, second pass): an answer mixing the client's call with the proxy's
    is one response upstream holding both calls; the client is shown its own, and a request
    chained on that response answered only it — the upstream refuses a chain with a call
    left without output ("No tool output found"). The outputs of the proxy's calls are kept
    with the answer's id, and go before the client's input in the chained request."""
    upstream.responder = lambda body: {**mixed_answer(body),
                                       "response_id": f"resp_m{len(upstream.requests)}"}
    c = sdk(proxy, f"mixed-chain-{stream}")
    kw: dict[str, Any] = {"model": "gpt-4o-mini", "input": agent_turns(14, tasks=False),
                          "tools": TOOLS}
    first = final_response(c, stream, **kw)
    assert [o.call_id for o in first.output if o.type == "function_call"] == ["client_1"]
    mine = [{"type": "function_call_output", "call_id": "client_1", "output": "a b"}]
    follow = c.responses.create(model="gpt-4o-mini", previous_response_id=first.id,
                                input=mine, tools=TOOLS)  # type: ignore[arg-type]
    assert follow.output_text == "all done"
    sent = upstream.requests[-1]
    assert sent["previous_response_id"] == first.id == "resp_m1"  # one round: as it was
    outputs = [i for i in sent["input"] if i.get("type") == "function_call_output"]
    assert [i["call_id"] for i in outputs] == ["rc_9", "client_1"]  # the proxy's, then its
    assert outputs[0]["output"] == BIG.format(k=1) and sent["input"][-1] == mine[0]


def test_every_cut_output_comes_back_byte_for_byte_and_items_stay_valid(
        proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    """One task, 40 large outputs: the forwarded input is a valid item sequence (every output
    after its call, every call answered) within the budget, and each output the window cut
    or dropped is returned whole by the proxy's recall tool."""
    items = agent_turns(40, tasks=False)
    outputs = {i["call_id"]: i["output"] for i in items if i["type"] == "function_call_output"}
    got: dict[str, str] = {}
    target: list[str] = []

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        last = body["input"][-1]
        if last.get("call_id") == "rc_all":
            got[target[0]] = last["output"]
            return {"content": "ok"}
        return {"tool_calls": [{"id": "rc_all", "name": proxy_tool(body),
                                "arguments": {"call_id": target[0]}}]}

    upstream.responder = respond
    c = sdk(proxy, "every-cut")
    target.append("call_39")
    c.responses.create(model="gpt-4o-mini", input=items, tools=TOOLS)
    sent = upstream.requests[0]["input"]
    called = [i["call_id"] for i in sent if i.get("type") == "function_call"]
    answered = [i["call_id"] for i in sent if i.get("type") == "function_call_output"]
    assert called == answered  # each call followed by its output, none orphaned
    for k, item in enumerate(sent):
        if item.get("type") == "function_call_output":
            assert sent[k - 1].get("call_id") == item["call_id"]
    assert len(orjson.dumps(sent)) < len(orjson.dumps(items)) / 4
    shown = {i["call_id"]: i["output"] for i in sent if i.get("type") == "function_call_output"}
    cut = [cid for cid in outputs if shown.get(cid) != outputs[cid]]
    assert len(cut) >= 30
    for cid in cut:
        target[0] = cid
        assert c.responses.create(model="gpt-4o-mini", input=items,
                                  tools=TOOLS).output_text == "ok"
        assert got[cid] == outputs[cid], cid


def test_a_stateless_session_shows_its_summary_after_the_marker(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """With extractive summaries, a Responses conversation that arrives long (twelve tasks,
    so the first request already omits five) shows the digest of what it omits right after
    the marker, as an assistant item: made inline, since no earlier request could make it."""
    proxy = make_proxy(policy={**MECHANISM, "summary_model": "extractive"})
    upstream.responder = lambda body: {"content": "ok"}
    items = agent_turns(12) + [{"role": "user", "content": "next"}]
    sdk(proxy, "sum-resp").responses.create(model="gpt-4o-mini", input=items, tools=TOOLS,
                                            store=False)
    sent = upstream.requests[-1]["input"]
    at = next(i for i, item in enumerate(sent)
              if "Earlier turns are not shown" in str(item.get("content")))
    summary = sent[at]  # the marker, the model's own note, with the summary after its text
    assert summary["role"] == "assistant"
    text = str(summary["content"])
    assert "[runloop-proxy] Earlier turns are not shown" in text
    assert "Summary of the turns not shown:\n- Q: task 0" in text
    # the opening task stays in view, where it stood, before the marker
    assert sent[at - 1]["role"] == "user" and "task 0" in str(sent[at - 1]["content"])
    assert "- Q: task 0: look at f0 [tools: shell] → A: f0 looks fine" in text
    assert "task 4: look at f4" in text and "task 5: look at f5" not in text  # loops 0-4
    assert "0-0" not in text  # an output's row coordinates are no identifiers (amounts are)
    assert sent[-1] == {"role": "user", "content": "next"}
