"""Models' context windows: the table by family, what it only guesses, and what an upstream's
overflow error says (pure), then through the proxy with the anthropic SDK.

The bug class: *a limit the proxy guessed is enforced as if it knew it.* Claude Code 2.1.332
asks for ``claude-opus-5-5`` with ``max_tokens: 128000``; the proxy assumed a 128,000-token
window, reserved all of it for the answer and refused every request. Planted to see these
tests red: the guess enforced (a refusal past the guessed budget), the request's reserve
taken whole for a guessed window (every request refused), a snapshot's suffix read as a
later model (``claude-haiku-4-5-20251001`` a guess), the learned limit not used by the next
request (a second overflow upstream), the learned limit kept in the process only (the second
replica overflows too), the overflow's limit read from the tokens the prompt had (Anthropic's
first number). The 1M window (Anthropic's ``context-1m`` beta): red with the header not
read, the 1M window given to every Claude model asked, the 1M window given unasked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from runloop_proxy.config import Policy, TenantSpec
from runloop_proxy.scripted import ScriptedUpstream
from runloop_proxy.window.forms import Budget
from runloop_proxy.windows import (
    ModelWindow,
    asks_long_context,
    lookup,
    overflow_limit,
    window_name,
)

from .keys import anthropic_key, openai_project_key
from .test_metrics import metric_sum

KEY = anthropic_key(5)


@pytest.mark.parametrize(("model", "tokens", "known"), [
    ("claude-opus-4-6", 200_000, True),
    ("claude-sonnet-4-5-20250929", 200_000, True),
    ("claude-haiku-4-5-20251001", 200_000, True),
    ("claude-sonnet-4-6[1m]", 1_000_000, True),  # Claude Code's spelling of the 1M beta
    ("claude-haiku-4-5[1m]", 200_000, True),  # the suffix where the beta is not offered
    ("claude-3-5-sonnet-20241022", 200_000, True),
    ("claude-3-7-sonnet-latest", 200_000, True),
    ("claude-opus-4-1-20250805", 200_000, True),
    ("anthropic/claude-sonnet-4", 200_000, True),  # a gateway's name
    ("claude-2.1", 200_000, True),
    ("claude-opus-5-5", 1_000_000, True),  # 1M without asking (Claude Code's catalog)
    ("claude-opus-4-8", 1_000_000, True),
    ("claude-opus-5-7", 1_000_000, False),  # a later model of a 1M family: a guess
    ("claude-opus-6", 200_000, False),  # a later model of the family: a guess
    ("claude-fable-5-2", 200_000, False),
    ("gpt-4o-2024-08-06", 128_000, True),
    ("gpt-4.1-mini-2025-04-14", 1_047_576, True),
    ("gpt-4-turbo-2024-04-09", 128_000, True),
    ("gpt-4-0613", 8_192, True),
    ("gpt-5", 400_000, True),
    ("gpt-5-mini-2025-08-07", 400_000, True),
    ("gpt-5-codex", 400_000, True),
    ("gpt-5-chat-latest", 128_000, True),
    ("gpt-5.1", 400_000, True),
    ("gpt-5.7", 400_000, False),
    ("gpt-7", 128_000, False),
    ("o1", 200_000, True),
    ("o1-mini-2024-09-12", 128_000, True),
    ("o3-pro", 200_000, True),
    ("o3-mini-high", 200_000, True),
    ("o4-mini-2025-04-16", 200_000, True),
    ("o5", 200_000, False),
    ("deepseek-chat", 128_000, True),
])
def test_the_table_by_family(model: str, tokens: int, known: bool) -> None:
    found = lookup(model)
    assert found is not None and (found.tokens, found.known) == (tokens, known), found


@pytest.mark.parametrize("model", ["llama3.1:8b", "qwen2.5-coder-32b", "mistral-large",
                                   "omni-moderation-latest", "someones-local-model"])
def test_a_name_of_no_family_is_not_in_the_table(model: str) -> None:
    assert lookup(model) is None
    tenant = TenantSpec(name="t")
    assert tenant.window_of(model) == ModelWindow(128_000, False, "default")
    # the operator's default is the operator's word: known
    assert TenantSpec(name="t", default_context_window=32_768).window_of(model) == \
        ModelWindow(32_768, True, "config")


@pytest.mark.parametrize(("model", "tokens", "known"), [
    ("claude-sonnet-4-6", 1_000_000, True),
    ("claude-sonnet-4-5-20250929", 1_000_000, True),
    ("claude-sonnet-4-20250514", 1_000_000, True),
    ("claude-3-7-sonnet-latest", 1_000_000, True),
    ("claude-opus-4-6", 1_000_000, True),
    ("claude-sonnet-4-9", 1_000_000, False),  # a later Sonnet 4: the family's, as a guess
    ("claude-opus-4-5-20251101", 200_000, True),  # no 1M beta for these
    ("claude-opus-4-1-20250805", 200_000, True),
    ("claude-haiku-4-5-20251001", 200_000, True),
    ("claude-opus-5-5", 1_000_000, True),  # 1M asked or not
    ("gpt-4o-2024-08-06", 128_000, True),  # the header means nothing to other families
])
def test_a_request_that_asks_for_the_1m_window_has_it_where_the_model_offers_it(
        model: str, tokens: int, known: bool) -> None:
    """The 1M window is the request's to ask for (the ``context-1m`` beta): the models
    offering it have it then, and 200k otherwise; the rest keep their window whatever the
    header says. Red with the flag not read (every Sonnet 4 at 200k asked or not) and with
    the 1M window given to every Claude model asked (Opus 4.5 at 1M)."""
    found = lookup(model, long_context=True)
    assert found is not None and (found.tokens, found.known) == (tokens, known), found
    assert TenantSpec(name="t").window_of(model, True) == found
    unasked = lookup(model)
    assert unasked is not None
    assert unasked.tokens == (tokens if model.startswith(("claude-opus-5", "gpt-"))
                              or tokens == 200_000 else 200_000)


@pytest.mark.parametrize(("values", "asked"), [
    (["context-1m-2025-08-07"], True),
    (["claude-code-20250219,interleaved-thinking-2025-05-14,context-1m-2025-08-07"], True),
    (["oauth-2025-04-20", " Context-1M-2025-08-07 "], True),  # a header per beta, spaced
    (["context-1m"], True),
    (["interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14"], False),
    (["context-1mx-2025-08-07", "no-context-1m-2025-08-07"], False),
    ([], False),
])
def test_the_beta_that_asks_for_the_1m_window(values: list[str], asked: bool) -> None:
    assert asks_long_context(values) is asked


def test_a_limit_learned_for_the_1m_window_is_kept_apart_from_the_models_other() -> None:
    """An overflow under the 1M beta says nothing of the 200k window, nor the other way:
    each is remembered under its own name. Red with both learned under the model's name (a
    1M request compressed to the 200k an unasked one learned)."""
    assert window_name("claude-sonnet-4-6", True) == "claude-sonnet-4-6[1m]"
    assert window_name("claude-sonnet-4-6", False) == "claude-sonnet-4-6"
    assert window_name("claude-sonnet-4-6[1m]", True) == "claude-sonnet-4-6[1m]"


@given(st.integers(1, 2_000_000), st.integers(1_000, 2_000_000), st.integers(0, 60_000))
def test_a_guessed_window_leaves_room_for_messages_whatever_the_reserve(
        reserve: int, context: int, tools: int) -> None:
    """Whatever ``max_tokens`` a request asks for, a guessed window keeps three quarters of
    itself (less margin and tools) for the messages; a known one honours the reserve."""
    policy = Policy()
    guessed = Budget.for_request(policy, context, reserve, tools, known=False)
    assert guessed.reserve <= context // 4 and not guessed.known
    margin = min(policy.safety_margin_tokens, context // 16)
    assert guessed.hard == max(context - min(reserve, context // 4) - margin - tools - 3, 0)
    known = Budget.for_request(policy, context, reserve, tools)
    assert known.reserve == reserve and known.known


@pytest.mark.parametrize(("status", "body", "limit"), [
    (400, b'{"type":"error","error":{"type":"invalid_request_error","message":"prompt is '
          b'too long: 213456 tokens > 200000 maximum"}}', 200_000),
    (400, b'{"type":"error","error":{"type":"invalid_request_error","message":"input length'
          b' and `max_tokens` exceed context limit: 188240 + 21333 > 200000, decrease input '
          b'length or `max_tokens` and try again"}}', 200_000),
    (400, b'{"error":{"message":"This model\'s maximum context length is 128000 tokens. '
          b'However, your messages resulted in 130412 tokens. Please reduce the length of the'
          b' messages.","type":"invalid_request_error","param":"messages","code":'
          b'"context_length_exceeded"}}', 128_000),
    (400, b'{"object":"error","message":"This model\'s maximum context length is 32768 '
          b'tokens. However, you requested 33000 tokens (32000 in the messages, 1000 in the '
          b'completion).","type":"BadRequestError","param":null,"code":400}', 32_768),  # vLLM
    (400, b'{"error":{"code":400,"message":"the request exceeds the available context size,'
          b' try increasing it","type":"exceed_context_size_error","n_prompt_tokens":5000,'
          b'"n_ctx":4096}}', 4_096),  # llama.cpp
    (400, b'{"object":"error","message":"Prompt contains 40000 tokens and 0 draft tokens, '
          b'too large for model with 32768 maximum context length","type":"invalid_request_'
          b'error"}', 32_768),  # Mistral
    (400, b'[{"error":{"code":400,"message":"The input token count (1200000) exceeds the '
          b'maximum number of tokens allowed (1048576).","status":"INVALID_ARGUMENT"}}]',
     1_048_576),  # Gemini's OpenAI-compatible API
    (413, b'{"error":{"message":"Request exceeds the context window of 8192 tokens",'
          b'"code":"context_length_exceeded"}}', 8_192),  # a gateway's own words
    (400, b'{"error":{"message":"Trying to keep the first 9000 tokens when context the '
          b'overflows. However, the model is loaded with context length of only 4096 tokens'
          b'"}}', 4_096),  # LM Studio
])
def test_an_overflow_error_names_the_window(status: int, body: bytes, limit: int) -> None:
    assert overflow_limit(status, body) == limit


@pytest.mark.parametrize(("status", "body"), [
    (400, b'{"error":{"message":"max_tokens: 128000 > 64000, which is the maximum allowed '
          b'number of output tokens for claude-sonnet-4-6"}}'),
    (429, b'{"error":{"message":"prompt is too long: 213456 tokens > 200000 maximum"}}'),
    (400, b'{"error":{"message":"maximum context length is 12 tokens"}}'),  # no window
    (400, b'{"error":{"message":"messages: roles must alternate"}}'),
])
def test_what_is_not_an_overflow(status: int, body: bytes) -> None:
    assert overflow_limit(status, body) is None


# -- through the proxy ---------------------------------------------------------------------

NEW_MODEL = "claude-opus-6"  # a later model than the table knows
LIMIT = 41_000  # the scripted model's real window: what the upstream's error says
ADMIN = "admin-" + "9b2f" * 8


def _turns(n: int) -> list[dict[str, Any]]:
    """A session of ``n`` tool steps with results of ~2,300 tokens each."""
    turns: list[dict[str, Any]] = [{"role": "user", "content": "find the failing job"}]
    for k in range(n):
        turns.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": f"toolu_01W{k:03d}", "name": "Bash",
             "input": {"command": f"cat build-{k}.log"}}]})
        turns.append({"role": "user", "content": [{
            "type": "tool_result", "tool_use_id": f"toolu_01W{k:03d}",
            "content": "\n".join(f"build {k} step {i}: compiled module_{i}.o in {i % 7}.{i}s"
                                 for i in range(160))}]})
    return turns


BASH = {"name": "Bash", "description": "Run a command.", "input_schema": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


def _overflowing(upstream: ScriptedUpstream) -> Any:
    """The upstream as Anthropic answers a prompt past the model's window."""
    def respond(body: dict[str, Any]) -> dict[str, Any]:
        n = upstream.anthropic.tokens(body)
        if n > LIMIT:
            return {"status": 400, "body": {"type": "error", "error": {
                "type": "invalid_request_error",
                "message": f"prompt is too long: {n} tokens > {LIMIT} maximum"}}}
        return {"content": f"answered {n} tokens"}
    return respond


def agent_proxy(tmp_path: Path, make_proxy: Any, upstream: ScriptedUpstream,
                **kw: Any) -> Any:
    """A tenant as Claude Code's users run one: an Anthropic upstream, a working budget of
    150,000 tokens (the window, not cost, bounds it)."""
    cfg = tmp_path / "cfg"
    (cfg / "tenants").mkdir(parents=True, exist_ok=True)
    (cfg / "runloop.toml").write_text(
        f'[upstreams.claude]\nurl = "{upstream.url}"\nformat = "anthropic"\n'
        f'api_key = "{anthropic_key(6)}"\n')
    (cfg / "tenants" / "dev.toml").write_text(
        f'keys = ["{KEY}"]\nupstream = "claude"\n[policy]\nsoft_budget_tokens = 150000\n')
    return make_proxy(config_dir=str(cfg), **kw)


def ask(client: anthropic.Anthropic, **kw: Any) -> Any:
    """A request as Claude Code makes it: streamed (the SDK wants that for 128k outputs)."""
    with client.messages.stream(**kw) as stream:
        return stream.get_final_message()


def test_a_model_the_proxy_does_not_know_is_never_refused(
        make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """``claude-opus-6`` with ``max_tokens`` 128,000: a short request and one past the
    guessed budget (200,000 less a quarter) both reach the upstream and are answered; the
    reserve goes upstream as the client asked."""
    proxy = agent_proxy(tmp_path, make_proxy, upstream)
    client = anthropic.Anthropic(base_url=proxy.base, api_key=KEY, max_retries=0)
    short = ask(client, model=NEW_MODEL, max_tokens=128_000,
                                   messages=[{"role": "user", "content": "hello"}])
    assert short.content[0].text == "echo: hello"  # type: ignore[union-attr]
    assert upstream.requests[-1]["max_tokens"] == 128_000
    upstream.responder = lambda body: {"content": f"{upstream.anthropic.tokens(body)}"}
    # one message of ~170k tokens: nothing to compress, past 200,000 - 50,000 - margin
    task = " ".join(f"requirement-{i}: keep module_{i} stable" for i in range(24_000))
    answer = ask(client, model=NEW_MODEL, max_tokens=128_000, tools=[BASH],
                 messages=[{"role": "user", "content": task}])
    assert int(answer.content[0].text) > 150_000  # type: ignore[union-attr]
    assert upstream.requests[-1]["max_tokens"] == 128_000
    assert upstream.requests[-1]["messages"][0]["content"] == task


def test_the_upstreams_overflow_is_learned_and_the_request_answered(
        make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """The model's real window is 41,000: the first request over it goes once, comes back
    "prompt is too long", and is built again in the learned window and answered — the
    client never sees the error. The next request goes compressed straight away, and so
    does a second replica's (it reads what the first learned from Redis)."""
    proxy = agent_proxy(tmp_path, make_proxy, upstream)
    upstream.responder = _overflowing(upstream)
    client = anthropic.Anthropic(base_url=proxy.base, api_key=KEY, max_retries=0)
    answer = ask(client, model=NEW_MODEL, max_tokens=128_000, tools=[BASH],
                                    messages=_turns(24))  # ~55k tokens
    first, second = upstream.requests[-2:]
    assert upstream.anthropic.tokens(first) > LIMIT  # the guess: sent whole
    assert upstream.anthropic.tokens(second) <= LIMIT - 41_000 // 4
    assert answer.content[0].text == \
        f"answered {upstream.anthropic.tokens(second)} tokens"  # type: ignore[union-attr]
    assert len(upstream.requests) == 2
    ask(client, model=NEW_MODEL, max_tokens=128_000, tools=[BASH],
                           messages=_turns(26))
    assert len(upstream.requests) == 3  # learned: no second overflow
    assert upstream.anthropic.tokens(upstream.requests[-1]) <= LIMIT
    replica = agent_proxy(tmp_path, make_proxy, upstream,
                          store={"key_prefix": proxy.state.config.store.key_prefix})
    other = anthropic.Anthropic(base_url=replica.base, api_key=KEY, max_retries=0)
    ask(other, model=NEW_MODEL, max_tokens=128_000, tools=[BASH],
                          messages=_turns(25))
    assert len(upstream.requests) == 4
    assert upstream.anthropic.tokens(upstream.requests[-1]) <= LIMIT


def test_a_request_resent_in_a_learned_window_counts_its_steps_once(
        make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """A session past the guessed budget is compacted for it, overflows the real window and
    is built again in the learned one: what the metrics and the session's records count is
    the window that went and was answered — as much as a proxy that knew the window already
    counts for the same request — not that plus the refused one. Red with the first
    window's steps counted too (the metric and the records: 17 against 15)."""
    upstream.responder = _overflowing(upstream)

    def steps(proxy: Any) -> tuple[float, list[tuple[str, int]]]:
        """The compaction events counted while the request is served, and the steps the
        session's records keep."""
        client = anthropic.Anthropic(base_url=proxy.base, api_key=KEY, max_retries=0)
        before = metric_sum(proxy, "runloop_compaction_events_total")
        ask(client, model=NEW_MODEL, max_tokens=128_000, tools=[BASH], messages=_turns(80),
            extra_headers={"X-Session-Id": "build-triage-2026-12-02"})
        proxy.settle()
        counted = metric_sum(proxy, "runloop_compaction_events_total") - before
        view = httpx.get(f"{proxy.base}/admin/sessions/build-triage-2026-12-02",
                         params={"tenant": "dev"},
                         headers={"Authorization": f"Bearer {ADMIN}"}).json()
        return counted, [(r["kind"], r["at_message"]) for r in view["compression_records"]]

    guessing = agent_proxy(tmp_path, make_proxy, upstream, admin_key=ADMIN)
    resent = steps(guessing)
    assert len(upstream.requests) == 2  # the overflow, then the learned window
    (key,) = list(guessing.state.windows._known.keys())
    knowing = agent_proxy(tmp_path, make_proxy, upstream, admin_key=ADMIN)  # its own Redis keys
    knowing.run(knowing.state.windows.learn(knowing.state.store, *key, LIMIT))
    straight = steps(knowing)
    assert len(upstream.requests) == 3  # built in the window at once
    assert resent == straight and len(straight[1]) == straight[0] > 0, (resent, straight)


def test_an_overflow_with_nothing_new_is_the_upstreams_error(
        make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """An upstream that says the window the proxy already built for is passed through as
    it came (one call, no retry): Anthropic's words reach the SDK."""
    proxy = agent_proxy(tmp_path, make_proxy, upstream)
    upstream.responder = lambda body: {"status": 400, "body": {"type": "error", "error": {
        "type": "invalid_request_error", "message": "prompt is too long: 201234 tokens > "
        "200000 maximum"}}}
    client = anthropic.Anthropic(base_url=proxy.base, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="claude-sonnet-4-6", max_tokens=16_000,
                               messages=[{"role": "user", "content": "hi"}])
    assert "prompt is too long: 201234 tokens > 200000 maximum" in str(caught.value)
    assert len(upstream.requests) == 1


def test_an_openai_models_overflow_is_learned_too(
        make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """The same through chat completions and the openai SDK, in OpenAI's words, for a
    model of no family (a local server's)."""
    proxy = make_proxy()
    limit = 4_000

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        n = sum(len(str(m.get("content", ""))) for m in body["messages"]) // 4
        if n > limit:
            return {"status": 400, "body": {"error": {
                "message": f"This model's maximum context length is {limit} tokens. However,"
                           f" your messages resulted in {n} tokens.",
                "type": "invalid_request_error", "param": "messages",
                "code": "context_length_exceeded"}}}
        return {"content": f"fits: {n}"}
    upstream.responder = respond
    client = openai.OpenAI(base_url=proxy.url, api_key=openai_project_key(3), max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "summarise the logs"}]
    for k in range(8):
        messages += [{"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{k:02d}Xq", "type": "function",
            "function": {"name": "read", "arguments": f'{{"path": "log{k}.txt"}}'}}]},
            {"role": "tool", "tool_call_id": f"call_{k:02d}Xq",
             "content": "\n".join(f"log {k} line {i}: ok" for i in range(300))}]
    reply = client.chat.completions.create(model="qwen2.5-coder-32b-instruct",
                                           messages=messages, tools=[{
                                               "type": "function", "function": {
                                                   "name": "read", "parameters": {
                                                       "type": "object", "properties": {}}}}])
    assert reply.choices[0].message.content.startswith("fits: ")  # type: ignore[union-attr]
    assert len(upstream.requests) == 2
    httpx.get(proxy.base + "/healthz")


LONG_BETA = "context-1m-2025-08-07"


def test_claude_codes_1m_beta_gives_the_request_the_1m_window(
        make_proxy: Any, upstream: ScriptedUpstream, tmp_path: Path) -> None:
    """Claude Code asks for Sonnet 4.6's 1M window with the ``context-1m`` beta (a model
    chosen as ``claude-sonnet-4-6[1m]``). A session of ~230k tokens, under a working budget
    above both windows: with the beta it goes whole (and the beta with it), without it the
    proxy makes it fit 200k. Red with the header not read (compressed to 200k though asked
    for 1M) and with the beta's window given whatever the request asks (sent whole to a
    200k window)."""
    cfg = tmp_path / "cfg"
    (cfg / "tenants").mkdir(parents=True)
    (cfg / "runloop.toml").write_text(
        f'[upstreams.claude]\nurl = "{upstream.url}"\nformat = "anthropic"\n'
        f'api_key = "{anthropic_key(6)}"\n')
    (cfg / "tenants" / "dev.toml").write_text(
        f'keys = ["{KEY}"]\nupstream = "claude"\n[policy]\nsoft_budget_tokens = 900000\n')
    proxy = make_proxy(config_dir=str(cfg))
    client = anthropic.Anthropic(base_url=proxy.base, api_key=KEY, max_retries=0)
    turns = _turns(75)
    sent = upstream.anthropic.tokens({"messages": turns, "tools": [BASH]})
    assert 210_000 < sent < 900_000
    upstream.responder = lambda body: {"content": f"{upstream.anthropic.tokens(body)}"}
    asked = ask(client, model="claude-sonnet-4-6", max_tokens=32_000, tools=[BASH],
                messages=turns, extra_headers={"anthropic-beta": f"interleaved-thinking-"
                                                                 f"2025-05-14,{LONG_BETA}"})
    assert upstream.requests[-1]["messages"] == turns  # whole: it fits 1M
    assert LONG_BETA in upstream.headers[-1]["anthropic-beta"]
    assert int(asked.content[0].text) > 200_000  # type: ignore[union-attr]
    unasked = ask(client, model="claude-sonnet-4-6", max_tokens=32_000, tools=[BASH],
                  messages=turns)
    assert "anthropic-beta" not in upstream.headers[-1]
    assert int(unasked.content[0].text) < 200_000 - 32_000  # type: ignore[union-attr]
    assert len(upstream.requests) == 2  # neither was refused, nor sent twice
