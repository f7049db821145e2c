"""The scripted upstream's world: a latency per call kind, ids shaped like the providers'.

The other tests lean on these: a background call slower than the gap between requests, or a
deadline armed from the wrong setting, shows only if the upstream takes the time it was told
to for that kind of call and no other; a proxy that mangles a real id (length, alphabet,
prefix) shows only if the upstream hands out real-shaped ones."""

from __future__ import annotations

import re
import time
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from runloop_proxy.history.summaries import APPEND, MERGE, SECTIONS
from runloop_proxy.scripted import ScriptedUpstream
from runloop_proxy.scripted_world import Latency, is_summary_call, provider_id

from .keys import ANTHROPIC_MODEL, OPENAI_MODEL, anthropic_key, openai_project_key

SHAPES = {
    "chat completion": r"chatcmpl-[0-9A-Za-z]{29}",
    "chat tool call": r"call_[0-9A-Za-z]{24}",
    "response": r"resp_[0-9a-f]{48}",
    "response message": r"msg_[0-9a-f]{48}",
    "response function call": r"fc_[0-9a-f]{48}",
    "response reasoning": r"rs_[0-9a-f]{48}",
    "anthropic message": r"msg_01[0-9A-Za-z]{22}",
    "anthropic tool use": r"toolu_01[0-9A-Za-z]{22}",
    "system fingerprint": r"fp_[0-9a-f]{10}",
}
# distinct from one another (and from every other figure here): a wait taken from the wrong
# kind shows in the record
LATENCY = Latency(first_byte=0.037, between_events=0.0043, summary=0.211, count_tokens=0.0191)
CALL = {"name": "lookup_order", "arguments": {"order_id": "#W5310481"}}


def shaped(kind: str, value: Any) -> None:
    assert isinstance(value, str) and re.fullmatch(SHAPES[kind], value), (kind, value)


def oai(upstream: ScriptedUpstream) -> openai.OpenAI:
    return openai.OpenAI(base_url=upstream.url, api_key=openai_project_key(3), max_retries=0)


def claude(upstream: ScriptedUpstream) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=upstream.url.removesuffix("/v1"),
                               api_key=anthropic_key(3), max_retries=0)


def test_chat_answers_carry_ids_shaped_like_openais(upstream: ScriptedUpstream) -> None:
    """Bug class: the fixture's ids not shaped like the provider's (a proxy that cuts an id
    to 32 characters, or keys a map by its numeric tail, passes against ``chatcmpl-7``).
    Planted: chat completion ids back to ``chatcmpl-<n>``; second: the stream's tool call
    ids back to ``call_<n>``."""
    upstream.push({"content": "Order #W5310481 shipped.", "tool_calls": [CALL]},
                  {"content": "Order #W5310481 shipped.", "tool_calls": [CALL, CALL]})
    messages: Any = [{"role": "user", "content": "where is #W5310481?"}]
    answer = oai(upstream).chat.completions.create(model=OPENAI_MODEL, messages=messages)
    shaped("chat completion", answer.id)
    shaped("system fingerprint", answer.system_fingerprint)
    assert answer.model == OPENAI_MODEL
    calls = answer.choices[0].message.tool_calls or []
    assert len(calls) == 1
    shaped("chat tool call", calls[0].id)
    stream = list(oai(upstream).chat.completions.create(model=OPENAI_MODEL, messages=messages,
                                                        stream=True))
    assert {c.id for c in stream} != {answer.id} and len({c.id for c in stream}) == 1
    shaped("chat completion", stream[0].id)
    ids = [t.id for c in stream for ch in c.choices for t in ch.delta.tool_calls or [] if t.id]
    assert len(ids) == 2 and len(set(ids)) == 2
    for i in ids:
        shaped("chat tool call", i)


def test_responses_answers_carry_ids_shaped_like_openais(upstream: ScriptedUpstream) -> None:
    """Bug class as above, for the Responses API. Planted: the response id back to
    ``resp_<n>``; second: the output message's id back to ``msg_<n>``."""
    upstream.push({"content": "It shipped.", "reasoning": "gAAAAABo-opaque", "tool_calls": [CALL]})
    answer = oai(upstream).responses.create(model=OPENAI_MODEL, input="where is #W5310481?")
    shaped("response", answer.id)
    kinds = {item.type: item for item in answer.output}
    shaped("response reasoning", kinds["reasoning"].id)
    shaped("response message", kinds["message"].id)
    call: Any = kinds["function_call"]
    shaped("response function call", call.id)
    shaped("chat tool call", call.call_id)
    assert len({item.id for item in answer.output}) == 3


def test_messages_answers_carry_ids_shaped_like_anthropics(upstream: ScriptedUpstream) -> None:
    """Bug class as above, for the Messages API. Planted: ``msg_%06d`` again; second:
    ``toolu_%04d`` again."""
    upstream.push({"content": "It shipped.", "tool_calls": [CALL]},
                  {"content": "It shipped.", "tool_calls": [CALL]})
    ask: Any = [{"role": "user", "content": "where is #W5310481?"}]
    answer = claude(upstream).messages.create(model=ANTHROPIC_MODEL, max_tokens=1024,
                                              messages=ask)
    shaped("anthropic message", answer.id)
    use: Any = answer.content[1]
    shaped("anthropic tool use", use.id)
    with claude(upstream).messages.stream(model=ANTHROPIC_MODEL, max_tokens=1024,
                                          messages=ask) as stream:
        final = stream.get_final_message()
    shaped("anthropic message", final.id)
    streamed: Any = final.content[1]
    shaped("anthropic tool use", streamed.id)
    assert final.id != answer.id and streamed.id != use.id


def test_provider_ids_are_distinct_and_keep_their_alphabet() -> None:
    """Bug class: an id generator that repeats or leaves its alphabet. Planted: the digest
    of the prefix alone (every id the same); second: ``length`` counted with the prefix."""
    drawn = [provider_id("call_", 24) for _ in range(2000)]
    assert len(set(drawn)) == 2000
    assert all(re.fullmatch(r"call_[0-9A-Za-z]{24}", d) for d in drawn)
    long = provider_id("x_", 300, "ab")  # longer than one digest
    assert len(long) == 302 and set(long[2:]) == {"a", "b"}


def _summary_body(template: str) -> dict[str, Any]:
    prompt = template.format(max_tokens=812, sections=SECTIONS, previous="(none)",
                             turns="user: where is #W5310481?")
    return {"model": "gpt-4.1-mini-2025-04-14", "max_tokens": 812,
            "messages": [{"role": "user", "content": prompt}]}


@pytest.mark.parametrize("body, summary", [
    (_summary_body(APPEND), True),
    (_summary_body(MERGE), True),
    # the prompt quoted by a user, after another message: a conversation, not a summary call
    ({"messages": [{"role": "system", "content": "You help."},
                   _summary_body(APPEND)["messages"][0]]}, False),
    ({"messages": [{"role": "user", "content": "You maintain the running"}]}, False),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, False),
    ({"input": "You maintain the running summary of an agent conversation"}, False),
    ({"messages": "not a list"}, False),
])
def test_summary_calls_are_told_from_conversations(body: dict[str, Any], summary: bool) -> None:
    """Bug class: a call kind told wrongly (the summary latency on every call, or on none).
    Planted: any single user message counted a summary call; second: only MERGE's opening
    known (APPEND's calls waited as conversations)."""
    assert is_summary_call(body) is summary


def _events(raw: bytes) -> int:
    return raw.count(b"\n\n")


def test_each_call_kind_waits_its_own_latency(upstream: ScriptedUpstream) -> None:
    """Bug class: a latency applied to the wrong kind of call (or to every event but the
    ones of one API). Planted: the summary's wait taken for every call; second: the Messages
    stream not paced between its events (its count of between-events pauses short)."""
    upstream.latency = LATENCY
    ask = {"model": OPENAI_MODEL, "messages": [{"role": "user", "content": "hello there"}]}
    with httpx.Client(base_url=upstream.url, timeout=30) as c:
        started = time.monotonic()
        assert c.post("/chat/completions", json=ask).status_code == 200
        json_took = time.monotonic() - started
        assert upstream.pauses.of("first_byte") == [LATENCY.first_byte]
        assert upstream.pauses.of("between_events") == []

        upstream.push({"content": "Goals: track #W5310481."})
        started = time.monotonic()
        assert c.post("/chat/completions", json=_summary_body(MERGE)).json()[
            "choices"][0]["message"]["content"] == "Goals: track #W5310481."
        summary_took = time.monotonic() - started
        assert upstream.pauses.of("summary") == [LATENCY.summary]
        assert upstream.pauses.of("first_byte") == [LATENCY.first_byte]

        upstream.push({"content": "a streamed answer of some length", "tool_calls": [CALL]})
        chat = c.post("/chat/completions", json={**ask, "stream": True}).content
        gaps = _events(chat) - 1
        upstream.push({"content": "a streamed answer", "reasoning": "r"})
        responses = c.post("/responses", json={"model": OPENAI_MODEL, "input": "hi",
                                               "stream": True}).content
        gaps += _events(responses) - 1
        upstream.push({"content": "a streamed answer", "tool_calls": [CALL]})
        messages = c.post("/messages", json={"model": ANTHROPIC_MODEL, "max_tokens": 64,
                                             "stream": True, "messages": ask["messages"]}
                          ).content
        gaps += _events(messages) - 1
        assert _events(chat) > 10 and _events(responses) > 10 and _events(messages) > 10
        assert upstream.pauses.of("between_events") == [LATENCY.between_events] * gaps
        assert upstream.pauses.of("first_byte") == [LATENCY.first_byte] * 4

        started = time.monotonic()
        counted = c.post("/messages/count_tokens", json={"model": ANTHROPIC_MODEL,
                                                         "messages": ask["messages"]})
        count_took = time.monotonic() - started
        assert counted.json()["input_tokens"] > 0
        assert upstream.pauses.of("count_tokens") == [LATENCY.count_tokens]
        assert upstream.pauses.of("summary") == [LATENCY.summary]
    # the waits are real (a lower bound holds however loaded the machine)
    assert json_took >= LATENCY.first_byte and summary_took >= LATENCY.summary
    assert count_took >= LATENCY.count_tokens


def test_a_replys_own_delay_and_reset_override_the_latency(upstream: ScriptedUpstream
                                                           ) -> None:
    """Bug class: an override that does not override (a reply's ``delay`` ignored when a
    latency is set, a reset that keeps a test's latency for the next test). Planted: reset()
    left ``latency`` alone; second: ``delay`` read only when the latency is zero."""
    upstream.latency = LATENCY
    upstream.push({"content": "quick", "delay": 0.0029})
    with httpx.Client(base_url=upstream.url, timeout=30) as c:
        c.post("/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert upstream.pauses.of("first_byte") == [0.0029]
        upstream.delay = 0.0057  # the old spelling sets first_byte alone
        assert upstream.latency == Latency(0.0057, LATENCY.between_events, LATENCY.summary,
                                           LATENCY.count_tokens)
        upstream.reset()
        assert upstream.latency == Latency() and upstream.pauses.of("first_byte") == []
        c.post("/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert upstream.pauses.of("first_byte") == []


@pytest.mark.parametrize("field", ["first_byte", "between_events", "summary", "count_tokens"])
def test_a_latency_is_seconds_not_below_zero(field: str) -> None:
    """Bug class: a setting taken unchecked. Planted: the check skipped; second: only
    first_byte checked."""
    with pytest.raises(ValueError, match=field):
        Latency(**{field: -0.001})
    assert orjson.dumps(Latency(**{field: 0.5}).__dict__)
