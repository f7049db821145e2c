"""What a request names of what an upstream account stores, found by construction (any field
at any depth whose name or shape names a stored object), checked against every id field of
OpenAI's request schemas (tests/data/stored_references.json, made from the OpenAPI spec by
tests/data/extract_references.py) and Anthropic's Messages types; and the 403 a caller on a
shared upstream key gets for one, on every API, the socket, count_tokens and pass-through."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

from runloop_proxy.api.routes import body_references
from runloop_proxy.pipeline.references import stored_references
from runloop_proxy.scripted import ScriptedUpstream

from .conftest import ProxyServer
from .keys import anthropic_key, openai_project_key
from .work import lines

ROWS: list[dict[str, Any]] = json.loads(
    (Path(__file__).parent / "data" / "stored_references.json").read_text())
FILE = "file-8Hq2xV3Mz1Rk7TcW5bNp9Y"
CLAUDE_FILE = "file_011CNha8iCJcU1wXNR6q4V8w"
MODEL = "gpt-4o-2024-08-06"
CLAUDE = "claude-sonnet-4-6"
TOOLU = "toolu_01A09q90qw90lq917835lq9"


def test_the_spec_extraction_covers_every_api_and_both_kinds() -> None:
    by = {(r["endpoint"], r["stored"]) for r in ROWS}
    for endpoint in ("/chat/completions", "/responses", "/responses/input_tokens"):
        assert (endpoint, True) in by and (endpoint, False) in by
    assert ("/images/edits", True) in by
    assert len([r for r in ROWS if r["stored"]]) >= 90


@pytest.mark.parametrize("row", ROWS, ids=[f"{r['endpoint']}:{r['field']}:{i}"
                                           for i, r in enumerate(ROWS)])
def test_every_id_field_of_openais_requests_is_judged_as_the_spec_says(
        row: dict[str, Any]) -> None:
    """Bug class: a field naming a stored object that the walk does not know (a file in a
    Responses tool's nested configuration, a custom voice, a previous audio answer, an item
    given by its id alone), or an id the client owns taken for one (a tool call's, an
    output item's: every agent's second turn refused). Each row is the smallest body of its
    endpoint with one id field of the spec, at its real depth. Red with the walk stopping
    at ``content`` / ``tools`` as the old one did (25 rows), with ``*_ids`` lists left out,
    with ``call_id`` not in the client's ids, and with an object of an id alone not read."""
    found = stored_references(row["body"])
    assert bool(found) is row["stored"], (row["description"], found)


def _merged(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One body holding every row's fields: lists joined, the first value of the rest."""
    out: dict[str, Any] = {"model": MODEL}
    for row in rows:
        for k, v in copy.deepcopy(row["body"]).items():
            if isinstance(v, list) and isinstance(out.get(k), list):
                out[k] = out[k] + v
            else:
                out.setdefault(k, v)
    return out


OWNED = [r for r in ROWS if not r["stored"] and r["endpoint"] == "/responses"]
STORED = [r for r in ROWS if r["stored"] and r["endpoint"] == "/responses"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(OWNED), max_size=12),
       st.lists(st.sampled_from(STORED), max_size=2))
def test_a_body_names_a_stored_object_exactly_when_a_field_of_it_does(
        owned: list[dict[str, Any]], stored: list[dict[str, Any]]) -> None:
    """Any mix of the spec's fields in one Responses body: refused exactly when one of them
    names a stored object, whatever the client-owned ids around it."""
    body = _merged(owned + stored)
    assert bool(stored_references(body)) is any(
        bool(stored_references(_merged([r]))) for r in owned + stored)
    if stored:
        assert stored_references(body)


# Anthropic's Messages request types (anthropic-sdk-python, src/anthropic/types): every place
# one names an object the account keeps (the Files API's files, a code execution container,
# a custom skill, a memory store) and every id the client owns
def _user(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"model": CLAUDE, "max_tokens": 1024, "messages": [{"role": "user",
                                                               "content": list(blocks)}]}


ANTHROPIC_STORED = {
    "image source file": _user({"type": "image", "source": {"type": "file",
                                                             "file_id": CLAUDE_FILE}}),
    "document source file": _user({"type": "document", "title": "q3.pdf", "source": {
        "type": "file", "file_id": CLAUDE_FILE}, "citations": {"enabled": True}}),
    "container upload": _user({"type": "container_upload", "file_id": CLAUDE_FILE}),
    "tool result's document": {**_user(), "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": TOOLU,
                                           "name": "fetch", "input": {"url": "u"}}]},
        {"role": "user", "content": [{"type": "tool_result",
                                      "tool_use_id": "toolu_01A09q90qw90lq917835lq9",
                                      "content": [{"type": "document", "source": {
                                          "type": "file", "file_id": CLAUDE_FILE}}]}]}]},
    "container by id": {**_user({"type": "text", "text": "go on"}),
                        "container": "container_011CNha8iCJcU1wXNR6q4V8w"},
    "container object": {**_user({"type": "text", "text": "go on"}),
                         "container": {"id": "container_011CNha8iCJcU1wXNR6q4V8w"}},
    "custom skill": {**_user({"type": "text", "text": "deck"}), "container": {"skills": [
        {"type": "custom", "skill_id": "skill_01AbCdEfGhIjKlMnOpQrStUv", "version": "latest"}]}},
    "memory store": {**_user({"type": "text", "text": "x"}), "context_management": {
        "edits": [{"type": "dream", "memory_store_id": "memstore_01AbCdEfGhIjKl"}]}},
    "fine-tuned model": {"model": "ft:gpt-4o-mini-2024-07-18:acme:support:9kLmN2pQ",
                         "messages": [{"role": "user", "content": "hi"}]},
}
ANTHROPIC_OWNED = {
    "tool use and result": {**_user(), "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": TOOLU,
                                           "name": "weather", "input": {
                                               "file_id": "not-a-reference", "run_id": "r1"}}]},
        {"role": "user", "content": [{"type": "tool_result",
                                      "tool_use_id": "toolu_01A09q90qw90lq917835lq9",
                                      "content": "sunny"}]}]},
    "server tool caller": {**_user(), "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_01B", "name": "bash", "input": {},
         "caller": {"type": "code_execution_20260120", "tool_id": "srvtoolu_01C"}}]}]},
    "inline sources": _user({"type": "image", "source": {"type": "base64", "media_type":
                                                          "image/png", "data": "iVBORw0KGgo="}},
                            {"type": "document", "source": {"type": "url",
                                                            "url": "https://x.test/a.pdf"}},
                            {"type": "document", "source": {"type": "text", "media_type":
                                                            "text/plain", "data": "notes"}}),
    "metadata user": {**_user({"type": "text", "text": "hi"}),
                      "metadata": {"user_id": "user_2f8a9c_account_7d1e_session_0b3c"}},
    "anthropic's own skill": {**_user({"type": "text", "text": "deck"}), "container": {
        "skills": [{"type": "anthropic", "skill_id": "pptx", "version": "latest"}]}},
    "tool schema naming ids": {**_user({"type": "text", "text": "x"}), "tools": [
        {"name": "read", "description": "reads", "input_schema": {
            "type": "object", "properties": {"file_id": {"type": "string"},
                                             "vector_store_ids": {"type": "array"}}}}]},
    "chat call arguments as an object": {"model": MODEL, "messages": [
        {"role": "assistant", "tool_calls": [{"id": "call_Xk2m9QpR4vT7wY1zA3bC5dE8",
                                              "type": "function", "function": {
                                                  "name": "f", "arguments": {"file_id": "x"}}}]},
        {"role": "tool", "tool_call_id": "call_Xk2m9QpR4vT7wY1zA3bC5dE8", "content": "ok"}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "r", "schema": {"properties": {"thread_id": {"type": "string"}}}}}},
    "local shell's environment": {"model": MODEL, "input": [
        {"type": "local_shell_call", "id": "lsh_68f1", "call_id": "call_Bd7f9Hj1",
         "status": "completed", "action": {"type": "exec", "command": ["env"],
                                           "env": {"run_id": "nightly", "file_id": "f"}}}]},
}


@pytest.mark.parametrize("name", list(ANTHROPIC_STORED))
def test_every_place_anthropics_types_name_a_stored_object(name: str) -> None:
    assert stored_references(ANTHROPIC_STORED[name])


@pytest.mark.parametrize("name", list(ANTHROPIC_OWNED))
def test_what_the_client_owns_names_nothing_stored(name: str) -> None:
    """Red with a tool's input read (an agent calling its own ``file_id`` argument refused)
    and with Anthropic's built-in skills taken for an account's."""
    assert stored_references(ANTHROPIC_OWNED[name]) == []


def test_the_walk_is_linear_in_the_body() -> None:
    """The walk runs on a shared tenant's every request: lines of Python run grow with the
    body's items, not faster (a path string re-joined per level, a list re-scanned per
    block, would not be)."""
    def body(n: int) -> dict[str, Any]:
        turn = {"role": "user", "content": [{"type": "text", "text": "t"},
                                            {"type": "input_file", "file_url": "u"}]}
        nested: dict[str, Any] = {"role": "user", "content": "x"}
        for _ in range(n // 8):
            nested = {"type": "message", "content": [nested]}
        return {"model": MODEL, "input": [copy.deepcopy(turn) for _ in range(n)] + [nested]}
    _, small = lines(stored_references, body(200))
    _, large = lines(stored_references, body(800))
    assert large <= 4.4 * small, (small, large)


@pytest.mark.parametrize(("content_type", "encoding", "raw", "named"), [
    ("application/json", "", orjson.dumps({"model": MODEL, "images": [{"file_id": FILE}],
                                           "prompt": "add a hat"}), True),
    ("application/json", "gzip", gzip.compress(orjson.dumps({"input": [
        {"role": "user", "content": [{"type": "input_file", "file_id": FILE}]}]})), True),
    ("application/json", "gzip", gzip.compress(orjson.dumps({"input": "hi"})), False),
    ("application/json", "br", b"\x0b\x02\x80{}\x03", True),
    ("application/x-www-form-urlencoded", "", b"model=m&images%5B0%5D%5Bfile_id%5D=" +
     FILE.encode(), True),
    ("multipart/form-data; boundary=b0undary", "",
     b'--b0undary\r\nContent-Disposition: form-data; name="mask[file_id]"\r\n\r\n'
     + FILE.encode() + b'\r\n--b0undary--\r\n', True),
    ("multipart/form-data; boundary=b0undary", "",
     b'--b0undary\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
     b'RIFF....WAVE\r\n--b0undary--\r\n', False),
    ("audio/wav", "", b"RIFF\x24\x00\x00\x00WAVEfmt ", False),
])
def test_a_pass_through_body_is_read_as_the_upstream_reads_it(
        content_type: str, encoding: str, raw: bytes, named: bool) -> None:
    """Red with the encoded body read as it came (the gzip reference passed) and with
    forms' bracketed names taken whole."""
    assert bool(body_references(content_type, encoding, raw, 1 << 20)) is named
    assert body_references("application/json", "gzip",
                           gzip.compress(b'{"input": "' + b"a" * 5000 + b'"}'), 1000) \
        == ["an encoded body"]  # inflated past the limit: refused, not read in part


# -- through the proxy ------------------------------------------------------------------------

SHARED = "shared-proxy-key-5b7e0c1a93d2"
OTHER = "other-proxy-key-9e2d4f6a18c0"
OWN = "own-proxy-key-3a8c1e5f70b4"


@pytest.fixture
def proxy(tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream) -> ProxyServer:
    """Two tenants on the operator's key for each format (so it is shared), one with its
    own; count_tokens asks the upstream."""
    root = tmp_path / "cfg"
    (root / "tenants").mkdir(parents=True)
    (root / "runloop.toml").write_text(
        f'[upstreams.main]\nurl = "{upstream.url}"\napi_key = "{openai_project_key(50)}"\n'
        f'max_retries = 0\n[upstreams.claude]\nurl = "{upstream.url}"\nformat = "anthropic"\n'
        f'api_key = "{anthropic_key(50)}"\nmax_retries = 0\n[defaults]\nupstream = "main"\n'
        f'[defaults.policy]\ncount_tokens = "upstream"\n')
    for name, key, extra in [("s", SHARED, ""), ("o", OTHER, ""),
                             ("own", OWN, f'upstream_key = "{openai_project_key(51)}"\n'),
                             ("cs", SHARED + "-c", 'upstream = "claude"\n'),
                             ("co", OTHER + "-c", 'upstream = "claude"\n')]:
        (root / "tenants" / f"{name}.toml").write_text(f'keys = ["{key}"]\n{extra}')
    return make_proxy(config_dir=str(root))  # type: ignore[no-any-return]


def _first(endpoint: str, field: str) -> dict[str, Any]:
    return next(r["body"] for r in ROWS if r["endpoint"] == endpoint and r["field"] == field
                and r["stored"])


HTTP = [  # (path, body, the error's shape)
    ("/v1/chat/completions", {**_first("/chat/completions", "audio.voice.id"), "messages": [
        {"role": "user", "content": "say it"}], "model": MODEL}, "openai"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "again"},
        {"role": "assistant", "audio": {"id": "audio_68f1c2a9d3e48191"}}]}, "openai"),
    ("/v1/responses", {**_first("/responses", "tools.environment.skills.skill_id"),
                       "model": MODEL, "input": "run it"}, "openai"),
    ("/v1/responses", {**_first("/responses", "tools.input_image_mask.file_id"),
                       "model": MODEL, "input": "paint"}, "openai"),
    ("/v1/responses", {"model": MODEL, "input": [
        {"role": "user", "content": "the report?"},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "see q3.pdf", "annotations": [
                {"type": "file_citation", "file_id": FILE, "filename": "q3.pdf",
                 "index": 3}]}]},
        {"role": "user", "content": "quote it"}]}, "openai"),
    ("/v1/messages", ANTHROPIC_STORED["document source file"], "anthropic"),
    ("/v1/messages", ANTHROPIC_STORED["custom skill"], "anthropic"),
    ("/v1/messages/count_tokens", {k: v for k, v in ANTHROPIC_STORED["image source file"]
                                   .items() if k != "max_tokens"}, "anthropic"),
    ("/v1/responses/input_tokens", {"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_file", "file_id": FILE}]}]}, "openai"),
    ("/v1/images/edits", {"model": "gpt-image-1", "prompt": "a hat",
                          "images": [{"file_id": FILE}]}, "openai"),
]


@pytest.mark.parametrize(("path", "body", "shape"), HTTP,
                         ids=[f"{p}:{i}" for i, (p, _, _) in enumerate(HTTP)])
def test_a_shared_key_sends_nothing_that_names_a_stored_object(
        proxy: ProxyServer, upstream: ScriptedUpstream, path: str, body: dict[str, Any],
        shape: str) -> None:
    """Bug class: a reference a shared-key tenant's request carries to the upstream (one
    tenant has the model read another's file). Found where the old walk never looked, on
    each API, count_tokens and the pass-through endpoints that take a body: a 403 in the
    API's error shape before anything is sent. Red with the pass-through's bodies unread
    and with count_tokens forwarded unchecked."""
    claude = path.startswith("/v1/messages")
    key = SHARED + "-c" if claude else SHARED
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"} if claude \
        else {"Authorization": f"Bearer {key}"}
    r = httpx.post(proxy.base + path, json=body, headers=headers)
    assert r.status_code == 403, r.text
    if shape == "anthropic":
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "permission_error"
    else:
        assert r.json()["error"]["type"] == "permission_error"
    assert "upstream_key" in r.text and FILE not in r.text
    assert upstream.requests == [] and upstream.other == []


def test_a_shared_key_sends_its_plain_turns_and_an_own_key_its_references(
        proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    """The same bodies from a tenant with its own key go upstream as they came; a shared
    tenant's agent turns, tool calls answered, reach the upstream (nothing refused that
    names nothing)."""
    body = HTTP[5][1]
    r = httpx.post(proxy.base + "/v1/images/edits", json=HTTP[-1][1],
                   headers={"Authorization": f"Bearer {OWN}"})
    assert r.status_code == 404 and upstream.other[-1][1] == "/v1/images/edits"
    c = anthropic.Anthropic(base_url=proxy.base, api_key=SHARED + "-c", max_retries=0)
    reply = c.messages.create(**ANTHROPIC_OWNED["tool use and result"])  # type: ignore[arg-type]
    assert reply.content[0].type == "text"
    assert upstream.requests[-1]["messages"][-1]["content"][0]["tool_use_id"] \
        == "toolu_01A09q90qw90lq917835lq9"
    r = httpx.post(proxy.base + "/v1/responses", headers={"Authorization": f"Bearer {SHARED}"},
                   json={"model": MODEL, "input": [
                       {"type": "function_call", "id": "fc_68f1c2a9", "call_id": "call_Xk2m9Q",
                        "name": "f", "arguments": '{"file_id": "mine"}'},
                       {"type": "function_call_output", "call_id": "call_Xk2m9Q",
                        "output": "done"}]})
    assert r.status_code == 200, r.text
    assert body["messages"]  # (the refused body, for the record)


def test_a_socket_turn_names_no_stored_object_on_a_shared_key(
        proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    """The WebSocket path: a ``response.create`` naming a vector store in a tool's nested
    configuration is a 403 error event, and the socket goes on serving."""
    url = proxy.base.replace("http://", "ws://") + "/v1/responses"
    with connect(url, additional_headers={"Authorization": f"Bearer {SHARED}"}) as ws:
        ws.send(orjson.dumps({"type": "response.create", "model": MODEL, "input": "find it",
                              "tools": [{"type": "file_search",
                                         "vector_store_ids": ["vs_68f1c2a9d3e4"]}]}).decode())
        err = orjson.loads(ws.recv(timeout=30))
        assert err["type"] == "error" and err["status"] == 403, err
        assert err["error"]["type"] == "permission_error"
        ws.send(orjson.dumps({"type": "response.create", "model": MODEL,
                              "input": "plain"}).decode())
        events = []
        while not events or events[-1]["type"] not in ("response.completed", "error"):
            events.append(orjson.loads(ws.recv(timeout=30)))
        assert events[-1]["type"] == "response.completed"
    assert len(upstream.requests) == 1 and "tools" not in upstream.requests[0]
