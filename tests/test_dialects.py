"""Every translation and relay against what other servers really send (``tests/dialects.py``):
their errors (a prompt too long above all: Claude Code compacts only when the bridge says
"prompt is too long"), their stream ends, usage fields, finish reasons and tool-call shapes."""

from __future__ import annotations

import collections
import contextlib
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from runloop_proxy.api.bridge import BridgeWire, anthropic_error
from runloop_proxy.scripted import ScriptedUpstream
from runloop_proxy.windows import overflow_limit

from .conftest import ProxyServer
from .dialects import BASH, GREP, NOT_OVERFLOWS, OVERFLOWS, STREAMS, ErrorRow
from .keys import ANTHROPIC_MODEL, OPENAI_MODEL, openai_project_key

KEY = openai_project_key(39)
ROWS = OVERFLOWS + NOT_OVERFLOWS


def expected_message(row: ErrorRow, words: str) -> str:
    if not row.overflow:
        return words
    if words.startswith("prompt is too long"):
        return words
    if row.needed is not None:
        return f"prompt is too long: {row.needed} tokens > {row.allowed} maximum. {words}"
    return f"prompt is too long: {words}"


def words_of(row: ErrorRow) -> str:
    data = orjson.loads(row.body)
    data = data[0] if isinstance(data, list) else data
    err = data.get("error")
    return str(err["message"] if isinstance(err, dict) else err if isinstance(err, str)
               else data["message"])


@pytest.mark.parametrize("row", ROWS, ids=[r.server for r in ROWS])
def test_every_servers_error_is_anthropics_and_an_overflow_says_prompt_is_too_long(
        row: ErrorRow) -> None:
    """The exact answer the bridge gives for each server's error body, its sizes read from
    whichever words or fields the server used. Bug class: an overflow recognised in one
    server's words only (Claude Code never compacts behind vLLM, llama.cpp, Ollama...).
    Planted: the recognition back to OpenAI's ``context_length_exceeded``/"context length"
    (red for llama.cpp, Mistral's sizes, TGI, Gemini, Bedrock); second: the top-level fields
    (vLLM before 0.6, Mistral) not read, the message the raw body."""
    status, body = BridgeWire().upstream_error(row.status, row.body)
    kind = "invalid_request_error" if row.overflow or row.status in (400, 422) else {
        429: "rate_limit_error", 404: "not_found_error", 503: "overloaded_error",
        500: "api_error"}[row.status]
    want = {"type": "error", "error": {"type": kind,
                                       "message": expected_message(row, words_of(row))}}
    assert orjson.loads(body) == want
    assert anthropic_error(row.status, row.body) == want
    assert status == (400 if row.overflow else row.status)


def bridge(make_proxy: Any) -> ProxyServer:
    return make_proxy(upstream_format="chat")  # type: ignore[no-any-return]


def test_claude_code_sees_every_servers_overflow_through_the_bridge(
        make_proxy: Any, upstream: ScriptedUpstream) -> None:
    """Through real servers, the anthropic SDK (Claude Code's) against a bridge whose chat
    upstream answers each server's error: an overflow is a 400 ``invalid_request_error``
    whose message starts "prompt is too long", JSON and streamed alike; anything else keeps
    its status and words. Bug class and plants as above; a third: the overflow's status left
    the server's (TGI's 422 reached Claude Code as a 422)."""
    proxy = bridge(make_proxy)
    client = anthropic.Anthropic(base_url=proxy.base, api_key=KEY, max_retries=0)
    ask: Any = [{"role": "user", "content": "refactor the parser"}]
    for row in ROWS:
        for stream in (False, True):
            # the proxy retries a 429 and a 5xx, and an overflow in the window it names
            upstream.push(*[{"status": row.status, "body": orjson.loads(row.body),
                             "headers": {"retry-after": "0"}}] * 4)
            with pytest.raises(anthropic.APIStatusError) as raised:
                if stream:
                    with client.messages.stream(model=ANTHROPIC_MODEL, max_tokens=2048,
                                                messages=ask) as s:
                        s.get_final_message()
                else:
                    client.messages.create(model=ANTHROPIC_MODEL, max_tokens=2048,
                                           messages=ask)
            upstream.script.clear()
            err = raised.value
            message = err.body["error"]["message"]  # type: ignore[index]
            assert message == expected_message(row, words_of(row)), (row.server, stream)
            assert err.status_code == (400 if row.overflow else row.status), row.server
            if row.overflow:
                assert isinstance(err, anthropic.BadRequestError), row.server


def test_every_servers_error_reaches_a_chat_client_as_the_server_sent_it(
        proxy: ProxyServer, upstream: ScriptedUpstream) -> None:
    """The chat relay passes each server's error through: its status, its body byte for
    byte (an OpenAI client reads vLLM's or llama.cpp's fields as it would direct). Bug class:
    a relay that rebuilds what it passes on. Planted: the body re-encoded from its parse
    (key order, a list unwrapped); second: a 422 answered as a 502."""
    for row in ROWS:
        upstream.push(*[{"status": row.status, "body": orjson.loads(row.body),
                         "headers": {"retry-after": "0"}}] * 4)  # retried, as above
        r = httpx.post(proxy.url + "/chat/completions", timeout=30,
                       headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": OPENAI_MODEL, "messages": [
                           {"role": "user", "content": "refactor the parser"}]})
        upstream.script.clear()
        assert r.status_code == row.status, row.server
        assert r.content == row.body, row.server  # the scripted upstream sends these bytes


@pytest.mark.parametrize("row", ROWS, ids=[r.server for r in ROWS])
def test_the_window_the_proxy_learns_from_each_servers_error(row: ErrorRow) -> None:
    """What the proxy learns of a model's window from the same errors (``windows``): the
    size each overflow names, nothing from an error that is not one. Bug class as above, on
    the learning side. Planted: llama.cpp's ``n_ctx`` pattern dropped; second: the statuses
    not checked (a 429's "Limit 30000" learned as a window)."""
    learned = overflow_limit(row.status, row.body)
    if not row.overflow:
        assert learned is None
    elif row.allowed is not None:
        assert learned == row.allowed


STREAM_IDS = [r.server for r in STREAMS]


def test_every_servers_stream_through_the_bridge(make_proxy: Any, upstream: ScriptedUpstream
                                                 ) -> None:
    """Each server's stream (its ends, usage fields, finish reasons, tool-call shapes) through
    the bridge to the anthropic SDK: the text, the calls (each with an id of its own, the
    arguments whole), the stop reason. Bug class: a translation that knows one server's
    stream. Planted: a finish reason other than tool_calls with calls named end_turn (red
    for Ollama's "stop"); second: a call with no id passed on with an empty one (red before
    ``bridge_stream.tool_use`` made one: a bug this table found)."""
    proxy = bridge(make_proxy)
    client = anthropic.Anthropic(base_url=proxy.base, api_key=KEY, max_retries=0)
    for row in STREAMS:
        upstream.push({"raw_chunks": row.chunks})
        ask: Any = [{"role": "user", "content": "fix the parser"}]
        if row.cut:
            with pytest.raises(anthropic.APIStatusError, match="ended before its answer"), \
                    client.messages.stream(model=ANTHROPIC_MODEL, max_tokens=2048,
                                           messages=ask) as s:
                s.get_final_message()
            continue
        with client.messages.stream(model=ANTHROPIC_MODEL, max_tokens=2048,
                                    messages=ask) as s:
            final = s.get_final_message()
        upstream.script.clear()
        text = "".join(b.text for b in final.content if b.type == "text")
        uses = [b for b in final.content if b.type == "tool_use"]
        assert (text, [(u.name, u.input) for u in uses]) == (row.text, row.calls), row.server
        assert all(u.id for u in uses) and len({u.id for u in uses}) == len(uses), row.server
        assert final.stop_reason == row.stop_reason, row.server


def test_every_servers_stream_reaches_a_chat_client_whole(proxy: ProxyServer,
                                                          upstream: ScriptedUpstream) -> None:
    """Each server's stream through the chat relay to the openai SDK: the text, the calls'
    names and arguments, the finish reason, as the server sent them. Bug class: a relay that
    drops what it does not expect (a chunk of no choices, a comment, a field beside the
    choices). Planted: chunks without choices dropped (Azure's filter chunk); second:
    llama.cpp's ``timings`` stripped beside its usage. A stream with no end marker is cut
    (the proxy never takes an answer as whole without it): its text arrives, then the
    error, and its held end never does."""
    client = openai.OpenAI(base_url=proxy.url, api_key=KEY, max_retries=0)
    # the client's tools: the proxy's ride beside them, so the stream is read and rewritten
    tools: Any = [{"type": "function", "function": {
        "name": name, "parameters": {"type": "object", "properties": {
            k: {"type": "string"} for k in args}}}} for name, args in (BASH, GREP)]
    for row in STREAMS:
        upstream.push({"raw_chunks": row.chunks})
        chunks: list[Any] = []
        with contextlib.ExitStack() as cut:
            if row.cut:  # the text reaches the client, then the error
                cut.enter_context(pytest.raises(openai.APIError, match="ended before"))
            chunks += client.chat.completions.create(
                model=OPENAI_MODEL, stream=True, tools=tools,
                messages=[{"role": "user", "content": "fix the parser"}])
        upstream.script.clear()
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        names, args = [], collections.defaultdict(str)
        for c in chunks:
            for choice in c.choices:
                for t in choice.delta.tool_calls or []:
                    if t.function and t.function.name:
                        names.append(t.function.name)
                    if t.function and t.function.arguments:
                        args[t.index] += t.function.arguments
        assert text == row.text, row.server
        assert names == [n for n, _ in row.calls], row.server
        assert [orjson.loads(a) for _, a in sorted(args.items())] == \
            [a for _, a in row.calls], row.server
        finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
        # a cut stream's end is held back (it never came): no finish reason reaches the client
        assert finishes == ([row.finish] if row.finish and not row.cut else []), row.server
        # what rides beside the choices reaches the client too (Azure's filter results)
        extras = [{k: v for k, v in (c.model_extra or {}).items()} for c in chunks]
        sent = [{k: v for k, v in e.items() if k in ("prompt_filter_results", "timings")}
                for e in _events(row.chunks)]
        assert [e for e in sent if e] == [
            {k: v for k, v in e.items() if k in ("prompt_filter_results", "timings")}
            for e in extras if set(e) & {"prompt_filter_results", "timings"}], row.server


def _events(chunks: list[bytes]) -> list[dict[str, Any]]:
    raw = b"".join(chunks).replace(b"\r\n", b"\n")
    return [orjson.loads(line[5:]) for line in raw.split(b"\n")
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"]
