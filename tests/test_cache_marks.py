"""What a client adds or moves for the provider's cache is not content: ``cache_control`` on
any block, at any depth (a tool_result's content, a document's), on system blocks and tools,
never makes a message another one for reconciliation or a session's fingerprint — while the
window forwards the client's marks where it put them.

The bug class: *a field a client sets for the provider's cache counted as content.* Claude
Code moves its one mark to the newest block on every request, so the block that carried it
comes back without it; a match that counted the mark read every request as an edit (15
branches for one 3-turn session). Planted to see these tests red: the match hash counting the
mark (every row below, and the SDK sessions fork); marks taken out of a block's top level only
(the nested rows: a tool_result's text block, a document's content); the fingerprint hashing
the marked system prompt (the unnamed SDK session splits in two); ``prepare`` trusting the
content hash for a marked message (the stored sessions fork).
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runloop_proxy.api.breakpoints import marks
from runloop_proxy.conversation.blocks import to_messages
from runloop_proxy.conversation.identity import fingerprint
from runloop_proxy.conversation.messages import match_hash, message_hash, unmarked
from runloop_proxy.history.writes import prepare
from runloop_proxy.scripted import ScriptedUpstream

from .keys import anthropic_key

EPHEMERAL = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}
MODEL = "claude-haiku-4-5-20251001"
KEY = anthropic_key(38)
ADMIN = "admin-cache-marks-0123456789"
TENANT = "pt-" + hashlib.sha256(KEY.encode()).hexdigest()[:16]


def _mark(value: Any, path: tuple[Any, ...], mark: dict[str, Any]) -> Any:
    out = copy.deepcopy(value)
    node = out
    for step in path:
        node = node[step]
    node["cache_control"] = mark
    return out


TEXT_TURN = [{"type": "text", "text": "run the tests"}, {"type": "text", "text": "and fix them"}]
RESULT_TURN = [{"type": "tool_result", "tool_use_id": "toolu_01HXb3", "content": [
    {"type": "text", "text": "FAILED tests/test_app.py::test_login"},
    {"type": "text", "text": "1 failed, 41 passed in 2.31s"}]}]
DOC_TURN = [{"type": "document", "source": {"type": "content", "content": [
    {"type": "text", "text": "Section 1. Terms."}]}, "title": "contract.pdf"},
    {"type": "text", "text": "summarise it"}]
SYSTEM = [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI."},
          {"type": "text", "text": "Working directory: /home/dev/app"}]


@pytest.mark.parametrize(("system", "turn", "path"), [
    (None, TEXT_TURN, (0, "content", 1)),
    (None, TEXT_TURN, (0, "content", 0)),
    (None, RESULT_TURN, (0, "content", 0)),
    (None, RESULT_TURN, (0, "content", 0, "content", 1)),  # inside a tool_result
    (None, DOC_TURN, (0, "content", 0, "source", "content", 0)),  # inside a document
    (None, [{"type": "text", "text": "hi"}], (0, "content", 0)),  # one text block
    ("system", TEXT_TURN, (1,)),  # a system block
], ids=["last-text", "first-text", "tool-result", "nested-in-result", "nested-in-document",
        "single-text", "system-block"])
def test_a_mark_anywhere_leaves_the_match_and_the_fingerprint_alone(
        system: str | None, turn: list[dict[str, Any]], path: tuple[Any, ...]) -> None:
    turns = [{"role": "user", "content": turn}]
    plain = to_messages(turns, SYSTEM)
    for mark in (EPHEMERAL, HOUR):
        if system:
            marked = to_messages(turns, _mark(SYSTEM, path, mark))
        else:
            marked = to_messages(_mark(turns, path, mark), SYSTEM)
        assert [match_hash(m) for m in marked] == [match_hash(m) for m in plain]
        assert [prepare(m).match for m in marked] == [prepare(m).match for m in plain]
        assert fingerprint("ns", (), marked) == fingerprint("ns", (), plain)
        # the content keeps the mark: the window forwards what the client sent
        assert [message_hash(m) for m in marked] != [message_hash(m) for m in plain]
        assert [prepare(m).hash for m in marked] != [prepare(m).hash for m in plain]


@pytest.mark.parametrize("other", [
    [{"type": "text", "text": "run the tests", "cache_control": EPHEMERAL},
     {"type": "text", "text": "and fix them later"}],
    [{"type": "text", "text": "run the tests"}],
    [{"type": "tool_result", "tool_use_id": "toolu_01HXb3", "is_error": True,
      "content": RESULT_TURN[0]["content"], "cache_control": EPHEMERAL}],
    [{"type": "text", "text": "run the tests", "cache": EPHEMERAL},
     {"type": "text", "text": "and fix them"}],  # not a cache mark: a field of its own
], ids=["text-changed", "block-dropped", "is-error-added", "another-field"])
def test_what_still_makes_another_message(other: list[dict[str, Any]]) -> None:
    base = to_messages([{"role": "user", "content": TEXT_TURN}])[0]
    result = to_messages([{"role": "user", "content": RESULT_TURN}])[0]
    changed = to_messages([{"role": "user", "content": other}])[0]
    assert match_hash(changed) not in (match_hash(base), match_hash(result))


def test_a_system_turn_in_marked_blocks_then_as_a_string_is_one_turn() -> None:
    """Claude Code 2.1.332 sends its environment as a system turn: a marked text block while
    it is the newest, a string once the mark moved on (the session forked at it)."""
    env = "# Environment\nYou have been invoked in the following environment:"
    first = to_messages([{"role": "user", "content": "hi"},
                         {"role": "system", "content": [
                             {"type": "text", "text": env, "cache_control": EPHEMERAL}]}])
    later = to_messages([{"role": "user", "content": "hi"},
                         {"role": "system", "content": env}])
    plain = to_messages([{"role": "user", "content": "hi"},
                         {"role": "system", "content": [{"type": "text", "text": env}]}])
    assert match_hash(first[1]) == match_hash(later[1]) == match_hash(plain[1])
    assert prepare(first[1]).match == prepare(later[1]).match
    assert fingerprint("ns", (), to_messages([], [{"type": "text", "text": env}])) == \
        fingerprint("ns", (), to_messages([], env))
    other = to_messages([{"role": "system", "content": [
        {"type": "text", "text": env}, {"type": "image", "source": {}}]}])
    assert match_hash(other[0]) != match_hash(later[1])


def test_quoting_a_mark_in_text_is_text() -> None:
    """A message whose text names ``"cache_control"`` holds no mark: its match is its
    content hash, as for any other message."""
    msg = {"role": "user", "content": 'set "cache_control": {"type": "ephemeral"} on it'}
    assert match_hash(msg) == message_hash(msg) == prepare(msg).match  # type: ignore[arg-type]


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=6))
json_tree = st.recursive(
    json_leaf, lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.dictionaries(st.sampled_from(["type", "text", "content", "source", "input", "x"]),
                        kids, max_size=4)), max_leaves=24)


def _slow_unmarked(value: Any) -> Any:
    """The reference: every dict rebuilt without its mark, recursively."""
    if isinstance(value, dict):
        return {k: _slow_unmarked(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_slow_unmarked(v) for v in value]
    return value


def _dict_paths(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at] if isinstance(value, dict) else []
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else []
    for k, v in items:
        out += _dict_paths(v, (*at, k))
    return out


@settings(max_examples=300, deadline=None)
@given(json_tree, st.data())
def test_unmarked_is_the_tree_without_its_marks_and_leaves_the_input_alone(
        tree: Any, data: st.DataObject) -> None:
    """Marks set on any dicts of any tree (shared subtrees too) come out, nothing else does,
    and the input is not changed."""
    marked = copy.deepcopy(tree)
    paths = _dict_paths(marked)
    for path in data.draw(st.lists(st.sampled_from(paths), max_size=4)) if paths else []:
        marked = _mark(marked, path, data.draw(st.sampled_from([EPHEMERAL, HOUR])))
    before = copy.deepcopy(marked)
    out = unmarked(marked)
    assert out == _slow_unmarked(marked) == _slow_unmarked(tree)
    assert marked == before
    if "cache_control" not in orjson.dumps(marked).decode():
        assert out is marked  # nothing to take out: nothing copied
    shared = {"type": "text", "text": "t", "cache_control": EPHEMERAL}
    msg = {"role": "tool", "tool_call_id": "toolu_2", "content": [shared],
           "blocks": [{"type": "tool_result", "content": [shared]}]}
    assert unmarked(msg) == _slow_unmarked(msg)


# -- through the proxy, with the anthropic SDK ------------------------------------------------

BASH = {"name": "Bash", "description": "Run a shell command in the workspace.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                         "required": ["command"]}}
READ = {"name": "Read", "description": "Read a file.",
        "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                         "required": ["file_path"]}}


def _claude_code_like(turns: list[dict[str, Any]], tools_marked: bool) -> dict[str, Any]:
    """A request as Claude Code builds it: the system prompt in blocks, its last one marked
    for an hour; the tools, the last marked when ``tools_marked``; one mark on the newest
    block of the conversation (moved there on every request, taken off where it was)."""
    messages = copy.deepcopy(turns)
    last = messages[-1]
    if isinstance(last["content"], str):
        last["content"] = [{"type": "text", "text": last["content"]}]
    last["content"][-1]["cache_control"] = EPHEMERAL
    tools = [BASH, {**READ, "cache_control": HOUR} if tools_marked else READ]
    return {"system": [SYSTEM[0], {**SYSTEM[1], "cache_control": HOUR}], "tools": tools,
            "messages": messages}


def _agent(upstream: ScriptedUpstream, turn: int) -> None:
    """Each user turn: a Bash call, a Read call, then an answer."""
    upstream.push(
        {"content": f"Running the tests ({turn}).", "reasoning": f"turn {turn}: run them",
         "tool_calls": [{"id": f"toolu_01T{turn}bash", "name": "Bash",
                         "arguments": {"command": "pytest -q"}}]},
        {"content": "Reading the failing test.",
         "tool_calls": [{"id": f"toolu_01T{turn}read", "name": "Read",
                         "arguments": {"file_path": f"/home/dev/app/test_{turn}.py"}}]},
        {"content": f"Turn {turn}: fixed test_{turn}."})


@pytest.mark.parametrize("named", [True, False], ids=["claude-code-session", "fingerprint"])
def test_a_mark_moved_every_request_is_one_session_one_branch(
        make_proxy: Any, upstream: ScriptedUpstream, named: bool) -> None:
    """Six user turns of three requests each through the anthropic SDK, the mark moved to
    the newest block every time (and on the tools every other request): one session, one
    branch, every message stored once; and each request reaches the upstream with its marks
    where the client put them."""
    proxy = make_proxy(admin_key=ADMIN)
    session = "3f1b2c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"
    client = anthropic.Anthropic(base_url=proxy.base, api_key=KEY, max_retries=0,
                                 default_headers={"X-Claude-Code-Session-Id": session}
                                 if named else None)
    turns: list[dict[str, Any]] = []
    sent = 0
    for turn in range(6):
        _agent(upstream, turn)
        turns.append({"role": "user", "content": f"fix test_{turn}"})
        while True:
            body = _claude_code_like(turns, tools_marked=sent % 2 == 0)
            with client.messages.stream(model=MODEL, max_tokens=32000, **body) as stream:
                reply = stream.get_final_message()
            sent += 1
            forwarded = upstream.requests[-1]
            # the marks where the client put them: the system prompt's, the tools', and the
            # newest block's (the current turn goes as it came; past loops are reduced)
            assert forwarded["system"] == body["system"]
            assert forwarded["messages"][-1] == body["messages"][-1]
            last = (2, len(forwarded["messages"]) - 1)
            assert marks(forwarded) == [m for m in marks(body) if m[0] < 2] + [
                (*last, len(body["messages"][-1]["content"]) - 1, None)]
            blocks = [b.model_dump(exclude_none=True) for b in reply.content]
            turns.append({"role": "assistant", "content": blocks})
            calls = [b for b in blocks if b["type"] == "tool_use"]
            if not calls:
                break
            turns.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": c["id"],
                 "content": f"output of {c['name']} #{sent}"} for c in calls]})
    assert sent == 18
    proxy.settle()
    auth = {"Authorization": f"Bearer {ADMIN}"}
    listed = httpx.get(f"{proxy.base}/admin/sessions", headers=auth,
                       params={"tenant": TENANT}).json()["sessions"]
    assert len(listed) == 1, listed
    view = httpx.get(f"{proxy.base}/admin/sessions/{listed[0]['session_id']}", headers=auth,
                     params={"messages": "1", "tenant": TENANT}).json()
    assert len(view["branches"]) == 1, view["branches"]
    # the system prompt, then each turn's question, three replies and two results
    assert [m["role"] for m in view["messages"]] == ["system"] + [
        "user", "assistant", "tool", "assistant", "tool", "assistant"] * 6
